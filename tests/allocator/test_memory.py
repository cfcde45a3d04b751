"""accel.memory: Buffer, statistics functions, snapshots, staging memory (host backend)."""

from __future__ import annotations

import functools
import gc
import operator
import os
import pickle
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest

import accel
from accel import memory
from accel.allocator._registry import registry
from accel._errors import DeviceError, InvalidHandleError, InvalidValueError
from tests.allocator.thread_races import free_each, run_threads, run_while_toggling

MiB = 1 << 20


def test_buffer_basics():
    before = memory.memory_allocated()
    buf = memory.allocate(1000)
    assert buf.nbytes == 1000 and buf.ptr % 512 == 0
    assert str(buf.device) == "cpu:0"
    assert buf.stream == accel.current_stream()
    assert memory.memory_allocated() == before + 1024
    assert "nbytes=1000" in repr(buf)
    buf.free()
    assert buf.freed and "freed" in repr(buf)
    with pytest.raises(InvalidHandleError, match="was freed"):
        _ = buf.ptr
    with pytest.raises(InvalidHandleError):
        buf.record_stream(accel.current_stream())
    buf.free()  # a second free does nothing
    assert memory.memory_allocated() == before


def test_buffer_context_manager_and_garbage_collection():
    before = memory.memory_allocated()
    with memory.allocate(4096) as buf:
        accel.current_stream().fill(buf, 3)
    assert buf.freed
    buf = memory.allocate(8192)
    assert memory.memory_allocated() == before + 8192
    del buf
    assert memory.memory_allocated() == before


def test_finalizer_while_the_allocator_lock_is_held_does_not_deadlock():
    allocator = memory.get_allocator()
    before = memory.memory_allocated()
    buf = memory.allocate(4096)
    with allocator._lock:
        del buf  # the free is queued, not run under the held lock
        gc.collect()
    assert memory.memory_allocated() == before


def test_allocate_arguments_are_checked():
    with pytest.raises(InvalidValueError):
        memory.allocate(0)
    with pytest.raises(InvalidValueError):
        memory.allocate("1MiB")  # type: ignore[arg-type]
    with pytest.raises(DeviceError):
        memory.allocate(10, device=5)
    with pytest.raises(DeviceError):
        memory.allocate(10, device="cuda:0")
    s = accel.Stream()
    s.close()
    with pytest.raises(InvalidHandleError):
        memory.allocate(10, stream=s)
    with pytest.raises(InvalidValueError):
        memory.allocate(10, stream=object())  # type: ignore[arg-type]


def test_buffer_on_a_stream_and_record_stream():
    s = accel.Stream()
    other = accel.Stream()
    buf = memory.allocate(MiB, stream=s)
    assert buf.stream == s
    s.fill(buf, 1)
    gate = threading.Event()
    other.launch_host_func(gate.wait)
    buf.record_stream(other)
    ptr = buf.ptr
    buf.free()
    again = memory.allocate(MiB, stream=s)
    assert again.ptr != ptr  # other has not passed the free yet
    gate.set()
    other.synchronize()
    third = memory.allocate(MiB, stream=s)
    assert third.ptr == ptr
    with pytest.raises(InvalidValueError):
        third.record_stream("not a stream")  # type: ignore[arg-type]
    again.free()
    third.free()


def test_record_stream_takes_a_torch_stream():
    # Every accel call that takes a stream takes torch's; record_stream refused it.
    import torch

    buf = memory.allocate(64)
    buf.record_stream(torch.Stream("cpu"))
    buf.free()


def test_a_buffer_whose_construction_failed_is_collected_quietly():
    # __del__ read a slot __init__ never set: "Exception ignored ... AttributeError" on stderr.
    import gc
    import sys

    errors: list[object] = []
    previous, sys.unraisablehook = sys.unraisablehook, errors.append
    try:
        with pytest.raises(TypeError):
            memory.HostBuffer()  # type: ignore[call-arg]
        with pytest.raises(TypeError):
            memory.Buffer()  # type: ignore[call-arg]
        gc.collect()
    finally:
        sys.unraisablehook = previous
    assert errors == []


