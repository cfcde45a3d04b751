"""Host device memory: memfd-backed allocations and virtual memory, accounting.

Each host device keeps its own account of what it handed out, so that
``ACCEL_CPU_MEMORY_LIMIT`` gives a device a real capacity and the allocator's
out-of-memory paths can be exercised on any machine.

Every allocation (``malloc``) and every physical chunk (``create``, what
expandable segments map) is an anonymous file of its own (memfd), sized once
and sealed at that size, and mapped shared, so that another process can map
the same memory. What another process is handed (see ``export``) is the files
behind a buffer, never more: as in CUDA, it can reach at most the allocations
that hold the buffer, and the seals keep it from resizing them under this
process's mappings (SIGBUS). Freeing unmaps the file, gives its pages back
(a punched hole: a forked child's inherited mapping does not keep them) and
closes it.

That is a file descriptor per allocation and per 2 MiB chunk: the soft
limit on open files (often 1024, 2 GiB of chunks) is raised to the hard
limit the first time it is reached, and only a full table at the hard limit
is an error (an OutOfMemoryError saying so).
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import threading
from collections.abc import Iterator

from accel._errors import DriverError, InvalidHandleError, InvalidValueError, OutOfMemoryError
from accel._units import format_size
from accel.backends._sharing import check_extent, check_map_count, description, dup_for_export, more_descriptors, natural
from accel.backends.cpu import _libc

PAGE = os.sysconf("SC_PAGE_SIZE")
#: Virtual-memory granularity: what expandable segments grow and shrink by.
VM_GRANULARITY = 2 << 20


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _meminfo() -> dict[str, int]:
    values = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            values[key] = int(rest.split()[0]) * 1024
    return values


def machine_memory() -> tuple[int, int, str]:
    """``(available, total, source)`` of host memory: the cgroup limit if one
    applies and is below physical memory, else /proc/meminfo.

    With no file descriptor free to read those files, the kernel's sysinfo
    counts (free and total RAM, no cgroup) stand in: allocations then still work.
    """
    try:
        info = _meminfo()
    except OSError as exc:
        if not _libc.is_out_of_descriptors(exc):
            raise
        page = os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * page
        return os.sysconf("SC_AVPHYS_PAGES") * page, total, "sysinfo (no file descriptor free for /proc/meminfo)"
    total, available = info["MemTotal"], info.get("MemAvailable", info["MemFree"])
    for limit_path, usage_path in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        limit = _read_int(limit_path)
        usage = _read_int(usage_path)
        if limit is not None and usage is not None and limit < total:
            return max(0, min(available, limit - usage)), limit, "cgroup"
    return available, total, "/proc/meminfo"


def round_up(n: int, unit: int) -> int:
    return (n + unit - 1) // unit * unit


# Plain classes, not dataclasses: generating a dataclass's methods at import costs start-up time.
class _Reservation:
    __slots__ = ("mapped", "size")

    def __init__(self, size: int) -> None:
        self.size = size
        self.mapped: dict[int, tuple[int, int]] = {}  # addr -> (size, handle)


class _Chunk:
    """A physical memory handle: a sealed anonymous file (memfd) of ``size`` bytes."""

    __slots__ = ("fd", "live", "mappings", "pid", "size")

    def __init__(self, fd: int, size: int) -> None:
        self.fd = fd
        self.size = size
        self.pid = os.getpid()  # the process that made it (see DeviceMemory._close_file)
        self.live = True  # False once released; the file stays open while ranges still map it
        self.mappings = 0


def export_dup(fd: int, device: int) -> int:
    """A duplicate of ``fd`` for an export to own (see ``dup_for_export``); a full
    descriptor table raises the soft limit first, as for new memory."""
    try:
        return dup_for_export(fd, "cpu", device)
    except DriverError as exc:
        if exc.code != errno.EMFILE or not more_descriptors():
            raise
    return dup_for_export(fd, "cpu", device)


def _descriptor_limit() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return "unlimited" if soft == resource.RLIM_INFINITY else str(soft)


class _Allocations:
    """The mappings ``malloc`` handed out, by address, so that ``free`` unmaps
    exactly what was mapped there and refuses any other pointer."""

    def __init__(self, where: str, free_call: str, allocator: str) -> None:
        # How a bad free is reported: "cpu:0: free(0x...): not an allocation of this device ..."
        self._where, self._free_call, self._allocator = where, free_call, allocator
        # Reentrant: a garbage-collected buffer's finalizer may free memory while
        # this thread is inside an allocation.
        self._lock = threading.RLock()
        self._allocations: dict[int, int] = {}

    def _released(self, nbytes: int) -> None:
        """Account for ``nbytes`` given back by ``free`` (the lock is held)."""

    def free(self, ptr: int) -> None:
        with self._lock:
            size = self._allocations.pop(ptr, None)
            if size is None:
                raise InvalidHandleError(
                    f"{self._where}: {self._free_call}({ptr:#x}): not an allocation of {self._allocator} "
                    "(already freed, or allocated elsewhere)"
                )
            self._released(size)
        _libc.unmap(ptr, size)


class DeviceMemory(_Allocations):
    """Allocations of one host device, optionally capped at ``limit`` bytes."""

    def __init__(self, device: int, limit: int | None) -> None:
        super().__init__(f"cpu:{device}", "free", "this device")
        self.device = device
        self.limit = limit
        self._held = 0
        self._reservations: dict[int, _Reservation] = {}
        self._physical: dict[int, _Chunk] = {}  # live handles, and released ones still mapped
        self._next_handle = 1
        self._files: dict[int, tuple[int, int]] = {}  # malloc'd ptr -> (its file, the pid that made it)
        self._imports: dict[int, tuple[int, int]] = {}  # imported ptr -> (mapping base, length)

    # -- accounting ---------------------------------------------------------

    def info(self) -> tuple[int, int]:
        available, total, _ = machine_memory()
        if self.limit is None:
            return available, total
        with self._lock:
            return max(0, min(available, self.limit - self._held)), self.limit

    def _out_of_descriptors(self, nbytes: int, what: str, exc: OSError) -> OutOfMemoryError:
        # An OutOfMemoryError, so the caching allocator flushes its cache and retries.
        return OutOfMemoryError(
            f"cpu:{self.device}: {what} of {format_size(nbytes)} failed: the process has no free "
            f"file descriptor ({exc}; the limit is {_descriptor_limit()}, and accel raises it to the hard "
            "limit when it is reached). accel needs one per allocation and one per 2 MiB of expandable "
            "segments: free memory (and empty the allocator's cache), close files, or raise the hard "
            "limit (ulimit -n as root, or LimitNOFILE= of the service)",
            requested=nbytes,
            device=self.device,
        )

    def _charge(self, nbytes: int, what: str) -> None:
        """Count ``nbytes`` as held, or raise OutOfMemoryError. Caller holds the lock."""
        if self.limit is not None:
            capacity, source = self.limit, f"ACCEL_CPU_MEMORY_LIMIT={format_size(self.limit)}"
        else:
            _, capacity, source = machine_memory()
            source = f"host memory ({source})"
        if self._held + nbytes > capacity:
            raise OutOfMemoryError(
                f"cpu:{self.device}: {what} of {format_size(nbytes)} failed: "
                f"{format_size(self._held)} of {format_size(capacity)} already held by this "
                f"device, capacity from {source}. Free memory, or raise ACCEL_CPU_MEMORY_LIMIT.",
                requested=nbytes,
                device=self.device,
            )
        self._held += nbytes

    # -- plain allocations ----------------------------------------------------

    @contextlib.contextmanager
    def _charged(self, nbytes: int, what: str) -> Iterator[None]:
        """Hold ``nbytes`` against the capacity for the block's system call;
        give them back and raise OutOfMemoryError if the call fails, and give
        them back too when anything else stops it (an interrupt, Ctrl-C)."""
        self._charge(nbytes, what)
        try:
            with self._system_call(nbytes, what):
                yield
        except BaseException:
            self._held -= nbytes
            raise

    @contextlib.contextmanager
    def _system_call(self, nbytes: int, what: str) -> Iterator[None]:
        """Turn the block's OSError into an accel error: OutOfMemoryError when memory,
        address space or file descriptors ran out (so callers flush caches and retry),
        else DriverError."""
        try:
            yield
        except OSError as exc:
            if _libc.is_out_of_descriptors(exc):
                raise self._out_of_descriptors(nbytes, what, exc) from None
            if not _libc.is_oom(exc):
                raise self._driver_error(what, exc) from exc
            raise OutOfMemoryError(
                f"cpu:{self.device}: {what} of {format_size(nbytes)} failed: {exc}",
                requested=nbytes,
                device=self.device,
            ) from exc

    def _driver_error(self, what: str, exc: OSError) -> DriverError:
        code = exc.errno or 0
        return DriverError("cpu", what, code, errno.errorcode.get(code, "OSError"), str(exc), device=self.device)

    def malloc(self, nbytes: int) -> int:
        # A file of its own, mapped shared, rather than anonymous pages: so that
        # another process can map the same memory (export), and only it.
        size = round_up(nbytes, PAGE)
        with self._lock, self._charged(size, "allocation"):
            fd = _libc.memfd(size)
            try:
                ptr = _libc.map_fd(size, fd, 0)
            except OSError:
                os.close(fd)
                raise
            self._allocations[ptr] = size
            self._files[ptr] = (fd, os.getpid())
        return ptr

    def free(self, ptr: int) -> None:
        with self._lock:
            size = self._allocations.get(ptr, 0)
            super().free(ptr)  # refuses a pointer that is not an allocation
            fd, pid = self._files.pop(ptr)
            self._close_file(fd, size, pid, "freeing memory")

    def _released(self, nbytes: int) -> None:
        self._held -= nbytes

    def _close_file(self, fd: int, nbytes: int, pid: int, what: str) -> None:
        """Close a file of this device's memory that this process no longer maps.

        Its pages go back to the system at once, even while a forked child still
        maps it (it inherits the mappings and the descriptors, and would otherwise
        keep the memory until it exits); but only in the process ``pid`` that made
        the file: a forked child that frees what it inherited leaves the parent's
        pages alone."""
        try:
            if pid == os.getpid():
                _libc.punch_hole(fd, 0, nbytes)
        except OSError as exc:
            raise self._driver_error(what, exc) from exc
        finally:
            os.close(fd)

    # -- virtual memory -------------------------------------------------------

    def _check_multiple(self, call: str, nbytes: int) -> None:
        if nbytes <= 0 or nbytes % VM_GRANULARITY:
            raise InvalidValueError(
                f"cpu:{self.device}: {call}: size {nbytes} is not a positive multiple of the "
                f"granularity {VM_GRANULARITY}"
            )

    def reserve(self, nbytes: int) -> int:
        self._check_multiple("vm_reserve", nbytes)
        # Over-reserve by one granule, then trim, so the range is granule aligned.
        with self._system_call(nbytes, "address space reservation"):
            raw = _libc.reserve(nbytes + VM_GRANULARITY)
        start = round_up(raw, VM_GRANULARITY)
        if start > raw:
            _libc.unmap(raw, start - raw)
        tail = raw + nbytes + VM_GRANULARITY - (start + nbytes)
        if tail:
            _libc.unmap(start + nbytes, tail)
        with self._lock:
            self._reservations[start] = _Reservation(nbytes)
        return start

    def release_reservation(self, addr: int, nbytes: int) -> None:
        with self._lock:
            res = self._reservations.get(addr)
            if res is None or res.size != nbytes:
                raise InvalidHandleError(
                    f"cpu:{self.device}: vm_free({addr:#x}, {nbytes}): no reservation of that "
                    "address and size"
                )
            if res.mapped:
                raise InvalidValueError(
                    f"cpu:{self.device}: vm_free({addr:#x}): {len(res.mapped)} ranges are still "
                    "mapped; unmap them first"
                )
            del self._reservations[addr]
        _libc.unmap(addr, nbytes)

    def create(self, nbytes: int) -> int:
        self._check_multiple("vm_create", nbytes)
        with self._lock, self._charged(nbytes, "physical memory creation"):
            chunk = _Chunk(_libc.memfd(nbytes), nbytes)
            handle = self._next_handle
            self._next_handle += 1
            self._physical[handle] = chunk
        return handle

    def _live_chunk(self, call: str, handle: int) -> _Chunk:
        chunk = self._physical.get(handle)
        if chunk is None or not chunk.live:
            raise InvalidHandleError(f"cpu:{self.device}: {call}: {handle} is not a live physical memory handle")
        return chunk

    def _drop_if_unused(self, handle: int, chunk: _Chunk) -> None:
        """Give a released chunk's pages back once no range maps it (caller holds the lock)."""
        if chunk.live or chunk.mappings:
            return
        del self._physical[handle]
        self._close_file(chunk.fd, chunk.size, chunk.pid, "releasing physical memory")

    def release(self, handle: int) -> None:
        with self._lock:
            chunk = self._live_chunk(f"vm_release({handle})", handle)
            chunk.live = False
            self._held -= chunk.size
            # Pages stay valid while mapped (as with cuMemRelease); the last unmap gives them back.
            self._drop_if_unused(handle, chunk)

    def _reservation_of(self, addr: int, nbytes: int) -> _Reservation:
        for start, res in self._reservations.items():
            if start <= addr and addr + nbytes <= start + res.size:
                return res
        raise InvalidValueError(
            f"cpu:{self.device}: range [{addr:#x}, {addr + nbytes:#x}) is not inside a reservation"
        )

    def map(self, addr: int, nbytes: int, handle: int) -> None:
        with self._lock:
            chunk = self._live_chunk("vm_map", handle)
            if chunk.size != nbytes:
                raise InvalidValueError(
                    f"cpu:{self.device}: vm_map: the chunk is {chunk.size} bytes, not {nbytes}; map whole chunks"
                )
            res = self._reservation_of(addr, nbytes)
            for start, (length, _) in res.mapped.items():
                if start < addr + nbytes and addr < start + length:
                    raise InvalidValueError(
                        f"cpu:{self.device}: vm_map: [{addr:#x}, {addr + nbytes:#x}) overlaps a "
                        f"mapped range at {start:#x}"
                    )
            with self._system_call(nbytes, "mapping physical memory"):
                _libc.map_fd_fixed(addr, nbytes, chunk.fd, 0)
            chunk.mappings += 1
            res.mapped[addr] = (nbytes, handle)

    def unmap(self, addr: int, nbytes: int) -> None:
        with self._lock:
            res = self._reservation_of(addr, nbytes)
            inside = [s for s, (n, _) in res.mapped.items() if addr <= s and s + n <= addr + nbytes]
            covered = sum(res.mapped[s][0] for s in inside)
            if covered != nbytes:
                raise InvalidValueError(
                    f"cpu:{self.device}: vm_unmap: [{addr:#x}, {addr + nbytes:#x}) is not exactly "
                    "a union of mapped chunks"
                )
            _libc.reserve(nbytes, addr)  # back to inaccessible address space
            for start in inside:
                _, handle = res.mapped.pop(start)
                chunk = self._physical[handle]
                chunk.mappings -= 1
                self._drop_if_unused(handle, chunk)

    # -- sharing with other processes -------------------------------------------
    #
    # Every byte of device memory is in a file of its own allocation or chunk,
    # so an export names file ranges: one descriptor per file behind the buffer
    # (dup'd: the caller owns it) and, per piece, ``(file index, file offset,
    # length)``, page aligned, in address order. The importer can map those
    # files whole, and nothing else.

    def _pieces(self, ptr: int, nbytes: int) -> list[tuple[int, int, int]]:
        """The file ranges ``(fd, offset, length)`` behind the pages of ``[ptr, ptr + nbytes)``
        (caller holds the lock)."""
        start, end = ptr - ptr % PAGE, round_up(ptr + nbytes, PAGE)
        for base, size in self._allocations.items():
            if base <= start and end <= base + size:
                return [(self._files[base][0], start - base, end - start)]
        for res_start, res in self._reservations.items():
            if not (res_start <= start and end <= res_start + res.size):
                continue
            pieces, at = [], start
            for addr in sorted(res.mapped):
                size, handle = res.mapped[addr]
                if addr <= at < addr + size:
                    length = min(end, addr + size) - at
                    pieces.append((self._physical[handle].fd, at - addr, length))
                    at += length
                    if at == end:
                        return pieces
            break
        raise InvalidValueError(
            f"cpu:{self.device}: ipc_memory_export: [{ptr:#x}, {ptr + nbytes:#x}) is not memory "
            "allocated on this device (freed, or partly unmapped)"
        )

    def export(self, ptr: int, nbytes: int) -> tuple[bytes, list[int]]:
        import json

        with self._lock:
            pieces = self._pieces(ptr, nbytes)
            files: list[int] = []
            for fd, _, _ in pieces:
                if fd not in files:
                    files.append(fd)
            fds: list[int] = []
            try:
                for fd in files:
                    fds.append(export_dup(fd, self.device))
            except BaseException:
                for fd in fds:
                    os.close(fd)
                raise
        layout = {"lead": ptr % PAGE, "pieces": [(files.index(fd), off, n) for fd, off, n in pieces]}
        return json.dumps(layout).encode(), fds

    def import_(self, payload: bytes, fds: list[int], nbytes: int) -> int:
        try:
            lead, pieces = self._check_description(payload, fds, nbytes)
            total = sum(n for _, _, n in pieces)
            check_map_count(len(pieces), f"cpu:{self.device}: mapping memory of another process", self.device)
            with self._system_call(total, "mapping memory of another process"):
                base = _libc.reserve(total)
                at = base
                try:
                    for index, offset, length in pieces:
                        _libc.map_fd_fixed(at, length, fds[index], offset)
                        at += length
                except OSError:
                    _libc.unmap(base, total)
                    raise
        finally:
            for fd in fds:
                os.close(fd)
        ptr = base + lead
        with self._lock:
            self._imports[ptr] = (base, total)
        return ptr

    def _check_description(self, payload: bytes, fds: list[int], nbytes: int) -> tuple[int, list[tuple[int, int, int]]]:
        """``(lead, pieces)`` of an export's description, checked against the descriptors:
        mapping a range past the end of its file maps it, and the first read there is SIGBUS;
        so is the first read of a range the exporter cut off the file later, unless sealed."""
        where = f"cpu:{self.device}: mapping memory of another process"
        layout = description(payload, where)
        lead = natural(layout, "lead", where)
        raw = layout.get("pieces")
        pieces: list[tuple[int, int, int]] = []
        for piece in raw if isinstance(raw, list) else [None]:
            fields = dict(zip(("file", "offset", "length"), piece if isinstance(piece, list) and len(piece) == 3 else []))
            index, offset = natural(fields, "file", where), natural(fields, "offset", where)
            length = natural(fields, "length", where, positive=True)
            if index >= len(fds) or offset % PAGE or length % PAGE:
                raise InvalidHandleError(
                    f"{where}: the exporting process described its memory inconsistently (piece {piece!r} of "
                    f"{len(fds)} file(s), pages of {PAGE} bytes); pickle the buffer again in its process"
                )
            size = _libc.sealed_size(fds[index])
            if size is None:
                raise InvalidHandleError(
                    f"{where}: the exporting process sent a descriptor that is not memory sealed against "
                    "shrinking (F_SEAL_SHRINK), so it could shrink it under this process's mapping (the next "
                    "access there is SIGBUS). Is it an accel process? Pickle the buffer again in its process"
                )
            check_extent(where, offset, length, size)
            pieces.append((index, offset, length))
        if not pieces or lead >= PAGE:
            raise InvalidHandleError(
                f"{where}: the exporting process described its memory inconsistently ({len(pieces)} piece(s), "
                f"{lead} bytes into the first page); pickle the buffer again in its process"
            )
        check_extent(where, lead, nbytes, sum(n for _, _, n in pieces))
        return lead, pieces

    def close_import(self, ptr: int) -> None:
        with self._lock:
            mapping = self._imports.pop(ptr, None)
        if mapping is None:
            raise InvalidHandleError(
                f"cpu:{self.device}: ipc_memory_close({ptr:#x}): not memory imported from another process "
                "(already closed?)"
            )
        _libc.unmap(*mapping)


class HostMemory(_Allocations):
    """Page-aligned host memory for staging copies (every page is host memory here)."""

    def __init__(self) -> None:
        super().__init__("cpu", "host_free", "host_malloc")

    def malloc(self, nbytes: int) -> int:
        size = round_up(nbytes, PAGE)
        try:
            ptr = _libc.map_anonymous(size)
        except OSError as exc:
            raise OutOfMemoryError(
                f"host_malloc of {format_size(size)} failed: {exc}", requested=size
            ) from exc
        with self._lock:
            self._allocations[ptr] = size
        return ptr
