"""The native allocator core (csrc/accel_core.c) against a small reference model.

The model is not a second allocator: it knows only what callers and the upstream
can see (the live allocations, the segments the upstream handed out and took back)
and checks every property the core must keep after each step: blocks lie in live
segments of their stream and pool, never overlap, tile their segments exactly; the
sizes are PyTorch's rounding (with power-of-two divisions too); every statistic equals
what the model counts, held blocks (freed, their reuse waiting) active but not
allocated; a freed address cannot be freed again; empty_cache gives back exactly the
wholly free segments of the pools not kept, release_pool those of one pool, and
nothing goes back while the core is frozen; a destroyed stream's memory is re-keyed.
With expandable segments on (and off again) too: each expandable segment is a
reservation the upstream has out, its pages mapped exactly under its mapped blocks,
empty_cache gives back exactly the whole free pages, and a growth never gives back
the pages of a stream that is not idle.
"""

from __future__ import annotations

import gc
import shutil
import subprocess
import threading
import weakref
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from accel._errors import InvalidValueError, OutOfMemoryError
from accel.allocator import BackendResource, LimitingAdaptor, StatisticsAdaptor
from accel.allocator._caching import round_size
from accel.allocator._native_core import GIL_MODE, GIVE_BACK_FIRST, NO_RETRY, NativeCore, core_module
from accel.backends.cpu import CpuBackend

KB = 512
SMALL = 1 << 20
MiB = 1 << 20
PAGE = 2 * MiB  # expandable segments' page
RESERVATION = 1 << 30  # and reservation (no fragmentation of it fills it before the limit)


def rounded(n: int, divisions: tuple[int, ...] = (0,) * 16) -> int:
    slot = n.bit_length() - 21
    return round_size(n, divisions[min(max(slot, 0), 15)])


