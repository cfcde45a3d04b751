"""accel.memory.MemPool / use_mem_pool, mirroring the behaviours of PyTorch's test_mempool_*
(ids, routing, nesting, threads, stats and snapshot, use count, release, graph capture)."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

import accel
from accel.allocator import BackendResource, ConfigStringError, StatisticsAdaptor
from accel.graph import Graph, graph
from tests.conftest import CONFORMANCE_BACKENDS
from tests.fixtures import scripts
from tests.graph.test_graph import run_script_on

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _runtime_ready():
    # The first device call of a process may pin its caller's frames (a pool
    # created there would never be collected); start from a live runtime.
    accel.memory.memory_stats()


def allocated(pool=None) -> int:
    stats = pool.memory_stats() if pool is not None else accel.memory.memory_stats()
    return stats["allocated_bytes.all.current"]


def test_mempool_id_shares_the_graph_pool_counter():
    handle = accel.graph_pool_handle()
    pool = accel.memory.MemPool()
    assert handle[0] == pool.id[0] == 0
    assert pool.id[1] > handle[1]
    assert accel.memory.MemPool().id[1] > pool.id[1]


def test_allocations_inside_the_context_come_from_the_pool():
    pool = accel.memory.MemPool()
    device_before = allocated()
    with accel.memory.use_mem_pool(pool):
        inside = accel.memory.allocate(4096)
        assert pool.use_count() == 2
    outside = accel.memory.allocate(4096)
    assert pool.use_count() == 1
    assert allocated(pool) == 4096
    assert allocated() == device_before + 4096
    assert inside._allocator is pool.allocator()
    segments = pool.snapshot()
    assert segments and all(s["segment_pool_id"] == pool.id for s in segments)
    assert any(b["address"] == inside.ptr for s in segments for b in s["blocks"])
    assert not any(b["address"] == inside.ptr for s in accel.memory.memory_snapshot() for b in s["blocks"])
    inside.free()
    outside.free()
    assert allocated(pool) == 0


def test_accel_empty_is_routed_too():
    torch = pytest.importorskip("torch")
    pool = accel.memory.MemPool()
    with accel.memory.use_mem_pool(pool):
        t = accel.empty((1024,), dtype=torch.uint8)
    assert allocated(pool) == 1024
    del t
    gc.collect()
    assert allocated(pool) == 0


def test_nested_pools_the_innermost_wins():
    outer, inner = accel.memory.MemPool(), accel.memory.MemPool()
    with accel.memory.use_mem_pool(outer):
        a = accel.memory.allocate(512)
        with accel.memory.use_mem_pool(inner):
            b = accel.memory.allocate(1024)
        c = accel.memory.allocate(2048)
    assert allocated(outer) == 512 + 2048
    assert allocated(inner) == 1024
    for buf in (a, b, c):
        buf.free()


def test_only_the_calling_thread_is_routed():
    pool = accel.memory.MemPool()
    started, stop = threading.Event(), threading.Event()
    other: list[accel.memory.Buffer] = []

    def worker() -> None:
        started.wait()
        other.append(accel.memory.allocate(8192))
        stop.set()

    thread = threading.Thread(target=worker)
    thread.start()
    with accel.memory.use_mem_pool(pool):
        started.set()
        stop.wait(30)
        mine = accel.memory.allocate(4096)
    thread.join(30)
    assert allocated(pool) == 4096
    assert other[0]._allocator is accel.memory.get_allocator()
    mine.free()
    other[0].free()


def test_pool_settings_override_the_process_settings():
    pool = accel.memory.MemPool("roundup_power2_divisions:4")
    assert pool.allocator().config.roundup_power2_divisions[0] == 4
    assert accel.memory.get_allocator().config.roundup_power2_divisions[0] != 4
    with accel.memory.use_mem_pool(pool):
        buf = accel.memory.allocate(4800)
    assert pool.memory_stats()["allocated_bytes.all.current"] == 5120  # rounded by the pool's divisions
    buf.free()
    with pytest.raises(ConfigStringError, match="expandable_segmets"):
        accel.memory.MemPool("expandable_segmets:True")
    with pytest.raises(accel.InvalidValueError, match="settings"):
        accel.memory.MemPool(42)  # type: ignore[arg-type]
    with pytest.raises(accel.InvalidValueError, match="MemPool"):
        with accel.memory.use_mem_pool("pool"):  # type: ignore[arg-type]
            pass


def test_pool_with_its_own_upstream():
    backend = accel.memory.get_allocator().backend
    upstream = StatisticsAdaptor(BackendResource(backend, 0))
    pool = accel.memory.MemPool(upstream=upstream)
    with accel.memory.use_mem_pool(pool):
        buf = accel.memory.allocate(3 * MiB)
    assert upstream.counts.allocations >= 1 and upstream.counts.current_bytes >= 3 * MiB
    assert accel.memory.get_allocator().upstream is not upstream
    buf.free()
    pool.empty_cache()
    assert upstream.counts.current_bytes == 0


def test_dropped_pool_gives_its_memory_back():
    pool = accel.memory.MemPool()
    with accel.memory.use_mem_pool(pool):
        accel.memory.allocate(4096).free()
    allocator = pool.allocator()
    assert allocator.stats()["reserved_bytes.all.current"] > 0
    gone = weakref.ref(pool)
    del pool
    gc.collect()
    assert gone() is None
    assert allocator.stats()["reserved_bytes.all.current"] == 0


def test_dropped_pool_with_live_buffers_releases_after_the_last_free():
    pool = accel.memory.MemPool()
    with accel.memory.use_mem_pool(pool):
        a = accel.memory.allocate(4096)
        b = accel.memory.allocate(3 * MiB)
    allocator = pool.allocator()
    del pool
    gc.collect()
    a.free()
    assert allocator.stats()["reserved_bytes.all.current"] > 0, "b is still alive"
    accel.current_stream().fill(b, 1)
    b.free()
    assert allocator.stats()["reserved_bytes.all.current"] == 0


def test_graph_captured_inside_use_mem_pool_takes_the_pools_memory():
    pool = accel.memory.MemPool()
    device_reserved = accel.memory.memory_stats()["reserved_bytes.all.current"]
    g = Graph()
    with accel.memory.use_mem_pool(pool):
        with graph(g):
            buf = accel.memory.allocate(4096)
            accel.current_stream().fill(buf, 3)
    assert g.pool() in pool.allocator().pool_ids()
    assert g.pool() not in accel.memory.get_allocator().pool_ids()
    assert pool.memory_stats()["reserved_bytes.all.current"] > 0
    assert accel.memory.memory_stats()["reserved_bytes.all.current"] <= device_reserved  # nothing new on the device allocator
    g.replay()
    accel.synchronize()
    buf.free()
    del g
    gc.collect()


def test_a_graph_that_outlives_its_dropped_pool_gives_the_memory_back_when_it_goes():
    # The graph's private pool used to stay cached in the orphaned allocator,
    # which nobody can empty any more: its memory leaked for the process's life.
    pool = accel.memory.MemPool()
    g = Graph()
    with accel.memory.use_mem_pool(pool):
        with graph(g):
            buf = accel.memory.allocate(MiB)
            accel.current_stream().fill(buf, 3)
    allocator = pool.allocator()
    del pool
    gc.collect()
    buf.free()
    g.replay()
    accel.synchronize()
    assert allocator.stats()["reserved_bytes.all.current"] > 0, "the graph still uses its pool"
    del g
    gc.collect()
    assert allocator.stats()["reserved_bytes.all.current"] == 0
    assert allocator.pool_ids() == []


def test_a_mempool_id_is_not_a_graph_pool():
    pool = accel.memory.MemPool()
    with pytest.raises(accel.InvalidValueError, match="use_mem_pool"):
        Graph(pool=pool.id)
    pool_id = pool.id
    del pool
    gc.collect()
    Graph(pool=pool_id)  # a dead pool's id is an ordinary id again


DROP_IN_A_HOST_FUNCTION = """
import gc, sys, threading
import accel

