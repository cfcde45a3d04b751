"""Hostile calls on the allocator's public methods (malloc, free, free_from_finalizer)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import accel
from accel._errors import InvalidHandleError, InvalidValueError, NotSupportedError
from accel._runtime import Runtime
from accel.allocator._caching import DeviceAllocator
from accel.allocator._history import History
from accel.allocator.config import parse
from accel.backends.cpu import CpuBackend


def test_free_from_finalizer_refuses_a_block_of_another_allocator() -> None:
    # It took the block and freed it into its own books (counts below zero, another
    # allocator's memory on its free list) where free() refuses it.
    backend = CpuBackend(1, None)
    stream = Runtime(backend).default_stream(0)
    mine = DeviceAllocator(backend, 0, parse("expandable_segments:False"))
    other = DeviceAllocator(backend, 0, parse("expandable_segments:False"))
    block = other.malloc(1000, stream)
    before = mine.stats()
    with pytest.raises(InvalidHandleError, match="not allocated by"):
        mine.free_from_finalizer(block)
    mine._lock.acquire()  # the deferred path, when the lock is taken, refuses it too
    try:
        with pytest.raises(InvalidHandleError, match="not allocated by"):
            mine.free_from_finalizer(block)
    finally:
        mine._lock.release()
    assert mine.stats() == before and not mine._gc_frees
    assert (
        block.state == other.malloc(1000, stream).state
    )  # still allocated, in its own books
    other.free(block)
    assert other.stats()["allocation.all.current"] == 1


def test_calls_from_inside_the_locked_path_are_refused_or_deferred() -> None:
    # What a gc callback or finalizer run while this thread holds the lock gets: they
    # waited for the lock forever. Refused with an accel error; a free deferred to the
    # next call that takes the lock (a free of a freed block still refused).
    backend = CpuBackend(1, None)
    stream = Runtime(backend).default_stream(0)
    a = DeviceAllocator(backend, 0, parse("expandable_segments:False"))
    a.record_history(History("all", "all", "python", 100))  # the locked path
    block, freed = a.malloc(1000, stream), a.malloc(1000, stream)
    a.free(freed)
    a._lock.acquire()
    try:
        for call in (lambda: a.malloc(1000, stream), a.stats, a.empty_cache):
            with pytest.raises(NotSupportedError, match="called again on a thread that is already inside it"):
                call()
        a.free(block)
        assert list(a._gc_frees) == [block]
        with pytest.raises(InvalidHandleError, match="freed twice"):
            a.free(freed)
    finally:
        a._lock.release()
    assert a.stats()["allocation.all.current"] == 0 and not a._gc_frees  # done by stats()


def test_an_int_subclass_size_is_refused_for_its_type_not_its_value() -> None:
    # nbytes=Size(10) was refused with "cannot allocate 10 bytes: the size must be at least 1"
    class Size(int):
        pass

    with pytest.raises(InvalidValueError, match=r"is a Size, not an int: pass int\(nbytes\)"):
        accel.memory.allocate(Size(10))
    with pytest.raises(InvalidValueError, match="the size must be at least 1"):
        accel.memory.allocate(Size(0))


_GC_CALLBACK_ALLOCATES = """
import gc, accel
allocator, stream = accel.memory.get_allocator(), accel.current_stream()
spare = [allocator.malloc(100, stream) for _ in range(200)]
refused = []
def allocate_in_collection(phase, info):
    if phase == "start":
        if spare:
            allocator.free(spare.pop())  # inside the locked path: deferred to its next call
        try:
            accel.memory.allocate(100).free()
        except accel.NotSupportedError as exc:  # inside the locked path: refused, not a hang
            refused.append(str(exc))
gc.callbacks.append(allocate_in_collection)
gc.set_threshold(1, 1, 1)
live = []
for _ in range(3000):
    live.append(accel.memory.allocate(700))
    if len(live) > 10:
        live.pop(0).free()
gc.callbacks.remove(allocate_in_collection)
for buf in live:
    buf.free()
for block in spare:
    allocator.free(block)
accel.memory.allocate(1).free()  # takes the lock: the deferred frees are done
print(len(refused), accel.memory.memory_allocated(), refused[:1])
"""


def _run_gc_callback_allocates(prelude: str) -> tuple[int, int, str]:
    """(allocations refused, bytes allocated at the end, the first refusal's words)"""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    try:
        out = subprocess.run(
            [sys.executable, "-c", prelude + _GC_CALLBACK_ALLOCATES], env=env, capture_output=True, text=True,
            timeout=60, check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("hung: the allocation in the gc callback waits on the lock its own thread holds")
    assert out.returncode == 0 and not out.stderr, out.stderr
    refused, allocated, first = out.stdout.split(" ", 2)
    return int(refused), int(allocated), first


def test_an_allocation_from_a_gc_callback_inside_the_common_pair_does_not_hang() -> None:
    # the common pair (a plain allocator: see DeviceAllocator._plain) takes no lock: served
    assert _run_gc_callback_allocates("")[:2] == (0, 0)


def test_an_allocation_from_a_gc_callback_inside_the_locked_malloc_does_not_hang() -> None:
    # history recorded: malloc and free take the lock, and a collection inside makes the
    # callback call in while its own thread holds it. Allocations there are refused with
    # an accel error (they could not be served safely halfway through the outer call),
    # frees deferred; before, the callback waited forever.
    refused, allocated, first = _run_gc_callback_allocates("import accel\naccel.memory.record_memory_history()\n")
    assert refused > 0 and allocated == 0
    assert "called again on a thread that is already inside it" in first
