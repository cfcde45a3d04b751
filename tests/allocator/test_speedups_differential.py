"""The compiled allocator paths (accel/_speedups.c) and the Python ones they stand in
for leave the same books after the same random sequence.

Two allocators in one process replay one seeded sequence of allocations, frees,
record_stream (via the allocator's stream uses), empty_cache and dropped buffers on
several streams: one through the compiled methods, one through the Python functions
in their ``__wrapped__``. Their backends hand out the same made-up addresses (a bump
pointer), so that the best fit's ties, broken by address, break the same way: with
real mmap addresses the two processes of ``ACCEL_PURE_PYTHON=1`` and compiled place
segments differently and pick different but equal blocks.
"""

from __future__ import annotations

import inspect
import random

import pytest

from accel._native import speedups
from accel._runtime import Runtime
from accel.allocator._caching import DeviceAllocator
from accel.allocator.config import parse
from accel.backends.cpu import CpuBackend
from accel.stream import Stream
from tests.allocator.test_caching import check_invariants

pytestmark = pytest.mark.skipif(
    speedups is None, reason="the compiled paths are not loaded in this run"
)

MiB = 1 << 20


class _BumpBackend(CpuBackend):
    """Addresses from a counter: the same in both allocators; nothing is touched."""

    def __init__(self) -> None:
        super().__init__(1, None)
        self._next = 1 << 40

    def malloc(self, device: int, nbytes: int) -> int:
        ptr = self._next
        self._next += (nbytes + MiB - 1) // MiB * MiB + MiB
        return ptr

    def free(self, device: int, ptr: int) -> None:
        pass


def _layout(alloc: DeviceAllocator, streams: list[Stream]) -> list:
    # stream handles come from a process-wide counter: compare the streams' places
    which = {s._handle: i for i, s in enumerate(streams)}
    return [
        (
            seg["address"],
            which[seg["stream"]],
            [
                (b["address"], b["size"], b["state"], b["requested_size"])
                for b in seg["blocks"]
            ],
        )
        for seg in alloc.snapshot()
    ]


def _methods(compiled: bool) -> tuple:
    names = ("malloc", "free", "free_from_finalizer")
    fns = [DeviceAllocator.__dict__[n] for n in names]
    assert not any(inspect.isfunction(fn) for fn in fns)  # the compiled stand-ins
    return tuple(fn if compiled else fn.__wrapped__ for fn in fns)


@pytest.mark.parametrize(
    "config", ["", "max_split_size_mb:24", "garbage_collection_threshold:0.5"]
)
@pytest.mark.parametrize("seed", range(4))
def test_compiled_and_python_paths_keep_the_same_books(config: str, seed: int) -> None:
    sides = []
    for compiled in (True, False):
        backend = _BumpBackend()
        runtime = Runtime(backend)
        alloc = DeviceAllocator(
            backend, 0, parse(config or "expandable_segments:False")
        )
        streams = [runtime.default_stream(0)] + [
            Stream._wrap(runtime, 0, backend.stream_create(0, 0), owned=True)
            for _ in range(2)
        ]
        sides.append((alloc, streams, [], _methods(compiled)))
    rng = random.Random(seed)
    sizes = [1, 511, 512, 513, 4000, MiB, MiB + 1, 2 * MiB, 5 * MiB, 11 * MiB, 25 * MiB]
    for _ in range(600):
        op = rng.random()
        size = rng.choice(sizes)
        s = rng.randrange(3)
        pick = rng.random()
        for alloc, streams, live, (malloc, free, free_fin) in sides:
            if op < 0.5:
                live.append(malloc(alloc, size, streams[s]))
            elif live and op < 0.8:
                free(alloc, live.pop(int(pick * len(live))))
            elif live and op < 0.9:
                alloc.record_stream(live[int(pick * len(live))], streams[s])
            elif live and op < 0.95:
                free_fin(alloc, live.pop(int(pick * len(live))))
            else:
                for st in streams:
                    st.synchronize()
                alloc.empty_cache()
        (fa, fs, fl, _), (pa, ps, pl, _) = sides
        assert [(b.ptr, b.size) for b in fl] == [(b.ptr, b.size) for b in pl]
        assert fa.stats() == pa.stats()
        assert _layout(fa, fs) == _layout(pa, ps)
    check_invariants(sides[0][0])
