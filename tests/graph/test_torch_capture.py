"""Host-backend capture of torch ops: bitwise replay of real models, no allocation
on replay, and refusal of what a replay would get wrong."""

from __future__ import annotations

from collections.abc import Callable

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

import accel  # noqa: E402
import accel.memory  # noqa: E402
from accel.graph import Graph, graph, is_capturing  # noqa: E402


def _mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    return model.eval(), (torch.randn(8, 32),)


def _transformer() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return layer.eval(), (torch.randn(2, 5, 32),)


def _cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 5),
    ).eval()
    with torch.no_grad():  # non-trivial running statistics
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(2, 3, 8, 8),)


def _gru_step() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return nn.GRU(16, 24, batch_first=True).eval(), (torch.randn(3, 1, 16), torch.randn(1, 3, 24))


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "mlp": _mlp, "transformer": _transformer, "cnn_batchnorm": _cnn, "gru_step": _gru_step,
}


def _allocations() -> int:
    return int(accel.memory.memory_stats()["allocation.all.allocated"])


@pytest.mark.parametrize("name", sorted(MODELS))
def test_replay_is_bitwise_eager_and_allocates_nothing(name: str) -> None:
    torch.manual_seed(0)
    model, sample = MODELS[name]()
    static = [t.clone() for t in sample]
    with torch.no_grad():
        model(*static)  # warm-up, as before any capture
    g = Graph()
    before = _allocations()
    with graph(g):
        out = model(*static)
    assert _allocations() > before  # the static outputs came from the allocator...
    outs = tree_flatten(out)[0]
    addresses = [t.data_ptr() for t in outs]
    pool_buffers = [(b.ptr, b.ptr + b.nbytes) for b in g.program.buffers]
    assert all(any(lo <= a < hi for lo, hi in pool_buffers) for a in addresses)
    allocated = _allocations()
    for _ in range(3):
        new = [torch.randn_like(t) for t in sample]
        for s, n in zip(static, new):
            s.copy_(n)
        g.replay()
        with torch.no_grad():
            expected = tree_flatten(model(*new))[0]
        assert all(torch.equal(a, b) for a, b in zip(outs, expected))
    assert [t.data_ptr() for t in outs] == addresses
    assert _allocations() == allocated  # ...and replays took nothing more
    assert g.program.fallback_ops == []


def test_attention_without_the_fused_fast_path_replays_bitwise() -> None:
    # The unfused path calls scaled_dot_product_attention, which is tagged as
    # random (dropout) but draws nothing with dropout_p=0 in eval mode.
    torch.manual_seed(0)
    layer, (x,) = _transformer()
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        g = Graph()
        with graph(g):
            y = layer(x)
        new = torch.randn_like(x)
        x.copy_(new)
        g.replay()
        with torch.no_grad():
            assert torch.equal(y, layer(new))
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)
    assert any("scaled_dot_product" in str(r.func) for r in g.program.records)


def test_replay_on_a_created_stream_runs_there() -> None:
    model, (x,) = _mlp()
    g = Graph()
    with graph(g):
        y = model(x)
    new = torch.randn_like(x)
    x.copy_(new)
    s = accel.Stream()
    with s:
        g.replay()
    s.synchronize()
    with torch.no_grad():
        assert torch.equal(y, model(new))


def test_torch_ops_and_stream_copies_replay_in_recorded_order() -> None:
    x, src = torch.zeros(16), torch.full((16,), 3.0)
    g = Graph()
    with graph(g):
        before = x * 2
        accel.current_stream().copy(x.data_ptr(), src.data_ptr(), 64)
        after = x + 1
    assert len(g.program.segments) == 2
    x.fill_(1.0)
    g.replay()
    assert torch.equal(before, torch.full((16,), 2.0))  # read x before the copy
    assert torch.equal(after, torch.full((16,), 4.0))  # and after it


def test_in_place_ops_on_graph_tensors_and_registered_inputs_replay() -> None:
    state, x = torch.zeros(4), torch.ones(4)
    g = Graph()
    g.register_inputs(state)
    with graph(g):
        y = x * 2
        y.add_(1)
        state.add_(y)  # a running accumulator the user asked for
    g.replay()
    g.replay()
    assert torch.equal(y, torch.full((4,), 3.0))
    assert torch.equal(state, torch.full((4,), 6.0))  # two replays: the capture ran nothing


