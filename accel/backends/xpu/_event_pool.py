"""Pooled Level Zero events: event pools with free lists, and holds on each event.

Level Zero events may be referenced by queued commands after their owner is
gone, so every pooled event is reference-counted ("holds") and goes back to
its pool only when no owner and no queued command refers to it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accel.backends.xpu._bindings import ZeLoader
    from accel.backends.xpu._records import EventState

__all__ = ["EVENTS_PER_POOL", "EventSlot", "EventSlots"]

EVENTS_PER_POOL = 64


class EventSlot:
    """One pooled Level Zero event and the number of owners still using it.

    An interprocess event has an IPC pool of its own (``ipc_pool``), and
    ``release`` destroys both once the last hold is dropped, instead of
    returning the slot to a free list."""

    __slots__ = ("cdata", "handle", "timing", "holds", "ipc_pool", "release")

    def __init__(self, cdata: object, handle: int, timing: bool) -> None:
        self.cdata = cdata
        self.handle = handle
        self.timing = timing
        self.holds = 0
        self.ipc_pool: object | None = None
        self.release: Callable[[], None] | None = None


class EventSlots:
    """Event pools with free lists: cheap event creation and reuse."""

    def __init__(self, ze: ZeLoader, context: object) -> None:
        self._ze = ze
        self._context = context
        # Reentrant, as the backend's: an accel Event collected while the lock
        # is held (this code allocates under it) returns its slot from its finalizer.
        self._lock = threading.RLock()
        self._free: dict[bool, list[EventSlot]] = {False: [], True: []}
        self._pools: list[object] = []

    def _grow(self, timing: bool) -> None:
        ffi, lib = self._ze.ffi, self._ze.lib
        flags = lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE
        if timing:
            flags |= lib.ZE_EVENT_POOL_FLAG_KERNEL_TIMESTAMP
        desc = ffi.new("ze_event_pool_desc_t *", {
            "stype": lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC, "flags": flags, "count": EVENTS_PER_POOL,
        })
        pool = ffi.new("ze_event_pool_handle_t *")
        self._ze.check("zeEventPoolCreate", lib.zeEventPoolCreate(self._context, desc, 0, ffi.NULL, pool))
        self._pools.append(pool[0])
        scope = lib.ZE_EVENT_SCOPE_FLAG_HOST
        for index in range(EVENTS_PER_POOL):
            edesc = ffi.new("ze_event_desc_t *", {
                "stype": lib.ZE_STRUCTURE_TYPE_EVENT_DESC, "index": index, "signal": scope, "wait": scope,
            })
            event = ffi.new("ze_event_handle_t *")
            self._ze.check("zeEventCreate", lib.zeEventCreate(pool[0], edesc, event))
            handle = int(ffi.cast("uintptr_t", event[0]))
            self._free[timing].append(EventSlot(event[0], handle, timing))

    def acquire(self, timing: bool) -> EventSlot:
        """A reset event with one hold, owned by the caller."""
        with self._lock:
            if not self._free[timing]:
                self._grow(timing)
            slot = self._free[timing].pop()
            slot.holds = 1
        self._ze.check("zeEventHostReset", self._ze.lib.zeEventHostReset(slot.cdata))
        return slot

    def hold(self, slot: EventSlot) -> None:
        with self._lock:
            slot.holds += 1

    def drop(self, slot: EventSlot | None) -> None:
        if slot is None:
            return
        with self._lock:
            self._drop_locked(slot)

    def _drop_locked(self, slot: EventSlot) -> None:
        slot.holds -= 1
        if slot.holds == 0:
            if slot.release is not None:
                slot.release()
            else:
                self._free[slot.timing].append(slot)

    # -- interprocess events: one event in an IPC pool of its own ---------------------

    def create_ipc(self) -> EventSlot:
        """A signalled event (waiting on it before its first record passes, as in CUDA)
        in a new IPC pool, with one hold for the caller."""
        ffi, lib = self._ze.ffi, self._ze.lib
        desc = ffi.new("ze_event_pool_desc_t *", {
            "stype": lib.ZE_STRUCTURE_TYPE_EVENT_POOL_DESC,
            "flags": lib.ZE_EVENT_POOL_FLAG_HOST_VISIBLE | lib.ZE_EVENT_POOL_FLAG_IPC, "count": 1,
        })
        pool = ffi.new("ze_event_pool_handle_t *")
        self._ze.check("zeEventPoolCreate", lib.zeEventPoolCreate(self._context, desc, 0, ffi.NULL, pool))
        slot = self._ipc_slot(pool[0], "zeEventPoolDestroy", lib.zeEventPoolDestroy)
        self._ze.check("zeEventHostSignal", lib.zeEventHostSignal(slot.cdata))
        return slot

    def open_ipc(self, handle: bytes) -> EventSlot:
        """The event of an IPC pool exported by another process (``handle``: its 64 bytes)."""
        ffi, lib = self._ze.ffi, self._ze.lib
        ipc = ffi.new("ze_ipc_event_pool_handle_t *")
        ffi.memmove(ipc.data, handle, len(ipc.data))
        pool = ffi.new("ze_event_pool_handle_t *")
        self._ze.check("zeEventPoolOpenIpcHandle", lib.zeEventPoolOpenIpcHandle(self._context, ipc[0], pool))
        return self._ipc_slot(pool[0], "zeEventPoolCloseIpcHandle", lib.zeEventPoolCloseIpcHandle)

    def _ipc_slot(self, pool: object, close_call: str, close: Callable[[object], int]) -> EventSlot:
        ffi, lib = self._ze.ffi, self._ze.lib
        scope = lib.ZE_EVENT_SCOPE_FLAG_HOST
        desc = ffi.new("ze_event_desc_t *", {
            "stype": lib.ZE_STRUCTURE_TYPE_EVENT_DESC, "index": 0, "signal": scope, "wait": scope,
        })
        event = ffi.new("ze_event_handle_t *")
        code = lib.zeEventCreate(pool, desc, event)
        if code != 0:
            close(pool)
            self._ze.check("zeEventCreate", code)
        slot = EventSlot(event[0], int(ffi.cast("uintptr_t", event[0])), False)
        slot.ipc_pool = pool
        slot.holds = 1

        def release() -> None:
            self._ze.check("zeEventDestroy", lib.zeEventDestroy(slot.cdata))
            self._ze.check(close_call, close(pool))

        slot.release = release
        return slot

    def hold_current(self, event: EventState) -> EventSlot | None:
        """The event's current slot with one more hold for the caller (who drops it), or None.

        Reading and holding happen under the pool lock, as the swap in ``set_current``
        does: otherwise a concurrent re-record could give the slot back to the pool, and
        another record take it, between the caller's read and its hold.
        """
        with self._lock:
            slot = event.slot
            if slot is not None:
                slot.holds += 1
            return slot

    def set_current(self, event: EventState, slot: EventSlot | None) -> None:
        """Make ``slot`` (and the caller's hold on it) the event's; drop the previous slot's hold."""
        with self._lock:
            old, event.slot = event.slot, slot
            if old is not None:
                self._drop_locked(old)