def segment_size(size: int, large_segment: int = 20 * MiB) -> int:
    if size <= SMALL:
        return 2 * MiB
    if size < 10 * MiB:
        return large_segment
    return -(-size // (2 * MiB)) * (2 * MiB)


class Upstream(StatisticsAdaptor):
    """Records the segments it handed out and took back (and the reservations)."""

    def __init__(self, limit: int) -> None:
        self.limiting = LimitingAdaptor(BackendResource(CpuBackend(1, None), 0), limit)
        super().__init__(self.limiting)
        self.live: dict[int, int] = {}
        self.reservations: dict[int, int] = {}

    def vm_reserve(self, nbytes: int) -> int:
        va = super().vm_reserve(nbytes)
        self.reservations[va] = nbytes
        return va

    def vm_free(self, addr: int, nbytes: int) -> None:
        assert self.reservations.pop(addr) == nbytes
        super().vm_free(addr, nbytes)

    def allocate(self, nbytes: int) -> int:
        ptr = super().allocate(nbytes)
        self.live[ptr] = nbytes
        return ptr

    def deallocate(self, ptr: int, nbytes: int) -> None:
        assert self.live.pop(ptr) == nbytes
        super().deallocate(ptr, nbytes)


sizes = st.one_of(
    st.integers(1, 4096), st.integers(4096, SMALL), st.integers(SMALL + 1, 12 * MiB), st.sampled_from([512, 1 << 20])
)


class CoreModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.upstream = Upstream(96 * MiB)
        self.events: dict[str, int] = {}
        self.busy: set[int] = set()  # streams with queued work
        self.core = NativeCore(self.upstream, notify=self._event, idle=lambda stream: stream not in self.busy)
        self.expandable = False
        self.max_split: int | None = None
        self.divisions = (0,) * 16
        # ptr -> (requested, size, stream, pool): allocated, and held (freed, reuse waiting)
        self.live: dict[int, tuple[int, int, int, int]] = {}
        self.held: dict[int, tuple[int, int, int, int]] = {}
        self.freed: set[int] = set()
        self.ooms = 0
        self.kept: set[int] = set()
        self.frozen = False
        self.next_key = 1 << 40  # retired streams' keys: never a stream's

    @rule(
        max_split=st.sampled_from([None, 4 * MiB, 12 * MiB]),
        divisions=st.sampled_from([(0,) * 16, (4,) * 16, (1, 2, 4, 8, 16, 1, 2, 4, 8, 16, 1, 2, 4, 8, 16, 1)]),
    )
    def configure(self, max_split: int | None, divisions: tuple[int, ...]) -> None:
        # blocks may be live: the core counts the oversize ones again under the new bound
        self.core.empty_cache()
        self.max_split = max_split
        self.divisions = divisions
        self.core.configure(max_split, 20 * MiB, 20 * MiB)
        self.core.set_divisions(divisions)

    def _event(self, event: str, ptr: int, size: int) -> None:
        self.events[event] = self.events.get(event, 0) + 1

    @rule(on=st.booleans(), keep_free=st.sampled_from([0, 0, 4 * MiB]))
    def set_expandable(self, on: bool, keep_free: int) -> None:
        """Live blocks stay where they are; off, free expandable blocks are not reused."""
        self.core.set_expandable(on, PAGE, RESERVATION, keep_free)
        self.expandable = on

    @rule(stream=st.sampled_from([0, 7]), busy=st.booleans())
    def stream_busy(self, stream: int, busy: bool) -> None:
        (self.busy.add if busy else self.busy.discard)(stream)

    def _busy_pages(self) -> set[int]:
        """The mapped pages of the expandable segments of streams with queued work."""
        pages = self.core._callbacks.pages
        return {
            p for b in self.core.blocks() if b["expandable"] and b["stream"] in self.busy and b["mapped"]
            for p in pages if b["ptr"] <= p < b["ptr"] + b["size"]
        }  # fmt: skip

    @rule(
        nbytes=sizes,
        stream=st.sampled_from([0, 7]),
        pool=st.sampled_from([0, 0, 3]),
        flags=st.sampled_from([0, 0, NO_RETRY, GIVE_BACK_FIRST]),
    )
    def malloc(self, nbytes: int, stream: int, pool: int, flags: int) -> None:
        busy = self._busy_pages() if flags == NO_RETRY else set()
        try:
            ptr, size = self.core.malloc(nbytes, stream, pool, flags)
        except OutOfMemoryError:
            if flags != NO_RETRY:
                self.ooms += 1
            if not (flags == NO_RETRY or self.frozen):
                # refused only when even a fresh segment (or the pages) does not fit
                # beside what is allocated, held or in kept pools
                want = rounded(nbytes, self.divisions)
                need = -(-want // PAGE) * PAGE if self.expandable else segment_size(want)
                assert self.upstream.limiting.held + need > 96 * MiB
            return
        # a growth gives back only idle streams' pages (NO_RETRY: the cache stays)
        assert busy <= self._busy_pages()
        want = rounded(nbytes, self.divisions)
        assert size >= want
        (seg,) = {b["expandable"] for b in self.core.blocks() if b["ptr"] == ptr}
        if seg:  # any rest worth a block is cut in an expandable segment
            assert size - want < KB
        elif size > want:  # not cut: the rest was too small to keep, or the block oversize
            rest = size - want
            small = want <= SMALL
            oversize = self.max_split is not None and want >= self.max_split
            assert rest < KB or (not small and (rest <= SMALL or oversize))
        assert ptr not in self.live and ptr not in self.held
        self.live[ptr] = (nbytes, size, stream, pool)
        self.freed.discard(ptr)

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def hold(self, data: st.DataObject) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        self.core.hold(ptr)
        self.held[ptr] = self.live.pop(ptr)
        with pytest.raises(InvalidValueError, match="not allocated"):
            self.core.free(ptr)  # held is not allocated
        assert self.core.allocated_size(ptr) is None

    @rule(data=st.data())
    @precondition(lambda self: self.held)
    def release_held(self, data: st.DataObject) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.held)))
        self.core.release_held(ptr)
        del self.held[ptr]
        self.freed.add(ptr)
        with pytest.raises(InvalidValueError, match="not a block this allocator core holds"):
            self.core.release_held(ptr)

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def release_held_of_an_allocated_block(self, data: st.DataObject) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        with pytest.raises(InvalidValueError, match="not a block this allocator core holds"):
            self.core.release_held(ptr)

    @rule(keep=st.booleans())
    def keep_pool(self, keep: bool) -> None:
        self.core.keep_pool(3, keep)
        if keep:
            self.kept.add(3)
        else:
            self.kept.discard(3)

    @rule(frozen=st.booleans())
    def freeze(self, frozen: bool) -> None:
        self.core.freeze(frozen)
        self.frozen = frozen

    @rule(threshold=st.sampled_from([0, 8 * MiB, 40 * MiB]))
    def gc_threshold(self, threshold: int) -> None:
        self.core.set_gc_threshold(threshold)

    @rule(old=st.sampled_from([0, 7]))
    def rekey_stream(self, old: int) -> None:
        """A stream destroyed: what it keyed moves to a new key; a later malloc on the
        handle (a new stream that got it) gets none of that memory."""
        key = self.next_key
        self.next_key += 1
        segments = {b["segment"] for b in self.core.blocks() if b["stream"] == old}
        assert self.core.rekey_stream(old, key) == len(segments)
        for table in (self.live, self.held):
            for ptr, (n, size, stream, pool) in list(table.items()):
                if stream == old:
                    table[ptr] = (n, size, key, pool)
        assert not any(b["stream"] == old for b in self.core.blocks())

    @rule()
    def release_pool(self) -> None:
        blocks = self.core.blocks()
        whole = {b["segment"] for b in blocks if b["pool"] == 3 and self._wholly_free(b)}
        pages = self._free_pages([b for b in blocks if b["pool"] == 3])
        given = self.core.release_pool(3)
        assert given == (0 if self.frozen else sum(b["segment_size"] for b in blocks if b["segment"] in whole) + pages)
        assert self.core.pool_segments(3) == len({b["segment"] for b in self.core.blocks() if b["pool"] == 3})

    @staticmethod
    def _wholly_free(b: dict[str, int]) -> bool:
        return not b["expandable"] and not b["allocated"] and not b["held"] and b["size"] == b["segment_size"]

    @staticmethod
    def _free_pages(blocks: list[dict[str, int]]) -> int:
        """The bytes of the whole pages of the free blocks of expandable segments."""
        total = 0
        for b in blocks:
            if b["expandable"] and b["mapped"] and not b["allocated"] and not b["held"]:
                first = -(-(b["ptr"] - b["segment"]) // PAGE) * PAGE
                last = (b["ptr"] + b["size"] - b["segment"]) // PAGE * PAGE
                total += max(0, last - first)
        return total

    @rule(data=st.data())
    @precondition(lambda self: self.live)
    def free(self, data: st.DataObject) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.live)))
        self.core.free(ptr)
        del self.live[ptr]
        self.freed.add(ptr)

    @rule(data=st.data())
    @precondition(lambda self: self.freed)
    def free_twice(self, data: st.DataObject) -> None:
        ptr = data.draw(st.sampled_from(sorted(self.freed)))
        if ptr in self.live:
            return
        with pytest.raises(InvalidValueError, match="not allocated"):
            self.core.free(ptr)

    @rule()
    def empty_cache(self) -> None:
        blocks = self.core.blocks()
        whole = {b["segment"] for b in blocks if self._wholly_free(b) and b["pool"] not in self.kept}
        pages = self._free_pages([b for b in blocks if b["pool"] not in self.kept])
        given = self.core.empty_cache()
        if self.frozen:
            assert given == 0
            return
        assert given == sum(b["segment_size"] for b in blocks if b["segment"] in whole) + pages
        assert not any(b["expandable"] and not b["mapped"] and b["size"] == b["segment_size"] for b in self.core.blocks())
        assert not whole & set(self.upstream.live)
        kept = {b["segment"] for b in blocks if b["pool"] in self.kept}
        assert kept <= set(self.upstream.live) | set(self.upstream.reservations)

    @invariant()
    def books_match_the_model(self) -> None:
        blocks = self.core.blocks()
        segments: dict[int, list[dict[str, int]]] = {}
        for b in blocks:
            segments.setdefault(b["segment"], []).append(b)
        # the core's segments are exactly those the upstream has out (and reserved)
        plain = {base: bs for base, bs in segments.items() if not bs[0]["expandable"]}
        expandable = {base: bs for base, bs in segments.items() if bs[0]["expandable"]}
        assert {base: bs[0]["segment_size"] for base, bs in plain.items()} == self.upstream.live
        assert {base: bs[0]["segment_size"] for base, bs in expandable.items()} == self.upstream.reservations
        # an expandable segment's pages are mapped exactly under its mapped blocks
        pages = self.core._callbacks.pages
        under = set()
        for base, bs in expandable.items():
            for b in bs:
                first = base + (b["ptr"] - base) // PAGE * PAGE
                if b["mapped"]:
                    under.update(range(first, b["ptr"] + b["size"], PAGE))
                else:
                    assert (b["ptr"] - base) % PAGE == 0 and b["size"] % PAGE == 0
        assert under == set(pages)
        allocated, held = {}, {}
        for base, bs in segments.items():
            bs.sort(key=lambda b: b["ptr"])
            end = base
            for b in bs:  # tiled exactly, in one stream and pool
                assert b["ptr"] == end and b["size"] > 0
                assert (b["stream"], b["pool"]) == (bs[0]["stream"], bs[0]["pool"])
                end += b["size"]
                if b["allocated"] or b["held"]:
                    (allocated if b["allocated"] else held)[b["ptr"]] = (
                        b["requested"], b["size"], b["stream"], b["pool"]
                    )
            assert end == base + bs[0]["segment_size"]
            for a, b in zip(bs, bs[1:]):  # free (and unmapped) neighbours are always merged
                assert a["allocated"] or a["held"] or b["allocated"] or b["held"] or a["mapped"] != b["mapped"]
        assert allocated == self.live
        assert held == self.held
        s = self.core.stats()
        small = [v for v in self.live.values() if v[1] <= SMALL]  # small blocks are never above 1 MiB
        seg_small = [bs for bs in plain.values() if bs[0]["small"]]
        split_free = [  # (not counted in expandable segments)
            b for bs in plain.values() if len(bs) > 1 for b in bs if not b["allocated"] and not b["held"]
        ]
        active = list(self.live.values()) + list(self.held.values())
        assert s["allocation.all.current"] == len(self.live)
        assert s["active.all.current"] == len(active)
        assert s["allocated_bytes.all.current"] == sum(v[1] for v in self.live.values())
        assert s["active_bytes.all.current"] == sum(v[1] for v in active)
        assert s["requested_bytes.all.current"] == sum(v[0] for v in active)
        assert s["allocation.small_pool.current"] == len(small)
        assert s["segment.all.current"] == len(plain)
        assert s["segment.small_pool.current"] == len(seg_small)
        assert s["reserved_bytes.all.current"] == sum(self.upstream.live.values()) + len(pages) * PAGE
        assert s["inactive_split.all.current"] == len(split_free)
        assert s["inactive_split_bytes.all.current"] == sum(b["size"] for b in split_free)
        assert s["num_ooms"] == self.ooms
        assert s["allocated_bytes.all.peak"] >= s["allocated_bytes.all.current"]
        events = self.events
        assert s["num_device_alloc"] == events.get("segment_alloc", 0) + events.get("segment_map", 0)
        assert s["num_device_free"] == events.get("segment_free", 0) + events.get("segment_unmap", 0)
        if self.max_split is not None:
            assert s["oversize_allocations.current"] == sum(1 for v in self.live.values() if v[1] >= self.max_split)

    def teardown(self) -> None:
        for ptr in list(self.live):
            self.core.free(ptr)
        for ptr in list(self.held):
            self.core.release_held(ptr)
        self.core.freeze(False)
        self.core.keep_pool(3, False)
        self.core.empty_cache()
        assert not self.upstream.live and not self.upstream.reservations


