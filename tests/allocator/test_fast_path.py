"""The allocate/free fast paths leave exactly the books the named steps leave.

Two allocators replay the same random sequence, one with its fast paths
switched off; after every step their blocks, statistics and snapshots agree.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accel._runtime import Runtime
from accel.allocator._caching import DeviceAllocator
from accel.allocator.config import parse
from accel.backends.cpu import CpuBackend
from tests.allocator.test_caching import check_invariants

MiB = 1 << 20

steps = st.lists(
    st.one_of(
        st.tuples(st.just("a"), st.one_of(st.integers(1, 4096), st.integers(4097, 2 * MiB), st.integers(2 * MiB, 30 * MiB))),
        st.tuples(st.just("f"), st.integers(0, 1 << 16)),
    ),
    min_size=1,
    max_size=60,
)


def _layout(alloc: DeviceAllocator) -> list:
    out = []
    for seg in alloc.snapshot():
        base = seg["address"]
        out.append([(b["address"] - base, b["size"], b["state"]) for b in seg["blocks"]])
    return sorted(out)


@settings(max_examples=60, deadline=None)
@given(config=st.sampled_from(["", "max_split_size_mb:24", "expandable_segments:True"]), script=steps)
def test_fast_and_named_steps_agree(config: str, script: list) -> None:
    pairs = []
    for fast in (True, False):
        backend = CpuBackend(1, None)
        alloc = DeviceAllocator(backend, 0, parse(config or "expandable_segments:False"))
        if not fast:
            alloc._fast = False  # malloc and free take the named steps only
        pairs.append((alloc, Runtime(backend).default_stream(0), []))
    for op, arg in script:
        for alloc, stream, live in pairs:
            if op == "a":
                live.append(alloc.malloc(arg, stream))
            elif live:
                alloc.free(live.pop(arg % len(live)))
        (fa, _, fl), (sa, _, sl) = pairs
        assert [b.size for b in fl] == [b.size for b in sl]
        assert fa.stats() == sa.stats()
        assert _layout(fa) == _layout(sa)
        check_invariants(fa)
    for alloc, _, live in pairs:
        for b in live:
            alloc.free(b)
        alloc.empty_cache()


@pytest.mark.parametrize("holes", [0, 1, 10])
@pytest.mark.parametrize("size", [1, 4096, 3 * MiB])
def test_cached_pairs_take_the_fast_paths(holes: int, size: int) -> None:
    """An allocate+free pair of a cached size, with ``holes`` free 4 KiB blocks cached
    between allocated ones, never reaches the named steps (it cuts the segment's rest
    or a hole, takes a hole whole, merges into the free rest or stands in for a hole)
    and leaves the books the named steps leave."""
    pairs = []
    for fast in (True, False):
        backend = CpuBackend(1, None)
        alloc = DeviceAllocator(backend, 0, parse("expandable_segments:False"))
        if not fast:
            alloc._fast = False
        stream = Runtime(backend).default_stream(0)
        blocks = [alloc.malloc(4096, stream) for _ in range(2 * holes)]
        for b in blocks[::2]:
            alloc.free(b)
        alloc.free(alloc.malloc(size, stream))  # the segment a large size needs
        pairs.append((alloc, stream, blocks[1::2]))
    fast_alloc = pairs[0][0]

    def named_step(*args: object) -> None:
        raise AssertionError("the pair left the fast path")

    fast_alloc._malloc_steps = named_step  # type: ignore[method-assign]
    fast_alloc._free_block = named_step  # type: ignore[method-assign]
    for _ in range(3):
        for give_back in ("free", "free_from_finalizer"):
            # free_from_finalizer is how a Buffer (a tensor of accel.empty) that
            # dies without free() gives its block back: the same fast paths.
            for alloc, stream, _kept in pairs:
                getattr(alloc, give_back)(alloc.malloc(size, stream))
            (fa, _, _), (sa, _, _) = pairs
            assert fa.stats() == sa.stats()
            assert _layout(fa) == _layout(sa)
            check_invariants(fa)
