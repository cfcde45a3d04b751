"""Eager work queued while another thread begins a capture on the same stream.

The backend cannot tell whether a launch it made just before a capture began
on its stream was recorded by that capture or queued for an eager run. It
must keep what such a launch needs (its host functions) for both: until the
capture's graph is gone *and* the eager run is over. These tests make the
capture begin at the worst moment (see ``begin_capture_around_launch``) and
then drop the capture's graph before the eager work had a chance to run.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from accel._errors import CaptureError
from accel.backends.base import CaptureMode
from tests.backends.cuda.conftest import SimControl, captured_host_function
from tests.backends.cuda.test_capture_races import begin_capture_around_launch

D = 0


def block(cuda: Any, stream: int) -> threading.Event:
    """Queue a host function that holds ``stream`` until the returned event is set."""
    gate = threading.Event()
    cuda.launch_host_func(D, stream, lambda: gate.wait(10))
    return gate


def invalidate_and_end(cuda: Any, stream: int) -> None:
    """Invalidate the capture on ``stream`` (a wait on an event recorded outside it) and end it."""
    other = cuda.stream_create(D, 0)
    event = cuda.event_create(D, timing=False, blocking=False, interprocess=False)
    cuda.event_record(D, event, other)
    with pytest.raises(CaptureError):
        cuda.stream_wait_event(D, stream, event)
        cuda.stream_end_capture(D, stream)
    if cuda.stream_capture_status(D, stream):
        with pytest.raises(CaptureError):
            cuda.stream_end_capture(D, stream)
    cuda.event_destroy(D, event)
    cuda.stream_destroy(D, other)


@pytest.mark.parametrize("capture_end", ["graph destroyed", "capture invalidated"])
def test_a_host_function_queued_before_the_capture_still_runs(
    cuda: Any, stream: int, monkeypatch: pytest.MonkeyPatch, capture_end: str
) -> None:
    held = cuda.pending_host_functions()
    gate = block(cuda, stream)
    calls: list[int] = []
    begin_capture_around_launch(cuda, monkeypatch, stream, before=False)
    cuda.launch_host_func(D, stream, lambda: calls.append(1))  # eager: the capture begins right after
    monkeypatch.undo()
    if capture_end == "graph destroyed":
        cuda.graph_destroy(D, cuda.stream_end_capture(D, stream))
    else:
        invalidate_and_end(cuda, stream)
    gate.set()
    cuda.stream_synchronize(D, stream)
    assert calls == [1], "a host function queued before the capture began never ran"
    assert cuda.pending_host_functions() == held


@pytest.mark.parametrize(
    ("entry_point", "before"),
    [
        # The capture begins right after the eager replay's launch.
        ("cuGraphLaunch", False),
        # The backend saw no capture after the launch, but its bookkeeping event
        # was recorded into one: it must not rely on that event (querying it
        # fails with CUDA_ERROR_CAPTURED_EVENT).
        ("cuEventRecord", True),
    ],
    ids=["capture-begun-after-the-launch", "capture-begun-before-the-event-record"],
)
def test_an_eager_replay_keeps_its_host_functions_when_a_capture_begins_around_it(
    cuda: Any, stream: int, monkeypatch: pytest.MonkeyPatch, entry_point: str, before: bool
) -> None:
    held = cuda.pending_host_functions()
    calls: list[str] = []
    inner, inner_exec = captured_host_function(cuda, stream, lambda: calls.append("inner"))
    gate = block(cuda, stream)
    begin_capture_around_launch(cuda, monkeypatch, stream, before=before, entry_point=entry_point)
    cuda.graph_launch(D, inner_exec, stream)  # an eager replay, queued behind the gate
    monkeypatch.undo()
    cuda.graph_destroy(D, cuda.stream_end_capture(D, stream))
    cuda.graph_exec_destroy(D, inner_exec)  # CUDA lets the queued replay finish
    cuda.graph_destroy(D, inner)
    gate.set()
    cuda.stream_synchronize(D, stream)
    assert calls == ["inner"]
    cuda.device_synchronize(D)
    assert cuda.pending_host_functions() == held


def test_a_capture_begun_and_ended_around_the_replays_event_record(
    cuda: Any, stream: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Too quick for the backend to see: the event went into a capture that is
    # over. The query that finds out must not fail unrelated calls.
    held = cuda.pending_host_functions()
    calls: list[str] = []
    inner, inner_exec = captured_host_function(cuda, stream, lambda: calls.append("inner"))
    real = cuda.driver.fn["cuEventRecord"]
    graphs: list[int] = []

    def on_other_thread(fn: Any, *args: Any) -> None:
        thread = threading.Thread(target=lambda: graphs.append(fn(*args)))
        thread.start()
        thread.join(10)

    def record_inside_a_capture(*args: Any) -> int:
        monkeypatch.setitem(cuda.driver.fn, "cuEventRecord", real)
        on_other_thread(cuda.stream_begin_capture, D, stream, CaptureMode.RELAXED)
        code = int(real(*args))
        on_other_thread(cuda.stream_end_capture, D, stream)
        return code

    monkeypatch.setitem(cuda.driver.fn, "cuEventRecord", record_inside_a_capture)
    cuda.graph_launch(D, inner_exec, stream)
    monkeypatch.undo()
    cuda.graph_destroy(D, graphs[-1])
    cuda.stream_synchronize(D, stream)
    cuda.graph_exec_destroy(D, inner_exec)  # checks the event
    cuda.graph_destroy(D, inner)
    assert calls == ["inner"]
    cuda.device_synchronize(D)
    assert cuda.pending_host_functions() == held


def test_a_failed_check_loses_no_retiring_graph_and_fails_no_unrelated_call(cuda: Any, stream: int, sim: SimControl) -> None:
    held = cuda.pending_host_functions()
    calls: list[int] = []
    gate = block(cuda, stream)
    owners = [captured_host_function(cuda, stream, lambda: calls.append(1)) for _ in range(2)]
    for graph, graph_exec in owners:
        cuda.graph_launch(D, graph_exec, stream)  # queued behind the gate
        cuda.graph_exec_destroy(D, graph_exec)
        cuda.graph_destroy(D, graph)
    assert cuda.pending_host_functions() > held
    spare = cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL) or cuda.stream_end_capture(D, stream)
    sim.fail("cuEventQuery", 999)
    # The check of what finished is housekeeping: its failure fails neither call.
    cuda.graph_exec_destroy(D, cuda.graph_instantiate(D, spare))
    sim.clear()
    gate.set()
    cuda.stream_synchronize(D, stream)
    assert calls == [1, 1]
    cuda.graph_destroy(D, spare)
    cuda.device_synchronize(D)
    assert cuda.pending_host_functions() == held


def test_a_failed_check_keeps_what_it_had_found_over(cuda: Any, stream: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check of one parked graph fails after another's was found over: both stay
    parked (nothing leaks), and device_synchronize lets both go."""
    held = cuda.pending_host_functions()
    gate = block(cuda, stream)
    owners = [captured_host_function(cuda, stream, lambda: None) for _ in range(2)]
    for _, graph_exec in owners:
        cuda.graph_launch(D, graph_exec, stream)
    second = cuda._event(next(iter(cuda._exec_events[owners[1][1]].values())))
    for graph, graph_exec in owners:
        cuda.graph_exec_destroy(D, graph_exec)  # parked: the replays wait behind the gate
        cuda.graph_destroy(D, graph)
    gate.set()
    cuda.stream_synchronize(D, stream)
    query = cuda.driver.fn["cuEventQuery"]
    monkeypatch.setitem(cuda.driver.fn, "cuEventQuery", lambda event: 999 if event == second else query(event))
    spare = cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL) or cuda.stream_end_capture(D, stream)
    cuda.graph_exec_destroy(D, cuda.graph_instantiate(D, spare))  # checks: the first is over, the second fails
    monkeypatch.undo()
    cuda.graph_destroy(D, spare)
    cuda.device_synchronize(D)
    assert cuda.pending_host_functions() == held