TestCoreModel = CoreModel.TestCase
TestCoreModel.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_core_declares_itself_gil_free() -> None:
    assert core_module().lib.accel_core_gil_free() == 1
    assert GIL_MODE == "not used"


def test_threads_share_one_core() -> None:
    """Python threads (the GIL let go around each call) allocate and free at once;
    the books end empty and every segment goes back."""
    upstream = Upstream(1 << 40)
    core = NativeCore(upstream)
    errors: list[BaseException] = []

    def work(stream: int) -> None:
        try:
            for i in range(300):
                ptrs = [core.malloc(512 * (1 + (i * 7 + k) % 40), stream)[0] for k in range(8)]
                for ptr in ptrs:
                    core.free(ptr)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t % 2,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    s = core.stats()
    assert s["allocation.all.current"] == 0 and s["allocation.all.allocated"] == 4 * 300 * 8
    core.empty_cache()
    assert not upstream.live


def test_an_upstream_error_reaches_the_caller() -> None:
    """Not an out-of-memory refusal: the upstream's own exception, raised by malloc."""

    class Broken(Upstream):
        def allocate(self, nbytes: int) -> int:
            raise ZeroDivisionError("driver fault")

    core = NativeCore(Broken(1 << 30))
    with pytest.raises(ZeroDivisionError, match="driver fault"):
        core.malloc(100, 0)


