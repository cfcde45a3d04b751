"""accel.Graph carried by torch's own device graphs, on the simulated CUDA driver.

This machine's torch has no CUDA, so ``TorchCudaAtDriverLevel`` stands in for
``torch.cuda``: it makes the driver calls torch's CUDAGraph makes (begin and
end capture on torch's current stream, instantiate, launch on the current
stream), and a "kernel" is a memset it queues on its current stream. Both it
and accel's CUDA backend drive the same simulated libcuda in this process, so
the tests show what the integration does at the driver: torch's kernels and
accel's stream work in one graph, accel's host functions kept alive for
torch's replays and let go after. tests/backends/cuda/test_real_gpu.py runs
the same scenario with a real torch on a GPU.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Iterator
from typing import Any

import cffi
import numpy as np
import pytest

import accel
from accel._errors import CaptureError
from accel._runtime import activate
from accel.graph import Graph, graph, graph_pool_handle
from accel.graph import _torch_graphs
from tests.conftest import backend_skip_reason

_CDEF = """
typedef int CUresult;
typedef struct CUctx_st *CUcontext;
typedef struct CUstream_st *CUstream;
typedef struct CUgraph_st *CUgraph;
typedef struct CUgraphExec_st *CUgraphExec;
CUresult cuDevicePrimaryCtxRetain(CUcontext *pctx, int dev);
CUresult cuCtxSetCurrent(CUcontext ctx);
CUresult cuStreamBeginCapture_v2(CUstream hStream, int mode);
CUresult cuStreamEndCapture(CUstream hStream, CUgraph *phGraph);
CUresult cuGraphInstantiateWithFlags(CUgraphExec *phGraphExec, CUgraph hGraph, unsigned long long flags);
CUresult cuGraphLaunch(CUgraphExec hGraphExec, CUstream hStream);
CUresult cuGraphExecDestroy(CUgraphExec hGraphExec);
CUresult cuGraphDestroy(CUgraph hGraph);
CUresult cuMemsetD8Async(unsigned long long dst, unsigned char value, size_t n, CUstream hStream);
CUresult cuStreamSynchronize(CUstream hStream);
"""
_MODES = {"global": 0, "thread_local": 1, "relaxed": 2}


class _Stream:
    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream) and other.handle == self.handle

    def __hash__(self) -> int:
        return self.handle

    def wait_stream(self, other: _Stream) -> None:
        TorchCudaAtDriverLevel.instance.check(
            "cuStreamSynchronize", TorchCudaAtDriverLevel.instance.lib.cuStreamSynchronize(_cu(other.handle))
        )


def _cu(handle: int) -> Any:
    return TorchCudaAtDriverLevel.instance.ffi.cast("CUstream", handle)


class TorchCudaAtDriverLevel:
    """The driver calls torch.cuda makes for streams, graphs and a kernel launch."""

    instance: TorchCudaAtDriverLevel

    def __init__(self, path: str) -> None:
        self.ffi = cffi.FFI()
        self.ffi.cdef(_CDEF)
        self.lib = self.ffi.dlopen(path)  # the library accel loaded: same driver state
        self.current = _Stream(0)
        self.calls: list[tuple[str, Any]] = []
        self._pools = itertools.count(1)
        ctx = self.ffi.new("CUcontext *")
        self.check("cuDevicePrimaryCtxRetain", self.lib.cuDevicePrimaryCtxRetain(ctx, 0))
        self._ctx = ctx[0]
        TorchCudaAtDriverLevel.instance = self

    def check(self, call: str, code: int) -> None:
        if code:
            raise RuntimeError(f"CUDA error {code} in {call}")

    def bind(self) -> None:
        """torch's runtime makes the primary context current before its driver calls."""
        self.check("cuCtxSetCurrent", self.lib.cuCtxSetCurrent(self._ctx))

    def kernel_fill(self, ptr: int, value: int, nbytes: int) -> None:
        """A torch kernel writing ``nbytes`` at ``ptr``, launched on torch's current stream."""
        self.bind()
        self.check("cuMemsetD8Async", self.lib.cuMemsetD8Async(ptr, value, nbytes, _cu(self.current.handle)))

    def new_pool(self) -> tuple[int, int]:
        return (next(self._pools), 0)

    @contextlib.contextmanager
    def use_stream(self, stream: _Stream) -> Iterator[None]:
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def api(self) -> _torch_graphs.TorchGraphAPI:
        fake = self

        class CUDAGraph:
            def __init__(self, keep_graph: bool = False) -> None:
                self.keep_graph = keep_graph
                self.graph = self.exec = None
                self.stream: _Stream | None = None
                self._pool: tuple[int, int] | None = None
                self.debug = False

            def enable_debug_mode(self) -> None:
                self.debug = True

            def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
                fake.calls.append(("capture_begin", (fake.current.handle, pool, capture_error_mode)))
                if fake.current.handle == 0:
                    raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
                fake.bind()
                fake.check(
                    "cuStreamBeginCapture",
                    fake.lib.cuStreamBeginCapture_v2(_cu(fake.current.handle), _MODES[capture_error_mode]),
                )
                self.stream = fake.current
                self._pool = pool or fake.new_pool()

            def capture_end(self) -> None:
                assert self.stream is not None
                fake.calls.append(("capture_end", fake.current.handle))
                out = fake.ffi.new("CUgraph *")
                fake.check("cuStreamEndCapture", fake.lib.cuStreamEndCapture(_cu(self.stream.handle), out))
                self.graph = out[0]
                if not self.keep_graph:
                    self.instantiate()
                    fake.lib.cuGraphDestroy(self.graph)
                    self.graph = None

            def instantiate(self) -> None:
                out = fake.ffi.new("CUgraphExec *")
                fake.check("cuGraphInstantiateWithFlags", fake.lib.cuGraphInstantiateWithFlags(out, self.graph, 0))
                if self.exec is not None:
                    fake.lib.cuGraphExecDestroy(self.exec)
                self.exec = out[0]

            def replay(self) -> None:
                fake.calls.append(("replay", fake.current.handle))
                if self.exec is None:
                    self.instantiate()
                fake.bind()
                fake.check("cuGraphLaunch", fake.lib.cuGraphLaunch(self.exec, _cu(fake.current.handle)))

            def reset(self) -> None:
                fake.calls.append(("reset", None))
                if self.exec is not None:
                    fake.lib.cuGraphExecDestroy(self.exec)
                if self.graph is not None:
                    fake.lib.cuGraphDestroy(self.graph)
                self.graph = self.exec = None

            def pool(self) -> tuple[int, int]:
                assert self._pool is not None
                return self._pool

            def debug_dump(self, path: str) -> None:
                assert self.debug and self.graph is not None
                with open(path, "w") as f:
                    f.write("torch's graph\n")

        return _torch_graphs.TorchGraphAPI(
            graph_type=CUDAGraph,
            external_stream=lambda handle, device: _Stream(handle),
            use_stream=self.use_stream,
            current_stream=lambda device: self.current,
        )


