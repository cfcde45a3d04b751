"""The compiled replay tier: AOTInductor over the captured program, cached on disk."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import accel  # noqa: E402
from accel.graph import Graph, compile_graph, graph, make_graphed_callables  # noqa: E402


class _Tiny(nn.Module):
    """Small, and with an op returning a list of tensors (chunk -> split)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, value = self.a(x).chunk(2, dim=-1)
        return self.b(torch.sigmoid(gate) * value)


def _tiny() -> nn.Module:
    torch.manual_seed(1)
    return _Tiny().eval()


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("graph-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("ACCEL_GRAPH_CACHE", str(path))
        yield path


def _capture(model: nn.Module, x: torch.Tensor) -> tuple[Graph, torch.Tensor]:
    g = Graph()
    with graph(g):
        y = model(x)
    return g, y


def test_compiled_replay_matches_eager_and_the_build_is_cached(cache: Path) -> None:
    model, x = _tiny(), torch.randn(2, 8)
    g, y = _capture(model, x)
    first = compile_graph(g, inputs=[x], outputs=[y])
    assert first.built and first.path.parent == cache and first.path.exists()
    for _ in range(2):
        new = torch.randn(2, 8)
        x.copy_(new)
        g.replay()
        with torch.no_grad():
            torch.testing.assert_close(y, model(new))
    # The same program again (another capture, same weights): loaded, not built.
    g2, y2 = _capture(model, x)
    again = compile_graph(g2, inputs=[x], outputs=[y2])
    assert not again.built and again.key == first.key


def test_make_graphed_callables_compiled_tier(cache: Path) -> None:
    model = _tiny()
    fast = make_graphed_callables(model, (torch.randn(2, 8),), tier="compiled")
    new = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(fast(new), model(new))
    (entry,) = fast._cache.values()
    assert entry.graph.program.compiled is not None


def test_changed_weights_change_the_cache_key(cache: Path) -> None:
    model, x = _tiny(), torch.randn(2, 8)
    with torch.no_grad():
        model.a.weight.add_(1.0)
    g, y = _capture(model, x)
    from accel.graph._compiled import _cache_key, _to_fx

    base_model = _tiny()
    g0, y0 = _capture(base_model, x)
    k1 = _cache_key(_to_fx(g.program, [x], [y]), [x])
    k0 = _cache_key(_to_fx(g0.program, [x], [y0]), [x])
    assert k0 != k1


def test_graphs_the_compiled_tier_cannot_take_are_refused(cache: Path) -> None:
    empty = Graph()
    with graph(empty):
        accel.current_stream().launch_host_func(lambda: None)
    with pytest.raises(accel.NotSupportedError, match="no torch ops"):
        compile_graph(empty, inputs=[], outputs=[torch.ones(1)])

    x = torch.zeros(4)
    split = Graph()
    with graph(split):
        a = x + 1
        accel.current_stream().launch_host_func(lambda: None)
        b = a * 2
    with pytest.raises(accel.NotSupportedError, match="one piece"):
        compile_graph(split, inputs=[x], outputs=[b])

    state = torch.zeros(4)
    writes = Graph()
    writes.register_inputs(state)
    with graph(writes):
        state.add_(x)
    with pytest.raises(accel.NotSupportedError, match="writes to an input"):
        compile_graph(writes, inputs=[x], outputs=[state])

    g, y = _capture(_tiny(), torch.randn(2, 8))
    with pytest.raises(accel.InvalidValueError, match="at least one output"):
        compile_graph(g, inputs=[], outputs=[])
    with pytest.raises(accel.InvalidValueError, match="not produced"):
        compile_graph(g, inputs=[], outputs=[torch.ones(2)])
