"""Hostile calls on the allocator's public methods, compiled (accel/_speedups.c) and
pure Python alike (the suite runs both ways)."""

from __future__ import annotations

import pytest

import accel
from accel._errors import InvalidHandleError, InvalidValueError
from accel._runtime import Runtime
from accel.allocator._caching import DeviceAllocator
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


def test_an_int_subclass_size_is_refused_for_its_type_not_its_value() -> None:
    # nbytes=Size(10) was refused with "cannot allocate 10 bytes: the size must be at least 1"
    class Size(int):
        pass

    with pytest.raises(InvalidValueError, match=r"is a Size, not an int: pass int\(nbytes\)"):
        accel.memory.allocate(Size(10))
    with pytest.raises(InvalidValueError, match="the size must be at least 1"):
        accel.memory.allocate(Size(0))