def test_stats_functions_and_resets():
    stats = memory.memory_stats()
    assert list(stats) == sorted(stats) and "allocated_bytes.all.current" in stats
    buf = memory.allocate(3 * MiB)
    assert memory.max_memory_allocated() >= memory.memory_allocated() >= 3 * MiB
    assert memory.memory_reserved() >= 3 * MiB and memory.max_memory_reserved() >= memory.memory_reserved()
    buf.free()
    memory.reset_peak_memory_stats()
    assert memory.max_memory_allocated() == memory.memory_allocated()
    memory.reset_accumulated_memory_stats()
    assert memory.memory_stats()["allocation.all.allocated"] == 0
    memory.empty_cache()
    # After empty_cache no cached block can hold 40 MiB: it gets a segment of its own.
    memory.allocate(40 * MiB).free()
    cached = memory.memory_reserved()
    memory.empty_cache(0)
    assert memory.memory_reserved() == cached - 40 * MiB
    summary = memory.memory_summary()
    assert "Allocated memory" in summary and "num_ooms" in summary
    assert len({len(line) for line in summary.splitlines()}) == 1  # a well-formed table


def test_memory_fraction_is_checked():
    for bad in (-0.1, 1.5, "half", None):
        with pytest.raises(InvalidValueError):
            memory.set_per_process_memory_fraction(bad)  # type: ignore[arg-type]


def test_graph_pool_handles_are_fresh():
    a, b = memory.graph_pool_handle(), memory.graph_pool_handle()
    assert a[0] == 0 and b[0] == 0 and b[1] > a[1] > 0


def test_snapshot_and_dump_read_by_pytorch_viewer(tmp_path):
    memory.record_memory_history(max_entries=1000)
    try:
        buf = memory.allocate(5 * MiB)
        snap = memory.memory_snapshot()
        assert any(b["state"] == "active_allocated" for seg in snap for b in seg["blocks"])
        buf.free()
        path = tmp_path / "snap.pickle"
        memory.dump_snapshot(path)
    finally:
        memory.record_memory_history(None)
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert set(data) == {"segments", "device_traces", "allocator_settings", "external_annotations"}
    actions = [e["action"] for e in data["device_traces"][0]]
    assert "alloc" in actions and "free_completed" in actions
    assert data["allocator_settings"]["max_split_size"] == -1
    viz = pytest.importorskip("torch.cuda._memory_viz")
    assert "total_reserved" in viz.segsum(data)
    assert "5.0MiB" in viz.trace(data)
    with pytest.raises(InvalidValueError, match="expected state"):
        memory.record_memory_history("everything")


def test_config_changes_reach_live_allocators():
    from accel.allocator.config import set_settings

    allocator = memory.get_allocator()
    set_settings("expandable_segments:True", backend="cpu")
    try:
        assert allocator.config.expandable_segments and allocator._expandable
        buf = memory.allocate(200 * MiB)  # misses the cache: new memory is expandable
        assert buf._block is not None
        (seg,) = [seg for seg in allocator.snapshot() if seg["address"] <= buf.ptr < seg["address"] + seg["total_size"]]
        assert seg["is_expandable"]
        buf.free()
    finally:
        set_settings("expandable_segments:False", backend="cpu")
    assert not allocator.config.expandable_segments
    memory.empty_cache()


def test_many_threads_with_buffers():
    streams = [accel.Stream() for _ in range(3)]

    def work(k: int) -> None:
        for i in range(200):
            buf = memory.allocate(512 * (1 + (k * 31 + i) % 700), stream=streams[(k + i) % 3])
            if i % 3 == 0:
                buf.record_stream(streams[(k + i + 1) % 3])
            buf.free()

    assert run_threads([functools.partial(work, k) for k in range(4)]) == []


# -- staging memory ------------------------------------------------------------------------


def test_host_buffers_are_cached_and_wait_for_their_copies():
    s = accel.Stream()
    a = memory.allocate_host(5000)
    assert a.nbytes == 5000 and "HostBuffer" in repr(a)
    ptr = a.ptr
    gate = threading.Event()
    s.launch_host_func(gate.wait)
    a.record_stream(s)
    a.free()
    b = memory.allocate_host(6000)  # same rounded size, but the copy is still queued
    assert b.ptr != ptr
    gate.set()
    s.synchronize()
    c = memory.allocate_host(8192)
    assert c.ptr == ptr
    for x in (b, c):
        x.free()
    with pytest.raises(InvalidHandleError):
        _ = c.ptr
    with pytest.raises(InvalidValueError):
        memory.allocate_host(0)
    memory.empty_host_cache()
    host = registry().host
    assert host is not None and host.stats()["cached_bytes"] == 0


# -- a fresh process: out of memory, upstream adaptors -------------------------------------


def _run(code: str, **env: str) -> str:
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, "ACCEL_BACKEND": "cpu", "PYTHONPATH": root, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_out_of_memory_through_the_facade():
    out = _run(
        """
        import accel
        keep = accel.memory.allocate(50 << 20)
        try:
            accel.memory.allocate(20 << 20)
        except accel.OutOfMemoryError as exc:
            print(exc)
            print(accel.memory.memory_stats()["num_ooms"])
        """,
        ACCEL_CPU_MEMORY_LIMIT="64MiB",
    )
    assert "Tried to allocate 20.00 MiB" in out and "total capacity of 64.00 MiB" in out
    assert out.strip().endswith("1")