@pytest.fixture
def torch_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[TorchCudaAtDriverLevel]:
    pytest.importorskip("torch")  # accel hands captures to torch only once torch is imported
    reason = backend_skip_reason("cuda")
    if reason:
        pytest.skip(reason)
    with activate("cuda") as runtime:
        fake = TorchCudaAtDriverLevel(runtime.backend.driver.path)
        monkeypatch.setattr(_torch_graphs, "torch_graph_api", lambda name: fake.api() if name == "cuda" else None)
        yield fake
        accel.synchronize()


def _device_bytes(buf: Any, n: int) -> bytes:
    host = np.zeros(n, dtype=np.uint8)
    s = accel.current_stream()
    s.copy(host, buf)
    s.synchronize()
    return host.tobytes()


def test_torch_kernels_and_accel_stream_work_land_in_one_graph(torch_cuda: TorchCudaAtDriverLevel) -> None:
    a, b = accel.memory.allocate(64), accel.memory.allocate(64)
    accel.current_stream().fill(a, 0)
    accel.current_stream().fill(b, 0)
    seen: list[bytes] = []
    g = Graph()
    with graph(g):
        s = accel.current_stream()
        assert torch_cuda.current.handle == s.native_handle, "accel's stream is torch's current stream"
        torch_cuda.kernel_fill(a.ptr, 7, 64)  # torch's kernel
        s.copy(b, a)  # accel's own stream work, ordered after it
        s.launch_host_func(lambda: seen.append(b"ran"))
    assert torch_cuda.current.handle == 0, "torch's current stream is given back"
    assert [c for c, _ in torch_cuda.calls] == ["capture_begin", "capture_end"]
    assert _device_bytes(b, 64) == bytes(64) and seen == [], "recorded, not run"
    for _ in range(2):
        g.replay()
    accel.synchronize()
    assert _device_bytes(b, 64) == b"\x07" * 64
    assert seen == [b"ran", b"ran"]
    a.free()
    b.free()


