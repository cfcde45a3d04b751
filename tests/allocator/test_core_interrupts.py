"""An interrupt (Ctrl-C) at any backend call the native core's plain segments make
(a segment asked for, the device waited for before one goes back, one given back)
leaves the books whole and loses no memory but a release that was itself
interrupted; the interrupt reaches the caller."""

from __future__ import annotations

import sys

import pytest

from accel._runtime import Runtime
from accel.allocator._blocks import ALLOCATED
from accel.allocator._caching import DeviceAllocator
from accel.allocator._history import History
from accel.allocator.config import parse
from accel.backends.cpu import CpuBackend
from accel.stream._stream import Stream
from tests.allocator.interrupts import Held, interrupt_each_backend_call
from tests.allocator.test_caching import check_invariants
from tests.fixtures.scripts import ok, run

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


# Where a signal's handler may raise in an upstream callback: as one begins (before any
# line of it runs), and just after a driver call returned (its result not yet kept).
_CALLBACK_ENTRIES = [
    ("call", name, config)
    for name, config in [
        ("accel_py_upstream_alloc", ""),
        ("accel_py_upstream_free", ""),
        ("accel_py_vm_reserve", "expandable_segments:True"),
        ("accel_py_vm_unreserve", "expandable_segments:True"),
        ("accel_py_vm_map", "expandable_segments:True"),
        ("accel_py_vm_unmap", "expandable_segments:True"),
    ]
]
_DRIVER_RETURNS = [
    ("return", name, config)
    for name, config in [
        ("allocate", ""),
        ("deallocate", ""),
        ("vm_reserve", "expandable_segments:True"),
        ("vm_free", "expandable_segments:True"),
        ("vm_create", "expandable_segments:True"),
        ("vm_map", "expandable_segments:True"),
        ("vm_unmap", "expandable_segments:True"),
        ("vm_release", "expandable_segments:True"),
    ]
]


