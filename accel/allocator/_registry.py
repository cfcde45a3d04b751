"""The per-device allocator registry: one caching allocator per device, one staging cache.

Each runtime keeps one :class:`AllocatorRegistry` (created on first use);
everything that allocates device memory through accel's caching allocator,
the ``accel.memory`` facade and graph pools alike, finds its allocator here.

>>> from accel.allocator import get_allocator
>>> get_allocator(0).device
0
"""

from __future__ import annotations

import threading
from typing import Any

from accel._device import DeviceLike
from accel._errors import InvalidValueError
from accel._runtime import Runtime, get_runtime
from accel.allocator._caching import DeviceAllocator, release_orphans, stream_destroyed
from accel.allocator._fork import track_lock
from accel.allocator._history import History
from accel.allocator._host_cache import HostCachingAllocator
from accel.allocator._resources import MemoryResource
from accel.allocator.config import AllocatorConfig, add_change_observer, config_for_backend

__all__ = [
    "AllocatorRegistry",
    "HistorySettings",
    "allocators",
    "empty_cache",
    "get_allocator",
    "registry",
    "set_upstream",
]

#: ``record_memory_history``'s arguments: (enabled, context, stacks, max_entries).
HistorySettings = tuple[str, "str | None", str, int]

_EXTENSION = "accel.allocator"


class AllocatorRegistry:
    """One runtime's allocators: per device, created on first use, plus the staging cache.

    Locking: ``lock`` guards the creation of allocators and the writes to
    ``allocators``, ``upstreams``, ``host`` and ``history``. Reads of
    ``allocators`` and ``host`` take no lock: an entry, once set, never
    changes, and a dict read is atomic under the GIL.
    """

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime
        self.lock = threading.Lock()
        track_lock(self, "lock")
        self.config: AllocatorConfig = config_for_backend(runtime.name)
        self.allocators: dict[int, DeviceAllocator] = {}
        self.upstreams: dict[int, MemoryResource] = {}
        self.host: HostCachingAllocator | None = None
        self.history: HistorySettings | None = None
        add_change_observer(self._config_changed)
        runtime.stream_destroy_listeners.append(self._stream_destroyed)

    def _stream_destroyed(self, index: int, handle: int) -> None:
        # runtime.backend, read now: in a forked child it is a stand-in no allocator uses.
        stream_destroyed(self.runtime.backend, index, handle)

    def _config_changed(self, backend: str, old: Any, new: Any) -> None:
        if backend != self.runtime.name:
            return
        self.config = new
        for allocator in list(self.allocators.values()):
            allocator.update_config(new)
        if self.host is not None:
            self.host.update_config(new)

    def allocator(self, index: int) -> DeviceAllocator:
        """The caching allocator of device ``index`` (a checked index), created on first use."""
        allocator = self.allocators.get(index)
        if allocator is None:
            with self.lock:
                allocator = self.allocators.get(index)
                if allocator is None:
                    allocator = DeviceAllocator(
                        self.runtime.backend, index, self.config, upstream=self.upstreams.get(index)
                    )
                    if self.history is not None:
                        allocator.record_history(History(*self.history))
                    self.allocators[index] = allocator
        return allocator

    def host_allocator(self) -> HostCachingAllocator:
        """The page-locked staging cache, created on first use."""
        if self.host is None:
            with self.lock:
                if self.host is None:
                    self.host = HostCachingAllocator(self.runtime.backend, self.config)
        return self.host

    def set_history(self, settings: HistorySettings | None) -> None:
        """Record allocation history with ``settings`` on every device (None: stop)."""
        if settings is not None:
            History(*settings)  # validate before touching any allocator
        with self.lock:
            self.history = settings
            live = list(self.allocators.values())
        for allocator in live:
            allocator.record_history(None if settings is None else History(*settings))


def registry(runtime: Runtime | None = None) -> AllocatorRegistry:
    """The allocator registry of ``runtime`` (default: the process's runtime)."""
    runtime = runtime if runtime is not None else get_runtime()
    found = runtime.extensions.get(_EXTENSION)
    if found is None:
        with runtime._lock:
            found = runtime.extensions.get(_EXTENSION)
            if found is None:
                found = runtime.extensions[_EXTENSION] = AllocatorRegistry(runtime)
    assert isinstance(found, AllocatorRegistry)
    return found


def device_allocator(runtime: Runtime, index: int) -> DeviceAllocator:
    """``registry(runtime).allocator(index)`` with the common case (both exist) first:
    two dict look-ups, for the allocation hot path."""
    found = runtime.extensions.get(_EXTENSION)
    if found is not None:
        allocator = found.allocators.get(index)  # type: ignore[attr-defined]
        if allocator is not None:
            return allocator  # type: ignore[no-any-return]
    return registry(runtime).allocator(index)


def get_allocator(device: DeviceLike = None) -> DeviceAllocator:
    """The caching allocator of ``device`` (created on first use).

    >>> import accel
    >>> accel.memory.get_allocator().device
    0
    """
    runtime = get_runtime()
    return registry(runtime).allocator(runtime.index(device))


def allocators(device: DeviceLike) -> list[DeviceAllocator]:
    """The allocators ``device`` names; None means every device that has one."""
    runtime = get_runtime()
    found = registry(runtime)
    if device is None:
        return [found.allocators[i] for i in sorted(found.allocators)]
    return [found.allocator(runtime.index(device))]


def empty_cache(device: DeviceLike = None) -> None:
    """Give the unused cached memory of ``device`` back (None: every device that has an allocator)."""
    for allocator in allocators(device):
        allocator.empty_cache()
    # Dropped pools' allocators of a device whose own allocator does not exist.
    runtime = get_runtime()
    release_orphans(runtime.backend, None if device is None else runtime.index(device))


def set_upstream(resource: MemoryResource, device: DeviceLike = None) -> None:
    """Make the allocator of ``device`` take its memory from ``resource``
    (an adaptor stack over :class:`~accel.allocator.BackendResource`).

    Only while the device's caching allocator does not exist yet: the first
    allocation on the device creates it, and so does the first call that reads
    or configures it (``memory_stats()``, ``memory_allocated()``,
    ``set_per_process_memory_fraction()``, ``get_allocator()``...). An
    allocator cannot change where its memory comes from, so call this first.

    >>> import accel
    >>> from accel.allocator import BackendResource, StatisticsAdaptor
    >>> backend = accel.memory.get_allocator(0).backend  # doctest: +SKIP
    >>> accel.memory.set_upstream(StatisticsAdaptor(BackendResource(backend, 1)), device=1)  # doctest: +SKIP
    """
    runtime = get_runtime()
    index = runtime.index(device)
    if not isinstance(resource, MemoryResource) or resource.device != index:
        raise InvalidValueError(f"{resource!r} is not a MemoryResource of device {index}")
    found = registry(runtime)
    with found.lock:
        if index in found.allocators:
            raise InvalidValueError(
                f"set_upstream() is too late for {runtime.device(index)}: its caching allocator already "
                "exists (made by the first allocation on the device, or by the first call that reads or "
                "configures it, such as memory_stats(), memory_allocated(), set_per_process_memory_fraction() "
                "or get_allocator()), and it cannot change where its memory comes from. Call set_upstream() "
                "for this device before any other accel.memory call on it, or give the resource to an "
                f"allocator of your own: accel.allocator.DeviceAllocator(backend, {index}, config, "
                "upstream=resource)"
            )
        found.upstreams[index] = resource
