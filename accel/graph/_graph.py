"""Graphs: stream work captured once and replayed many times.

A :class:`Graph` records the work queued on the current stream between
:meth:`Graph.capture_begin` and :meth:`Graph.capture_end` (copies, fills,
host functions, waits on events recorded inside the capture) instead of
running it; :meth:`Graph.replay` runs it all again, in the same order with the
same dependencies, at the same addresses. Allocations made on the capturing
streams come from the graph's private memory pool, so replays allocate
nothing. On the host backend, torch CPU ops run during a capture are recorded
too (see :mod:`accel.graph._torch_capture`); where torch has the backend's
devices and shares its streams (CUDA), torch's own graph machinery carries
the capture, so torch kernels land in the same graph (see
:mod:`accel.graph._torch_graphs`). Which of these applies is the backend's
declared capability (:mod:`accel.graph._integration`).
"""

from __future__ import annotations

import sys
import threading
import warnings
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any

from accel._errors import CaptureError, DeviceError, HostFunctionError, InvalidHandleError, InvalidValueError
from accel._runtime import Runtime, get_runtime
from accel.allocator import empty_cache
from accel.allocator._registry import registry
from accel.backends.base import CaptureMode
from accel.graph import _integration
from accel.graph._pool import PoolId, PoolLease, check_pool_id, new_private_pool_id
from accel.stream import Stream

if TYPE_CHECKING:
    from accel.graph._integration import CaptureIntegration, TorchGraphCarrier

__all__ = ["Graph", "graph", "is_capturing"]

_MODES = {
    "default": CaptureMode.GLOBAL,
    "global": CaptureMode.GLOBAL,
    "thread_local": CaptureMode.THREAD_LOCAL,
    "relaxed": CaptureMode.RELAXED,
}

# One capture per device at a time (as CUDA allows one per process with the
# global mode): it keeps the allocator's routing filter unambiguous.
# Weak: a Graph collected mid-capture drops its capture (see __del__).
_capturing: dict[tuple[str, int], weakref.ref[Graph]] = {}
_capturing_lock = threading.Lock()


def _check_mode(mode: object, where: str) -> str:
    if not isinstance(mode, str) or mode not in _MODES:  # a list is unhashable: no lookup
        raise InvalidValueError(
            f"{where}: unknown capture_error_mode {mode!r}; expected 'default', 'global', "
            "'thread_local' or 'relaxed'"
        )
    return mode


