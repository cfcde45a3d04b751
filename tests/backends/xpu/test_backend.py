"""The XPU backend's own semantics, on accel's simulated Level Zero driver.

The simulator is a CI stand-in: these tests prove the backend drives Level
Zero the way the protocol needs, not how an Intel GPU behaves.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Callable

import pytest

import accel
from accel.backends.base import CaptureMode, CaptureStatus
from tests.backends.xpu.conftest import REPO, require_simulator, run_python
from tests.fixtures.sharing import PENDING_EVENT_EXPORTER

MiB = 1 << 20


def host_buffer(xpu, nbytes: int, value: int = 0) -> int:
    ptr = xpu.host_malloc(nbytes)
    ctypes.memset(ptr, value, nbytes)
    return ptr


def gate(xpu, stream: int) -> threading.Event:
    opened = threading.Event()
    xpu.launch_host_func(0, stream, lambda: opened.wait(10))
    return opened


@pytest.fixture
def stream(xpu):
    handle = xpu.stream_create(0, 0)
    yield handle
    xpu.stream_synchronize(0, handle)
    xpu.stream_destroy(0, handle)


# -- devices and memory --------------------------------------------------------


def test_device_properties_name_the_simulator_and_the_memory_source(xpu) -> None:
    props = xpu.device_properties(0)
    assert props.name == "accel simulated Level Zero device (host memory)"
    assert props.type == "xpu" and props.total_memory == 1 << 30
    assert re.fullmatch(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", props.uuid)
    assert props.uuid != xpu.device_properties(1).uuid
    assert props.extra["memory_info_source"] == "device properties minus accel's own allocations"
    assert props.extra["api_version"] == "1.4"
    # The 1.8 loader lacks it; the backend must have probed, not assumed.
    assert props.extra["loader_has_zeCommandListHostSynchronize"] is False
    assert props.extra["timer_ns_per_tick"] == 10.0  # 1e9 / the simulator's 1e8 cycles per second


def test_memory_info_counts_what_accel_holds(xpu) -> None:
    free_before, total = xpu.memory_info(0)
    ptr = xpu.malloc(0, 3 * MiB)
    try:
        assert xpu.memory_info(0) == (free_before - 3 * MiB, total)
    finally:
        xpu.free(0, ptr)
    assert xpu.memory_info(0) == (free_before, total)


def test_out_of_device_memory_names_the_call_and_leaks_nothing(xpu) -> None:
    free, total = xpu.memory_info(0)
    big = xpu.malloc(0, total // 2 + MiB)
    try:
        with pytest.raises(accel.OutOfMemoryError) as info:
            xpu.malloc(0, total // 2)
        assert info.value.requested == total // 2 and info.value.device == 0
        assert "zeMemAllocDevice" in str(info.value) and "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY" in str(info.value)
    finally:
        xpu.free(0, big)
    assert xpu.memory_info(0) == (free, total)


def test_allocation_above_the_largest_single_allocation_is_out_of_memory(xpu) -> None:
    total = xpu.device_properties(0).total_memory
    with pytest.raises(accel.OutOfMemoryError, match="largest single allocation"):
        xpu.malloc(0, total + 1)


def test_bad_sizes_and_pointers_are_refused(xpu) -> None:
    with pytest.raises(accel.InvalidValueError):
        xpu.malloc(0, 0)
    with pytest.raises(accel.InvalidValueError):
        xpu.host_malloc(-1)
    with pytest.raises(accel.InvalidHandleError, match="not returned by malloc"):
        xpu.free(0, 0x1000)
    host = xpu.host_malloc(64)
    xpu.host_free(host)
    with pytest.raises(accel.InvalidHandleError, match="host_malloc"):
        xpu.host_free(host)
    ptr = xpu.malloc(1, 4096)
    with pytest.raises(accel.InvalidHandleError):
        xpu.free(0, ptr)  # allocated on device 1
    xpu.free(1, ptr)


def test_peer_access_between_simulated_devices(xpu) -> None:
    assert xpu.can_access_peer(0, 1) and xpu.can_access_peer(1, 0)


# -- virtual memory ---------------------------------------------------------------


def test_two_reservations_alias_one_physical_chunk(xpu, stream) -> None:
    g = xpu.vm_granularity(0)
    assert g == 2 * MiB
    a, b = xpu.vm_reserve(0, g), xpu.vm_reserve(0, g)
    chunk = xpu.vm_create(0, g)
    xpu.vm_map(0, a, g, chunk)
    xpu.vm_map(0, b, g, chunk)
    host = host_buffer(xpu, 16)
    try:
        xpu.memset_async(0, a, 0x3C, g, stream)
        xpu.memcpy_async(0, host, b + g - 16, 16, stream)
        xpu.stream_synchronize(0, stream)
        assert ctypes.string_at(host, 16) == b"\x3c" * 16
    finally:
        xpu.host_free(host)
        xpu.vm_unmap(0, a, g)
        xpu.vm_unmap(0, b, g)
        xpu.vm_release(0, chunk)
        xpu.vm_free(0, a, g)
        xpu.vm_free(0, b, g)


def test_released_chunk_holds_memory_until_unmapped(xpu) -> None:
    g = xpu.vm_granularity(0)
    free = xpu.memory_info(0)[0]
    base = xpu.vm_reserve(0, g)
    chunk = xpu.vm_create(0, g)
    xpu.vm_map(0, base, g, chunk)
    xpu.vm_release(0, chunk)
    assert xpu.memory_info(0)[0] == free - g  # still mapped: still held
    with pytest.raises(accel.InvalidHandleError, match="already released"):
        xpu.vm_release(0, chunk)
    with pytest.raises(accel.InvalidValueError, match="still mapped"):
        xpu.vm_free(0, base, g)
    xpu.vm_unmap(0, base, g)
    assert xpu.memory_info(0)[0] == free
    xpu.vm_free(0, base, g)


def test_virtual_memory_misuse_is_refused(xpu) -> None:
    g = xpu.vm_granularity(0)
    with pytest.raises(accel.InvalidValueError, match="granularity"):
        xpu.vm_reserve(0, g + 4096)
    base = xpu.vm_reserve(0, 2 * g)
    chunk = xpu.vm_create(0, g)
    try:
        with pytest.raises(accel.InvalidValueError, match="whole chunk"):
            xpu.vm_map(0, base, 2 * g, chunk)
        with pytest.raises(accel.InvalidValueError, match="not inside a reservation"):
            xpu.vm_map(0, base + 2 * g, g, chunk)
        with pytest.raises(accel.InvalidValueError, match="nothing is mapped"):
            xpu.vm_unmap(0, base, g)
        with pytest.raises(accel.InvalidHandleError, match="no reservation"):
            xpu.vm_free(0, base, g)
    finally:
        xpu.vm_release(0, chunk)
        xpu.vm_free(0, base, 2 * g)


# -- streams ---------------------------------------------------------------------------


def test_default_streams_are_live_command_lists_that_cannot_be_destroyed(xpu) -> None:
    defaults = {xpu.default_stream(d) for d in range(xpu.device_count())}
    assert len(defaults) == xpu.device_count() and 0 not in defaults
    with pytest.raises(accel.InvalidHandleError, match="default stream"):
        xpu.stream_destroy(0, xpu.default_stream(0))
    with pytest.raises(accel.InvalidHandleError, match="xpu:1: stream .* is not a live stream of this device"):
        xpu.stream_query(1, xpu.default_stream(0))  # a stream of another device


def test_destroying_a_stream_lets_queued_work_finish(xpu) -> None:
    s = xpu.stream_create(0, -1)
    opened = gate(xpu, s)
    ran = threading.Event()
    xpu.launch_host_func(0, s, ran.set)
    xpu.stream_destroy(0, s)
    assert not ran.is_set()
    opened.set()
    assert ran.wait(10)
    xpu.device_synchronize(0)


def test_a_raising_host_function_is_printed_without_a_runtime_and_the_stream_goes_on(
    xpu, stream, capfd, monkeypatch
) -> None:
    monkeypatch.setattr(xpu, "host_errors", None)  # the backend alone: nowhere to report to

    def broken() -> None:
        raise ValueError("boom")

    ran = []
    xpu.launch_host_func(0, stream, broken)
    xpu.launch_host_func(0, stream, lambda: ran.append(1))
    xpu.stream_synchronize(0, stream)
    assert ran == [1]
    assert "ValueError: boom" in capfd.readouterr().err


def _raising_function():
    def raise_boom() -> None:
        raise ValueError("boom")

    return raise_boom


def test_a_raising_host_function_is_raised_by_the_stream_s_next_synchronize(xpu) -> None:
    """As on the host backend: accel's own functions the worker runs unwrapped
    (an importer's wait for its exporter, a keep-alive) reach the user, not stderr
    (the importer's select() failure past fd 1023 stayed silent that way)."""
    from accel._runtime import activate

    with activate("xpu") as runtime:
        stream = accel.Stream()
        ran: list[int] = []
        runtime.backend.launch_host_func(0, stream.native_handle, _raising_function())
        runtime.backend.launch_host_func(0, stream.native_handle, lambda: ran.append(1))
        with pytest.raises(accel.HostFunctionError, match=r"host function .*raise_boom on .* raised ValueError: boom"):
            stream.synchronize()
        assert ran == [1]  # the stream went on
        stream.synchronize()  # reported once


def test_a_raising_host_node_of_a_graph_is_raised_by_the_launch_stream_s_synchronize(xpu) -> None:
    from accel._runtime import activate

    with activate("xpu") as runtime:
        origin, launch = accel.Stream(), accel.Stream()
        graph = capture(xpu, origin.native_handle, lambda: xpu.launch_host_func(0, origin.native_handle, _raising_function()))
        graph_exec = xpu.graph_instantiate(0, graph)
        try:
            xpu.graph_launch(0, graph_exec, launch.native_handle)
            with pytest.raises(accel.HostFunctionError, match=r"raise_boom on .* raised ValueError: boom"):
                launch.synchronize()
            origin.synchronize()  # the capture's stream ran nothing
        finally:
            xpu.graph_exec_destroy(0, graph_exec)
            xpu.graph_destroy(0, graph)
        assert runtime.take_host_errors(0, launch.native_handle) == []


def test_long_unsynchronized_streams_keep_working(xpu, stream) -> None:
    # Far more commands than one marker interval and than one event pool.
    host = host_buffer(xpu, 4096)
    try:
        for i in range(600):
            xpu.memset_async(0, host, i % 256, 4096, stream)
        xpu.stream_synchronize(0, stream)
        assert ctypes.string_at(host, 4096) == bytes([599 % 256]) * 4096
    finally:
        xpu.host_free(host)


# -- events ---------------------------------------------------------------------------


def new_event(xpu, timing: bool = False, device: int = 0) -> int:
    return xpu.event_create(device, timing=timing, blocking=False, interprocess=False)


def test_a_wait_queued_before_a_re_record_waits_for_the_old_record(xpu, stream) -> None:
    other, idle = xpu.stream_create(0, 0), xpu.stream_create(0, 0)
    event = new_event(xpu)
    opened = gate(xpu, stream)
    xpu.event_record(0, event, stream)
    xpu.stream_wait_event(0, other, event)
    seen = []
    xpu.launch_host_func(0, other, lambda: seen.append("after"))
    xpu.event_record(0, event, idle)  # re-recorded where nothing is pending
    xpu.event_synchronize(0, event)
    time.sleep(0.05)
    assert seen == [] and not xpu.stream_query(0, other)
    opened.set()
    xpu.stream_synchronize(0, other)
    assert seen == ["after"]
    xpu.event_destroy(0, event)
    for s in (other, idle):
        xpu.stream_destroy(0, s)


def test_destroying_an_event_with_a_pending_wait_keeps_the_waiter_correct(xpu, stream) -> None:
    other = xpu.stream_create(0, 0)
    event = new_event(xpu)
    opened = gate(xpu, stream)
    xpu.event_record(0, event, stream)
    xpu.stream_wait_event(0, other, event)
    seen = []
    xpu.launch_host_func(0, other, lambda: seen.append("after"))
    xpu.event_destroy(0, event)
    # Churn the event pools: a recycled Level Zero event must not be the one waited on.
    churn = [new_event(xpu) for _ in range(200)]
    for e in churn:
        xpu.event_record(0, e, xpu.default_stream(0))
    xpu.stream_synchronize(0, xpu.default_stream(0))
    time.sleep(0.05)
    assert seen == []
    opened.set()
    xpu.stream_synchronize(0, other)
    assert seen == ["after"]
    for e in churn:
        xpu.event_destroy(0, e)
    xpu.stream_destroy(0, other)


def test_events_of_one_device_order_streams_of_another(xpu) -> None:
    s0, s1 = xpu.stream_create(0, 0), xpu.stream_create(1, 0)
    event = new_event(xpu, device=0)
    opened = gate(xpu, s0)
    xpu.event_record(0, event, s0)
    xpu.stream_wait_event(1, s1, event)
    assert not xpu.stream_query(1, s1)
    opened.set()
    xpu.stream_synchronize(1, s1)
    with pytest.raises(accel.InvalidHandleError, match="xpu:1: event .* is not a live event of this device"):
        xpu.event_record(1, event, s1)  # recording stays on the event's device
    xpu.event_destroy(0, event)
    xpu.stream_destroy(0, s0)
    xpu.stream_destroy(1, s1)


def test_elapsed_time_refuses_unrecorded_and_pending_events(xpu, stream) -> None:
    start, end = new_event(xpu, True), new_event(xpu, True)
    with pytest.raises(accel.InvalidValueError, match="never recorded"):
        xpu.event_elapsed_ms(0, start, end)
    opened = gate(xpu, stream)
    xpu.event_record(0, start, stream)
    xpu.event_record(0, end, stream)
    with pytest.raises(accel.InvalidValueError, match="has not completed"):
        xpu.event_elapsed_ms(0, start, end)
    opened.set()
    xpu.event_synchronize(0, end)
    assert 0.0 <= xpu.event_elapsed_ms(0, start, end) < 1000.0
    for e in (start, end):
        xpu.event_destroy(0, e)


def test_interprocess_events_re_arm_one_event_and_cannot_time(xpu, stream) -> None:
    with pytest.raises(accel.NotSupportedError, match="cannot measure time"):
        xpu.event_create(0, timing=True, blocking=False, interprocess=True)
    event = xpu.event_create(0, timing=False, blocking=False, interprocess=True)
    assert xpu.event_query(0, event)  # never recorded: complete, as in CUDA
    for _ in range(2):  # each record re-arms the event's one Level Zero event
        opened = gate(xpu, stream)
        xpu.event_record(0, event, stream)
        assert not xpu.event_query(0, event)
        opened.set()
        xpu.event_synchronize(0, event)
        assert xpu.event_query(0, event)
    xpu.event_destroy(0, event)


# -- capture and replay ------------------------------------------------------------------


def capture(xpu, stream: int, work) -> int:
    xpu.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
    work()
    return xpu.stream_end_capture(0, stream)


def test_an_executable_graph_outlives_its_graph_and_replays_on_any_stream(xpu, stream) -> None:
    n = 8192
    dev = xpu.malloc(0, n)
    host = host_buffer(xpu, n)
    calls: list[int] = []

    def work() -> None:
        xpu.memset_async(0, dev, 0x61, n, stream)
        xpu.memcpy_async(0, host, dev, n, stream)
        xpu.launch_host_func(0, stream, lambda: calls.append(len(calls)))

    graph = capture(xpu, stream, work)
    graph_exec = xpu.graph_instantiate(0, graph)
    xpu.graph_destroy(0, graph)
    other = xpu.stream_create(0, 0)
    try:
        order = (stream, other, stream, other, other, stream, stream, other, stream, other, other, stream)
        for s in order:
            xpu.graph_launch(0, graph_exec, s)
        xpu.stream_synchronize(0, stream)
        assert calls == list(range(len(order)))
        assert ctypes.string_at(host, n) == b"\x61" * n
    finally:
        xpu.graph_exec_destroy(0, graph_exec)
        xpu.stream_destroy(0, other)
        xpu.free(0, dev)
        xpu.host_free(host)
    with pytest.raises(accel.InvalidHandleError, match=f"xpu:0: executable graph {graph_exec:#x} is not a live"):
        xpu.graph_launch(0, graph_exec, stream)
    with pytest.raises(accel.InvalidHandleError, match="executable graph .* not a live"):
        xpu.graph_exec_destroy(0, graph_exec)
    with pytest.raises(accel.InvalidHandleError, match=f"xpu:0: graph {graph:#x} is not a live graph of this device"):
        xpu.graph_destroy(0, graph)


def test_replay_is_ordered_after_earlier_stream_work_and_before_later_work(xpu, stream) -> None:
    seen: list[str] = []
    graph = capture(xpu, stream, lambda: xpu.launch_host_func(0, stream, lambda: seen.append("replay")))
    graph_exec = xpu.graph_instantiate(0, graph)
    opened = gate(xpu, stream)
    xpu.launch_host_func(0, stream, lambda: seen.append("before"))
    xpu.graph_launch(0, graph_exec, stream)
    xpu.launch_host_func(0, stream, lambda: seen.append("after"))
    time.sleep(0.05)
    assert seen == []
    opened.set()
    xpu.stream_synchronize(0, stream)
    assert seen == ["before", "replay", "after"]
    xpu.graph_exec_destroy(0, graph_exec)
    xpu.graph_destroy(0, graph)


def test_capture_misuse_is_refused(xpu, stream) -> None:
    done = new_event(xpu)
    xpu.event_record(0, done, stream)
    graph = capture(xpu, stream, lambda: xpu.launch_host_func(0, stream, lambda: None))
    graph_exec = xpu.graph_instantiate(0, graph)
    xpu.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
    with pytest.raises(accel.CaptureError, match="already capturing"):
        xpu.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
    with pytest.raises(accel.CaptureError, match="inside a capture"):
        xpu.graph_launch(0, graph_exec, stream)
    inner = new_event(xpu)
    xpu.event_record(0, inner, stream)
    with pytest.raises(accel.CaptureError, match="still running"):
        xpu.event_query(0, inner)
    with pytest.raises(accel.CaptureError, match="recorded outside the capture"):
        xpu.stream_wait_event(0, stream, done)
    assert xpu.stream_capture_status(0, stream) == CaptureStatus.INVALIDATED
    with pytest.raises(accel.CaptureError, match="invalidated"):
        xpu.stream_end_capture(0, stream)
    with pytest.raises(accel.CaptureError, match="not capturing"):
        xpu.stream_end_capture(0, stream)
    xpu.graph_exec_destroy(0, graph_exec)
    xpu.graph_destroy(0, graph)
    for e in (done, inner):
        xpu.event_destroy(0, e)


def test_device_synchronize_during_capture_invalidates_it(xpu, stream) -> None:
    xpu.stream_begin_capture(0, stream, CaptureMode.RELAXED)
    with pytest.raises(accel.CaptureError, match="synchronize the device"):
        xpu.device_synchronize(0)
    with pytest.raises(accel.CaptureError):
        xpu.stream_end_capture(0, stream)


def test_graph_debug_dump_lists_the_recorded_commands(xpu, stream, tmp_path) -> None:
    dev = xpu.malloc(0, 4096)
    graph = capture(xpu, stream, lambda: xpu.memset_async(0, dev, 1, 4096, stream))
    path = tmp_path / "graph.txt"
    xpu.graph_debug_dump(0, graph, str(path))
    text = path.read_text()
    assert "regular command list" in text and "fill 4096 bytes" in text
    xpu.graph_destroy(0, graph)
    xpu.free(0, dev)


class _PreemptAfterSlotRead:
    """Forces the interleaving of a re-record race, deterministically.

    The first time ``reader`` reads the event's current Level Zero event (its
    pooled slot), ``interleave`` runs on another thread right after the read,
    as if the reader were preempted there. The reader goes on once
    ``interleave`` has finished, or once it has to wait for the slot pool's
    lock: a reader that reads and holds the slot under that lock (the fix)
    cannot let it through, so waiting longer would deadlock.
    """

    def __init__(self, xpu, monkeypatch, event: int, reader: threading.Thread, interleave: Callable[[], None]) -> None:
        from accel.backends.xpu._records import EventState

        self.other = threading.Thread(target=self._run, args=(interleave,), daemon=True)
        self.errors: list[BaseException] = []
        self._progress = threading.Event()
        self._started = False
        self._reader = reader
        slots, hook = xpu._slots, self

        class Lock:  # the pool lock, reporting when the interleaving thread must wait for it
            def __init__(self, inner) -> None:
                self._inner = inner

            def __enter__(self) -> None:
                if not self._inner.acquire(blocking=False):
                    if threading.current_thread() is hook.other:
                        hook._progress.set()
                    self._inner.acquire()

            def __exit__(self, *exc) -> None:
                self._inner.release()

        class Hooked(EventState):
            def _get(event):
                slot = event.__dict__["slot"]
                if threading.current_thread() is hook._reader and not hook._started:
                    hook._started = True
                    hook.other.start()
                    assert hook._progress.wait(10), "the interleaving thread made no progress"
                return slot

            def _set(event, slot) -> None:
                event.__dict__["slot"] = slot

            slot = property(_get, _set)

        monkeypatch.setattr(slots, "_lock", Lock(slots._lock))
        target = xpu._events[event]
        monkeypatch.setattr(target, "__class__", Hooked)

    def _run(self, interleave: Callable[[], None]) -> None:
        try:
            interleave()
        except BaseException as exc:  # reported by finish()
            self.errors.append(exc)
        finally:
            self._progress.set()

    def finish(self) -> None:
        assert self._started, "the reader never read the event's slot: the hook is not where the race is"
        self.other.join(10)
        assert not self.other.is_alive() and not self.errors, self.errors


@pytest.mark.parametrize("use", ["event_synchronize", "stream_wait_event", "event_query"])
def test_a_concurrent_re_record_cannot_recycle_the_event_a_reader_uses(xpu, stream, monkeypatch, use) -> None:
    """Thread A uses an event while thread B re-records it and records another event:
    the Level Zero event A read must not go back to the pool and serve B's second record
    (gated here) before A waited on it, queued a wait on it or queried it."""
    gated, idle, waiter = xpu.stream_create(0, 0), xpu.stream_create(0, 0), xpu.stream_create(0, 0)
    event, other = new_event(xpu), new_event(xpu)
    xpu.event_record(0, event, stream)
    xpu.stream_synchronize(0, stream)  # the stream lets go of the event's slot: the event alone holds it
    opened = gate(xpu, gated)
    outcome: list[object] = []

    def use_event() -> None:
        try:
            if use == "event_synchronize":
                xpu.event_synchronize(0, event)
            elif use == "stream_wait_event":
                xpu.stream_wait_event(0, waiter, event)
                xpu.stream_synchronize(0, waiter)
            else:
                outcome.append(xpu.event_query(0, event))
        except BaseException as exc:  # reported below, from the test's thread
            outcome.append(exc)

    def re_record() -> None:
        xpu.event_record(0, event, idle)
        xpu.event_record(0, other, gated)  # the pool hands out the slot it got back last

    reader = threading.Thread(target=use_event, daemon=True)
    race = _PreemptAfterSlotRead(xpu, monkeypatch, event, reader, re_record)
    try:
        reader.start()
        reader.join(10)
        hung = reader.is_alive()
    finally:
        opened.set()
        reader.join(10)
        race.finish()
    assert not hung, f"{use} waited on the gated record of another event"
    if use == "event_query":
        assert outcome == [True], "event_query saw the gated record of another event"
    else:
        assert outcome == []
    for s in (gated, idle, waiter):
        xpu.stream_synchronize(0, s)
        xpu.stream_destroy(0, s)
    for e in (event, other):
        xpu.event_destroy(0, e)


# -- entry points newer than the 1.8 loader ------------------------------------------------


class _LoaderWithHostSynchronize:
    """The real loader plus a ``zeCommandListHostSynchronize`` answering ``code``,
    as a newer loader in front of a driver may."""

    def __init__(self, lib: object, code: int) -> None:
        self._lib, self.code, self.calls = lib, code, 0

    def __getattr__(self, name: str) -> object:
        return getattr(self._lib, name)

    def zeCommandListHostSynchronize(self, command_list: object, timeout: int) -> int:
        self.calls += 1
        return self.code


def backend_with_host_synchronize(xpu, code: int):
    from accel.backends.xpu._backend import XpuBackend
    from accel.backends.xpu._bindings import ZeLoader

    ze = xpu._ze
    lib = _LoaderWithHostSynchronize(ze.lib, code)
    count = ze.ffi.new("uint32_t *", 1)
    driver = ze.ffi.new("ze_driver_handle_t[1]")
    assert ze.lib.zeDriverGet(count, driver) == 0
    devices = [xpu._devices[0].cdata]
    return XpuBackend(ZeLoader(ze.ffi, lib, ze.path), driver[0], devices, loader_version="test"), lib


def test_host_synchronize_is_used_when_exported_and_dropped_when_unsupported(xpu) -> None:
    backend, lib = backend_with_host_synchronize(xpu, 0x78000003)  # UNSUPPORTED_FEATURE
    assert backend.device_properties(0).extra["loader_has_zeCommandListHostSynchronize"] is True
    s = backend.stream_create(0, 0)
    host = backend.host_malloc(4096)
    backend.memset_async(0, host, 0x2B, 4096, s)
    backend.stream_synchronize(0, s)  # falls back to a marker event
    backend.stream_synchronize(0, s)
    assert lib.calls == 1 and ctypes.string_at(host, 4096) == b"\x2b" * 4096
    backend.host_free(host)
    backend.stream_destroy(0, s)


def test_host_synchronize_failures_are_driver_errors(xpu) -> None:
    backend, _ = backend_with_host_synchronize(xpu, 0x70000001)  # DEVICE_LOST
    s = backend.stream_create(0, 0)
    with pytest.raises(accel.DriverError) as info:
        backend.stream_synchronize(0, s)
    assert info.value.call == "zeCommandListHostSynchronize" and info.value.name == "ZE_RESULT_ERROR_DEVICE_LOST"
    backend.stream_destroy(0, s)


def test_host_functions_recorded_from_forked_threads_replay_in_order(xpu) -> None:
    """Streams forked into one capture record host functions from their own
    threads; replay serves host nodes in list order, so it must not deadlock."""
    origin = xpu.stream_create(0, 0)
    sides = [xpu.stream_create(0, 0) for _ in range(4)]
    fork = xpu.event_create(0, timing=False, blocking=False, interprocess=False)
    joins = [xpu.event_create(0, timing=False, blocking=False, interprocess=False) for _ in sides]
    calls = [0] * len(sides)
    xpu.stream_begin_capture(0, origin, CaptureMode.GLOBAL)
    xpu.event_record(0, fork, origin)

    def record(i: int) -> None:
        xpu.stream_wait_event(0, sides[i], fork)
        for _ in range(20):
            xpu.launch_host_func(0, sides[i], lambda i=i: calls.__setitem__(i, calls[i] + 1))
        xpu.event_record(0, joins[i], sides[i])

    threads = [threading.Thread(target=record, args=(i,)) for i in range(len(sides))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for join in joins:
        xpu.stream_wait_event(0, origin, join)
    graph = xpu.stream_end_capture(0, origin)
    graph_exec = xpu.graph_instantiate(0, graph)
    replayed = threading.Event()
    xpu.graph_launch(0, graph_exec, origin)
    xpu.launch_host_func(0, origin, replayed.set)
    # No synchronize before this check: on a deadlock it would never return.
    assert replayed.wait(30), "the replay deadlocked: host nodes out of list order"
    assert calls == [20] * len(sides)
    xpu.graph_exec_destroy(0, graph_exec)
    xpu.graph_destroy(0, graph)
    for event in (fork, *joins):
        xpu.event_destroy(0, event)
    for s in (origin, *sides):
        xpu.stream_destroy(0, s)


COLLECTED_INSIDE = """
import gc, sys, threading
import accel
from accel._runtime import activate, get_runtime
kind = sys.argv[1]
with activate("xpu"):
    backend = get_runtime().backend
    obj = accel.Stream() if kind == "stream" else accel.Event()
    if kind == "event":
        obj.record()
    obj.cycle = obj  # only a collection frees it
    stream_lock = backend._streams[obj.native_handle].lock if kind == "stream" else backend._lock
    del obj

    def collect_inside_the_backend():
        # As inside event_record on that very stream, which holds all three.
        with backend._lock, backend._slots._lock, stream_lock:
            gc.collect()

    t = threading.Thread(target=collect_inside_the_backend, daemon=True)
    t.start()
    t.join(10)
    if t.is_alive():
        print("DEADLOCK", flush=True)
        sys.exit(3)
    accel.synchronize()
print("OK")
"""


@pytest.mark.parametrize("kind", ["stream", "event"])
def test_a_stream_or_event_collected_inside_the_backend_does_not_deadlock(kind: str) -> None:
    """Their finalizers destroy them through the backend, and a garbage
    collection can run inside the backend's locked sections (they allocate).
    In a subprocess: a deadlocked backend would hang this one."""
    result = run_python(COLLECTED_INSIDE.replace("sys.argv[1]", repr(kind)), ACCEL_BACKEND="xpu")
    assert "DEADLOCK" not in result.stdout, f"a collected {kind}'s finalizer deadlocked on the backend's lock"
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-2000:]


# -- sharing with other processes ---------------------------------------------------------

EVENT_IMPORTER = """
import pickle, sys, accel
event = pickle.loads(bytes.fromhex(sys.argv[1]))
print("opened", event.query(), flush=True)
try:
    event.synchronize()
    print("completed")
except accel.AccelError as exc:
    print(type(exc).__name__, exc)
"""


def test_an_importer_stops_waiting_on_an_event_whose_exporter_was_killed() -> None:
    # zeEventHostSynchronize without a timeout used to wait forever for a signal
    # that the dead exporter would never send.
    require_simulator()
    env = {**os.environ, "ACCEL_BACKEND": "xpu", "PYTHONPATH": str(REPO)}
    exporter = subprocess.Popen([sys.executable, "-c", PENDING_EVENT_EXPORTER], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, env=env, cwd=REPO)
    importer = None
    try:
        assert exporter.stdout is not None
        pickled = exporter.stdout.readline().strip()
        importer = subprocess.Popen([sys.executable, "-c", EVENT_IMPORTER, pickled], stdout=subprocess.PIPE,
                                    text=True, env=env, cwd=REPO)
        assert importer.stdout is not None
        assert importer.stdout.readline().split() == ["opened", "False"]
    finally:
        exporter.kill()
        exporter.wait(30)
    try:
        out, _ = importer.communicate(timeout=30)
    finally:
        importer.kill()
        importer.wait(30)
    assert out.startswith("InvalidHandleError") and "exited before the work it recorded completed" in out, out


@pytest.mark.parametrize("layout", [
    {"kind": "physical", "lead": 0, "sizes": [2 << 20, 2 << 20]},  # two chunks, one descriptor
    {"kind": "physical", "lead": 0, "sizes": []},
    {"kind": "physical", "lead": 0, "sizes": [0]},
    {"kind": "physical", "lead": 2 << 20, "sizes": [2 << 20]},  # starts past its first chunk
], ids=["descriptors", "no-chunk", "empty-chunk", "lead"])
def test_an_inconsistent_description_of_physical_memory_is_refused_and_its_descriptors_closed(xpu, layout) -> None:
    read_end, write_end = os.pipe()
    try:
        with pytest.raises(accel.InvalidHandleError, match="described its (physical )?memory inconsistently"):
            xpu.ipc_memory_import(0, json.dumps(layout).encode(), [read_end], 1)
        with pytest.raises(BrokenPipeError):  # the backend closed the only read end
            os.write(write_end, b"x")
    finally:
        os.close(write_end)
