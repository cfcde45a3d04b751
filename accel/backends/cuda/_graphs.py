"""Host functions, stream capture and graphs of the CUDA backend, and when their callables are let go.

A host function is a Python callable behind one cffi trampoline; the driver
runs it on its own thread. A plain launch's callable is let go (on a user
thread) once it ran. A callable captured into a graph is owned by the
capture, the graph, every executable graph made from it and every replay
that may still run; an executable graph destroyed while replays are queued
is retired: its callables are let go once events recorded after those
replays completed (or at the next device synchronize).

:class:`GraphsAndHostFunctions` is a part of :class:`~accel.backends.cuda._backend.CudaBackend`
(a mixin): it calls the driver through the backend's plumbing, declared below
for type checkers.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accel._errors import AccelError, CaptureError, InvalidHandleError, NotSupportedError
from accel.backends.base import CaptureMode, CaptureStatus
from accel.backends.cuda._constants import (
    CUDA_ERROR_CAPTURED_EVENT,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
    CUDA_ERROR_STREAM_CAPTURE_UNJOINED,
    CUDA_SUCCESS,
    CU_EVENT_DISABLE_TIMING,
    CU_EVENT_RECORD_EXTERNAL,
    CU_EVENT_WAIT_EXTERNAL,
    CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE,
)
from accel.backends.cuda._host_functions import HostFunctions

if TYPE_CHECKING:
    from accel.backends.cuda._bindings import Driver

__all__ = ["GraphsAndHostFunctions"]


class GraphsAndHostFunctions:
    """Host functions, capture, graphs and graph retirement (mixed into CudaBackend)."""

    # The backend's driver plumbing this part calls through (set or defined by CudaBackend).
    _driver: Driver
    _ffi: Any
    _fn: dict[str, Any]
    _lock: threading.RLock

    if TYPE_CHECKING:

        def _enter(self, device: int) -> bool: ...
        def _leave(self, device: int, pushed: bool) -> None: ...
        def _check(self, call: str, code: int, device: int | None, *, handle: str = "", capture: bool = False,
                   requested: int = 0) -> None: ...
        def _stream(self, stream: int) -> Any: ...
        def _event(self, event: int) -> Any: ...
        def _address(self, cdata: Any) -> int: ...
        def _relaxed_capture_mode(self, device: int) -> contextlib.AbstractContextManager[None]: ...
        def _create_event(self, device: int, flags: int) -> int: ...
        def _record_event(self, device: int, event: int, stream: int) -> None: ...
        def _destroy_event(self, device: int, event: int) -> None: ...

    def _init_graphs_and_host_functions(self) -> None:
        self._host_fns = HostFunctions()
        # One callback for every host function: userData carries the registry key.
        self._trampoline = self._ffi.callback("void(void *)", self._run_host_function)
        # Callables that ran, waiting to be let go on a user thread (see _run_host_function).
        self._spent: collections.deque[Callable[[], None] | BaseException] = collections.deque()
        self._capture_keys: dict[int, list[int]] = {}
        # Orders launches into a capturing stream against the end of that
        # capture: a launch reads the capture id, launches and files its host
        # functions under the id before the capture can be ended (else they
        # would be filed under a capture that is gone, and never let go).
        # Holding it across driver calls is fine because it covers only
        # cuStreamGetCaptureInfo (a host-side query) and calls made while the
        # stream captures: then cuLaunchHostFunc and cuGraphLaunch only add
        # nodes to the capture's graph on the host, cuStreamEndCapture only
        # finishes that graph, and none of them waits for the device. A launch
        # on a stream that does not capture (which can block while the
        # device's queue is full) never holds it. Taken before self._lock,
        # never after. Reentrant: a finalizer run on this thread while it is
        # held (Graph.__del__ ending its capture) must not deadlock; at worst
        # the outer launch then files under a capture that just ended, and
        # that host function is kept for the life of the backend.
        self._capture_lock = threading.RLock()
        self._graph_keys: dict[int, list[int]] = {}
        self._exec_keys: dict[int, list[int]] = {}
        # Per executable graph with host functions: an event per stream it was
        # launched on, re-recorded after each launch (marks its last replay there).
        self._exec_events: dict[int, dict[int, int]] = {}
        # Per device: (events, keys) of launches that may still run, whose
        # owners are gone; released once every event completed. Events None:
        # released by the next device_synchronize (no event marks the launch).
        self._retiring: dict[int, list[tuple[list[int] | None, list[int]]]] = {}
        self._detached_ids = itertools.count(1)
        # Capture id -> detached handle, until the handle is released: what is
        # launched into a capture after it was detached (another thread, in a
        # relaxed capture, before torch ends it) goes to the handle.
        self._detached_captures: dict[int, int] = {}

    def launch_host_func(self, device: int, stream: int, fn: Callable[[], None]) -> None:
        self._drop_spent()
        pushed = self._enter(device)
        try:
            with self._capture_lock:
                capture_id = self._capture_id(device, stream)
                if capture_id:
                    self._launch_host_function(device, stream, fn, capture_id)
                    return
            key = self._launch_host_function(device, stream, fn, 0)
            # Another thread may have begun a capture on this stream (or joined
            # it to one) between the check and the launch, and the driver may
            # have captured the function. If the stream captures now, that
            # capture owns the function too: at worst one that ran already is
            # kept until the graph goes. (A capture begun and ended in that
            # window goes unseen: CUDA leaves that race to the application.)
            with self._capture_lock:
                capture_id = self._capture_id(device, stream)
                if capture_id and self._host_fns.share(key):
                    with self._lock:
                        self._file_under_capture(capture_id, [key])
        finally:
            self._leave(device, pushed)

    def _launch_host_function(self, device: int, stream: int, fn: Callable[[], None], capture_id: int) -> int:
        """Queue ``fn`` on ``stream``, filed under ``capture_id`` when that capture records it; its key."""
        key = self._host_fns.add(fn, shared=capture_id != 0)
        code = self._fn["cuLaunchHostFunc"](self._stream(stream), self._trampoline, self._ffi.cast("void *", key))
        if code != CUDA_SUCCESS:
            self._host_fns.discard(key)
            self._check("cuLaunchHostFunc", code, device, handle=f"stream {stream:#x}")
        if capture_id:
            with self._lock:
                self._file_under_capture(capture_id, [key])
        return key

    def _file_under_capture(self, capture_id: int, keys: list[int]) -> None:
        """Hand ``keys`` (already counted for it) to a capture, or to its detached handle; self._lock held."""
        handle = self._detached_captures.get(capture_id)
        if handle is not None:
            self._exec_keys[-handle].extend(keys)
        else:
            self._capture_keys.setdefault(capture_id, []).extend(keys)

    def _run_host_function(self, data: Any) -> None:
        # Runs on the driver's callback thread and makes no driver call, so it
        # neither needs nor changes that thread's current context. Nor may the
        # callable die here: finalizers of what its closure holds (an accel
        # Event's, a torch tensor's) call CUDA, which CUDA forbids on this
        # thread. The next launch_host_func, graph_launch or synchronize on a
        # user thread lets go of it, and of the exception it raised, whose
        # traceback holds the call's frames; cffi reports that exception
        # through sys.unraisablehook.
        fn, one_shot = self._host_fns.take(self._address(data))
        if fn is not None:
            try:
                fn()
            except BaseException as exc:
                self._spent.append(exc)
                raise
            finally:
                if one_shot:  # a graph's callable stays in the registry and goes on a user thread
                    self._spent.append(fn)

    def _drop_spent(self) -> None:
        """Let go of host functions that ran, on this (user) thread."""
        spent = self._spent
        while spent:
            try:
                spent.popleft()
            except IndexError:  # another thread emptied it first
                return

    def pending_host_functions(self) -> int:
        """How many host functions are held (queued, or owned by graphs); for leak checks.

        Those of destroyed executable graphs are let go by the next
        device_synchronize, graph_instantiate or graph_exec_destroy after their
        last replay ran (those of a replay raced by a capture begin only by
        the next device_synchronize).
        """
        return len(self._host_fns)

    # -- capture and graphs ------------------------------------------------

    def supports_graphs(self, device: int) -> bool:
        return self._driver.has_graphs

    def _require_graphs(self, device: int) -> None:
        if not self._driver.has_graphs:
            raise NotSupportedError(
                f"cuda:{device}: the CUDA driver {self._driver.path} lacks the stream capture / graph entry points"
            )

    def _capture_id(self, device: int, stream: int) -> int:
        """The id of the capture ``stream`` takes part in (0 when it is not capturing)."""
        if not self._driver.has_graphs:
            return 0
        ffi = self._ffi
        status = ffi.new("int *")
        ident = ffi.new("cuuint64_t *")
        info = self._fn["cuStreamGetCaptureInfo"]
        if self._driver.symbols["cuStreamGetCaptureInfo"].endswith("_v3"):
            code = info(self._stream(stream), status, ident, ffi.NULL, ffi.NULL, ffi.NULL, ffi.NULL)
        else:
            code = info(self._stream(stream), status, ident, ffi.NULL, ffi.NULL, ffi.NULL)
        self._check("cuStreamGetCaptureInfo", code, device, handle=f"stream {stream:#x}")
        return int(ident[0]) if status[0] != CaptureStatus.NONE else 0

    def stream_begin_capture(self, device: int, stream: int, mode: CaptureMode) -> None:
        self._require_graphs(device)
        pushed = self._enter(device)
        try:
            code = self._fn["cuStreamBeginCapture"](self._stream(stream), int(mode))
        finally:
            self._leave(device, pushed)
        self._check("cuStreamBeginCapture", code, device, handle=f"stream {stream:#x}", capture=True)

    def stream_end_capture(self, device: int, stream: int) -> int:
        self._require_graphs(device)
        out = self._ffi.new("CUgraph *")
        keys: list[int] = []
        pushed = self._enter(device)
        try:
            with self._capture_lock:  # no launch is between recording and filing its host functions
                capture_id = self._capture_id(device, stream)
                code = self._fn["cuStreamEndCapture"](self._stream(stream), out)
                ended = code in (CUDA_SUCCESS, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED,
                                 CUDA_ERROR_STREAM_CAPTURE_UNJOINED)
                if ended and capture_id:
                    with self._lock:
                        keys = self._capture_keys.pop(capture_id, [])
        finally:
            self._leave(device, pushed)
        if code != CUDA_SUCCESS:
            self._host_fns.release(keys)  # the capture is discarded: its host functions never run
            self._check("cuStreamEndCapture", code, device, handle=f"stream {stream:#x}", capture=True)
        graph = self._address(out[0])
        if keys:
            with self._lock:
                self._graph_keys[graph] = keys
        return graph

    def _end_capture_of_destroyed_stream(self, device: int, stream: int) -> None:
        """``stream`` is about to be destroyed: end the capture it takes part in first.

        CUDA leaves destroying a capturing stream undefined, and nothing could
        end its capture afterwards, so the host functions recorded into it
        would never be released. Ending it on a forked stream fails
        (CUDA_ERROR_STREAM_CAPTURE_UNMATCHED) and invalidates the capture,
        which the stream that began it then ends."""
        if not self._capture_id(device, stream):
            return
        try:
            graph = self.stream_end_capture(device, stream)
        except AccelError:
            return
        self.graph_destroy(device, graph)

    def event_record_external(self, device: int, event: int, stream: int) -> None:
        record = self._fn.get("cuEventRecordWithFlags")
        if record is None:
            raise NotSupportedError(
                f"cuda:{device}: the CUDA driver {self._driver.path} lacks cuEventRecordWithFlags (CUDA 11.1), "
                "which a capture needs to keep an event record; update the driver"
            )
        pushed = self._enter(device)
        try:
            # The external flag is an error outside a capture (as torch's CUDAEvent notes).
            flags = CU_EVENT_RECORD_EXTERNAL if self._capture_id(device, stream) else 0
            code = record(self._event(event), self._stream(stream), flags)
        finally:
            self._leave(device, pushed)
        self._check("cuEventRecordWithFlags", code, device, handle=f"event {event:#x} or stream {stream:#x}")

    def stream_wait_event_external(self, device: int, stream: int, event: int) -> None:
        pushed = self._enter(device)
        try:
            # The external flag is an error outside a capture (as torch's CUDAEvent notes);
            # inside one it makes an event-wait node instead of a fork or a refusal.
            flags = CU_EVENT_WAIT_EXTERNAL if self._capture_id(device, stream) else 0
            code = self._fn["cuStreamWaitEvent"](self._stream(stream), self._event(event), flags)
        finally:
            self._leave(device, pushed)
        self._check("cuStreamWaitEvent", code, device, handle=f"stream {stream:#x} or event {event:#x}")

    def stream_capture_id(self, device: int, stream: int) -> int:
        pushed = self._enter(device)
        try:
            return self._capture_id(device, stream)
        finally:
            self._leave(device, pushed)

    def stream_capture_status(self, device: int, stream: int) -> CaptureStatus:
        if not self._driver.has_graphs:
            return CaptureStatus.NONE
        out = self._ffi.new("int *")
        pushed = self._enter(device)
        try:
            code = self._fn["cuStreamIsCapturing"](self._stream(stream), out)
        finally:
            self._leave(device, pushed)
        self._check("cuStreamIsCapturing", code, device, handle=f"stream {stream:#x}")
        return CaptureStatus(out[0])

    def graph_instantiate(self, device: int, graph: int) -> int:
        self._require_graphs(device)
        out = self._ffi.new("CUgraphExec *")
        pushed = self._enter(device)
        try:
            self._retire_quietly(device)
            code = self._fn["cuGraphInstantiateWithFlags"](out, self._ffi.cast("CUgraph", graph), 0)
        finally:
            self._leave(device, pushed)
        self._check("cuGraphInstantiateWithFlags", code, device, handle=f"graph {graph:#x}")
        graph_exec = self._address(out[0])
        with self._lock:
            keys = self._graph_keys.get(graph)
            if keys:
                self._host_fns.retain(keys)
                self._exec_keys[graph_exec] = list(keys)
        return graph_exec

    def graph_launch(self, device: int, graph_exec: int, stream: int) -> None:
        self._require_graphs(device)
        self._drop_spent()
        pushed = self._enter(device)
        try:
            keys = self._exec_keys.get(graph_exec)
            if keys:
                with self._capture_lock:
                    capture_id = self._capture_id(device, stream)
                    if capture_id:
                        # Launched inside a capture: the new graph replays these host functions too.
                        self._launch_graph(device, graph_exec, stream)
                        self._capture_owns(capture_id, keys)
                        return
            self._launch_graph(device, graph_exec, stream)
            if keys:
                self._hold_for_launch(device, graph_exec, keys, stream)
        finally:
            self._leave(device, pushed)

    def _launch_graph(self, device: int, graph_exec: int, stream: int) -> None:
        code = self._fn["cuGraphLaunch"](self._ffi.cast("CUgraphExec", graph_exec), self._stream(stream))
        self._check("cuGraphLaunch", code, device, handle=f"executable graph {graph_exec:#x} or stream {stream:#x}")

    def _capture_owns(self, capture_id: int, keys: list[int]) -> None:
        with self._lock:
            self._host_fns.retain(keys)
            self._file_under_capture(capture_id, keys)

    def _hold_for_launch(self, device: int, owner: int, keys: list[int], stream: int) -> None:
        """Keep ``owner``'s host functions ``keys`` until its launch just queued on ``stream`` ran.

        Called with ``device``'s context current. Normally an event recorded
        after the launch marks when it ran. As in launch_host_func, another
        thread may begin a capture on the stream around the launch: then the
        capture may have recorded the launch, so it owns the host functions
        too, and the launch may also have been queued before the capture
        began. An event recorded now would go into the capture and mark
        nothing, so that possible eager launch holds them until the device's
        next synchronize instead. The same holds when the capture began
        between the check and the event's record.
        """
        with self._capture_lock:
            capture_id = self._capture_id(device, stream)
            if capture_id:
                self._capture_owns(capture_id, keys)
                self._hold_until_synchronize(device, keys)
                return
        try:
            with self._lock:
                # Only our own event marks when this replay is over; the stream
                # itself may be destroyed before the executable graph is.
                events = self._exec_events.setdefault(owner, {})
                event = events.get(stream)
                if event is None:
                    event = events[stream] = self._create_event(device, CU_EVENT_DISABLE_TIMING)
            # Not under the lock: the record may wait for room in the stream's queue.
            self._record_event(device, event, stream)
        except AccelError:
            self._hold_until_synchronize(device, keys)  # the launch is queued all the same
            raise
        if self._capture_id(device, stream):
            # The capture may have recorded the event, which then marks no
            # eager work (the next eager record re-arms it; a check that meets
            # it captured holds until synchronize): the device's next
            # synchronize guards this launch instead.
            self._hold_until_synchronize(device, keys)

    def _hold_until_synchronize(self, device: int, keys: list[int]) -> None:
        """Keep ``keys`` (one more reference) until the next device_synchronize on ``device``."""
        with self._lock:
            self._host_fns.retain(keys)
            self._retiring.setdefault(device, []).append((None, list(keys)))

    def graph_node_count(self, device: int, graph: int) -> int | None:
        self._require_graphs(device)
        count = self._ffi.new("size_t *")
        pushed = self._enter(device)
        try:
            # A NULL node array asks only for the count.
            code = self._fn["cuGraphGetNodes"](self._ffi.cast("CUgraph", graph), self._ffi.NULL, count)
        finally:
            self._leave(device, pushed)
        self._check("cuGraphGetNodes", code, device, handle=f"graph {graph:#x}")
        return int(count[0])

    def graph_destroy(self, device: int, graph: int) -> None:
        self._require_graphs(device)
        pushed = self._enter(device)
        try:
            code = self._fn["cuGraphDestroy"](self._ffi.cast("CUgraph", graph))
        finally:
            self._leave(device, pushed)
        self._check("cuGraphDestroy", code, device, handle=f"graph {graph:#x}")
        with self._lock:
            keys = self._graph_keys.pop(graph, [])
        self._host_fns.release(keys)

    def graph_exec_destroy(self, device: int, graph_exec: int) -> None:
        self._require_graphs(device)
        pushed = self._enter(device)
        try:
            code = self._fn["cuGraphExecDestroy"](self._ffi.cast("CUgraphExec", graph_exec))
            self._check("cuGraphExecDestroy", code, device, handle=f"executable graph {graph_exec:#x}")
            self._retire(device, graph_exec)
        finally:
            self._leave(device, pushed)

    def _retire(self, device: int, owner: int) -> None:
        """``owner`` is gone: release its host functions once its launches finished.

        Called with ``device``'s context current.
        """
        with self._lock:
            keys = self._exec_keys.pop(owner, [])
            events = list(self._exec_events.pop(owner, {}).values())
            if keys:
                # CUDA lets replays already queued finish after cuGraphExecDestroy,
                # so the callables stay until the replays' events completed.
                self._retiring.setdefault(device, []).append((events, keys))
        self._retire_quietly(device)

    def _retire_quietly(self, device: int) -> None:
        """Housekeeping inside an unrelated call: a failing check must not fail
        that call (its own work is done). The entries stay parked, and
        device_synchronize retries them and reports the error."""
        with contextlib.suppress(AccelError):
            self._retire_finished(device)

    # A detached capture's host functions are owned like an executable
    # graph's, under a negative key: executable graph handles are addresses,
    # so the two never collide.

    def stream_capture_detach(self, device: int, stream: int) -> int:
        self._require_graphs(device)
        pushed = self._enter(device)
        try:
            with self._capture_lock:  # no host function is being filed under the capture meanwhile
                capture_id = self._capture_id(device, stream)
                if not capture_id:
                    raise CaptureError(
                        f"cuda:{device}: stream {stream:#x} is not capturing; there is no capture to detach"
                    )
                with self._lock:
                    handle = self._detached_captures.get(capture_id)
                    if handle is None:
                        # A handle even with nothing filed yet: a launch may
                        # still come before the other runtime ends the capture.
                        handle = next(self._detached_ids)
                        self._exec_keys[-handle] = self._capture_keys.pop(capture_id, [])
                        self._detached_captures[capture_id] = handle
            return handle
        finally:
            self._leave(device, pushed)

    def detached_graph_launched(self, device: int, handle: int, stream: int) -> None:
        keys = self._exec_keys.get(-handle)
        if keys is None:
            raise InvalidHandleError(f"cuda:{device}: {handle} is not a live detached-capture handle")
        self._drop_spent()  # torch drives these replays: accel's other entry points may not run
        if not keys:
            return  # the capture holds no host functions: nothing to guard
        pushed = self._enter(device)
        try:
            self._hold_for_launch(device, -handle, keys, stream)
        finally:
            self._leave(device, pushed)

    def graph_holds_host_functions(self, device: int, graph: int) -> bool:
        return bool(self._graph_keys.get(graph))

    def detached_graph_holds_host_functions(self, device: int, handle: int) -> bool:
        keys = self._exec_keys.get(-handle)
        if keys is None:
            raise InvalidHandleError(f"cuda:{device}: {handle} is not a live detached-capture handle")
        return bool(keys)

    def detached_graph_release(self, device: int, handle: int) -> None:
        if -handle not in self._exec_keys:
            raise InvalidHandleError(f"cuda:{device}: {handle} is not a live detached-capture handle")
        with self._lock:
            for capture_id in [c for c, h in self._detached_captures.items() if h == handle]:
                del self._detached_captures[capture_id]
        pushed = self._enter(device)
        try:
            self._retire(device, -handle)
        finally:
            self._leave(device, pushed)

    def _retire_finished(self, device: int) -> None:
        """Release host functions of launches whose owners are gone once those launches are over.

        Called inside an entry point, with ``device``'s context current. If it
        raises, what it did not get to stays for the next call.
        """
        if not self._retiring.get(device):
            return
        with self._lock:
            entries = self._retiring.pop(device, [])
        keep: list[tuple[list[int] | None, list[int]]] = []
        done: list[tuple[list[int] | None, list[int]]] = []
        index = 0
        try:
            # Relaxed: an event query must not invalidate another thread's global capture.
            with self._relaxed_capture_mode(device):
                while index < len(entries):
                    events, keys = entries[index]
                    over = self._launches_over(device, events) if events is not None else False
                    index += 1
                    if over is None:  # an event went into a capture: wait for a synchronize instead
                        done.append((events, []))
                        keep.append((None, keys))
                    elif over:
                        done.append((events, keys))
                    else:
                        keep.append((events, keys))
        except BaseException:
            # Nothing is lost: what was found over is checked again next time.
            self._park(device, done + keep + entries[index:])
            raise
        self._park(device, keep)
        self._release_retired(device, done)

    def _launches_over(self, device: int, events: list[int]) -> bool | None:
        """Whether every event completed; None when one was last recorded in a capture (it marks nothing)."""
        query = self._fn["cuEventQuery"]
        for event in events:
            code = query(self._event(event))
            if code == CUDA_ERROR_NOT_READY:
                return False
            if code == CUDA_ERROR_CAPTURED_EVENT:
                return None
            self._check("cuEventQuery", code, device, handle=f"event {event:#x}")
        return True

    def _park(self, device: int, entries: list[tuple[list[int] | None, list[int]]]) -> None:
        """Put retiring entries back for a later check."""
        if entries:
            with self._lock:
                self._retiring.setdefault(device, []).extend(entries)

    def _release_retired(self, device: int, entries: list[tuple[list[int] | None, list[int]]]) -> None:
        """Release the keys of finished entries and destroy their events (context current)."""
        for _, keys in entries:
            self._host_fns.release(keys)
        events = [event for owned, _ in entries for event in owned or ()]
        if events:
            with self._relaxed_capture_mode(device):  # as for the queries
                for event in events:
                    self._destroy_event(device, event)

    def graph_debug_dump(self, device: int, graph: int, path: str) -> None:
        dot = self._fn.get("cuGraphDebugDotPrint")
        if dot is None:
            raise NotSupportedError(
                f"cuda:{device}: the CUDA driver {self._driver.path} does not export cuGraphDebugDotPrint"
            )
        pushed = self._enter(device)
        try:
            code = dot(self._ffi.cast("CUgraph", graph), path.encode(), CU_GRAPH_DEBUG_DOT_FLAGS_VERBOSE)
        finally:
            self._leave(device, pushed)
        self._check("cuGraphDebugDotPrint", code, device, handle=f"graph {graph:#x}" if code == 1 else "")
