"""Host-backend specifics: memory accounting, limits, virtual memory misuse."""

from __future__ import annotations

import ctypes

import pytest

import accel
from accel.backends.base import CaptureMode
from accel.backends.cpu import CpuBackend
from accel.backends.cpu._memory import VM_GRANULARITY, machine_memory
from tests.fixtures.sharing import PENDING_EVENT_EXPORTER

MiB = 1 << 20


@pytest.fixture
def limited() -> CpuBackend:
    return CpuBackend(2, 16 * MiB)


def test_limit_caps_each_device_and_frees_return_capacity(limited: CpuBackend) -> None:
    ptrs = [limited.malloc(0, 4 * MiB) for _ in range(4)]
    assert limited.memory_info(0)[0] == 0
    with pytest.raises(accel.OutOfMemoryError, match="ACCEL_CPU_MEMORY_LIMIT=16.00 MiB") as info:
        limited.malloc(0, 1)
    assert info.value.device == 0 and info.value.requested == 4096
    assert limited.memory_info(1) == (16 * MiB, 16 * MiB)  # the other device is untouched
    for p in ptrs:
        limited.free(0, p)
    assert limited.memory_info(0) == (16 * MiB, 16 * MiB)


def test_physical_chunks_count_against_the_limit(limited: CpuBackend) -> None:
    handles = [limited.vm_create(0, VM_GRANULARITY) for _ in range(8)]
    with pytest.raises(accel.OutOfMemoryError):
        limited.vm_create(0, VM_GRANULARITY)
    for h in handles:
        limited.vm_release(0, h)
    assert limited.memory_info(0)[0] == 16 * MiB


def test_freeing_twice_or_foreign_pointers_is_refused(limited: CpuBackend) -> None:
    p = limited.malloc(0, 100)
    limited.free(0, p)
    with pytest.raises(accel.InvalidHandleError, match="already freed"):
        limited.free(0, p)
    h = limited.host_malloc(100)
    with pytest.raises(accel.InvalidHandleError, match=rf"cpu:0: free\({h:#x}\): not an allocation of this device"):
        limited.free(0, h)
    limited.host_free(h)
    with pytest.raises(accel.InvalidHandleError, match=rf"cpu: host_free\({h:#x}\): not an allocation of host_malloc"):
        limited.host_free(h)
    assert limited.memory_info(0) == (16 * MiB, 16 * MiB)  # a refused free changes no account


def test_stale_graph_handles_are_refused_by_name(limited: CpuBackend) -> None:
    stream = limited.stream_create(0, 0)
    limited.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
    graph = limited.stream_end_capture(0, stream)
    graph_exec = limited.graph_instantiate(0, graph)
    limited.graph_exec_destroy(0, graph_exec)
    limited.graph_destroy(0, graph)
    with pytest.raises(accel.InvalidHandleError, match=f"cpu: executable graph handle {graph_exec:#x} is not live"):
        limited.graph_launch(0, graph_exec, stream)
    with pytest.raises(accel.InvalidHandleError, match="executable graph .* not live"):
        limited.graph_exec_destroy(0, graph_exec)
    with pytest.raises(accel.InvalidHandleError, match=f"cpu: graph handle {graph:#x} is not live"):
        limited.graph_instantiate(0, graph)
    with pytest.raises(accel.InvalidHandleError, match="graph .* not live"):
        limited.graph_destroy(0, graph)
    limited.stream_destroy(0, stream)


def test_virtual_memory_misuse_is_explained(limited: CpuBackend) -> None:
    g = VM_GRANULARITY
    with pytest.raises(accel.InvalidValueError, match="multiple of the granularity"):
        limited.vm_reserve(0, g + 1)
    base = limited.vm_reserve(0, 2 * g)
    chunk = limited.vm_create(0, g)
    with pytest.raises(accel.InvalidValueError, match="not inside a reservation"):
        limited.vm_map(0, base + 2 * g, g, chunk)
    limited.vm_map(0, base, g, chunk)
    with pytest.raises(accel.InvalidValueError, match="overlaps"):
        limited.vm_map(0, base, g, chunk)
    with pytest.raises(accel.InvalidValueError, match="still mapped"):
        limited.vm_free(0, base, 2 * g)
    with pytest.raises(accel.InvalidValueError, match="union of mapped chunks"):
        limited.vm_unmap(0, base, 2 * g)
    ctypes.memset(base, 1, g)  # mapped memory is host memory here
    limited.vm_unmap(0, base, g)
    limited.vm_release(0, chunk)
    with pytest.raises(accel.InvalidHandleError):
        limited.vm_release(0, chunk)
    limited.vm_free(0, base, 2 * g)


def test_one_chunk_mapped_twice_aliases(limited: CpuBackend) -> None:
    g = VM_GRANULARITY
    base = limited.vm_reserve(0, 2 * g)
    chunk = limited.vm_create(0, g)
    limited.vm_map(0, base, g, chunk)
    limited.vm_map(0, base + g, g, chunk)
    ctypes.memset(base, 0x5C, 8)
    assert ctypes.string_at(base + g, 8) == b"\x5c" * 8
    limited.vm_unmap(0, base, 2 * g)
    limited.vm_release(0, chunk)
    limited.vm_free(0, base, 2 * g)