def test_host_functions_live_while_torch_graph_replays_then_are_released(
    torch_cuda: TorchCudaAtDriverLevel,
) -> None:
    backend = accel._runtime.get_runtime().backend
    before = backend.pending_host_functions()
    count: list[int] = []
    g = Graph()
    with graph(g):
        accel.current_stream().launch_host_func(lambda: count.append(1))
    g.replay()
    accel.synchronize()
    assert backend.pending_host_functions() == before + 1, "owned by the graph torch holds"
    g.reset()
    accel.synchronize()  # lets the backend retire what finished replays held
    assert backend.pending_host_functions() == before
    assert count == [1]


def test_replay_runs_on_accels_current_stream(torch_cuda: TorchCudaAtDriverLevel) -> None:
    g = Graph()
    with graph(g):
        accel.current_stream().launch_host_func(lambda: None)
    other = accel.Stream()
    with other:
        g.replay()
    assert torch_cuda.calls[-1] == ("replay", other.native_handle)
    other.synchronize()
    g.reset()


def test_shared_pool_maps_to_one_torch_pool(torch_cuda: TorchCudaAtDriverLevel) -> None:
    handle = graph_pool_handle()
    graphs = [Graph(pool=handle), Graph(pool=handle), Graph()]
    for g in graphs:
        with graph(g):
            accel.current_stream().launch_host_func(lambda: None)
    pools = [args[1] for call, args in torch_cuda.calls if call == "capture_begin"]
    assert pools[0] is None, "the first capture lets torch make the pool"
    assert pools[1] == graphs[0]._torch_graph._graph.pool(), "the second shares it"
    assert pools[2] is None, "a private accel pool is a private torch pool"
    for g in graphs:
        g.reset()


def test_capture_mode_is_passed_to_torch(torch_cuda: TorchCudaAtDriverLevel) -> None:
    g = Graph(capture_error_mode="thread_local")
    with graph(g):
        pass
    assert torch_cuda.calls[0][1][2] == "thread_local"
    g2 = Graph()
    with graph(g2):
        pass
    assert torch_cuda.calls[2][1][2] == "global", "accel's default is CUDA's global mode"


def test_failed_capture_leaves_nothing_behind_and_next_capture_works(torch_cuda: TorchCudaAtDriverLevel) -> None:
    backend = accel._runtime.get_runtime().backend
    before = backend.pending_host_functions()
    g = Graph()
    with pytest.raises(CaptureError):
        with graph(g):
            s = accel.current_stream()
            s.launch_host_func(lambda: None)
            s.synchronize()  # illegal while capturing: invalidates the capture
    assert not accel.graph.is_capturing()
    assert torch_cuda.current.handle == 0
    accel.synchronize()
    assert backend.pending_host_functions() == before, "the failed capture's host functions are let go"
    ran: list[int] = []
    with graph(g):
        accel.current_stream().launch_host_func(lambda: ran.append(1))
    g.replay()
    accel.synchronize()
    assert ran == [1]
    g.reset()


def test_error_in_block_aborts_torch_capture(torch_cuda: TorchCudaAtDriverLevel) -> None:
    backend = accel._runtime.get_runtime().backend
    before = backend.pending_host_functions()
    g = Graph()
    with pytest.raises(ZeroDivisionError):
        with graph(g):
            accel.current_stream().launch_host_func(lambda: None)
            1 / 0  # noqa: B018
    assert not accel.current_stream().is_capturing() and torch_cuda.current.handle == 0
    assert ("reset", None) in torch_cuda.calls
    accel.synchronize()
    assert backend.pending_host_functions() == before
    with pytest.raises(CaptureError, match="holds no captured graph"):
        g.replay()


def test_debug_dump_and_instantiate_with_keep_graph(torch_cuda: TorchCudaAtDriverLevel, tmp_path: Any) -> None:
    g = Graph(keep_graph=True)
    with graph(g):
        accel.current_stream().launch_host_func(lambda: None)
    g.debug_dump(str(tmp_path / "g.txt"))
    assert (tmp_path / "g.txt").read_text() == "torch's graph\n"
    g.instantiate()
    g.replay()
    accel.synchronize()
    g.reset()
    plain = Graph()
    with graph(plain):
        pass
    with pytest.raises(CaptureError, match="keep_graph=True"):
        plain.debug_dump(str(tmp_path / "x.txt"))
    plain.reset()