@pytest.mark.parametrize("error", [KeyboardInterrupt, ZeroDivisionError])
def test_an_upstream_error_stops_the_miss(error: type[BaseException]) -> None:
    """Not a shortage (an interrupt, a driver fault): the malloc raises it at once; the
    cache is not given back to ask again (which could succeed and swallow it), no
    out-of-memory is counted, and the next malloc sees no stale error."""

    class Once(Upstream):
        fail = False

        def allocate(self, nbytes: int) -> int:
            if self.fail:
                self.fail = False
                raise error("once")
            return super().allocate(nbytes)

    upstream = Once(1 << 30)
    core = NativeCore(upstream)
    ptr, _ = core.malloc(100, 0)
    core.free(ptr)  # a cached segment, which a give-back of the cache would take
    upstream.fail = True
    with pytest.raises(error, match="once"):
        core.malloc(30 * MiB, 0)
    stats = core.stats()
    assert stats["segment.all.current"] == 1 and stats["num_alloc_retries"] == 0 and stats["num_ooms"] == 0
    ptr, _ = core.malloc(30 * MiB, 0)
    core.free(ptr)
    assert core.empty_cache() == 32 * MiB and not upstream.live


def test_a_refusal_nobody_raises_goes_with_its_thread() -> None:
    """torch's threads reach the upstream through accel_torch_alloc, which returns NULL
    on a refusal and never raises it: what the upstream raised must not outlive the
    thread (it was kept per thread id for the life of the process)."""
    refused: list[weakref.ref[BaseException]] = []

    class Refusing(Upstream):
        def allocate(self, nbytes: int) -> int:
            exc = OutOfMemoryError("refused", requested=nbytes, device=0)
            refused.append(weakref.ref(exc))
            raise exc

    core = NativeCore(Refusing(1 << 30))
    module = core_module()
    ffi, lib = module.ffi, module.lib
    device = lib.ACCEL_CORE_MAX_DEVICES - 1  # a slot no test's runtime serves
    old = lib.accel_core_register_torch(device, core._core)
    try:
        threads = [
            threading.Thread(target=lambda: results.append(lib.accel_torch_alloc(4096, device, ffi.NULL)))
            for _ in range(8)
        ]
        results: list[object] = []
        for t in threads:
            t.start()
            t.join()
    finally:
        lib.accel_core_register_torch(device, old)
    assert results == [ffi.NULL] * 8 and len(refused) >= 8
    gc.collect()
    assert [ref for ref in refused if ref() is not None] == []
    # a refusal on this thread is still raised by this thread's malloc
    with pytest.raises(OutOfMemoryError, match=r"4096 bytes refused \(refused\)"):
        core.malloc(4096, 0)


