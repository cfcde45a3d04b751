"""The Backend protocol, the same tests on every backend.

Device memory is only ever read through copies into host memory from
``host_malloc``, so these tests hold on a real GPU as on the simulators.
"""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

import accel
from accel.backends.base import Backend, CaptureMode, CaptureStatus
from tests.fixtures import cuda_driver

MiB = 1 << 20


class HostBuffer:
    """Page-locked host memory readable from Python."""

    def __init__(self, backend: Backend, nbytes: int) -> None:
        self.backend, self.nbytes = backend, nbytes
        self.ptr = backend.host_malloc(nbytes)

    def fill(self, value: int) -> None:
        ctypes.memset(self.ptr, value, self.nbytes)

    def bytes(self, n: int | None = None) -> bytes:
        return ctypes.string_at(self.ptr, self.nbytes if n is None else n)

    def free(self) -> None:
        self.backend.host_free(self.ptr)


@pytest.fixture
def stream(backend: Backend):
    handle = backend.stream_create(0, 0)
    yield handle
    backend.stream_synchronize(0, handle)
    backend.stream_destroy(0, handle)


def gate(backend: Backend, stream: int) -> threading.Event:
    """Block ``stream`` until the returned event is set."""
    opened = threading.Event()
    backend.launch_host_func(0, stream, lambda: opened.wait(10))
    return opened


# -- devices ---------------------------------------------------------------


def test_devices_and_properties(backend: Backend) -> None:
    assert backend.device_count() >= 1
    for index in range(backend.device_count()):
        props = backend.device_properties(index)
        assert props.index == index and props.type == backend.name
        assert props.name and props.uuid and props.driver_version
        assert props.total_memory > 0 and props.multi_processor_count >= 1


def test_memory_info_is_bounded(backend: Backend) -> None:
    free, total = backend.memory_info(0)
    assert 0 <= free <= total
    assert total == backend.device_properties(0).total_memory


def test_peer_access_answers_a_bool(backend: Backend) -> None:
    assert isinstance(backend.can_access_peer(0, 0), bool)


# -- memory ------------------------------------------------------------------


def test_malloc_is_aligned_and_freed_once(backend: Backend) -> None:
    ptrs = [backend.malloc(0, n) for n in (1, 512, 4096, 3 * MiB)]
    assert all(p % 512 == 0 for p in ptrs) and len(set(ptrs)) == len(ptrs)
    for p in ptrs:
        backend.free(0, p)
    with pytest.raises(accel.AccelError):
        backend.free(0, ptrs[0])


def test_allocation_past_capacity_is_out_of_memory(backend: Backend) -> None:
    _, total = backend.memory_info(0)
    with pytest.raises(accel.OutOfMemoryError):
        backend.malloc(0, total * 4)
    # Nothing leaked: a normal allocation still works.
    backend.free(0, backend.malloc(0, MiB))


def test_copies_and_fills_round_trip(backend: Backend, stream: int) -> None:
    n = 64 * 1024
    src, dst = HostBuffer(backend, n), HostBuffer(backend, n)
    src.fill(0x5A)
    dst.fill(0)
    dev = backend.malloc(0, n)
    try:
        backend.memcpy_async(0, dev, src.ptr, n, stream)
        backend.memset_async(0, dev + 100, 0x07, 10, stream)
        backend.memcpy_async(0, dst.ptr, dev, n, stream)
        backend.stream_synchronize(0, stream)
        data = dst.bytes()
        assert data[:100] == b"\x5a" * 100
        assert data[100:110] == b"\x07" * 10
        assert data[110:] == b"\x5a" * (n - 110)
    finally:
        backend.free(0, dev)
        src.free()
        dst.free()


# -- streams -------------------------------------------------------------------


def test_priority_range_is_ordered(backend: Backend) -> None:
    least, greatest = backend.stream_priority_range(0)
    assert greatest <= least
    handle = backend.stream_create(0, greatest)
    backend.stream_destroy(0, handle)


