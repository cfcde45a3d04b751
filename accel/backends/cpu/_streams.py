"""Host streams, events and stream capture.

A created stream is an ordered work queue drained by its own worker thread,
so work is really asynchronous: a call returns before the work runs, and
``query()`` sees it pending. The default stream runs work inline on the
calling thread (it is the host, after all), which is what CUDA's default
stream looks like to a host thread that synchronizes on it.

Events are markers in those queues. Capture follows CUDA's model: while a
stream captures, work is recorded as graph nodes instead of run; an event
recorded during capture is a *captured event*, and a stream that waits on it
joins the capture (fork); the capture can only end once every forked stream
was joined back. Replay runs the nodes in recording order, which respects
every dependency recorded (recording order is a valid topological order).
"""

from __future__ import annotations

import collections
import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from accel._errors import CaptureError, InvalidHandleError
from accel.backends.base import CaptureMode, CaptureStatus

_handles = itertools.count(0x1000)


def new_handle() -> int:
    """A handle never used before in this process (handles are never recycled,
    so a stale handle is always detected)."""
    return next(_handles)


@dataclass
class Node:
    """One recorded operation of a captured graph."""

    description: str
    run: Callable[[], None]


@dataclass
class Capture:
    """State of one capture sequence, shared by the origin and forked streams."""

    origin: HostStream
    mode: CaptureMode
    nodes: list[Node] = field(default_factory=list)
    streams: set[HostStream] = field(default_factory=set)
    last_node: dict[int, int] = field(default_factory=dict)  # stream handle -> node index
    joined_upto: dict[int, int] = field(default_factory=dict)
    invalid_reason: str = ""

    def invalidate(self, reason: str) -> None:
        if not self.invalid_reason:
            self.invalid_reason = reason


class HostEvent:
    """A marker that completes when its stream's worker reaches it."""

    def __init__(self, device: int, timing: bool) -> None:
        self.handle = new_handle()
        self.device = device
        self.timing = timing
        self.cond = threading.Condition()
        self.record_gen = 0
        self.done_gen = 0
        self.timestamp_ns = 0
        # (capture, stream handle, node index) while recorded inside a capture
        self.captured: tuple[Capture, int, int] | None = None

    def complete(self, gen: int) -> None:
        with self.cond:
            if gen > self.done_gen:
                self.done_gen = gen
                self.timestamp_ns = time.monotonic_ns()
            self.cond.notify_all()

    def is_done(self) -> bool:
        return self.done_gen >= self.record_gen

    def wait(self, gen: int) -> None:
        with self.cond:
            self.cond.wait_for(lambda: self.done_gen >= gen)


class HostStream:
    """An ordered queue of work; ``inline`` streams run work on the caller's thread."""

    def __init__(self, device: int, priority: int, *, inline: bool) -> None:
        self.handle = new_handle()
        self.device = device
        self.priority = priority
        self.inline = inline
        self.capture: Capture | None = None
        self._cond = threading.Condition()
        self._queue: collections.deque[Callable[[], None] | None] = collections.deque()
        self._submitted = 0
        self._completed = 0
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(
                target=self._drain, name=f"accel-cpu{device}-stream-{self.handle:#x}", daemon=True
            )
            self._thread.start()

    def submit(self, description: str, work: Callable[[], None]) -> None:
        """Run ``work`` after everything queued before it (or record it while capturing)."""
        capture = self.capture
        if capture is not None:
            capture.nodes.append(Node(description, work))
            capture.last_node[self.handle] = len(capture.nodes) - 1
            return
        if self.inline:
            work()
            return
        with self._cond:
            self._queue.append(work)
            self._submitted += 1
            self._cond.notify_all()

    def idle(self) -> bool:
        with self._cond:
            return self._completed == self._submitted

    def synchronize(self) -> None:
        with self._cond:
            target = self._submitted
            self._cond.wait_for(lambda: self._completed >= target)

    def close(self) -> None:
        """Stop the worker once the work already queued has run."""
        if self._thread is not None:
            with self._cond:
                self._queue.append(None)
                self._cond.notify_all()

    def _drain(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: bool(self._queue))
                work = self._queue.popleft()
            if work is None:
                return
            try:
                work()
            except BaseException:  # noqa: BLE001 - a failing item must not kill the queue
                # Host functions are wrapped above the backend and report their
                # own errors; nothing else queued here can raise.
                pass
            with self._cond:
                self._completed += 1
                self._cond.notify_all()