def test_bad_sizes() -> None:
    core = NativeCore(Upstream(1 << 30))
    for n in (0, -1, 1 << 60):
        with pytest.raises(InvalidValueError, match="cannot allocate"):
            core.malloc(n, 0)


def test_an_upstream_free_error_reaches_empty_cache() -> None:
    """Giving memory back failed: empty_cache raises it (not a traceback printed by the
    callback), and the segment is out of the books (the upstream has it)."""

    class Refusing(Upstream):
        def deallocate(self, ptr: int, nbytes: int) -> None:
            super().deallocate(ptr, nbytes)
            raise ZeroDivisionError("driver fault on free")

    core = NativeCore(Refusing(1 << 30))
    ptr, _ = core.malloc(100, 0)
    core.free(ptr)
    with pytest.raises(ZeroDivisionError, match="driver fault on free"):
        core.empty_cache()
    assert core.stats()["segment.all.current"] == 0
    assert core.empty_cache() == 0


def test_resets() -> None:
    """reset_peak sets peaks to the current values; reset_accumulated zeroes the
    allocated and freed totals and the counters, and they count on from there."""
    core = NativeCore(Upstream(1 << 30))
    ptrs = [core.malloc(1000, 0)[0] for _ in range(3)]
    core.free(ptrs.pop())
    core.reset_peak()
    s = core.stats()
    assert s["allocation.all.peak"] == s["allocation.all.current"] == 2
    assert s["allocated_bytes.small_pool.peak"] == 2048
    core.reset_accumulated()
    s = core.stats()
    assert s["allocation.all.allocated"] == s["allocation.all.freed"] == s["num_device_alloc"] == 0
    assert s["allocation.all.current"] == 2 and s["reserved_bytes.all.current"] == 2 << 20
    core.free(ptrs.pop())
    core.malloc(1000, 1)
    s = core.stats()
    assert (s["allocation.all.allocated"], s["allocation.all.freed"], s["num_device_alloc"]) == (1, 1, 1)
    assert s["allocation.all.current"] == 2


STRESS = Path(__file__).with_name("core_stress.c")
CSRC = Path(__file__).resolve().parents[2] / "csrc"


