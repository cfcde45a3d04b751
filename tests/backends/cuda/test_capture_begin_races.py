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
