"""The thread that runs a stream's (or a graph's) host functions in order.

Level Zero has no host functions: the stream signals event A and waits on
event B; this thread waits for A, runs the function and signals B. An
exception from the function (or from waiting for A) goes where the item says:
its stream's host errors, raised by that stream's next synchronize, as the
host backend reports its streams' failures.
"""

from __future__ import annotations

import collections
import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

from accel._errors import function_name
from accel.backends.xpu._bindings import WAIT_FOREVER

if TYPE_CHECKING:
    from accel.backends.xpu._backend import XpuBackend
    from accel.backends.xpu._event_pool import EventSlot

__all__ = ["HostWorker", "Item"]

#: (event A, event B, the function, whether the worker drops the two events after,
#: where an exception is reported as (name, exception): None prints it, for a
#: backend used without a runtime).
Item = tuple["EventSlot", "EventSlot", Callable[[], None], bool, "collections.deque[tuple[str, BaseException]] | None"]


class HostWorker:
    """Runs a stream's host functions in order on one thread."""

    def __init__(self, backend: XpuBackend, name: str) -> None:
        self._backend = backend
        self._items: deque[Item | None] = deque()
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: Item | None) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()

    def _run(self) -> None:
        ze, slots = self._backend._ze, self._backend._slots
        lib = ze.lib
        while True:
            with self._cond:
                while not self._items:
                    self._cond.wait()
                item = self._items.popleft()
            if item is None:
                return
            reached, release, fn, owned, errors = item
            try:
                ze.check("zeEventHostSynchronize", lib.zeEventHostSynchronize(reached.cdata, WAIT_FOREVER))
                ze.check("zeEventHostReset", lib.zeEventHostReset(reached.cdata))
                fn()
            except BaseException as exc:  # noqa: BLE001 - nothing may wedge the stream: report and carry on
                if errors is not None:
                    errors.append((function_name(fn), exc))
                else:
                    print("accel xpu: a host function or its Level Zero events failed:", file=sys.stderr)
                    traceback.print_exc()
            finally:
                lib.zeEventHostSignal(release.cdata)
                if owned:
                    slots.drop(reached)
                    slots.drop(release)