def test_set_upstream_with_adaptors():
    out = _run(
        """
        import accel
        from accel.allocator._resources import BackendResource, LimitingAdaptor, StatisticsAdaptor
        backend = accel.memory.get_allocator(0).backend
        stats = StatisticsAdaptor(LimitingAdaptor(BackendResource(backend, 1), 30 << 20))
        accel.memory.set_upstream(stats, device=1)
        buf = accel.memory.allocate(5 << 20, device=1)
        print(stats.counts.allocations, stats.counts.current_bytes)
        try:
            accel.memory.allocate(25 << 20, device=1)
        except accel.OutOfMemoryError:
            print("oom")
        try:
            accel.memory.set_upstream(stats, device=1)
        except accel.InvalidValueError:
            print("too late")
        try:
            accel.memory.set_upstream(object(), device=0)
        except accel.InvalidValueError:
            print("refused")
        """,
        ACCEL_CPU_DEVICES="2",
    )
    assert out.split() == ["1", str(20 << 20), "oom", "too", "late", "refused"]


def test_set_upstream_too_late_says_when_it_is_allowed_and_what_to_do():
    from accel.allocator import BackendResource

    allocator = memory.get_allocator(0)  # made by this call: nothing was allocated through it
    with pytest.raises(InvalidValueError) as info:
        memory.set_upstream(BackendResource(allocator.backend, 0), device=0)
    message = str(info.value)
    assert "too late for cpu:0" in message and "already exists" in message
    # Not only an allocation makes the allocator: the message must say so, and what to do instead.
    assert "memory_stats()" in message and "get_allocator()" in message
    assert "before any other accel.memory call" in message
    assert "DeviceAllocator(backend, 0, config, upstream=resource)" in message


def test_host_buffer_finalizer_and_cache_limits():
    from accel.allocator._host_cache import HostCachingAllocator
    from accel.allocator.config import parse
    from accel.backends.cpu import CpuBackend

    host = registry().host_allocator()
    before = host.stats()["allocated_bytes"]
    buf = memory.allocate_host(10_000)
    with host._lock:
        del buf  # queued: the lock is taken
        gc.collect()
    assert host.stats()["allocated_bytes"] == before

    backend = CpuBackend(1, None)
    capped = HostCachingAllocator(backend, parse("pinned_max_cached_size_mb:1"))
    blocks = [capped.malloc(600_000) for _ in range(2)]  # 1 MiB each after rounding
    for b in blocks:
        capped.free(b)
    # The first fits under the cap and stays cached; the second would not: released.
    assert capped.stats()["cached_bytes"] == 1 << 20 and capped.stats()["reserved_bytes"] == 1 << 20
    again = capped.malloc(600_000)
    assert again.ptr in (blocks[0].ptr, blocks[1].ptr)  # served from the cache
    capped.free(again)
    rounded = HostCachingAllocator(backend, parse("pinned_max_round_threshold_mb:1"))
    assert rounded.malloc(3 << 20).size == 3 << 20  # above the threshold: whole pages only
    assert rounded.malloc(600_000).size == 1 << 20
    with pytest.raises(InvalidHandleError):
        capped.free(blocks[0])


def test_a_stale_host_block_is_refused_after_its_memory_was_reused():
    """A freed HostBlock is retired: freeing it again cannot free the next owner's block."""
    from accel.allocator._host_cache import HostCachingAllocator
    from accel.allocator.config import AllocatorConfig

    host = HostCachingAllocator(accel.current_stream()._runtime.backend, AllocatorConfig())
    old = host.malloc(3000)
    host.free(old)
    new = host.malloc(3000)
    assert new.ptr == old.ptr  # the same memory, served from the cache
    with pytest.raises(InvalidHandleError, match="not allocated"):
        host.free(old)
    with pytest.raises(InvalidHandleError, match="not allocated"):
        host.record_stream(old, accel.current_stream())
    assert host.stats()["allocated_bytes"] == 4096  # the new owner's block is untouched
    host.free(new)
    assert host.stats()["allocated_bytes"] == 0


