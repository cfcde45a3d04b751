"""Upstream memory resources: where the caching allocator gets device memory.

A :class:`MemoryResource` hands out raw device memory for one device, and
optionally virtual memory (address reservations plus physical chunks) for
expandable segments. :class:`BackendResource` is the default: it calls the
Backend directly. Adaptors wrap another resource and compose, in the spirit
of RMM::

    upstream = LoggingAdaptor(StatisticsAdaptor(LimitingAdaptor(BackendResource(backend, 0), 1 << 30)))

Every adaptor forwards what it does not change, so a stack of them still
supports virtual memory when the bottom resource does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from accel._errors import InvalidValueError, OutOfMemoryError
from accel._units import format_size
from accel.backends.base import Backend

__all__ = [
    "BackendResource",
    "LimitingAdaptor",
    "LoggingAdaptor",
    "MemoryResource",
    "ResourceAdaptor",
    "ResourceCounts",
    "StatisticsAdaptor",
]

_T = TypeVar("_T")


class MemoryResource:
    """Raw memory of one device. Subclasses implement what they support.

    ``allocate`` raises :class:`~accel.OutOfMemoryError` when the memory is
    not there (the caching allocator then frees its cache and retries); any
    other exception is passed to the caller unchanged.
    """

    device: int

    def allocate(self, nbytes: int) -> int:
        """``nbytes`` of device memory, 512-byte aligned."""
        raise NotImplementedError

    def deallocate(self, ptr: int, nbytes: int) -> None:
        """Give back what :meth:`allocate` returned (``nbytes`` as asked)."""
        raise NotImplementedError

    def memory_info(self) -> tuple[int, int]:
        """``(free, total)`` bytes as this resource sees them."""
        raise NotImplementedError

    # Virtual memory, for expandable segments.
    def supports_virtual_memory(self) -> bool:
        return False

    def vm_granularity(self) -> int:
        raise NotImplementedError

    def vm_reserve(self, nbytes: int) -> int:
        raise NotImplementedError

    def vm_free(self, addr: int, nbytes: int) -> None:
        raise NotImplementedError

    def vm_create(self, nbytes: int) -> int:
        raise NotImplementedError

    def vm_release(self, handle: int, nbytes: int) -> None:
        raise NotImplementedError

    def vm_map(self, addr: int, nbytes: int, handle: int) -> None:
        raise NotImplementedError

    def vm_unmap(self, addr: int, nbytes: int) -> None:
        raise NotImplementedError


class BackendResource(MemoryResource):
    """Device memory straight from a Backend (``malloc``/``free``, ``vm_*``).

    >>> from accel.allocator import BackendResource
    >>> from accel.backends.cpu import CpuBackend
    >>> r = BackendResource(CpuBackend(1, None), 0)
    >>> r.deallocate(r.allocate(4096), 4096)
    """

    def __init__(self, backend: Backend, device: int) -> None:
        self.backend = backend
        self.device = device

    def __repr__(self) -> str:
        return f"BackendResource({self.backend.name}:{self.device})"

    def allocate(self, nbytes: int) -> int:
        return self.backend.malloc(self.device, nbytes)

    def deallocate(self, ptr: int, nbytes: int) -> None:
        self.backend.free(self.device, ptr)

    def memory_info(self) -> tuple[int, int]:
        return self.backend.memory_info(self.device)

    def supports_virtual_memory(self) -> bool:
        return self.backend.supports_virtual_memory(self.device)

    def vm_granularity(self) -> int:
        return self.backend.vm_granularity(self.device)

    def vm_reserve(self, nbytes: int) -> int:
        return self.backend.vm_reserve(self.device, nbytes)

    def vm_free(self, addr: int, nbytes: int) -> None:
        self.backend.vm_free(self.device, addr, nbytes)

    def vm_create(self, nbytes: int) -> int:
        return self.backend.vm_create(self.device, nbytes)

    def vm_release(self, handle: int, nbytes: int) -> None:
        self.backend.vm_release(self.device, handle)

    def vm_map(self, addr: int, nbytes: int, handle: int) -> None:
        self.backend.vm_map(self.device, addr, nbytes, handle)

    def vm_unmap(self, addr: int, nbytes: int) -> None:
        self.backend.vm_unmap(self.device, addr, nbytes)


class ResourceAdaptor(MemoryResource):
    """A resource that forwards everything to ``upstream``; adaptors override parts."""

    def __init__(self, upstream: MemoryResource) -> None:
        if not isinstance(upstream, MemoryResource):
            raise InvalidValueError(
                f"upstream={upstream!r} is not a MemoryResource; wrap a BackendResource or another adaptor"
            )
        self.upstream = upstream
        self.device = upstream.device

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.upstream!r})"

    def allocate(self, nbytes: int) -> int:
        return self.upstream.allocate(nbytes)

    def deallocate(self, ptr: int, nbytes: int) -> None:
        self.upstream.deallocate(ptr, nbytes)

    def memory_info(self) -> tuple[int, int]:
        return self.upstream.memory_info()

    def supports_virtual_memory(self) -> bool:
        return self.upstream.supports_virtual_memory()

    def vm_granularity(self) -> int:
        return self.upstream.vm_granularity()

    def vm_reserve(self, nbytes: int) -> int:
        return self.upstream.vm_reserve(nbytes)

    def vm_free(self, addr: int, nbytes: int) -> None:
        self.upstream.vm_free(addr, nbytes)

    def vm_create(self, nbytes: int) -> int:
        return self.upstream.vm_create(nbytes)

    def vm_release(self, handle: int, nbytes: int) -> None:
        self.upstream.vm_release(handle, nbytes)

    def vm_map(self, addr: int, nbytes: int, handle: int) -> None:
        self.upstream.vm_map(addr, nbytes, handle)

    def vm_unmap(self, addr: int, nbytes: int) -> None:
        self.upstream.vm_unmap(addr, nbytes)


class LimitingAdaptor(ResourceAdaptor):
    """Refuses to hold more than ``limit`` bytes (plain allocations plus physical chunks).

    >>> from accel.allocator import BackendResource, LimitingAdaptor
    >>> from accel.backends.cpu import CpuBackend
    >>> r = LimitingAdaptor(BackendResource(CpuBackend(1, None), 0), 1 << 20)
    >>> r.allocate(2 << 20)
    Traceback (most recent call last):
    ...
    accel._errors.OutOfMemoryError: LimitingAdaptor: 2.00 MiB asked, 0 bytes of 1.00 MiB held; ...
    """

    def __init__(self, upstream: MemoryResource, limit: int) -> None:
        super().__init__(upstream)
        if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
            raise InvalidValueError(f"limit={limit!r} must be a positive number of bytes")
        self.limit = limit
        self._held = 0
        self._lock = threading.Lock()

    @property
    def held(self) -> int:
        """Bytes currently held through this adaptor."""
        return self._held

    def _charge(self, nbytes: int) -> None:
        with self._lock:
            if self._held + nbytes > self.limit:
                raise OutOfMemoryError(
                    f"LimitingAdaptor: {format_size(nbytes)} asked, {format_size(self._held)} of "
                    f"{format_size(self.limit)} held; free memory or raise the limit",
                    requested=nbytes,
                    device=self.device,
                )
            self._held += nbytes

    def _refund(self, nbytes: int) -> None:
        with self._lock:
            self._held -= nbytes

    def allocate(self, nbytes: int) -> int:
        self._charge(nbytes)
        try:
            return self.upstream.allocate(nbytes)
        except BaseException:
            self._refund(nbytes)
            raise

    def deallocate(self, ptr: int, nbytes: int) -> None:
        self.upstream.deallocate(ptr, nbytes)
        self._refund(nbytes)

    def memory_info(self) -> tuple[int, int]:
        free, total = self.upstream.memory_info()
        return min(free, self.limit - self._held), min(total, self.limit)

    def vm_create(self, nbytes: int) -> int:
        self._charge(nbytes)
        try:
            return self.upstream.vm_create(nbytes)
        except BaseException:
            self._refund(nbytes)
            raise

    def vm_release(self, handle: int, nbytes: int) -> None:
        self.upstream.vm_release(handle, nbytes)
        self._refund(nbytes)


@dataclass
class ResourceCounts:
    """What a :class:`StatisticsAdaptor` saw: calls and bytes, current and peak."""

    allocations: int = 0
    deallocations: int = 0
    current_bytes: int = 0
    peak_bytes: int = 0
    total_bytes: int = 0
    failures: int = 0


class StatisticsAdaptor(ResourceAdaptor):
    """Counts calls and bytes held (plain allocations plus physical chunks).

    >>> from accel.allocator import BackendResource, StatisticsAdaptor
    >>> from accel.backends.cpu import CpuBackend
    >>> r = StatisticsAdaptor(BackendResource(CpuBackend(1, None), 0))
    >>> r.deallocate(r.allocate(4096), 4096)
    >>> r.counts.allocations, r.counts.peak_bytes, r.counts.current_bytes
    (1, 4096, 0)
    """

    def __init__(self, upstream: MemoryResource) -> None:
        super().__init__(upstream)
        self.counts = ResourceCounts()
        self._lock = threading.Lock()

    def _took(self, nbytes: int) -> None:
        with self._lock:
            c = self.counts
            c.allocations += 1
            c.current_bytes += nbytes
            c.total_bytes += nbytes
            c.peak_bytes = max(c.peak_bytes, c.current_bytes)

    def _gave(self, nbytes: int) -> None:
        with self._lock:
            self.counts.deallocations += 1
            self.counts.current_bytes -= nbytes

    def _failed(self) -> None:
        with self._lock:
            self.counts.failures += 1

    def allocate(self, nbytes: int) -> int:
        try:
            ptr = self.upstream.allocate(nbytes)
        except BaseException:
            self._failed()
            raise
        self._took(nbytes)
        return ptr

    def deallocate(self, ptr: int, nbytes: int) -> None:
        self.upstream.deallocate(ptr, nbytes)
        self._gave(nbytes)

    def vm_create(self, nbytes: int) -> int:
        try:
            handle = self.upstream.vm_create(nbytes)
        except BaseException:
            self._failed()
            raise
        self._took(nbytes)
        return handle

    def vm_release(self, handle: int, nbytes: int) -> None:
        self.upstream.vm_release(handle, nbytes)
        self._gave(nbytes)


class LoggingAdaptor(ResourceAdaptor):
    """Logs every call that takes or gives memory, at DEBUG level, to ``logger``.

    >>> from accel.allocator import BackendResource, LoggingAdaptor
    >>> import logging
    >>> from accel.backends.cpu import CpuBackend
    >>> r = LoggingAdaptor(BackendResource(CpuBackend(1, None), 0), logging.getLogger("accel.mr"))
    """

    def __init__(self, upstream: MemoryResource, logger: logging.Logger | None = None) -> None:
        super().__init__(upstream)
        self.logger = logger if logger is not None else logging.getLogger("accel.allocator.upstream")

    def _call(self, name: str, args: str, fn: Callable[..., _T], *call_args: object) -> _T:
        try:
            result = fn(*call_args)
        except BaseException as exc:
            self.logger.debug("%s(%s) on device %d failed: %s", name, args, self.device, exc)
            raise
        self.logger.debug(
            "%s(%s) on device %d -> %s", name, args, self.device, "" if result is None else f"{result:#x}"
        )
        return result

    def allocate(self, nbytes: int) -> int:
        return self._call("allocate", str(nbytes), self.upstream.allocate, nbytes)

    def deallocate(self, ptr: int, nbytes: int) -> None:
        self._call("deallocate", f"{ptr:#x}, {nbytes}", self.upstream.deallocate, ptr, nbytes)

    def vm_reserve(self, nbytes: int) -> int:
        return self._call("vm_reserve", str(nbytes), self.upstream.vm_reserve, nbytes)

    def vm_free(self, addr: int, nbytes: int) -> None:
        self._call("vm_free", f"{addr:#x}, {nbytes}", self.upstream.vm_free, addr, nbytes)

    def vm_create(self, nbytes: int) -> int:
        return self._call("vm_create", str(nbytes), self.upstream.vm_create, nbytes)

    def vm_release(self, handle: int, nbytes: int) -> None:
        self._call("vm_release", f"{handle}, {nbytes}", self.upstream.vm_release, handle, nbytes)

    def vm_map(self, addr: int, nbytes: int, handle: int) -> None:
        self._call("vm_map", f"{addr:#x}, {nbytes}, {handle}", self.upstream.vm_map, addr, nbytes, handle)

    def vm_unmap(self, addr: int, nbytes: int) -> None:
        self._call("vm_unmap", f"{addr:#x}, {nbytes}", self.upstream.vm_unmap, addr, nbytes)