def test_detached_handles_are_checked(torch_cuda: TorchCudaAtDriverLevel) -> None:
    backend = accel._runtime.get_runtime().backend
    s = accel.Stream()
    with pytest.raises(CaptureError, match="not capturing"):
        backend.stream_capture_detach(0, s.native_handle)
    with pytest.raises(accel.InvalidHandleError):
        backend.detached_graph_release(0, 12345)
    with pytest.raises(accel.InvalidHandleError):
        backend.detached_graph_launched(0, 12345, s.native_handle)


def test_backends_without_foreign_captures_say_so() -> None:
    from accel.backends import load_backend

    cpu = load_backend("cpu")
    with pytest.raises(accel.NotSupportedError, match="captures ended by another runtime"):
        cpu.stream_capture_detach(0, cpu.default_stream(0))


def test_torch_ops_on_unshared_device_streams_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a backend whose streams torch cannot share (XPU), a torch op on its
    device during a capture fails the capture instead of running once.

    torch here has no XPU, so CPU tensors play the device's tensors."""
    torch = pytest.importorskip("torch")
    reason = backend_skip_reason("xpu")
    if reason:
        pytest.skip(reason)
    monkeypatch.setattr(_torch_graphs, "torch_device_type", lambda name: "cpu" if name == "xpu" else None)
    with activate("xpu"):
        g = Graph()
        with pytest.raises(CaptureError, match="aten.add.Tensor on a cpu tensor cannot be captured"):
            with graph(g):
                torch.ones(2) + 1
        assert not accel.graph.is_capturing()
        ran: list[int] = []
        with graph(g):  # the next capture works, and the guard is gone after it
            accel.current_stream().launch_host_func(lambda: ran.append(1))
        torch.ones(2) + 1
        g.replay()
        accel.synchronize()
        assert ran == [1]
        g.reset()


def test_graphed_callables_check_backend_and_tensors(torch_cuda: TorchCudaAtDriverLevel) -> None:
    torch = pytest.importorskip("torch")
    from accel.graph import make_graphed_callables

    lin = torch.nn.Linear(4, 4).eval()
    with pytest.raises(accel.InvalidValueError, match=r"sample_args\[0\] is on cpu; on the cuda backend .* cuda tensors"):
        make_graphed_callables(lin, (torch.randn(2, 4),))
    with pytest.raises(accel.NotSupportedError, match="tier='compiled'"):
        make_graphed_callables(lin, (torch.randn(2, 4),), tier="compiled")


def test_graphed_callables_need_torch_graphs_that_share_streams() -> None:
    torch = pytest.importorskip("torch")
    from accel.graph import make_graphed_callables

    reason = backend_skip_reason("cuda")
    if reason:
        pytest.skip(reason)
    with activate("cuda"), pytest.raises(accel.NotSupportedError, match="needs torch's graphs to share"):
        make_graphed_callables(torch.nn.Linear(4, 4), (torch.randn(2, 4),))


def test_torch_reads_replay_outputs_in_stream_order(torch_cuda: TorchCudaAtDriverLevel) -> None:
    api = torch_cuda.api()
    waited: list[int] = []

    class Current(_Stream):
        def wait_stream(self, other: _Stream) -> None:
            waited.append(other.handle)

    s = accel.Stream()
    torch_cuda.current = Current(0)
    _torch_graphs.wait_for_replay_in_torch(api, s, 0)
    assert waited == [s.native_handle]
    torch_cuda.current = Current(s.native_handle)
    _torch_graphs.wait_for_replay_in_torch(api, s, 0)
    assert waited == [s.native_handle], "no wait when torch already runs on the replay's stream"
    torch_cuda.current = _Stream(0)


def test_keep_graph_with_a_torch_too_old_for_it_is_refused(
    torch_cuda: TorchCudaAtDriverLevel, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = torch_cuda.api()
    original = api.graph_type

    def old_torch_graph(*args: Any, **kwargs: Any) -> Any:
        if kwargs:  # torch < 2.7: CUDAGraph() takes no keep_graph
            raise TypeError("CUDAGraph.__new__() got an unexpected keyword argument 'keep_graph'")
        return original()

    old = _torch_graphs.TorchGraphAPI(old_torch_graph, api.external_stream, api.use_stream, api.current_stream)
    monkeypatch.setattr(_torch_graphs, "torch_graph_api", lambda name: old)
    with pytest.raises(accel.NotSupportedError, match="torch >= 2.7"):
        with graph(Graph(keep_graph=True)):
            pass
    assert not accel.graph.is_capturing() and torch_cuda.current.handle == 0
    g = Graph()
    with graph(g):
        pass
    g.replay()
    g.reset()