def test_work_is_asynchronous_and_ordered(backend: Backend, stream: int) -> None:
    opened = gate(backend, stream)
    order: list[int] = []
    for i in range(5):
        backend.launch_host_func(0, stream, lambda i=i: order.append(i))
    assert not backend.stream_query(0, stream)  # blocked behind the gate
    assert order == []
    opened.set()
    backend.stream_synchronize(0, stream)
    assert backend.stream_query(0, stream)
    assert order == [0, 1, 2, 3, 4]


def test_device_synchronize_waits_for_every_stream(backend: Backend) -> None:
    streams = [backend.stream_create(0, 0) for _ in range(2)]
    done: list[int] = []
    for s in streams:
        backend.launch_host_func(0, s, lambda s=s: (time.sleep(0.02), done.append(s)))
    backend.device_synchronize(0)
    assert sorted(done) == sorted(streams)
    for s in streams:
        backend.stream_destroy(0, s)


def test_destroyed_stream_is_an_invalid_handle(backend: Backend) -> None:
    if backend.name == "cuda" and cuda_driver.cuda_mode() == "real":
        pytest.skip("using a destroyed CUstream/CUevent is undefined behaviour in the real CUDA driver")
    handle = backend.stream_create(0, 0)
    backend.stream_destroy(0, handle)
    with pytest.raises(accel.InvalidHandleError):
        backend.stream_query(0, handle)


# -- events ----------------------------------------------------------------------


def test_unrecorded_event_is_complete(backend: Backend) -> None:
    event = backend.event_create(0, timing=False, blocking=False, interprocess=False)
    assert backend.event_query(0, event)
    backend.event_synchronize(0, event)
    backend.event_destroy(0, event)


def test_event_waits_order_two_streams(backend: Backend, stream: int) -> None:
    other = backend.stream_create(0, 0)
    event = backend.event_create(0, timing=False, blocking=False, interprocess=False)
    seen: list[str] = []
    opened = gate(backend, stream)
    backend.launch_host_func(0, stream, lambda: seen.append("first"))
    backend.event_record(0, event, stream)
    backend.stream_wait_event(0, other, event)
    backend.launch_host_func(0, other, lambda: seen.append("second"))
    time.sleep(0.05)
    assert seen == [] and not backend.event_query(0, event)
    assert not backend.stream_query(0, other)  # really waiting, not done early
    opened.set()
    backend.stream_synchronize(0, other)
    assert seen == ["first", "second"]
    assert backend.event_query(0, event)
    backend.event_destroy(0, event)
    backend.stream_destroy(0, other)


def test_elapsed_time_measures_host_work(backend: Backend, stream: int) -> None:
    start, end = (backend.event_create(0, timing=True, blocking=False, interprocess=False) for _ in range(2))
    backend.event_record(0, start, stream)
    backend.launch_host_func(0, stream, lambda: time.sleep(0.05))
    backend.event_record(0, end, stream)
    backend.event_synchronize(0, end)
    elapsed = backend.event_elapsed_ms(0, start, end)
    assert 45.0 <= elapsed < 2000.0
    for e in (start, end):
        backend.event_destroy(0, e)


def test_elapsed_time_needs_timing_events(backend: Backend, stream: int) -> None:
    plain = [backend.event_create(0, timing=False, blocking=False, interprocess=False) for _ in range(2)]
    for e in plain:
        backend.event_record(0, e, stream)
    backend.stream_synchronize(0, stream)
    with pytest.raises(accel.AccelError):
        backend.event_elapsed_ms(0, *plain)
    for e in plain:
        backend.event_destroy(0, e)


def test_destroyed_event_is_an_invalid_handle(backend: Backend) -> None:
    if backend.name == "cuda" and cuda_driver.cuda_mode() == "real":
        pytest.skip("using a destroyed CUstream/CUevent is undefined behaviour in the real CUDA driver")
    event = backend.event_create(0, timing=False, blocking=False, interprocess=False)
    backend.event_destroy(0, event)
    with pytest.raises(accel.InvalidHandleError):
        backend.event_query(0, event)


# -- virtual memory ------------------------------------------------------------------


