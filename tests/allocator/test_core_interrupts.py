"""An interrupt (Ctrl-C) at any backend call the native core's plain segments make
(a segment asked for, the device waited for before one goes back, one given back)
leaves the books whole and loses no memory but a release that was itself
interrupted; the interrupt reaches the caller."""

from __future__ import annotations

import sys

import pytest

from accel._runtime import Runtime
from accel.allocator._caching import DeviceAllocator
from accel.allocator._history import History
from accel.allocator.config import parse
from accel.backends.cpu import CpuBackend
from accel.stream._stream import Stream
from tests.allocator.interrupts import Held, interrupt_each_backend_call
from tests.allocator.test_caching import check_invariants

MiB = 1 << 20


def _scenario(a: DeviceAllocator, streams: list[Stream], held: Held) -> None:
    s0, s1 = streams
    malloc, free = held.malloc, held.free
    x, y, z = malloc(8 * MiB, s0), malloc(30 * MiB, s0), malloc(3000, s0)
    a.record_stream(y, s1)
    free(y)
    free(z)
    free(x)
    a.empty_cache()
    u = malloc(12 * MiB, s0)
    w = malloc(40 * MiB, s1)
    free(u)
    free(w)
    a.empty_cache()


@pytest.mark.parametrize("config", ["", "max_split_size_mb:20"])
def test_an_interrupt_at_any_backend_call_leaves_the_core_books_whole(config: str) -> None:
    # a give-back interrupted as it frees may lose that segment
    interrupt_each_backend_call(config, _scenario, streams=2, losable={"free": sys.maxsize}, min_calls=10)


class _InterruptedHistory(History):
    """A history whose report of a segment (taken or given back) is interrupted."""

    def record(self, action, addr, size, stream, frames):
        if action.startswith("segment_"):
            raise KeyboardInterrupt(action)
        super().record(action, addr, size, stream, frames)


def test_an_interrupted_report_of_a_segment_loses_no_memory(capfd: pytest.CaptureFixture[str]) -> None:
    backend = CpuBackend(1, None)
    stream = Runtime(backend).default_stream(0)
    a = DeviceAllocator(backend, 0, parse(""))
    a.record_history(_InterruptedHistory("all", None, "python", 100))
    # the segment came from upstream: the allocation gets it, the interrupt comes later
    b = a.malloc(1000, stream)
    assert a.stats()["reserved_bytes.all.current"] == backend._memory[0]._held == 2 * MiB
    a.free(b)
    with pytest.raises(KeyboardInterrupt, match="segment_alloc"):
        a.empty_cache()
    a.record_history(None)
    a.empty_cache()
    check_invariants(a)
    assert a.stats()["reserved_bytes.all.current"] == backend._memory[0]._held == 0
    assert "cffi callback" not in capfd.readouterr().err


def test_an_interrupt_on_the_way_into_the_report_loses_no_memory() -> None:
    """The interrupt lands as the report of a new segment is called (before any line of
    it runs, as a signal's handler may): the segment is booked all the same."""
    backend = CpuBackend(1, None)
    stream = Runtime(backend).default_stream(0)
    a = DeviceAllocator(backend, 0, parse(""))

    def trace(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "_report":
            sys.settrace(None)
            raise KeyboardInterrupt("on the way in")

    sys.settrace(trace)
    try:
        b = a.malloc(1000, stream)
    finally:
        sys.settrace(None)
    assert a.stats()["reserved_bytes.all.current"] == backend._memory[0]._held == 2 * MiB
    a.free(b)
    with pytest.raises(KeyboardInterrupt, match="on the way in"):
        a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == backend._memory[0]._held == 0


# An interrupt at the entry of the core's upstream callback is swallowed there by cffi (an
# unraisable exception): another window, not this test's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_an_interrupt_anywhere_in_the_locked_pair_leaves_the_lock_free() -> None:
    """Ctrl-C's KeyboardInterrupt lands, in turn, wherever a signal's handler may run in the
    locked malloc, free and finalizer's free (history on: not the lock-free pair): as a
    Python function starts and as a C function returns. The lock is free after each: an
    interrupt between taking the lock and the guard that gives it back (``acquire()`` then
    ``try``, or inside a Python lock's acquire or release) left it held for good, so that
    every later call on the thread raised NotSupportedError, or every call waited forever."""
    backend = CpuBackend(1, None)
    stream = Runtime(backend).default_stream(0)
    a = DeviceAllocator(backend, 0, parse(""))
    a.record_history(History("all", None, "python", 100))
    left_held = []
    at = 1
    while True:
        events = 0

        def profile(frame, event, arg):
            nonlocal events
            if event in ("call", "c_return"):
                events += 1
                if events == at:
                    raise KeyboardInterrupt(f"{event} {getattr(arg, '__qualname__', frame.f_code.co_name)}")

        held = []
        sys.setprofile(profile)
        try:
            held.append(a.malloc(1000, stream))
            a.free(held.pop())
            held.append(a.malloc(1000, stream))
            a.free_from_finalizer(held.pop())  # a finalizer's free: no waiting for the lock
            interrupted = None
        except KeyboardInterrupt as exc:
            interrupted = str(exc)
        finally:
            sys.setprofile(None)
        if events < at:  # the calls ran to the end
            break
        if a._lock.acquire(blocking=False):
            a._lock.release()
        else:
            left_held.append(interrupted)
            a._lock = type(a._lock)(a._lock.what)  # a fresh lock, to go on
        for block in held:
            a.free(block)
        at += 1
    a.record_history(None)
    assert at > 20  # the interrupts reached the locked paths
    assert left_held == [], left_held