def test_a_refused_settings_change_never_reaches_the_live_allocator():
    from accel.allocator import add_change_listener, config_for_backend, remove_change_listener, set_settings

    allocator = memory.get_allocator()
    before = allocator.config

    def refuse(backend, old, new):
        raise accel.AllocatorConfigError("refused by the test")

    add_change_listener(refuse)
    try:
        with pytest.raises(accel.AllocatorConfigError, match="refused by the test"):
            set_settings("max_split_size_mb:64")
    finally:
        remove_change_listener(refuse)
    assert allocator.config == before == config_for_backend("cpu")


def test_host_memory_stats_follow_torch_keys_and_resets():
    import torch

    accel.memory.empty_host_cache()
    accel.memory.reset_accumulated_host_memory_stats()
    accel.memory.reset_peak_host_memory_stats()
    stats = accel.memory.host_memory_stats()
    # the same keys as torch's host_memory_stats() (torch's may be empty without CUDA: compare to the documented set)
    names = ("allocations", "allocated_bytes", "active_requests", "active_bytes")
    expected = {f"{n}.{m}" for n in names for m in ("current", "peak", "allocated", "freed")}
    expected |= {"num_host_alloc", "num_host_free"}
    expected |= {f"{n}.{m}" for n in ("host_alloc_time", "host_free_time") for m in ("total", "max", "min", "count", "avg")}
    assert set(stats) == expected
    assert list(stats) == sorted(stats)
    assert callable(torch.cuda.host_memory_stats)
    base_active = stats["active_requests.current"]
    a = accel.memory.allocate_host(3000)  # rounded to 4096
    b = accel.memory.allocate_host(5000)  # rounded to 8192
    stats = accel.memory.host_memory_stats()
    assert stats["active_requests.current"] == base_active + 2
    assert stats["active_bytes.current"] >= 4096 + 8192
    assert stats["num_host_alloc"] == stats["allocations.allocated"] >= 2
    assert stats["host_alloc_time.count"] == stats["num_host_alloc"]
    a.free()
    b.free()
    stats = accel.memory.host_memory_stats()
    assert stats["active_requests.current"] == base_active
    assert stats["active_requests.peak"] == base_active + 2
    assert stats["allocations.current"] >= 2  # cached, still held
    accel.memory.reset_peak_host_memory_stats()
    assert accel.memory.host_memory_stats()["active_requests.peak"] == base_active
    accel.memory.empty_host_cache()
    stats = accel.memory.host_memory_stats()
    assert stats["num_host_free"] >= 2 and stats["allocations.current"] == 0
    assert stats["host_free_time.count"] == stats["num_host_free"]
    accel.memory.reset_accumulated_host_memory_stats()
    stats = accel.memory.host_memory_stats()
    assert stats["num_host_alloc"] == stats["num_host_free"] == stats["allocations.freed"] == 0
    assert stats["host_alloc_time.count"] == 0


def test_get_per_process_memory_fraction():
    before = accel.memory.get_per_process_memory_fraction()
    try:
        accel.memory.set_per_process_memory_fraction(0.5)
        assert accel.memory.get_per_process_memory_fraction() == 0.5
        assert accel.memory.get_per_process_memory_fraction(0) == 0.5
    finally:
        accel.memory.set_per_process_memory_fraction(before)


def test_torch_spellings_of_history_and_snapshot(tmp_path):
    """torch passes record_memory_history's arguments positionally and dump_snapshot's by ``filename``."""
    memory.record_memory_history("all", "all", "python", 100, None)
    try:
        memory.allocate(MiB).free()
        memory.dump_snapshot(filename=tmp_path / "snap.pickle")
    finally:
        memory.record_memory_history(None)
    with open(tmp_path / "snap.pickle", "rb") as f:
        assert pickle.load(f)["device_traces"][0]
    with pytest.raises(DeviceError):
        memory.record_memory_history("all", "all", "all", 10, 7)


def test_get_memory_info_and_nested_stats_as_torch():
    free, total = memory.get_memory_info()
    assert 0 <= free <= total and (free, total)[1] == accel.get_memory_info(0)[1]
    buf = memory.allocate(MiB)
    nested = memory.memory_stats_as_nested_dict()
    flat = memory.memory_stats()
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"] >= MiB
    assert nested["num_ooms"] == flat["num_ooms"]
    buf.free()


def test_allocate_host_of_more_than_any_machine_has_is_an_out_of_memory_error():
    with pytest.raises(accel.OutOfMemoryError, match="more than 1EB"):
        memory.allocate_host(2**64)


@pytest.mark.parametrize("filename", [True, 1, 2, None], ids=["True", "1", "2", "None"])
def test_dump_snapshot_refuses_what_is_not_a_path(filename, tmp_path, monkeypatch):
    # open() took True/1 as a file descriptor: the snapshot went into stdout, which was then closed.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(InvalidValueError, match="must be a path"):
        memory.dump_snapshot(filename)