def test_virtual_memory_maps_physical_chunks(backend: Backend, stream: int) -> None:
    if not backend.supports_virtual_memory(0):
        with pytest.raises(accel.NotSupportedError):
            backend.vm_granularity(0)
        return
    g = backend.vm_granularity(0)
    assert g >= 4096 and g & (g - 1) == 0
    base = backend.vm_reserve(0, 4 * g)
    assert base % g == 0
    chunks = [backend.vm_create(0, g) for _ in range(2)]
    backend.vm_map(0, base, g, chunks[0])
    backend.vm_map(0, base + g, g, chunks[1])
    host = HostBuffer(backend, 2 * g)
    try:
        # One fill across the boundary of two chunks: the range is contiguous.
        backend.memset_async(0, base, 0x11, 2 * g, stream)
        backend.memcpy_async(0, host.ptr, base, 2 * g, stream)
        backend.stream_synchronize(0, stream)
        assert host.bytes() == b"\x11" * (2 * g)
    finally:
        host.free()
        backend.vm_unmap(0, base, 2 * g)
        for c in chunks:
            backend.vm_release(0, c)
        backend.vm_free(0, base, 4 * g)


def test_virtual_memory_creation_past_capacity_is_out_of_memory(backend: Backend) -> None:
    if not backend.supports_virtual_memory(0):
        pytest.skip(f"{backend.name} has no virtual memory")
    g = backend.vm_granularity(0)
    _, total = backend.memory_info(0)
    with pytest.raises(accel.OutOfMemoryError):
        backend.vm_create(0, (total * 4 // g + 1) * g)


# -- capture and replay ------------------------------------------------------------------


def test_capture_records_instead_of_running_and_replays(backend: Backend, stream: int) -> None:
    if not backend.supports_graphs(0):
        pytest.skip(f"{backend.name} has no graphs")
    n = 4096
    dev = backend.malloc(0, n)
    host = HostBuffer(backend, n)
    host.fill(0)
    calls: list[int] = []
    try:
        backend.memset_async(0, dev, 0, n, stream)
        backend.stream_synchronize(0, stream)
        backend.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
        assert backend.stream_capture_status(0, stream) == CaptureStatus.ACTIVE
        backend.memset_async(0, dev, 0x42, n, stream)
        backend.memcpy_async(0, host.ptr, dev, n, stream)
        backend.launch_host_func(0, stream, lambda: calls.append(1))
        graph = backend.stream_end_capture(0, stream)
        assert backend.stream_capture_status(0, stream) == CaptureStatus.NONE
        assert calls == [] and host.bytes() == b"\0" * n  # recorded, not run
        graph_exec = backend.graph_instantiate(0, graph)
        backend.graph_launch(0, graph_exec, stream)
        backend.graph_launch(0, graph_exec, stream)
        backend.stream_synchronize(0, stream)
        assert calls == [1, 1]
        assert host.bytes() == b"\x42" * n
        backend.graph_exec_destroy(0, graph_exec)
        backend.graph_destroy(0, graph)
    finally:
        backend.free(0, dev)
        host.free()


def test_an_external_event_wait_is_a_graph_node_that_waits_as_of_each_launch(backend: Backend, stream: int) -> None:
    """CUDA's CU_EVENT_WAIT_EXTERNAL: a wait on an event recorded outside the
    capture, kept as a node; each launch waits for the record it finds."""
    if not backend.supports_graphs(0):
        pytest.skip(f"{backend.name} has no graphs")
    other = backend.stream_create(0, 0)
    e = backend.event_create(0, timing=False, blocking=False, interprocess=False)
    calls: list[str] = []
    try:
        backend.event_record(0, e, other)
        backend.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
        backend.stream_wait_event_external(0, stream, e)
        backend.launch_host_func(0, stream, lambda: calls.append("graph"))
        graph = backend.stream_end_capture(0, stream)  # no fork of `other` to join back
        assert backend.graph_node_count(0, graph) in (None, 2)
        graph_exec = backend.graph_instantiate(0, graph)
        backend.graph_destroy(0, graph)
        for _ in range(2):
            opened = gate(backend, other)
            backend.launch_host_func(0, other, lambda: calls.append("other"))
            backend.event_record(0, e, other)
            backend.graph_launch(0, graph_exec, stream)
            opened.set()
            backend.stream_synchronize(0, stream)
            assert calls[-2:] == ["other", "graph"]
        backend.graph_exec_destroy(0, graph_exec)
    finally:
        backend.stream_synchronize(0, other)
        backend.stream_destroy(0, other)
        backend.event_destroy(0, e)


def test_capture_on_default_stream_is_refused(backend: Backend) -> None:
    if not backend.supports_graphs(0):
        pytest.skip(f"{backend.name} has no graphs")
    with pytest.raises(accel.CaptureError):
        backend.stream_begin_capture(0, backend.default_stream(0), CaptureMode.GLOBAL)


def test_synchronize_during_capture_invalidates_it(backend: Backend, stream: int) -> None:
    if not backend.supports_graphs(0):
        pytest.skip(f"{backend.name} has no graphs")
    backend.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
    with pytest.raises(accel.CaptureError):
        backend.stream_synchronize(0, stream)
    with pytest.raises(accel.CaptureError):
        backend.stream_end_capture(0, stream)
    assert backend.stream_capture_status(0, stream) == CaptureStatus.NONE
    # The stream is usable, and capturable, again.
    backend.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
    backend.launch_host_func(0, stream, lambda: None)
    backend.graph_destroy(0, backend.stream_end_capture(0, stream))


def test_forked_capture_must_join_and_then_replays_both_streams(backend: Backend, stream: int) -> None:
    if not backend.supports_graphs(0):
        pytest.skip(f"{backend.name} has no graphs")
    side = backend.stream_create(0, 0)
    fork, join = (backend.event_create(0, timing=False, blocking=False, interprocess=False) for _ in range(2))
    seen: list[str] = []
    backend.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
    backend.launch_host_func(0, stream, lambda: seen.append("main"))
    backend.event_record(0, fork, stream)
    backend.stream_wait_event(0, side, fork)
    assert backend.stream_capture_status(0, side) == CaptureStatus.ACTIVE
    backend.launch_host_func(0, side, lambda: seen.append("side"))
    backend.event_record(0, join, side)
    backend.stream_wait_event(0, stream, join)
    backend.launch_host_func(0, stream, lambda: seen.append("after"))
    graph = backend.stream_end_capture(0, stream)
    assert backend.stream_capture_status(0, side) == CaptureStatus.NONE
    graph_exec = backend.graph_instantiate(0, graph)
    backend.graph_launch(0, graph_exec, stream)
    backend.stream_synchronize(0, stream)
    assert seen == ["main", "side", "after"]
    backend.graph_exec_destroy(0, graph_exec)
    backend.graph_destroy(0, graph)
    for e in (fork, join):
        backend.event_destroy(0, e)
    backend.stream_destroy(0, side)


def test_capture_id_names_the_capture_of_every_stream_taking_part(backend: Backend, stream: int) -> None:
    """The graph layer files what captured work holds by this id, whichever stream queued it."""
    assert backend.stream_capture_id(0, stream) == 0  # not capturing
    if not backend.supports_graphs(0):
        return
    side, other = backend.stream_create(0, 0), backend.stream_create(0, 0)
    fork, join = (backend.event_create(0, timing=False, blocking=False, interprocess=False) for _ in range(2))
    ids = []
    for _ in range(2):
        backend.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
        ident = backend.stream_capture_id(0, stream)
        backend.event_record(0, fork, stream)
        backend.stream_wait_event(0, side, fork)  # fork: the side stream joins this capture
        assert backend.stream_capture_id(0, side) == ident != 0
        assert backend.stream_capture_id(0, other) == 0
        backend.event_record(0, join, side)
        backend.stream_wait_event(0, stream, join)
        backend.launch_host_func(0, stream, lambda: None)
        backend.graph_destroy(0, backend.stream_end_capture(0, stream))
        assert backend.stream_capture_id(0, stream) == backend.stream_capture_id(0, side) == 0
        ids.append(ident)
    assert ids[0] != ids[1]  # a new capture, a new id
    for e in (fork, join):
        backend.event_destroy(0, e)
    for s in (side, other):
        backend.stream_destroy(0, s)


def test_unjoined_fork_fails_the_capture(backend: Backend, stream: int) -> None:
    if not backend.supports_graphs(0):
        pytest.skip(f"{backend.name} has no graphs")
    side = backend.stream_create(0, 0)
    fork = backend.event_create(0, timing=False, blocking=False, interprocess=False)
    backend.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
    backend.event_record(0, fork, stream)
    backend.stream_wait_event(0, side, fork)
    backend.launch_host_func(0, side, lambda: None)
    with pytest.raises(accel.CaptureError):
        backend.stream_end_capture(0, stream)
    assert backend.stream_capture_status(0, side) == CaptureStatus.NONE
    backend.event_destroy(0, fork)
    backend.stream_destroy(0, side)


def test_graph_debug_dump_describes_the_graph(backend: Backend, stream: int, tmp_path) -> None:
    if not backend.supports_graphs(0):
        pytest.skip(f"{backend.name} has no graphs")
    backend.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
    backend.launch_host_func(0, stream, lambda: None)
    graph = backend.stream_end_capture(0, stream)
    path = tmp_path / "graph.txt"
    try:
        backend.graph_debug_dump(0, graph, str(path))
    except accel.NotSupportedError:
        pytest.skip(f"{backend.name} cannot dump graphs")
    assert path.stat().st_size > 0
    backend.graph_destroy(0, graph)


def test_capture_length_counts_recorded_work_or_says_none(backend: Backend, stream: int) -> None:
    assert backend.stream_capture_length(0, stream) is None  # not capturing
    if not backend.supports_graphs(0):
        return
    backend.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
    before = backend.stream_capture_length(0, stream)
    backend.launch_host_func(0, stream, lambda: None)
    after = backend.stream_capture_length(0, stream)
    graph = backend.stream_end_capture(0, stream)
    backend.graph_destroy(0, graph)
    if before is not None:  # None is always allowed: "cannot tell"
        assert after is not None and after > before


def test_graph_node_count_is_zero_for_an_empty_capture_and_counts_recorded_work(backend: Backend, stream: int) -> None:
    if not backend.supports_graphs(0):
        pytest.skip(f"{backend.name} has no graphs")
    counts = []
    for work in range(3):
        backend.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
        for _ in range(work):
            backend.launch_host_func(0, stream, lambda: None)
        graph = backend.stream_end_capture(0, stream)
        counts.append(backend.graph_node_count(0, graph))
        backend.graph_destroy(0, graph)
    # Every backend accel ships can tell (the empty-capture warning needs it).
    assert counts == [0, 1, 2]


def test_destroying_the_capturing_stream_releases_forked_streams(backend: Backend, stream: int) -> None:
    if not backend.supports_graphs(0):
        pytest.skip(f"{backend.name} has no graphs")
    if backend.name == "cuda" and cuda_driver.cuda_mode() == "real":
        pytest.skip("destroying a capturing CUstream is undefined behaviour in the real CUDA driver")
    origin, side = backend.stream_create(0, 0), backend.stream_create(0, 0)
    fork = backend.event_create(0, timing=False, blocking=False, interprocess=False)
    backend.stream_begin_capture(0, origin, CaptureMode.GLOBAL)
    backend.event_record(0, fork, origin)
    backend.stream_wait_event(0, side, fork)
    backend.stream_destroy(0, origin)
    # The forked stream works again: its work runs instead of vanishing.
    assert backend.stream_capture_status(0, side) == CaptureStatus.NONE
    ran: list[int] = []
    backend.launch_host_func(0, side, lambda: ran.append(1))
    backend.stream_synchronize(0, side)
    assert ran == [1]
    backend.event_destroy(0, fork)
    backend.stream_destroy(0, side)
