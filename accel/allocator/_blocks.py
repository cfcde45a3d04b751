"""The allocator's data model: what callers hold, and the books of expandable segments.

Plain segments (one upstream ``allocate`` each) are kept by the native core
(csrc/accel_core.c): a caller holds a :class:`CoreBlock`, a handle of one of its
blocks. Expandable segments (one address reservation each, mapped page by page) are
kept here: a :class:`Segment` cut into a doubly linked chain of :class:`Block`
objects that tile it exactly; a *pool* keeps, per stream, a :class:`FreeList` of its
free blocks ordered by ``(size, ptr)``, so best fit costs O(log n).
"""

from __future__ import annotations

from typing import Any

from accel._native import speedups
from accel.allocator._freelist import FreeList
from accel.allocator._pool_ids import PoolId

__all__ = ["ALLOCATED", "FREE", "PENDING", "RETIRED", "Block", "CoreBlock", "CoreSteps", "Pool", "PrivatePool", "Segment"]

#: Block states. PENDING: freed by the caller but waiting for other streams'
#: events (or for a capture to end) before it may be reused. RETIRED: a block
#: object that was handed to a caller and freed; it is never part of a segment
#: again, so a stale second ``free`` of it is refused instead of freeing the
#: memory's next owner.
FREE, ALLOCATED, PENDING, RETIRED = 0, 1, 2, 3


class Segment:
    """One upstream allocation or expandable reservation."""

    __slots__ = (
        "owner", "base", "size", "stream", "pool", "expandable", "page", "pages", "head",
        "frames", "grown_at", "last_growth",
    )

    def __init__(self, owner: object, base: int, size: int, stream: int, pool: Pool, expandable: bool) -> None:
        self.owner = owner  # the DeviceAllocator, to refuse blocks of another allocator
        self.base = base
        self.size = size  # bytes allocated, or bytes reserved for an expandable segment
        self.stream = stream
        self.pool = pool
        self.expandable = expandable
        self.page = 0  # expandable: bytes per physical chunk
        self.pages: dict[int, int] = {}  # expandable: page index -> physical handle
        self.grown_at = 0  # expandable: the owner's growth count when this segment last grew
        self.last_growth = 0  # expandable: bytes mapped by that growth
        self.head: Block | None = None
        self.frames: list[dict[str, Any]] = []

    def blocks(self) -> list[Block]:
        out = []
        b = self.head
        while b is not None:
            out.append(b)
            b = b.next
        return out


class Block:
    """A range of a segment: allocated, pending, free, or (expandable) unmapped."""

    __slots__ = (
        "ptr", "size", "requested", "stream", "pool", "segment", "state", "mapped", "prev",
        "next", "event_count", "stream_uses", "frames",
    )

    def __init__(self, ptr: int, size: int, segment: Segment, mapped: bool = True) -> None:
        self.ptr = ptr
        self.size = size
        self.requested = 0
        self.segment = segment
        self.stream = segment.stream
        self.pool = segment.pool
        self.state = FREE
        self.mapped = mapped
        self.prev: Block | None = None
        self.next: Block | None = None
        self.event_count = 0
        self.stream_uses: set[int] | None = None
        self.frames: list[dict[str, Any]] | None = None

    def __repr__(self) -> str:
        state = ("free", "allocated", "pending", "freed")[self.state] if self.mapped else "unmapped"
        return f"<Block {self.ptr:#x} {self.size} bytes {state}>"

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    @property
    def owner(self) -> object:
        return self.segment.owner


# A caller's handle of a block the native core handed out: ALLOCATED, PENDING (freed,
# held in the core until other streams' events pass) or RETIRED (freed: a stale second
# ``free`` of it is refused instead of freeing the memory's next owner). Its ``segment``
# is None: the core keeps its books. Made only by a DeviceAllocator's CoreSteps (in C,
# accel/_speedups.c), which changes the core's books and the handles together, so that an
# interrupt (a Python signal handler) never lands between them.
CoreBlock = speedups.CoreBlock
CoreSteps = speedups.CoreSteps


class Pool:
    """Free blocks of one kind (small or large) of one pool, per stream."""

    __slots__ = ("small", "kind", "private", "free", "expandable")

    def __init__(self, small: bool, private: PrivatePool | None) -> None:
        self.small = small
        self.kind = 0 if small else 1  # index into the stats arrays
        self.private = private
        # stream handle -> its free blocks; (size, ptr) is unique among them
        self.free: dict[int, FreeList] = {}
        self.expandable: dict[int, Segment] = {}  # stream handle -> its expandable segment


class PrivatePool:
    """A pool of its own for graph capture, identified by ``(a, b)`` as in PyTorch."""

    __slots__ = ("id", "key", "small", "large", "use_count", "segments")

    def __init__(self, pool_id: PoolId, key: int) -> None:
        self.id = pool_id
        self.key = key  # the native core's number for it (0 is the default pool)
        self.small = Pool(True, self)
        self.large = Pool(False, self)
        self.use_count = 1
        self.segments = 0  # live expandable reservations (the core counts plain segments)
