"""The few libc calls the host backend needs, through ctypes.

ctypes, not cffi: ``import accel`` already loads ctypes, so the host backend
(the one every machine without a GPU selects) starts without importing cffi
or parsing declarations; and ctypes takes no lock a finalizer could wait on.
What ``os`` offers (memfd_create, ftruncate) comes from ``os``, and file
seals from ``fcntl``.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
from collections.abc import Callable

from accel.backends._sharing import more_descriptors

_libc = ctypes.CDLL(None, use_errno=True)

_mmap = _libc.mmap
_mmap.restype = ctypes.c_void_p
_mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_munmap = _libc.munmap
_munmap.restype = ctypes.c_int
_munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_fallocate = _libc.fallocate
_fallocate.restype = ctypes.c_int
_fallocate.argtypes = (ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long)

PROT_NONE = 0
PROT_READ = 1
PROT_WRITE = 2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MAP_FAILED = ctypes.c_void_p(-1).value
PAGE = os.sysconf("SC_PAGE_SIZE")


def _os_error(call: str) -> OSError:
    code = ctypes.get_errno()
    return OSError(code, f"{call}: {os.strerror(code)}")


def is_oom(exc: OSError) -> bool:
    """Whether an OSError from these calls means 'no memory'."""
    return exc.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG)


def is_out_of_descriptors(exc: OSError) -> bool:
    """Whether an OSError means the process (EMFILE) or system (ENFILE) has no free file descriptor."""
    return exc.errno in (errno.EMFILE, errno.ENFILE)


def _map(addr: int, nbytes: int, prot: int, flags: int, fd: int, offset: int) -> int:
    ptr = _mmap(addr or None, nbytes, prot, flags, fd, offset)
    if ptr is None or ptr == MAP_FAILED:
        raise _os_error("mmap")
    return int(ptr)


def map_anonymous(nbytes: int) -> int:
    """Fresh read-write pages; returns their address."""
    return _map(0, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)


def map_fd(nbytes: int, fd: int, offset: int) -> int:
    """Map ``nbytes`` of file ``fd`` from ``offset`` read-write, shared; returns the address."""
    return _map(0, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, offset)


def reserve(nbytes: int, addr: int = 0) -> int:
    """Inaccessible address space (no memory behind it); at ``addr`` exactly if given."""
    flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (MAP_FIXED if addr else 0)
    return _map(addr, nbytes, PROT_NONE, flags, -1, 0)


def unmap(addr: int, nbytes: int) -> None:
    if _munmap(addr, nbytes) != 0:
        raise _os_error("munmap")


def new_descriptor(make: Callable[[], int]) -> int:
    """``make()``, which opens a file descriptor; when the process has none free
    (EMFILE) and the soft limit can rise, it rises to the hard limit and ``make()``
    runs once more. Raises OSError."""
    try:
        return make()
    except OSError as exc:
        if exc.errno != errno.EMFILE or not more_descriptors():
            raise
    return make()


#: The seals of every file accel shares: its size is fixed for good, so a process
#: it is shared with cannot shrink it under another's mappings (the next access
#: there would be SIGBUS), grow it, or seal it further (against writes).
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def memfd(nbytes: int, name: str = "accel-host-physical") -> int:
    """A new anonymous file of ``nbytes`` (holes: no memory until touched), sealed at
    that size: physical memory that can be mapped anywhere and passed on as an fd."""
    fd = new_descriptor(lambda: os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING))
    try:
        os.ftruncate(fd, nbytes)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
    except OSError:
        os.close(fd)
        raise
    return fd


def shared_page() -> int:
    """A one-page anonymous file, sealed at that size, for state shared with other processes."""
    return memfd(PAGE, "accel-host-shared")


def sealed_size(fd: int) -> int | None:
    """The size of file ``fd`` if it is sealed against shrinking, else None.

    A file received from another process is mapped only then: that process could
    otherwise shrink it under the mapping, and this one would die of SIGBUS."""
    try:
        sealed = fcntl.fcntl(fd, fcntl.F_GET_SEALS) & fcntl.F_SEAL_SHRINK
        # After the seals: a file sealed against shrinking keeps at least this size.
        return os.fstat(fd).st_size if sealed else None
    except OSError:  # not a file that can be sealed (a pipe, a socket, a file on disk)
        return None


def punch_hole(fd: int, offset: int, nbytes: int) -> None:
    """Give the file's pages in ``[offset, offset + nbytes)`` back to the system; they read as zeros
    (also in every other process that maps them)."""
    if _fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, nbytes) != 0:
        raise _os_error("fallocate")


def map_fd_fixed(addr: int, nbytes: int, fd: int, offset: int) -> None:
    """Map ``nbytes`` of file ``fd`` from ``offset`` read-write over ``[addr, addr + nbytes)``,
    replacing what is there."""
    _map(addr, nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, offset)


def memmove(dst: int, src: int, nbytes: int) -> None:
    ctypes.memmove(dst, src, nbytes)


def memset(dst: int, value: int, nbytes: int) -> None:
    ctypes.memset(dst, value, nbytes)
