"""Unit tests of the caching DeviceAllocator over a private host backend."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any

import pytest

from accel._errors import CaptureError, DeviceError, InvalidHandleError, InvalidValueError, OutOfMemoryError
from accel._runtime import Runtime
from accel.allocator import _stats as S
from accel.allocator._blocks import ALLOCATED, PENDING, RETIRED
from accel.allocator._caching import DeviceAllocator, round_size
from accel.allocator._history import History
from accel.allocator.config import AllocatorConfig, parse
from accel.backends.cpu import CpuBackend
from tests.allocator.thread_races import free_each, run_threads, run_while_toggling

MiB = 1 << 20


def check_invariants(alloc: DeviceAllocator) -> None:
    """Everything the allocator's structures must satisfy, recounted from scratch: the
    core's books (every segment tiled by its blocks, free and unmapped neighbours merged,
    an expandable segment's pages mapped exactly under its mapped blocks), the handles
    of the policy layer, and the public views."""
    with alloc._lock:
        segments: dict[int, list[dict[str, int]]] = {}
        for b in alloc._core.blocks():
            segments.setdefault(b["segment"], []).append(b)
        upstream = alloc._core._callbacks
        pages, page = upstream.pages, upstream.page
        mapped_pages = set()
        for base, blocks in segments.items():
            end = base
            for prev, b in zip([None, *blocks], blocks):
                assert b["ptr"] == end and b["size"] > 0, "blocks must tile the segment"
                end += b["size"]
                free = b["mapped"] and not b["allocated"] and not b["held"]
                if prev is not None:
                    prev_free = prev["mapped"] and not prev["allocated"] and not prev["held"]
                    assert not (free and prev_free), "adjacent free blocks were not merged"
                    assert prev["mapped"] or b["mapped"], "adjacent unmapped blocks were not merged"
                if not b["expandable"]:
                    assert b["mapped"]
                    continue
                first = base + (b["ptr"] - base) // page * page
                touched = range(first, b["ptr"] + b["size"], page)
                if b["mapped"]:
                    assert all(p in pages for p in touched), "a mapped block over an unmapped page"
                    mapped_pages.update(touched)
                else:
                    assert (b["ptr"] - base) % page == 0 and b["size"] % page == 0
                    assert not any(p in pages for p in touched), "an unmapped block over a mapped page"
                if b["held"]:
                    assert alloc._live[b["ptr"]].state == PENDING
            assert end == base + blocks[0]["segment_size"], "blocks do not cover the segment"
        assert mapped_pages == set(pages), "a page is mapped that no block covers"
        held = {b["ptr"] for bs in segments.values() for b in bs if b["held"]}
        pending = {}
        for queue in alloc._pending.values():
            for _, b in queue:
                pending[id(b)] = pending.get(id(b), 0) + 1
                assert b.state == PENDING and b.ptr in held
        for b in alloc._live.values():
            assert b.event_count == pending.get(id(b), 0)
            assert (b.state == PENDING) == (b.ptr in held)
        waited_for = [e for queue in alloc._pending.values() for e, _ in queue]
        pooled = alloc._events
        assert len(set(waited_for + pooled)) == len(waited_for) + len(pooled), "an event is pooled and in use"
    check_public_views(alloc)


def check_public_views(alloc: DeviceAllocator) -> None:
    """What the public views (snapshot, stats) must agree on, the native core's books
    included: segments do not overlap and are tiled by their blocks, free neighbours
    are merged, and the statistics equal the snapshot's sums."""
    snap = sorted(alloc.snapshot(), key=lambda seg: seg["address"])
    for a, b in zip(snap, snap[1:]):
        assert a["address"] + a["total_size"] <= b["address"], "segments overlap"
    for seg in snap:
        end = seg["address"]
        for prev, b in zip([None, *seg["blocks"]], seg["blocks"]):
            assert b["address"] == end and b["size"] > 0, "blocks must tile the segment"
            end += b["size"]
            if not seg["is_expandable"] and prev is not None:
                assert (prev["state"], b["state"]) != ("inactive", "inactive"), "free neighbours were not merged"
        assert end == seg["address"] + seg["total_size"]
    blocks = [b for seg in snap for b in seg["blocks"]]
    stats = alloc.stats()
    allocated = [b for b in blocks if b["state"] == "active_allocated"]
    active = [b for b in blocks if b["state"] != "inactive"]
    assert stats["allocation.all.current"] == len(allocated)
    assert stats["allocated_bytes.all.current"] == sum(b["size"] for b in allocated)
    assert stats["active.all.current"] == len(active)
    assert stats["active_bytes.all.current"] == sum(b["size"] for b in active)
    assert stats["requested_bytes.all.current"] == sum(b["requested_size"] for b in active)
    assert stats["reserved_bytes.all.current"] == sum(seg["total_size"] for seg in snap)
    assert stats["segment.all.current"] == sum(1 for seg in snap if not seg["is_expandable"])


def segment_of(alloc: DeviceAllocator, ptr: int) -> int:
    """The address of the segment that holds ``ptr`` (from the snapshot)."""
    for seg in alloc.snapshot():
        if seg["address"] <= ptr < seg["address"] + seg["total_size"]:
            return int(seg["address"])
    raise AssertionError(f"no segment holds {ptr:#x}")


def block_after(alloc: DeviceAllocator, ptr: int) -> dict[str, Any] | None:
    """The snapshot's block after the one at ``ptr`` in its segment (None: it is the last)."""
    for seg in alloc.snapshot():
        addresses = [b["address"] for b in seg["blocks"]]
        if ptr in addresses:
            i = addresses.index(ptr)
            return seg["blocks"][i + 1] if i + 1 < len(addresses) else None
    raise AssertionError(f"no block at {ptr:#x}")


@pytest.fixture
def host():
    backend = CpuBackend(1, None)
    runtime = Runtime(backend)
    yield backend, runtime
    backend.device_synchronize(0)


def make(backend, text: str = "", **kw) -> DeviceAllocator:
    return DeviceAllocator(backend, 0, parse(text) if text else AllocatorConfig(), **kw)


def stream(runtime: Runtime):
    from accel.stream._stream import Stream

    return Stream._wrap(runtime, 0, runtime.backend.stream_create(0, 0), owned=True)


# -- sizes --------------------------------------------------------------------------


