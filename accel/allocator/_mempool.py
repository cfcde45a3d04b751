"""User memory pools: :class:`MemPool` and :func:`use_mem_pool`, like ``torch.cuda``'s.

A pool is a caching allocator of its own per device, with its own settings
(the process's allocator settings with the pool's overrides on top) and,
optionally, its own upstream :class:`~accel.allocator.MemoryResource`. Inside
``with use_mem_pool(pool):`` the allocations this thread makes on the pool's
device (``accel.memory.allocate``, ``accel.empty``, and the allocations of a
graph captured there) come from the pool; other threads and other devices are
not affected. The pool has its own statistics and snapshot, and its memory
goes back to the device once the pool is dropped and nothing allocated from it
is alive any more (without waiting for the device: memory whose streams still
have queued work then goes back at the next ``empty_cache`` of the device, or
when an allocation there runs short).

>>> import accel
>>> pool = accel.memory.MemPool("expandable_segments:False")
>>> with accel.memory.use_mem_pool(pool):
...     buf = accel.memory.allocate(4096)
>>> pool.memory_stats()["allocation.all.current"]
1
>>> buf.free(); del pool
"""

from __future__ import annotations

import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from accel._device import DeviceLike
from accel._errors import DeviceError, InvalidValueError
from accel._runtime import Runtime, get_runtime
from accel.allocator._caching import DeviceAllocator
from accel.allocator._pool_ids import PoolId, graph_pool_handle, register_mem_pool, unregister_mem_pool
from accel.allocator._registry import registry
from accel.allocator._resources import MemoryResource
from accel.allocator.config import AllocatorConfig, parse

__all__ = ["MemPool", "current_allocator", "routed_allocator", "use_mem_pool"]


class _Routing(threading.local):
    def __init__(self) -> None:
        self.stack: list[tuple[MemPool, int]] = []  # (pool, device index), innermost last


_routing = _Routing()
# Contexts open in any thread: while 0, allocation does not look at the
# thread-local stack at all (the common case costs one global read).
_open = 0
_open_lock = threading.Lock()


class MemPool:
    """A memory pool with its own caching allocator per device.

    ``settings``: allocator settings in ``ACCEL_ALLOC_CONF`` syntax laid over the
    process's settings (e.g. ``"expandable_segments:True"``), or a whole
    :class:`AllocatorConfig`. ``upstream``: where the pool's memory comes from
    (then the pool serves that resource's device only). ``id`` is a pool id
    from the same counter as :func:`graph_pool_handle`.

    >>> import accel
    >>> pool = accel.memory.MemPool()
    >>> pool.id[0], pool.use_count()
    (0, 1)
    """

    def __init__(
        self,
        settings: str | AllocatorConfig | None = None,
        *,
        upstream: MemoryResource | None = None,
    ) -> None:
        if settings is not None and not isinstance(settings, (str, AllocatorConfig)):
            raise InvalidValueError(
                f"MemPool(settings={settings!r}): pass allocator settings as a string such as "
                "'expandable_segments:True', or an AllocatorConfig"
            )
        if isinstance(settings, str):
            parse(settings, origin="MemPool()")  # refuse a bad string now, not at first use
        if upstream is not None and not isinstance(upstream, MemoryResource):
            raise InvalidValueError(f"MemPool(upstream={upstream!r}): pass an accel.allocator.MemoryResource")
        self._settings = settings
        self._upstream = upstream
        self._id = graph_pool_handle()
        self._runtime: Runtime | None = None
        self._lock = threading.Lock()
        self._allocators: dict[int, DeviceAllocator] = {}
        self._uses = 0  # open use_mem_pool contexts
        # Dropped: give the memory back now if nothing is allocated, else when
        # the last allocation is freed (buffers keep the allocators alive).
        register_mem_pool(self._id)
        self._finalizer = weakref.finalize(self, _release, self._allocators, self._id)

    @property
    def id(self) -> PoolId:
        """The pool's id, ``(0, N)``."""
        return self._id

    def use_count(self) -> int:
        """1 for the pool itself, plus one per ``use_mem_pool`` context open on it."""
        return 1 + self._uses

    def __repr__(self) -> str:
        return f"accel.memory.MemPool(id={self._id}, devices={sorted(self._allocators)})"

    def allocator(self, device: DeviceLike = None) -> DeviceAllocator:
        """The pool's caching allocator of ``device`` (created on first use)."""
        runtime = get_runtime()
        return self._allocator(runtime, runtime.index(device))

    def _allocator(self, runtime: Runtime, index: int) -> DeviceAllocator:
        allocator = self._allocators.get(index)
        if allocator is not None:
            return allocator
        with self._lock:
            allocator = self._allocators.get(index)
            if allocator is None:
                if self._runtime is not None and self._runtime is not runtime:
                    raise DeviceError(f"{self!r} belongs to the {self._runtime.name} backend, not {runtime.name}")
                if self._upstream is not None and self._upstream.device != index:
                    raise DeviceError(
                        f"{self!r} takes its memory from {self._upstream!r}, a resource of device "
                        f"{self._upstream.device}; it cannot serve device {index}"
                    )
                base = registry(runtime).config
                config = (
                    self._settings
                    if isinstance(self._settings, AllocatorConfig)
                    else base if self._settings is None
                    else parse(self._settings, origin="MemPool()", base=base)
                )
                allocator = DeviceAllocator(
                    runtime.backend, index, config, upstream=self._upstream, mempool=self._id
                )
                self._runtime = runtime
                self._allocators[index] = allocator
        return allocator

    def memory_stats(self, device: DeviceLike = None) -> OrderedDict[str, int]:
        """The pool's statistics on ``device``, with :func:`accel.memory.memory_stats`'s keys."""
        return OrderedDict(self.allocator(device).stats())

    def snapshot(self) -> list[dict[str, Any]]:
        """The pool's segments on every device, in ``memory_snapshot()``'s layout; their
        ``segment_pool_id`` is the pool's id."""
        out = []
        for index in sorted(self._allocators):
            for segment in self._allocators[index].snapshot():
                if segment["segment_pool_id"] == (0, 0):
                    segment["segment_pool_id"] = self._id
                out.append(segment)
        return out

    def empty_cache(self) -> None:
        """Give the pool's unused cached memory back to the device."""
        for allocator in list(self._allocators.values()):
            allocator.empty_cache()


