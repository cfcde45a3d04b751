"""The allocator's locks across ``fork()``.

A forked child has only the thread that forked. A lock another parent thread
held at that moment stays held in the child forever, so an explicit ``free()``
there (the child may release the parent's buffers it inherited) would hang.
Before a fork every tracked lock is taken (waiting at most
``FORK_LOCK_WAIT_S`` for each), so that the child inherits consistent state
and unlocked locks; the parent releases them after the fork. A lock that
could not be taken in time gets a fresh lock in the child.
"""

from __future__ import annotations

import os
import threading
import weakref

__all__ = ["FORK_LOCK_WAIT_S", "track_lock"]

# How long a fork waits for another thread to leave the allocator (it normally holds
# a lock for microseconds; a bound keeps a fork from hanging on a pathological holder).
FORK_LOCK_WAIT_S = 1.0

_tracked: list[tuple[weakref.ref[object], str]] = []
_tracked_lock = threading.Lock()
_held: list[tuple[object, str, threading.Lock]] = []


def track_lock(owner: object, attr: str = "_lock") -> None:
    """Take ``owner.<attr>`` (a ``threading.Lock``) around every fork while ``owner`` lives."""
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
            setattr(owner, attr, threading.Lock())  # held by a thread that does not exist here


os.register_at_fork(
    before=_before_fork, after_in_parent=_after_fork_in_parent, after_in_child=_after_fork_in_child
)
