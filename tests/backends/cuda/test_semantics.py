"""CUDA backend behaviour beyond the protocol suite: host-function lifetimes,
capture with forks and joins, VMM aliasing, properties, contexts per thread.

These run on whichever driver the session uses (the simulator by default,
a real GPU with ACCEL_TEST_CUDA=real) and only assert what CUDA documents.
"""

from __future__ import annotations

import ctypes
import gc
import re
import threading
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from accel._errors import CaptureError
from accel.backends.base import CaptureMode, CaptureStatus

D = 0


class Gate:
    """A host function that holds its stream until the test opens the gate."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.running = threading.Event()

    def __call__(self) -> None:
        self.running.set()
        self._event.wait(30)

    def open(self) -> None:
        self._event.set()


@pytest.fixture
def host(cuda: Any) -> Iterator[Callable[[int], int]]:
    """Pinned host buffers, freed after the test."""
    buffers: list[int] = []

    def allocate(nbytes: int) -> int:
        buffers.append(cuda.host_malloc(nbytes))
        return buffers[-1]

    yield allocate
    cuda.device_synchronize(D)
    for ptr in buffers:
        cuda.host_free(ptr)


def read(ptr: int, nbytes: int) -> bytes:
    return ctypes.string_at(ptr, nbytes)


def test_properties_look_like_nvidia_smi(cuda: Any) -> None:
    props = cuda.device_properties(D)
    assert props.type == "cuda" and props.index == D
    assert re.fullmatch(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", props.uuid)
    assert re.fullmatch(r"\d+\.\d+", props.driver_version)
    assert props.compute_capability is not None and props.compute_capability[0] >= 1
    assert props.pci_bus_id is not None and re.fullmatch(r"[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}\.\d", props.pci_bus_id)
    assert props.multi_processor_count > 0
    assert props.extra["warp_size"] == 32
    assert props.total_memory == cuda.memory_info(D)[1]
    assert cuda.device_properties(D) is props  # static facts are cached


def test_priorities_and_default_stream(cuda: Any) -> None:
    least, greatest = cuda.stream_priority_range(D)
    assert greatest <= least
    assert cuda.default_stream(D) == 0
    s = cuda.stream_create(D, greatest)
    assert s != 0
    cuda.stream_destroy(D, s)


def test_host_function_is_kept_alive_until_it_ran(cuda: Any, stream: int) -> None:
    gate = Gate()
    cuda.launch_host_func(D, stream, gate)
    ran = []

    class Probe:
        def __call__(self) -> None:
            ran.append(True)

    probe = Probe()
    alive = weakref.ref(probe)
    cuda.launch_host_func(D, stream, probe)
    del probe
    gc.collect()
    assert alive() is not None, "the driver still has to call it"
    gate.open()
    cuda.stream_synchronize(D, stream)
    assert ran == [True]
    gc.collect()
    assert alive() is None, "a host function that ran must not be kept"


def test_cross_stream_event_orders_work(cuda: Any, stream: int, host: Callable[[int], int]) -> None:
    other = cuda.stream_create(D, 0)
    src, dst = host(256), host(256)
    event = cuda.event_create(D, timing=False, blocking=False, interprocess=False)
    gate = Gate()
    cuda.launch_host_func(D, stream, gate)
    cuda.memset_async(D, src, 0xAB, 256, stream)
    cuda.event_record(D, event, stream)
    cuda.stream_wait_event(D, other, event)
    cuda.memcpy_async(D, dst, src, 256, other)
    assert not cuda.event_query(D, event)
    assert not cuda.stream_query(D, other), "the copy must wait for the gated stream"
    gate.open()
    cuda.stream_synchronize(D, other)
    assert read(dst, 256) == b"\xab" * 256
    assert cuda.event_query(D, event)
    cuda.event_destroy(D, event)
    cuda.stream_destroy(D, other)


def test_timing_events_measure_gated_work(cuda: Any, stream: int) -> None:
    start = cuda.event_create(D, timing=True, blocking=True, interprocess=False)
    end = cuda.event_create(D, timing=True, blocking=True, interprocess=False)
    cuda.event_record(D, start, stream)
    cuda.launch_host_func(D, stream, lambda: threading.Event().wait(0.02))
    cuda.event_record(D, end, stream)
    cuda.event_synchronize(D, end)
    assert cuda.event_elapsed_ms(D, start, end) >= 10.0  # generous: the host function slept 20 ms
    cuda.event_destroy(D, start)
    cuda.event_destroy(D, end)


def test_device_synchronize_waits_for_destroyed_streams(cuda: Any, host: Callable[[int], int]) -> None:
    s = cuda.stream_create(D, 0)
    buf = host(64)
    gate = Gate()
    cuda.launch_host_func(D, s, gate)
    cuda.memset_async(D, buf, 7, 64, s)
    cuda.stream_destroy(D, s)  # queued work still completes
    gate.open()
    cuda.device_synchronize(D)
    assert read(buf, 64) == b"\x07" * 64


def capture(cuda: Any, stream: int, body: Callable[[], None], mode: CaptureMode = CaptureMode.GLOBAL) -> int:
    cuda.stream_begin_capture(D, stream, mode)
    assert cuda.stream_capture_status(D, stream) == CaptureStatus.ACTIVE
    body()
    graph = cuda.stream_end_capture(D, stream)
    assert cuda.stream_capture_status(D, stream) == CaptureStatus.NONE
    return graph


def test_captured_host_functions_live_as_long_as_the_graph(cuda: Any, stream: int) -> None:
    calls = []

    class Probe:
        def __call__(self) -> None:
            calls.append(True)

    probe = Probe()
    alive = weakref.ref(probe)
    graph = capture(cuda, stream, lambda: cuda.launch_host_func(D, stream, probe))
    del probe
    assert calls == [], "capture records, it does not run"
    graph_exec = cuda.graph_instantiate(D, graph)
    cuda.graph_destroy(D, graph)  # the executable graph keeps what it needs
    gc.collect()
    assert alive() is not None
    for _ in range(3):
        cuda.graph_launch(D, graph_exec, stream)
    cuda.stream_synchronize(D, stream)
    assert len(calls) == 3
    cuda.graph_exec_destroy(D, graph_exec)
    cuda.stream_synchronize(D, stream)
    gc.collect()
    assert alive() is None


def test_exec_destroyed_with_replays_pending(cuda: Any, stream: int) -> None:
    calls = []
    graph = capture(cuda, stream, lambda: cuda.launch_host_func(D, stream, lambda: calls.append(1)))
    graph_exec = cuda.graph_instantiate(D, graph)
    cuda.graph_destroy(D, graph)
    gate = Gate()
    cuda.launch_host_func(D, stream, gate)
    cuda.graph_launch(D, graph_exec, stream)
    cuda.graph_launch(D, graph_exec, stream)
    cuda.graph_exec_destroy(D, graph_exec)  # CUDA lets queued replays finish
    gate.open()
    cuda.device_synchronize(D)
    assert calls == [1, 1]
    assert cuda.pending_host_functions() == 0


def test_exec_destroyed_after_its_stream(cuda: Any, stream: int) -> None:
    calls = []
    graph = capture(cuda, stream, lambda: cuda.launch_host_func(D, stream, lambda: calls.append(1)))
    graph_exec = cuda.graph_instantiate(D, graph)
    cuda.graph_destroy(D, graph)
    doomed, other = cuda.stream_create(D, 0), cuda.stream_create(D, 0)
    gate = Gate()
    cuda.launch_host_func(D, doomed, gate)
    cuda.graph_launch(D, graph_exec, doomed)
    cuda.graph_launch(D, graph_exec, other)
    cuda.stream_destroy(D, doomed)  # its queued replay still runs
    cuda.graph_exec_destroy(D, graph_exec)
    cuda.stream_synchronize(D, other)
    assert gate.running.wait(10)
    # The running gate is no longer held; the function the pending replay needs is.
    assert cuda.pending_host_functions() == 1
    gate.open()
    cuda.device_synchronize(D)
    assert calls == [1, 1]
    assert cuda.pending_host_functions() == 0
    cuda.stream_destroy(D, other)


def test_graph_replays_copies_and_memsets(cuda: Any, stream: int, host: Callable[[int], int]) -> None:
    src, dst = host(4096), host(4096)
    dev = cuda.malloc(D, 4096)

    def body() -> None:
        cuda.memcpy_async(D, dev, src, 4096, stream)
        cuda.memset_async(D, dev, 0x11, 16, stream)
        cuda.memcpy_async(D, dst, dev, 4096, stream)

    graph = capture(cuda, stream, body)
    graph_exec = cuda.graph_instantiate(D, graph)
    for value in (1, 2, 3):
        ctypes.memset(src, value, 4096)
        cuda.graph_launch(D, graph_exec, stream)
        cuda.stream_synchronize(D, stream)
        assert read(dst, 4096) == b"\x11" * 16 + bytes([value]) * 4080
    cuda.graph_exec_destroy(D, graph_exec)
    cuda.graph_destroy(D, graph)
    cuda.free(D, dev)


def test_fork_join_capture(cuda: Any, stream: int, host: Callable[[int], int]) -> None:
    side = cuda.stream_create(D, 0)
    fork = cuda.event_create(D, timing=False, blocking=False, interprocess=False)
    join = cuda.event_create(D, timing=False, blocking=False, interprocess=False)
    a, b = host(64), host(64)

    def body() -> None:
        cuda.event_record(D, fork, stream)
        cuda.stream_wait_event(D, side, fork)
        assert cuda.stream_capture_status(D, side) == CaptureStatus.ACTIVE
        cuda.memset_async(D, b, 2, 64, side)
        cuda.memset_async(D, a, 1, 64, stream)
        cuda.event_record(D, join, side)
        cuda.stream_wait_event(D, stream, join)

    graph = capture(cuda, stream, body)
    assert cuda.stream_capture_status(D, side) == CaptureStatus.NONE
    graph_exec = cuda.graph_instantiate(D, graph)
    cuda.graph_launch(D, graph_exec, stream)
    cuda.stream_synchronize(D, stream)
    assert read(a, 64) == b"\x01" * 64 and read(b, 64) == b"\x02" * 64
    for handle, destroy in ((graph_exec, cuda.graph_exec_destroy), (graph, cuda.graph_destroy)):
        destroy(D, handle)
    cuda.event_destroy(D, fork)
    cuda.event_destroy(D, join)
    cuda.stream_destroy(D, side)


def test_unjoined_fork_fails_end_capture(cuda: Any, stream: int, host: Callable[[int], int]) -> None:
    side = cuda.stream_create(D, 0)
    fork = cuda.event_create(D, timing=False, blocking=False, interprocess=False)
    buf = host(64)
    cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL)
    cuda.event_record(D, fork, stream)
    cuda.stream_wait_event(D, side, fork)
    cuda.memset_async(D, buf, 1, 64, side)
    with pytest.raises(CaptureError, match="CUDA_ERROR_STREAM_CAPTURE_UNJOINED"):
        cuda.stream_end_capture(D, stream)
    assert cuda.stream_capture_status(D, stream) == CaptureStatus.NONE
    assert cuda.stream_capture_status(D, side) == CaptureStatus.NONE
    cuda.event_destroy(D, fork)
    cuda.stream_destroy(D, side)


def test_malloc_during_capture_keeps_the_capture(cuda: Any, stream: int) -> None:
    cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL)
    ptr = cuda.malloc(D, 1 << 20)
    cuda.memset_async(D, ptr, 0, 1 << 20, stream)
    assert cuda.stream_capture_status(D, stream) == CaptureStatus.ACTIVE
    graph = cuda.stream_end_capture(D, stream)
    cuda.graph_destroy(D, graph)
    cuda.free(D, ptr)


def test_graph_launched_inside_a_capture(cuda: Any, stream: int) -> None:
    calls = []
    inner = capture(cuda, stream, lambda: cuda.launch_host_func(D, stream, lambda: calls.append("inner")))
    inner_exec = cuda.graph_instantiate(D, inner)
    outer = capture(cuda, stream, lambda: cuda.graph_launch(D, inner_exec, stream))
    cuda.graph_exec_destroy(D, inner_exec)
    cuda.graph_destroy(D, inner)
    outer_exec = cuda.graph_instantiate(D, outer)
    cuda.graph_launch(D, outer_exec, stream)
    cuda.stream_synchronize(D, stream)
    assert calls == ["inner"]
    cuda.graph_exec_destroy(D, outer_exec)
    cuda.graph_destroy(D, outer)
    cuda.stream_synchronize(D, stream)
    assert cuda.pending_host_functions() == 0


def test_graph_debug_dump(cuda: Any, stream: int, tmp_path: Path) -> None:
    ptr = cuda.malloc(D, 4096)
    graph = capture(cuda, stream, lambda: cuda.memset_async(D, ptr, 1, 4096, stream))
    path = tmp_path / "graph.dot"
    cuda.graph_debug_dump(D, graph, str(path))
    assert path.read_text().lstrip().startswith("digraph")
    cuda.graph_destroy(D, graph)
    cuda.free(D, ptr)


def test_vmm_map_alias_unmap(cuda: Any, stream: int, host: Callable[[int], int]) -> None:
    if not cuda.supports_virtual_memory(D):
        pytest.skip("no virtual memory management on this device")
    granularity = cuda.vm_granularity(D)
    assert granularity >= 2 << 20 and granularity % (2 << 20) == 0
    free_before = cuda.memory_info(D)[0]
    base = cuda.vm_reserve(D, 2 * granularity)
    chunk = cuda.vm_create(D, granularity)
    assert cuda.memory_info(D)[0] <= free_before - granularity
    # One physical chunk at two addresses: a write through one is read through the other.
    cuda.vm_map(D, base, granularity, chunk)
    cuda.vm_map(D, base + granularity, granularity, chunk)
    out = host(8)
    cuda.memset_async(D, base, 0x5A, 8, stream)
    cuda.memcpy_async(D, out, base + granularity, 8, stream)
    cuda.stream_synchronize(D, stream)
    assert read(out, 8) == b"\x5a" * 8
    cuda.vm_unmap(D, base, 2 * granularity)
    cuda.vm_release(D, chunk)
    cuda.vm_free(D, base, 2 * granularity)
    assert cuda.memory_info(D)[0] >= free_before - (64 << 20)  # others may allocate on a real GPU


def test_other_threads_get_the_primary_context(cuda: Any, stream: int, host: Callable[[int], int]) -> None:
    buf = host(32)
    errors: list[BaseException] = []

    def work() -> None:
        try:
            s = cuda.stream_create(D, 0)
            cuda.memset_async(D, buf, 9, 32, s)
            cuda.stream_synchronize(D, s)
            cuda.stream_destroy(D, s)
        except BaseException as exc:  # reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert read(buf, 32) == b"\x09" * 32


def test_memory_info_tracks_malloc(cuda: Any) -> None:
    free0, total = cuda.memory_info(D)
    ptr = cuda.malloc(D, 8 << 20)
    free1, _ = cuda.memory_info(D)
    cuda.free(D, ptr)
    assert free1 <= free0 - (8 << 20) + (64 << 20)  # a real GPU may see other processes
    assert 0 < free1 < total


def test_destroying_a_capturing_stream_releases_what_its_capture_recorded(cuda: Any) -> None:
    class Probe:
        def __call__(self) -> None:
            pass

    probe = Probe()
    alive = weakref.ref(probe)
    s = cuda.stream_create(D, 0)
    cuda.stream_begin_capture(D, s, CaptureMode.GLOBAL)
    cuda.launch_host_func(D, s, probe)
    del probe
    cuda.stream_destroy(D, s)  # nothing can end that capture any more
    cuda.device_synchronize(D)
    gc.collect()
    assert cuda.pending_host_functions() == 0
    assert alive() is None


def test_an_event_record_node_records_the_event_at_each_replay(cuda: Any, stream: int) -> None:
    e = cuda.event_create(D, timing=True, blocking=False, interprocess=False)
    graph = capture(cuda, stream, lambda: cuda.event_record_external(D, e, stream))
    assert cuda.graph_node_count(D, graph) == 1
    graph_exec = cuda.graph_instantiate(D, graph)
    cuda.graph_destroy(D, graph)
    cuda.event_destroy(D, e)  # the executable graph holds the event
    cuda.graph_launch(D, graph_exec, stream)
    cuda.stream_synchronize(D, stream)
    cuda.graph_exec_destroy(D, graph_exec)
