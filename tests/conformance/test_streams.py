"""Streams and events through the public API, the same tests on every backend."""

from __future__ import annotations

import ctypes
import threading
import time

import pytest

import accel
from tests.fixtures import cuda_driver


class Pinned:
    """Host memory from the backend, readable from Python, with ``ptr``/``nbytes``."""

    def __init__(self, runtime, nbytes: int) -> None:
        self.backend, self.nbytes = runtime.backend, nbytes
        self.ptr = self.backend.host_malloc(nbytes)

    def bytes(self) -> bytes:
        return ctypes.string_at(self.ptr, self.nbytes)

    def close(self) -> None:
        self.backend.host_free(self.ptr)


def gate(stream: accel.Stream) -> threading.Event:
    opened = threading.Event()
    stream.launch_host_func(lambda: opened.wait(10))
    return opened


def test_queued_work_is_pending_until_it_runs(runtime) -> None:
    s = accel.Stream()
    opened = gate(s)
    ran = []
    s.launch_host_func(lambda: ran.append(True))
    assert not s.query() and ran == []  # really asynchronous
    opened.set()
    s.synchronize()
    assert s.query() and ran == [True]


def test_events_order_work_across_streams(runtime) -> None:
    producer, consumer = accel.Stream(), accel.Stream()
    seen = []
    opened = gate(producer)
    producer.launch_host_func(lambda: seen.append("produce"))
    ready = producer.record_event()
    consumer.wait_event(ready)
    consumer.launch_host_func(lambda: seen.append("consume"))
    time.sleep(0.05)
    assert seen == [] and not consumer.query() and not ready.query()
    opened.set()
    consumer.synchronize()
    assert seen == ["produce", "consume"] and ready.query()


def test_wait_stream_orders_after_everything_queued(runtime) -> None:
    first, second = accel.Stream(), accel.Stream()
    seen = []
    opened = gate(first)
    first.launch_host_func(lambda: seen.append(1))
    second.wait_stream(first)
    second.launch_host_func(lambda: seen.append(2))
    assert not second.query()
    opened.set()
    second.synchronize()
    assert seen == [1, 2]


def test_elapsed_time_measures_a_known_sleep(runtime) -> None:
    s = accel.Stream()
    start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    start.record(s)
    s.launch_host_func(lambda: time.sleep(0.1))
    end.record(s)
    elapsed = start.elapsed_time(end)  # waits for both
    assert 95.0 <= elapsed < 1000.0


def test_event_errors_mirror_torch(runtime) -> None:
    s = accel.Stream()
    plain, timed = accel.Event(), accel.Event(enable_timing=True)
    assert plain.query()  # never recorded: complete
    plain.synchronize()
    with pytest.raises(accel.InvalidValueError, match="enable_timing=True"):
        plain.elapsed_time(timed)
    other = accel.Event(enable_timing=True)
    timed.record(s)
    with pytest.raises(accel.InvalidValueError, match="must be recorded"):
        timed.elapsed_time(other)


def test_copy_and_fill_through_device_memory(runtime) -> None:
    n = 8192
    src, dst = Pinned(runtime, n), Pinned(runtime, n)
    ctypes.memset(src.ptr, 0x33, n)
    device = runtime.backend.malloc(0, n)
    s = accel.Stream()
    try:
        s.copy(device, src, n)
        s.fill(device, 0x44, 16)
        s.copy(dst, device, n)
        s.synchronize()
        assert dst.bytes() == b"\x44" * 16 + b"\x33" * (n - 16)
        with pytest.raises(accel.InvalidValueError, match="past the end"):
            s.copy(dst, src, n + 1)
        with pytest.raises(accel.InvalidValueError, match="must be a byte"):
            s.fill(dst, 256)
        with pytest.raises(accel.InvalidValueError, match="not memory"):
            s.copy("dst", src)
    finally:
        runtime.backend.free(0, device)
        src.close()
        dst.close()


