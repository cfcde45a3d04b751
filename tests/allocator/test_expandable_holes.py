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
from accel.allocator._resources import BackendResource, StatisticsAdaptor
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
    for step in range(15):
        # A period of three steps; the 1 MiB temporary is in the small pool. In the
        # first period the large pool takes the small pool's free page; the small
        # pool maps one again in the second and keeps it from then on.
        temps = [a.malloc((1 + step % 3) * MiB, s), a.malloc(7 * MiB, s)]
        for t in temps:
            a.free(t)
        if step == 5:
            before = a.stats()
    after = a.stats()
    assert after["num_device_alloc"] == before["num_device_alloc"]
    assert after["num_device_free"] == before["num_device_free"]
    assert after["reserved_bytes.all.current"] == before["reserved_bytes.all.current"]
    _release(a, cache)


def test_growth_takes_the_free_pages_of_the_other_pool_and_maps_them_again(vm):
    backend, s = vm
    counted = StatisticsAdaptor(BackendResource(backend, 0))
    a = DeviceAllocator(backend, 0, parse("expandable_segments:True"), upstream=counted)
    big = a.malloc(4 * MiB, s)  # the large pool: 2 pages
    small = [a.malloc(1 * MiB, s) for _ in range(3)]  # the small pool: 2 pages, one growth each
    for b in small:
        a.free(b)
    assert a.stats()["reserved_bytes.all.current"] == 8 * MiB
    assert counted.counts.allocations == 4
    # The large pool grows by 3 pages. The small pool grew after it last did, so it
    # keeps what its last growth mapped (a page) and gives the other; that physical
    # page is mapped again in the large pool, not released and made anew.
    more = a.malloc(6 * MiB, s)
    check_invariants(a)
    assert a.stats()["reserved_bytes.all.current"] == 12 * MiB
    assert counted.counts.allocations == 6
    # Growing again, the large pool takes the small pool's last page too: the
    # small pool's reservation goes back, and no page is made.
    last = a.malloc(2 * MiB, s)
    check_invariants(a)
    stats = a.stats()
    assert stats["reserved_bytes.all.current"] == 12 * MiB
    assert stats["reserved_bytes.small_pool.current"] == 0
    assert stats["segment.small_pool.current"] == 0
    assert counted.counts.allocations == 6
    assert counted.counts.current_bytes == 12 * MiB
    _release(a, [big, more, last])
    assert counted.counts.current_bytes == 0


def test_growth_maps_where_the_fewest_new_pages_are_needed(vm):
    backend, s = vm
    a = DeviceAllocator(backend, 0, parse("expandable_segments:True"))
    x = a.malloc(int(3.75 * MiB), s)  # [0, 3.75): pages 0-1
    y = a.malloc(8 * MiB, s)  # [3.75, 11.75): pages 2-5
    z = a.malloc(3 * MiB, s)  # [11.75, 14.75): pages 6-7
    base = x.ptr
    a.free(y)
    # 9 MiB fits in no hole: the segment grows at its end by 4 pages after giving back
    # the hole's 3 whole pages, [4, 10). The hole keeps 0.25 MiB mapped before them
    # and 1.75 MiB after.
    w = a.malloc(9 * MiB, s)
    assert w.ptr == base + int(14.75 * MiB)
    assert a.stats()["reserved_bytes.all.current"] == 18 * MiB
    # 5.5 MiB: starting in the 0.25 MiB before the hole needs 3 pages, and so does
    # the end of the segment; ending in the 1.75 MiB after the hole needs 2.
    v = a.malloc(int(5.5 * MiB), s)
    assert v.ptr == base + 6 * MiB
    assert a.stats()["reserved_bytes.all.current"] == 22 * MiB
    check_invariants(a)
    _release(a, [x, z, w, v])


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


def test_pools_needing_pages_in_turn_settle(vm):
    """Repeating patterns of small- and large-pool temporaries: after a few periods
    no page is mapped or unmapped any more (a segment that grew since the growing
    one last did keeps what that growth mapped, so pages are not passed back and
    forth between the pools)."""
    import random

    backend, s = vm
    still_mapping = []
    for seed in range(12):
        rng = random.Random(seed)
        a = DeviceAllocator(backend, 0, parse("expandable_segments:True"))
        cache = [a.malloc(int(rng.uniform(0.2, 9) * MiB), s) for _ in range(rng.randint(1, 4))]
        period = [
            [int(rng.choice([rng.uniform(0.05, 1), rng.uniform(1, 12)]) * MiB) for _ in range(rng.randint(1, 5))]
            for _ in range(rng.randint(2, 5))
        ]
        for rep in range(12):
            if rep == 8:
                before = a.stats()
            for step in period:
                temps = [a.malloc(n, s) for n in step]
                rng.shuffle(temps)
                for t in temps:
                    a.free(t)
        after = a.stats()
        if (after["num_device_alloc"], after["num_device_free"]) != (
            before["num_device_alloc"],
            before["num_device_free"],
        ):
            still_mapping.append(seed)
        check_invariants(a)
        _release(a, cache)
    assert still_mapping == []


