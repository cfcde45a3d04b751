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
was joined back (``accel.backends._capture`` keeps those rules, for every
backend that captures by itself). Replay runs the nodes in recording order,
which respects every dependency recorded (recording order is a valid
topological order).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import errno
import ctypes
import fcntl
import functools
import itertools
import os
import queue
import select
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from accel._errors import (
    CaptureError,
    DriverError,
    InvalidHandleError,
    InvalidValueError,
    NotSupportedError,
    function_name,
)
from accel.backends import _capture
from accel.backends._capture import Capture, Mark
from accel.backends.base import CaptureMode, CaptureStatus
from accel.backends.cpu import _libc
from accel.backends.cpu._memory import export_dup

_handles = itertools.count(0x1000)

# How long interpreter exit waits for work still queued on host streams (their
# worker threads are daemons: whatever is left when the interpreter ends is lost).
EXIT_WAIT_S = 5.0


def _finish_at_exit(table_ref: weakref.ref[StreamTable]) -> None:
    table = table_ref()
    if table is None or table.pid != os.getpid():
        return  # a forked child has no workers: the parent runs its queued work
    dropped = table.finish_queued_work(EXIT_WAIT_S)
    if dropped:
        warnings.warn_explicit(  # no user frame to point at during exit
            f"{dropped} item(s) of work queued on host streams (host functions, copies, fills) "
            f"were still pending {EXIT_WAIT_S:g} s into interpreter exit and were dropped; "
            "synchronize streams before exiting",
            RuntimeWarning,
            "accel",
            0,
        )


def _forked(table_ref: weakref.ref[StreamTable]) -> None:
    """In a forked child the streams have no workers: host functions must take the
    full path (which the runtime refuses there) instead of the direct append."""
    table = table_ref()
    if table is not None:
        for stream in list(table._streams.values()) + table._closing:
            stream.direct = False


def new_handle() -> int:
    """A handle never used before in this process (handles are never recycled,
    so a stale handle is always detected)."""
    return next(_handles)


@dataclass
class Node:
    """One recorded operation of a captured graph: ``run`` runs it, or, for
    nodes that read an event when a replay is queued (event records and
    external waits, as CUDA's ``cuGraphLaunch`` issues them), ``issue`` is
    called at each launch and returns what that replay runs."""

    description: str
    run: Callable[[], None] | None
    issue: Callable[[], Callable[[], None]] | None = None

    def launched(self) -> Callable[[], None]:
        """What one replay runs for this node, issued now."""
        if self.issue is not None:
            return self.issue()
        assert self.run is not None
        return self.run


class HostEvent:
    """A marker that completes when its stream's worker reaches it.

    ``done_gen`` is written by one completer at a time and read without a lock
    (the GIL orders it); the condition is only used by a thread that has to
    wait, and only notified when one does.
    """

    # Class-level defaults rather than assignments in __init__: SharedHostEvent
    # keeps these two counts in shared memory instead.
    record_gen = 0
    done_gen = 0

    def __init__(self, device: int, timing: bool) -> None:
        self.handle = new_handle()
        self.device = device
        self.timing = timing
        self.cond = threading.Condition(threading.Lock())
        self.timestamp_ns = 0
        self._waiting = 0
        self.captured: Mark | None = None  # where it was recorded inside a capture

    def next_gen(self) -> int:
        """Count a new record; its generation."""
        with self.cond:
            self.record_gen += 1
            return self.record_gen

    def complete(self, gen: int) -> None:
        if gen > self.done_gen:
            self.timestamp_ns = time.monotonic_ns()
            self.done_gen = gen
        # A waiter counts itself before it checks done_gen: it either sees the new
        # value or is counted here (and then waits on the condition this notifies).
        if self._waiting:
            with self.cond:
                self.cond.notify_all()

    def is_done(self) -> bool:
        return self.done_gen >= self.record_gen

    def wait(self, gen: int) -> None:
        if self.done_gen >= gen:
            return
        with self.cond:
            self._waiting += 1
            try:
                while self.done_gen < gen:
                    self.cond.wait()
            finally:
                self._waiting -= 1


