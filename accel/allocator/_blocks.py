"""What callers of the caching allocator hold: the books themselves (plain and
expandable segments, blocks, free lists) are kept by the native core
(csrc/accel_core.c); a caller holds a :class:`CoreBlock`, a handle of one of its blocks.
"""

from __future__ import annotations

from typing import Any

from accel.allocator._pool_ids import PoolId

__all__ = ["ALLOCATED", "PENDING", "RETIRED", "CoreBlock", "PrivatePool"]

#: A handle's states. PENDING: freed by the caller but waiting for other streams'
#: events (or for a capture to end) before it may be reused. RETIRED: freed; a stale
#: second ``free`` of it is refused instead of freeing the memory's next owner.
ALLOCATED, PENDING, RETIRED = 1, 2, 3


class CoreBlock:
    """A caller's handle of a block the native core handed out: ALLOCATED, PENDING
    (freed, held in the core until other streams' events pass) or RETIRED (freed: a
    stale second ``free`` of it is refused instead of freeing the memory's next owner)."""

    __slots__ = ("ptr", "size", "requested", "stream", "owner", "state", "stream_uses", "event_count", "frames")

    def __init__(self, owner: object, ptr: int, size: int, requested: int, stream: int) -> None:
        self.owner = owner
        self.ptr = ptr
        self.size = size
        self.requested = requested
        self.stream = stream
        self.state = ALLOCATED
        self.stream_uses: set[int] | None = None
        self.event_count = 0
        self.frames: list[dict[str, Any]] | None = None

    def __repr__(self) -> str:
        state = ("free", "allocated", "pending", "freed")[self.state]
        return f"<Block {self.ptr:#x} {self.size} bytes {state}>"


class PrivatePool:
    """A pool of its own for graph capture, identified by ``(a, b)`` as in PyTorch."""

    __slots__ = ("id", "key", "use_count")

    def __init__(self, pool_id: PoolId, key: int) -> None:
        self.id = pool_id
        self.key = key  # the native core's number for it (0 is the default pool)
        self.use_count = 1
