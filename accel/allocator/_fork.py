"""The allocator's locks across ``fork()``.

A forked child has only the thread that forked. A lock another parent thread
held at that moment stays held in the child forever, so an explicit ``free()``
there (the child may release the parent's buffers it inherited) would hang.
Before a fork every tracked lock is taken (waiting at most
``FORK_LOCK_WAIT_S`` for each), so that the child inherits consistent state
and unlocked locks; the parent releases them after the fork. A lock that
could not be taken in time gets a fresh lock in the child.

A caching allocator's lock is an :class:`OwnedLock`: it notes the thread that holds
it, so that a call on that same thread (a garbage-collection callback or finalizer
run while it held the lock) is refused instead of waiting for itself forever.
"""

from __future__ import annotations

import os
import threading
import weakref
from threading import get_ident

from accel._native import speedups

__all__ = ["FORK_LOCK_WAIT_S", "OwnedLock", "acting_for", "caller_ident", "track_lock"]

# How long a fork waits for another thread to leave the allocator (it normally holds
# a lock for microseconds; a bound keeps a fork from hanging on a pathological holder).
FORK_LOCK_WAIT_S = 1.0

# A caching allocator's lock: it notes the thread that holds it (``owner``, 0 when free),
# and a blocking acquire on that thread raises NotSupportedError naming ``what``: only a
# garbage-collection callback or a finalizer can get there (run by a collection while its
# thread held the lock), and it would wait forever. Frees from there are deferred instead
# (see DeviceAllocator.free_from_finalizer). It is C (accel/_speedups.c): Python code
# between taking the lock and noting its owner, or between clearing the owner and letting
# go, is where Ctrl-C's KeyboardInterrupt lands, and it left the lock held for good.
OwnedLock = speedups.OwnedLock

_tracked: list[tuple[weakref.ref[object], str]] = []
_tracked_lock = threading.Lock()
_held: list[tuple[object, str, threading.Lock | OwnedLock]] = []


# Per thread: the thread whose call it runs (accel's upstream thread runs the main
# thread's upstream calls while that waits: see accel/allocator/_native_core.py).
_acting = threading.local()


def caller_ident() -> int:
    """The ident of the thread this one acts for (see :func:`acting_for`), else its own:
    a garbage-collection callback or finalizer run there runs inside that thread's call.

    >>> caller_ident() == get_ident()
    True
    """
    ident: int = getattr(_acting, "ident", 0)
    return ident or get_ident()


def acting_for(ident: int) -> None:
    """This thread now runs a call of thread ``ident`` (0: its own calls again)."""
    _acting.ident = ident


def track_lock(owner: object, attr: str = "_lock") -> None:
    """Take ``owner.<attr>`` (a ``threading.Lock`` or :class:`OwnedLock`) around every
    fork while ``owner`` lives."""
    with _tracked_lock:
        _tracked[:] = [(ref, name) for ref, name in _tracked if ref() is not None]
        _tracked.append((weakref.ref(owner), attr))


def _before_fork() -> None:
    _tracked_lock.acquire()
    for ref, attr in _tracked:
        owner = ref()
        if owner is None:
            continue
        lock = getattr(owner, attr)
        if lock.acquire(timeout=FORK_LOCK_WAIT_S):
            _held.append((owner, attr, lock))


def _after_fork_in_parent() -> None:
    while _held:
        _, _, lock = _held.pop()
        lock.release()
    _tracked_lock.release()


def _after_fork_in_child() -> None:
    taken = {(id(owner), attr) for owner, attr, _ in _held}
    _after_fork_in_parent()
    for ref, attr in _tracked:
        owner = ref()
        if owner is not None and (id(owner), attr) not in taken:
            # held by a thread that does not exist here
            held = getattr(owner, attr)
            setattr(owner, attr, OwnedLock(held.what) if isinstance(held, OwnedLock) else threading.Lock())


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