class StreamTable:
    """Every live stream and event of the host backend, with their capture rules."""

    def __init__(self, device_count: int) -> None:
        # Reentrant: finalizers of garbage-collected streams and events destroy
        # them, and collection can run while this thread holds the lock.
        self._lock = threading.RLock()
        self._streams: dict[int, HostStream] = {}
        self._events: dict[int, HostEvent] = {}
        self._graphs: dict[int, list[Node]] = {}
        self._execs: dict[int, list[Node]] = {}
        self.defaults = []
        for device in range(device_count):
            stream = HostStream(device, 0, inline=True)
            self._streams[stream.handle] = stream
            self.defaults.append(stream)

    # -- lookups ----------------------------------------------------------

    def stream(self, device: int, handle: int) -> HostStream:
        stream = self._streams.get(handle)
        if stream is None or stream.device != device:
            raise InvalidHandleError(
                f"cpu:{device}: stream handle {handle:#x} is not a live stream of this device "
                "(destroyed, never created, or created on another device)"
            )
        return stream

    def event(self, device: int | None, handle: int) -> HostEvent:
        """The live event ``handle`` of ``device`` (of any device when None)."""
        event = self._events.get(handle)
        if event is None or device is not None and event.device != device:
            raise InvalidHandleError(
                f"cpu:{device}: event handle {handle:#x} is not a live event of this device "
                "(destroyed, never created, or created on another device)"
            )
        return event

    def streams_of(self, device: int) -> list[HostStream]:
        with self._lock:
            return [s for s in self._streams.values() if s.device == device]

    # -- streams ----------------------------------------------------------

    def create_stream(self, device: int, priority: int) -> int:
        stream = HostStream(device, priority, inline=False)
        with self._lock:
            self._streams[stream.handle] = stream
        return stream.handle

    def destroy_stream(self, device: int, handle: int) -> None:
        stream = self.stream(device, handle)
        if stream.inline:
            raise InvalidHandleError(f"cpu:{device}: the default stream cannot be destroyed")
        if stream.capture is not None:
            stream.capture.invalidate(f"stream {handle:#x} was destroyed while capturing")
        with self._lock:
            del self._streams[handle]
        stream.close()

    def query(self, device: int, handle: int) -> bool:
        stream = self.stream(device, handle)
        self._refuse_during_capture(stream, "querying a stream")
        return stream.idle()

    def synchronize(self, device: int, handle: int) -> None:
        stream = self.stream(device, handle)
        self._refuse_during_capture(stream, "synchronizing a stream")
        stream.synchronize()

    def synchronize_device(self, device: int) -> None:
        streams = self.streams_of(device)
        for stream in streams:
            if stream.capture is not None:
                stream.capture.invalidate("the device was synchronized during capture")
                raise CaptureError(
                    f"cpu:{device}: cannot synchronize the device while stream "
                    f"{stream.handle:#x} is capturing; the capture is now invalidated. "
                    "End the capture first."
                )
        for stream in streams:
            stream.synchronize()

    def _refuse_during_capture(self, stream: HostStream, what: str) -> None:
        if stream.capture is not None:
            stream.capture.invalidate(f"{what} is not allowed during capture")
            raise CaptureError(
                f"cpu:{stream.device}: {what} is not allowed while stream {stream.handle:#x} "
                "is capturing; the capture is now invalidated. End the capture, then synchronize."
            )

    # -- events -----------------------------------------------------------

    def create_event(self, device: int, timing: bool) -> int:
        event = HostEvent(device, timing)
        with self._lock:
            self._events[event.handle] = event
        return event.handle

    def destroy_event(self, device: int, handle: int) -> None:
        self.event(device, handle)
        with self._lock:
            del self._events[handle]

    def record(self, device: int, event_handle: int, stream_handle: int) -> None:
        event = self.event(device, event_handle)
        stream = self.stream(device, stream_handle)
        capture = stream.capture
        if capture is not None:
            event.captured = (capture, stream.handle, capture.last_node.get(stream.handle, -1))
            return
        event.captured = None
        with event.cond:
            event.record_gen += 1
            gen = event.record_gen
        stream.submit("event record", lambda: event.complete(gen))

    def _live_capture_of(self, event: HostEvent) -> tuple[Capture, int, int] | None:
        captured = event.captured
        if captured is None:
            return None
        capture = captured[0]
        return captured if capture.origin.capture is capture else None

    def event_query(self, device: int, handle: int) -> bool:
        event = self.event(device, handle)
        self._refuse_captured(event, "querying")
        return event.is_done()

    def event_synchronize(self, device: int, handle: int) -> None:
        event = self.event(device, handle)
        self._refuse_captured(event, "synchronizing")
        event.wait(event.record_gen)

    def _refuse_captured(self, event: HostEvent, what: str) -> None:
        if self._live_capture_of(event) is not None:
            raise CaptureError(
                f"cpu:{event.device}: {what} event {event.handle:#x} is not allowed: it was "
                "recorded inside a capture that is still running"
            )

    def wait_event(self, device: int, stream_handle: int, event_handle: int) -> None:
        stream = self.stream(device, stream_handle)
        event = self.event(None, event_handle)  # streams may wait on events of any device
        captured = self._live_capture_of(event)
        if captured is not None:
            self._join_capture(stream, event, captured)
            return
        if stream.capture is not None:
            stream.capture.invalidate("a capturing stream waited on an event recorded outside the capture")
            raise CaptureError(
                f"cpu:{device}: stream {stream.handle:#x} is capturing and cannot wait on event "
                f"{event.handle:#x}, which was recorded outside the capture (the dependency would "
                "cross the capture boundary); the capture is now invalidated. Record the event "
                "before beginning the capture and synchronize instead."
            )
        target = event.record_gen
        if target == 0:
            return  # never recorded: waiting on it is a no-op, as in CUDA
        stream.submit("wait event", lambda: event.wait(target))

    def _join_capture(self, stream: HostStream, event: HostEvent, captured: tuple[Capture, int, int]) -> None:
        capture, source, node = captured
        if stream.capture is None:
            if stream.inline:
                capture.invalidate("the default stream waited on a captured event")
                raise CaptureError(
                    f"cpu:{stream.device}: the default stream cannot join a capture; fork "
                    "capture work onto a created stream instead. The capture is now invalidated."
                )
            stream.capture = capture  # fork: this stream now records into the same graph
            capture.streams.add(stream)
        elif stream.capture is not capture:
            stream.capture.invalidate("two captures were merged")
            raise CaptureError(
                f"cpu:{stream.device}: stream {stream.handle:#x} waits on an event of another "
                "capture; captures cannot be merged. The capture is now invalidated."
            )
        if source != stream.handle:
            capture.joined_upto[source] = max(capture.joined_upto.get(source, -1), node)

    # -- capture and graphs -------------------------------------------------

    def begin_capture(self, device: int, handle: int, mode: CaptureMode) -> None:
        stream = self.stream(device, handle)
        if stream.inline:
            raise CaptureError(
                f"cpu:{device}: graphs must be captured on a created stream, not the default "
                "stream (replay may run on any stream). Use `with accel.Stream():`."
            )
        if stream.capture is not None:
            raise CaptureError(f"cpu:{device}: stream {handle:#x} is already capturing")
        capture = Capture(origin=stream, mode=CaptureMode(mode))
        capture.streams.add(stream)
        stream.capture = capture

    def capture_status(self, device: int, handle: int) -> CaptureStatus:
        stream = self.stream(device, handle)
        if stream.capture is None:
            return CaptureStatus.NONE
        return CaptureStatus.INVALIDATED if stream.capture.invalid_reason else CaptureStatus.ACTIVE

    def end_capture(self, device: int, handle: int) -> int:
        stream = self.stream(device, handle)
        capture = stream.capture
        if capture is None:
            raise CaptureError(f"cpu:{device}: stream {handle:#x} is not capturing")
        if capture.origin is not stream:
            capture.invalidate("the capture was ended on a stream other than the one that began it")
            raise CaptureError(
                f"cpu:{device}: end the capture on stream {capture.origin.handle:#x}, which began "
                f"it, not on the forked stream {handle:#x}; the capture is now invalidated"
            )
        for member in capture.streams:
            member.capture = None
        if capture.invalid_reason:
            raise CaptureError(f"cpu:{device}: the capture was invalidated: {capture.invalid_reason}")
        for member in capture.streams:
            if member is stream:
                continue
            last = capture.last_node.get(member.handle, -1)
            if last > capture.joined_upto.get(member.handle, -1):
                raise CaptureError(
                    f"cpu:{device}: forked stream {member.handle:#x} was not joined back into the "
                    "capturing stream: record an event on it after its last work and make the "
                    "origin stream wait on that event before ending the capture"
                )
        graph = new_handle()
        with self._lock:
            self._graphs[graph] = list(capture.nodes)
        return graph

    def graph_nodes(self, graph: int) -> list[Node]:
        nodes = self._graphs.get(graph)
        if nodes is None:
            raise InvalidHandleError(f"graph handle {graph:#x} is not a live captured graph")
        return nodes

    def instantiate(self, graph: int) -> int:
        nodes = self.graph_nodes(graph)
        graph_exec = new_handle()
        with self._lock:
            self._execs[graph_exec] = list(nodes)
        return graph_exec

    def launch(self, device: int, graph_exec: int, stream_handle: int) -> None:
        nodes = self._execs.get(graph_exec)
        if nodes is None:
            raise InvalidHandleError(f"executable graph handle {graph_exec:#x} is not live")
        stream = self.stream(device, stream_handle)
        if stream.capture is not None:
            raise CaptureError(f"cpu:{device}: launching a graph inside a capture is not supported")
        runs = [node.run for node in nodes]

        def replay() -> None:
            for run in runs:
                run()

        stream.submit("graph launch", replay)

    def destroy_graph(self, graph: int) -> None:
        with self._lock:
            if self._graphs.pop(graph, None) is None:
                raise InvalidHandleError(f"graph handle {graph:#x} is not a live captured graph")

    def destroy_exec(self, graph_exec: int) -> None:
        with self._lock:
            if self._execs.pop(graph_exec, None) is None:
                raise InvalidHandleError(f"executable graph handle {graph_exec:#x} is not live")
