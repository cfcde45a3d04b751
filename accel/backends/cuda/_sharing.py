"""Sharing CUDA memory and events with other processes.

Two kinds of memory, two mechanisms (as PyTorch's CUDA IPC):

- memory from ``cuMemAlloc`` (segments of the caching allocator): a legacy
  IPC handle of the allocation's base (``cuIpcGetMemHandle``), plus the
  buffer's offset in it; the importer opens it with ``cuIpcOpenMemHandle``;
- virtual memory (expandable segments): each physical chunk under the range
  is exported as a POSIX file descriptor (``cuMemExportToShareableHandle``;
  chunks are created with that handle type where the device supports it),
  and the importer maps the chunks into a reservation of its own.

Events use ``cuIpcGetEventHandle``/``cuIpcOpenEventHandle``.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from accel._errors import InvalidHandleError, InvalidValueError, NotSupportedError
from accel.backends._sharing import check_extent, check_map_count, description, natural, naturals
from accel.backends.cuda._bindings import Driver
from accel.backends.cuda._constants import (
    CUDA_SUCCESS,
    CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_MEM_LOCATION_TYPE_DEVICE,
)

__all__ = ["Sharing"]


class Sharing:
    """The Backend protocol's ipc_* methods for :class:`CudaBackend` (a mixin)."""

    # The backend's driver plumbing this part calls through (set or defined by CudaBackend).
    _driver: Driver
    _ffi: Any
    _fn: dict[str, Any]

    if TYPE_CHECKING:

        def _enter(self, device: int) -> bool: ...
        def _leave(self, device: int, pushed: bool) -> None: ...
        def _check(self, call: str, code: int, device: int | None, *, handle: str = "", capture: bool = False,
                   requested: int = 0) -> None: ...

    def _init_sharing(self) -> None:
        # Imported address -> ("legacy", opened base) or ("vmm", reservation, size).
        self._imports: dict[int, tuple[Any, ...]] = {}

    def supports_ipc(self, device: int) -> bool:
        return bool(self._driver.has_ipc)

    def _require_ipc(self, device: int) -> None:
        if not self._driver.has_ipc:
            raise NotSupportedError(
                f"cuda:{device}: the driver does not export the cuIpc* entry points, so memory and events "
                "cannot be shared with other processes"
            )

    def _address_range(self, device: int, ptr: int) -> tuple[int, int]:
        base, size = self._ffi.new("CUdeviceptr *"), self._ffi.new("size_t *")
        self._check("cuMemGetAddressRange", self._fn["cuMemGetAddressRange"](base, size, ptr), device,
                    handle=f"device pointer {ptr:#x}")
        return int(base[0]), int(size[0])

    def _retained_chunk(self, ptr: int) -> int | None:
        """The physical chunk mapped at ``ptr`` (retained: release it), or None outside virtual memory."""
        if not self._driver.has_vmm_ipc:
            return None
        out = self._ffi.new("CUmemGenericAllocationHandle *")
        if self._fn["cuMemRetainAllocationHandle"](out, self._ffi.cast("void *", ptr)) != CUDA_SUCCESS:
            return None
        return int(out[0])

    def ipc_memory_export(self, device: int, ptr: int, nbytes: int) -> tuple[bytes, list[int]]:
        self._require_ipc(device)
        pushed = self._enter(device)
        try:
            chunk = self._retained_chunk(ptr)
            if chunk is None:
                return self._export_allocation(device, ptr, nbytes), []
            self._check("cuMemRelease", self._fn["cuMemRelease"](chunk), device)
            return self._export_chunks(device, ptr, nbytes)
        finally:
            self._leave(device, pushed)

    def _export_allocation(self, device: int, ptr: int, nbytes: int) -> bytes:
        base, size = self._address_range(device, ptr)
        if ptr + nbytes > base + size:
            raise InvalidValueError(
                f"cuda:{device}: [{ptr:#x}, {ptr + nbytes:#x}) runs past the allocation it starts in"
            )
        handle = self._ffi.new("CUipcMemHandle *")
        self._check("cuIpcGetMemHandle", self._fn["cuIpcGetMemHandle"](handle, base), device,
                    handle=f"allocation {base:#x}")
        raw = bytes(self._ffi.buffer(handle.reserved, 64))
        return json.dumps({"kind": "legacy", "handle": raw.hex(), "offset": ptr - base}).encode()

    def _export_chunks(self, device: int, ptr: int, nbytes: int) -> tuple[bytes, list[int]]:
        fds: list[int] = []
        sizes: list[int] = []
        lead = 0
        try:
            at, end = ptr, ptr + nbytes
            while at < end:
                base, size = self._address_range(device, at)
                if not sizes:
                    lead = ptr - base
                chunk = self._retained_chunk(at)
                if chunk is None:
                    raise InvalidValueError(f"cuda:{device}: {at:#x} is not mapped virtual memory")
                fd = self._ffi.new("int *")
                try:
                    code = self._fn["cuMemExportToShareableHandle"](fd, chunk, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0)
                finally:
                    self._fn["cuMemRelease"](chunk)
                if code != CUDA_SUCCESS:
                    raise NotSupportedError(
                        f"cuda:{device}: cuMemExportToShareableHandle refused the chunk at {base:#x} "
                        f"({self._driver.describe(code)}): this device cannot export virtual memory as file "
                        "descriptors; share buffers allocated without expandable_segments"
                    )
                fds.append(int(fd[0]))
                sizes.append(size)
                at = base + size
        except BaseException:
            for fd_ in fds:
                os.close(fd_)
            raise
        return json.dumps({"kind": "vmm", "lead": lead, "sizes": sizes}).encode(), fds

    def ipc_memory_import(self, device: int, payload: bytes, fds: list[int], nbytes: int) -> int:
        pushed = False
        try:
            self._require_ipc(device)
            # Parsed and checked inside the try: the descriptors are closed whatever the payload.
            where = f"cuda:{device}: opening memory of another process"
            layout = description(payload, where)
            pushed = self._enter(device)
            if layout.get("kind") == "legacy":
                raw = layout.get("handle")
                offset = natural(layout, "offset", where)
                try:
                    handle_bytes = bytes.fromhex(raw) if isinstance(raw, str) else b""
                except ValueError:
                    handle_bytes = b""
                if len(handle_bytes) != 64:
                    raise InvalidHandleError(f"{where}: the exporting process sent a damaged IPC handle ({raw!r:.40})")
                handle = self._ffi.new("CUipcMemHandle *")
                self._ffi.memmove(handle.reserved, handle_bytes, 64)
                out = self._ffi.new("CUdeviceptr *")
                code = self._fn["cuIpcOpenMemHandle"](out, handle[0], CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
                self._check("cuIpcOpenMemHandle", code, device, handle="IPC memory handle")
                base = int(out[0])
                try:
                    # The handle names a whole allocation; the buffer must lie inside it.
                    check_extent(where, offset, nbytes, self._address_range(device, base)[1])
                except BaseException:
                    self._fn["cuIpcCloseMemHandle"](base)
                    raise
                ptr = base + offset
                self._imports[ptr] = ("legacy", base)
                return ptr
            if layout.get("kind") != "vmm":
                raise InvalidHandleError(f"{where}: the exporting process described memory of kind {layout.get('kind')!r}")
            # One descriptor per chunk: mapping fewer chunks than the sizes add up to
            # left the rest of the reservation unmapped under the buffer (SIGSEGV).
            sizes = naturals(layout, "sizes", where, len(fds))
            lead = natural(layout, "lead", where)
            check_extent(where, lead, nbytes, sum(sizes))
            # Each chunk is a mapping of the process's own (the driver maps it into the
            # address space: host memory under the simulated driver).
            check_map_count(len(sizes), where, device)
            base = self._import_chunks(device, sizes, fds)
            ptr = base + lead
            self._imports[ptr] = ("vmm", base, sum(sizes))
            return ptr
        finally:
            for fd in fds:
                os.close(fd)
            if pushed:
                self._leave(device, pushed)

    def _import_chunks(self, device: int, sizes: list[int], fds: list[int]) -> int:
        """Map the chunks behind ``fds`` back to back into a new reservation (context current)."""
        total = sum(sizes)
        out = self._ffi.new("CUdeviceptr *")
        self._check("cuMemAddressReserve", self._fn["cuMemAddressReserve"](out, total, 0, 0, 0), device,
                    requested=total)
        base = int(out[0])
        access = self._ffi.new("CUmemAccessDesc *")
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        mapped = 0
        try:
            for fd, size in zip(fds, sizes, strict=True):
                chunk = self._ffi.new("CUmemGenericAllocationHandle *")
                code = self._fn["cuMemImportFromShareableHandle"](
                    chunk, self._ffi.cast("void *", fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                )
                self._check("cuMemImportFromShareableHandle", code, device)
                try:
                    self._check("cuMemMap", self._fn["cuMemMap"](base + mapped, size, 0, chunk[0], 0), device)
                finally:
                    self._fn["cuMemRelease"](chunk[0])  # the mapping keeps the chunk
                mapped += size
                self._check("cuMemSetAccess", self._fn["cuMemSetAccess"](base + mapped - size, size, access, 1), device)
        except BaseException:
            if mapped:
                self._fn["cuMemUnmap"](base, mapped)
            self._fn["cuMemAddressFree"](base, total)
            raise
        return base

    def ipc_memory_close(self, device: int, ptr: int) -> None:
        entry = self._imports.pop(ptr, None)
        if entry is None:
            raise InvalidHandleError(
                f"cuda:{device}: ipc_memory_close({ptr:#x}): not memory imported from another process "
                "(already closed?)"
            )
        pushed = self._enter(device)
        try:
            if entry[0] == "legacy":
                self._check("cuIpcCloseMemHandle", self._fn["cuIpcCloseMemHandle"](entry[1]), device)
            else:
                _, base, total = entry
                self._check("cuMemUnmap", self._fn["cuMemUnmap"](base, total), device)
                self._check("cuMemAddressFree", self._fn["cuMemAddressFree"](base, total), device)
        finally:
            self._leave(device, pushed)

    def ipc_event_export(self, device: int, event: int) -> tuple[bytes, list[int]]:
        self._require_ipc(device)
        handle = self._ffi.new("CUipcEventHandle *")
        pushed = self._enter(device)
        try:
            code = self._fn["cuIpcGetEventHandle"](handle, self._ffi.cast("CUevent", event))
        finally:
            self._leave(device, pushed)
        self._check("cuIpcGetEventHandle", code, device, handle=f"event {event:#x} (created interprocess?)")
        return bytes(self._ffi.buffer(handle.reserved, 64)), []

    def ipc_event_import(self, device: int, payload: bytes, fds: list[int]) -> int:
        for fd in fds:
            os.close(fd)
        self._require_ipc(device)
        if len(payload) != 64:  # memmove below copies 64 bytes: past the end of a shorter payload
            raise InvalidHandleError(
                f"cuda:{device}: the exporting process sent a damaged IPC event handle ({len(payload)} bytes, "
                "not 64); is it an accel process? Pickle the event again there"
            )
        handle = self._ffi.new("CUipcEventHandle *")
        self._ffi.memmove(handle.reserved, payload, 64)
        out = self._ffi.new("CUevent *")
        pushed = self._enter(device)
        try:
            code = self._fn["cuIpcOpenEventHandle"](out, handle[0])
        finally:
            self._leave(device, pushed)
        self._check("cuIpcOpenEventHandle", code, device, handle="IPC event handle")
        return int(self._ffi.cast("uintptr_t", out[0]))
