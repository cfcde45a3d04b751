"""What callers of the caching allocator hold: the books themselves (plain and
expandable segments, blocks, free lists) are kept by the native core
(csrc/accel_core.c); a caller holds a :class:`CoreBlock`, a handle of one of its blocks.
"""

from __future__ import annotations

from accel._native import speedups
from accel.allocator._pool_ids import PoolId

__all__ = ["ALLOCATED", "CoreBlock", "CoreSteps", "PENDING", "RETIRED", "PrivatePool"]

#: A handle's states. PENDING: freed by the caller but waiting for other streams'
#: events (or for a capture to end) before it may be reused. RETIRED: freed; a stale
#: second ``free`` of it is refused instead of freeing the memory's next owner.
ALLOCATED, PENDING, RETIRED = 1, 2, 3


# A caller's handle of a block the native core handed out: ALLOCATED, PENDING (freed,
# held in the core until other streams' events pass) or RETIRED (freed: a stale second
# ``free`` of it is refused instead of freeing the memory's next owner). Made only by a
# DeviceAllocator's CoreSteps (in C, accel/_speedups.c), which changes the core's books
# and the handles together, so that an interrupt (a Python signal handler) never lands
# between them.
CoreBlock = speedups.CoreBlock
CoreSteps = speedups.CoreSteps


class PrivatePool:
    """A pool of its own for graph capture, identified by ``(a, b)`` as in PyTorch."""

    __slots__ = ("id", "key", "use_count")

    def __init__(self, pool_id: PoolId, key: int) -> None:
        self.id = pool_id
        self.key = key  # the native core's number for it (0 is the default pool)
        self.use_count = 1
