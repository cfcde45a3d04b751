"""Graph memory pools: where the allocations made during a capture go.

A capture routes the allocations of its streams into a private pool of the
caching allocator, so that the addresses a graph reads and writes stay
reserved for it, and replays allocate nothing. Pool ids follow PyTorch:
``(N, 0)`` is a pool a graph made for itself, ``(0, N)`` a shareable handle
from :func:`graph_pool_handle`; ``(0, 0)`` is the default pool and never a
graph's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accel.allocator import PoolId, allocate, graph_pool_handle
from accel.allocator._mempool import current_allocator
from accel.allocator._pool_ids import check_pool_id as _check_allocator_pool_id
from accel.allocator._pool_ids import new_private_pool_id
from accel.allocator._registry import registry

if TYPE_CHECKING:
    from accel.stream import Stream

__all__ = ["PoolId", "PoolLease", "check_pool_id", "graph_pool_handle", "new_private_pool_id"]


def check_pool_id(pool: object, *, where: str) -> PoolId | None:
    """``pool`` as a pool id, or None (a graph's own private pool); a malformed id is refused."""
    return None if pool is None else _check_allocator_pool_id(pool, where=where)


class PoolLease:
    """One capture's use of a pool: routing while capturing, a use count after.

    While routing, allocations made on streams that ``stream_filter`` accepts
    come from the pool. :meth:`release` gives the graph's use of the pool
    back; its memory returns to the device once no graph uses it.
    """

    def __init__(self, device: int, pool_id: PoolId, stream_filter: Callable[[Stream], bool]) -> None:
        self.device = device
        self.pool_id = pool_id
        # A capture inside use_mem_pool(pool) takes its memory from that pool.
        self._allocator: Any = current_allocator(device)
        self._allocator.begin_allocate_to_pool(pool_id, stream_filter)
        # The pinned staging cache: no event queries during the capture, and the
        # blocks captured work uses stay this graph's.
        self._host: Any = registry().host_allocator()
        self._host.begin_capture(device, pool_id)
        self._routing = True
        self._released = False

    def allocate(self, nbytes: int, stream: Stream) -> Any:
        """An allocator Buffer of ``nbytes`` from the pool (routing must be on)."""
        return allocate(nbytes, device=self.device, stream=stream)

    def stop_routing(self) -> None:
        """End routing new allocations into the pool (idempotent)."""
        if self._routing:
            self._routing = False
            self._host.end_capture(self.device)
            self._allocator.end_allocate_to_pool(self.pool_id)

    def release(self, *, from_finalizer: bool = False) -> None:
        """Stop routing and give this capture's use of the pool back (idempotent).

        ``from_finalizer``: called by a garbage collection (a graph's
        ``__del__``), which may run inside the allocator's locked sections, so
        the release may wait for the allocator's next call instead.
        """
        self.stop_routing()
        if not self._released:
            self._released = True
            self._host.release_pool(self.pool_id, from_finalizer=from_finalizer)
            if from_finalizer:
                self._allocator.release_pool_from_finalizer(self.pool_id)
            else:
                self._allocator.release_pool(self.pool_id)