# -- the common pair (compiled: straight into the native core; pure: DeviceAllocator's lock-free path)


def _device_allocator() -> Any:
    buf = memory.allocate(1)
    allocator = buf._allocator
    buf.free()  # the first pair found the allocator plain
    return allocator


def test_the_common_pair_takes_no_lock_and_the_compiled_one_no_allocator_method():
    a = _device_allocator()
    assert a._plain
    before = a.stats()["allocated_bytes.all.current"]

    def no_method(*args: object) -> None:
        raise AssertionError("the compiled pair called a DeviceAllocator method")

    class NoLock:
        owner = 0  # held by no thread (free() reads it: see OwnedLock)

        def acquire(self, *args: object, **kwargs: object) -> bool:
            raise AssertionError("the common pair took the allocator's lock")

        release = __enter__ = __exit__ = acquire

    lock, a._lock = a._lock, NoLock()
    # the compiled allocate and Buffer.free/__del__ call the core
    a.malloc = a.free = a.free_from_finalizer = no_method
    try:
        buf = memory.allocate(4096)
        buf.free()
        memory.allocate(4096)  # collected at once: Buffer.__del__
        t = accel.empty(64, dtype="uint8")
        del t
    finally:
        a._lock = lock
        for name in ("malloc", "free", "free_from_finalizer"):
            a.__dict__.pop(name, None)
    assert a.stats()["allocated_bytes.all.current"] == before


def test_the_common_pair_refuses_what_the_allocator_refuses():
    a = _device_allocator()
    for bad, error in ((0, InvalidValueError), (-1, InvalidValueError), (True, InvalidValueError),
                       (1.5, InvalidValueError), (1 << 61, accel.OutOfMemoryError)):  # fmt: skip
        with pytest.raises(error) as by_allocate:
            memory.allocate(bad)  # type: ignore[arg-type]
        with pytest.raises(error) as by_malloc:
            a.malloc(bad, accel.current_stream())
        assert str(by_allocate.value) == str(by_malloc.value)
    buf = memory.allocate(100)
    block = buf._block
    buf.free()
    with pytest.raises(InvalidHandleError, match="freed twice"):
        a.free(block)  # a second free of the handle the compiled free gave back
    fresh = memory.allocate(100)
    assert fresh.ptr == block.ptr  # block is a stale handle of fresh's memory
    with pytest.raises(InvalidHandleError, match="freed twice"):
        a.free(block)
    assert fresh._block.state == 1 and a._live[fresh.ptr] is fresh._block  # still fresh's
    # a buffer whose allocator is not its block's owner: refused, the block kept
    other = accel.allocator.DeviceAllocator(a.backend, a.device, a.config)
    stray = memory.Buffer(fresh._block, other, accel.current_stream(), 100)
    with pytest.raises(InvalidHandleError, match="another allocator"):
        stray.free()
    assert a._live[fresh.ptr] is fresh._block
    fresh.free()


def test_compiled_and_python_pairs_mixed_across_threads():
    """Buffers (the compiled pair where built) and the allocator's own malloc/free on one
    allocator from several threads, history turned on and off meanwhile (the locked
    paths), and each of a set of handles freed by a Buffer and by the allocator at once:
    every handle is freed once, the other free refused, nothing leaks."""
    a = _device_allocator()
    before = a.stats()["allocated_bytes.all.current"]
    stream = accel.current_stream()

    def buffers(seed: int) -> None:
        for i in range(1500):
            buf = memory.allocate(512 * (1 + (seed + i) % 5))
            if i % 3:
                buf.free()
            else:
                del buf  # Buffer.__del__

    def blocks(seed: int) -> None:
        for i in range(1500):
            b = a.malloc(512 * (1 + (seed + i) % 5), stream)
            (a.free if i % 2 else a.free_from_finalizer)(b)

    def toggle() -> None:
        memory.record_memory_history()
        memory.record_memory_history(None)

    shared = [memory.allocate(512) for _ in range(300)]
    handles = [buf._block for buf in shared]
    workers = [functools.partial(work, k) for work in (buffers, blocks) for k in range(2)]
    # a Buffer's free is a no-op when the allocator freed the block first
    workers += [free_each(operator.methodcaller("free"), shared), free_each(a.free, handles)]
    errors = run_while_toggling(workers, toggle)
    memory.record_memory_history(None)
    gc.collect()
    assert not errors
    assert all(b.state == 3 for b in handles)  # RETIRED: freed, once (the core refuses a second)
    assert a.stats()["allocated_bytes.all.current"] == before
