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

import dataclasses
import itertools
import threading
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
int simcuda_set_failure(const char *name, int code);
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
        fake = TorchCudaAtDriverLevel.instance
        fake.waits.append((self.handle, other.handle))
        fake.check("cuStreamSynchronize", fake.lib.cuStreamSynchronize(_cu(other.handle)))


def _cu(handle: int) -> Any:
    return TorchCudaAtDriverLevel.instance.ffi.cast("CUstream", handle)


class _UseStream:
    """torch.cuda.StreamContext: a class, entered and exited explicitly."""

    def __init__(self, fake: TorchCudaAtDriverLevel, stream: _Stream) -> None:
        self._fake, self._stream, self._previous = fake, stream, None

    def __enter__(self) -> None:
        self._previous, self._fake.current = self._fake.current, self._stream

    def __exit__(self, *exc: object) -> None:
        self._fake.current = self._previous


class TorchCudaAtDriverLevel:
    """What torch.cuda does for streams, graphs, its allocator's pools and a kernel launch.

    Where torch behaves in a way accel must cope with, so does this:
    ``ExternalStream(0)`` is not the NULL stream, ``pool()`` works only after
    a successful capture_end, capture_end must run with the capture stream
    current, and the allocator routes into a pool from before the driver
    capture begins until after it ended successfully.
    """

    instance: TorchCudaAtDriverLevel

    def __init__(self, path: str) -> None:
        self.ffi = cffi.FFI()
        self.ffi.cdef(_CDEF)
        self.lib = self.ffi.dlopen(path)  # the library accel loaded: same driver state
        self.current = _Stream(0)
        self.calls: list[tuple[str, Any]] = []
        self.waits: list[tuple[int, int]] = []
        self.routing: list[tuple[int, int]] = []  # pools the allocator routes into
        self.pool_uses: dict[tuple[int, int], int] = {}
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

    def external_stream(self, handle: int, device: int) -> _Stream:
        assert handle != 0, "torch.cuda.ExternalStream(0) is a new pool stream, not the NULL stream"
        return _Stream(handle)

    def end_pool_routing(self, device: int, pool: tuple[int, int]) -> None:
        if pool not in self.routing:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")
        self.routing.remove(pool)

    def release_pool(self, device: int, pool: tuple[int, int]) -> None:
        self.pool_uses[pool] -= 1
        if self.pool_uses[pool] == 0:
            del self.pool_uses[pool]

    def api(self) -> _torch_graphs.TorchGraphAPI:
        fake = self

        class CUDAGraph:
            def __init__(self, keep_graph: bool = False) -> None:
                self.keep_graph = keep_graph
                self.graph = self.exec = None
                self.stream: _Stream | None = None
                self._pool: tuple[int, int] | None = None
                self.capture_ended = False

            def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
                fake.calls.append(("capture_begin", (fake.current.handle, pool, capture_error_mode)))
                if fake.current.handle == 0:
                    raise RuntimeError("CUDA graphs must be captured on a non-default stream.")
                self._pool = pool or (next(fake._pools), 0)
                fake.pool_uses[self._pool] = fake.pool_uses.get(self._pool, 0) + 1
                fake.routing.append(self._pool)  # beginAllocateToPool, then the driver
                fake.bind()
                fake.check(
                    "cuStreamBeginCapture",
                    fake.lib.cuStreamBeginCapture_v2(_cu(fake.current.handle), _MODES[capture_error_mode]),
                )
                self.stream = fake.current

            def capture_end(self) -> None:
                assert self.stream is not None and self._pool is not None
                fake.calls.append(("capture_end", fake.current.handle))
                if fake.current != self.stream:
                    raise RuntimeError("Capture must end on the same stream it began on.")
                out = fake.ffi.new("CUgraph *")
                fake.check("cuStreamEndCapture", fake.lib.cuStreamEndCapture(_cu(self.stream.handle), out))
                fake.routing.remove(self._pool)
                self.graph = out[0]
                self.capture_ended = True
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
                if self.capture_ended:  # torch releases the pool only for a capture that ended
                    fake.release_pool(0, self._pool)
                self.graph = self.exec = None
                self.capture_ended = False

            def pool(self) -> tuple[int, int]:
                if not self.capture_ended:
                    raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
                assert self._pool is not None
                return self._pool

            def debug_dump(self, path: str) -> None:
                assert self.keep_graph and self.graph is not None
                with open(path, "w") as f:
                    f.write("torch's graph\n")

        return _torch_graphs.TorchGraphAPI(
            graph_type=CUDAGraph,
            external_stream=self.external_stream,
            default_stream=lambda device: _Stream(0),
            current_stream=lambda device: self.current,
            use_stream=lambda stream: _UseStream(self, stream),
            pool_handle=lambda: (0, next(self._pools)),
            end_pool_routing=self.end_pool_routing,
            release_pool=self.release_pool,
        )

    def assert_clean(self) -> None:
        """No routing, no pool in use, torch's stream back to the default."""
        assert self.routing == [] and self.pool_uses == {} and self.current.handle == 0, (
            self.routing, self.pool_uses, self.current.handle
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


def test_replaying_torch_kernels_alone_queues_no_host_function(
    torch_cuda: TorchCudaAtDriverLevel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A graph torch carries with no host function of accel's replays without
    one (a forwarder per replay cost a driver callback taking the GIL: graphed
    calls ran 2.5x slower than torch's on an H100); with one, replays forward."""
    backend = accel._runtime.get_runtime().backend
    a = accel.memory.allocate(64)
    plain, hosting = Graph(), Graph()
    with graph(plain):  # captured on a side stream, replayed on the default stream
        torch_cuda.kernel_fill(a.ptr, 7, 64)
    with graph(hosting):
        torch_cuda.kernel_fill(a.ptr, 7, 64)
        accel.current_stream().launch_host_func(lambda: None)
    queued: list[object] = []
    launch = backend.launch_host_func
    monkeypatch.setattr(backend, "launch_host_func", lambda *args: (queued.append(args), launch(*args)))
    for _ in range(3):
        plain.replay()
    accel.synchronize()
    assert queued == []
    hosting.replay()
    accel.synchronize()
    assert len(queued) == 1, "a graph with host functions forwards their failures to the replay stream"
    a.free()


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
    later = Graph(pool=graphs[2].pool())  # another graph's own pool, shared by passing pool()
    with graph(later):
        pass
    pools = [args[1] for call, args in torch_cuda.calls if call == "capture_begin"]
    assert pools[0] is not None and pools[1] == pools[0], "graphs sharing an accel pool share a torch pool"
    assert pools[2] not in (None, pools[0]), "a private accel pool is a private torch pool"
    assert pools[3] == pools[2]
    assert torch_cuda.pool_uses == {pools[0]: 2, pools[2]: 2}
    for g in [*graphs, later]:
        g.reset()
    assert _torch_graphs._torch_pools == {}, "the pool map forgets a pool with its last graph"
    torch_cuda.assert_clean()


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
    torch_cuda.assert_clean()
    ran: list[int] = []
    with graph(g):
        accel.current_stream().launch_host_func(lambda: ran.append(1))
    g.replay()
    accel.synchronize()
    assert ran == [1]
    g.reset()
    torch_cuda.assert_clean()


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
    torch_cuda.assert_clean()


def test_failed_torch_begin_leaves_nothing_behind(torch_cuda: TorchCudaAtDriverLevel) -> None:
    torch_cuda.lib.simcuda_set_failure(b"cuStreamBeginCapture_v2", 2)  # out of memory, after torch's routing began
    try:
        with pytest.raises(CaptureError, match="torch could not begin capturing"):
            with graph(Graph()):
                pass
    finally:
        torch_cuda.lib.simcuda_set_failure(b"cuStreamBeginCapture_v2", 0)
    assert not accel.graph.is_capturing() and _torch_graphs._torch_pools == {}
    torch_cuda.assert_clean()
    g = Graph()
    with graph(g):
        pass
    g.reset()


def test_capture_end_on_another_thread_is_refused_and_the_capture_survives(
    torch_cuda: TorchCudaAtDriverLevel,
) -> None:
    s = accel.Stream()
    g = Graph()
    with s:
        g.capture_begin()
        accel.current_stream().launch_host_func(lambda: None)
        errors: list[BaseException] = []

        def end_elsewhere() -> None:
            try:
                g.capture_end()
            except BaseException as exc:  # noqa: BLE001 - collected for the assertion
                errors.append(exc)

        t = threading.Thread(target=end_elsewhere)
        t.start()
        t.join()
        assert len(errors) == 1 and isinstance(errors[0], CaptureError)
        assert "another thread" in str(errors[0])
        assert s.is_capturing() and torch_cuda.current.handle == s.native_handle
        g.capture_end()
    g.replay()
    s.synchronize()
    accel.synchronize()
    g.reset()
    torch_cuda.assert_clean()


def test_default_stream_is_refused_and_replays_there_use_torchs_default_stream(
    torch_cuda: TorchCudaAtDriverLevel,
) -> None:
    g = Graph()
    with pytest.raises(CaptureError, match="default stream"):
        g.capture_begin()
    torch_cuda.assert_clean()
    with graph(g):
        accel.current_stream().launch_host_func(lambda: None)
    g.replay()  # on accel's default stream: torch's default stream, not ExternalStream(0)
    assert torch_cuda.calls[-1] == ("replay", 0)
    accel.synchronize()
    g.reset()


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
        t = torch.ones(2)
        with pytest.raises(CaptureError, match="aten.add.Tensor on a cpu device cannot be captured"):
            with graph(g):
                t + 1  # noqa: B018
        assert not accel.graph.is_capturing()
        for make in (lambda: torch.ones(2, device="cpu"), lambda: torch.ones(2, device="meta").to("cpu")):
            with pytest.raises(CaptureError, match="on a cpu device cannot be captured"):
                with graph(g):
                    make()  # factories and copies name the device rather than passing its tensors
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


def test_graphed_callables_capture_without_autograd(
    torch_cuda: TorchCudaAtDriverLevel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inference-only: an autograd graph recorded in the capture binds the
    model's AccumulateGrad nodes to accel's capture stream; a later eager
    backward then records the gradients on that stream, and on an H100 torch
    aborted at interpreter exit (an event recorded on a stream gone with its
    context). The stand-in runs torch's CPU ops, so the device check is lifted."""
    torch = pytest.importorskip("torch")
    from accel.graph import _graphed, make_graphed_callables

    monkeypatch.setattr(_graphed, "_signature", lambda args, role, device_type: tuple(
        (tuple(a.shape), a.dtype) for a in args))
    lin = torch.nn.Linear(4, 4)
    grad_enabled: list[bool] = []

    def forward(x: Any) -> Any:
        grad_enabled.append(torch.is_grad_enabled())
        return lin(x)

    fast = make_graphed_callables(forward, (torch.randn(2, 4),), num_warmup_iters=1)
    assert grad_enabled == [False, False], "warm-up and capture run without autograd"
    (entry,) = fast._cache.values()
    assert entry.output.grad_fn is None and not entry.output.requires_grad
    entry.graph.reset()


def test_graphed_callables_need_torch_graphs_that_share_streams() -> None:
    torch = pytest.importorskip("torch")
    from accel.graph import make_graphed_callables

    reason = backend_skip_reason("cuda")
    if reason:
        pytest.skip(reason)
    with activate("cuda"), pytest.raises(accel.NotSupportedError, match="needs torch's graphs to share"):
        make_graphed_callables(torch.nn.Linear(4, 4), (torch.randn(2, 4),))


def test_stream_ordering_helpers(torch_cuda: TorchCudaAtDriverLevel) -> None:
    api = torch_cuda.api()
    s = accel.Stream()
    ts = _torch_graphs.torch_stream(api, s)
    assert ts.handle == s.native_handle
    assert _torch_graphs.torch_stream(api, accel.current_stream()).handle == 0, "default stream, not ExternalStream(0)"
    _torch_graphs.order_after(api, ts, _Stream(0))
    _torch_graphs.order_after(api, ts, ts)
    assert torch_cuda.waits == [(s.native_handle, 0)], "one wait, none for a stream on itself"


def test_keep_graph_with_a_torch_too_old_for_it_is_refused(
    torch_cuda: TorchCudaAtDriverLevel, monkeypatch: pytest.MonkeyPatch
) -> None:
    api = torch_cuda.api()
    original = api.graph_type

    def old_torch_graph(*args: Any, **kwargs: Any) -> Any:
        if kwargs:  # torch < 2.7: CUDAGraph() takes no keep_graph
            raise TypeError("CUDAGraph.__new__() got an unexpected keyword argument 'keep_graph'")
        return original()

    old = dataclasses.replace(api, graph_type=old_torch_graph)
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
