"""Every CUresult becomes the right accel exception, and misuse leaks nothing.

The first half injects driver failures through the simulator (so it needs
ACCEL_TEST_CUDA=sim); the second half provokes real misuse, which a real
driver answers the same way.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

from accel._errors import (
    AccelError,
    CaptureError,
    DriverError,
    InvalidHandleError,
    NotSupportedError,
    OutOfMemoryError,
)
from accel.backends.base import CaptureMode, CaptureStatus
from tests.backends.cuda.conftest import SimControl

D = 0


@pytest.fixture
def stream(cuda: Any) -> Iterator[int]:
    s = cuda.stream_create(D, 0)
    yield s
    if cuda.stream_capture_status(D, s) != CaptureStatus.NONE:
        try:
            cuda.graph_destroy(D, cuda.stream_end_capture(D, s))
        except CaptureError:
            pass  # an invalidated capture ends with the error; nothing to clean
    cuda.stream_synchronize(D, s)
    cuda.stream_destroy(D, s)


# -- mapping of driver codes (simulator failure injection) ---------------------


def test_out_of_memory_carries_request_and_device(cuda: Any, sim: SimControl) -> None:
    sim.fail("cuMemAlloc_v2", 2)
    with pytest.raises(OutOfMemoryError) as info:
        cuda.malloc(D, 12345)
    assert info.value.requested == 12345 and info.value.device == D
    assert "CUDA_ERROR_OUT_OF_MEMORY (2): out of memory" in str(info.value)
    assert isinstance(info.value, MemoryError)


@pytest.mark.parametrize(
    ("code", "exc_type", "text"),
    [
        (400, InvalidHandleError, "CUDA_ERROR_INVALID_HANDLE (400): invalid resource handle"),
        (201, InvalidHandleError, "CUDA_ERROR_INVALID_CONTEXT (201)"),
        (901, CaptureError, "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED (901)"),
        (907, CaptureError, "CUDA_ERROR_CAPTURED_EVENT (907)"),
        (801, NotSupportedError, "CUDA_ERROR_NOT_SUPPORTED (801): operation not supported"),
        (999, DriverError, "cuStreamSynchronize failed on cuda:0: CUDA_ERROR_UNKNOWN (999): unknown error"),
    ],
)
def test_codes_map_to_accel_types(
    cuda: Any, sim: SimControl, stream: int, code: int, exc_type: type[AccelError], text: str
) -> None:
    sim.fail("cuStreamSynchronize", code)
    with pytest.raises(exc_type) as info:
        cuda.stream_synchronize(D, stream)
    assert text in str(info.value)
    sim.clear()  # before the stream fixture's teardown synchronizes


def test_driver_error_fields(cuda: Any, sim: SimControl) -> None:
    sim.fail("cuCtxSynchronize", 700)
    with pytest.raises(DriverError) as info:
        cuda.device_synchronize(D)
    err = info.value
    assert (err.backend, err.call, err.code, err.name, err.device) == (
        "cuda", "cuCtxSynchronize", 700, "CUDA_ERROR_ILLEGAL_ADDRESS", D
    )
    assert err.description == "an illegal memory access was encountered"


def test_failed_stream_create_leaks_nothing(cuda: Any, sim: SimControl) -> None:
    before = sim.live("stream")
    sim.fail("cuStreamCreateWithPriority", 2)
    with pytest.raises(OutOfMemoryError):
        cuda.stream_create(D, 0)
    assert sim.live("stream") == before


def test_failed_host_function_launch_keeps_nothing(cuda: Any, sim: SimControl, stream: int) -> None:
    held = cuda.pending_host_functions()
    sim.fail("cuLaunchHostFunc", 400)
    with pytest.raises(InvalidHandleError):
        cuda.launch_host_func(D, stream, lambda: None)
    assert cuda.pending_host_functions() == held


def test_failed_set_access_unmaps(cuda: Any, sim: SimControl) -> None:
    g = cuda.vm_granularity(D)
    base = cuda.vm_reserve(D, g)
    chunk = cuda.vm_create(D, g)
    mappings = sim.live("mapping")
    sim.fail("cuMemSetAccess", 1)
    with pytest.raises(DriverError, match="cuMemSetAccess"):
        cuda.vm_map(D, base, g, chunk)
    sim.clear()
    assert sim.live("mapping") == mappings
    cuda.vm_map(D, base, g, chunk)  # the range was left unmapped, so this works
    cuda.vm_unmap(D, base, g)
    cuda.vm_release(D, chunk)
    cuda.vm_free(D, base, g)


# -- real misuse ---------------------------------------------------------------


def test_oom_without_leak(cuda: Any) -> None:
    free, total = cuda.memory_info(D)
    with pytest.raises(OutOfMemoryError) as info:
        cuda.malloc(D, total + (1 << 30))
    assert info.value.requested == total + (1 << 30)
    assert cuda.memory_info(D)[0] >= free - (64 << 20)


def test_vm_create_oom(cuda: Any) -> None:
    g = cuda.vm_granularity(D)
    total = cuda.memory_info(D)[1]
    with pytest.raises(OutOfMemoryError):
        cuda.vm_create(D, (total // g + 1) * g)


# Using a destroyed handle is undefined behaviour on a real driver (it may
# crash), so these run on the simulator only, which checks every handle.


def test_destroyed_handles(cuda: Any, sim: SimControl) -> None:
    s = cuda.stream_create(D, 0)
    cuda.stream_destroy(D, s)
    e = cuda.event_create(D, timing=True, blocking=False, interprocess=False)
    cuda.event_destroy(D, e)
    ptr = cuda.malloc(D, 1024)
    cuda.free(D, ptr)
    host = cuda.host_malloc(1024)
    cuda.host_free(host)
    calls = [
        lambda: cuda.stream_synchronize(D, s),
        lambda: cuda.stream_query(D, s),
        lambda: cuda.stream_destroy(D, s),
        lambda: cuda.event_record(D, e, 0),
        lambda: cuda.event_query(D, e),
        lambda: cuda.event_destroy(D, e),
        lambda: cuda.free(D, ptr),
        lambda: cuda.host_free(host),
        lambda: cuda.stream_destroy(D, cuda.default_stream(D)),
    ]
    for call in calls:
        with pytest.raises(InvalidHandleError):
            call()


def test_destroyed_graph_handles(cuda: Any, sim: SimControl, stream: int) -> None:
    cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL)
    graph = cuda.stream_end_capture(D, stream)
    graph_exec = cuda.graph_instantiate(D, graph)
    cuda.graph_exec_destroy(D, graph_exec)
    cuda.graph_destroy(D, graph)
    with pytest.raises(InvalidHandleError):
        cuda.graph_destroy(D, graph)
    with pytest.raises(InvalidHandleError):
        cuda.graph_exec_destroy(D, graph_exec)
    with pytest.raises(InvalidHandleError):
        cuda.graph_launch(D, graph_exec, stream)
    with pytest.raises(InvalidHandleError):
        cuda.graph_instantiate(D, graph)


def test_vm_release_twice(cuda: Any, sim: SimControl) -> None:
    chunk = cuda.vm_create(D, cuda.vm_granularity(D))
    cuda.vm_release(D, chunk)
    with pytest.raises(InvalidHandleError, match="memory handle"):
        cuda.vm_release(D, chunk)


def test_interprocess_event_cannot_time(cuda: Any) -> None:
    with pytest.raises(NotSupportedError, match="timing disabled"):
        cuda.event_create(D, timing=True, blocking=False, interprocess=True)
    e = cuda.event_create(D, timing=False, blocking=False, interprocess=True)
    cuda.event_destroy(D, e)


def test_elapsed_time_misuse(cuda: Any, stream: int) -> None:
    timed = cuda.event_create(D, timing=True, blocking=False, interprocess=False)
    untimed = cuda.event_create(D, timing=False, blocking=False, interprocess=False)
    cuda.event_record(D, timed, stream)
    cuda.event_record(D, untimed, stream)
    cuda.stream_synchronize(D, stream)
    with pytest.raises(InvalidHandleError, match="timing enabled"):
        cuda.event_elapsed_ms(D, timed, untimed)
    gate = threading.Event()
    late = cuda.event_create(D, timing=True, blocking=False, interprocess=False)
    cuda.launch_host_func(D, stream, lambda: gate.wait(30))
    cuda.event_record(D, late, stream)
    with pytest.raises(DriverError, match="CUDA_ERROR_NOT_READY"):
        cuda.event_elapsed_ms(D, timed, late)
    gate.set()
    cuda.stream_synchronize(D, stream)
    assert cuda.event_elapsed_ms(D, timed, late) >= 0
    for e in (timed, untimed, late):
        cuda.event_destroy(D, e)


def test_synchronize_during_capture_invalidates_it(cuda: Any, stream: int) -> None:
    buf = cuda.host_malloc(16)
    cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL)
    with pytest.raises(CaptureError, match="CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"):
        cuda.stream_synchronize(D, stream)
    assert cuda.stream_capture_status(D, stream) == CaptureStatus.INVALIDATED
    with pytest.raises(CaptureError, match="CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"):
        cuda.memset_async(D, buf, 0, 16, stream)
    with pytest.raises(CaptureError, match="CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"):
        cuda.stream_end_capture(D, stream)
    assert cuda.stream_capture_status(D, stream) == CaptureStatus.NONE
    cuda.host_free(buf)


def test_capture_misuse(cuda: Any, stream: int) -> None:
    with pytest.raises(CaptureError, match="is not capturing"):
        cuda.stream_end_capture(D, stream)
    with pytest.raises(CaptureError, match="CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"):
        cuda.stream_begin_capture(D, cuda.default_stream(D), CaptureMode.GLOBAL)
    cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL)
    with pytest.raises(CaptureError, match="already captures"):
        cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL)
    cuda.graph_destroy(D, cuda.stream_end_capture(D, stream))


def test_waiting_on_uncaptured_work_breaks_isolation(cuda: Any, stream: int) -> None:
    outside = cuda.event_create(D, timing=False, blocking=False, interprocess=False)
    cuda.event_record(D, outside, 0)
    cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL)
    with pytest.raises(CaptureError, match="CUDA_ERROR_STREAM_CAPTURE_ISOLATION"):
        cuda.stream_wait_event(D, stream, outside)
    with pytest.raises(CaptureError):
        cuda.stream_end_capture(D, stream)
    cuda.event_destroy(D, outside)


def test_captured_event_cannot_be_queried(cuda: Any, stream: int) -> None:
    e = cuda.event_create(D, timing=False, blocking=False, interprocess=False)
    cuda.stream_begin_capture(D, stream, CaptureMode.RELAXED)
    cuda.event_record(D, e, stream)
    with pytest.raises(CaptureError, match="CUDA_ERROR_CAPTURED_EVENT"):
        cuda.event_query(D, e)
    cuda.graph_destroy(D, cuda.stream_end_capture(D, stream))
    cuda.event_destroy(D, e)


def test_end_capture_from_another_thread(cuda: Any, stream: int) -> None:
    cuda.stream_begin_capture(D, stream, CaptureMode.THREAD_LOCAL)
    errors: list[BaseException] = []

    def end() -> None:
        try:
            cuda.stream_end_capture(D, stream)
        except CaptureError as exc:
            errors.append(exc)

    t = threading.Thread(target=end)
    t.start()
    t.join()
    assert len(errors) == 1 and "CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD" in str(errors[0])
    assert cuda.stream_capture_status(D, stream) == CaptureStatus.ACTIVE  # the capture goes on
    cuda.graph_destroy(D, cuda.stream_end_capture(D, stream))


def test_global_capture_refuses_unsafe_calls_elsewhere(cuda: Any, stream: int) -> None:
    e = cuda.event_create(D, timing=False, blocking=False, interprocess=False)
    cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL)
    errors: list[BaseException] = []

    def query() -> None:
        try:
            cuda.event_query(D, e)
        except CaptureError as exc:
            errors.append(exc)

    t = threading.Thread(target=query)
    t.start()
    t.join()
    assert len(errors) == 1
    with pytest.raises(CaptureError, match="INVALIDATED"):
        cuda.stream_end_capture(D, stream)
    cuda.event_destroy(D, e)


def test_nothing_leaks(cuda: Any, sim: SimControl) -> None:
    kinds = ("stream", "event", "graph", "graph_exec", "alloc", "host_alloc", "vmm_handle", "reservation", "mapping")
    before = {kind: sim.live(kind) for kind in kinds}
    s = cuda.stream_create(D, 0)
    e = cuda.event_create(D, timing=True, blocking=False, interprocess=False)
    ptr, host = cuda.malloc(D, 4096), cuda.host_malloc(4096)
    g = cuda.vm_granularity(D)
    base, chunk = cuda.vm_reserve(D, g), cuda.vm_create(D, g)
    cuda.vm_map(D, base, g, chunk)
    cuda.stream_begin_capture(D, s, CaptureMode.GLOBAL)
    cuda.memcpy_async(D, host, ptr, 4096, s)
    cuda.launch_host_func(D, s, lambda: None)
    graph = cuda.stream_end_capture(D, s)
    graph_exec = cuda.graph_instantiate(D, graph)
    cuda.graph_launch(D, graph_exec, s)
    cuda.event_record(D, e, s)
    cuda.event_synchronize(D, e)
    cuda.graph_exec_destroy(D, graph_exec)
    cuda.graph_destroy(D, graph)
    cuda.vm_unmap(D, base, g)
    cuda.vm_release(D, chunk)
    cuda.vm_free(D, base, g)
    cuda.free(D, ptr)
    cuda.host_free(host)
    cuda.event_destroy(D, e)
    cuda.stream_destroy(D, s)
    cuda.device_synchronize(D)
    assert {kind: sim.live(kind) for kind in kinds} == before
    assert cuda.pending_host_functions() == 0
