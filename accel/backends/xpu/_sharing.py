"""Sharing Level Zero memory and events with other processes.

Two kinds of memory, two mechanisms (as on CUDA):

- memory from ``zeMemAllocDevice`` (the caching allocator's plain segments) is
  shared with ``zeMemGetIpcHandle``/``zeMemOpenIpcHandle``/``zeMemCloseIpcHandle``,
  at the allocation's base plus the buffer's offset;
- virtual memory (expandable segments): each physical chunk mapped under the
  buffer is exported as a file descriptor (``zePhysicalMemGetProperties`` with a
  ``ze_external_memory_export_fd_t`` chained, Level Zero 1.15; chunks are created
  exportable, a ``ze_external_memory_export_desc_t`` chained, when the loader has
  that entry point), and the importer creates physical memory from each
  descriptor (``zePhysicalMemCreate`` with a ``ze_external_memory_import_fd_t``
  chained) and maps the chunks back to back into a reservation of its own.
  Without the entry point (Debian's 1.8.12 loader) exporting such a buffer
  raises NotSupportedError naming it.

The specification does not say who owns the descriptor an export returns;
accel treats it as the driver's (valid while the chunk lives) and sends a
duplicate, as it does with an IPC handle's.

An interprocess event has
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

"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from accel._errors import InvalidHandleError, InvalidValueError, NotSupportedError
from accel.backends._sharing import check_extent, check_map_count, description, dup_for_export, natural, naturals
from accel.backends.xpu._library import describe_result
from accel.backends.xpu._records import DeviceState, EventState, new_handle

_PID = struct.Struct("!q")

if TYPE_CHECKING:
    from accel.backends.xpu._bindings import ZeLoader
    from accel.backends.xpu._event_pool import EventSlots

__all__ = ["Sharing"]

_FD_BYTES = 4
#: The entry point that exports physical memory, and the API version that added it.
_EXPORT_CALL = "zePhysicalMemGetProperties"
_EXPORT_VERSION = "1.15"


@dataclass(frozen=True)
class _Opened:
    """Memory opened with zeMemOpenIpcHandle: the base it returned."""

    base: int


@dataclass(frozen=True)
class _Mapped:
    """Physical chunks of another process mapped into a reservation of this one."""

    base: int
    size: int
    chunks: tuple[tuple[int, int, Any], ...]  # (address, size, the imported chunk's handle)


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
        def _require_vm(self, device: int) -> DeviceState: ...

    def supports_ipc(self, device: int) -> bool:
        return True

    def _init_sharing(self) -> None:
        self._ipc_imports: dict[int, _Opened | _Mapped] = {}  # imported address -> what to close
        # Whether physical chunks can be exported (the loader forwards Level Zero 1.15's
        # call): chunks are then created exportable, as the export requires.
        self._physical_export = self._ze.has(_EXPORT_CALL)
        # Devices whose driver refused an exportable chunk -> the result it answered.
        self._export_refused: dict[int, int] = {}

    def _exportable_chunk_desc(self, device: int) -> Any:
        """The ``pNext`` for zePhysicalMemCreate: an opaque-fd export descriptor, or NULL."""
        ffi, lib = self._ze.ffi, self._ze.lib
        if not self._physical_export or device in self._export_refused:
            return ffi.NULL
        return ffi.new("ze_external_memory_export_desc_t *", {
            "stype": lib.ZE_STRUCTURE_TYPE_EXTERNAL_MEMORY_EXPORT_DESC,
            "flags": lib.ZE_EXTERNAL_MEMORY_TYPE_FLAG_OPAQUE_FD,
        })

    def _refuse_export(self, device: int, code: int) -> None:
        """The driver refused an exportable chunk (``code``) and made a plain one: this device's
        chunks are made plain from now on, so that expandable segments keep working (unshareable)
        instead of failing."""
        self._export_refused.setdefault(device, code)

    def ipc_memory_export(self, device: int, ptr: int, nbytes: int) -> tuple[bytes, list[int]]:
        dev = self._devices[device]
        with dev.lock:
            base = next((b for b, n in dev.allocations.items() if b <= ptr and ptr + nbytes <= b + n), None)
            virtual = any(b <= ptr < b + n for b, n in dev.reservations.items())
            if base is None and virtual:
                return self._export_chunks(dev, ptr, nbytes)
        if base is None:
            raise InvalidValueError(f"xpu:{device}: [{ptr:#x}, {ptr + nbytes:#x}) is not memory allocated on this device")
        ffi, lib = self._ze.ffi, self._ze.lib
        handle = ffi.new("ze_ipc_mem_handle_t *")
        self._check("zeMemGetIpcHandle", lib.zeMemGetIpcHandle(self._context, ffi.cast("void *", base), handle), device)
        raw = bytes(ffi.buffer(handle.data, len(handle.data)))
        fd = dup_for_export(_fd_of(raw), "xpu", device)
        return json.dumps({"kind": "ipc", "handle": raw.hex(), "offset": ptr - base}).encode(), [fd]

    def _export_chunks(self, dev: DeviceState, ptr: int, nbytes: int) -> tuple[bytes, list[int]]:
        """Export the chunks mapped under [ptr, ptr + nbytes) (dev.lock held: none is unmapped meanwhile)."""
        device = dev.index
        if not self._physical_export:
            raise NotSupportedError(
                f"xpu:{device}: cannot share Level Zero virtual memory (expandable segments) with other "
                f"processes: exporting physical memory needs {_EXPORT_CALL} (Level Zero {_EXPORT_VERSION}), "
                f"which the loader {self._ze.path} does not export; point ACCEL_ZE_LOADER at a Level Zero "
                f"{_EXPORT_VERSION}+ loader, or share buffers allocated without expandable_segments"
            )
        refused = self._export_refused.get(device)
        if refused is not None:
            raise NotSupportedError(
                f"xpu:{device}: cannot share Level Zero virtual memory (expandable segments) with other "
                f"processes: the driver refused to create exportable physical memory (zePhysicalMemCreate "
                f"with an opaque-fd ze_external_memory_export_desc_t answered {describe_result(refused)}); "
                "share buffers allocated without expandable_segments"
            )
        ffi, lib = self._ze.ffi, self._ze.lib
        starts = sorted(a for a, (size, _) in dev.mappings.items() if a < ptr + nbytes and ptr < a + size)
        fds: list[int] = []
        sizes: list[int] = []
        try:
            at = ptr
            for start in starts:
                if start > at:
                    break  # a hole: reported below
                size, handle = dev.mappings[start]
                export = ffi.new("ze_external_memory_export_fd_t *", {
                    "stype": lib.ZE_STRUCTURE_TYPE_EXTERNAL_MEMORY_EXPORT_FD,
                    "flags": lib.ZE_EXTERNAL_MEMORY_TYPE_FLAG_OPAQUE_FD,
                    "fd": -1,
                })
                props = ffi.new("ze_physical_mem_properties_t *", {
                    "stype": lib.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_PROPERTIES, "pNext": export,
                })
                code = lib.zePhysicalMemGetProperties(self._context, dev.physical[handle].cdata, props)
                self._check(_EXPORT_CALL, code, device)
                fds.append(dup_for_export(export.fd, "xpu", device))
                sizes.append(size)
                at = start + size
            if at < ptr + nbytes:
                raise InvalidValueError(f"xpu:{device}: {at:#x} (in [{ptr:#x}, {ptr + nbytes:#x})) is not mapped")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        return json.dumps({"kind": "physical", "lead": ptr - starts[0] if starts else 0, "sizes": sizes}).encode(), fds

    def ipc_memory_import(self, device: int, payload: bytes, fds: list[int], nbytes: int) -> int:
        where = f"xpu:{device}: opening memory of another process"
        try:
            layout = description(payload, where)
            if layout.get("kind") == "physical":
                sizes = naturals(layout, "sizes", where, len(fds))
                lead = natural(layout, "lead", where)
                if lead >= sizes[0]:
                    raise InvalidHandleError(
                        f"xpu:{device}: the exporting process described its physical memory inconsistently "
                        f"({len(fds)} descriptor(s) for chunks of {sizes!r} bytes, {lead!r} bytes in); "
                        "pickle the buffer again in its process"
                    )
                check_extent(where, lead, nbytes, sum(sizes))
                check_map_count(len(sizes), where, device)  # each chunk a mapping of the process's own
                mapped = self._import_chunks(device, sizes, fds)
                ptr = mapped.base + lead
                with self._lock:
                    self._ipc_imports[ptr] = mapped
                return ptr
            if layout.get("kind") != "ipc" or len(fds) != 1:
                raise InvalidHandleError(
                    f"{where}: the exporting process described memory of kind {layout.get('kind')!r} with "
                    f"{len(fds)} descriptor(s)"
                )
            offset = natural(layout, "offset", where)
            raw = layout.get("handle")
            ffi, lib = self._ze.ffi, self._ze.lib
            handle = ffi.new("ze_ipc_mem_handle_t *")
            try:
                handle_bytes = bytes.fromhex(raw) if isinstance(raw, str) else b""
            except ValueError:
                handle_bytes = b""
            if len(handle_bytes) != len(handle.data):
                raise InvalidHandleError(f"{where}: the exporting process sent a damaged IPC handle ({raw!r:.40})")
            ffi.memmove(handle.data, _with_fd(handle_bytes, fds[0]), len(handle.data))
            out = ffi.new("void **")
            code = lib.zeMemOpenIpcHandle(self._context, self._devices[device].cdata, handle[0], 0, out)
            self._check("zeMemOpenIpcHandle", code, device)
        finally:
            for fd_ in fds:
                os.close(fd_)
        base = int(ffi.cast("uintptr_t", out[0]))
        size = ffi.new("size_t *")
        code = lib.zeMemGetAddressRange(self._context, out[0], ffi.NULL, size)
        try:
            self._check("zeMemGetAddressRange", code, device)
            # The handle names a whole allocation; the buffer must lie inside it.
            check_extent(where, offset, nbytes, int(size[0]))
        except BaseException:
            lib.zeMemCloseIpcHandle(self._context, out[0])
            raise
        ptr = base + offset
        with self._lock:
            self._ipc_imports[ptr] = _Opened(base)
        return ptr

    def _import_chunks(self, device: int, sizes: list[int], fds: list[int]) -> _Mapped:
        """Create physical memory from each descriptor and map the chunks back to back into a
        new reservation (the caller closes the descriptors: the driver keeps what it needs)."""
        if not self._physical_export:
            # The exporter's loader had the entry point, this one's has not: creating
            # physical memory from a descriptor is as new as exporting it.
            raise NotSupportedError(
                f"xpu:{device}: cannot open Level Zero virtual memory of another process: this process's "
                f"loader {self._ze.path} lacks {_EXPORT_CALL} (Level Zero {_EXPORT_VERSION}, the version that "
                f"also lets zePhysicalMemCreate import a file descriptor); use a Level Zero {_EXPORT_VERSION}+ "
                "loader (ACCEL_ZE_LOADER) here too"
            )
        ffi, lib = self._ze.ffi, self._ze.lib
        dev = self._require_vm(device)
        total = sum(sizes)
        out = ffi.new("void **")
        with dev.lock:  # the hint: as vm_reserve's (the validation layer refuses NULL)
            hint = dev.next_hint or dev.vm_page or total
        self._ze.check("zeVirtualMemReserve", lib.zeVirtualMemReserve(self._context, ffi.cast("void *", hint), total, out),
                       device=device, requested=total)
        base = int(ffi.cast("uintptr_t", out[0]))
        chunks: list[tuple[int, int, Any]] = []
        try:
            at = base
            for fd, size in zip(fds, sizes, strict=True):
                imported = ffi.new("ze_external_memory_import_fd_t *", {
                    "stype": lib.ZE_STRUCTURE_TYPE_EXTERNAL_MEMORY_IMPORT_FD,
                    "flags": lib.ZE_EXTERNAL_MEMORY_TYPE_FLAG_OPAQUE_FD,
                    "fd": fd,
                })
                desc = ffi.new("ze_physical_mem_desc_t *", {
                    "stype": lib.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC, "pNext": imported, "size": size,
                })
                chunk = ffi.new("ze_physical_mem_handle_t *")
                self._check("zePhysicalMemCreate", lib.zePhysicalMemCreate(self._context, dev.cdata, desc, chunk), device)
                code = lib.zeVirtualMemMap(self._context, ffi.cast("void *", at), size, chunk[0], 0,
                                           lib.ZE_MEMORY_ACCESS_ATTRIBUTE_READWRITE)
                if code != 0:
                    lib.zePhysicalMemDestroy(self._context, chunk[0])
                    self._check("zeVirtualMemMap", code, device)
                chunks.append((at, size, chunk[0]))
                at += size
        except BaseException:
            self._unmap_imported(device, _Mapped(base, total, tuple(chunks)))  # its failures are secondary
            raise
        return _Mapped(base, total, tuple(chunks))

    def _unmap_imported(self, device: int, mapped: _Mapped) -> list[tuple[str, int]]:
        """Unmap and destroy imported chunks, then free their reservation, attempting every call
        (what one fails to release cannot be retried); returns the failed ``(call, code)``."""
        ffi, lib = self._ze.ffi, self._ze.lib
        calls: list[tuple[str, int]] = []
        for at, size, chunk in mapped.chunks:
            calls.append(("zeVirtualMemUnmap", lib.zeVirtualMemUnmap(self._context, ffi.cast("void *", at), size)))
            calls.append(("zePhysicalMemDestroy", lib.zePhysicalMemDestroy(self._context, chunk)))
        calls.append(("zeVirtualMemFree", lib.zeVirtualMemFree(self._context, ffi.cast("void *", mapped.base), mapped.size)))
        return [(call, code) for call, code in calls if code != 0]

    def ipc_memory_close(self, device: int, ptr: int) -> None:
        with self._lock:
            opened = self._ipc_imports.pop(ptr, None)
        if opened is None:
            raise InvalidHandleError(
                f"xpu:{device}: ipc_memory_close({ptr:#x}): not memory imported from another process "
                "(already closed?)"
            )
        if isinstance(opened, _Mapped):
            for call, code in self._unmap_imported(device, opened)[:1]:
                self._check(call, code, device)
            return
        ffi, lib = self._ze.ffi, self._ze.lib
        self._check("zeMemCloseIpcHandle", lib.zeMemCloseIpcHandle(self._context, ffi.cast("void *", opened.base)), device)

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
            handle_size = len(self._ze.ffi.new("ze_ipc_event_pool_handle_t *").data)
            if len(fds) != 1 or len(payload) != _PID.size + handle_size:  # raw ValueError/struct.error before
                raise InvalidHandleError(
                    f"xpu:{device}: the exporting process described its event inconsistently ({len(payload)} "
                    f"bytes, {len(fds)} descriptor(s)); is it an accel process? Pickle the event again there"
                )
            (pid,) = _PID.unpack_from(payload)
            slot = self._slots.open_ipc(_with_fd(payload[_PID.size :], fds[0]))
        finally:
            for fd_ in fds:
                os.close(fd_)
        try:
            exporter = os.pidfd_open(pid)
        except (OSError, OverflowError):  # OverflowError: a "pid" past pid_t, from a damaged description
            exporter = -1  # gone already (it answered the broker a moment ago): waits are not bounded
        handle = new_handle()
        with self._lock:
            self._events[handle] = EventState(device, handle, False, slot=slot, ipc=True, exporter=exporter)
        return handle
