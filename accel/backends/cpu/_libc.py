"""The few libc calls the host backend needs, bound with cffi in ABI mode."""

from __future__ import annotations

import errno
import os
from typing import Any

import cffi

ffi = cffi.FFI()
ffi.cdef(
    """
    void *mmap(void *addr, size_t length, int prot, int flags, int fd, long offset);
    int munmap(void *addr, size_t length);
    int memfd_create(const char *name, unsigned int flags);
    int ftruncate(int fd, long length);
    int fallocate(int fd, int mode, long offset, long len);
    int close(int fd);
    void *memmove(void *dest, const void *src, size_t n);
    void *memset(void *s, int c, size_t n);
    """
)
libc: Any = ffi.dlopen(None)

PROT_NONE = 0
PROT_READ = 1
PROT_WRITE = 2
MAP_SHARED = 0x01
MAP_PRIVATE = 0x02
MAP_FIXED = 0x10
MAP_ANONYMOUS = 0x20
MAP_NORESERVE = 0x4000
MFD_CLOEXEC = 0x0001
FALLOC_FL_KEEP_SIZE = 0x01
FALLOC_FL_PUNCH_HOLE = 0x02
MAP_FAILED = ffi.cast("void *", -1)


def _os_error(call: str) -> OSError:
    code = ffi.errno
    return OSError(code, f"{call}: {os.strerror(code)}")


def is_oom(exc: OSError) -> bool:
    """Whether an OSError from these calls means 'no memory'."""
    return exc.errno in (errno.ENOMEM, errno.ENOSPC, errno.EFBIG)


def is_out_of_descriptors(exc: OSError) -> bool:
    """Whether an OSError means the process (EMFILE) or system (ENFILE) has no free file descriptor."""
    return exc.errno in (errno.EMFILE, errno.ENFILE)


def map_anonymous(nbytes: int) -> int:
    """Fresh read-write pages; returns their address."""
    ptr = libc.mmap(ffi.NULL, nbytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if ptr == MAP_FAILED:
        raise _os_error("mmap")
    return int(ffi.cast("uintptr_t", ptr))


def reserve(nbytes: int, addr: int = 0) -> int:
    """Inaccessible address space (no memory behind it); at ``addr`` exactly if given."""
    flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | (MAP_FIXED if addr else 0)
    ptr = libc.mmap(ffi.cast("void *", addr), nbytes, PROT_NONE, flags, -1, 0)
    if ptr == MAP_FAILED:
        raise _os_error("mmap")
    return int(ffi.cast("uintptr_t", ptr))


def unmap(addr: int, nbytes: int) -> None:
    if libc.munmap(ffi.cast("void *", addr), nbytes) != 0:
        raise _os_error("munmap")


def memfd() -> int:
    """An empty anonymous file: physical memory that can be mapped anywhere (and passed on as an fd)."""
    fd = libc.memfd_create(b"accel-host-physical", MFD_CLOEXEC)
    if fd < 0:
        raise _os_error("memfd_create")
    return int(fd)


def truncate(fd: int, nbytes: int) -> None:
    """Set the file's length; growing it adds holes (no memory until touched)."""
    if libc.ftruncate(fd, nbytes) != 0:
        raise _os_error("ftruncate")


def punch_hole(fd: int, offset: int, nbytes: int) -> None:
    """Give the file's pages in ``[offset, offset + nbytes)`` back to the system; they read as zeros."""
    if libc.fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, nbytes) != 0:
        raise _os_error("fallocate")


def close(fd: int) -> None:
    libc.close(fd)


def map_fd_fixed(addr: int, nbytes: int, fd: int, offset: int) -> None:
    """Map ``nbytes`` of file ``fd`` from ``offset`` read-write over ``[addr, addr + nbytes)``,
    replacing what is there."""
    ptr = libc.mmap(
        ffi.cast("void *", addr), nbytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, offset
    )
    if ptr == MAP_FAILED:
        raise _os_error("mmap")


def memmove(dst: int, src: int, nbytes: int) -> None:
    libc.memmove(ffi.cast("void *", dst), ffi.cast("void *", src), nbytes)


def memset(dst: int, value: int, nbytes: int) -> None:
    libc.memset(ffi.cast("void *", dst), value, nbytes)
