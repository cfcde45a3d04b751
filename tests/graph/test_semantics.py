"""What a capture means, stated once and run on every backend (host, simulated
CUDA, simulated Level Zero): capture records and runs nothing; state a graph
updates in place advances once per replay; outputs hold values after a
replay; what would make a replay differ from eager is refused."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

import pytest

import accel
from accel._runtime import activate
from accel.allocator import allocate, allocate_host
from accel.backends.base import Backend, TorchIntegration

torch = pytest.importorskip("torch")


@pytest.fixture
def rt(backend):
    with activate(backend.name) as runtime:
        yield runtime


def _step_as_host_function(cache: torch.Tensor) -> None:
    """The KV-cache update as stream work every backend records: a host function."""
    accel.current_stream().launch_host_func(lambda: cache.mul_(0.5).add_(1))


def _step_as_torch_ops(cache: torch.Tensor) -> None:
    cache.mul_(0.5).add_(1)


STEPS = {"host_function": _step_as_host_function, "torch_ops": _step_as_torch_ops}


def _records_torch_ops(rt) -> bool:
    # Where torch has no devices of the backend, its CPU ops are not the
    # capture's (as with torch.cuda.graph); the host backend records them.
    return rt.backend.torch_integration is TorchIntegration.RECORD_HOST_OPS


@pytest.mark.parametrize("how", sorted(STEPS))
def test_in_place_state_advances_once_per_replay_and_not_at_capture(rt, how: str) -> None:
    if how == "torch_ops" and not _records_torch_ops(rt):
        pytest.skip(f"torch CPU ops are not part of a {rt.name} capture")
    cache = torch.zeros(4, 8)
    g = accel.Graph()
    g.register_inputs(cache)
    with accel.graph(g):
        STEPS[how](cache)
    accel.synchronize()
    assert torch.equal(cache, torch.zeros(4, 8))  # the capture ran nothing
    for _ in range(3):
        g.replay()
    accel.synchronize()
    assert torch.equal(cache, torch.full((4, 8), 1.75))


def test_outputs_hold_values_after_the_first_replay_and_follow_new_inputs(rt) -> None:
    n = 256
    static_in, out = allocate(n), allocate(n)
    host = allocate_host(n)
    view = (ctypes.c_ubyte * n).from_address(host.ptr)
    s = accel.current_stream()
    s.fill(static_in, 3)
    s.fill(out, 0)
    accel.synchronize()
    g = accel.Graph()
    with accel.graph(g):
        accel.current_stream().copy(out, static_in)
    s.copy(host, out)
    accel.synchronize()
    assert bytes(view) == b"\0" * n  # before any replay: untouched
    for value in (3, 9):
        s.fill(static_in, value)
        g.replay()
        s.copy(host, out)
        accel.synchronize()
        assert bytes(view) == bytes([value]) * n
    g.reset()


def test_synchronizing_a_capturing_stream_invalidates_the_capture(rt) -> None:
    g = accel.Graph()
    with pytest.raises(accel.CaptureError):
        with accel.graph(g):
            accel.current_stream().launch_host_func(lambda: None)
            try:
                accel.current_stream().synchronize()
            except accel.CaptureError:
                pass  # refused now, or the capture fails at its end
    assert not accel.graph.is_capturing()
    with accel.graph(g):  # the device is free for the next capture
        accel.current_stream().launch_host_func(lambda: None)
    g.replay()
    accel.synchronize()


def test_host_torch_outputs_hold_values_only_after_replay(rt) -> None:
    if not _records_torch_ops(rt):
        pytest.skip(f"torch CPU ops are not part of a {rt.name} capture")
    x = torch.ones(4)
    g = accel.Graph()
    with accel.graph(g):
        y = x * 2 + 1
    assert torch.equal(y, torch.zeros(4))  # recorded, not run
    g.replay()
    assert torch.equal(y, torch.full((4,), 3.0))
    x.fill_(5)
    g.replay()
    assert torch.equal(y, torch.full((4,), 11.0))


READS = {
    "item": lambda x: x.sum().item(),
    "bool": lambda x: bool(x[0] > 0),
    "float": lambda x: float(x[0]),
    "tolist": lambda x: torch.tensor(x.tolist()) * 2,
    "numpy": lambda x: x.numpy(),
    "print": lambda x: print(x),
    "format": lambda x: f"{x}",
    "nonzero": lambda x: x.nonzero(),
    "mask": lambda x: x[x > 0],
    "equal": lambda x: torch.equal(x, x),
}


@pytest.mark.parametrize("case", sorted(READS))
def test_reading_values_during_a_host_capture_is_refused_naming_the_op(rt, case: str) -> None:
    if not _records_torch_ops(rt):
        pytest.skip(f"torch CPU ops are not part of a {rt.name} capture")
    x = torch.ones(4)
    g = accel.Graph()
    with pytest.raises(accel.CaptureError, match=r"cannot capture (aten\.|Tensor\.)\w+.*values"):
        with accel.graph(g):
            READS[case](x * 1)
    assert not accel.graph.is_capturing()
    with accel.graph(g):  # nothing left behind: the next capture works
        y = x + 1
    g.replay()
    assert torch.equal(y, torch.full((4,), 2.0))


def test_a_caught_export_refusal_still_fails_the_capture(rt) -> None:
    if not _records_torch_ops(rt):
        pytest.skip(f"torch CPU ops are not part of a {rt.name} capture")
    x = torch.ones(4)
    g = accel.Graph()
    with pytest.raises(accel.CaptureError, match="invalidated.*tolist"):
        with accel.graph(g):
            try:
                x.tolist()
            except accel.CaptureError:
                pass
            y = x * 2  # noqa: F841
    assert x.tolist() == [1.0] * 4  # after the capture, exports work again


def test_capture_time_out_of_memory_comes_from_accels_pool(rt) -> None:
    if not _records_torch_ops(rt):
        pytest.skip(f"torch CPU ops are not part of a {rt.name} capture")
    _, total = accel.get_memory_info()
    x = torch.ones(1)
    g = accel.Graph()
    with pytest.raises(accel.OutOfMemoryError):
        with accel.graph(g):
            x.expand(total // 4 + 1).clone()  # more bytes than the device has
    assert not accel.graph.is_capturing()


def test_a_capture_whose_stream_is_closed_is_dropped_and_frees_the_device(rt) -> None:
    s = accel.Stream()
    g = accel.Graph()
    with s:
        g.capture_begin()
        accel.current_stream().launch_host_func(lambda: None)
    s.close()
    g2 = accel.Graph()
    with accel.graph(g2):  # not "another graph is capturing"
        accel.current_stream().launch_host_func(lambda: None)
    g2.replay()
    accel.synchronize()
    with pytest.raises(accel.CaptureError, match="not capturing"):
        g.capture_end()


def test_capture_end_after_the_capturing_stream_was_closed_says_so(rt) -> None:
    """It raised InvalidHandleError about the closed stream, not that the capture was dropped."""
    s, g = accel.Stream(), accel.Graph()
    with s:
        g.capture_begin()
        accel.current_stream().launch_host_func(lambda: None)
        s.close()
        with pytest.raises(accel.CaptureError, match="was closed, which dropped the capture"):
            g.capture_end()
    assert repr(g).startswith("accel.Graph(empty")


def test_closing_the_side_stream_of_graph_inside_its_block_spoils_no_later_graph(rt) -> None:
    """accel.graph() captures on a side stream shared per device: closed inside a
    block (accel.current_stream().close()), every later graph() raised
    InvalidHandleError for the rest of the process."""
    with pytest.raises(accel.AccelError, match="was closed"):
        with accel.graph(accel.Graph()):
            accel.current_stream().close()
    seen: list[int] = []
    g = accel.Graph()
    with accel.graph(g):
        accel.current_stream().launch_host_func(lambda: seen.append(1))
    g.replay()
    accel.synchronize()
    assert seen == [1]


def test_a_graph_holding_memory_of_another_device_replays_on_any_stream(rt) -> None:
    """A captured peer copy holds the other device's buffer: replaying on a side
    stream ordered the held memory on that stream and raised DeviceError (a stream
    of device 0 for memory of device 1)."""
    if accel.device_count() < 2:
        pytest.skip("needs two devices")
    peer, here = allocate(4096, device=1), allocate(4096, device=0)
    g = accel.Graph()
    with accel.graph(g):
        accel.current_stream().copy(here, peer)
    peer.free()  # held by the graph
    side = accel.Stream()
    with side:
        g.replay()
    side.synchronize()
    g.reset()


def test_a_graph_collected_mid_capture_frees_the_device(rt) -> None:
    import gc

    s = accel.Stream()
    g = accel.Graph()
    with s:
        g.capture_begin()
        accel.current_stream().launch_host_func(lambda: None)
        del g
        gc.collect()
        assert not s.is_capturing()
    g2 = accel.Graph()
    with accel.graph(g2):
        accel.current_stream().launch_host_func(lambda: None)
    g2.replay()
    accel.synchronize()


def test_a_host_function_failing_in_a_replay_is_raised_by_the_next_synchronize(rt) -> None:
    calls = []

    def boom() -> None:
        calls.append(1)
        raise ValueError("boom")

    g = accel.Graph()
    with accel.graph(g):
        accel.current_stream().launch_host_func(boom)
    s = accel.current_stream()
    g.replay()
    with pytest.raises(accel.HostFunctionError, match="boom"):
        s.synchronize()
    s.synchronize()  # reported once
    g.replay()
    with pytest.raises(accel.HostFunctionError, match="boom"):
        s.synchronize()
    assert calls == [1, 1]


def test_a_host_function_failing_in_a_replay_on_another_stream_is_wrapped_once(rt) -> None:
    # The failure was forwarded to the replay stream by a host function raising a
    # HostFunctionError, which that stream's synchronize wrapped again: a
    # HostFunctionError caused by a HostFunctionError caused by the error.
    def boom() -> None:
        raise ValueError("boom")

    g = accel.Graph()
    with accel.graph(g):  # on a side stream: the replays below go to another one
        accel.current_stream().launch_host_func(boom)
    other = accel.Stream()
    with other:
        g.replay()
    once = r"^host function \S*boom in a replay of .* raised ValueError: boom$"
    with pytest.raises(accel.HostFunctionError, match=once) as info:
        other.synchronize()
    assert type(info.value.__cause__) is ValueError
    other.synchronize()  # reported once


def test_replaying_stream_work_without_host_functions_queues_no_host_function(rt, monkeypatch) -> None:
    """A replay on another stream than the capture's forwards host-function
    failures only where the graph can run host functions: on CUDA a forwarder
    is a driver callback taking the GIL on every replay."""
    if type(rt.backend).graph_holds_host_functions is Backend.graph_holds_host_functions:
        pytest.skip(f"the {rt.name} backend cannot tell whether a graph holds host functions")
    buf = allocate(64)
    g = accel.Graph()
    with accel.graph(g):  # on a side stream; replays go to the default stream
        accel.current_stream().fill(buf, 3)
    queued: list[object] = []
    launch = rt.backend.launch_host_func
    monkeypatch.setattr(rt.backend, "launch_host_func", lambda *a: (queued.append(a), launch(*a)))
    for _ in range(3):
        g.replay()
    accel.synchronize()
    assert queued == []


def test_an_empty_capture_warns(rt) -> None:
    g = accel.Graph()
    with pytest.warns(UserWarning, match="captured no work"):
        with accel.graph(g):
            pass
    g.replay()
    accel.synchronize()


def test_events_recorded_in_a_capture_time_each_replay(rt) -> None:
    # PyTorch's test_graph_timing: external events recorded inside the capture.
    import time

    start = accel.Event(enable_timing=True, external=True)
    end = accel.Event(enable_timing=True, external=True)
    g = accel.Graph()
    with accel.graph(g):
        start.record()
        accel.current_stream().launch_host_func(lambda: time.sleep(0.02))
        end.record()
    start.synchronize()  # not recorded by any replay yet: nothing to wait for
    for _ in range(2):
        g.replay()
        accel.synchronize()
        # A lower bound only: the replay slept at least 20 ms between the records.
        assert start.elapsed_time(end) >= 19.0
    assert end.query()


def _gated_signal(stream: accel.Stream, gate: threading.Event, order: list[str], ready: accel.Event) -> None:
    """Queue on ``stream`` work that waits for ``gate`` (the sleep of PyTorch's test), then record ``ready``."""
    stream.launch_host_func(gate.wait)
    stream.launch_host_func(lambda: order.append("signal"))
    ready.record(stream)


def _replays_after_the_signal(g: accel.Graph, signal: Callable[[], None], order: list[str], done: accel.Event) -> None:
    gate_opened = signal()
    try:
        with accel.Stream():
            g.replay()
        # The replay's record of `done` counts from the launch: pending while the gate holds.
        assert not done.query()
        assert order.count("graph") == order.count("signal")  # the graph's work waits too
    finally:
        gate_opened()  # else the signalling stream waits forever
    done.synchronize()
    assert order[-2:] == ["signal", "graph"]


@pytest.mark.parametrize("recorded_before_capture", [False, True], ids=["never_recorded", "recorded"])
def test_a_capture_keeps_a_wait_on_an_external_event_recorded_outside_it(rt, recorded_before_capture: bool) -> None:
    """PyTorch's test_graph_external_wait_and_record: inside a capture, a wait on an
    ``external=True`` event recorded elsewhere is an event-wait node; each replay
    waits for the event's last record as of its launch. Before, the wait was
    refused (recorded before the capture) or silently left out (never recorded)."""
    ready = accel.Event(external=True)
    done = accel.Event(external=True)
    signal, gate, order = accel.Stream(), threading.Event(), []
    if recorded_before_capture:
        ready.record(signal)
    g = accel.Graph()
    with accel.graph(g):
        ready.wait()
        accel.current_stream().launch_host_func(lambda: order.append("graph"))
        done.record()

    def gated() -> Callable[[], None]:
        gate.clear()
        _gated_signal(signal, gate, order, ready)
        return gate.set

    for _ in range(2):
        _replays_after_the_signal(g, gated, order, done)
    assert order == ["signal", "graph"] * 2


def test_a_capture_waits_on_an_external_event_another_graph_records(rt) -> None:
    ready = accel.Event(external=True)
    done = accel.Event(external=True)
    signal, gate, order = accel.Stream(), threading.Event(), []
    signalling = accel.Graph()
    with accel.graph(signalling):
        accel.current_stream().launch_host_func(gate.wait)
        accel.current_stream().launch_host_func(lambda: order.append("signal"))
        ready.record()
    waiting = accel.Graph()
    with accel.graph(waiting):
        ready.wait()
        accel.current_stream().launch_host_func(lambda: order.append("graph"))
        done.record()

    def gated() -> Callable[[], None]:
        gate.clear()
        with signal:
            signalling.replay()
        return gate.set

    for _ in range(2):
        _replays_after_the_signal(waiting, gated, order, done)
    assert order == ["signal", "graph"] * 2


def test_a_capture_may_wait_on_an_external_event_it_records_itself(rt) -> None:
    marker = accel.Event(external=True)
    order: list[int] = []
    g = accel.Graph()
    with accel.graph(g):
        s = accel.current_stream()
        s.launch_host_func(lambda: order.append(1))
        marker.record()
        marker.wait()
        s.launch_host_func(lambda: order.append(2))
    for _ in range(2):
        g.replay()
    accel.synchronize()
    assert order == [1, 2, 1, 2]


def test_waiting_on_an_event_recorded_outside_the_capture_is_refused_unless_external(rt) -> None:
    plain = accel.Event()
    plain.record(accel.Stream())
    g = accel.Graph()
    with pytest.raises(accel.CaptureError, match="external=True"):
        with accel.graph(g):
            accel.current_stream().launch_host_func(lambda: None)
            plain.wait()
    assert not accel.graph.is_capturing()


def test_an_external_event_recorded_outside_a_capture_is_an_ordinary_record(rt) -> None:
    s = accel.Stream()
    start = accel.Event(enable_timing=True, external=True)
    end = accel.Event(enable_timing=True, external=True)
    start.record(s)
    end.record(s)
    end.synchronize()
    assert start.elapsed_time(end) >= 0.0


def test_the_pinned_host_cache_works_inside_a_capture_and_gives_no_block_of_a_graph_to_another(rt) -> None:
    n = 4096
    src = allocate(n)
    accel.current_stream().fill(src, 7)
    accel.synchronize()
    g = accel.Graph()
    with accel.graph(g):
        s = accel.current_stream()
        staging = allocate_host(n)  # no event query of the capture's events
        s.copy(staging, src)
        staging.record_stream(s)
        used_by_g = staging.ptr
        staging.free()  # freed inside the capture: the graph's copy still writes it
        other = allocate_host(n)  # no event query here either
        assert other.ptr != used_by_g
        other.free()
    for _ in range(3):  # later staging never lands on the block the graph writes
        h = allocate_host(n)
        assert h.ptr != used_by_g
        h.free()
    g.replay()
    accel.synchronize()
    view = (ctypes.c_ubyte * n).from_address(used_by_g)
    assert bytes(view) == b"\x07" * n  # the graph's block, still the graph's
    g.reset()
    accel.synchronize()
    allocate_host(n).free()  # the cache still works once the graph is gone


def test_staging_used_by_a_capture_and_freed_after_it_stays_the_graphs(rt) -> None:
    n = 4096
    src = allocate(n)
    staging = allocate_host(n)
    g = accel.Graph()
    with accel.graph(g):
        s = accel.current_stream()
        s.copy(staging, src)
        staging.record_stream(s)
    used_by_g = staging.ptr
    staging.free()
    h = allocate_host(n)
    assert h.ptr != used_by_g  # g's replays still write the block
    h.free()
    del g
    import gc

    gc.collect()
    accel.synchronize()
    assert allocate_host(n).ptr == used_by_g  # back in the cache once the graph is gone


def test_staging_a_capture_copies_from_is_the_graphs_until_it_is_gone_without_record_stream(rt) -> None:
    # As a device buffer the captured work uses: the graph holds it (before, a HostBuffer
    # freed after the capture was reused at once, and the replays read the next owner's data).
    n = 4096
    dst = allocate(n)
    staging = allocate_host(n)
    g = accel.Graph()
    with accel.graph(g):
        accel.current_stream().copy(dst, staging)
    used_by_g = staging.ptr
    staging.free()
    h = allocate_host(n)
    assert h.ptr != used_by_g  # g's replays still read the block
    h.free()
    g.reset()
    accel.synchronize()
    assert allocate_host(n).ptr == used_by_g  # back in the cache once the graph let go


def test_a_captured_copy_from_pageable_host_memory_is_refused_where_cuda_refuses_it(rt) -> None:
    if rt.name != "cuda":
        pytest.skip(f"the {rt.name} backend copies from any host memory, captured or not")
    n = 256
    pageable = bytearray(n)
    dst = allocate(n)
    g = accel.Graph()
    with pytest.raises(accel.CaptureError, match="pageable host memory.*allocate_host"):
        with accel.graph(g):
            accel.current_stream().copy(dst, pageable)
    assert not accel.graph.is_capturing()
    staging = allocate_host(n)  # what the error says to do instead
    with accel.graph(g):
        accel.current_stream().copy(dst, staging)
    g.replay()
    accel.synchronize()