@pytest.mark.parametrize("sanitize", ["thread", "address,undefined"])
def test_the_core_alone_under_threads_and_sanitizers(sanitize: str, tmp_path: Path) -> None:
    """No Python at all: the core's own C under 7 threads (allocations, frees, empty_cache,
    stats and block listings at once, an upstream that refuses now and then), built with
    ThreadSanitizer, then AddressSanitizer and UBSan. Correct without the GIL means this:
    no data race, no memory error, no overlap, and nothing left over."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler")
    exe = tmp_path / "stress"
    build = subprocess.run(
        # -fno-builtin: memcpy and memset stay calls the sanitizers see (inlined, a
        # race in a copy of the statistics went unnoticed)
        [compiler, "-O1", "-g", "-fno-builtin", "-Wall", "-Werror", f"-fsanitize={sanitize}", "-fno-sanitize-recover=all",
         "-pthread", f"-I{CSRC}", str(STRESS), str(CSRC / "accel_core.c"), "-o", str(exe)],
        capture_output=True, text=True,
    )  # fmt: skip
    if build.returncode != 0 and "sanitize" in build.stderr:
        pytest.skip(f"this compiler cannot build with -fsanitize={sanitize}: {build.stderr[-300:]}")
    assert build.returncode == 0, build.stderr
    result = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0 and "Sanitizer" not in result.stderr, result.stdout + result.stderr[-4000:]
    assert "failures 0 allocated 0 reserved-left 0" in result.stdout


def test_a_miss_gives_back_an_oversize_cached_block_before_the_whole_cache() -> None:
    """PyTorch's release_available_cached_blocks: an oversize cached block too large to
    serve the request goes back so the request fits; the other cache stays (no retry)."""
    upstream = Upstream(40 * MiB)
    core = NativeCore(upstream)
    core.configure(4 * MiB, 2 * MiB, 20 * MiB)
    small, _ = core.malloc(1000, 0)
    big, _ = core.malloc(30 * MiB, 0)
    core.free(small)
    core.free(big)
    ptr, size = core.malloc(12 * MiB, 0, flags=NO_RETRY)  # 30 MiB is past 12 + 2: not usable
    assert size == 12 * MiB and big not in upstream.live and small in upstream.live
    s = core.stats()
    assert (s["num_alloc_retries"], s["num_device_free"], s["num_ooms"]) == (0, 1, 0)
    core.free(ptr)
    core.empty_cache()


def test_garbage_collection_gives_back_the_old_blocks_first() -> None:
    """Above the threshold a miss gives back the unsplit cached large blocks at least as
    old (in best-fit searches of the default large pool) as their average, until under it."""
    upstream = Upstream(1 << 30)
    core = NativeCore(upstream)
    core.set_gc_threshold(1 << 40)  # the clock runs; nothing is collected yet
    core.malloc(12 * MiB, 0)
    b, _ = core.malloc(12 * MiB, 0)
    c, _ = core.malloc(14 * MiB, 0)
    core.free(b)
    core.malloc(13 * MiB, 0)  # a search that b cannot serve: b ages by one
    core.free(c)
    core.set_gc_threshold(40 * MiB)  # 52 MiB reserved
    core.malloc(20 * MiB, 0)  # b (age 2) is older than the average (1.5); c (age 1) is not
    assert b not in upstream.live and c in upstream.live
    assert core.stats()["reserved_bytes.all.current"] == 60 * MiB


def test_no_retry_leaves_the_cache_to_the_caller() -> None:
    """NO_RETRY: a refusal returns without giving the cache back (DeviceAllocator has
    steps of its own first); GIVE_BACK_FIRST then gives it back and counts the retry."""
    upstream = Upstream(5 * MiB)
    core = NativeCore(upstream)
    cached, _ = core.malloc(1000, 0)
    core.free(cached)
    core.malloc(1000, 7)
    with pytest.raises(OutOfMemoryError):
        core.malloc(1000, 9, flags=NO_RETRY)
    assert cached in upstream.live
    s = core.stats()
    assert (s["num_alloc_retries"], s["num_ooms"]) == (0, 0)
    core.malloc(1000, 9, flags=GIVE_BACK_FIRST)
    s = core.stats()  # (the upstream may hand the address given back out again)
    assert (s["num_alloc_retries"], s["num_ooms"], s["num_device_free"]) == (1, 0, 1)
    assert {b["stream"] for b in core.blocks()} == {7, 9}