def _release(allocators: dict[int, DeviceAllocator], pool_id: PoolId) -> None:
    unregister_mem_pool(pool_id)
    for allocator in allocators.values():
        allocator.release_when_idle()


@contextmanager
def use_mem_pool(pool: MemPool, device: DeviceLike = None) -> Iterator[None]:
    """Route this thread's allocations on ``device`` (default: the current device) to
    ``pool`` inside the ``with`` block; contexts nest, the innermost wins.

    >>> import accel
    >>> pool = accel.memory.MemPool()
    >>> with accel.memory.use_mem_pool(pool):
    ...     with accel.memory.allocate(512) as buf:
    ...         pool.memory_stats()["allocated_bytes.all.current"]
    512
    """
    global _open
    if not isinstance(pool, MemPool):
        raise InvalidValueError(f"use_mem_pool needs an accel.memory.MemPool, got {pool!r}")
    runtime = get_runtime()
    index = runtime.index(device)
    pool._allocator(runtime, index)  # refuse a device the pool cannot serve now
    stack = _routing.stack
    with _open_lock:
        _open += 1
        pool._uses += 1
    stack.append((pool, index))
    try:
        yield
    finally:
        # The innermost entry of this pool: contexts may be left out of order
        # (generators), and the others stay in force.
        for i in range(len(stack) - 1, -1, -1):
            if stack[i][0] is pool and stack[i][1] == index:
                del stack[i]
                break
        with _open_lock:
            _open -= 1
            pool._uses -= 1


def routed_allocator(runtime: Runtime, index: int) -> DeviceAllocator:
    """The allocator this thread's allocations on device ``index`` use: the innermost
    :func:`use_mem_pool` pool's for that device, else the device's."""
    if _open:
        for pool, device in reversed(_routing.stack):
            if device == index:
                return pool._allocator(runtime, index)
    return registry(runtime).allocator(index)


def current_allocator(device: DeviceLike = None) -> DeviceAllocator:
    """:func:`routed_allocator` for ``device`` (default: the current device)."""
    runtime = get_runtime()
    return routed_allocator(runtime, runtime.index(device))
