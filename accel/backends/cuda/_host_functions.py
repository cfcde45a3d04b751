"""The registry of Python callables queued as CUDA host functions, and who owns them."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable

__all__ = ["HostFunctions"]


class HostFunctions:
    """Python callables waiting to be run by the driver, by integer key.

    A one-shot entry (plain stream work) is dropped when it runs. A shared
    entry (captured into a graph) is reference-counted by its owners: the
    capture, the graph, each executable graph and guarded replays.

    An entry queued as plain work and then shared (:meth:`share`: a capture
    that may have recorded it began around the launch) may still run eagerly
    once. Until some run of it is seen, letting go of the last owner turns it
    back into a one-shot entry instead of dropping it.
    """

    def __init__(self) -> None:
        # Reentrant: a finalizer run by a collection inside these methods may
        # release a graph's callables (accel.Graph.__del__).
        self._lock = threading.RLock()
        self._fns: dict[int, Callable[[], None]] = {}
        self._refs: dict[int, int] = {}
        self._unrun: set[int] = set()  # shared by share() and not run since
        self._keys = itertools.count(1)

    def add(self, fn: Callable[[], None], *, shared: bool) -> int:
        key = next(self._keys)
        with self._lock:
            self._fns[key] = fn
            if shared:
                self._refs[key] = 1
        return key

    def take(self, key: int) -> tuple[Callable[[], None] | None, bool]:
        """The callable for ``key``, and whether running it drops it (a one-shot entry)."""
        with self._lock:
            if key in self._refs:
                self._unrun.discard(key)
                return self._fns.get(key), False
            return self._fns.pop(key, None), True

    def share(self, key: int) -> bool:
        """Turn a one-shot entry that has not run yet into a shared one (owned once); False if it ran."""
        with self._lock:
            if key not in self._fns or key in self._refs:
                return False
            self._refs[key] = 1
            self._unrun.add(key)
            return True

    def discard(self, key: int) -> None:
        with self._lock:
            dropped = self._fns.pop(key, None)
            self._refs.pop(key, None)
            self._unrun.discard(key)
        del dropped  # outside the lock: a finalizer of what it holds may call back into the backend

    def retain(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                self._refs[key] += 1

    def release(self, keys: list[int]) -> None:
        dropped = []
        with self._lock:
            for key in keys:
                self._refs[key] -= 1
                if self._refs[key] == 0:
                    del self._refs[key]
                    if key in self._unrun:
                        # Its eager run may still be queued: one-shot again.
                        # (A function the capture did record, in a graph
                        # never replayed, is kept for good: the cost.)
                        self._unrun.discard(key)
                    else:
                        dropped.append(self._fns.pop(key, None))
        del dropped  # outside the lock: a finalizer of what they hold may call back into the backend

    def __len__(self) -> int:
        with self._lock:
            return len(self._fns)
