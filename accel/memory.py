"""Device memory: buffers from the caching allocator, statistics, snapshots.

The names follow ``torch.accelerator`` / ``torch.cuda.memory``::

    import accel

    buf = accel.memory.allocate(1 << 20)          # on the current device and stream
    s = accel.Stream()
    s.fill(buf, 0)
    buf.record_stream(s)                          # reuse waits for s
    buf.free()                                    # or let it be garbage collected
    accel.memory.memory_stats()["allocated_bytes.all.current"]

Device arguments accept an index, ``"cuda:1"``, an :class:`accel.Device` or
a ``torch.device``; None means the current device.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from typing import Any

from accel._device import DeviceLike
from accel._runtime import get_runtime
from accel import allocator as _allocator
from accel.allocator._registry import allocators as _allocators
from accel.allocator._registry import registry as _registry
from accel.allocator._snapshot import dump_snapshot as _dump_snapshot
from accel.allocator._snapshot import summary as _summary
from accel.allocator import (
    Buffer,
    DeviceAllocator,
    HostBuffer,
    MemPool,
    allocate,
    allocate_host,
    get_allocator,
    graph_pool_handle,
    set_upstream,
    use_mem_pool,
)

__all__ = [
    "Buffer",
    "DeviceAllocator",
    "HostBuffer",
    "MemPool",
    "allocate",
    "allocate_host",
    "dump_snapshot",
    "empty_cache",
    "empty_host_cache",
    "get_allocator",
    "get_memory_info",
    "get_per_process_memory_fraction",
    "graph_pool_handle",
    "host_memory_stats",
    "max_memory_allocated",
    "max_memory_reserved",
    "mem_get_info",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_stats_as_nested_dict",
    "memory_summary",
    "record_memory_history",
    "reset_accumulated_host_memory_stats",
    "reset_accumulated_memory_stats",
    "reset_peak_host_memory_stats",
    "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
    "set_upstream",
    "use_mem_pool",
]


def empty_host_cache() -> None:
    """Free the cached staging memory whose copies completed."""
    host = _registry().host
    if host is not None:
        host.empty_cache()


def empty_cache(device: DeviceLike = None) -> None:
    """Give unused cached memory back to the device: whole free segments and free
    expandable pages. None means every device (unlike torch, not only the current one)."""
    _allocator.empty_cache(device)


def set_per_process_memory_fraction(fraction: float, device: DeviceLike = None) -> None:
    """Cap what the allocator of ``device`` reserves at ``fraction`` (0..1) of its memory."""
    get_allocator(device).set_memory_fraction(fraction)


def get_per_process_memory_fraction(device: DeviceLike = None) -> float:
    """The fraction of ``device``'s memory its allocator may reserve (1.0 when uncapped).

    >>> import accel
    >>> accel.memory.get_per_process_memory_fraction()
    1.0
    """
    return get_allocator(device).get_memory_fraction()


def host_memory_stats() -> OrderedDict[str, int | float]:
    """Statistics of the page-locked staging cache, with torch's keys
    (``allocations.current``, ``active_bytes.peak``, ``num_host_alloc``,
    ``host_alloc_time.avg``...; times in µs).

    >>> import accel
    >>> with accel.memory.allocate_host(4096):
    ...     accel.memory.host_memory_stats()["active_requests.current"]
    1
    """
    return OrderedDict(_registry().host_allocator().memory_stats())


def reset_peak_host_memory_stats() -> None:
    """Set the peaks of :func:`host_memory_stats` to the current values."""
    _registry().host_allocator().reset_peak_stats()


def reset_accumulated_host_memory_stats() -> None:
    """Zero the totals of :func:`host_memory_stats` (``.allocated``, ``.freed``, call counts and times)."""
    _registry().host_allocator().reset_accumulated_stats()


def memory_stats(device: DeviceLike = None) -> OrderedDict[str, int]:
    """PyTorch's ``memory_stats`` keys (``allocated_bytes.all.current``,
    ``num_alloc_retries``...) for ``device``, sorted.

    >>> import accel
    >>> accel.memory.memory_stats()["num_ooms"]
    0
    """
    return OrderedDict(get_allocator(device).stats())


def memory_stats_as_nested_dict(device: DeviceLike = None) -> dict[str, Any]:
    """:func:`memory_stats` as nested dicts, split at the dots, like torch's.

    >>> import accel
    >>> accel.memory.memory_stats_as_nested_dict()["allocated_bytes"]["all"]["current"] >= 0
    True
    """
    nested: dict[str, Any] = {}
    for key, value in get_allocator(device).stats().items():
        *path, leaf = key.split(".")
        node = nested
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = value
    return nested


def get_memory_info(device: DeviceLike = None, /) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device``'s memory, device-wide (as ``accel.get_memory_info``).

    >>> import accel
    >>> free, total = accel.memory.get_memory_info()
    >>> 0 <= free <= total
    True
    """
    runtime = get_runtime()
    return runtime.backend.memory_info(runtime.index(device))