def test_the_whole_free_pages_beyond_the_new_block_go_back_too(vm):
    backend, s = vm
    a = DeviceAllocator(backend, 0, parse("expandable_segments:True"))
    p = a.malloc(10 * MiB, s)  # [0, 10)
    base = p.ptr
    q = a.malloc(int(2.25 * MiB), s)  # [10, 12.25)
    r = a.malloc(int(5.5 * MiB), s)  # [12.25, 17.75)
    a.free(r)
    a.free(p)
    d = a.malloc(int(3.5 * MiB), s)  # [12.25, 15.75)
    e = a.malloc(4 * MiB, s)  # [0, 4)
    f = a.malloc(8 * MiB, s)  # the end, [15.75, 23.75); pages [4, 10) given back
    a.free(q)
    a.free(e)
    assert a.stats()["reserved_bytes.all.current"] == 18 * MiB
    # Free [0, 4), unmapped [4, 10), free [10, 12.25). 10 MiB goes from 0 over the
    # unmapped run (3 new pages) and the free block after the run joins it; that
    # block's whole page [10, 12) is beyond the new block: it goes back first.
    g = a.malloc(10 * MiB, s)
    assert g.ptr == base
    assert a.stats()["reserved_bytes.all.current"] == 22 * MiB
    check_invariants(a)
    _release(a, [d, f, g])


def test_a_block_goes_to_the_end_of_a_hole_when_that_touches_fewer_pages(vm):
    backend, s = vm
    a = DeviceAllocator(backend, 0, parse("expandable_segments:True"))
    x = a.malloc(3 * MiB, s)  # [0, 3)
    y = a.malloc(int(4.5 * MiB), s)  # [3, 7.5)
    z = a.malloc(int(2.5 * MiB), s)  # [7.5, 10): the segment's last page is full
    base = x.ptr
    a.free(y)
    # 1.5 MiB in the hole [3, 7.5): at its start it would touch [2, 4), which x
    # touches already, and [4, 6), a new page; at its end, [6, 7.5) touches only
    # [6, 8), which z touches already. So it goes at the end, and [4, 6) stays a
    # whole free page.
    w = a.malloc(int(1.5 * MiB), s)
    assert w.ptr == base + 6 * MiB
    check_invariants(a)
    # The next growth gives that page back: 10 + 10 - 2 MiB reserved, not 20.
    v = a.malloc(10 * MiB, s)
    assert a.stats()["reserved_bytes.all.current"] == 18 * MiB
    check_invariants(a)
    _release(a, [x, z, w, v])


def test_a_block_stays_at_the_start_of_a_hole_when_the_end_is_no_better(vm):
    backend, s = vm
    a = DeviceAllocator(backend, 0, parse("expandable_segments:True"))
    x = a.malloc(3 * MiB, s)  # [0, 3)
    y = a.malloc(4 * MiB, s)  # [3, 7)
    z = a.malloc(3 * MiB, s)  # [7, 10)
    base = x.ptr
    a.free(y)
    # 1.5 MiB in [3, 7): one new page, [4, 6), at either end, and
    # as many bytes of pages touched: the start, as without pages to save.
    w = a.malloc(int(1.5 * MiB), s)
    assert w.ptr == base + 3 * MiB
    check_invariants(a)
    _release(a, [x, z, w])


def test_with_every_free_page_kept_blocks_go_at_the_start_of_holes(vm):
    backend, s = vm
    a = DeviceAllocator(backend, 0, parse("expandable_segments:True,expandable_keep_free_mb:1000000"))
    x = a.malloc(3 * MiB, s)
    y = a.malloc(int(4.5 * MiB), s)
    z = a.malloc(int(2.5 * MiB), s)
    a.free(y)
    # No page goes back before empty_cache: nothing to save by going to the end.
    w = a.malloc(int(1.5 * MiB), s)
    assert w.ptr == x.ptr + 3 * MiB
    check_invariants(a)
    _release(a, [x, z, w])


def test_a_growth_counts_the_free_pages_it_covers_as_added(vm):
    backend, s = vm
    a = DeviceAllocator(backend, 0, parse("expandable_segments:True"))
    x = a.malloc(2 * MiB, s)  # [0, 2)
    y = a.malloc(int(2.5 * MiB), s)  # [2, 4.5)
    base = x.ptr
    a.free(x)
    z = a.malloc(6 * MiB, s)  # [4.5, 10.5), after giving back [0, 2)
    assert a.stats()["reserved_bytes.all.current"] == 10 * MiB
    a.free(y)  # free [2, 4.5): the whole page [2, 4) stays mapped
    # 3.5 MiB needs one new page either at [0, 3.5), over the unmapped [0, 2) into
    # the free block after, or at the end, [10.5, 14). The first also covers the
    # free page [2, 4), which would otherwise go back: two pages added to those
    # live blocks touch, against one at the end, where z's last page is filled.
    w = a.malloc(int(3.5 * MiB), s)
    assert w.ptr == base + int(10.5 * MiB)
    assert a.stats()["reserved_bytes.all.current"] == 10 * MiB
    check_invariants(a)
    _release(a, [z, w])


def test_a_free_block_gives_its_pages_once(vm):
    """The free block after a growth gives back only its whole pages past the new
    block's end; what is left of it before them is not looked at again (it would give
    the pages the new block is about to take, and the growth would fall short)."""
    backend, s = vm
    a = DeviceAllocator(backend, 0, parse("expandable_segments:True"))
    h, x, p, r, q, y = (a.malloc(n * MiB, s) for n in (4, 4, 2, 6, 8, 2))  # [0, 26)
    a.free(r)
    a.empty_cache()  # [10, 16) unmapped
    for b in (h, p, q):
        a.free(b)  # free: [0, 4), [8, 10), [16, 24)
    maps = a.stats()["num_device_alloc"]
    # 14 MiB: the run [10, 16) is mapped, the block starting in the free block before
    # it; the give-back takes [22, 24) past its end and the hole [0, 4), 6 MiB in all.
    w = a.malloc(14 * MiB, s)
    check_invariants(a)
    assert w.ptr == p.ptr and a.stats()["num_device_alloc"] == maps + 1
    assert a.stats()["reserved_bytes.all.current"] == 20 * MiB
    for b in (x, y, w):
        a.free(b)