def _issue_record(event: HostEvent) -> Callable[[], None]:
    """An event record node, issued by a launch: the record counts from the launch
    on (a query, synchronize or wait after it waits for this replay's record), and
    completes where the replay reaches the node."""
    gen = event.next_gen()
    return lambda: event.complete(gen)


def _issue_wait(event: HostEvent) -> Callable[[], None]:
    """An external event wait node, issued by a launch: the replay waits there for
    the event's last record as of the launch (none: nothing to wait for)."""
    target = event.record_gen
    return (lambda: event.wait(target)) if target else _nothing


def _nothing() -> None:
    """A node with nothing to do in this replay."""


# How often a process polls an event that another process completes (it cannot
# be woken by that process's condition variable): from 20 µs, doubling, to 2 ms.
_POLL_FIRST_S, _POLL_MAX_S = 20e-6, 2e-3


# The largest pid Linux can give (PID_MAX_LIMIT, 2**22 on 64-bit): a larger one is not a pid.
_PID_MAX = 1 << 22


class SharedHostEvent(HostEvent):
    """An interprocess event: its counts live in a page of a memfd that the
    exporting process and its importers all map: the record count, the
    completion count and the pid of the process that recorded last. The memfd
    is sealed at one page, so no process can cut it off under another's
    mapping (SIGBUS there); an importer refuses one that is not.

    Every process records it, as in CUDA. A record and a completion change the
    counts under a POSIX record lock on the memfd (``lockf``: it excludes other
    processes, and ``_local`` the other threads of this one), so two processes
    never count the same generation and the completion count never goes back.
    A process waits on its own condition variable for a record it made itself
    (its own stream completes it); for another process's record it polls, and
    stops waiting, with an error, if that process exits first.
    """

    def __init__(self, device: int, fd: int, *, exporter_pid: int | None) -> None:
        if exporter_pid is not None:
            # Opening the event of a process that exited is refused (ProcessLookupError).
            os.close(os.pidfd_open(exporter_pid))
        addr = _libc.map_fd(_libc.PAGE, fd, 0)
        super().__init__(device, timing=False)
        self.exporter_pid = exporter_pid  # None in the exporting process
        self._local = threading.Lock()
        self._counts = (ctypes.c_uint64 * 3).from_address(addr)
        # The event owns fd (for the record lock; the exporter exports it again)
        # from here on. Both go only when nothing can use them any more: stream
        # work that records, completes or waits on the event holds it, and may
        # outlive event_destroy.
        self.fd = fd
        weakref.finalize(self, os.close, fd)
        weakref.finalize(self, _libc.unmap, addr, _libc.PAGE)

    # Read-only: a record counts only through next_gen, under the record lock.
    @property
    def record_gen(self) -> int:  # type: ignore[override]
        return int(self._counts[0])

    @property
    def done_gen(self) -> int:
        return int(self._counts[1])

    @done_gen.setter
    def done_gen(self, value: int) -> None:
        self._counts[1] = value

    @property
    def recorder(self) -> int:
        """The pid of the process that recorded last (0: never recorded)."""
        return int(self._counts[2])

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        return _file_locked(self._local, self.fd)

    def next_gen(self) -> int:
        with self._locked():
            gen = self._counts[0] = self._counts[0] + 1
            self._counts[2] = os.getpid()
        return int(gen)

    def complete(self, gen: int) -> None:
        with self._locked():  # max(): a later record of another process may have completed first
            if gen > self._counts[1]:
                self.timestamp_ns = time.monotonic_ns()
                self._counts[1] = gen
        if self._waiting:
            with self.cond:
                self.cond.notify_all()

    def wait(self, gen: int) -> None:
        if self.done_gen >= gen:
            return
        with self._locked():
            recorder = self.recorder
        if recorder == os.getpid():
            super().wait(gen)  # this process's stream completes it, and notifies
            return
        try:
            pidfd = os.pidfd_open(recorder)
        except ProcessLookupError:
            pidfd = -1
        exited = select.poll()  # not select(): it refuses descriptors past 1023, and accel may raise the limit
        if pidfd >= 0:
            exited.register(pidfd, select.POLLIN)
        try:
            delay = _POLL_FIRST_S
            while self.done_gen < gen:
                if (pidfd < 0 or exited.poll(0)) and self.done_gen < gen:
                    raise InvalidHandleError(
                        f"cpu:{self.device}: the process that recorded event {self.handle:#x} last "
                        f"(pid {recorder}) exited before the work it recorded completed"
                    )
                time.sleep(delay)
                delay = min(delay * 2, _POLL_MAX_S)
        finally:
            if pidfd >= 0:
                os.close(pidfd)


