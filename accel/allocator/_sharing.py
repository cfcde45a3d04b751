"""Buffers shared with other processes: what ``pickle`` does with a :class:`Buffer`.

Pickling a buffer exports its memory (the backend describes it, this
process's broker serves the description and its file descriptors) and
records a ticket; unpickling the ticket in another process maps the same
memory there, without a copy, as a :class:`Buffer` on that process's current
stream. This is what lets a buffer cross ``multiprocessing`` with the spawn
start method, passed to a ``Process`` or through a ``Queue``.

Lifetime rules:

- The exporter keeps the buffer alive (not freed) until every importer has
  unpickled it; unpickling after the exporter freed it raises
  :class:`~accel.InvalidHandleError`.
- Once opened, the exporter's memory is not reused while an importer holds
  it, even if the exporter frees its buffer: the importer's hold keeps the
  buffer's lease (as a DLPack view does). The hold ends when the importer
  dies, or after it freed its buffer (``free()``, or garbage collection):
  once the work queued before the free on every stream the buffer was used
  on (its stream, those named with ``record_stream``, closed ones too) has
  run, the importer unmaps the memory and ends the hold. ``free()`` waits
  for that work; a garbage-collected buffer's finalizer never waits (a
  thread of the importer does). Neither takes the failures of host
  functions from those streams: they stay for the streams' next
  ``synchronize()``.
- At interpreter exit, buffers still open stay mapped and held until the
  process is gone (its work may still run until then).
- Opening a buffer whose exporter has exited raises
  :class:`~accel.InvalidHandleError`.
- Unpickling in the exporting process itself gives back the buffer that was
  pickled (``torch.distributed.all_gather_object`` hands each rank its own
  entry too); once that buffer was freed or garbage-collected, it raises
  :class:`~accel.InvalidHandleError`.
- Only memory accel allocated from its backend can be shared: a buffer of a
  :class:`~accel.memory.MemPool` (or device) whose upstream resource is not the backend's
  refuses export with :class:`~accel.NotSupportedError`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import struct
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

from accel import _runtime
from accel._errors import AccelError, InvalidHandleError, NotSupportedError
from accel._runtime import Runtime, get_runtime
from accel._units import format_size
from accel.allocator._resources import BackendResource, ResourceAdaptor
from accel.backends._sharing import ExportTicket, Held, broker, check_device, export_origin, open_export
from accel.backends.base import CaptureStatus, record_new_event

if TYPE_CHECKING:
    from accel.allocator._buffer import Buffer
    from accel.backends.base import Backend
    from accel.stream import Event, Stream

__all__ = ["export_buffer", "open_buffer"]

# The exporter states the size with the backend's description: the importer
# maps what the exporter says, never what a (possibly forged) pickle claims.
_SIZE = struct.Struct("!Q")
# One export per lease, however often the buffer is pickled (a Queue carries
# it every step): each export holds duplicated descriptors until the lease dies.
_tickets: weakref.WeakKeyDictionary[object, ExportTicket] = weakref.WeakKeyDictionary()
_tickets_lock = threading.Lock()
# This process's exported buffers by their export's token, for unpickling here.
_exported: weakref.WeakValueDictionary[str, Buffer] = weakref.WeakValueDictionary()


def _forget_exports_in_child() -> None:
    """A forked child exports nothing of its parent's: its tickets name the parent's broker,
    whose copy the child closes (see accel.backends._sharing)."""
    global _tickets_lock
    _tickets_lock = threading.Lock()  # another parent thread may have held it at the fork
    _tickets.clear()
    _exported.clear()


os.register_at_fork(after_in_child=_forget_exports_in_child)


class _ImportedBlock:
    """The part of a caching allocator's block an imported buffer needs: its address."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _Unmap:
    """An imported buffer's memory, freed: unmapped, and its hold ended, once the work
    queued before the free on the streams it was used on has run."""

    __slots__ = ("_runtime", "_device", "_ptr", "_held", "_events", "_ends", "_later", "_unordered")

    def __init__(self, runtime: Runtime, device: int, ptr: int, held: Held, streams: list[Stream]) -> None:
        self._runtime = runtime
        self._device = device
        self._ptr = ptr
        self._held = held
        self._events: list[int] = []  # recorded here on live streams; destroyed by close()
        self._ends: list[Event] = []  # closed streams' end events (see Stream.close)
        self._later: list[Stream] = []  # capturing: a record now would be the capture's
        self._unordered = False  # a stream whose end no event marks: only the device's end orders it
        for stream in streams:
            self._after(stream)

    def _after(self, stream: Stream) -> None:
        """Note what completes after the work queued on ``stream`` so far; never waits
        (this runs in finalizers)."""
        if stream._closed or (stream._finalizer is not None and not stream._finalizer.alive):
            if stream._closed and stream._owned:
                # Its work still runs after the close; the event recorded at the close
                # completes after it (None: the stream's work was abandoned or waited for).
                if stream._end is not None:
                    self._ends.append(stream._end)
            else:
                # A closed ExternalStream (its owner may have destroyed the handle), or a
                # stream destroyed at interpreter exit without a close: no record on its handle.
                self._unordered = True
            return
        backend, device, handle = self._runtime.backend, self._device, stream._handle
        try:
            if backend.stream_capture_status(device, handle) != CaptureStatus.NONE:
                self._later.append(stream)  # ordered once the capture ends (see wait)
                return
            event = record_new_event(backend, device, handle)
        except AccelError:
            self._unordered = True
            return
        self._events.append(event)

    @property
    def capturing(self) -> bool:
        """Whether a stream it waits for is capturing: only another thread can wait for
        the capture's end."""
        return bool(self._later)

    def done(self) -> bool:
        """Whether that work has run (never waits)."""
        if self._unordered or self._later:
            return False
        backend, device = self._runtime.backend, self._device
        try:
            return all(backend.event_query(device, e) for e in self._events) and all(e.query() for e in self._ends)
        except AccelError:
            return False

    def poll(self) -> bool:
        """Whether that work has run as far as events tell (never waits), dropping what has;
        a stream whose end no event marks is left to :meth:`wait` (the device's end). A
        failed query raises AccelError."""
        backend, device = self._runtime.backend, self._device
        for stream in [s for s in self._later if not _capturing(s)]:
            self._later.remove(stream)
            self._after(stream)  # the capture ended (or the stream closed): record now
        if self._later:
            # Not a query while the capture goes on (as wait): the driver may take it for
            # an unsafe call during the capture and invalidate it (CUDA's global mode).
            return False
        for event in [e for e in self._events if backend.event_query(device, e)]:
            self._events.remove(event)
            with contextlib.suppress(AccelError):
                backend.event_destroy(device, event)
        self._ends = [e for e in self._ends if not e.query()]
        return not (self._later or self._events or self._ends or self._unordered)

    @property
    def unordered(self) -> bool:
        """Whether only the device's end orders it (see :meth:`wait`)."""
        return self._unordered

    def wait(self) -> None:
        """Wait for that work (never in a finalizer, nor where a host function of one of
        the streams may run); each wait done is dropped, so a failed one can be retried."""
        backend, device = self._runtime.backend, self._device
        while self._later:
            stream = self._later.pop()
            while _capturing(stream):
                time.sleep(_CAPTURE_POLL_S)
            self._after(stream)  # the capture ended (or the stream closed): record now
        while self._events:
            backend.event_synchronize(device, self._events[-1])
            with contextlib.suppress(AccelError):
                backend.event_destroy(device, self._events.pop())
        while self._ends:
            self._ends[-1].synchronize()
            self._ends.pop()
        if self._unordered:
            backend.device_synchronize(device)
            self._unordered = False

    def close(self) -> None:
        """Unmap the memory and end the hold (the work is done)."""
        backend, device = self._runtime.backend, self._device
        try:
            backend.ipc_memory_close(device, self._ptr)
        finally:
            self._held.release()
            while self._events:
                with contextlib.suppress(AccelError):
                    backend.event_destroy(device, self._events.pop())


