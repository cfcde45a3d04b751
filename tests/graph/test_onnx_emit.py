"""accel's own ONNX emitter (the ``onnxruntime-fx`` engine): each aten op it maps,
run by ONNX Runtime on new inputs against eager; what it refuses; and the engine
serving a graph first, falling back to the exporter, keyed by the emitter's version."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnx")
import torch.nn.functional as F  # noqa: E402

import accel  # noqa: E402
from accel.graph import Graph, compile_graph, graph, make_graphed_callables  # noqa: E402
from accel.graph import _compiled, _engines, _onnx_emit  # noqa: E402
from accel.graph._compiled import BuildWarning  # noqa: E402

aten = torch.ops.aten
# Builds not in the disk cache say so; these tests build on purpose.
pytestmark = pytest.mark.filterwarnings("ignore::accel.graph._compiled.BuildWarning")


@pytest.fixture(autouse=True)
def _inference() -> Iterator[None]:
    with torch.no_grad():
        yield


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("ACCEL_GRAPH_CACHE", str(tmp_path))
    return tmp_path


def _r(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randn(*shape)


def _pos(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.rand(*shape) + 0.5


def _ints(high: int, *shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.randint(0, high, shape)


def _mask(*shape: int) -> Callable[[], torch.Tensor]:
    return lambda: torch.rand(*shape) > 0.3


def _fresh(x: torch.Tensor) -> torch.Tensor:
    """A tensor the program makes (in-place ops may not write its inputs)."""
    return x * 1.0


_W = torch.randn(6, 4)
_B = torch.randn(6)
_CONV = torch.randn(6, 2, 3, 3)
_CONV1 = torch.randn(4, 3, 3)
_EMB = torch.randn(10, 4)
_LN = (torch.randn(4), torch.randn(4))
_EMPTY = torch.empty(0)
_BN = (torch.randn(3), torch.randn(3), torch.randn(3), torch.rand(3) + 0.5)

# (id, program, input makers): every op the emitter maps is run by at least one
# (test_every_mapped_op_is_exercised), on arguments that differ from the defaults.
CASES: list[tuple[str, Callable[..., Any], list[Callable[[], torch.Tensor]]]] = [
    ("relu", torch.relu, [_r(3, 4)]),
    ("relu_", lambda x: _fresh(x).relu_(), [_r(3, 4)]),
    ("tanh", torch.tanh, [_r(3, 4)]),
    ("tanh_", lambda x: _fresh(x).tanh_(), [_r(3, 4)]),
    ("sigmoid", torch.sigmoid, [_r(3, 4)]),
    ("sigmoid_", lambda x: _fresh(x).sigmoid_(), [_r(3, 4)]),
    ("exp", torch.exp, [_r(3, 4)]),
    ("exp_", lambda x: _fresh(x).exp_(), [_r(3, 4)]),
    ("log", torch.log, [_pos(3, 4)]),
    ("sqrt", torch.sqrt, [_pos(3, 4)]),
    ("sqrt_", lambda x: _fresh(x).sqrt_(), [_pos(3, 4)]),
    ("rsqrt", torch.rsqrt, [_pos(3, 4)]),
    ("neg", torch.neg, [_r(3, 4)]),
    ("neg_", lambda x: _fresh(x).neg_(), [_r(3, 4)]),
    ("abs", torch.abs, [_r(3, 4)]),
    ("abs_", lambda x: _fresh(x).abs_(), [_r(3, 4)]),
    ("erf", torch.erf, [_r(3, 4)]),
    ("reciprocal", torch.reciprocal, [_pos(3, 4)]),
    ("silu", F.silu, [_r(3, 4)]),
    ("silu_", lambda x: F.silu(_fresh(x), inplace=True), [_r(3, 4)]),
    ("gelu", F.gelu, [_r(3, 4)]),
    ("gelu tanh", lambda x: F.gelu(x, approximate="tanh"), [_r(3, 4)]),
    ("gelu_", lambda x: aten.gelu_(_fresh(x)), [_r(3, 4)]),
    ("hardtanh", lambda x: F.hardtanh(x, -0.5, 0.7), [_r(3, 4)]),
    ("hardtanh_", lambda x: F.hardtanh(_fresh(x), -0.5, 0.7, inplace=True), [_r(3, 4)]),
    ("clamp", lambda x: x.clamp(min=-0.3), [_r(3, 4)]),
    ("clamp_", lambda x: _fresh(x).clamp_(-0.3, 0.4), [_r(3, 4)]),
    ("leaky_relu", lambda x: F.leaky_relu(x, 0.2), [_r(3, 4)]),
    ("leaky_relu_", lambda x: F.leaky_relu(_fresh(x), 0.2, inplace=True), [_r(3, 4)]),
    ("add", lambda x, y: torch.add(x, y, alpha=2.5), [_r(3, 4), _r(4)]),
    ("add int and float", lambda x, y: x + y, [_ints(5, 3, 4), _r(3, 4)]),
    ("add number", lambda x: x + 2, [_r(3, 4)]),
    ("add.Scalar", lambda x: aten.add.Scalar(x, 2, alpha=3), [_r(3, 4)]),
    ("add_", lambda x, y: _fresh(x).add_(y, alpha=-1), [_r(3, 4), _r(3, 4)]),
    ("add_.Scalar", lambda x: aten.add_.Scalar(_fresh(x), 1.5), [_r(3, 4)]),
    ("sub", lambda x, y: torch.sub(x, y, alpha=0.5), [_r(3, 4), _r(3, 1)]),
    ("sub.Scalar", lambda x: aten.sub.Scalar(x, 2), [_r(3, 4)]),
    ("sub_", lambda x, y: _fresh(x).sub_(y), [_r(3, 4), _r(4)]),
    ("sub_.Scalar", lambda x: aten.sub_.Scalar(_fresh(x), 2), [_r(3, 4)]),
    ("mul", torch.mul, [_r(3, 4), _r(3, 4)]),
    ("mul.Scalar", lambda x: aten.mul.Scalar(x, 3), [_r(3, 4)]),
    ("mul_", lambda x, y: _fresh(x).mul_(y), [_r(3, 4), _r(3, 4)]),
    ("mul_.Scalar", lambda x: aten.mul_.Scalar(_fresh(x), -2), [_r(3, 4)]),
    ("div", torch.div, [_r(3, 4), _pos(3, 4)]),
    ("div ints", torch.div, [_ints(9, 3, 4), lambda: torch.randint(1, 4, (3, 4))]),
    ("div.Scalar", lambda x: aten.div.Scalar(x, 4), [_r(3, 4)]),
    ("div_", lambda x, y: _fresh(x).div_(y), [_r(3, 4), _pos(3, 4)]),
    ("div_.Scalar", lambda x: aten.div_.Scalar(_fresh(x), 4), [_r(3, 4)]),
    ("rsub", lambda x, y: torch.rsub(x, y, alpha=2), [_r(3, 4), _r(3, 4)]),
    ("rsub.Scalar", lambda x: aten.rsub.Scalar(x, 1.0), [_r(3, 4)]),
    ("pow number", lambda x: x ** 3, [_r(3, 4)]),
    ("pow tensors", torch.pow, [_pos(3, 4), _r(3, 4)]),
    ("maximum", torch.maximum, [_r(3, 4), _r(3, 4)]),
    ("minimum", torch.minimum, [_r(3, 4), _r(4)]),
    ("where", torch.where, [_mask(3, 4), _r(3, 4), _r(3, 4)]),
    ("addmm", lambda x: F.linear(x, _W, _B), [_r(3, 4)]),
    ("addmm alpha beta", lambda b, x: torch.addmm(b, x, _W.t(), alpha=0.5, beta=2.0), [_r(6), _r(3, 4)]),
    ("addmm beta 0", lambda b, x: torch.addmm(b, x, _W.t(), beta=0), [_r(3, 6), _r(3, 4)]),
    ("mm", lambda x, y: x @ y, [_r(3, 4), _r(4, 5)]),
    ("bmm", torch.bmm, [_r(2, 3, 4), _r(2, 4, 5)]),
    ("matmul 3d by 2d", lambda x: x @ _W.t(), [_r(2, 3, 4)]),
    ("baddbmm", lambda b, x, y: torch.baddbmm(b, x, y, beta=0.5, alpha=2.0), [_r(2, 3, 5), _r(2, 3, 4), _r(2, 4, 5)]),
    ("baddbmm beta 0", lambda b, x, y: torch.baddbmm(b, x, y, beta=0), [_r(2, 3, 5), _r(2, 3, 4), _r(2, 4, 5)]),
    ("view", lambda x: (x + 1).view(4, 3), [_r(3, 4)]),
    ("reshape", lambda x: x.t().reshape(12), [_r(3, 4)]),
    ("unsqueeze", lambda x: (x + 1).unsqueeze(-1), [_r(3, 4)]),
    ("unsqueeze_", lambda x: _fresh(x).unsqueeze_(1), [_r(3, 4)]),
    ("squeeze", lambda x: (x + 1).squeeze(), [_r(3, 1, 4, 1)]),
    ("squeeze dim", lambda x: (x + 1).squeeze(1), [_r(3, 1, 4)]),
    ("squeeze dims", lambda x: (x + 1).squeeze((1, 3)), [_r(3, 1, 4, 1)]),
    ("squeeze_", lambda x: _fresh(x).squeeze_(1), [_r(3, 1, 4)]),
    ("alias", lambda x: aten.alias(x) + 1, [_r(3, 4)]),
    ("detach", lambda x: (x + 1).detach(), [_r(3, 4)]),
    ("clone", lambda x: x.t().clone(memory_format=torch.contiguous_format), [_r(3, 4)]),
    ("expand", lambda x: x.expand(2, 3, 4) + 0, [_r(3, 1)]),
    ("t", lambda x: x.t() + 0, [_r(3, 4)]),
    ("t_", lambda x: _fresh(x).t_(), [_r(3, 4)]),
    ("transpose", lambda x: x.transpose(0, -1) + 0, [_r(2, 3, 4)]),
    ("transpose_", lambda x: _fresh(x).transpose_(2, 0), [_r(2, 3, 4)]),
    ("permute", lambda x: x.permute(2, 0, 1) + 0, [_r(2, 3, 4)]),
    ("select", lambda x: x[:, -1] + x[1], [_r(4, 4)]),
    ("slice", lambda x: x[:, 1:3] + x[:, ::2] + x[-3:, -2:], [_r(3, 4)]),
    ("split", lambda x: torch.stack(x.split(2, dim=1)), [_r(3, 4)]),
    ("unsafe_split", lambda x: torch.cat(aten.unsafe_split(x, 3, -1)), [_r(3, 6)]),
    ("split_with_sizes", lambda x: torch.cat(x.split([1, 3], dim=1), 1), [_r(3, 4)]),
    ("unsafe_split_with_sizes", lambda x: torch.cat(aten.unsafe_split_with_sizes(x, [2, 1], 0)[::-1]), [_r(3, 4)]),
    ("unbind", lambda x: torch.cat(x.unbind(1)), [_r(3, 4)]),
    ("cat", lambda x, y: torch.cat([x, y, _EMPTY], dim=-1), [_r(3, 4), _r(3, 2)]),
    ("cat promotes", lambda x, y: torch.cat([x, y]), [_ints(5, 3, 4), _r(3, 4)]),
    ("stack", lambda x, y: torch.stack([x, y], dim=1), [_r(3, 4), _r(3, 4)]),
    ("zeros", lambda x: x + torch.zeros(3, 4), [_r(3, 4)]),
    ("ones", lambda x: x + torch.ones(4, dtype=torch.float64), [_r(3, 4)]),
    ("full", lambda x: x * torch.full((3, 1), 2.5), [_r(3, 4)]),
    ("to", lambda x: x.to(torch.float64) * 2, [_r(3, 4)]),
    ("mean", lambda x: x.mean(dim=(0, 2), keepdim=True), [_r(2, 3, 4)]),
    ("mean all", lambda x: x.mean(dim=[]), [_r(2, 3, 4)]),
    ("sum", lambda x: x.sum(dim=-1), [_r(2, 3, 4)]),
    ("sum ints", lambda x: x.sum(dim=0), [_ints(7, 3, 4)]),
    ("amax", lambda x: x.amax(dim=1, keepdim=True), [_r(2, 3, 4)]),
    ("softmax", lambda x: torch.softmax(x, dim=0), [_r(3, 4)]),
    ("log_softmax", lambda x: F.log_softmax(x, dim=-1), [_r(3, 4)]),
    ("layer_norm", lambda x: F.layer_norm(x, (4,), *_LN, eps=1e-3), [_r(2, 3, 4)]),
    ("layer_norm without weights", lambda x: F.layer_norm(x, (3, 4)), [_r(2, 3, 4)]),
    ("batch_norm", lambda x: F.batch_norm(x, _BN[2], _BN[3], _BN[0], _BN[1], eps=1e-3), [_r(2, 3, 5, 5)]),
    ("batch_norm without weights", lambda x: F.batch_norm(x, _BN[2], _BN[3]), [_r(2, 3, 5)]),
    ("conv2d", lambda x: F.conv2d(x, _CONV, _B, stride=2, padding=1, dilation=1, groups=2), [_r(1, 4, 7, 7)]),
    ("conv2d dilated", lambda x: F.conv2d(x, _CONV, None, padding=(2, 1), dilation=(2, 1), groups=2),
     [_r(2, 4, 8, 6)]),
    ("conv1d", lambda x: F.conv1d(x, _CONV1, stride=1, padding=2), [_r(2, 3, 9)]),
    ("max_pool2d", lambda x: F.max_pool2d(x, 3, stride=2, padding=1), [_r(1, 2, 7, 7)]),
    ("max_pool2d ceil", lambda x: F.max_pool2d(x, 2, ceil_mode=True), [_r(1, 2, 7, 7)]),
    ("avg_pool2d", lambda x: F.avg_pool2d(x, 3, stride=2, padding=1, count_include_pad=False), [_r(1, 2, 7, 7)]),
    ("avg_pool2d default", lambda x: F.avg_pool2d(x, 2), [_r(1, 2, 6, 6)]),
    ("adaptive_avg_pool2d", lambda x: F.adaptive_avg_pool2d(x, 1) + 0, [_r(2, 3, 5, 5)]),
    ("embedding", lambda i: F.embedding(i, _EMB), [_ints(10, 2, 3)]),
    ("attention", lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [_r(1, 2, 5, 8)] * 3),
    ("attention causal scaled", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3),
     [_r(2, 2, 5, 8), _r(2, 2, 6, 8), _r(2, 2, 6, 8)]),
    ("attention float mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
     [_r(1, 2, 5, 8)] * 3 + [_r(5, 5)]),
    ("attention bool mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
     [_r(1, 2, 5, 8)] * 3 + [lambda: _mask(5, 5)() | torch.eye(5, dtype=torch.bool)]),  # no row all masked
    ("gru cell", lambda x: _gru(x), [_r(3, 1, 8)]),
]


_GRU = torch.nn.GRU(8, 6, batch_first=True).eval()


def _gru(x: torch.Tensor) -> torch.Tensor:
    """Gates as chunks of one matrix product, written in place (disjoint views of one tensor)."""
    return _GRU(x, torch.zeros(1, x.shape[0], 6))[0]


def _capture(fn: Callable[..., Any], inputs: list[torch.Tensor]) -> tuple[Graph, list[torch.Tensor]]:
    g = Graph()
    with graph(g):
        y = fn(*inputs)
    return g, list(y) if isinstance(y, tuple) else [y]


def _session(model: bytes) -> Any:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def _run(session: Any, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    wanted = {i.name for i in session.get_inputs()}
    feed = {f"input_{i}": t.numpy() for i, t in enumerate(inputs) if f"input_{i}" in wanted}
    return [torch.from_numpy(out) for out in session.run(None, feed)]


@pytest.mark.parametrize("name, fn, makers", CASES, ids=[c[0] for c in CASES])
def test_each_mapped_op_runs_as_eager_on_new_inputs(name: str, fn: Callable[..., Any], makers: list[Any]) -> None:
    torch.manual_seed(0)
    inputs = [make() for make in makers]
    g, outputs = _capture(fn, inputs)
    gm = _compiled._to_fx(g.program, inputs, outputs)
    session = _session(_onnx_emit.emit(gm, inputs))
    for _ in range(2):  # new values: nothing of the capture's inputs is baked in
        new = [make() for make in makers]
        expected = fn(*new)
        got = _run(session, new)
        for out, ref in zip(got, list(expected) if isinstance(expected, tuple) else [expected]):
            assert out.dtype == ref.dtype and out.shape == ref.shape
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_every_mapped_op_is_exercised() -> None:
    """Every op in the table appears in some case's captured program (a mapping
    no program records is dead code; one no case runs is unchecked)."""
    seen: set[str] = set()
    for _, fn, makers in CASES:
        torch.manual_seed(0)
        inputs = [make() for make in makers]
        g, outputs = _capture(fn, inputs)
        seen.update(str(r.func) for r in g.program.records)
    assert sorted(set(_onnx_emit.mapped_ops()) - seen) == []


@pytest.mark.parametrize(
    "fn, makers, refusal",
    [
        (lambda x: torch.cumsum(x, 1), [_r(3, 4)], "maps no aten.cumsum"),
        (lambda x: F.conv_transpose2d(x, _CONV), [_r(1, 6, 5, 5)], "transposed convolution"),
        (lambda x: F.gelu(x) + torch.div(x, 2, rounding_mode="floor"), [_r(3, 4)], "maps no aten.div.Tensor_mode"),
        # A view made before an in-place write through another view of the same memory.
        (lambda x: _written_through_a_view(x), [_r(3, 4)], "after aten.add_.Tensor wrote its memory"),
        # torch's addmm drops the product at alpha=0 (NaN in it never reaches the result).
        (lambda b, x: torch.addmm(b, x, _W.t(), alpha=0), [_r(6), _r(3, 4)], "maps no aten.addmm.default with alpha=0"),
        # An integer power with a tensor exponent: 0 ** -1 is 0 in torch.
        (torch.pow, [_ints(5, 3), _ints(3, 3)], "maps no aten.pow.Tensor_Tensor of integers"),
    ],
    ids=["unmapped op", "unmapped argument", "unmapped overload", "stale view", "addmm alpha 0", "integer pow"],
)
def test_what_the_emitter_does_not_map_is_refused_by_name(fn: Callable[..., Any], makers: list[Any],
                                                           refusal: str) -> None:
    inputs = [make() for make in makers]
    g, outputs = _capture(fn, inputs)
    gm = _compiled._to_fx(g.program, inputs, outputs)
    with pytest.raises(accel.NotSupportedError, match=refusal):
        _onnx_emit.emit(gm, inputs)


def _written_through_a_view(x: torch.Tensor) -> torch.Tensor:
    base = x * 2
    row = base[0]
    base[:, 1:].add_(1.0)  # reaches into row
    return row + 0


def test_disjoint_views_written_in_place_are_followed() -> None:
    """Views of one tensor that share no element (a GRU's gate chunks, strided at
    batch > 1) do not stale each other; the one written reads its new values."""
    def program(x: torch.Tensor) -> torch.Tensor:
        base = x @ torch.ones(4, 6)
        a, b, c = base.chunk(3, dim=1)  # column blocks: strided, disjoint
        a.add_(1.0)
        b.mul_(a)
        return torch.cat([a, b, c], dim=1)

    x = torch.randn(5, 4)
    g, outputs = _capture(program, [x])
    session = _session(_onnx_emit.emit(_compiled._to_fx(g.program, [x], outputs), [x]))
    new = torch.randn(5, 4)
    torch.testing.assert_close(_run(session, [new])[0], program(new))


def test_in_place_writes_are_followed_in_linear_work(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each in-place write looks at the views of its own tensor not already stale,
    not at every node emitted before it: 4000 in-place ops took 12 s to emit."""
    looks = 0

    class Counting(dict):  # type: ignore[type-arg]
        def __contains__(self, key: object) -> bool:
            nonlocal looks
            looks += 1
            return super().__contains__(key)

    made = _onnx_emit._Emitter.__init__

    def counting(self: Any, recorder: Any) -> None:
        made(self, recorder)
        self.stale = Counting()

    monkeypatch.setattr(_onnx_emit._Emitter, "__init__", counting)
    writes = 200

    def program(x: torch.Tensor) -> torch.Tensor:
        y = x * 1.0
        for _ in range(writes // 2):
            y.mul_(0.5)
            y.add_(1.0)
        return y

    x = torch.randn(3, 4)
    g, outputs = _capture(program, [x])
    session = _session(_onnx_emit.emit(_compiled._to_fx(g.program, [x], outputs), [x]))
    assert looks < 10 * writes  # a scan of every node emitted: about writes ** 2
    new = torch.randn(3, 4)
    torch.testing.assert_close(_run(session, [new])[0], program(new))


def test_the_first_engine_of_a_compiled_graphed_callable_is_the_emitted_one(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the exporter's engine beside it, the emitted ONNX serves first; its
    report and the kept choice name it."""
    # The two ONNX engines, in the compiled tier's own order (AOTInductor would take minutes).
    table = {name: e for name, e in _engines.ENGINES.items() if name in ("onnxruntime-fx", "onnxruntime")}
    monkeypatch.setattr(_compiled, "ENGINES", table)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.LayerNorm(8)).eval()
    x = torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", BuildWarning)
        fast = make_graphed_callables(model, (x,), tier="compiled")
    (entry,) = fast._cache.values()
    assert entry.compiled.wait(60, first=True)
    first = entry.compiled.compiled
    assert first.engine == "onnxruntime-fx"
    assert entry.compiled.wait(120) and entry.compiled.state == "ready"
    statuses = {c.engine: c.status for c in entry.compiled.candidates}
    assert set(statuses) == {"onnxruntime-fx", "onnxruntime"} and "chosen" in statuses.values()
    chosen = entry.compiled.compiled.engine
    assert f'"engine": "{chosen}"' in next(cache.glob("choice-*.json")).read_text()
    new = torch.randn(2, 8)
    torch.testing.assert_close(fast(new), model(new), rtol=1e-4, atol=1e-4)


def test_a_program_the_emitter_does_not_map_is_served_by_the_exporters_engine(cache: Path) -> None:
    x = torch.randn(3, 4)
    g, (y,) = _capture(lambda t: torch.cumsum(t, 1).tanh(), [x])
    compiled = compile_graph(g, inputs=[x], outputs=[y], engines=["onnxruntime-fx", "onnxruntime"])
    by_name = {c.engine: c for c in compiled.candidates}
    assert compiled.engine == "onnxruntime"
    assert by_name["onnxruntime-fx"].status == "failed" and "maps no aten.cumsum" in by_name["onnxruntime-fx"].detail
    new = torch.randn(3, 4)
    x.copy_(new)
    g.replay()
    torch.testing.assert_close(y, torch.cumsum(new, 1).tanh())


def test_the_cache_key_changes_with_the_emitters_version(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file an older emitter wrote is never loaded by a newer one."""
    x = torch.randn(3, 4)
    g, (y,) = _capture(lambda t: torch.relu(t) * 2, [x])
    first = compile_graph(g, inputs=[x], outputs=[y], engines=["onnxruntime-fx"])
    assert first.engine == "onnxruntime-fx" and first.path.exists()
    monkeypatch.setattr(_onnx_emit, "EMITTER_VERSION", _onnx_emit.EMITTER_VERSION + 1)
    g2, (y2,) = _capture(lambda t: torch.relu(t) * 2, [x])
    with pytest.warns(BuildWarning, match="onnxruntime-fx"):
        second = compile_graph(g2, inputs=[x], outputs=[y2], engines=["onnxruntime-fx"])
    assert second.built and second.key != first.key and second.path != first.path


def test_a_damaged_emitted_file_in_the_cache_is_emitted_anew(cache: Path) -> None:
    x = torch.randn(3, 4)
    g, (y,) = _capture(lambda t: torch.sigmoid(t) + 1, [x])
    first = compile_graph(g, inputs=[x], outputs=[y], engines=["onnxruntime-fx"])
    first.path.write_bytes(first.path.read_bytes()[:40])  # truncated (a full disk, a crash while copying)
    g2, (y2,) = _capture(lambda t: torch.sigmoid(t) + 1, [x])
    again = compile_graph(g2, inputs=[x], outputs=[y2], engines=["onnxruntime-fx"])
    (candidate,) = again.candidates
    assert again.path == first.path and candidate.status == "chosen" and not candidate.cached
    new = torch.randn(3, 4)
    x.copy_(new)
    g2.replay()
    torch.testing.assert_close(y2, torch.sigmoid(new) + 1)


_INF, _NAN = float("inf"), float("nan")
_EDGES = torch.tensor([[_NAN, -2.0, _INF, -_INF], [0.5, -0.0, 3.0, -1e30]])

# (id, program, trial inputs, later inputs): values the trial run does not hold
# (infinities, NaN, rows all masked...) on which a mapping that validation passed
# on the trial inputs could still differ from eager.
EDGE_CASES: list[tuple[str, Callable[..., Any], list[torch.Tensor], list[torch.Tensor]]] = [
    ("clamp min only keeps inf", lambda x: x.clamp(min=-1.0), [torch.randn(2, 4)], [_EDGES]),
    ("clamp max only keeps -inf", lambda x: _fresh(x).clamp_(max=1.0), [torch.randn(2, 4)], [_EDGES]),
    ("max_pool2d of a window holding NaN", lambda x: F.max_pool2d(x, 2, padding=1),
     [torch.randn(1, 1, 2, 4)], [_EDGES.reshape(1, 1, 2, 4)]),
    ("max_pool2d of half NaN and -inf", lambda x: F.max_pool2d(x, 2, padding=1),
     [torch.randn(1, 1, 2, 4).half()], [_EDGES.reshape(1, 1, 2, 4).half()]),  # -1e30: -inf in half
    ("attention bool mask with a row all masked",
     lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
     [torch.randn(1, 2, 3, 4)] * 3 + [torch.ones(3, 3, dtype=torch.bool)],
     [torch.randn(1, 2, 3, 4)] * 3 + [torch.tensor([[True, False, True], [False] * 3, [True] * 3])]),
    ("attention float mask with a row all -inf",
     lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
     [torch.randn(1, 2, 3, 4)] * 3 + [torch.zeros(3, 3)],
     [torch.randn(1, 2, 3, 4)] * 3 + [torch.tensor([[0.0, -1.0, 0.0], [-_INF] * 3, [0.0, _NAN, 0.0]])]),
]


def test_a_negative_embedding_index_fails_as_in_eager() -> None:
    """torch refuses index -1; ONNX's Gather would read the table's last row."""
    indices = torch.tensor([[1, 2]])
    g, outputs = _capture(lambda i: F.embedding(i, _EMB), [indices])
    session = _session(_onnx_emit.emit(_compiled._to_fx(g.program, [indices], outputs), [indices]))
    bad = torch.tensor([[-1, 2]])
    with pytest.raises(IndexError):
        F.embedding(bad, _EMB)
    with pytest.raises(Exception, match="out of data bounds"):
        _run(session, [bad])


@pytest.mark.parametrize("name, fn, trial, later", EDGE_CASES, ids=[c[0] for c in EDGE_CASES])
def test_edge_values_after_the_trial_run_as_eager(name: str, fn: Callable[..., Any], trial: list[torch.Tensor],
                                                   later: list[torch.Tensor]) -> None:
    g, outputs = _capture(fn, trial)
    session = _session(_onnx_emit.emit(_compiled._to_fx(g.program, trial, outputs), trial))
    expected = fn(*later)
    for out, ref in zip(_run(session, later), list(expected) if isinstance(expected, tuple) else [expected]):
        assert out.dtype == ref.dtype and out.shape == ref.shape
        torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_a_cached_file_damaged_where_the_trial_does_not_look_is_emitted_anew(cache: Path) -> None:
    """A flipped byte in a table row the trial inputs never read still loads and
    agrees with eager on them: the file is checked against its digest instead."""
    table = torch.arange(40, dtype=torch.float32).reshape(10, 4) + 0.25
    indices = torch.tensor([1, 2])
    g, (y,) = _capture(lambda i: F.embedding(i, table), [indices])
    first = compile_graph(g, inputs=[indices], outputs=[y], engines=["onnxruntime-fx"])
    data = first.path.read_bytes()
    row = table[9].numpy().tobytes()
    assert data.count(row) == 1
    first.path.write_bytes(data.replace(row, torch.tensor([-999.0, 37.25, 38.25, 39.25]).numpy().tobytes()))
    indices2 = torch.tensor([1, 2])
    g2, (y2,) = _capture(lambda i: F.embedding(i, table), [indices2])
    again = compile_graph(g2, inputs=[indices2], outputs=[y2], engines=["onnxruntime-fx"])
    (candidate,) = again.candidates
    assert again.path == first.path and candidate.status == "chosen" and not candidate.cached
    indices2.copy_(torch.tensor([9, 1]))
    g2.replay()
    torch.testing.assert_close(y2, F.embedding(indices2, table))


def _out_of_range(error: BaseException | None) -> None:
    """The engine's failure, as an accel error that names it and chains ONNX Runtime's
    (a RuntimeError from its session's run, one of its own types from the public call)."""
    assert isinstance(error, accel.InvalidValueError)
    assert "'onnxruntime-fx' failed on this call's inputs" in str(error)
    assert "tier='interpreted'" in str(error) and "out of data bounds" in str(error)
    cause = error.__cause__
    assert cause is not None and not isinstance(cause, accel.AccelError) and "out of data bounds" in str(cause)


def test_an_engine_failing_at_a_replay_raises_an_accel_error_and_the_graph_stays_usable(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An embedding index out of range in a later call: eager raises IndexError; ONNX
    Runtime's own exception type reached the caller, from the steady path (the C head
    where built: the binding already on the argument's memory), the path that points
    the binding, and the graph's replay alike."""
    monkeypatch.setattr(_compiled, "ENGINES", {"onnxruntime-fx": _engines.ENGINES["onnxruntime-fx"]})
    table = torch.nn.Embedding(10, 4).eval()
    fast = make_graphed_callables(table, (torch.tensor([[1, 2]]),), tier="compiled", wait=True)
    (entry,) = fast._cache.values()
    assert entry.compiled.engine == "onnxruntime-fx"
    good = torch.tensor([[3, 4]])
    torch.testing.assert_close(fast(good), table(good))
    torch.testing.assert_close(fast(good), table(good))  # the steady path: the binding is on good's memory
    good[0, 0] = -11
    with pytest.raises(IndexError):
        table(good)
    with pytest.raises(accel.InvalidValueError) as steady:
        fast(good)
    _out_of_range(steady.value)
    with pytest.raises(accel.InvalidValueError) as pointing:
        fast(torch.tensor([[2, 10]]))
    _out_of_range(pointing.value)
    good[0, 0] = 9
    torch.testing.assert_close(fast(good), table(good))
    fresh = torch.tensor([[0, 5]])
    torch.testing.assert_close(fast(fresh), table(fresh))

    indices = torch.tensor([[1, 2]])
    g, (y,) = _capture(lambda i: F.embedding(i, table.weight), [indices])
    compiled = compile_graph(g, inputs=[indices], outputs=[y], engines=["onnxruntime-fx"])
    indices.copy_(torch.tensor([[1, 12]]))
    with pytest.raises(accel.InvalidValueError) as called:
        compiled()
    _out_of_range(called.value)
    with pytest.raises(accel.HostFunctionError) as replayed:  # a graph's replay wraps its failures
        g.replay()
    _out_of_range(replayed.value.__cause__)
    indices.copy_(torch.tensor([[7, 8]]))
    g.replay()
    torch.testing.assert_close(y, table(indices))