pool = accel.memory.MemPool()
s = accel.Stream()
with accel.memory.use_mem_pool(pool), s:
    # Cached segments ordered on s: the release has memory to give back, which it
    # cannot without waiting while s runs the host function.
    accel.memory.allocate(1 << 20).free()
    kept = accel.memory.allocate(4096) if sys.argv[1] == "last-free" else None
allocator = pool.allocator()
holder = [pool]
if sys.argv[1] == "collect":
    pool.cycle = pool  # only a collection frees it
del pool
done = threading.Event()

def drop():
    # On the stream's own thread: a wait for the device here waits for itself.
    if sys.argv[1] == "collect":
        holder.clear()
        gc.collect()
    elif sys.argv[1] == "last-free":
        holder.clear()
        gc.collect()
        kept.free()
    else:
        holder.clear()
    done.set()

s.launch_host_func(drop)
assert done.wait(10), "dropping the pool inside a host function hung"
s.synchronize()
assert allocator.stats()["reserved_bytes.all.current"] > 0, "given back while s still ran"
accel.memory.empty_cache()  # what the drop could not give back without waiting goes now
assert allocator.stats()["reserved_bytes.all.current"] == 0, allocator.stats()["reserved_bytes.all.current"]
print("OK")
"""


@pytest.mark.parametrize("how", ["drop", "collect", "last-free"])
@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_pool_dropped_inside_a_host_function_does_not_wait_for_the_device(backend: str, how: str) -> None:
    """The pool's finalizer (and the free of its last buffer) synchronized the device
    to give the memory back; on the thread running a host function (or in a collection
    there) that waits for the host function itself: a deadlock."""
    run_script_on(backend, DROP_IN_A_HOST_FUNCTION, how, timeout=60)


OUT_OF_MEMORY_WITH_ANOTHER_ALLOCATORS_CACHE = """
import sys, accel
pool = accel.memory.MemPool()
mine, theirs = (pool, None) if sys.argv[1] == "pool caches" else (None, pool)
if mine is not None:
    with accel.memory.use_mem_pool(mine):
        accel.memory.allocate(200 << 20).free()