# How often the unmapping thread looks whether a capture it waits for has ended.
_CAPTURE_POLL_S = 0.01


def _capturing(stream: Stream) -> bool:
    if stream._closed:
        return False
    try:
        return stream._runtime.backend.stream_capture_status(stream._device, stream._handle) != CaptureStatus.NONE
    except AccelError:  # destroyed meanwhile: _after says what orders it
        return False


# Frees whose streams' work could not be waited for (a driver error): mapped and held
# until the process exits, rather than unmapped under work that may still run.
_left_to_exit: list[_Unmap] = []


# How long the unmapping thread sleeps between looks at the events it waits for, at
# most (it starts at _CAPTURE_POLL_S and backs off while nothing completes).
_UNMAP_POLL_MAX_S = 0.1


class _Unmapper:
    """The importing process's threads that unmap the imported buffers freed by finalizers
    (and by frees that must wait for a capture to end) once their streams' work has run:
    a finalizer never waits (it may run inside a host function of one of those streams).

    One thread polls every such buffer's events without waiting on any, so a buffer
    whose stream never finishes keeps no other buffer mapped and held; only buffers
    that the device's end alone orders (see :meth:`_Unmap.wait`) go to a second thread,
    which waits for the device (that wait includes every stream's work anyway)."""

    def __init__(self) -> None:
        # put() is reentrant (a finalizer may run inside another put on this thread).
        self._queue: queue.SimpleQueue[_Unmap] = queue.SimpleQueue()
        self._device_queue: queue.SimpleQueue[_Unmap] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._pid = 0  # the process whose threads run (a forked child has none)

    def start(self) -> None:
        """Start the threads in this process if they are not running (at every import, so
        never in a finalizer, where starting a thread could wait on a lock held below)."""
        pid = os.getpid()
        if self._pid != pid:
            with self._lock:
                if self._pid != pid:
                    threading.Thread(target=self._run, name="accel-ipc-unmap", daemon=True).start()
                    threading.Thread(target=self._run_device_waits, name="accel-ipc-unmap-device", daemon=True).start()
                    self._pid = pid

    def put(self, unmap: _Unmap) -> None:
        self._queue.put(unmap)

    def _run(self) -> None:
        pending: list[_Unmap] = []
        pause = _CAPTURE_POLL_S
        while True:
            try:
                pending.append(self._queue.get(timeout=pause if pending else None))
                pause = _CAPTURE_POLL_S  # a new one: look again soon
            except queue.Empty:
                pause = min(2 * pause, _UNMAP_POLL_MAX_S)  # nothing new: look less often
            waiting: list[_Unmap] = []
            for unmap in pending:
                try:
                    done = unmap.poll()
                except AccelError:
                    _left_to_exit.append(unmap)
                    continue
                if done:
                    with contextlib.suppress(AccelError):  # nobody to tell: the hold ends regardless
                        unmap.close()
                elif unmap.unordered and not unmap.capturing:
                    self._device_queue.put(unmap)  # what events tell is done: the device's end is left
                else:
                    waiting.append(unmap)
            pending = waiting

    def _run_device_waits(self) -> None:
        while True:
            unmap = self._device_queue.get()
            try:
                unmap.wait()
            except AccelError:
                _left_to_exit.append(unmap)
                continue
            with contextlib.suppress(AccelError):  # nobody to tell: the hold ends regardless
                unmap.close()