@contextlib.contextmanager
def _file_locked(local: threading.Lock, fd: int) -> Iterator[None]:
    """``local`` and a POSIX record lock on all of ``fd``: held by one thread of one process."""
    with local:
        fcntl.lockf(fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.lockf(fd, fcntl.LOCK_UN)


class HostStream:
    """An ordered queue of work; ``inline`` streams run work on the caller's thread.

    The hot paths take as few locks and wake-ups as CPython allows. Work goes
    into a ``collections.deque`` (one C call, ordered by the GIL, no lock);
    the worker runs the item at the head and pops it only afterwards, so an
    empty deque means every item queued so far has run (``idle``). The worker
    sleeps on a ``queue.SimpleQueue`` token only after announcing it in
    ``sleeping`` and finding the deque still empty; a producer puts a token only
    when it sees that flag, so a busy stream costs no wake-up at all.
    ``synchronize`` queues a lock's ``release`` and waits on the lock.

    Host functions from :meth:`launcher` are queued as they are (no wrapper per
    item); the worker catches their exceptions and appends them to ``errors``.
    """

    def __init__(self, device: int, priority: int, *, inline: bool) -> None:
        self.handle = new_handle()
        self.device = device
        self.priority = priority
        self.inline = inline
        self._capture: Capture[Node] | None = None
        self.closed = False
        # Whether a host function may go straight into the queue: a created stream,
        # neither capturing nor closed. Read by launcher() on every call.
        self.direct = not inline
        self.errors: collections.deque[tuple[str, BaseException]] | None = None
        self._lock = threading.Lock()  # orders close() against synchronize()'s marker
        self._items: collections.deque[Callable[[], object]] = collections.deque()
        self._wake: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.sleeping = False
        self._finished = threading.Event()  # set by the worker when it stops
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(
                target=self._drain, name=f"accel-cpu{device}-stream-{self.handle:#x}", daemon=True
            )
            self._thread.start()

    @property
    def capture(self) -> Capture[Node] | None:
        return self._capture

    @capture.setter
    def capture(self, capture: Capture[Node] | None) -> None:
        self._capture = capture
        self.direct = capture is None and not self.inline and not self.closed

    @property
    def is_default(self) -> bool:
        """The default stream is the inline one; it can neither capture nor join a capture."""
        return self.inline

    def submit(self, description: str | Callable[[], str], work: Callable[[], None]) -> None:
        """Run ``work`` after everything queued before it (or record it while capturing).

        ``description`` names the work in a captured graph; a callable is only
        called then (formatting it on every submit costs more than the submit)."""
        capture = self._capture
        if capture is not None:
            capture.add(self, Node(description if isinstance(description, str) else description(), work))
            return
        if self.inline:
            work()
            return
        self._put(work)

    def _put(self, work: Callable[[], object]) -> None:
        self._items.append(work)
        if self.sleeping:
            self.sleeping = False
            self._wake.put(None)

    def launcher(
        self, errors: collections.deque[tuple[str, BaseException]], fallback: Callable[[Callable[[], object]], None]
    ) -> Callable[[Callable[[], object]], None]:
        """A function that queues a host function with one deque append while the
        stream is ``direct``, and hands it to ``fallback`` otherwise (capture,
        closed stream, not callable: the checks and errors of the full path)."""
        self.errors = errors
        append = self._items.append
        wake = self._wake.put
        stream = self

        def launch_host_func(fn: Callable[[], object]) -> None:
            if stream.direct and callable(fn):
                append(fn)
                if stream.sleeping:
                    stream.sleeping = False
                    wake(None)
            else:
                fallback(fn)

        return launch_host_func

    def idle(self) -> bool:
        return not self._items

    def synchronize(self) -> None:
        if self._items:
            self._wait(None)

    def wait_idle(self, timeout: float) -> int:
        """Wait up to ``timeout`` seconds for the queue to drain; the items still queued."""
        marker = self._wait(timeout) if self._items else None
        return sum(1 for work in list(self._items) if work is not _STOP and work != marker)

    def _wait(self, timeout: float | None) -> Callable[[], object] | None:
        """Wait for the work queued so far; the marker queued for it, if one was."""
        waiter = threading.Lock()
        waiter.acquire()
        marker = waiter.release
        with self._lock:
            closed = self.closed
            if not closed:
                self._put(marker)
        # A signal interrupts either wait in the main thread (KeyboardInterrupt).
        if closed:  # the stop marker is queued: nothing may follow it
            self._finished.wait(timeout)
            return None
        if timeout is None:
            waiter.acquire()
        else:
            waiter.acquire(timeout=timeout)
        return marker

    def close(self) -> None:
        """Stop the worker once the work already queued has run."""
        with self._lock:
            self.closed = True
            self.direct = False
            if self._thread is not None:
                self._put(_STOP)

    def _drain(self) -> None:
        items = self._items
        get = self._wake.get
        while True:
            while items:
                work = items[0]
                if work is _STOP:
                    items.popleft()
                    self._finished.set()
                    return
                try:
                    work()
                except BaseException as exc:  # noqa: BLE001 - a failing item must not kill the queue
                    self._failed(work, exc)
                items.popleft()  # only now: an empty queue means everything ran
            self.sleeping = True
            if items:  # queued before the flag was seen: no token is coming for it
                self.sleeping = False
                continue
            get()

    def _failed(self, work: Callable[[], object], exc: BaseException) -> None:
        """Report a failed host function (queued by launcher() or launch_host_func, or
        a graph's node) where the stream's errors are; copies, fills and markers do not raise."""
        errors = self.errors
        if errors is not None:
            errors.append((function_name(work), exc))


def _STOP() -> None:
    """Queued by close(): the worker stops when it reaches it."""



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
        # One lock per executable graph, held while a launch runs: as cuGraphLaunch, a
        # launch on one stream does not run while another of the same graph does (the
        # two would write the same static memory at once). Reentrant: a host function
        # run inline by a launch may launch its own graph again.
        self._exec_locks: dict[int, threading.RLock] = {}
        # Destroyed streams whose queued work may still run: device synchronization
        # (and so every release of memory, which synchronizes first) waits for them too.
        self._closing: list[HostStream] = []
        self.defaults = []
        self.pid = os.getpid()
        atexit.register(_finish_at_exit, weakref.ref(self))
        os.register_at_fork(after_in_child=functools.partial(_forked, weakref.ref(self)))
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
            where = "cpu" if device is None else f"cpu:{device}"
            raise InvalidHandleError(
                f"{where}: event handle {handle:#x} is not a live event of this device "
                "(destroyed, never created, or created on another device)"
            )
        return event

    def finish_queued_work(self, timeout: float) -> int:
        """Let queued work run for up to ``timeout`` seconds; how many items are left."""
        with self._lock:
            streams = [s for s in self._streams.values() if not s.inline] + self._closing
        deadline = time.monotonic() + timeout
        return sum(s.wait_idle(max(deadline - time.monotonic(), 0.0)) for s in streams)

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
        _capture.abandon(stream)
        with self._lock:
            del self._streams[handle]
            self._closing = [s for s in self._closing if not s.idle()]
            self._closing.append(stream)
        stream.close()

    def query(self, device: int, handle: int) -> bool:
        stream = self.stream(device, handle)
        _capture.refuse_while_capturing(stream, "querying a stream")
        return stream.idle()

    def synchronize(self, device: int, handle: int) -> None:
        stream = self.stream(device, handle)
        _capture.refuse_while_capturing(stream, "synchronizing a stream")
        stream.synchronize()

    def synchronize_device(self, device: int) -> None:
        streams = self.streams_of(device)
        _capture.refuse_device_synchronize(device, streams)
        with self._lock:
            closing = [s for s in self._closing if s.device == device]
        for stream in streams + closing:
            stream.synchronize()
        if closing:
            with self._lock:
                self._closing = [s for s in self._closing if not s.idle()]

    # -- events -----------------------------------------------------------

    def create_event(self, device: int, timing: bool, interprocess: bool = False) -> int:
        if interprocess:
            if timing:
                raise NotSupportedError(
                    f"cpu:{device}: an interprocess event cannot measure time (as in CUDA); "
                    "create it with enable_timing=False"
                )
            try:
                page = _libc.shared_page()
            except OSError as exc:
                code = exc.errno or 0
                raise DriverError(
                    "cpu", "creating an interprocess event", code, errno.errorcode.get(code, "OSError"), str(exc),
                    device=device, remedy="close events and files no longer needed, or raise the hard limit on "
                    "open files (ulimit -n as root; accel raises the soft limit to it when it is reached)",
                ) from None
            event: HostEvent = SharedHostEvent(device, page, exporter_pid=None)
        else:
            event = HostEvent(device, timing)
        with self._lock:
            self._events[event.handle] = event
        return event.handle

    def destroy_event(self, device: int, handle: int) -> None:
        self.event(device, handle)
        with self._lock:
            del self._events[handle]  # a shared event's memfd closes with the object

    def export_event(self, device: int, handle: int) -> tuple[bytes, list[int]]:
        event = self.event(device, handle)
        if not isinstance(event, SharedHostEvent) or event.exporter_pid is not None:
            raise InvalidValueError(
                f"cpu:{device}: event {handle:#x} was not created with interprocess=True in this "
                "process; create it with accel.Event(interprocess=True) to share it"
            )
        return str(os.getpid()).encode(), [export_dup(event.fd, device)]

    def import_event(self, device: int, payload: bytes, fds: list[int]) -> int:
        try:
            # Checked before mapping: the description comes from whatever process answered,
            # and reading a page past the end of a shorter file is SIGBUS (also once the
            # exporter cut it shorter: it must be sealed against that).
            size = _libc.sealed_size(fds[0]) if len(fds) == 1 else 0
            if not (payload.isdigit() and 0 < int(payload) <= _PID_MAX and size is not None and size >= _libc.PAGE):
                state = "not sealed against shrinking" if size is None else f"{size} bytes"
                raise InvalidHandleError(
                    f"cpu:{device}: the exporting process described its event inconsistently ({payload[:20]!r}, "
                    f"{len(fds)} descriptor(s), {state}); is it an accel process? Pickle the event again there"
                )
            try:
                event = SharedHostEvent(device, fds[0], exporter_pid=int(payload))
            except ProcessLookupError:
                raise InvalidHandleError(
                    f"cpu:{device}: the process that exported this event (pid {int(payload)}) has exited"
                ) from None
            except OSError as exc:
                code = exc.errno or 0
                raise DriverError(
                    "cpu", "mapping an event of another process", code, errno.errorcode.get(code, "OSError"), str(exc),
                    device=device,
                ) from None
        except BaseException:  # the event owns fds[0] only once made
            for fd in fds:
                os.close(fd)
            raise
        with self._lock:
            self._events[event.handle] = event
        return event.handle

    def record(self, device: int, event_handle: int, stream_handle: int, *, external: bool = False) -> None:
        event = self.event(device, event_handle)
        stream = self.stream(device, stream_handle)
        capture = stream.capture
        if capture is not None and external:
            # A node of the graph: each replay records the event when it gets there.
            event.captured = None
            capture.add(stream, Node(f"event record {event.handle:#x}", None, functools.partial(_issue_record, event)))
            return
        if capture is not None:
            event.captured = capture.mark(stream)
            return
        event.captured = None
        gen = event.next_gen()
        if stream.inline or stream.idle():
            # Everything queued before the record has run: the event completes now,
            # without a trip through the worker.
            event.complete(gen)
            return
        stream.submit("event record", lambda: event.complete(gen))

    def event_query(self, device: int, handle: int) -> bool:
        event = self.event(device, handle)
        _capture.refuse_captured_event(event.captured, event.device, event.handle, "querying")
        return event.is_done()

    def event_synchronize(self, device: int, handle: int) -> None:
        event = self.event(device, handle)
        _capture.refuse_captured_event(event.captured, event.device, event.handle, "synchronizing")
        event.wait(event.record_gen)

    def wait_event(self, device: int, stream_handle: int, event_handle: int) -> None:
        stream = self.stream(device, stream_handle)
        event = self.event(None, event_handle)  # streams may wait on events of any device
        if _capture.wait_event(stream, event.captured, event.handle):
            return
        target = event.record_gen
        if target == 0:
            return  # never recorded: waiting on it is a no-op, as in CUDA
        stream.submit("wait event", lambda: event.wait(target))

    def wait_event_external(self, device: int, stream_handle: int, event_handle: int) -> None:
        """A wait a capture keeps (``Event(external=True)``): on a capturing stream, a
        node that each replay issues (see _issue_wait); elsewhere an ordinary wait."""
        stream = self.stream(device, stream_handle)
        event = self.event(None, event_handle)
        capture = stream.capture
        if capture is None:
            self.wait_event(device, stream_handle, event_handle)
            return
        capture.add(stream, Node(f"wait event {event.handle:#x}", None, functools.partial(_issue_wait, event)))

    # -- capture and graphs -------------------------------------------------

    def begin_capture(self, device: int, handle: int, mode: CaptureMode) -> None:
        stream = self.stream(device, handle)
        _capture.check_begin("cpu", stream)
        stream.capture = Capture("cpu", stream, mode)

    def capture_status(self, device: int, handle: int) -> CaptureStatus:
        return _capture.status(self.stream(device, handle))

    def end_capture(self, device: int, handle: int) -> int:
        capture = _capture.end_capture("cpu", self.stream(device, handle))
        graph = new_handle()
        with self._lock:
            self._graphs[graph] = list(capture.nodes)
        return graph

    @staticmethod
    def _live_nodes(table: dict[int, list[Node]], handle: int, kind: str) -> list[Node]:
        """The nodes of graph or executable graph ``handle`` (graphs of every device share
        ``table``), else InvalidHandleError."""
        nodes = table.get(handle)
        if nodes is None:
            raise InvalidHandleError(f"cpu: {kind} handle {handle:#x} is not live (destroyed, or never created)")
        return nodes

    def graph_nodes(self, graph: int) -> list[Node]:
        return self._live_nodes(self._graphs, graph, "graph")

    def instantiate(self, graph: int) -> int:
        nodes = self.graph_nodes(graph)
        graph_exec = new_handle()
        with self._lock:
            self._execs[graph_exec] = list(nodes)
            self._exec_locks[graph_exec] = threading.RLock()
        return graph_exec

    def launch(self, device: int, graph_exec: int, stream_handle: int) -> None:
        nodes = self._live_nodes(self._execs, graph_exec, "executable graph")
        stream = self.stream(device, stream_handle)
        if stream.capture is not None:
            raise CaptureError(f"cpu:{device}: launching a graph inside a capture is not supported")
        runs = [node.launched() for node in nodes]
        with self._lock:
            running = self._exec_locks[graph_exec]

        def replay() -> None:
            with running:
                for run in runs:
                    run()

        stream.submit("graph launch", replay)

    def destroy_graph(self, graph: int) -> None:
        with self._lock:
            self._live_nodes(self._graphs, graph, "graph")
            del self._graphs[graph]

    def destroy_exec(self, graph_exec: int) -> None:
        with self._lock:
            self._live_nodes(self._execs, graph_exec, "executable graph")
            del self._execs[graph_exec]
            del self._exec_locks[graph_exec]