class Graph:
    """A captured graph of stream work (and, on the host, torch ops), replayable.

    ``pool`` shares a memory pool with other graphs (from
    :func:`graph_pool_handle` or another graph's :meth:`pool`); None gives
    the graph a private one. With ``keep_graph=False`` the captured graph is
    instantiated at :meth:`capture_end` and the raw graph dropped; with True it
    is kept (for :meth:`debug_dump`) and instantiated on first replay.

    Like ``torch.accelerator.Graph``, the context manager does not switch
    streams: enter a created stream first, or use :func:`graph`.

    >>> import accel
    >>> buf = bytearray(4)
    >>> import numpy as np; arr = np.frombuffer(buf, dtype=np.uint8)
    >>> g = accel.graph.Graph()
    >>> with accel.graph.graph(g):
    ...     accel.current_stream().fill(arr, 7)
    >>> bytes(buf)            # recorded, not run
    b'\\x00\\x00\\x00\\x00'
    >>> g.replay(); accel.synchronize(); bytes(buf)
    b'\\x07\\x07\\x07\\x07'
    """

    def __init__(
        self,
        keep_graph: bool = False,
        *,
        pool: PoolId | None = None,
        capture_error_mode: str = "default",
    ) -> None:
        self._keep_graph = bool(keep_graph)
        self._graph_pool = check_pool_id(pool, where="accel.Graph")
        self._capture_error_mode = _check_mode(capture_error_mode, "accel.Graph")
        self._runtime: Runtime | None = None
        self._device = 0
        self._stream: Stream | None = None  # the capturing stream, while capturing
        self._lease: PoolLease | None = None
        # torch's part in the capture (None: none); after capture_end, kept only
        # where torch's graph carries the captured graph.
        self._torch: CaptureIntegration | None = None
        self._program: Any = None  # the recorded torch program (host backend)
        self._graph = 0  # raw captured graph handle
        self._exec = 0  # executable graph handle
        self._captured = False
        self._inputs: list[Any] = []
        self._capture_handle = 0  # the stream captured on: replayed host functions report there
        self._forward_host_errors = False
        self.replay_errors: list[tuple[str, BaseException]] = []
        # Holds on the accel buffers the captured work touches (their memory stays
        # until this graph is reset or collected: every replay writes it).
        self._holds: list[Any] = []
        # Streams replays ran on: held memory is reused after they passed its release.
        self._replayed_on: set[int] = set()
        self._capture_id = 0  # the backend's id of the capture under way (keys the holds)
        # Orders replay() launches and reset() letting go (reentrant: a host
        # function of a replay run inline on the host may reset its graph).
        self._launch_lock = threading.RLock()
        # torch's part in the capture of the ``with`` block under way, told when it exits.
        self._block_part: CaptureIntegration | None = None

    def __repr__(self) -> str:
        state = "capturing" if self._stream is not None else ("captured" if self._captured else "empty")
        return f"accel.Graph({state}, pool={self._lease.pool_id if self._lease else None})"

    # torch.accelerator.Graph's attributes: what the next capture uses, settable before it
    # (after reset(), to capture again differently). Checked when set, not at the capture.

    @property
    def graph_pool(self) -> PoolId | None:
        """The pool the next capture allocates from (None: a private pool), as
        ``torch.accelerator.Graph.graph_pool``; the constructor's ``pool``.

        >>> import accel
        >>> g = accel.Graph()
        >>> g.graph_pool = accel.graph_pool_handle()
        """
        return self._graph_pool

    @graph_pool.setter
    def graph_pool(self, pool: PoolId | None) -> None:
        self._graph_pool = check_pool_id(pool, where="Graph.graph_pool")

    @property
    def capture_error_mode(self) -> str:
        """How strictly the next capture refuses unsafe calls (``"default"``,
        ``"global"``, ``"thread_local"``, ``"relaxed"``), as
        ``torch.accelerator.Graph.capture_error_mode``; the constructor's."""
        return self._capture_error_mode

    @capture_error_mode.setter
    def capture_error_mode(self, mode: str) -> None:
        self._capture_error_mode = _check_mode(mode, "Graph.capture_error_mode")

    # -- capture -----------------------------------------------------------------

    def register_inputs(self, *tensors: Any) -> None:
        """Declare torch tensors made outside the graph that captured ops write in place.

        Optional: a captured in-place write to a tensor made outside the graph
        (a KV cache) is recorded without it, as CUDA records it: each replay
        writes that tensor again, and the graph keeps it alive.
        """
        self._inputs.extend(tensors)
        if self._torch is not None and self._stream is not None:
            self._torch.register_inputs(tensors)

    def capture_begin(self, pool: PoolId | None = None, capture_error_mode: str | None = None) -> None:
        """Start capturing the work queued on the current stream.

        ``pool`` and ``capture_error_mode`` override the constructor's for
        this capture. Raises :class:`~accel.CaptureError` on the default
        stream, when this graph already holds a capture (call :meth:`reset`),
        or when another capture is under way on the device.
        """
        _sweep()
        pool_id = check_pool_id(pool, where="Graph.capture_begin") or self._graph_pool
        mode = self._capture_error_mode if capture_error_mode is None else capture_error_mode
        mode = _check_mode(mode, "Graph.capture_begin")
        if self._stream is not None:
            raise CaptureError(f"{self!r} is already capturing; call capture_end() first")
        if self._captured:
            raise CaptureError(
                f"{self!r} already owns a captured graph; call reset() before capturing again, "
                "or create a new accel.Graph"
            )
        runtime = get_runtime()
        device = runtime.current_index
        stream = runtime.current_stream(device)
        key = (runtime.name, device)
        _drop_abandoned_capture(runtime, device)
        with _capturing_lock:
            _check_no_capture(runtime, device)
            _capturing[key] = weakref.ref(self)
        try:
            if pool_id is None:
                pool_id = new_private_pool_id()

            def routes(s: Stream) -> bool:
                return s.device_index == device and s.is_capturing()

            lease = PoolLease(device, pool_id, routes)
            try:
                torch_part = self._begin(runtime, device, stream, lease, pool_id, mode)
            except BaseException:
                lease.release()
                raise
        except BaseException:
            with _capturing_lock:
                _capturing.pop(key, None)
            raise
        self._runtime, self._device, self._stream, self._lease = runtime, device, stream, lease
        self._torch = torch_part
        self.replay_errors.clear()
        try:
            # Keyed by the capture, not the stream: streams forked into it add theirs too.
            self._capture_id = runtime.backend.stream_capture_id(device, stream.native_handle)
            if self._capture_id:
                runtime.capture_holds[self._capture_id] = self._holds
                runtime.capture_owners[self._capture_id] = _weak_on_stream_closed(self)
            if torch_part is not None and not torch_part.carries_graph:
                torch_part.start(self._inputs)
        except BaseException:
            self._abort()
            raise

    def _begin(
        self, runtime: Runtime, device: int, stream: Stream, lease: PoolLease, pool_id: PoolId, mode: str
    ) -> CaptureIntegration | None:
        """Begin the capture, through torch's graph where it carries it; torch's part, if any."""
        torch_part = _integration.for_capture(
            runtime, device, stream, lease,
            keep_graph=self._keep_graph, errors=self.replay_errors, on_refused=_weak_abort(self),
        )
        if isinstance(torch_part, _integration.TorchGraphCarrier):
            if stream.native_handle == runtime.backend.default_stream(device):
                raise CaptureError(
                    f"cannot capture on the default stream of {runtime.device(device)}; enter a created "
                    "accel.Stream first, or use accel.graph.graph(), which captures on a side stream"
                )
            torch_part.begin(pool_id, mode)
            return torch_part
        runtime.backend.stream_begin_capture(device, stream._live(), _MODES[mode])
        return torch_part

    def capture_end(self) -> None:
        """End the capture begun by :meth:`capture_begin` (on the stream that began it).

        Raises :class:`~accel.CaptureError` if the capture was invalidated
        (synchronizing a capturing stream, an unjoined fork, a refused torch
        op...); the graph is then empty again and can capture anew.
        """
        stream, runtime = self._stream, self._runtime
        if stream is None or runtime is None:
            raise CaptureError(f"capture_end() called on {self!r}, which is not capturing")
        if stream._closed:
            name = repr(self)
            self._abort()
            raise CaptureError(
                f"capture_end() called on {name}: the stream it captured on ({stream!r}) was closed, "
                "which dropped the capture; capture again on an open stream"
            )
        carrier = self._carrier()
        if carrier is not None:
            carrier.graph.check_thread("capture_end()")  # before anything is torn down
        torch_part = self._torch
        if carrier is None:
            self._torch = None  # its part ends with the capture
        try:
            if torch_part is not None and carrier is None:
                self._program = torch_part.stop()
            if carrier is not None:
                carrier.end()  # torch warns about an empty graph itself
                length = None
            else:
                self._graph = runtime.backend.stream_end_capture(self._device, stream._live())
                length = runtime.backend.graph_node_count(self._device, self._graph)
        except BaseException:
            self._abort()
            raise
        assert self._lease is not None
        self._lease.stop_routing()
        self._capture_handle = stream.native_handle
        segments = len(self._program.segments) if self._program is not None else 0
        if self._program is not None and length == segments:
            self._program.mark_alone()
        # Work beyond the recorded torch ops (whose failures replay() raises)
        # may hold host functions, whose failures go to the capture stream.
        # Only then does a replay queue a forwarding host function: on CUDA one
        # costs a driver callback that takes the GIL on every replay.
        if carrier is not None:
            self._forward_host_errors = carrier.graph.holds_host_functions()
        else:
            self._forward_host_errors = (length is None or length > segments) and (
                runtime.backend.graph_holds_host_functions(self._device, self._graph)
            )
        if length == 0:
            warnings.warn(
                f"{self!r} captured no work: the capture recorded nothing (no stream work on the "
                "capturing stream, no torch op), so a replay does nothing. Was the work queued on "
                "another stream?",
                UserWarning,
                stacklevel=2,
            )
        self._finish_capture()
        self._captured = True
        if not self._keep_graph and carrier is None:
            self.instantiate()
            runtime.backend.graph_destroy(self._device, self._graph)
            self._graph = 0

    def _finish_capture(self) -> None:
        if self._runtime is not None and self._capture_id:
            self._runtime.capture_holds.pop(self._capture_id, None)
            self._runtime.capture_owners.pop(self._capture_id, None)
            self._capture_id = 0
        with _capturing_lock:
            if self._runtime is not None:
                key = (self._runtime.name, self._device)
                ref = _capturing.get(key)
                if ref is not None and ref() in (self, None):
                    del _capturing[key]
        self._stream = None

    def _carrier(self) -> TorchGraphCarrier | None:
        """torch's graph, where it carries this graph's capture."""
        torch_part = self._torch
        return torch_part if isinstance(torch_part, _integration.TorchGraphCarrier) else None

    def _abort(self) -> None:
        """Drop a capture under way: backend capture, recorder, pool routing and use."""
        runtime, stream = self._runtime, self._stream
        torch_part, self._torch = self._torch, None
        try:
            if torch_part is not None:
                torch_part.abort()  # torch's graph, where it carries the capture, ends it
        finally:  # whatever torch's part or the backend raised, the capture must not stay half dropped
            try:
                backend_capture = torch_part is None or not torch_part.carries_graph
                if backend_capture and runtime is not None and stream is not None and _still_capturing(stream):
                    try:
                        graph = runtime.backend.stream_end_capture(self._device, stream._live())
                    except CaptureError:
                        pass  # an invalidated capture ends by raising; it is over either way
                    else:
                        runtime.backend.graph_destroy(self._device, graph)
            finally:
                self._program = None
                self._finish_capture()
                self._holds.clear()  # nothing will replay it
                lease, self._lease = self._lease, None
                if lease is not None:
                    lease.release()

    def _stream_closed(self, index: int, handle: int) -> None:
        """A stream of this capture was closed. The capturing one: the backend dropped
        the capture with it, so its holds and pool use go now (capture_end() still says
        why it failed). Another (forked into it): the capture fails at capture_end()."""
        stream = self._stream
        if stream is None or stream.device_index != index or stream.native_handle != handle:
            return
        if self._runtime is not None and self._capture_id:
            self._runtime.capture_holds.pop(self._capture_id, None)
            self._runtime.capture_owners.pop(self._capture_id, None)
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        self._holds.clear()

    # -- replay ----------------------------------------------------------------

    def instantiate(self) -> None:
        """Make the captured graph executable (again, if it already was).

        Needs the raw graph: after :meth:`capture_end` with ``keep_graph=True``.
        """
        runtime = self._require_captured("instantiate")
        carrier = self._carrier()
        if carrier is not None and self._keep_graph:
            carrier.graph.instantiate()
            return
        if not self._graph:
            raise CaptureError(
                f"{self!r} was instantiated at capture_end and its raw graph dropped; "
                "create the Graph with keep_graph=True to instantiate it explicitly"
            )
        graph_exec = runtime.backend.graph_instantiate(self._device, self._graph)
        if self._exec:
            runtime.backend.graph_exec_destroy(self._device, self._exec)
        self._exec = graph_exec

    def replay(self) -> None:
        """Run the captured work again on the current stream of the graph's device.

        Work is queued like any stream work: synchronize the stream before
        reading results (on the host, the default stream runs it inline). An
        op that failed in an earlier asynchronous replay is raised here.
        """
        # Under the lock reset() takes to let go of the graph: a reset racing on
        # another thread comes before (this replay is refused) or after the
        # launch is queued (which CUDA lets finish), never in the middle of it.
        with self._launch_lock:
            runtime = self._require_captured("replay")
            stream = runtime.current_stream(self._device)
            carrier = self._carrier()
            if carrier is None and not self._exec:
                self.instantiate()
            self._raise_replay_errors()
            if self._holds and stream.native_handle not in self._replayed_on:
                self._hold_on(stream)
            if carrier is not None:
                carrier.graph.replay(stream)
            else:
                runtime.backend.graph_launch(self._device, self._exec, stream._live())
        if self._forward_host_errors and stream.native_handle != self._capture_handle:
            stream.launch_host_func(self._host_error_forwarder(runtime, stream))
        self._raise_replay_errors()

    def _hold_on(self, stream: Stream) -> None:
        """Replays on ``stream`` write the held memory: once the graph lets go of it
        (reset, collected), it is reused only after ``stream`` passed that point,
        as after a record_stream (else a replay still running there wrote into
        whoever got the memory next)."""
        for lease in {id(h): h for h in self._holds}.values():
            try:
                lease.record_stream(stream)
            except DeviceError:
                pass  # memory of another device (a peer copy): only its own streams order its reuse
        self._replayed_on.add(stream.native_handle)

    def _host_error_forwarder(self, runtime: Runtime, stream: Stream) -> Callable[[], None]:
        """A host function, queued after a replay on ``stream``, that moves the replay's
        host-function failures (reported to the stream captured on) to ``stream``'s, so
        that its next synchronize raises them as it would uncaptured: wrapped once, in
        that synchronize's HostFunctionError (raising them here wrapped them twice)."""
        device, handle, name = self._device, self._capture_handle, repr(self)
        errors = stream._host_errors()

        def forward() -> None:
            failures = runtime.take_host_errors(device, handle)
            errors.extend((f"{what} in a replay of {name}", exc) for what, exc in failures)

        forward.__qualname__ = f"replay of {name}"
        return forward

    def _raise_replay_errors(self) -> None:
        if self.replay_errors:
            failures = list(self.replay_errors)
            self.replay_errors.clear()
            what, first = failures[0]
            raise HostFunctionError(
                f"replay of {self!r} failed in {what}: {type(first).__name__}: {first}"
            ) from first

    def reset(self) -> None:
        """Drop the captured graph (or the capture under way) and give its pool use back.

        Tensors the capture returned stay valid while referenced; their
        memory goes back to the pool once they are gone.
        """
        self._reset(from_finalizer=False)

    def _reset(self, *, from_finalizer: bool) -> None:
        if self._stream is not None:
            self._abort()
            return
        runtime = self._runtime
        carrier = self._carrier()
        # No captured graph from here on: a replay racing on another thread is
        # told so, not handed a handle being destroyed (see replay()).
        with self._launch_lock:
            self._captured = False
            graph_exec, graph, self._exec, self._graph = self._exec, self._graph, 0, 0
        self._torch = None
        if carrier is not None:
            carrier.graph.reset()
        if runtime is not None:
            if graph_exec:
                runtime.backend.graph_exec_destroy(self._device, graph_exec)
            if graph:
                runtime.backend.graph_destroy(self._device, graph)
        self._program = None
        if self._lease is not None:
            self._lease.release(from_finalizer=from_finalizer)
            self._lease = None
        self._holds.clear()  # freed buffers' memory goes back (from a finalizer too: leases defer)
        self._replayed_on.clear()
        self.replay_errors.clear()

    def __del__(self) -> None:
        # A collection can run this inside the allocator's locked sections:
        # the pool's release then waits for the allocator's next call. A graph
        # collected mid-capture ends the capture and frees the device.
        try:
            self._reset(from_finalizer=True)
        except Exception:  # noqa: BLE001 - interpreter shutdown; nothing to report to
            pass

    # -- inspection --------------------------------------------------------------

    def pool(self) -> PoolId:
        """The id of the pool the capture allocated from; pass it to share the pool."""
        if not self._captured or self._lease is None:
            raise CaptureError(f"pool() called on {self!r} without a preceding successful capture")
        return self._lease.pool_id

    @property
    def program(self) -> Any:
        """The recorded torch program (host backend), or None."""
        return self._program

    def enable_debug_mode(self) -> None:
        """Keep the raw graph at :meth:`capture_end` for :meth:`debug_dump`, as
        ``keep_graph=True`` does (torch's spelling); call it before capturing."""
        if self._captured or self._stream is not None:
            raise CaptureError(f"enable_debug_mode() must come before the capture of {self!r}")
        self._keep_graph = True

    def debug_dump(self, path: str) -> None:
        """Write a readable description of the captured graph to ``path``.

        Needs the raw graph: create the Graph with ``keep_graph=True``. On the
        host, the recorded torch ops are listed after the stream work.
        """
        runtime = self._require_captured("debug_dump")
        carrier = self._carrier()
        if carrier is not None and self._keep_graph:
            carrier.graph.debug_dump(path)
            return
        if not self._graph:
            raise CaptureError(
                f"debug_dump needs the raw graph, which {self!r} dropped at capture_end; "
                "create the Graph with keep_graph=True"
            )
        runtime.backend.graph_debug_dump(self._device, self._graph, path)
        if self._program is not None:
            with open(path, "a") as f:
                f.write(self._program.describe())

    def _require_captured(self, what: str) -> Runtime:
        if self._stream is not None:
            raise CaptureError(f"{what}() called on {self!r} while it is capturing; call capture_end() first")
        if not self._captured or self._runtime is None:
            raise CaptureError(f"{what}() called on {self!r}, which holds no captured graph; capture one first")
        return self._runtime

    # -- context manager -------------------------------------------------------

    def __enter__(self) -> Graph:
        _prepare_for_capture()
        self.capture_begin()
        self._block_part = self._torch
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            if exc_type is None:
                self.capture_end()
            elif self._stream is not None:
                self._abort()
        finally:
            _sweep()
            part, self._block_part = self._block_part, None
            if part is not None:
                part.block_exited()