_unmapper = _Unmapper()


class _ImportedMemory:
    """Stands in for a buffer's allocator when the memory came from another process:
    freeing it unmaps it and ends the hold once this process's work on it has run."""

    def __init__(self, runtime: Runtime, device: int, stream: Stream, held: Held) -> None:
        self._runtime = runtime
        self._device = device
        self._streams = [stream]
        self._held = held

    def record_stream(self, block: _ImportedBlock, stream: Stream) -> None:
        stream._live()  # a closed stream takes no new work: refused, as by the caching allocator
        # Equal streams may differ: a closed stream's handle may name a new stream now.
        if not any(s is stream or (s == stream and not s._closed) for s in self._streams):
            self._streams.append(stream)

    def _let_go(self, block: _ImportedBlock) -> _Unmap | None:
        """What unmaps the memory once the streams' work ran; None where that is not
        this process's to do."""
        if _runtime._forked_from is not None:
            # A forked child's copy of the parent's buffer: the mapping and the hold are the
            # parent's (the child's copy of the connection goes; the parent's stays).
            self._held.release()
            return None
        if sys.is_finalizing():
            # The streams are destroyed and the threads that run their work may be gone:
            # the process's exit unmaps the memory and ends the hold, after that work.
            _left_to_exit.append(_Unmap(self._runtime, self._device, block.ptr, self._held, []))
            return None
        streams, self._streams = self._streams, []
        return _Unmap(self._runtime, self._device, block.ptr, self._held, streams)

    def free(self, block: _ImportedBlock) -> None:
        """Wait for the work queued on the buffer's streams, unmap the memory, end the
        hold. A host function's failure stays with its stream (its next synchronize)."""
        unmap = self._let_go(block)
        if unmap is None:
            return
        if unmap.capturing:  # only once this thread ends the capture: the unmapping thread waits
            _unmapper.put(unmap)
            return
        try:
            unmap.wait()
        except BaseException:
            _unmapper.put(unmap)  # interrupted, or the wait failed: what is left is waited for there
            raise
        unmap.close()

    def free_from_finalizer(self, block: _ImportedBlock) -> None:
        """:meth:`free` from a finalizer (a garbage-collected buffer): it never waits,
        nor raises or prints; the unmapping thread waits where the work still runs."""
        with contextlib.suppress(AccelError):  # nobody to tell (a refused unmap)
            unmap = self._let_go(block)
            if unmap is None:
                return
            if unmap.done():
                unmap.close()
            else:
                _unmapper.put(unmap)