def _assert_clean(g: Graph) -> None:
    assert not is_capturing()
    assert _get_current_dispatch_mode_stack() == []
    with pytest.raises(accel.CaptureError, match="no captured graph"):
        g.replay()
    # The next capture works.
    x = torch.ones(3)
    with graph(g):
        y = x + 1
    x.fill_(5.0)
    g.replay()
    assert torch.equal(y, torch.full((3,), 6.0))
    assert torch.is_grad_enabled()


REFUSED: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "item": (lambda x: x.sum().item(), "_local_scalar_dense.*reads tensor values"),
    "branch": (lambda x: x.sum() > 0 and x, "reads tensor values on the host"),
    "nonzero": (lambda x: torch.nonzero(x), "nonzero.*reads tensor values"),
    "rand": (lambda x: torch.rand(3), "random"),
    "dropout_train": (lambda x: nn.functional.dropout(x, 0.5, training=True), "random"),
    "external_in_place": (lambda x: x.add_(1), "writes in place to a tensor.*register_inputs"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_ops_are_refused_and_leave_no_capture_state(case: str) -> None:
    fn, message = REFUSED[case]
    x = torch.ones(3)
    g = Graph()
    with pytest.raises(accel.CaptureError, match=message):
        with graph(g):
            fn(x)
    _assert_clean(g)


def test_refusal_with_explicit_capture_calls_cleans_up_too() -> None:
    x, g = torch.ones(3), Graph()
    s = accel.Stream()
    with s:
        g.capture_begin()
        y = x * 2
        with pytest.raises(accel.CaptureError, match="random"):
            torch.randn(2)
        with pytest.raises(accel.CaptureError, match="not capturing"):
            g.capture_end()  # nothing left to end
        assert torch.equal(y, torch.zeros(3))  # recorded, never run
    _assert_clean(g)


def test_refused_op_message_names_the_op() -> None:
    g = Graph()
    with pytest.raises(accel.CaptureError, match=r"cannot capture aten\.bernoulli"):
        with graph(g):
            torch.bernoulli(torch.full((3,), 0.5))


def test_debug_dump_lists_the_recorded_ops(tmp_path) -> None:
    model, (x,) = _mlp()
    g = Graph(keep_graph=True)
    with graph(g):
        model(x)
    path = tmp_path / "dump.txt"
    g.debug_dump(str(path))
    text = path.read_text()
    assert "host function" in text and "aten.addmm.default" in text and "torch program" in text


def test_capture_turns_autograd_off_and_restores_it() -> None:
    model, (x,) = _mlp()
    g = Graph()
    with graph(g):
        assert not torch.is_grad_enabled()
        y = model(x)
    assert torch.is_grad_enabled() and not y.requires_grad


def _pool_segments(pool: tuple[int, int]) -> int:
    return sum(1 for s in accel.memory.memory_snapshot() if tuple(s["segment_pool_id"]) == pool)


def test_static_tensors_live_in_the_graph_pool_until_graph_and_tensors_are_gone() -> None:
    x, lin = torch.randn(4, 8), nn.Linear(8, 8)
    g = Graph()
    with graph(g):
        y = lin(x)
    pool = g.pool()
    assert _pool_segments(pool) >= 1
    g.reset()
    accel.memory.empty_cache()
    expected = y.clone()
    assert torch.equal(y, expected) and _pool_segments(pool) >= 1  # y still holds its memory
    del y
    accel.memory.empty_cache()
    assert _pool_segments(pool) == 0


def test_an_op_failing_during_replay_is_raised_by_replay() -> None:
    x = torch.ones(3)
    g = Graph()
    with graph(g):
        y = x * 2
    (segment,) = g.program.segments

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("kernel failed")

    original = segment.steps[0]
    _, args, kwargs, _ = original
    segment.steps[0] = (broken, args, kwargs, "aten.mul.out")
    with pytest.raises(accel.HostFunctionError, match=r"aten\.mul\.out.*kernel failed"):
        g.replay()
    s = accel.Stream()  # asynchronous replay: raised by the next replay
    with s:
        g.replay()
    s.synchronize()
    segment.steps[0] = original
    with pytest.raises(accel.HostFunctionError, match="kernel failed"):
        g.replay()
    g.replay()  # reported once, then replays go on
    assert torch.equal(y, torch.full((3,), 2.0))


def test_zero_element_results_made_in_the_graph_can_be_written_in_place() -> None:
    x = torch.randn(4)
    g = accel.Graph()
    with accel.graph(g):
        z = x[:0] * 2
        z.add_(1)
    g.replay()
    accel.synchronize()
    assert z.numel() == 0
