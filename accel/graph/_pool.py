"""Graph memory pools: where the allocations made during a capture go.

A capture routes the allocations of its streams into a private pool of the
caching allocator, so that the addresses a graph reads and writes stay
reserved for it, and replays allocate nothing. Pool ids follow PyTorch:
``(N, 0)`` is a pool a graph made for itself, ``(0, N)`` a shareable handle
from :func:`graph_pool_handle`; ``(0, 0)`` is the default pool and never a
graph's.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accel._errors import InvalidValueError

if TYPE_CHECKING:
    from accel.stream._stream import Stream

__all__ = ["PoolId", "PoolLease", "check_pool_id", "graph_pool_handle", "new_graph_pool_id"]

PoolId = tuple[int, int]

_graph_ids = itertools.count(1)
_graph_ids_lock = threading.Lock()


def new_graph_pool_id() -> PoolId:
    """A fresh ``(N, 0)`` id for a graph that brings no pool of its own."""
    with _graph_ids_lock:
        return (next(_graph_ids), 0)


def graph_pool_handle() -> PoolId:
    """A new pool id to share between graphs: pass it as ``pool=`` to each.

    >>> import accel
    >>> a = accel.graph.graph_pool_handle()
    >>> a[0] == 0 and a[1] > 0
    True
    """
    from accel.memory import graph_pool_handle as allocator_handle

    return tuple(allocator_handle())  # type: ignore[return-value]


def check_pool_id(pool: object, *, where: str) -> PoolId | None:
    """``pool`` as a pool id, or None; a malformed id is refused with the reason."""
    if pool is None:
        return None
    if (
        isinstance(pool, tuple)
        and len(pool) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pool)
    ):
        if pool == (0, 0):
            raise InvalidValueError(
                f"{where}: pool=(0, 0) is the default pool, which graphs cannot capture into; "
                "pass None for a private pool, or a handle from accel.graph_pool_handle()"
            )
        if pool[0] and pool[1]:
            raise InvalidValueError(
                f"{where}: pool={pool!r} is not a pool id (one of its two numbers must be 0); "
                "use accel.graph_pool_handle() or another graph's pool()"
            )
        return pool  # type: ignore[return-value]
    raise InvalidValueError(
        f"{where}: pool={pool!r} must be None, a handle from accel.graph_pool_handle(), or "
        "another graph's pool() (a tuple of two non-negative ints)"
    )


class PoolLease:
    """One capture's use of a pool: routing while capturing, a use count after.

    While routing, allocations made on streams that ``stream_filter`` accepts
    come from the pool. :meth:`release` gives the graph's use of the pool
    back; its memory returns to the device once no graph uses it.
    """

    def __init__(self, device: int, pool_id: PoolId, stream_filter: Callable[[Stream], bool]) -> None:
        from accel.memory import get_allocator

        self.device = device
        self.pool_id = pool_id
        self._allocator: Any = get_allocator(device)
        self._allocator.begin_allocate_to_pool(pool_id, stream_filter)
        self._routing = True
        self._released = False

    def allocate(self, nbytes: int, stream: Stream) -> Any:
        """An allocator Buffer of ``nbytes`` from the pool (routing must be on)."""
        from accel.memory import allocate

        return allocate(nbytes, device=self.device, stream=stream)

    def stop_routing(self) -> None:
        """End routing new allocations into the pool (idempotent)."""
        if self._routing:
            self._routing = False
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
            if from_finalizer:
                self._allocator.release_pool_from_finalizer(self.pool_id)
            else:
                self._allocator.release_pool(self.pool_id)