def export_buffer(buffer: Buffer) -> tuple[Any, ...]:
    """The pickle of ``buffer``: ``(open_buffer, args)`` naming an export of its memory."""
    _runtime.check_not_forked()  # a forked child's backend is a stand-in: it exports nothing
    lease = buffer._export_lease()  # refuses a freed buffer
    if isinstance(buffer._allocator, _ImportedMemory):
        raise NotSupportedError(
            f"{buffer!r} was opened from another process; pickle the buffer in the process that "
            "allocated it instead (shared memory is not exported again)"
        )
    runtime = buffer.stream._runtime
    backend = runtime.backend
    device = buffer.stream.device_index
    _check_backend_memory(buffer, backend)
    if not backend.supports_ipc(device):
        raise NotSupportedError(
            f"{buffer.device} cannot share memory with other processes (the {backend.name} backend "
            "has no IPC support here); copy the data to host memory and send that instead"
        )
    uuid = backend.device_properties(device).uuid
    with _tickets_lock:
        ticket = _tickets.get(lease)
        if ticket is None:
            payload, fds = backend.ipc_memory_export(device, buffer.ptr, buffer.nbytes)
            ticket = broker().offer(
                "buffer", export_origin(backend.name, device, uuid), _SIZE.pack(buffer.nbytes) + payload, fds,
                _lease_of(weakref.ref(buffer)), hold=True,
            )
            _tickets[lease] = ticket
        _exported[ticket.token] = buffer
    return open_buffer, (ticket, backend.name, device, uuid, buffer.nbytes)