def test_round_size_vectors():
    assert round_size(1, 0) == 512
    assert round_size(512, 0) == 512
    assert round_size(513, 0) == 1024
    assert round_size(1200, 4) == 1536  # not above 512 * 4: plain rounding, as in PyTorch
    assert round_size(4800, 4) == 5120  # 4096 + steps of 1024
    assert round_size(1200, 0) == 1536
    assert round_size(1 << 20, 4) == 1 << 20  # powers of two stay
    assert round_size(1000, 4) == 1024  # 1000 <= 512*4: plain 512 rounding
    assert round_size(5 * MiB + 1, 4) == 6 * MiB
    assert round_size(5 * MiB + 1, 2) == 6 * MiB
    assert round_size(9 * MiB, 2) == 12 * MiB


def test_segment_sizes(host):
    """PyTorch's segment sizes: 2 MiB for small requests, a large segment below 10 MiB,
    else the request rounded up to 2 MiB."""
    backend, rt = host
    s = rt.default_stream(0)
    for config, request, segment in (
        ("", 1 * MiB, 2 * MiB), ("", 5 * MiB, 20 * MiB), ("", 11 * MiB, 12 * MiB),
        ("large_segment_size_mb:32", 5 * MiB, 32 * MiB),
    ):  # fmt: skip
        a = make(backend, config)
        block = a.malloc(request, s)
        assert [seg["total_size"] for seg in a.snapshot()] == [segment], (config, request)
        a.free(block)
        a.empty_cache()


def test_roundup_divisions_from_config(host):
    backend, rt = host
    a = make(backend, "roundup_power2_divisions:4")
    b = a.malloc(5 * MiB + 1, rt.default_stream(0))
    assert b.size == 6 * MiB
    a.free(b)
    check_invariants(a)


# -- pools, best fit, split, merge ---------------------------------------------------------


