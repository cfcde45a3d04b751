"""Snapshots in PyTorch's layout, built by hand, for the CLI tests."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

MiB = 1 << 20


def _segment(address: int, total: int, kind: str, blocks: list[tuple[int, str]], pool=(0, 0), device=0) -> dict[str, Any]:
    out, offset = [], 0
    for size, state in blocks:
        out.append({"address": address + offset, "size": size, "requested_size": size if state != "inactive" else 0,
                    "state": state, "frames": []})
        offset += size
    assert offset == total
    allocated = sum(size for size, state in blocks if state == "active_allocated")
    return {
        "device": device, "address": address, "total_size": total, "allocated_size": allocated,
        "active_size": sum(size for size, state in blocks if state != "inactive"),
        "requested_size": allocated, "stream": 0, "segment_type": kind, "segment_pool_id": pool,
        "is_expandable": False, "frames": [], "blocks": out,
    }


def sample_snapshot() -> dict[str, Any]:
    """Two live segments (small, large), one freed large segment, a graph pool and an OOM in the trace.

    Final state: small pool 1.5 KiB allocated of 2 MiB reserved; large 4 MiB of
    20 MiB; pool (1,0): 2 MiB of 2 MiB.
    """
    segments = [
        _segment(0x1000_0000, 2 * MiB, "small", [(1024, "active_allocated"), (512, "active_allocated"), (2 * MiB - 1536, "inactive")]),
        _segment(0x2000_0000, 20 * MiB, "large", [(4 * MiB, "active_allocated"), (2 * MiB, "active_pending_free"), (14 * MiB, "inactive")]),
        _segment(0x4000_0000, 2 * MiB, "small", [(2 * MiB, "active_allocated")], pool=(1, 0)),
    ]
    trace: list[dict[str, Any]] = []
    time_us = 1_700_000_000_000_000

    def entry(action: str, addr: int, size: int) -> None:
        nonlocal time_us
        time_us += 1000
        item = {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": time_us, "frames": []}
        if action == "oom":
            item["device_free"] = item.pop("addr")
        trace.append(item)

    entry("segment_alloc", 0x1000_0000, 2 * MiB)
    entry("alloc", 0x1000_0000, 1024)
    entry("alloc", 0x1000_0400, 512)
    entry("segment_alloc", 0x2000_0000, 20 * MiB)
    entry("alloc", 0x2000_0000, 4 * MiB)
    entry("alloc", 0x2040_0000, 2 * MiB)
    entry("free_requested", 0x2040_0000, 2 * MiB)  # pending: used on another stream
    entry("segment_alloc", 0x3000_0000, 20 * MiB)
    entry("alloc", 0x3000_0000, 8 * MiB)
    entry("free_requested", 0x3000_0000, 8 * MiB)
    entry("free_completed", 0x3000_0000, 8 * MiB)
    entry("segment_free", 0x3000_0000, 20 * MiB)
    entry("oom", 0, 64 * MiB)
    entry("segment_alloc", 0x4000_0000, 2 * MiB)
    entry("alloc", 0x4000_0000, 2 * MiB)
    return {"segments": segments, "device_traces": [trace], "allocator_settings": {}, "external_annotations": []}


def write(path: Path, data: object) -> Path:
    path.write_bytes(pickle.dumps(data))
    return path
