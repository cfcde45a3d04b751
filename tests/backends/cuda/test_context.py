"""Every CUDA backend entry point leaves the calling thread's current context as it found it.

torch and CuPy take their current device from the thread's current CUDA
context, so a library sharing the process must not switch it. These tests set
up a thread state through the driver itself (no context, the target device's
primary context, another device's, a two-deep stack), run the backend's entry
points and read the state back after each one. They run on whichever driver
the session uses; the cross-device cases need two devices (the simulator has
two by default), the failure-injection cases the simulator.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from accel._errors import AccelError, DriverError, OutOfMemoryError
from accel.backends.base import CaptureMode
from tests.backends.cuda.conftest import SimControl, run_json
from tests.fixtures.cuda_driver import build_simulator

CU_STREAM_CAPTURE_MODE_GLOBAL = 0
CU_STREAM_CAPTURE_MODE_RELAXED = 2


class Contexts:
    """The calling thread's CUDA context stack, read and changed through the driver."""

    def __init__(self, cuda: Any) -> None:
        self._ffi = cuda.driver.ffi
        self._fn = cuda.driver.fn
        self.count = cuda.device_count()

    def primary(self, device: int) -> Any:
        out = self._ffi.new("CUcontext *")
        assert self._fn["cuDevicePrimaryCtxRetain"](out, device) == 0
        return out[0]

    def current(self) -> int:
        """The current context's address (0: none)."""
        out = self._ffi.new("CUcontext *")
        assert self._fn["cuCtxGetCurrent"](out) == 0
        return int(self._ffi.cast("uintptr_t", out[0]))

    def push(self, ctx: Any) -> None:
        assert self._fn["cuCtxPushCurrent"](ctx) == 0

    def pop(self) -> int:
        out = self._ffi.new("CUcontext *")
        assert self._fn["cuCtxPopCurrent"](out) == 0
        return int(self._ffi.cast("uintptr_t", out[0]))

    def clear(self) -> None:
        """Empty the stack (setting NULL pops its top)."""
        for _ in range(64):
            if self.current() == 0:
                return
            assert self._fn["cuCtxSetCurrent"](self._ffi.NULL) == 0
        raise AssertionError("the thread's context stack did not empty")

    def capture_mode(self, mode: int) -> int:
        """Set this thread's stream capture mode; returns the previous one."""
        value = self._ffi.new("int *", mode)
        assert self._fn["cuThreadExchangeStreamCaptureMode"](value) == 0
        return int(value[0])

    def address(self, ctx: Any) -> int:
        return int(self._ffi.cast("uintptr_t", ctx))


@pytest.fixture
def contexts(cuda: Any) -> Iterator[Contexts]:
    state = Contexts(cuda)
    state.clear()
    yield state
    state.clear()