def _weak_abort(g: Graph) -> Callable[[], None]:
    """``g._abort``, without keeping ``g`` alive from what its capture holds."""
    ref = weakref.ref(g)

    def abort() -> None:
        graph = ref()
        if graph is not None:
            graph._abort()

    return abort


def _weak_on_stream_closed(g: Graph) -> Callable[[int, int], None]:
    """``g._stream_closed``, without keeping ``g`` alive from the runtime."""
    ref = weakref.ref(g)

    def on_stream_closed(index: int, handle: int) -> None:
        graph = ref()
        if graph is not None:
            graph._stream_closed(index, handle)

    return on_stream_closed


def _still_capturing(stream: Stream) -> bool:
    try:
        return stream.is_capturing()
    except InvalidHandleError:
        return False  # closed: the backend dropped its capture with it


def _drop_abandoned_capture(runtime: Runtime, device: int) -> None:
    """Drop the device's capture if its stream was closed under it: nothing else can end it."""
    ref = _capturing.get((runtime.name, device))
    other = ref() if ref is not None else None
    if other is not None and other._stream is not None and not _still_capturing(other._stream):
        other._abort()


def _check_no_capture(runtime: Runtime, device: int) -> None:
    ref = _capturing.get((runtime.name, device))
    if ref is not None and ref() is not None:
        raise CaptureError(
            f"another graph is capturing on {runtime.device(device)}; only one capture "
            "may be under way per device. End it first."
        )


