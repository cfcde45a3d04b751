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
  frees its buffer (after its streams finished the work queued on it), or
  when the importer dies.
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

import os
import struct
import threading
import weakref
from typing import TYPE_CHECKING, Any, cast

from accel._errors import InvalidHandleError, NotSupportedError
from accel._runtime import Runtime, get_runtime
from accel._units import format_size
from accel.allocator._resources import BackendResource, ResourceAdaptor
from accel.backends._sharing import ExportTicket, Held, broker, check_device, export_origin, open_export

if TYPE_CHECKING:
    from accel.allocator._buffer import Buffer
    from accel.backends.base import Backend
    from accel.stream import Stream

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


class _ImportedBlock:
    """The part of a caching allocator's block an imported buffer needs: its address."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _ImportedMemory:
    """Stands in for a buffer's allocator when the memory came from another process:
    freeing it waits for this process's work on it, unmaps it, and ends the hold."""

    def __init__(self, runtime: Runtime, device: int, stream: Stream, held: Held) -> None:
        self._runtime = runtime
        self._device = device
        self._streams = [stream]
        self._held = held

    def record_stream(self, block: _ImportedBlock, stream: Stream) -> None:
        if stream not in self._streams:
            self._streams.append(stream)

    def free(self, block: _ImportedBlock) -> None:
        try:
            for stream in self._streams:
                if not stream._closed:
                    stream.synchronize()  # the exporter may reuse the memory once the hold ends
            self._runtime.backend.ipc_memory_close(self._device, block.ptr)
        finally:
            self._held.release()

    free_from_finalizer = free


def export_buffer(buffer: Buffer) -> tuple[Any, ...]:
    """The pickle of ``buffer``: ``(open_buffer, args)`` naming an export of its memory."""
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
                weakref.ref(lease), hold=True,
            )
            _tickets[lease] = ticket
        _exported[ticket.token] = buffer
    return open_buffer, (ticket, backend.name, device, uuid, buffer.nbytes)


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
