"""Captures through torch's own device graphs, on accel's stream.

When torch can run kernels on the backend's devices (a CUDA build of torch
over the CUDA backend), torch ops launched during an accel capture must be
recorded by torch's graph machinery: its caching allocator has to route the
capture's allocations into a private pool, and its random generators have to
register their state so that each replay draws new numbers. So
:class:`accel.Graph` lets ``torch.cuda.CUDAGraph`` begin and end the capture,
on accel's capturing stream made torch's current stream. Both runtimes queue
into the same driver stream, so torch's kernels and accel's own stream work
(copies, fills, host functions, event waits) land in one graph, which torch
instantiates and replays.

What accel queued into the capture and must outlive it (host functions) is
detached from the backend's capture before torch ends it, and kept until the
graph is reset and its replays have finished.

Where torch's device streams are not the backend's (torch's XPU streams are
SYCL queues, accel's are Level Zero command lists), torch kernels cannot join
an accel capture: :class:`DeviceOpGuard` refuses them with a
:class:`~accel.CaptureError` rather than letting them run once and be
missing from every replay.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from accel._errors import CaptureError, InvalidValueError, NotSupportedError

if TYPE_CHECKING:
    from accel._runtime import Runtime
    from accel.graph._pool import PoolId
    from accel.stream import Stream

__all__ = [
    "DeviceOpGuard",
    "TorchDeviceGraph",
    "TorchGraphAPI",
    "torch_device_type",
    "torch_graph_api",
    "order_after",
    "torch_stream",
]

# accel's capture_error_mode names -> torch's
_TORCH_MODES = {"default": "global", "global": "global", "thread_local": "thread_local", "relaxed": "relaxed"}


@dataclass(frozen=True)
class TorchGraphAPI:
    """The pieces of torch's device graph API accel drives (``torch.cuda``'s)."""

    #: ``torch.cuda.CUDAGraph``: ``([keep_graph]) -> graph`` with capture_begin/end, replay, reset, debug_dump.
    graph_type: Callable[..., Any]
    #: ``(native stream handle, device index) -> torch stream`` over the same driver stream (handle != 0).
    external_stream: Callable[[int, int], Any]
    #: ``torch.cuda.default_stream``: ``(device index) -> torch stream`` (the driver's NULL stream).
    default_stream: Callable[[int], Any]
    #: ``torch.cuda.current_stream``: ``(device index) -> torch stream``.
    current_stream: Callable[[int], Any]
    #: ``torch.cuda.stream``: makes a torch stream (and its device) current inside a ``with`` block.
    use_stream: Callable[[Any], AbstractContextManager[Any]]
    #: ``torch.cuda.graph_pool_handle``: a new id for a memory pool of torch's allocator.
    pool_handle: Callable[[], Any]
    #: ``(device, pool) -> None``: stop routing allocations into ``pool``; raises when they are not routed there.
    end_pool_routing: Callable[[int, Any], None]
    #: ``(device, pool) -> None``: drop one use of ``pool`` (its memory goes when no use is left).
    release_pool: Callable[[int, Any], None]


def torch_device_type(device_type: str) -> str | None:
    """``device_type`` (a backend's declared torch device type), when torch is
    imported and has devices of it; None otherwise."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    module = getattr(torch, device_type, None)
    is_available = getattr(module, "is_available", None)
    return device_type if callable(is_available) and is_available() else None


def torch_graph_api(device_type: str) -> TorchGraphAPI | None:
    """torch's graph API for its ``device_type`` devices, or None when torch cannot
    launch kernels on them or has no graphs that share accel's streams."""
    make = _SHARED_STREAM_GRAPHS.get(device_type)
    if make is None or torch_device_type(device_type) is None:
        return None
    return make()


def _torch_cuda_graphs() -> TorchGraphAPI:
    import torch

    return TorchGraphAPI(
        graph_type=torch.cuda.CUDAGraph,
        external_stream=lambda handle, device: torch.cuda.ExternalStream(handle, device=torch.device("cuda", device)),
        default_stream=torch.cuda.default_stream,
        current_stream=torch.cuda.current_stream,
        use_stream=torch.cuda.stream,
        pool_handle=torch.cuda.graph_pool_handle,
        end_pool_routing=torch._C._cuda_endAllocateToPool,
        release_pool=torch._C._cuda_releasePool,
    )


# torch device types whose graphs capture on the driver's streams that accel's
# backend uses too (torch.cuda's CUDAGraph over CUstreams).
_SHARED_STREAM_GRAPHS: dict[str, Callable[[], TorchGraphAPI]] = {"cuda": _torch_cuda_graphs}


def torch_stream(api: TorchGraphAPI, stream: Stream) -> Any:
    """The torch stream over the same driver stream as ``stream``.

    accel's CUDA default stream is the NULL stream, which is torch's default
    stream; ``torch.cuda.ExternalStream(0)`` would be a new pool stream instead.
    """
    handle = stream.native_handle
    if handle == 0:
        return api.default_stream(stream.device_index)
    return api.external_stream(handle, stream.device_index)


def order_after(api: TorchGraphAPI, later: Any, earlier: Any) -> None:
    """Make work queued on torch stream ``later`` wait for what ``earlier`` has queued."""
    if later != earlier:
        later.wait_stream(earlier)


# accel pool id -> [torch pool handle, graphs using it], per (runtime, device):
# graphs that share an accel pool share the torch pool. An entry goes with
# its last graph, as the accel pool does.
_torch_pools: dict[tuple[str, int, tuple[int, int]], list[Any]] = {}
# Reentrant: a graph collected while the lock is held (the map allocates
# under it) releases its entry from its finalizer.
_torch_pools_lock = threading.RLock()


class TorchDeviceGraph:
    """One accel capture carried out by torch's device graph on accel's stream.

    Begun, ended and aborted on one thread: torch's current stream is per
    thread, and CUDA ends a global or thread-local capture only on the thread
    that began it.
    """

    def __init__(self, api: TorchGraphAPI, runtime: Runtime, device: int, stream: Stream, *, keep_graph: bool) -> None:
        self._api = api
        self._runtime = runtime
        self._device = device
        self._stream = stream
        if keep_graph:
            try:
                # torch's debug_dump works on graphs it keeps (no process-wide debug mode needed).
                self._graph = api.graph_type(keep_graph=True)
            except TypeError:
                raise NotSupportedError(
                    "accel.Graph(keep_graph=True) on CUDA keeps torch's raw graph, which needs torch >= 2.7 "
                    "(CUDAGraph(keep_graph=...)); upgrade torch, or capture with keep_graph=False"
                ) from None
        else:
            self._graph = api.graph_type()
        self._thread = threading.get_ident()
        self._stream_scope: AbstractContextManager[Any] | None = None
        self._pool_key: tuple[str, int, tuple[int, int]] | None = None
        self._torch_pool: Any = None
        self._capturing = False  # torch's capture is under way
        self._detached = 0  # backend handle of what accel queued into the capture
        # The torch stream last replayed on, by accel stream handle (made once, not per replay).
        self._replay_stream: tuple[int, Any] = (-1, None)

    def begin(self, pool_id: PoolId, mode: str) -> None:
        """Make accel's stream torch's current one and begin torch's capture on it."""
        self._pool_key = key = (self._runtime.name, self._device, pool_id)
        with _torch_pools_lock:
            entry = _torch_pools.get(key)
            if entry is None:
                entry = _torch_pools[key] = [self._api.pool_handle(), 0]
            entry[1] += 1
            self._torch_pool = entry[0]
        scope = self._api.use_stream(torch_stream(self._api, self._stream))
        scope.__enter__()
        self._stream_scope = scope
        try:
            self._graph.capture_begin(pool=self._torch_pool, capture_error_mode=_TORCH_MODES[mode])
        except BaseException as exc:
            # torch routes its allocator into the pool (a use of it) before it asks the driver to capture.
            if self._end_torch_pool_routing():
                self._api.release_pool(self._device, self._torch_pool)
            self._leave_stream()
            self._release_pool_key()
            raise CaptureError(f"torch could not begin capturing on {self._stream!r}: {exc}") from exc
        self._capturing = True

    def check_thread(self, what: str) -> None:
        """Refuse ``what`` on a thread other than the one that began the capture."""
        if threading.get_ident() != self._thread:
            raise CaptureError(
                f"{what} on {self._stream!r} from another thread than the one that began the capture: "
                "torch's current stream is per thread and CUDA ends a capture on its own thread. "
                "Call it on the capturing thread"
            )

    def end(self) -> None:
        """End torch's capture (it instantiates the graph); accel's queued work goes with it."""
        self.check_thread("capture_end()")
        backend = self._runtime.backend
        try:
            self._detached = backend.stream_capture_detach(self._device, self._stream._live())
            self._capturing = False
            self._graph.capture_end()
        except BaseException as exc:
            self._drop_failed_capture()
            if isinstance(exc, CaptureError):
                raise
            raise CaptureError(f"the capture on {self._stream!r} failed when torch ended it: {exc}") from exc
        finally:
            self._leave_stream()

    def abort(self) -> None:
        """Give up the capture under way: end it wherever it stands and drop the graph."""
        if threading.get_ident() != self._thread:
            # Neither torch's stream nor the capture can be ended here; the
            # capturing thread's next capture on this stream reports it.
            self._release_detached()
            return
        try:
            if self._capturing:
                self._capturing = False
                try:
                    self._detached = self._runtime.backend.stream_capture_detach(self._device, self._stream._live())
                except CaptureError:
                    pass  # the driver capture is already over
                try:
                    self._graph.capture_end()
                except Exception:  # noqa: BLE001 - an invalidated capture ends by raising; it is over either way
                    self._drop_failed_capture()
                    return
            self._release_detached()
            self._graph.reset()
            self._release_pool_key()
        finally:
            self._leave_stream()

    def replay(self, stream: Stream) -> None:
        """Launch the graph on ``stream`` (made torch's current stream for the launch)."""
        handle = stream.native_handle
        cached, replay_stream = self._replay_stream
        if cached != handle:
            replay_stream = torch_stream(self._api, stream)
            self._replay_stream = (handle, replay_stream)
        with self._api.use_stream(replay_stream):
            self._graph.replay()
        if self._detached:
            self._runtime.backend.detached_graph_launched(self._device, self._detached, stream._live())

    def holds_host_functions(self) -> bool:
        """Whether replays run host functions accel queued into the capture (after :meth:`end`)."""
        handle = self._detached
        return bool(handle) and self._runtime.backend.detached_graph_holds_host_functions(self._device, handle)

    def instantiate(self) -> None:
        """(Re-)instantiate torch's kept graph."""
        self._graph.instantiate()

    def reset(self) -> None:
        """Drop torch's graph; accel's host functions go once its replays finished."""
        self._graph.reset()
        self._release_detached()
        self._release_pool_key()

    def debug_dump(self, path: str) -> None:
        """torch's description of the captured graph (needs ``keep_graph=True``)."""
        self._graph.debug_dump(path)

    def _drop_failed_capture(self) -> None:
        """After torch's capture_end raised: leave nothing of the capture behind."""
        self._release_detached()
        # torch stops routing its allocator into the pool only once the driver
        # ended the capture, and releases the pool at reset only after that.
        if self._end_torch_pool_routing():
            self._api.release_pool(self._device, self._torch_pool)
        try:
            self._graph.reset()
        except Exception:  # noqa: BLE001 - the capture's own failure is the one to report
            pass
        if self._stream.is_capturing():  # torch refused to end it (wrong stream): end it at the driver
            try:
                graph = self._runtime.backend.stream_end_capture(self._device, self._stream._live())
            except CaptureError:
                pass
            else:
                self._runtime.backend.graph_destroy(self._device, graph)
        self._release_pool_key()

    def _end_torch_pool_routing(self) -> bool:
        """Stop torch's allocator routing into the pool; False when it already had."""
        try:
            self._api.end_pool_routing(self._device, self._torch_pool)
        except RuntimeError:
            return False
        return True

    def _leave_stream(self) -> None:
        scope, self._stream_scope = self._stream_scope, None
        if scope is not None:
            scope.__exit__(None, None, None)

    def _release_detached(self) -> None:
        handle, self._detached = self._detached, 0
        if handle:
            self._runtime.backend.detached_graph_release(self._device, handle)

    def _release_pool_key(self) -> None:
        key, self._pool_key = self._pool_key, None
        if key is None:
            return
        with _torch_pools_lock:
            entry = _torch_pools.get(key)
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    del _torch_pools[key]


class DeviceOpGuard:
    """Refuses torch ops on ``device_type`` tensors while an accel capture runs on a
    backend whose streams torch cannot share (torch's XPU streams are SYCL queues)."""

    def __init__(self, device_type: str, runtime_name: str) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        if not device_type:
            raise InvalidValueError("DeviceOpGuard needs a torch device type")
        guard = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                guard.check(func, args, kwargs or {})
                return func(*args, **(kwargs or {}))

        self._device_type = device_type
        self._runtime_name = runtime_name
        self._mode = _Mode()

    def check(self, func: Any, args: Any, kwargs: Any) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        for value in tree_flatten((args, kwargs))[0]:
            # Factories and copies name the device (device=, .to()); other ops take its tensors.
            device = value.device if isinstance(value, torch.Tensor) else value
            if isinstance(device, torch.device) and device.type == self._device_type:
                raise CaptureError(
                    f"{func} on a {self._device_type} device cannot be captured into an accel graph on the "
                    f"{self._runtime_name} backend: torch's {self._device_type} streams are not accel's, so the "
                    f"op would run once now and be missing from every replay. Capture torch work with "
                    f"torch.{self._device_type}'s own graphs, and accel's stream work with accel.Graph."
                )

    def __enter__(self) -> DeviceOpGuard:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