def _lease_of(exported: weakref.ref[Buffer]) -> Callable[[], object | None]:
    """What an export serves importers: the buffer's lease while the buffer holds it (neither
    freed nor collected). Not the lease itself: importers' holds and DLPack views keep it
    alive past the free, and a pickle opened then would map memory its exporter freed."""

    def target() -> object | None:
        buffer = exported()
        return None if buffer is None else buffer._lease

    return target


def open_buffer(ticket: ExportTicket, backend_name: str, device: int, uuid: str, nbytes: int) -> Buffer:
    """Map a buffer exported by another process (what unpickling a Buffer calls)."""
    from accel.allocator._buffer import Buffer

    if not isinstance(nbytes, int) or isinstance(nbytes, bool) or nbytes < 0:
        raise InvalidHandleError(
            f"cannot open a buffer from another process: its pickle is damaged (size {nbytes!r}); "
            "pickle the buffer again in its process"
        )
    what = f"a {format_size(nbytes)} buffer of {backend_name}:{device} from another process"
    runtime = get_runtime()
    check_device(runtime.backend, backend_name, device, uuid, what)
    if isinstance(ticket, ExportTicket) and ticket.pid == os.getpid() and isinstance(ticket.token, str):
        here = _exported.get(ticket.token)
        if here is not None:
            return _exported_here(here, device, nbytes)
    _unmapper.start()  # what unmaps the buffer once freed
    payload, fds, held = open_export(ticket, "buffer", export_origin(backend_name, device, uuid), what)
    try:
        if len(payload) < _SIZE.size:  # not what an accel exporter sends
            for fd in fds:
                os.close(fd)
            raise InvalidHandleError(
                f"cannot open {what}: its process answered with a damaged description of the memory "
                "(is it an accel process?); pickle the buffer again in its process"
            )
        (exported,) = _SIZE.unpack_from(payload)
        if exported != nbytes:
            for fd in fds:
                os.close(fd)
            raise InvalidHandleError(
                f"cannot open {what}: its process exports {format_size(exported)} there (the pickle "
                "is damaged or forged); pickle the buffer again in its process"
            )
        ptr = runtime.backend.ipc_memory_import(device, payload[_SIZE.size :], fds, nbytes)
    except BaseException:
        held.release()
        raise
    stream = runtime.current_stream(device)
    memory = _ImportedMemory(runtime, device, stream, held)
    return Buffer(cast(Any, _ImportedBlock(ptr)), cast(Any, memory), stream, nbytes)


def _exported_here(buffer: Buffer, device: int, nbytes: int) -> Buffer:
    """``buffer``, pickled and now unpickled in this process (as ``nbytes`` on ``device``),
    unless it was freed since.

    (One garbage-collected is no longer known here: open_export refuses its ticket.)"""
    what = f"a {format_size(nbytes)} buffer of {buffer.device.type}:{device} exported by this very process"
    if buffer.stream.device_index != device or buffer.nbytes != nbytes:
        raise InvalidHandleError(
            f"cannot open {what}: it is {buffer!r} (the pickle is damaged or forged); pickle the buffer again"
        )
    if buffer.freed:
        raise InvalidHandleError(
            f"cannot open {what}: it was freed here before the pickle was opened (keep the buffer alive "
            "until every importer has opened it)"
        )
    return buffer


def _check_backend_memory(buffer: Buffer, backend: Backend) -> None:
    """Refuse to export memory that did not come from ``backend`` (but from an upstream
    resource of a MemPool or of the device): the backend cannot describe it to another process."""
    upstream = getattr(buffer._allocator, "upstream", None)
    resource = upstream
    while isinstance(resource, ResourceAdaptor):
        resource = resource.upstream
    if upstream is not None and not (isinstance(resource, BackendResource) and resource.backend is backend):
        raise NotSupportedError(
            f"{buffer!r} cannot be shared with other processes: its memory comes from {upstream!r} "
            f"(an upstream resource given to MemPool or set_upstream), not from the {backend.name} "
            "backend, and accel shares only memory it allocated from its backend. Allocate the buffer "
            "without that resource, or copy it into a buffer allocated so"
        )
