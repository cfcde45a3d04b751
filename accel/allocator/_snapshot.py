"""Snapshots and summaries of the allocators: PyTorch's pickle layout and its summary table.

>>> from accel.allocator._snapshot import full_snapshot
>>> sorted(full_snapshot())
['allocator_settings', 'device_traces', 'external_annotations', 'segments']
"""

from __future__ import annotations

import os
import pickle
from typing import Any

from accel._errors import InvalidValueError
from accel._runtime import get_runtime
from accel._units import format_size
from accel.allocator._caching import DeviceAllocator
from accel.allocator._registry import allocators, registry
from accel.allocator.config import AllocatorConfig

__all__ = ["dump_snapshot", "full_snapshot", "summary"]


def _settings(config: AllocatorConfig) -> dict[str, Any]:
    table = config.roundup_power2_divisions
    return {
        "ACCEL_ALLOC_CONF": str(config),
        "max_split_size": -1 if config.max_split_size is None else config.max_split_size,
        "garbage_collection_threshold": config.garbage_collection_threshold,
        "expandable_segments": config.expandable_segments,
        "roundup_power2_divisions": {str(1 << i): d for i, d in enumerate(table)},
    }


def full_snapshot() -> dict[str, Any]:
    """Every device's segments and traces, with the settings (``torch.cuda.memory._snapshot()``'s layout)."""
    runtime = get_runtime()
    live = allocators(None)
    traces: list[list[dict[str, Any]]] = [[] for _ in range(runtime.device_count())]
    for allocator in live:
        traces[allocator.device] = allocator.trace()
    return {
        "segments": [seg for a in live for seg in a.snapshot()],
        "device_traces": traces,
        "allocator_settings": _settings(registry(runtime).config),
        "external_annotations": [],
    }


def dump_snapshot(path: str | os.PathLike[str]) -> None:
    """Pickle :func:`full_snapshot` to ``path``."""
    if not isinstance(path, (str, bytes, os.PathLike)):
        # open() takes an int as a file descriptor: True wrote into stdout, then closed it.
        raise InvalidValueError(f"filename={path!r} must be a path (a str, bytes or os.PathLike)")
    snapshot = full_snapshot()
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)


_SUMMARY_ROWS = (
    ("Allocated memory", "allocated_bytes", True),
    ("Active memory", "active_bytes", True),
    ("Requested memory", "requested_bytes", True),
    ("Reserved memory", "reserved_bytes", True),
    ("Non-releasable memory", "inactive_split_bytes", True),
    ("Allocations", "allocation", False),
    ("Active allocs", "active", False),
    ("Reserved segments", "segment", False),
    ("Non-releasable allocs", "inactive_split", False),
)
_SUMMARY_COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")


def summary(allocator: DeviceAllocator) -> str:
    """A table of ``allocator``'s statistics, laid out like PyTorch's ``memory_summary``."""
    stats = allocator.stats()
    width = 79
    line = "=" * width
    title = "accel memory summary, device " + str(get_runtime().device(allocator.device))
    out = [
        line,
        f"|{title:^{width - 2}}|",
        line,
        f"| {'Metric':<25}| {'Cur Usage':>10} | {'Peak Usage':>10} | {'Tot Alloc':>10} | {'Tot Freed':>7} |",
    ]
    for label, key, is_bytes in _SUMMARY_ROWS:
        out.append("-" * width)
        for pool, name in (("all", label), ("large_pool", "  from large pool"), ("small_pool", "  from small pool")):
            values = [stats[f"{key}.{pool}.{m}"] for m in ("current", "peak", "allocated", "freed")]
            text = [format_size(v) if is_bytes else str(v) for v in values]
            out.append(f"| {name:<25}| {text[0]:>10} | {text[1]:>10} | {text[2]:>10} | {text[3]:>9} |")
    out.append(line)
    for key in _SUMMARY_COUNTERS:
        out.append(f"| {key:<25}| {stats[key]:>48} |")
    out.append(line)
    return "\n".join(out)
