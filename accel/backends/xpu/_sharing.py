"""Sharing Level Zero memory and events with other processes.

Memory from ``zeMemAllocDevice`` (the caching allocator's plain segments) is
shared with ``zeMemGetIpcHandle``/``zeMemOpenIpcHandle``/``zeMemCloseIpcHandle``,
at the allocation's base plus the buffer's offset. An interprocess event has
an IPC event pool of its own (``zeEventPoolGetIpcHandle``/``zeEventPoolOpenIpcHandle``);
it starts signalled (waiting before the first record passes, as in CUDA) and
each record re-arms its one event (reset on the host at once, signalled in
stream order), so an importer waiting while the exporter records again waits
for the newer record, and a record still pending on another stream when the
event is recorded again completes the newer one early.

On Linux a Level Zero IPC handle carries a file descriptor of the exporting
process in its first four bytes (the layout Intel's level-zero-tests pass over
``SCM_RIGHTS``): accel sends a duplicate of it with the handle, and the
importer writes the descriptor it received there before opening. This
convention is exercised against accel's simulated driver only; no claim is
made here about a particular Intel driver version.

The Level Zero API (up to 1.8) has no IPC for virtual memory, so buffers of
expandable segments cannot be shared on this backend.
"""

from __future__ import annotations

import json
import os
import struct
from typing import TYPE_CHECKING, Any

from accel._errors import InvalidHandleError, InvalidValueError, NotSupportedError
from accel.backends._sharing import dup_for_export
from accel.backends.xpu._records import DeviceState, EventState, new_handle

_PID = struct.Struct("!q")

if TYPE_CHECKING:
    from accel.backends.xpu._bindings import ZeLoader
    from accel.backends.xpu._event_pool import EventSlots

__all__ = ["Sharing"]

_FD_BYTES = 4


def _fd_of(handle: bytes) -> int:
    return int.from_bytes(handle[:_FD_BYTES], "little", signed=True)


def _with_fd(handle: bytes, fd: int) -> bytes:
    return fd.to_bytes(_FD_BYTES, "little", signed=True) + handle[_FD_BYTES:]


class Sharing:
    """The Backend protocol's ipc_* methods for :class:`XpuBackend` (a mixin)."""

    # Set by XpuBackend.
    _ze: ZeLoader
    _context: Any
    _devices: list[DeviceState]
    _slots: EventSlots
    _events: dict[int, EventState]
    _lock: Any

    if TYPE_CHECKING:

        def _check(self, call: str, code: int, device: int | None = None) -> None: ...
        def _event(self, device: int, handle: int, *, any_device: bool = False) -> EventState: ...

    def supports_ipc(self, device: int) -> bool:
        return True

    def _init_sharing(self) -> None:
        self._ipc_imports: dict[int, int] = {}  # imported address -> the base zeMemOpenIpcHandle returned

    def ipc_memory_export(self, device: int, ptr: int, nbytes: int) -> tuple[bytes, list[int]]:
        dev = self._devices[device]
        with dev.lock:
            base = next((b for b, n in dev.allocations.items() if b <= ptr and ptr + nbytes <= b + n), None)
            virtual = any(b <= ptr < b + n for b, n in dev.reservations.items())
        if base is None:
            if virtual:
                raise NotSupportedError(
                    f"xpu:{device}: accel cannot share Level Zero virtual memory with other processes yet "
                    "(physical memory exports, zePhysicalMemGetProperties with a file descriptor, need "
                    "Level Zero 1.15; accel is built on 1.8's API); share buffers allocated without "
                    "expandable_segments"
                )
            raise InvalidValueError(f"xpu:{device}: [{ptr:#x}, {ptr + nbytes:#x}) is not memory allocated on this device")
        ffi, lib = self._ze.ffi, self._ze.lib
        handle = ffi.new("ze_ipc_mem_handle_t *")
        self._check("zeMemGetIpcHandle", lib.zeMemGetIpcHandle(self._context, ffi.cast("void *", base), handle), device)
        raw = bytes(ffi.buffer(handle.data, len(handle.data)))
        fd = dup_for_export(_fd_of(raw), "xpu", device)
        return json.dumps({"handle": raw.hex(), "offset": ptr - base}).encode(), [fd]

    def ipc_memory_import(self, device: int, payload: bytes, fds: list[int]) -> int:
        try:
            layout = json.loads(payload)
            (fd,) = fds
            ffi, lib = self._ze.ffi, self._ze.lib
            handle = ffi.new("ze_ipc_mem_handle_t *")
            ffi.memmove(handle.data, _with_fd(bytes.fromhex(layout["handle"]), fd), len(handle.data))
            out = ffi.new("void **")
            code = lib.zeMemOpenIpcHandle(self._context, self._devices[device].cdata, handle[0], 0, out)
            self._check("zeMemOpenIpcHandle", code, device)
        finally:
            for fd_ in fds:
                os.close(fd_)
        base = int(ffi.cast("uintptr_t", out[0]))
        ptr = base + int(layout["offset"])
        with self._lock:
            self._ipc_imports[ptr] = base
        return ptr

    def ipc_memory_close(self, device: int, ptr: int) -> None:
        with self._lock:
            base = self._ipc_imports.pop(ptr, None)
        if base is None:
            raise InvalidHandleError(
                f"xpu:{device}: ipc_memory_close({ptr:#x}): not memory imported from another process "
                "(already closed?)"
            )
        ffi, lib = self._ze.ffi, self._ze.lib
        self._check("zeMemCloseIpcHandle", lib.zeMemCloseIpcHandle(self._context, ffi.cast("void *", base)), device)

    def ipc_event_export(self, device: int, event: int) -> tuple[bytes, list[int]]:
        e = self._event(device, event)
        slot = e.slot
        if not e.ipc or slot is None:
            raise InvalidValueError(
                f"xpu:{device}: event {event:#x} was not created with interprocess=True; create it with "
                "accel.Event(interprocess=True) to share it"
            )
        ffi, lib = self._ze.ffi, self._ze.lib
        handle = ffi.new("ze_ipc_event_pool_handle_t *")
        self._check("zeEventPoolGetIpcHandle", lib.zeEventPoolGetIpcHandle(slot.ipc_pool, handle), device)
        raw = bytes(ffi.buffer(handle.data, len(handle.data)))
        # The exporter's pid: an importer stops waiting on the event once it exited.
        return _PID.pack(os.getpid()) + raw, [dup_for_export(_fd_of(raw), "xpu", device)]

    def ipc_event_import(self, device: int, payload: bytes, fds: list[int]) -> int:
        try:
            (fd,) = fds
            (pid,) = _PID.unpack_from(payload)
            slot = self._slots.open_ipc(_with_fd(payload[_PID.size :], fd))
        finally:
            for fd_ in fds:
                os.close(fd_)
        try:
            exporter = os.pidfd_open(pid)
        except OSError:
            exporter = -1  # gone already (it answered the broker a moment ago): waits are not bounded
        handle = new_handle()
        with self._lock:
            self._events[handle] = EventState(device, handle, False, slot=slot, ipc=True, exporter=exporter)
        return handle
