"""Dropped MemPools on many threads: a pool's memory goes back without waiting for
the device only when its streams have no queued work, so no fill still queued on
it writes memory given back (on the host backend and the simulated drivers, a
write into memory given back is a crash); and an allocation short of memory waits
for the dropped pools other threads are giving back, so the device's memory (1 GiB
here: 8 live pools of up to 60 MiB, and the dropped ones) never runs out.

Before the wait (see test_caching's dropped-pool tests, the deterministic ones),
9 of 20 runs on the simulated CUDA driver ended in OutOfMemoryError."""

from __future__ import annotations

import pytest

from tests.conftest import CONFORMANCE_BACKENDS
from tests.fixtures.scripts import ok, run

DROPPED_POOLS_ON_EIGHT_THREADS = """
import os
os.environ["ACCEL_CPU_MEMORY_LIMIT"] = "1GiB"  # as the simulated drivers' devices
import gc, threading, accel
from accel.allocator import _caching

errors = []

def worker(k):
    try:
        s = accel.Stream()
        for i in range(15):
            pool = accel.memory.MemPool("expandable_segments:" + ("True" if (i + k) % 2 else "False"))
            with accel.memory.use_mem_pool(pool):
                bufs = [accel.memory.allocate((i * 7 + 1) * 100_000, stream=s) for _ in range(3)]
            for b in bufs:
                s.fill(b, k)  # queued: the pool is dropped before it ran
            for b in bufs:
                b.free()
            del pool, bufs
    except Exception as exc:
        errors.append(repr(exc))

for _ in range(3):
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
assert not errors, errors
gc.collect()
accel.memory.empty_cache()
assert not _caching._orphans
print("ok")
"""


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_pools_dropped_on_many_threads_while_fills_are_queued(backend: str) -> None:
    ok(run(backend, DROPPED_POOLS_ON_EIGHT_THREADS, timeout=300))