def tour(cuda: Any, device: int, tmp_path: Path, after: Callable[[str], None]) -> None:
    """Call every entry point that needs a context once on ``device``, ``after(name)`` each."""

    def call(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        after(name)
        return result

    call("memory_info", cuda.memory_info, device)
    call("stream_priority_range", cuda.stream_priority_range, device)
    s = call("stream_create", cuda.stream_create, device, 0)
    other = call("stream_create", cuda.stream_create, device, 0)
    ptr = call("malloc", cuda.malloc, device, 4096)
    host = call("host_malloc", cuda.host_malloc, 4096)
    start = call("event_create", cuda.event_create, device, timing=True, blocking=False, interprocess=False)
    end = call("event_create", cuda.event_create, device, timing=True, blocking=True, interprocess=False)
    call("event_record", cuda.event_record, device, start, s)
    call("memset_async", cuda.memset_async, device, ptr, 3, 4096, s)
    call("memcpy_async", cuda.memcpy_async, device, host, ptr, 4096, s)
    call("launch_host_func", cuda.launch_host_func, device, s, lambda: None)
    call("event_record", cuda.event_record, device, end, s)
    call("stream_wait_event", cuda.stream_wait_event, device, other, end)
    call("stream_query", cuda.stream_query, device, other)
    call("event_query", cuda.event_query, device, start)
    call("event_synchronize", cuda.event_synchronize, device, end)
    call("event_elapsed_ms", cuda.event_elapsed_ms, device, start, end)
    call("stream_synchronize", cuda.stream_synchronize, device, other)
    if cuda.supports_graphs(device):
        call("stream_begin_capture", cuda.stream_begin_capture, device, s, CaptureMode.GLOBAL)
        call("stream_capture_status", cuda.stream_capture_status, device, s)
        call("memset_async (capturing)", cuda.memset_async, device, ptr, 4, 64, s)
        call("launch_host_func (capturing)", cuda.launch_host_func, device, s, lambda: None)
        graph = call("stream_end_capture", cuda.stream_end_capture, device, s)
        call("graph_debug_dump", cuda.graph_debug_dump, device, graph, str(tmp_path / f"graph{device}.dot"))
        graph_exec = call("graph_instantiate", cuda.graph_instantiate, device, graph)
        call("graph_launch", cuda.graph_launch, device, graph_exec, s)
        # A capture that torch ends: accel's part is detached first, and each
        # replay of torch's graph and its reset are reported.
        call("stream_begin_capture", cuda.stream_begin_capture, device, s, CaptureMode.RELAXED)
        call("graph_launch (capturing)", cuda.graph_launch, device, graph_exec, s)
        handle = call("stream_capture_detach", cuda.stream_capture_detach, device, s)
        outer = call("stream_end_capture", cuda.stream_end_capture, device, s)
        outer_exec = call("graph_instantiate", cuda.graph_instantiate, device, outer)
        call("graph_launch", cuda.graph_launch, device, outer_exec, s)
        call("detached_graph_launched", cuda.detached_graph_launched, device, handle, s)
        call("graph_exec_destroy", cuda.graph_exec_destroy, device, outer_exec)
        call("graph_destroy", cuda.graph_destroy, device, outer)
        call("detached_graph_release", cuda.detached_graph_release, device, handle)
        # A capture begun right after a launch (by other code, at the driver):
        # the launch's second check files the host function under it.
        fn, ffi = cuda.driver.fn, cuda.driver.ffi
        real_launch = fn["cuLaunchHostFunc"]

        def launch_then_capture(*args: Any) -> int:
            code = int(real_launch(*args))
            assert fn["cuStreamBeginCapture"](ffi.cast("CUstream", s), CU_STREAM_CAPTURE_MODE_RELAXED) == 0
            return code

        fn["cuLaunchHostFunc"] = launch_then_capture
        try:
            call("launch_host_func (capture begun after it)", cuda.launch_host_func, device, s, lambda: None)
        finally:
            fn["cuLaunchHostFunc"] = real_launch
        call("graph_destroy", cuda.graph_destroy, device, call("stream_end_capture", cuda.stream_end_capture, device, s))
        call("graph_exec_destroy", cuda.graph_exec_destroy, device, graph_exec)
        call("graph_destroy", cuda.graph_destroy, device, graph)
    if cuda.supports_virtual_memory(device):
        g = call("vm_granularity", cuda.vm_granularity, device)
        base = call("vm_reserve", cuda.vm_reserve, device, g)
        chunk = call("vm_create", cuda.vm_create, device, g)
        call("vm_map", cuda.vm_map, device, base, g, chunk)
        call("vm_unmap", cuda.vm_unmap, device, base, g)
        call("vm_release", cuda.vm_release, device, chunk)
        call("vm_free", cuda.vm_free, device, base, g)
    call("device_synchronize", cuda.device_synchronize, device)
    assert ctypes.string_at(host, 4) == b"\x03" * 4
    call("free", cuda.free, device, ptr)
    call("host_free", cuda.host_free, host)
    for e in (start, end):
        call("event_destroy", cuda.event_destroy, device, e)
    for stream in (s, other):
        call("stream_destroy", cuda.stream_destroy, device, stream)


def expect_unchanged(contexts: Contexts) -> Callable[[str], None]:
    before = contexts.current()

    def after(name: str) -> None:
        now = contexts.current()
        assert now == before, f"{name} left context {now:#x} current; it found {before:#x}"

    return after


def devices(count: int) -> list[int]:
    return [0, 1] if count > 1 else [0]


def test_no_current_context_stays_none(cuda: Any, contexts: Contexts, tmp_path: Path) -> None:
    for device in devices(contexts.count):
        tour(cuda, device, tmp_path, expect_unchanged(contexts))
        assert contexts.current() == 0


def test_the_targets_context_stays_current(cuda: Any, contexts: Contexts, tmp_path: Path) -> None:
    for device in devices(contexts.count):
        contexts.push(contexts.primary(device))
        tour(cuda, device, tmp_path, expect_unchanged(contexts))
        contexts.clear()


def test_another_devices_context_stays_current(cuda: Any, contexts: Contexts, tmp_path: Path) -> None:
    # What torch needs: an accel call on device 1 leaves torch's device 0 current, and the reverse.
    if contexts.count < 2:
        pytest.skip("needs two devices")
    for device, current in ((1, 0), (0, 1)):
        contexts.push(contexts.primary(current))
        tour(cuda, device, tmp_path, expect_unchanged(contexts))
        assert contexts.current() == contexts.address(contexts.primary(current))
        contexts.clear()


def test_a_deeper_stack_is_kept(cuda: Any, contexts: Contexts, tmp_path: Path) -> None:
    if contexts.count < 2:
        pytest.skip("needs two devices")
    bottom, top = contexts.primary(0), contexts.primary(1)
    contexts.push(bottom)
    contexts.push(top)
    tour(cuda, 0, tmp_path, expect_unchanged(contexts))
    assert contexts.pop() == contexts.address(top)
    assert contexts.pop() == contexts.address(bottom)
    assert contexts.current() == 0


def test_failing_calls_restore_the_context(cuda: Any, contexts: Contexts, sim: SimControl) -> None:
    if contexts.count < 2:
        pytest.skip("needs two devices")
    s = cuda.stream_create(1, 0)
    g = cuda.vm_granularity(1)
    base, chunk = cuda.vm_reserve(1, g), cuda.vm_create(1, g)
    e = cuda.event_create(1, timing=False, blocking=False, interprocess=False)
    held = cuda.pending_host_functions()
    cuda.stream_begin_capture(1, s, CaptureMode.GLOBAL)
    cuda.launch_host_func(1, s, lambda: None)
    graph = cuda.stream_end_capture(1, s)
    graph_exec = cuda.graph_instantiate(1, graph)
    contexts.push(contexts.primary(0))
    expected = contexts.current()
    failures: list[tuple[str, int, Callable[[], Any], type[AccelError]]] = [
        # Failures in the helpers an entry point calls after its own driver call.
        ("cuEventCreate", 999, lambda: cuda.graph_launch(1, graph_exec, s), DriverError),
        ("cuEventRecord", 999, lambda: cuda.graph_launch(1, graph_exec, s), DriverError),
        ("cuMemsetD8Async", 999, lambda: cuda.memset_async(1, base, 0, 1, s), DriverError),
        ("cuStreamSynchronize", 999, lambda: cuda.stream_synchronize(1, s), DriverError),
        ("cuMemAlloc_v2", 2, lambda: cuda.malloc(1, 4096), OutOfMemoryError),
        # A failure between two driver calls of one entry point.
        ("cuMemSetAccess", 1, lambda: cuda.vm_map(1, base, g, chunk), DriverError),
        ("cuEventQuery", 999, lambda: cuda.event_query(1, e), DriverError),
    ]
    for entry_point, code, call, error in failures:
        sim.fail(entry_point, code)
        with pytest.raises(error):
            call()
        sim.clear()
        assert contexts.current() == expected, f"a failed {entry_point} left another context current"
    contexts.clear()
    cuda.graph_exec_destroy(1, graph_exec)
    cuda.graph_destroy(1, graph)
    cuda.device_synchronize(1)  # lets go of the launches whose bookkeeping event failed
    assert cuda.pending_host_functions() == held
    cuda.event_destroy(1, e)
    cuda.vm_release(1, chunk)
    cuda.vm_free(1, base, g)
    cuda.stream_destroy(1, s)


def test_a_failed_push_changes_nothing(cuda: Any, contexts: Contexts, sim: SimControl) -> None:
    sim.fail("cuCtxPushCurrent_v2", 201)
    with pytest.raises(AccelError, match="cuCtxPushCurrent"):
        cuda.memory_info(0)
    sim.clear()
    assert contexts.current() == 0


def test_relaxed_capture_mode_and_context_both_restored(cuda: Any, contexts: Contexts) -> None:
    # malloc exchanges the capture mode to relaxed around cuMemAlloc; the
    # thread's own mode and its context must both come back, whatever it was.
    if contexts.count < 2:
        pytest.skip("needs two devices")
    contexts.push(contexts.primary(0))
    expected = contexts.current()
    for mode in (CU_STREAM_CAPTURE_MODE_RELAXED, CU_STREAM_CAPTURE_MODE_GLOBAL):
        contexts.capture_mode(mode)
        cuda.free(1, cuda.malloc(1, 4096))
        assert contexts.capture_mode(CU_STREAM_CAPTURE_MODE_GLOBAL) == mode
        assert contexts.current() == expected


def test_no_switch_when_the_context_is_current(
    cuda: Any, contexts: Contexts, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The cost decision: one cuCtxGetCurrent and nothing else when the thread
    # already has the device's context (torch's device); a push and a pop otherwise.
    calls: list[str] = []

    def counted(name: str, real: Callable[..., int]) -> Callable[..., int]:
        def call(*args: Any) -> int:
            calls.append(name)
            return real(*args)

        return call

    for name in ("cuCtxPushCurrent", "cuCtxPopCurrent", "cuCtxSetCurrent"):
        monkeypatch.setitem(cuda.driver.fn, name, counted(name, cuda.driver.fn[name]))
    s = cuda.stream_create(0, 0)
    ptr = cuda.malloc(0, 64)
    calls.clear()
    cuda.memset_async(0, ptr, 0, 64, s)
    assert calls == ["cuCtxPushCurrent", "cuCtxPopCurrent"]
    contexts.push(contexts.primary(0))
    calls.clear()
    cuda.memset_async(0, ptr, 0, 64, s)
    cuda.memcpy_async(0, ptr, ptr, 64, s)
    e = cuda.event_create(0, timing=False, blocking=False, interprocess=False)
    cuda.event_record(0, e, s)
    assert calls == []
    contexts.clear()
    cuda.stream_begin_capture(0, s, CaptureMode.GLOBAL)
    cuda.launch_host_func(0, s, lambda: None)
    graph = cuda.stream_end_capture(0, s)
    graph_exec = cuda.graph_instantiate(0, graph)
    calls.clear()
    # The launch also creates and records an event of its own: one push for all of it.
    cuda.graph_launch(0, graph_exec, s)
    assert calls == ["cuCtxPushCurrent", "cuCtxPopCurrent"]
    cuda.stream_synchronize(0, s)
    cuda.graph_exec_destroy(0, graph_exec)
    cuda.graph_destroy(0, graph)
    cuda.event_destroy(0, e)
    cuda.free(0, ptr)
    cuda.stream_destroy(0, s)


ONE_DEVICE = """
import json
from accel.backends.cuda import load
b = load()
fn, ffi = b.driver.fn, b.driver.ffi
s = b.stream_create(0, 0)
ptr = b.malloc(0, 64)
# Other code on the thread drops the context between two accel calls.
assert fn["cuCtxSetCurrent"](ffi.NULL) == 0
b.memset_async(0, ptr, 1, 64, s)
b.stream_synchronize(0, s)
b.free(0, ptr)
b.stream_destroy(0, s)
current = ffi.new("CUcontext *")
fn["cuCtxGetCurrent"](current)
print(json.dumps({"none_current": current[0] == ffi.NULL}))
"""


def test_one_device_does_not_trust_a_cached_context(sim: SimControl) -> None:
    # With a single device the backend used to remember that it had made the
    # context current and skip the driver; a thread whose context was dropped
    # by someone else then got CUDA_ERROR_INVALID_CONTEXT.
    env = {"ACCEL_CUDA_DRIVER": str(build_simulator()), "ACCEL_SIMCUDA_DEVICE_COUNT": "1"}
    assert run_json(ONE_DEVICE, env) == {"none_current": True}


def test_a_reentrant_call_inside_the_check_keeps_the_device(
    cuda: Any, contexts: Contexts, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A finalizer (accel.Event's) can run an accel call on this thread between
    # the outer call's cuCtxGetCurrent and its compare; the outer call must
    # still run on its own device, not on the one that happened to be current.
    if contexts.count < 2:
        pytest.skip("needs two devices")
    ffi, fn = cuda.driver.ffi, cuda.driver.fn
    event = cuda.event_create(0, timing=False, blocking=False, interprocess=False)
    contexts.push(contexts.primary(1))
    real_get, real_alloc = fn["cuCtxGetCurrent"], fn["cuMemAlloc"]
    reentered: list[bool] = []
    seen: list[int] = []

    def get_then_reenter(out: Any) -> int:
        code = int(real_get(out))
        if not reentered:
            reentered.append(True)
            cuda.event_destroy(0, event)
        return code

    def alloc(out: Any, nbytes: int) -> int:
        current = ffi.new("CUcontext *")
        real_get(current)
        seen.append(contexts.address(current[0]))
        return int(real_alloc(out, nbytes))

    monkeypatch.setitem(fn, "cuCtxGetCurrent", get_then_reenter)
    monkeypatch.setitem(fn, "cuMemAlloc", alloc)
    ptr = cuda.malloc(0, 4096)
    monkeypatch.undo()
    assert reentered == [True]
    assert seen == [contexts.address(contexts.primary(0))], "the allocation ran in another device's context"
    assert contexts.current() == contexts.address(contexts.primary(1))
    cuda.free(0, ptr)


def test_an_interrupt_right_after_the_push_pops_it(
    cuda: Any, contexts: Contexts, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A signal handler's KeyboardInterrupt can surface as the push returns,
    # before the entry point's finally is armed.
    real = cuda.driver.fn["cuCtxPushCurrent"]

    def push_then_interrupt(ctx: Any) -> int:
        real(ctx)
        raise KeyboardInterrupt

    monkeypatch.setitem(cuda.driver.fn, "cuCtxPushCurrent", push_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        cuda.memory_info(0)
    monkeypatch.undo()
    assert contexts.current() == 0


def test_host_memory_uses_the_current_context(
    cuda: Any, contexts: Contexts, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Any context can allocate portable pinned memory; the one torch (or the
    # caller) has current is already there, so no other device's is needed.
    if contexts.count < 2:
        pytest.skip("needs two devices")
    cuda.memory_info(1)  # accel works with device 1
    ffi, fn = cuda.driver.ffi, cuda.driver.fn
    seen: list[int] = []

    def in_context(name: str) -> Callable[..., int]:
        real = fn[name]

        def call(*args: Any) -> int:
            current = ffi.new("CUcontext *")
            fn["cuCtxGetCurrent"](current)
            seen.append(contexts.address(current[0]))
            return int(real(*args))

        return call

    for name in ("cuMemHostAlloc", "cuMemFreeHost"):
        monkeypatch.setitem(fn, name, in_context(name))
    contexts.push(contexts.primary(1))
    cuda.host_free(cuda.host_malloc(64))
    assert seen == [contexts.address(contexts.primary(1))] * 2
    assert contexts.current() == contexts.address(contexts.primary(1))


# Counts the devices whose primary context the backend retains (creates).
COUNT_RETAINS = """
import json
from accel.backends.cuda import load
b = load()
fn = b.driver.fn
real = fn["cuDevicePrimaryCtxRetain"]
retained = []
def retain(out, device):
    retained.append(device)
    return real(out, device)
fn["cuDevicePrimaryCtxRetain"] = retain
"""

ONLY_DEVICE_1 = COUNT_RETAINS + """
s = b.stream_create(1, 0)
host = b.host_malloc(64)  # no context current: the device accel works with
b.memset_async(1, host, 0, 64, s)
b.stream_synchronize(1, s)
b.host_free(host)
b.stream_destroy(1, s)
print(json.dumps(retained))
"""

FRESH = COUNT_RETAINS + """
b.host_free(b.host_malloc(64))
print(json.dumps(retained))
"""


def test_host_memory_creates_no_context_on_a_device_left_unused(sim: SimControl) -> None:
    env = {"ACCEL_CUDA_DRIVER": str(build_simulator()), "ACCEL_SIMCUDA_DEVICE_COUNT": "2"}
    assert run_json(ONLY_DEVICE_1, env) == [1]
    assert run_json(FRESH, env) == [0], "with no device in use yet, device 0's context serves"