def test_small_and_large_pools(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    small = a.malloc(MiB, s)
    large = a.malloc(MiB + 1, s)
    huge = a.malloc(25 * MiB, s)
    st = a.stats()
    assert st["segment.small_pool.current"] == 1 and st["reserved_bytes.small_pool.current"] == 2 * MiB
    assert st["segment.large_pool.current"] == 2
    assert st["reserved_bytes.large_pool.current"] == 20 * MiB + 26 * MiB
    assert st["allocated_bytes.all.current"] == MiB + (MiB + 512) + 26 * MiB  # 1 MiB tail kept
    assert st["requested_bytes.all.current"] == MiB + (MiB + 1) + 25 * MiB
    for b in (small, large, huge):
        a.free(b)
    check_invariants(a)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0
    assert backend._memory[0]._held == 0


def test_best_fit_reuses_smallest_block_on_same_stream(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    blocks = [a.malloc(n, s) for n in (4096, 8192, 4096, 16384)]
    keep = [a.malloc(512, s) for _ in range(2)]
    a.free(blocks[1])  # 8 KiB hole
    a.free(blocks[3])  # a 16 KiB hole: the 512-byte blocks after it keep it apart from the tail
    assert a.largest_free_block() == 2 * MiB - (4096 + 8192 + 4096 + 16384 + 2 * 512)  # the tail
    got = a.malloc(6000, s)
    assert got.ptr == blocks[1].ptr  # best fit picks the 8 KiB hole
    other = stream(rt)
    elsewhere = a.malloc(6000, other)
    assert segment_of(a, elsewhere.ptr) != segment_of(a, got.ptr)  # blocks never move between streams
    check_invariants(a)
    for b in (blocks[0], blocks[2], got, elsewhere, *keep):
        a.free(b)
    check_invariants(a)


def test_split_thresholds(host):
    backend, rt = host
    a = make(backend, "max_split_size_mb:100")
    s = rt.default_stream(0)
    # Small pool: a remainder of >= 512 bytes is split off.
    b = a.malloc(MiB - 512, s)
    rest = block_after(a, b.ptr)
    assert b.size == MiB - 512 and rest is not None and rest["size"] == MiB + 512
    # Large pool: a remainder of exactly 1 MiB stays attached (it must be > 1 MiB).
    c = a.malloc(19 * MiB, s)
    assert c.size == 20 * MiB and block_after(a, c.ptr) is None
    d = a.malloc(8 * MiB, s)
    rest = block_after(a, d.ptr)
    assert d.size == 8 * MiB and rest is not None and rest["size"] == 12 * MiB
    # Requests of max_split_size or more are never split.
    e = a.malloc(120 * MiB, s)
    a.free(e)
    f = a.malloc(105 * MiB, s)
    assert f.ptr == e.ptr and f.size == 120 * MiB
    a.free(f)
    for x in (b, c, d):
        a.free(x)
    check_invariants(a)


def test_oversize_blocks_serve_only_close_requests(host):
    backend, rt = host
    a = make(backend, "max_split_size_mb:40,max_non_split_rounding_mb:20")
    s = rt.default_stream(0)
    big = a.malloc(64 * MiB, s)
    ptr = big.ptr
    assert a.stats()["oversize_allocations.current"] == 1
    a.free(big)
    small = a.malloc(12 * MiB, s)  # < MS: never takes an oversize block
    assert small.ptr != ptr
    near = a.malloc(50 * MiB, s)  # 64 < 50 + 20: close enough, reused unsplit
    assert near.ptr == ptr and near.size == 64 * MiB
    a.free(near)
    far = a.malloc(41 * MiB, s)  # 64 >= 41 + 20: too wasteful
    assert far.ptr != ptr
    st = a.stats()
    assert st["oversize_segments.current"] == 2 and st["max_split_size"] == 40 * MiB
    for x in (small, far):
        a.free(x)
    check_invariants(a)


def test_max_split_size_unlimited_reports_minus_one(host):
    backend, _ = host
    assert make(backend).stats()["max_split_size"] == -1


def test_stats_keys_match_pytorch_scheme(host):
    backend, _ = host
    st = make(backend).stats()
    assert len(st) == 9 * 3 * 4 + 8 + 5 + 1
    assert list(st) == sorted(st)
    for key in ("allocation.all.current", "reserved_bytes.large_pool.peak", "num_alloc_retries",
                "num_ooms", "inactive_split_bytes.small_pool.freed", "oversize_segments.peak"):
        assert key in st


def test_peak_and_accumulated_resets(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    x = a.malloc(4096, s)
    y = a.malloc(4096, s)
    a.free(y)
    st = a.stats()
    assert st["allocated_bytes.all.peak"] == 8192 and st["allocated_bytes.all.current"] == 4096
    assert st["allocation.all.allocated"] == 2 and st["allocation.all.freed"] == 1
    a.reset_peak_stats()
    assert a.stats()["allocated_bytes.all.peak"] == 4096
    a.reset_accumulated_stats()
    st = a.stats()
    assert st["allocation.all.allocated"] == 0 and st["allocation.all.freed"] == 0
    assert st["allocation.all.current"] == 1 and st["num_device_alloc"] == 0
    a.free(x)
    st = a.stats()
    assert st["allocation.all.freed"] == 1 and st["allocation.all.current"] == 0


# -- errors --------------------------------------------------------------------------------


def test_bad_sizes_and_double_free(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(InvalidValueError):
            a.malloc(bad, s)  # type: ignore[arg-type]
    with pytest.raises(OutOfMemoryError, match="more than 1EB"):
        a.malloc(1 << 61, s)
    b = a.malloc(100, s)
    a.free(b)
    with pytest.raises(InvalidHandleError, match="freed twice"):
        a.free(b)
    other = make(backend)
    c = other.malloc(100, s)
    with pytest.raises(InvalidHandleError):
        a.free(c)
    other.free(c)
    check_invariants(a)


def test_upstream_of_other_device_refused(host):
    from accel.allocator._resources import BackendResource

    backend = CpuBackend(2, None)
    with pytest.raises(DeviceError, match="device 1"):
        DeviceAllocator(backend, 0, AllocatorConfig(), upstream=BackendResource(backend, 1))


# -- OOM -----------------------------------------------------------------------------------------


def test_oom_message_retry_and_stats():
    backend = CpuBackend(1, 64 * MiB)
    rt = Runtime(backend)
    a = make(backend)
    s = rt.default_stream(0)
    held = a.malloc(40 * MiB, s)
    cached = a.malloc(12 * MiB, s)
    a.free(cached)
    # 40 + 12 cached; 30 more needs the cache flushed, then still fails.
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(30 * MiB, s)
    err = info.value
    text = str(err)
    assert "Tried to allocate 30.00 MiB" in text and "total capacity of 64.00 MiB" in text
    assert "40.00 MiB is allocated by accel" in text
    assert err.requested == 30 * MiB and err.device == 0
    assert err.details.largest_free_block == 0  # type: ignore[attr-defined]
    st = a.stats()
    assert st["num_ooms"] == 1 and st["num_alloc_retries"] == 1 and st["num_sync_all_streams"] == 1
    assert st["reserved_bytes.all.current"] == 40 * MiB  # the cached 12 MiB went back
    # The retry path frees the cache and then succeeds.
    more = a.malloc(20 * MiB, s)
    a.free(more)
    a.free(held)
    check_invariants(a)


def test_oom_advice_fits_the_state():
    backend = CpuBackend(1, 64 * MiB)
    rt = Runtime(backend)
    s = rt.default_stream(0)
    # Fragmented: small blocks keep large segments alive.
    a = make(backend)
    pins = []
    for _ in range(3):
        x = a.malloc(15 * MiB, s)
        pins.append(a.malloc(4 * MiB, s))
        a.free(x)
    with pytest.raises(OutOfMemoryError) as info:
        a.malloc(30 * MiB, s)
    assert "expandable_segments:True" in str(info.value)
    assert info.value.details.fragmentation > 0.2  # type: ignore[attr-defined]
    for p in pins:
        a.free(p)
    a.empty_cache()
    # With expandable segments on, never suggest them.
    e = make(backend, "expandable_segments:True")
    pins = [e.malloc(20 * MiB, s) for _ in range(3)]
    with pytest.raises(OutOfMemoryError) as info:
        e.malloc(30 * MiB, s)
    assert "expandable_segments:True" not in str(info.value)
    for p in pins:
        e.free(p)
    e.empty_cache()
    check_invariants(e)


def test_memory_fraction_caps_reservation_without_asking_the_device():
    backend = CpuBackend(1, 100 * MiB)
    rt = Runtime(backend)
    a = make(backend)
    a.set_memory_fraction(0.5)
    s = rt.default_stream(0)
    x = a.malloc(40 * MiB, s)
    with pytest.raises(OutOfMemoryError, match="50.00 MiB allowed") as info:
        a.malloc(20 * MiB, s)
    assert "set_per_process_memory_fraction" in str(info.value)
    with pytest.raises(InvalidValueError):
        a.set_memory_fraction(1.5)
    a.free(x)
    assert a.get_memory_fraction() == 0.5


def test_memory_fraction_from_the_configuration_follows_changes():
    backend = CpuBackend(1, 100 * MiB)
    a = make(backend, "per_process_memory_fraction:0.5")
    assert a.get_memory_fraction() == 0.5 and a._allowed == 50 * MiB
    a.update_config(parse("per_process_memory_fraction:1.0"))
    assert a.get_memory_fraction() == 1.0 and a._allowed is None
    a.set_memory_fraction(0.25)
    a.update_config(parse("per_process_memory_fraction:0.5"))  # the explicit call wins
    assert a.get_memory_fraction() == 0.25


def test_garbage_collection_frees_old_blocks_first():
    backend = CpuBackend(1, 400 * MiB)
    rt = Runtime(backend)
    # 40 MiB blocks and larger are never split nor given to small requests.
    a = make(backend, "garbage_collection_threshold:0.4,max_split_size_mb:40")
    a.set_memory_fraction(1.0)  # GC runs only under a fraction limit: above 40% of 400 MiB
    s = rt.default_stream(0)
    old, mid, new = (a.malloc(50 * MiB, s) for _ in range(3))
    a.free(old)
    for _ in range(5):  # each best-fit search advances the large pool's clock
        a.free(a.malloc(12 * MiB, s))
    a.free(mid)
    a.free(new)
    assert a.stats()["reserved_bytes.all.current"] == 162 * MiB
    big = a.malloc(100 * MiB, s)  # a miss above the threshold: GC before asking upstream
    bases = {seg["address"] for seg in a.snapshot()}
    # Only blocks at least as old as the average age go: here `old` alone.
    assert old.ptr not in bases and mid.ptr in bases and new.ptr in bases
    assert a.stats()["num_device_free"] == 1
    a.free(big)
    check_invariants(a)
    # No GC without a fraction limit.
    plain = make(backend, "garbage_collection_threshold:0.3,max_split_size_mb:40")
    cached = plain.malloc(50 * MiB, s)
    plain.free(cached)
    plain.free(plain.malloc(60 * MiB, s))
    assert plain.stats()["num_device_free"] == 0


# -- streams and events ----------------------------------------------------------------------------


def test_block_used_on_other_stream_waits_for_its_event(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    side = stream(rt)
    gate = threading.Event()
    b = a.malloc(4096, s)
    a.record_stream(b, side)
    side.launch_host_func(gate.wait)
    a.free(b)
    assert b.state == PENDING
    st = a.stats()
    assert st["allocated_bytes.all.current"] == 0 and st["active_bytes.all.current"] == 4096
    again = a.malloc(4096, s)
    assert again.ptr != b.ptr
    check_invariants(a)
    gate.set()
    side.synchronize()
    third = a.malloc(4096, s)  # the event passed: the block is back
    assert a.stats()["active_bytes.all.current"] == 8192
    check_invariants(a)
    for x in (again, third):
        a.free(x)


def test_events_are_pooled_not_created_per_free(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    side = stream(rt)
    for _ in range(50):
        b = a.malloc(4096, s)
        a.record_stream(b, side)
        a.free(b)
        side.synchronize()
    assert a.events_created <= 2


def test_record_stream_on_own_stream_is_ignored_and_other_device_refused(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    b = a.malloc(4096, s)
    a.record_stream(b, s)
    assert b.stream_uses is None
    two = CpuBackend(2, None)
    rt2 = Runtime(two)
    from accel.stream._stream import Stream

    foreign = Stream._wrap(rt2, 1, two.default_stream(1), owned=False)
    with pytest.raises(DeviceError):
        a.record_stream(b, foreign)
    a.free(b)
    with pytest.raises(InvalidHandleError):
        a.record_stream(b, s)


def test_closed_stream_after_record_stream(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    side = stream(rt)
    b = a.malloc(4096, s)
    a.record_stream(b, side)
    side.close()
    a.free(b)  # recording on the closed stream fails: the device is synchronized instead
    assert b.state == RETIRED  # freed at once, not pending
    assert a.stats()["active.all.current"] == 0
    check_invariants(a)


def test_empty_cache_synchronizes_pending_frees(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    side = stream(rt)
    b = a.malloc(4096, s)
    a.record_stream(b, side)
    side.launch_host_func(lambda: time.sleep(0.05))
    a.free(b)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0
    assert backend._memory[0]._held == 0


# -- private pools ------------------------------------------------------------------------------------


def test_private_pool_routing_and_lifetime(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    side = stream(rt)
    a.begin_allocate_to_pool((1, 0), lambda st: st == side)
    inside = a.malloc(4096, side)
    outside = a.malloc(4096, s)
    pools = {seg["address"]: seg["segment_pool_id"] for seg in a.snapshot()}
    assert pools[segment_of(a, inside.ptr)] == (1, 0)
    assert pools[segment_of(a, outside.ptr)] == (0, 0)
    with pytest.raises(CaptureError, match="already recording"):
        a.begin_allocate_to_pool((1, 0), lambda st: True)
    a.empty_cache()  # no memory goes back during a capture
    a.free(inside)
    a.free(outside)
    a.empty_cache()
    assert a.stats()["segment.all.current"] == 2
    a.end_allocate_to_pool((1, 0))
    with pytest.raises(CaptureError, match="not currently recording"):
        a.end_allocate_to_pool((1, 0))
    assert a.pool_ids() == [(1, 0)]
    snap = a.snapshot()
    assert {seg["segment_pool_id"] for seg in snap} == {(0, 0), (1, 0)}
    a.release_pool((1, 0))  # last use: freeable, its memory goes at the next flush
    assert a.pool_ids() == [(1, 0)] and a.stats()["segment.all.current"] == 2
    a.empty_cache()
    assert a.pool_ids() == [] and a.stats()["segment.all.current"] == 0
    with pytest.raises(InvalidValueError):
        a.release_pool((1, 0))
    check_invariants(a)


def test_pool_ids_are_checked(host):
    backend, _ = host
    a = make(backend)
    for bad in ((0, 0), (1, 1), (1,), [1, 0], (-1, 0), "x"):
        with pytest.raises(InvalidValueError):
            a.begin_allocate_to_pool(bad, lambda s: True)  # type: ignore[arg-type]
    with pytest.raises(InvalidValueError):
        a.begin_allocate_to_pool((0, 3), None)  # type: ignore[arg-type]


def test_pool_lives_until_its_last_user_is_gone(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    shared = (0, 7)
    for _ in range(2):  # two graphs share one pool
        a.begin_allocate_to_pool(shared, lambda st: True)
        a.free(a.malloc(4096, s))
        a.end_allocate_to_pool(shared)
    a.release_pool(shared)
    assert a.pool_ids() == [shared]
    assert a.stats()["reserved_bytes.all.current"] == 2 * MiB
    a.release_pool(shared)
    assert a.pool_ids() == [shared]  # freeable now; memory goes at the next flush
    a.empty_cache()
    assert a.pool_ids() == [] and a.stats()["reserved_bytes.all.current"] == 0
    a.begin_allocate_to_pool((0, 8), lambda st: True)
    a.end_allocate_to_pool((0, 8))
    a.release_pool((0, 8))  # it never held memory: gone at once
    assert a.pool_ids() == []


class _NoMemoryToKeep:
    """The core's library, but ``accel_core_keep_pool`` fails as it does when the host's
    realloc of the kept pools' list fails (ACCEL_CORE_NO_MEMORY)."""

    def __init__(self, lib: Any) -> None:
        self._real = lib

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)

    def accel_core_keep_pool(self, core: Any, pool: int, keep: int) -> int:
        if keep:
            return int(self._real.ACCEL_CORE_NO_MEMORY)
        return int(self._real.accel_core_keep_pool(core, pool, keep))


def test_a_pool_the_core_cannot_keep_is_not_registered(host, monkeypatch):
    """begin_allocate_to_pool, when the core has no host memory to keep the pool: an
    accel error, and nothing registered (the pool was left half made: listed, counted
    in use, not kept by the core and no capture under way, so it never went)."""
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    a.begin_allocate_to_pool((0, 9), lambda st: True)  # a pool with memory, then unused
    a.free(a.malloc(4096, s))
    a.end_allocate_to_pool((0, 9))
    a.release_pool((0, 9))
    core = a._core
    monkeypatch.setattr(core, "_lib", _NoMemoryToKeep(core._lib))
    for pool in ((0, 9), (0, 10)):  # one unused, one new
        with pytest.raises(OutOfMemoryError, match="no memory for the allocator core's books to keep pool"):
            a.begin_allocate_to_pool(pool, lambda st: True)
        with pytest.raises(CaptureError, match="not currently recording"):
            a.end_allocate_to_pool(pool)
    assert a.pool_ids() == [(0, 9)]
    monkeypatch.undo()
    a.free(a.malloc(4096, s))  # no capture under way: the default pool, given back below
    a.empty_cache()
    assert a.pool_ids() == [] and a.stats()["reserved_bytes.all.current"] == 0
    a.begin_allocate_to_pool((0, 10), lambda st: True)  # with memory to keep it, as usual
    a.end_allocate_to_pool((0, 10))
    a.release_pool((0, 10))
    assert a.pool_ids() == []
    check_invariants(a)


def test_cross_stream_frees_deferred_during_capture(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    side = stream(rt)
    b = a.malloc(4096, s)
    a.record_stream(b, side)
    a.begin_allocate_to_pool((2, 0), lambda st: False)
    a.free(b)
    assert b.state == PENDING and a.events_created == 0
    a.end_allocate_to_pool((2, 0))
    side.synchronize()
    a.release_pool((2, 0))
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0
    check_invariants(a)


def test_during_capture_nothing_goes_back_and_oom_comes_sooner():
    backend = CpuBackend(1, 64 * MiB)
    rt = Runtime(backend)
    a = make(backend, "max_split_size_mb:40")
    s = rt.default_stream(0)
    a.free(a.malloc(45 * MiB, s))  # a cached oversize block outside the pool
    a.begin_allocate_to_pool((3, 0), lambda st: True)
    with pytest.raises(OutOfMemoryError, match="capture is under way") as info:
        a.malloc(30 * MiB, s)
    assert a.stats()["num_device_free"] == 0 and a.stats()["num_alloc_retries"] == 0
    assert info.value.details.capturing  # type: ignore[attr-defined]
    a.end_allocate_to_pool((3, 0))
    a.release_pool((3, 0))
    ok = a.malloc(30 * MiB, s)  # outside the capture the cache is flushed and it fits
    assert a.stats()["num_device_free"] == 1
    a.free(ok)
    check_invariants(a)


# -- expandable segments ----------------------------------------------------------------------------------


def test_expandable_segments_grow_and_shrink_by_pages(host):
    backend, rt = host
    a = make(backend, "expandable_segments:True")
    s = rt.default_stream(0)
    x = a.malloc(29 * MiB + 100, s)  # 15 pages of 2 MiB
    st = a.stats()
    assert st["reserved_bytes.all.current"] == 30 * MiB and st["segment.all.current"] == 0
    y = a.malloc(15 * MiB, s)  # the free tail of x's last page (1 MiB - 512) plus 8 more pages
    assert y.ptr == x.ptr + x.size  # one contiguous range
    assert a.stats()["reserved_bytes.all.current"] == 46 * MiB
    assert a.stats()["num_device_alloc"] == 2
    check_invariants(a)
    a.free(x)
    a.empty_cache()  # x's 14 whole pages go back; the page it shares with y stays
    assert a.stats()["reserved_bytes.all.current"] == 18 * MiB
    check_invariants(a)
    snap = a.snapshot()
    assert len(snap) == 1 and snap[0]["is_expandable"] and snap[0]["total_size"] == 18 * MiB
    a.free(y)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0 and not a.native_core().blocks()  # the reservation too
    assert backend._memory[0]._held == 0 and not backend._memory[0]._reservations


def test_expandable_fills_holes_before_growing(host):
    backend, rt = host
    a = make(backend, "expandable_segments:True")
    s = rt.default_stream(0)
    blocks = [a.malloc(20 * MiB, s) for _ in range(3)]
    a.free(blocks[1])
    a.empty_cache()
    again = a.malloc(20 * MiB, s)
    assert again.ptr == blocks[1].ptr
    for b in (blocks[0], blocks[2], again):
        a.free(b)
    check_invariants(a)


def test_no_oversize_rules_inside_expandable_segments(host):
    # PyTorch #193400: with max_split_size and expandable segments, reserved memory
    # must not grow without bound while allocated stays small.
    backend, rt = host
    a = make(backend, "expandable_segments:True,max_split_size_mb:40")
    s = rt.default_stream(0)
    for i in range(30):
        big = a.malloc((100 + i) * MiB, s)
        a.free(big)
        small = a.malloc((50 + i) * MiB, s)
        a.free(small)
    assert a.stats()["reserved_bytes.all.peak"] <= 140 * MiB
    check_invariants(a)


def test_toggling_expandable_segments_at_runtime(host):
    backend, rt = host
    a = make(backend, "expandable_segments:True")
    s = rt.default_stream(0)
    x = a.malloc(4 * MiB, s)
    a.update_config(parse("expandable_segments:False"))
    y = a.malloc(4 * MiB, s)  # free expandable memory is skipped while off
    assert not next(seg for seg in a.snapshot() if seg["address"] == segment_of(a, y.ptr))["is_expandable"]
    a.free(x)
    a.free(y)
    check_invariants(a)
    a.empty_cache()
    assert a.stats()["reserved_bytes.all.current"] == 0


# -- history and snapshot -----------------------------------------------------------------------------------


def test_history_and_snapshot_layout(host):
    from accel.allocator._history import History

    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    a.record_history(History("all", "all", "python", 100))
    b = a.malloc(1000, s)
    snap = a.snapshot()
    seg = snap[0]
    assert set(seg) >= {"device", "address", "total_size", "allocated_size", "active_size",
                        "requested_size", "stream", "segment_type", "segment_pool_id",
                        "is_expandable", "frames", "blocks"}
    assert seg["blocks"][0]["state"] == "active_allocated" and seg["blocks"][0]["requested_size"] == 1000
    assert any(f["name"] == "test_history_and_snapshot_layout" for f in seg["blocks"][0]["frames"])
    a.free(b)
    actions = [e["action"] for e in a.trace()]
    assert actions == ["segment_alloc", "alloc", "snapshot", "free_requested", "free_completed"]
    with pytest.raises(InvalidValueError, match="expected state"):
        History("yes", "all", "python", 1)
    with pytest.raises(InvalidValueError, match="expected context"):
        History("all", "some", "python", 1)
    with pytest.raises(InvalidValueError, match="expected stacks"):
        History("all", "all", "cpp", 1)


def test_history_ring_keeps_newest(host):
    from accel.allocator._history import History

    backend, rt = host
    a = make(backend)
    a.record_history(History("all", None, "python", 3))
    s = rt.default_stream(0)
    for _ in range(5):
        a.free(a.malloc(512, s))
    trace = a.trace()
    assert len(trace) == 3 and trace[-1]["action"] == "free_completed" and trace[0]["frames"] == []


# -- threads ------------------------------------------------------------------------------------------------


def test_many_threads_on_several_streams(host):
    backend, rt = host
    a = make(backend)
    streams = [rt.default_stream(0), stream(rt), stream(rt)]

    def work(seed: int) -> None:
        mine = []
        for i in range(300):
            s = streams[(seed + i) % 3]
            b = a.malloc(512 * (1 + (seed * 7 + i) % 4000), s)
            if i % 5 == 0:
                a.record_stream(b, streams[(seed + i + 1) % 3])
            mine.append(b)
            if len(mine) > 8:
                a.free(mine.pop(0))
        for b in mine:
            a.free(b)

    assert run_threads([functools.partial(work, k) for k in range(4)]) == []
    check_invariants(a)
    assert a.stats()["allocated_bytes.all.current"] == 0
    a.empty_cache()
    assert backend._memory[0]._held == 0


def test_oversize_statistics_follow_a_runtime_max_split_size_change():
    from accel._runtime import Runtime
    from accel.allocator._caching import DeviceAllocator
    from accel.allocator.config import parse
    from accel.backends.cpu import CpuBackend

    backend = CpuBackend(1, None)
    stream = Runtime(backend).default_stream(0)
    alloc = DeviceAllocator(backend, 0, parse(""))
    big = alloc.malloc(30 << 20, stream)
    alloc.update_config(parse("max_split_size_mb:20"))
    assert alloc.stats()["oversize_allocations.current"] == 1
    alloc.free(big)
    alloc.empty_cache()
    stats = alloc.stats()
    assert stats["oversize_allocations.current"] == 0 and stats["oversize_segments.current"] == 0


def test_expandable_segments_without_virtual_memory_warn():
    from accel._runtime import Runtime
    from accel.allocator import AllocatorConfigWarning
    from accel.allocator._caching import DeviceAllocator
    from accel.allocator._resources import BackendResource
    from accel.allocator.config import parse
    from accel.backends.cpu import CpuBackend

    class NoVirtualMemory(BackendResource):
        def supports_virtual_memory(self) -> bool:
            return False

    backend = CpuBackend(1, None)
    with pytest.warns(AllocatorConfigWarning, match="has no effect on cpu:0"):
        alloc = DeviceAllocator(backend, 0, parse("expandable_segments:True"), upstream=NoVirtualMemory(backend, 0))
    alloc.free(alloc.malloc(4096, Runtime(backend).default_stream(0)))


def test_oom_advice_names_the_memory_fraction_when_it_refused():
    from accel._runtime import Runtime
    from accel.allocator._caching import DeviceAllocator
    from accel.allocator.config import parse
    from accel.backends.cpu import CpuBackend

    backend = CpuBackend(1, 64 << 20)
    alloc = DeviceAllocator(backend, 0, parse(""))
    alloc.set_memory_fraction(1 / 64)  # 1 MiB allowed: a 1000-byte request needs a 2 MiB segment
    from accel import OutOfMemoryError

    with pytest.raises(OutOfMemoryError, match="memory fraction .* is what stops this request"):
        alloc.malloc(1000, Runtime(backend).default_stream(0))


# -- stale handles ------------------------------------------------------------------------------


@pytest.mark.parametrize("sizes", [(4096, 4096), (2 * MiB, 2 * MiB), (1 * MiB, 1 * MiB), (4096, 8192)])
def test_stale_block_refused_after_reuse(host, sizes):
    """A block freed and then handed out again must not be freeable through the old handle."""
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    old = a.malloc(sizes[0], s)
    a.free(old)
    new = a.malloc(sizes[1], s)
    assert new is not old
    with pytest.raises(InvalidHandleError, match="freed twice"):
        a.free(old)
    with pytest.raises(InvalidHandleError):
        a.record_stream(old, s)
    assert a.stats()["allocation.all.current"] == 1
    check_invariants(a)
    a.free(new)
    check_invariants(a)


def test_stale_block_refused_after_pending_free(host):
    """A block freed with a recorded stream stays refused once its events complete and it is reused."""
    backend, rt = host
    a = make(backend)
    s, other = rt.default_stream(0), stream(rt)
    old = a.malloc(4096, s)
    a.record_stream(old, other)
    a.free(old)
    other.synchronize()
    new = a.malloc(4096, s)
    assert new is not old
    with pytest.raises(InvalidHandleError):
        a.free(old)
    a.free_from_finalizer(old)  # a late finalizer of the old owner does nothing either
    assert a.stats()["allocation.all.current"] == 1
    check_invariants(a)
    a.free(new)


def test_malloc_refuses_stream_of_another_device():
    backend = CpuBackend(2, None)
    rt = Runtime(backend)
    a = DeviceAllocator(backend, 0, AllocatorConfig())
    with pytest.raises(DeviceError, match="cpu:1.* not a stream of cpu:0"):
        a.malloc(4096, rt.default_stream(1))
    other = Runtime(CpuBackend(1, None))
    with pytest.raises(DeviceError):
        a.malloc(4096, other.default_stream(0))
    assert a.stats()["allocation.all.current"] == 0


def test_malloc_refuses_a_closed_stream(backend):
    """DeviceAllocator.malloc called directly (not through accel.memory.allocate, which
    checked) with a closed stream cached memory under the dead stream's handle, which
    the backend may hand to a new stream; it must refuse, as allocate does."""
    rt = Runtime(backend)
    a = DeviceAllocator(backend, 0, AllocatorConfig())
    s = stream(rt)
    s.close()
    with pytest.raises(InvalidHandleError, match="was closed"):
        a.malloc(4096, s)  # a cache miss
    a.free(a.malloc(4096, rt.default_stream(0)))
    with pytest.raises(InvalidHandleError, match="was closed"):
        a.malloc(4096, s)  # the fast path, with a block cached
    check_invariants(a)
    a.empty_cache()


def _pending_frees(backend, a: DeviceAllocator, rt: Runtime, n: int) -> list:
    """``n`` blocks freed while other streams (returned: keep them open) used them:
    each waits for an event."""
    s = rt.default_stream(0)
    blocks = [a.malloc(4096 * (i + 1), s) for i in range(n)]
    sides = [stream(rt) for _ in range(n)]
    for b, side in zip(blocks, sides):
        a.record_stream(b, side)
        a.free(b)
    assert sum(len(q) for q in a._pending.values()) == n
    return sides


def _interrupt_call(monkeypatch, backend, name: str, at: int) -> None:
    """Ctrl-C during the ``at``-th call of ``backend.<name>`` (before it does anything)."""
    real = getattr(backend, name)
    calls = [0]

    def interrupted(*args, **kwargs):
        calls[0] += 1
        if calls[0] == at:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(backend, name, interrupted)


@pytest.mark.parametrize("at", [1, 2, 3])
def test_an_interrupt_while_empty_cache_waits_for_events_leaves_the_books_whole(backend, monkeypatch, at):
    """empty_cache waited for the pending frees' events one by one and dropped the
    whole queue only at the end: a KeyboardInterrupt in a wait left the events it had
    already pooled (and the blocks it had already freed) queued as well, so an event
    was handed out twice and a block's event count went negative (never freed)."""
    rt = Runtime(backend)
    a = DeviceAllocator(backend, 0, AllocatorConfig())
    sides = _pending_frees(backend, a, rt, 3)
    _interrupt_call(monkeypatch, backend, "event_synchronize", at)
    with pytest.raises(KeyboardInterrupt):
        a.empty_cache()
    monkeypatch.undo()
    check_invariants(a)
    a.empty_cache()
    check_invariants(a)
    assert a.stats()["reserved_bytes.all.current"] == 0
    a.free(a.malloc(4096, rt.default_stream(0)))
    check_invariants(a)
    del sides


@pytest.mark.parametrize("call", ["event_create", "event_record"])
def test_an_interrupt_while_free_records_events_leaves_the_books_whole(backend, monkeypatch, call):
    """free() of a block other streams used took the block's stream uses, then made
    and recorded an event per stream: a KeyboardInterrupt in event_create left the
    block pending with no event, on no list: its memory was never reused nor given back."""
    rt = Runtime(backend)
    a = DeviceAllocator(backend, 0, AllocatorConfig())
    s = rt.default_stream(0)
    b = a.malloc(4096, s)
    sides = [stream(rt), stream(rt)]
    for side in sides:
        a.record_stream(b, side)
    _interrupt_call(monkeypatch, backend, call, 1)
    with pytest.raises(KeyboardInterrupt):
        a.free(b)
    monkeypatch.undo()
    a.empty_cache()
    check_invariants(a)
    assert a.stats()["active.all.current"] == 0
    assert a.stats()["reserved_bytes.all.current"] == 0
    a.free(a.malloc(4096, s))
    check_invariants(a)


def test_an_allocation_short_of_memory_takes_back_what_a_dropped_pool_could_not_give():
    """A dropped pool's allocator whose stream still ran gave nothing back (its release
    must not wait for the device): an allocation of the device short of memory, which
    may wait, finishes that release instead of failing."""
    import accel.allocator._caching as caching

    backend = CpuBackend(1, 4 * MiB)
    rt = Runtime(backend)
    s = stream(rt)
    orphan = make(backend)
    blocks = [orphan.malloc(MiB, s) for _ in range(3)]  # two 2 MiB segments: the whole device
    for b in blocks:
        orphan.free(b)
    gate = threading.Event()
    backend.launch_host_func(0, s.native_handle, lambda: gate.wait(10))
    orphan.release_when_idle()  # what the MemPool's finalizer calls
    assert orphan.stats()["reserved_bytes.all.current"] == 4 * MiB, "s still runs: nothing went"
    assert orphan in caching._orphans
    threading.Timer(0.2, gate.set).start()
    main = make(backend)
    b = main.malloc(MiB, rt.default_stream(0))  # waits for s, then takes the orphan's memory
    assert orphan.stats()["reserved_bytes.all.current"] == 0
    assert orphan not in caching._orphans
    main.free(b)
    check_invariants(main)
    check_invariants(orphan)


def _orphan_holding_the_device(backend, rt):
    """A dropped pool's allocator holding the whole 4 MiB device (two 2 MiB segments)
    that its release could not give back (its stream still ran then); the stream
    is idle again when this returns."""
    import accel.allocator._caching as caching

    s = stream(rt)
    orphan = make(backend)
    blocks = [orphan.malloc(MiB, s) for _ in range(3)]
    for b in blocks:
        orphan.free(b)
    gate = threading.Event()
    backend.launch_host_func(0, s.native_handle, lambda: gate.wait(10))
    orphan.release_when_idle()  # what the MemPool's finalizer calls
    gate.set()
    s.synchronize()
    assert orphan in caching._orphans and orphan.stats()["reserved_bytes.all.current"] == 4 * MiB
    return orphan, s


def _hold_lock(alloc: DeviceAllocator, seconds: float) -> threading.Thread:
    """Another thread holds ``alloc``'s lock for ``seconds`` (as one giving a dropped
    pool's memory back does while it waits for the device); returns once it holds it."""
    held = threading.Event()

    def hold() -> None:
        with alloc._lock:
            held.set()
            time.sleep(seconds)

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(10)
    return thread


def test_an_allocation_short_of_memory_waits_for_a_dropped_pool_another_thread_holds():
    """An allocation short of memory skipped a dropped pool's allocator whose lock another
    thread held (eight threads dropping pools on the simulated CUDA driver: OutOfMemoryError
    in 9 of 20 runs, saying 0 bytes reserved): it waits for that thread, then takes the memory."""
    import accel.allocator._caching as caching

    backend = CpuBackend(1, 4 * MiB)
    rt = Runtime(backend)
    orphan, _ = _orphan_holding_the_device(backend, rt)
    holder = _hold_lock(orphan, 0.3)
    main = make(backend)
    start = time.monotonic()
    b = main.malloc(MiB, rt.default_stream(0))
    assert time.monotonic() - start >= 0.2, "it waited for the holder"
    holder.join()
    assert orphan.stats()["reserved_bytes.all.current"] == 0
    assert orphan not in caching._orphans
    main.free(b)
    check_invariants(main)
    check_invariants(orphan)


def test_a_dropped_pool_that_allocates_waits_for_no_other_dropped_pool(monkeypatch):
    """An allocator whose pool was dropped, allocating (through a reference the caller kept),
    waits for no other dropped pool's lock: two such would wait for each other."""
    import accel.allocator._caching as caching

    monkeypatch.setattr(caching, "ORPHAN_WAIT_S", 30.0)
    backend = CpuBackend(1, 4 * MiB)
    rt = Runtime(backend)
    orphan, _ = _orphan_holding_the_device(backend, rt)
    caller = make(backend)
    caller.release_when_idle()  # dropped too, still allocating
    holder = _hold_lock(orphan, 2.0)
    start = time.monotonic()
    with pytest.raises(OutOfMemoryError):
        caller.malloc(MiB, rt.default_stream(0))
    assert time.monotonic() - start < 1.5
    holder.join()
    backend.device_synchronize(0)
    caching.release_orphans(backend, 0)
    assert orphan not in caching._orphans


def test_the_out_of_memory_message_counts_what_dropped_pools_hold(monkeypatch):
    """The error named only the failing allocator's memory: '0 bytes is reserved by accel'
    while dropped pools held the whole device. It names theirs; and the wait for a dropped
    pool another thread holds is bounded (ORPHAN_WAIT_S)."""
    import accel.allocator._caching as caching

    monkeypatch.setattr(caching, "ORPHAN_WAIT_S", 0.2)
    backend = CpuBackend(1, 4 * MiB)
    rt = Runtime(backend)
    orphan, _ = _orphan_holding_the_device(backend, rt)
    holder = _hold_lock(orphan, 2.0)
    main = make(backend)
    start = time.monotonic()
    with pytest.raises(OutOfMemoryError) as info:
        main.malloc(MiB, rt.default_stream(0))
    assert time.monotonic() - start < 1.5, "the wait is bounded"
    holder.join()
    details = info.value.details  # type: ignore[attr-defined]
    assert (details.reserved, details.dropped_pools, details.dropped_pools_allocated) == (0, 4 * MiB, 0)
    assert "Dropped MemPools of this device still reserve 4.00 MiB, of which 0 bytes is allocated" in str(info.value)
    main.free(main.malloc(MiB, rt.default_stream(0)))  # the holder is gone: the memory comes back
    assert orphan not in caching._orphans
    check_invariants(main)


def test_the_out_of_memory_message_counts_the_buffers_of_dropped_pools():
    """A dropped pool whose buffers live keeps their segments: the error says so."""
    import accel.allocator._caching as caching

    backend = CpuBackend(1, 4 * MiB)
    rt = Runtime(backend)
    s = stream(rt)
    orphan = make(backend)
    kept = orphan.malloc(MiB, s)
    for b in [orphan.malloc(MiB, s) for _ in range(2)]:
        orphan.free(b)  # cached: half the first segment, the whole second
    orphan.release_when_idle()  # a buffer lives: everything stays until it is freed
    main = make(backend)
    with pytest.raises(OutOfMemoryError) as info:
        main.malloc(MiB, rt.default_stream(0))
    details = info.value.details  # type: ignore[attr-defined]
    assert (details.reserved, details.dropped_pools, details.dropped_pools_allocated) == (0, 4 * MiB, MiB)
    assert "Buffers of dropped MemPools hold 1.00 MiB" in str(info.value)
    orphan.free(kept)  # the last buffer: the pool's memory goes back
    assert orphan not in caching._orphans and orphan.stats()["reserved_bytes.all.current"] == 0
    main.free(main.malloc(MiB, rt.default_stream(0)))
    check_invariants(main)


def test_a_pool_dropped_while_another_thread_frees_into_it_is_not_forgotten():
    """A dropped pool's finalizer that found the lock taken left the release to the
    free under way, but that free may have read the dropped flag before it was set
    (the fast path then releases nothing): the memory stayed cached for good. The
    pool is noted as an orphan, so the device's next empty_cache takes it back."""
    import accel.allocator._caching as caching

    backend = CpuBackend(1, 4 * MiB)
    rt = Runtime(backend)
    s = stream(rt)
    orphan = make(backend)
    orphan.free(orphan.malloc(MiB, s))  # cached: a 2 MiB segment, nothing allocated
    holder = _hold_lock(orphan, 0.3)  # as the free that read the flag too early
    orphan.release_when_idle()  # what the MemPool's finalizer calls: the lock is taken
    holder.join()
    assert orphan in caching._orphans
    caching.release_orphans(backend, 0)  # what the device's empty_cache does
    assert orphan.stats()["reserved_bytes.all.current"] == 0
    assert orphan not in caching._orphans
    check_invariants(orphan)


# -- the lock-free common pair --------------------------------------------------------------


class _NoLock:
    """Stands in for an allocator's lock that the common pair must not take."""

    owner = 0  # held by no thread (free() reads it: see OwnedLock)

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        raise AssertionError("the common pair took the allocator's lock")

    release = __enter__ = __exit__ = acquire


def test_common_pair_takes_no_lock_and_refuses_bad_frees_as_the_locked_path(host):
    backend, rt = host
    a, other = make(backend), make(backend)
    s = rt.default_stream(0)
    a.free(a.malloc(100, s))  # the first pair, locked, finds the allocator plain
    c = other.malloc(100, s)
    lock, a._lock = a._lock, _NoLock()
    try:
        b = a.malloc(100, s)
        a.free(b)
        fresh = a.malloc(100, s)  # the same memory again: b is a stale handle of it
        b2 = a.malloc(100, s)
        a.free_from_finalizer(b2)
    finally:
        a._lock = lock
    assert fresh.ptr == b.ptr and b.state == RETIRED
    # refusals take the locked path, and say what the locked path says
    with pytest.raises(InvalidHandleError, match="freed twice"):
        a.free(b)
    a.free_from_finalizer(b)  # a collected stale handle: nothing to do
    with pytest.raises(InvalidHandleError, match="another allocator"):
        a.free(c)
    with pytest.raises(InvalidHandleError, match="another allocator"):
        a.free_from_finalizer(c)
    a.free(fresh)  # still its owner's
    other.free(c)
    assert a.stats()["allocated_bytes.all.current"] == 0
    check_invariants(a)


def test_pair_takes_the_lock_while_history_records(host):
    backend, rt = host
    a = make(backend)
    s = rt.default_stream(0)
    a.free(a.malloc(100, s))
    a.record_history(History("all", "all", "python", 100))
    lock, a._lock = a._lock, _NoLock()
    try:
        with pytest.raises(AssertionError, match="took the allocator's lock"):
            a.malloc(100, s)
    finally:
        a._lock = lock
    a.free(a.malloc(100, s))
    assert [e["action"] for e in a.trace()][-3:] == ["alloc", "free_requested", "free_completed"]


def test_lock_free_and_locked_frees_mixed_across_threads(host):
    """Threads pair on one allocator while others turn history on and off and use
    blocks on other streams (the locked paths), and two threads race to free each of
    a set of handles: every handle is freed once, the other free refused."""
    backend, rt = host
    a = make(backend)
    s, s2 = rt.default_stream(0), stream(rt)

    def pairs(seed: int) -> None:
        for i in range(2000):
            b = a.malloc(512 * (1 + (seed + i) % 7), s)
            if i % 11 == 0:
                a.record_stream(b, s2)
            (a.free if i % 2 else a.free_from_finalizer)(b)

    def toggle() -> None:
        a.record_history(History("all", "all", "python", 10))
        a.record_history(None)

    shared = [a.malloc(512, s) for _ in range(400)]
    freed = [0] * len(shared)
    workers = [functools.partial(pairs, k) for k in range(3)] + [free_each(a.free, shared, freed) for _ in range(2)]
    assert run_while_toggling(workers, toggle) == []
    assert freed == [1] * len(shared)
    s2.synchronize()
    a.empty_cache()  # orders the frees still pending on s2
    assert a.stats()["allocated_bytes.all.current"] == 0
    assert not a._live
    check_invariants(a)