def test_host_function_errors_surface_at_synchronize(runtime) -> None:
    s = accel.Stream()

    def broken() -> None:
        raise KeyError("boom")

    s.launch_host_func(broken)
    ran = []
    s.launch_host_func(lambda: ran.append(True))  # the stream keeps going
    with pytest.raises(accel.HostFunctionError, match="broken.*KeyError") as info:
        s.synchronize()
    assert isinstance(info.value.__cause__, KeyError) and ran == [True]
    s.synchronize()  # reported once


def test_closed_streams_and_events_are_refused(runtime) -> None:
    s = accel.Stream()
    s.close()
    s.close()  # idempotent
    for call in (s.query, s.synchronize, lambda: s.fill(1, 0, 1), lambda: s.launch_host_func(print)):
        with pytest.raises(accel.InvalidHandleError, match="was closed"):
            call()
    e = accel.Event()
    e.record()
    e.close()
    for call in (e.query, e.synchronize, e.record, lambda: accel.current_stream().wait_event(e)):
        with pytest.raises(accel.InvalidHandleError, match="was closed"):
            call()


def test_streams_of_two_devices_and_events_stay_on_their_device(runtime) -> None:
    if accel.device_count() < 2:
        pytest.skip("one device")
    s0, s1 = accel.Stream(0), accel.Stream(1)
    e = s0.record_event()
    assert e.device.index == 0
    with pytest.raises(accel.DeviceError, match="cannot be recorded on a stream of"):
        e.record(s1)
    s1.wait_event(e)  # any device may wait
    s1.synchronize()


def test_stream_priority_is_clamped(runtime) -> None:
    least, greatest = runtime.backend.stream_priority_range(0)
    assert accel.Stream(priority=greatest - 100).priority == greatest
    assert accel.Stream(priority=least + 100).priority == least
    with pytest.raises(accel.InvalidValueError):
        accel.Stream(priority=1.5)  # type: ignore[arg-type]


def test_external_stream_wraps_without_owning(runtime) -> None:
    s = accel.Stream()
    external = accel.ExternalStream(s.native_handle)
    assert external == s and hash(external) == hash(s)
    external.close()
    s.synchronize()  # the real stream is still alive
    s.close()
    if not (runtime.name == "cuda" and cuda_driver.cuda_mode() == "real"):
        # A destroyed CUstream is undefined behaviour in the real driver; the simulators check handles.
        with pytest.raises(accel.InvalidHandleError):
            accel.ExternalStream(s.native_handle)


def test_many_threads_share_streams_and_events(runtime) -> None:
    shared = accel.Stream()
    counts = [0] * 8
    errors: list[BaseException] = []

    def worker(i: int) -> None:
        try:
            own = accel.Stream()
            for _ in range(25):
                e = shared.record_event()
                own.wait_event(e)
                own.launch_host_func(lambda: counts.__setitem__(i, counts[i] + 1))
                own.record_event().synchronize()
            own.synchronize()
            own.close()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors and counts == [25] * 8


def test_host_function_errors_reach_every_wrapper_of_the_stream(runtime) -> None:
    s = accel.Stream()
    external = accel.ExternalStream(s.native_handle)

    def broken() -> None:
        raise ValueError("through the external wrapper")

    external.launch_host_func(broken)
    with pytest.raises(accel.HostFunctionError, match="through the external wrapper"):
        s.synchronize()
    external.synchronize()  # reported once, to one caller


def test_a_stream_is_idle_once_its_last_recorded_event_completed(runtime) -> None:
    # An event completes after all work before it; when nothing follows it, the
    # stream has no work left, so a thread woken by the event must see it idle.
    # (The simulated CUDA driver signalled the event before it dequeued the
    # record, and a query in between said "not ready"; Level Zero's query
    # appended a barrier of its own and asked whether the device passed it.)
    # Four threads make the window wide enough to be hit.
    busy = []

    def loop() -> None:
        s, e = accel.Stream(), accel.Event()
        for _ in range(1000):
            s.launch_host_func(lambda: None)
            e.record(s)
            e.synchronize()
            if not s.query():
                busy.append(1)

    threads = [threading.Thread(target=loop) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert busy == []