def _prepare_for_capture() -> None:
    """What ``torch.accelerator.Graph.__enter__`` does before a capture: wait for
    the device, and give cached device and page-locked memory back so the
    capture starts lean."""
    runtime = get_runtime()
    # Synchronizing would invalidate a capture under way; say why instead.
    _drop_abandoned_capture(runtime, runtime.current_index)
    _check_no_capture(runtime, runtime.current_index)
    runtime.backend.device_synchronize(runtime.current_index)
    empty_cache()
    host = registry(runtime).host
    if host is not None:
        host.empty_cache()


_side_streams: dict[tuple[str, int], Stream] = {}
_side_streams_lock = threading.Lock()


def _side_stream(runtime: Runtime, device: int) -> Stream:
    key = (runtime.name, device)
    with _side_streams_lock:
        stream = _side_streams.get(key)
        if stream is None or stream._closed:  # closed by a user inside a graph() block
            stream = _side_streams[key] = Stream(device)
        return stream


class graph:  # noqa: N801 - named like torch.cuda.graph
    """Capture into ``g`` on a side stream inside the block (``torch.cuda.graph``).

    Without ``stream``, a side stream shared by every :func:`graph` block of
    the device is used; to share a pool with an earlier capture, pass the
    same ``pool`` (and, as with torch, the same stream).

    >>> import accel
    >>> g = accel.graph.Graph()
    >>> with accel.graph.graph(g):
    ...     accel.current_stream().launch_host_func(lambda: None)
    >>> g.replay()
    """

    def __init__(
        self,
        g: Graph,
        *,
        pool: PoolId | None = None,
        stream: Stream | None = None,
        capture_error_mode: str | None = None,
    ) -> None:
        if not isinstance(g, Graph):
            raise InvalidValueError(f"accel.graph() expects an accel.Graph, got {type(g).__name__}")
        if stream is not None and not isinstance(stream, Stream):
            raise InvalidValueError(f"stream={stream!r} must be an accel.Stream or None")
        self._graph = g
        self._pool = check_pool_id(pool, where="accel.graph")
        self._mode = None if capture_error_mode is None else _check_mode(capture_error_mode, "accel.graph")
        self._stream = stream

    def __enter__(self) -> Graph:
        runtime = get_runtime()
        stream = self._stream or _side_stream(runtime, runtime.current_index)
        stream.__enter__()  # first, so the stream's device is the one prepared
        try:
            _prepare_for_capture()
            self._graph.capture_begin(pool=self._pool, capture_error_mode=self._mode)
        except BaseException:
            stream.__exit__(None, None, None)
            raise
        self._graph._block_part = self._graph._torch
        self._entered = stream
        return self._graph

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._graph.__exit__(exc_type, exc, tb)
        finally:
            self._entered.__exit__(None, None, None)


def _sweep() -> None:
    if "accel.graph._torch_capture" in sys.modules:
        from accel.graph._torch_capture import sweep

        sweep()


def is_capturing() -> bool:
    """Whether this thread's current stream is capturing into a graph.

    >>> import accel
    >>> accel.graph.is_capturing()
    False
    """
    _sweep()
    runtime = get_runtime()
    return runtime.current_stream(runtime.current_index).is_capturing()