def test_machine_memory_is_plausible() -> None:
    available, total, source = machine_memory()
    assert 0 < available <= total and source in ("cgroup", "/proc/meminfo")


def test_capture_refuses_waits_across_its_boundary() -> None:
    backend = CpuBackend(1, None)
    s = backend.stream_create(0, 0)
    outside = backend.event_create(0, timing=False, blocking=False, interprocess=False)
    backend.event_record(0, outside, s)
    backend.stream_begin_capture(0, s, CaptureMode.GLOBAL)
    with pytest.raises(accel.CaptureError, match="cross the capture boundary"):
        backend.stream_wait_event(0, s, outside)
    with pytest.raises(accel.CaptureError, match="invalidated"):
        backend.stream_end_capture(0, s)


def test_captured_events_cannot_be_waited_on_from_the_host() -> None:
    backend = CpuBackend(1, None)
    s = backend.stream_create(0, 0)
    event = backend.event_create(0, timing=False, blocking=False, interprocess=False)
    backend.stream_begin_capture(0, s, CaptureMode.GLOBAL)
    backend.event_record(0, event, s)
    with pytest.raises(accel.CaptureError, match="inside a capture"):
        backend.event_synchronize(0, event)
    with pytest.raises(accel.CaptureError, match="cannot synchronize the device"):
        backend.device_synchronize(0)
    with pytest.raises(accel.CaptureError):
        backend.stream_end_capture(0, s)
    assert backend.event_query(0, event)  # the capture is over: a plain event again


def test_frees_from_finalizers_inside_an_allocation_do_not_deadlock() -> None:
    """Garbage collection may run a finalizer that frees memory while the
    same thread is inside the backend (holding its lock)."""
    import threading

    backend = CpuBackend(1, None)
    p = backend.malloc(0, 100)
    s = backend.stream_create(0, 0)
    memory, streams = backend._memory[0], backend._streams

    def nested() -> None:
        with memory._lock:
            backend.free(0, p)
        with streams._lock:
            backend.stream_destroy(0, s)

    thread = threading.Thread(target=nested, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "a nested free deadlocked"


# -- sharing with other processes ---------------------------------------------------------

IMPORTER = """
import pickle, sys, accel
event = pickle.loads(bytes.fromhex(sys.argv[1]))
print("opened", event.query(), flush=True)
try:
    event.synchronize()
    print("completed")
except accel.InvalidHandleError as exc:
    print(exc)
event.record()  # the importer's own record: its stream completes it
event.synchronize()
print("own record completed", event.query())
"""


def test_an_importer_stops_waiting_on_an_event_whose_exporter_exited() -> None:
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "ACCEL_BACKEND": "cpu", "PYTHONPATH": str(root)}
    exporter = subprocess.Popen([sys.executable, "-c", PENDING_EVENT_EXPORTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                text=True, env=env, cwd=root)
    try:
        assert exporter.stdout is not None
        pickled = exporter.stdout.readline().strip()
        importer = subprocess.Popen([sys.executable, "-c", IMPORTER, pickled], stdout=subprocess.PIPE, text=True,
                                    env=env, cwd=root)
        assert importer.stdout is not None
        assert importer.stdout.readline().split() == ["opened", "False"]  # the exporter's record is pending
    finally:
        exporter.kill()
        exporter.wait(30)
    # Not communicate(timeout=...): it reads the pipe past the lines readline() already buffered.
    importer.wait(60)  # its output is a few lines: the pipe cannot fill
    out = importer.stdout.read()
    assert "exited before the work it recorded completed" in out
    assert "own record completed True" in out


def _raising_function():
    def raise_boom() -> None:
        raise ValueError("boom")

    return raise_boom


def test_a_failing_function_on_a_stream_accel_did_not_create_is_raised_by_its_synchronize() -> None:
    """accel's own functions run unwrapped (an importer's wait, a keep-alive); on a stream
    that the backend made and accel only wraps, their failure was dropped silently."""
    from accel._runtime import activate

    with activate("cpu") as runtime:
        handle = runtime.backend.stream_create(0, 0)
        try:
            stream = accel.ExternalStream(handle)
            ran: list[int] = []
            runtime.backend.launch_host_func(0, handle, _raising_function())
            runtime.backend.launch_host_func(0, handle, lambda: ran.append(1))
            with pytest.raises(accel.HostFunctionError, match=r"host function .*raise_boom on .* raised ValueError: boom"):
                stream.synchronize()
            assert ran == [1]
            graph_stream = accel.Stream()
            runtime.backend.stream_begin_capture(0, graph_stream.native_handle, CaptureMode.GLOBAL)
            runtime.backend.launch_host_func(0, graph_stream.native_handle, _raising_function())
            graph = runtime.backend.stream_end_capture(0, graph_stream.native_handle)
            graph_exec = runtime.backend.graph_instantiate(0, graph)
            runtime.backend.graph_launch(0, graph_exec, handle)  # a graph's node: the launch stream reports
            with pytest.raises(accel.HostFunctionError, match=r"raised ValueError: boom"):
                stream.synchronize()
            runtime.backend.graph_exec_destroy(0, graph_exec)
            runtime.backend.graph_destroy(0, graph)
        finally:
            runtime.backend.stream_destroy(0, handle)