else:
    accel.memory.allocate(200 << 20).free()
try:
    if theirs is not None:
        with accel.memory.use_mem_pool(theirs):
            accel.memory.allocate(100 << 20)
    else:
        accel.memory.allocate(100 << 20)
except accel.OutOfMemoryError as exc:
    d = exc.details
    print(d.mempools, d.mempools_allocated, d.others, d.others_allocated)
    print(exc)
"""

# Each simulated device has 256 MiB; the cache of one allocator leaves too little for the other.
_SMALL_DEVICE = {"ACCEL_CPU_MEMORY_LIMIT": "256MiB", "ACCEL_SIMCUDA_TOTAL_MEM": "256MiB", "ACCEL_SIMZE_MEMORY": "256MiB"}


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_out_of_memory_counts_what_a_pool_in_use_caches_and_says_how_to_free_it(backend: str) -> None:
    # The device allocator's error said "0 bytes is reserved by accel" while a MemPool
    # cached 200 MiB of the device, and did not say to empty the pool's cache.
    result = scripts.run(backend, OUT_OF_MEMORY_WITH_ANOTHER_ALLOCATORS_CACHE, "pool caches", env=_SMALL_DEVICE)
    assert result.returncode == 0, result.stderr
    numbers, message = result.stdout.split("\n", 1)
    assert numbers.split() == [str(200 << 20), "0", "0", "0"]
    assert "200.00 MiB is reserved by accel but unallocated" in message, message
    assert "MemPools of this device in use reserve 200.00 MiB (0 bytes allocated)" in message, message
    assert "MemPools of this device cache 200.00 MiB" in message and "pool.empty_cache()" in message, message


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_out_of_memory_in_a_pool_counts_what_the_device_allocator_caches(backend: str) -> None:
    result = scripts.run(backend, OUT_OF_MEMORY_WITH_ANOTHER_ALLOCATORS_CACHE, "device caches", env=_SMALL_DEVICE)
    assert result.returncode == 0, result.stderr
    numbers, message = result.stdout.split("\n", 1)
    assert numbers.split() == ["0", "0", str(200 << 20), "0"]
    assert "200.00 MiB is reserved by accel but unallocated" in message, message
    assert "the device's allocator outside this MemPool reserves 200.00 MiB" in message, message
    assert "caches 200.00 MiB outside this MemPool: call accel.memory.empty_cache()" in message, message
