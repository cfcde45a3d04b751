"""Dropped MemPools on many threads: a pool's memory goes back without waiting for
the device only when its streams have no queued work, so no fill still queued on
it writes memory given back (on the host backend and the simulated drivers, a
write into memory given back is a crash)."""

from __future__ import annotations

import pytest

from tests.fixtures.scripts import ok, run

DROPPED_POOLS_ON_EIGHT_THREADS = """
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


@pytest.mark.skip(
    reason="intermittent, so neither a pass nor a strict xfail can stand in CI (after the stream-retirement "
    "merge 98e61f1: 1 crash in 11 runs, then 5 of 20 runs ended in OutOfMemoryError while dropped pools "
    "held the device's memory and the error said accel reserved 0 bytes): found by the advB adversary, not understood yet: on Level Zero a dropped pool's memory is given "
    "back (without waiting: _release_if_idle) while a fill queued on its stream still writes it; the "
    "simulator's engine thread crashes in its copy (gdb: run_cmd, memcpy) while another thread closes a "
    "memory file; with _streams_idle forced False it does not crash. (On cpu and cuda the same script "
    "sometimes fails with OutOfMemoryError while dropped pools still hold the memory: not checked here.)",
)
def test_pools_dropped_on_many_threads_while_fills_are_queued() -> None:
    ok(run("xpu", DROPPED_POOLS_ON_EIGHT_THREADS, timeout=120))