def mem_get_info(device: DeviceLike = None) -> tuple[int, int]:
    """``torch.cuda.mem_get_info``'s name for :func:`get_memory_info`: ``(free, total)`` bytes."""
    return get_memory_info(device)


def memory_allocated(device: DeviceLike = None) -> int:
    """Bytes in allocated blocks (rounded sizes)."""
    return get_allocator(device).stats()["allocated_bytes.all.current"]


def max_memory_allocated(device: DeviceLike = None) -> int:
    """Peak of :func:`memory_allocated` since the start or the last peak reset."""
    return get_allocator(device).stats()["allocated_bytes.all.peak"]


def memory_reserved(device: DeviceLike = None) -> int:
    """Bytes the allocator holds from the device (allocated plus cached)."""
    return get_allocator(device).stats()["reserved_bytes.all.current"]


def max_memory_reserved(device: DeviceLike = None) -> int:
    """Peak of :func:`memory_reserved`."""
    return get_allocator(device).stats()["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    """Set every peak to the current value."""
    get_allocator(device).reset_peak_stats()


def reset_accumulated_memory_stats(device: DeviceLike = None) -> None:
    """Zero the ``allocated``/``freed`` totals and the event counters (retries, OOMs...)."""
    get_allocator(device).reset_accumulated_stats()


def memory_snapshot(device: DeviceLike = None) -> list[dict[str, Any]]:
    """Segments and blocks (PyTorch's ``memory_snapshot()`` layout); None: every device."""
    return [segment for a in _allocators(device) for segment in a.snapshot()]


def record_memory_history(
    enabled: str | None = "all",
    context: str | None = "all",
    stacks: str = "all",
    max_entries: int = sys.maxsize,
    device: DeviceLike = None,
) -> None:
    """Record allocation events (and their Python stacks) for :func:`dump_snapshot`.

    Arguments and their order are ``torch.cuda.memory._record_memory_history``'s.
    ``enabled``: "all" keeps a trace ring of ``max_entries``, "state" only the
    stacks of live blocks, None stops and clears. ``context``: which events
    carry stacks ("state", "alloc", "all" or None). ``stacks``: "python" or
    "all" (the same here: accel records Python frames only). Applies to every
    device, including allocators created later; ``device`` is checked (a
    device that does not exist is an error) but recording is never per device.

    >>> import accel
    >>> accel.memory.record_memory_history("all", "all", "python", 1000)
    >>> accel.memory.record_memory_history(None)
    """
    if device is not None:
        get_runtime().index(device)  # a bad device is an error, as in torch
    settings = None if enabled is None else (enabled, context, stacks, max_entries)
    _registry().set_history(settings)


def dump_snapshot(filename: str | os.PathLike[str] = "dump_snapshot.pickle") -> None:
    """Pickle the segments and traces for PyTorch's memory viewer
    (pytorch.org/memory_viz or ``python -m torch.cuda._memory_viz``).

    ``filename`` is torch's name for the argument (``_dump_snapshot(filename=...)``).
    """
    _dump_snapshot(filename)


def memory_summary(device: DeviceLike = None) -> str:
    """A table of the allocator's statistics for ``device``, like PyTorch's."""
    return _summary(get_allocator(device))
