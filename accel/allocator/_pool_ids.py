"""Memory pool ids: one type, one counter, one validator for graphs and allocators.

Ids follow PyTorch's scheme: ``(N, 0)`` is a pool a graph made for itself,
``(0, N)`` a shareable handle from :func:`graph_pool_handle`; ``(0, 0)`` is
the default pool, never a private one. Both kinds draw N from one counter,
so no two pools a process makes ever share an id.

>>> from accel.allocator import graph_pool_handle
>>> from accel.allocator._pool_ids import check_pool_id
>>> handle = graph_pool_handle()
>>> check_pool_id(handle, where="example") == handle
True
"""

from __future__ import annotations

import itertools
import threading

from accel._errors import InvalidValueError

__all__ = ["PoolId", "check_pool_id", "graph_pool_handle", "new_private_pool_id"]

PoolId = tuple[int, int]

_counter = itertools.count(1)
_counter_lock = threading.Lock()  # itertools.count is not documented as thread-safe


# Ids of live accel.memory.MemPool objects: their memory comes from the pool's
# own allocators, so a graph cannot be given one as its pool id.
_mem_pools: set[PoolId] = set()


def register_mem_pool(pool: PoolId) -> None:
    _mem_pools.add(pool)


def unregister_mem_pool(pool: PoolId) -> None:
    _mem_pools.discard(pool)


def _next() -> int:
    with _counter_lock:
        return next(_counter)


def new_private_pool_id() -> PoolId:
    """A fresh ``(N, 0)`` id for a graph that brings no pool of its own."""
    return (_next(), 0)


def graph_pool_handle() -> PoolId:
    """A new ``(0, N)`` pool id to share between graphs: pass it as ``pool=`` to each.

    >>> import accel
    >>> a = accel.graph_pool_handle()
    >>> a[0] == 0 and a[1] > 0
    True
    """
    return (0, _next())


def check_pool_id(pool: object, *, where: str) -> PoolId:
    """``pool`` as a private pool id; anything else is refused with the reason.

    ``where`` names the call in the message (``"accel.Graph"``...).
    """
    if not (
        isinstance(pool, tuple)
        and len(pool) == 2
        and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in pool)
    ):
        raise InvalidValueError(
            f"{where}: pool={pool!r} must be a handle from accel.graph_pool_handle() or another "
            "graph's pool() (a tuple of two non-negative ints)"
        )
    if pool == (0, 0):
        raise InvalidValueError(
            f"{where}: pool=(0, 0) is the default pool, which graphs cannot capture into; "
            "pass None for a private pool, or a handle from accel.graph_pool_handle()"
        )
    if pool in _mem_pools:
        raise InvalidValueError(
            f"{where}: pool={pool!r} is the id of an accel.memory.MemPool, whose memory comes from "
            "its own allocators; to capture into it, capture inside `with accel.memory.use_mem_pool(pool):` "
            "and give the graph no pool (or a handle from accel.graph_pool_handle())"
        )
    if pool[0] and pool[1]:
        raise InvalidValueError(
            f"{where}: pool={pool!r} is not a pool id (one of its two numbers must be 0): (N, 0) "
            "is a graph's own pool, (0, N) a handle from accel.graph_pool_handle()"
        )
    return pool
