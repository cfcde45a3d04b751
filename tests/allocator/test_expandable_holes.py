"""Expandable segments give back the free pages of their holes when they grow.

Run on every backend with virtual memory (the host's memfd pages, the
simulated CUDA VMM and Level Zero virtual memory), through the Backend
protocol's map and unmap calls only.
"""

from __future__ import annotations

import threading

import pytest

from accel._runtime import Runtime
from accel.allocator._caching import DeviceAllocator
from accel.allocator.config import parse
from tests.allocator.test_caching import check_invariants

MiB = 1 << 20


@pytest.fixture
def vm(backend):
    if not backend.supports_virtual_memory(0):
        pytest.skip(f"{backend.name} has no virtual memory here")
    runtime = Runtime(backend)
    yield backend, runtime.default_stream(0)
    backend.device_synchronize(0)


def _with_hole(backend, stream, keep_mb: int) -> tuple[DeviceAllocator, list]:
    """Three 8 MiB blocks (4 pages each) with the middle one freed: a hole of 4 whole pages."""
    a = DeviceAllocator(backend, 0, parse(f"expandable_segments:True,expandable_keep_free_mb:{keep_mb}"))
    x, y, z = (a.malloc(8 * MiB, stream) for _ in range(3))
    a.free(y)
    assert a.stats()["reserved_bytes.all.current"] == 24 * MiB
    return a, [x, z]


def _release(a: DeviceAllocator, blocks: list) -> None:
    for b in blocks:
        a.free(b)
    check_invariants(a)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0


def test_growth_unmaps_the_free_pages_of_holes_first(vm):
    backend, s = vm
    a, live = _with_hole(backend, s, 0)
    frees = a.stats()["num_device_free"]
    w = a.malloc(10 * MiB, s)  # fits in no hole: the segment grows by 5 pages
    check_invariants(a)
    stats = a.stats()
    # The hole's 4 pages went back before 5 were mapped: 24 - 8 + 10, not 34.
    assert stats["reserved_bytes.all.current"] == 26 * MiB
    assert stats["reserved_bytes.all.peak"] == 26 * MiB
    assert stats["num_device_free"] == frees + 1
    # The hole is mapped again when a request fits there.
    v = a.malloc(8 * MiB, s)
    assert v.ptr == live[0].ptr + 8 * MiB
    assert a.stats()["reserved_bytes.all.current"] == 34 * MiB
    check_invariants(a)
    _release(a, [*live, w, v])


def test_keep_free_pages_stay_mapped(vm):
    backend, s = vm
    a, live = _with_hole(backend, s, 2)
    w = a.malloc(10 * MiB, s)
    # One page of the hole stays mapped (2 MiB kept free): 24 - 6 + 10.
    assert a.stats()["reserved_bytes.all.current"] == 28 * MiB
    check_invariants(a)
    _release(a, [*live, w])


def test_a_large_keep_free_keeps_every_hole_as_pytorch_does(vm):
    backend, s = vm
    a, live = _with_hole(backend, s, 100_000)
    frees = a.stats()["num_device_free"]
    w = a.malloc(10 * MiB, s)
    assert a.stats()["reserved_bytes.all.current"] == 34 * MiB
    assert a.stats()["num_device_free"] == frees
    _release(a, [*live, w])


def test_unmaps_no_more_than_the_growth(vm):
    backend, s = vm
    a, live = _with_hole(backend, s, 0)
    w = a.malloc(4 * MiB, s)  # fits the hole: no growth at all
    assert a.stats()["reserved_bytes.all.current"] == 24 * MiB
    a.free(w)
    w = a.malloc(9 * MiB, s)  # grows by 5 pages, 4 of them given back
    assert a.stats()["reserved_bytes.all.current"] == 26 * MiB
    check_invariants(a)
    _release(a, [*live, w])


def test_no_page_is_unmapped_while_the_stream_has_queued_work(vm):
    from accel.stream._stream import Stream

    backend, default = vm
    # A created stream: the host backend runs its default stream's work inline.
    s = Stream._wrap(default._runtime, 0, backend.stream_create(0, 0), owned=True)
    a, live = _with_hole(backend, s, 0)
    gate = threading.Event()
    backend.launch_host_func(0, s._handle, lambda: gate.wait(30))
    try:
        w = a.malloc(10 * MiB, s)
        # The hole may still be read by the queued work: it stays mapped.
        assert a.stats()["reserved_bytes.all.current"] == 34 * MiB
        check_invariants(a)
    finally:
        gate.set()
    backend.stream_synchronize(0, s._handle)
    a.free(w)
    w = a.malloc(20 * MiB, s)  # idle now: growing by 5 pages gives the hole's 4 back
    assert a.stats()["reserved_bytes.all.current"] == (34 + 10 - 8) * MiB
    _release(a, [*live, w])
    s.close()


def test_a_steady_state_maps_and_unmaps_nothing(vm):
    backend, s = vm
    a = DeviceAllocator(backend, 0, parse("expandable_segments:True,expandable_keep_free_mb:0"))
    cache = [a.malloc(5 * MiB, s), a.malloc(3 * MiB, s)]
    for step in range(12):
        temps = [a.malloc((1 + step % 3) * MiB, s), a.malloc(7 * MiB, s)]
        for t in temps:
            a.free(t)
        if step == 3:
            before = a.stats()
    after = a.stats()
    assert after["num_device_alloc"] == before["num_device_alloc"]
    assert after["num_device_free"] == before["num_device_free"]
    _release(a, cache)


def test_nothing_is_unmapped_during_a_capture(vm):
    backend, s = vm
    a, live = _with_hole(backend, s, 0)
    a.begin_allocate_to_pool((1, 0), lambda stream: False)  # a capture on another stream
    try:
        w = a.malloc(10 * MiB, s)
        assert a.stats()["reserved_bytes.all.current"] == 34 * MiB
    finally:
        a.end_allocate_to_pool((1, 0))
        a.release_pool((1, 0))
    check_invariants(a)
    _release(a, [*live, w])