@pytest.mark.parametrize(("event", "name", "config"), _CALLBACK_ENTRIES + _DRIVER_RETURNS)
def test_an_interrupt_anywhere_in_an_upstream_callback_loses_nothing(
    event: str, name: str, config: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """A KeyboardInterrupt raised on the main thread as an upstream callback begins, or
    as the resource's driver call returns (as a signal's handler may), loses no memory
    at the driver and no interrupt: each call ends once, and the interrupt is raised."""
    backend = CpuBackend(1, None)
    runtime = Runtime(backend)
    streams = [runtime.default_stream(0), Stream._wrap(runtime, 0, backend.stream_create(0, 0), owned=True)]
    a = DeviceAllocator(backend, 0, parse(config))
    fired: list[str] = []

    def trace(frame, ev, arg):
        code = frame.f_code
        if code.co_name == name and (event == "call" or code.co_filename.endswith("_resources.py")):
            if event == "call":
                sys.settrace(None)
                fired.append(name)
                raise KeyboardInterrupt(name)
            return on_return
        return None

    def on_return(frame, ev, arg):
        if ev == "return" and not fired:
            sys.settrace(None)
            fired.append(name)
            raise KeyboardInterrupt(name)
        return on_return

    held = Held(a)
    raised: list[BaseException] = []
    sys.settrace(trace)
    try:
        _scenario(a, streams, held)
    except KeyboardInterrupt as exc:
        raised.append(exc)
    finally:
        sys.settrace(None)
    if event == "call":
        assert fired, f"{name} was never called"
    for b in held.blocks:
        if b.state == ALLOCATED:
            a.free(b)
    for s in streams:
        s.synchronize()
    try:
        a.empty_cache()
    except KeyboardInterrupt as exc:  # an interrupt a callback kept is raised here
        raised.append(exc)
    a.empty_cache()
    check_invariants(a)
    if fired:
        assert [str(exc) for exc in raised] == [name], f"the interrupt was swallowed or raised twice: {raised}"
    assert a.stats()["reserved_bytes.all.current"] == 0
    assert backend._memory[0]._held == 0, f"{backend._memory[0]._held} bytes lost at the driver"
    assert "cffi callback" not in capfd.readouterr().err
    streams[1].close()


SIGINT_STORM = r"""
import os, random, signal, sys, threading, time
import accel

MiB = 1 << 20
a = accel.memory.get_allocator()
assert a._expandable == (sys.argv[1] == "expandable_segments:True"), a.config
free_before = a.upstream.memory_info()[0]
stop = threading.Event()

def interrupt(signum, frame):
    # anywhere but in this script's own lines (its loop's jump is outside any try)
    if frame is not None and frame.f_code.co_filename != "<string>":
        raise KeyboardInterrupt

def storm():
    while not stop.wait(random.random() * 0.001):
        os.kill(os.getpid(), signal.SIGINT)

signal.signal(signal.SIGINT, interrupt)
threading.Thread(target=storm, daemon=True).start()
rng, live, interrupts = random.Random(1), [], 0
end = time.monotonic() + 2
while time.monotonic() < end:
    try:
        c = rng.random()
        if live and (c < 0.4 or len(live) > 12):
            live.pop(rng.randrange(len(live))).free()
        elif c < 0.55:
            a.empty_cache()
        else:
            live.append(accel.memory.allocate(rng.choice([100, 3000, 2 * MiB, 12 * MiB, 30 * MiB])))
    except KeyboardInterrupt:
        interrupts += 1
stop.set()
signal.signal(signal.SIGINT, signal.SIG_IGN)
for b in live:
    b.free()
accel.current_stream().synchronize()
for _ in range(2):
    try:
        a.empty_cache()
    except KeyboardInterrupt:
        pass  # one a callback kept
assert interrupts > 100, interrupts
stats = accel.memory.memory_stats()
assert stats["reserved_bytes.all.current"] == stats["allocated_bytes.all.current"] == 0, stats
lost = free_before - a.upstream.memory_info()[0]
assert lost == 0, f"{lost} bytes lost at the driver after {interrupts} interrupts"
print("ok")
"""


@pytest.mark.parametrize("config", ["", "expandable_segments:True"])
@pytest.mark.parametrize("name", ["cpu", "cuda"])
def test_a_sigint_storm_loses_no_memory(name: str, config: str) -> None:
    """Real SIGINTs, about one a millisecond, while the main thread allocates, frees
    and empties the cache: no callback of the upstream loses memory at the driver,
    nor leaves an expandable segment's pages mapped where the books say unmapped.
    (cffi may print an interrupt that lands as its onerror handler begins: only the
    report of that interrupt is lost.)"""
    env = {"ACCEL_ALLOC_CONF": config, "ACCEL_CPU_MEMORY_LIMIT": "1GiB"}
    ok(run(name, SIGINT_STORM, config, timeout=120, env=env))


GC_CALLBACK_FREES = r"""
import gc, threading
import accel
from accel.allocator._history import History

a = accel.memory.get_allocator()
stream = accel.current_stream()
keep = [a.malloc(1000, stream) for _ in range(4)]
a.record_history(History("all", None, "python", 100))  # malloc takes the allocator's lock
threads = set()

def collected(phase, info):
    # on accel's upstream thread, running the main thread's upstream call while the
    # main thread holds the lock
    if phase == "start" and keep and threading.current_thread() is not threading.main_thread():
        threads.add(threading.current_thread().name)
        a.free(keep.pop())  # deferred: this runs inside the lock holder's call

gc.callbacks.append(collected)
gc.set_threshold(1)
try:
    big = [a.malloc(30 << 20, stream) for _ in range(3)]  # new segments: upstream calls
finally:
    gc.set_threshold(700)
    gc.callbacks.remove(collected)
for b in big:
    a.free(b)
a.record_history(None)
a.empty_cache()
assert threads == {"accel-upstream"}, threads
assert a.stats()["allocated_bytes.all.current"] == len(keep) * 1024, a.stats()  # the rest still held
print("ok")
"""


def test_a_gc_callback_that_frees_during_an_upstream_call_does_not_hang() -> None:
    """A collection on accel's upstream thread (it runs the main thread's upstream
    calls, with the allocator's lock held by the main thread) whose gc callback frees a
    block: the free is deferred, as on the lock holder's own thread, not a wait for a
    lock the waiting main thread holds."""
    ok(run("cpu", GC_CALLBACK_FREES, timeout=60))
