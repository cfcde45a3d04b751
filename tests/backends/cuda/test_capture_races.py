"""Host-function bookkeeping when another thread ends or begins a capture in the middle of a launch.

A host function launched into a capturing stream is filed under the capture,
and the capture's end hands it to the graph. These tests make another thread
end (or begin) the capture at the worst moment: a wrapper around the driver's
launch entry point does it right before or after the real launch, before the
backend could file anything. Whatever the interleaving, a graph that recorded
the host function must own it (every replay runs it) and nothing may be left
behind once the graph is gone. RELAXED captures are used because only those
may be ended from another thread.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from accel.backends.base import CaptureMode
from tests.backends.cuda.conftest import SimControl, captured_host_function, run_python
from tests.fixtures.cuda_driver import build_simulator

D = 0


class EndDuringLaunch:
    """Wraps ``entry_point``: after the real call, another thread ends the capture on ``stream``."""

    # How long the launching thread gives the other one to end the capture.
    # While the launch may still file its host functions the end must wait,
    # so with the fix this always runs out; without it the end gets through.
    WINDOW_S = 0.2

    def __init__(self, cuda: Any, monkeypatch: pytest.MonkeyPatch, entry_point: str, stream: int) -> None:
        self.graphs: list[int] = []
        self._cuda = cuda
        self._stream = stream
        self._ended = threading.Event()
        self._thread: threading.Thread | None = None
        real = cuda.driver.fn[entry_point]

        def launch_then_end(*args: Any) -> int:
            code = real(*args)
            if self._thread is None:
                self._thread = threading.Thread(target=self._end)
                self._thread.start()
                self._ended.wait(self.WINDOW_S)
            return int(code)

        monkeypatch.setitem(cuda.driver.fn, entry_point, launch_then_end)

    def _end(self) -> None:
        self.graphs.append(self._cuda.stream_end_capture(D, self._stream))
        self._ended.set()

    def graph(self) -> int:
        assert self._thread is not None, "the wrapped launch never ran"
        self._thread.join(10)
        assert len(self.graphs) == 1, "the other thread did not end the capture"
        return self.graphs[0]


def replay(cuda: Any, graph: int, stream: int, times: int) -> None:
    graph_exec = cuda.graph_instantiate(D, graph)
    for _ in range(times):
        cuda.graph_launch(D, graph_exec, stream)
    cuda.stream_synchronize(D, stream)
    cuda.graph_exec_destroy(D, graph_exec)
    cuda.graph_destroy(D, graph)
    cuda.device_synchronize(D)


def test_capture_ended_during_a_host_function_launch(
    cuda: Any, stream: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    held = cuda.pending_host_functions()
    calls: list[int] = []
    cuda.stream_begin_capture(D, stream, CaptureMode.RELAXED)
    race = EndDuringLaunch(cuda, monkeypatch, "cuLaunchHostFunc", stream)
    cuda.launch_host_func(D, stream, lambda: calls.append(1))
    monkeypatch.undo()
    replay(cuda, race.graph(), stream, 2)
    assert calls == [1, 1]
    assert cuda.pending_host_functions() == held, "the host function outlived its graph"


def test_capture_ended_during_a_graph_launch(cuda: Any, stream: int, monkeypatch: pytest.MonkeyPatch) -> None:
    held = cuda.pending_host_functions()
    calls: list[str] = []
    inner, inner_exec = captured_host_function(cuda, stream, lambda: calls.append("inner"))
    cuda.stream_begin_capture(D, stream, CaptureMode.RELAXED)
    race = EndDuringLaunch(cuda, monkeypatch, "cuGraphLaunch", stream)
    cuda.graph_launch(D, inner_exec, stream)
    monkeypatch.undo()
    outer = race.graph()
    # The outer graph alone must keep the inner host function alive now.
    cuda.graph_exec_destroy(D, inner_exec)
    cuda.graph_destroy(D, inner)
    replay(cuda, outer, stream, 2)
    assert calls == ["inner", "inner"]
    assert cuda.pending_host_functions() == held, "the host functions outlived their graphs"


def test_launch_on_an_idle_stream_does_not_hold_up_captures(
    cuda: Any, stream: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A launch on a stream that is not capturing may block while the device's
    # queue is full; meanwhile other threads must still be able to begin and
    # end captures. The wrapped launch waits until one did.
    other = cuda.stream_create(D, 0)
    done = threading.Event()

    def capture_elsewhere() -> None:
        cuda.stream_begin_capture(D, other, CaptureMode.RELAXED)
        cuda.launch_host_func(D, other, lambda: None)
        cuda.graph_destroy(D, cuda.stream_end_capture(D, other))
        done.set()

    real = cuda.driver.fn["cuLaunchHostFunc"]
    waited: list[bool] = []

    def blocked_launch(*args: Any) -> int:
        monkeypatch.setitem(cuda.driver.fn, "cuLaunchHostFunc", real)  # the other thread's launch is plain
        worker = threading.Thread(target=capture_elsewhere)
        worker.start()
        waited.append(done.wait(10))
        worker.join(10)
        return int(real(*args))

    monkeypatch.setitem(cuda.driver.fn, "cuLaunchHostFunc", blocked_launch)
    ran: list[int] = []
    cuda.launch_host_func(D, stream, lambda: ran.append(1))
    cuda.stream_synchronize(D, stream)
    assert waited == [True], "a capture on another stream waited for a launch outside any capture"
    assert ran == [1]
    cuda.stream_destroy(D, other)


def begin_capture_around_launch(
    cuda: Any, monkeypatch: pytest.MonkeyPatch, stream: int, *, before: bool, entry_point: str = "cuLaunchHostFunc"
) -> None:
    """Make another thread begin a capture on ``stream`` right before (or after) the next ``entry_point`` call."""
    real = cuda.driver.fn[entry_point]

    def begin() -> None:
        other = threading.Thread(target=cuda.stream_begin_capture, args=(D, stream, CaptureMode.RELAXED))
        other.start()
        other.join(10)

    def launch(*args: Any) -> int:
        monkeypatch.setitem(cuda.driver.fn, entry_point, real)
        if before:
            begin()
        code = int(real(*args))
        if not before:
            begin()
        return code

    monkeypatch.setitem(cuda.driver.fn, entry_point, launch)


def test_capture_begun_just_before_a_host_function_launch(
    cuda: Any, stream: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The backend saw no capture, but the driver captured the launch.
    held = cuda.pending_host_functions()
    calls: list[int] = []
    begin_capture_around_launch(cuda, monkeypatch, stream, before=True)
    cuda.launch_host_func(D, stream, lambda: calls.append(1))
    assert calls == []
    replay(cuda, cuda.stream_end_capture(D, stream), stream, 3)
    assert calls == [1, 1, 1], "every replay runs a captured host function"
    assert cuda.pending_host_functions() == held


def test_capture_begun_just_after_a_host_function_launch(
    cuda: Any, stream: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The function was queued before the capture began, so it runs once, now;
    # the backend cannot tell that from a captured one and keeps it for the graph.
    held = cuda.pending_host_functions()
    calls: list[int] = []
    begin_capture_around_launch(cuda, monkeypatch, stream, before=False)
    cuda.launch_host_func(D, stream, lambda: calls.append(1))
    graph = cuda.stream_end_capture(D, stream)
    cuda.stream_synchronize(D, stream)
    assert calls == [1]
    replay(cuda, graph, stream, 2)
    assert calls == [1]
    assert cuda.pending_host_functions() == held


def test_capture_begun_just_before_a_graph_launch(cuda: Any, stream: int, monkeypatch: pytest.MonkeyPatch) -> None:
    held = cuda.pending_host_functions()
    calls: list[str] = []
    inner, inner_exec = captured_host_function(cuda, stream, lambda: calls.append("inner"))
    begin_capture_around_launch(cuda, monkeypatch, stream, before=True, entry_point="cuGraphLaunch")
    cuda.graph_launch(D, inner_exec, stream)
    outer = cuda.stream_end_capture(D, stream)
    cuda.graph_exec_destroy(D, inner_exec)
    cuda.graph_destroy(D, inner)
    replay(cuda, outer, stream, 2)
    assert calls == ["inner", "inner"]
    assert cuda.pending_host_functions() == held


REENTRANT_END = """
import json
from accel.backends.base import CaptureMode
from accel.backends.cuda import load
b = load()
fn = b.driver.fn
launching, capturing = b.stream_create(0, 0), b.stream_create(0, 0)
b.stream_begin_capture(0, capturing, CaptureMode.RELAXED)
real = fn["cuStreamGetCaptureInfo"]
def finalizer_runs_here(*args):
    fn["cuStreamGetCaptureInfo"] = real
    b.graph_destroy(0, b.stream_end_capture(0, capturing))  # as Graph.__del__ would
    return real(*args)
fn["cuStreamGetCaptureInfo"] = finalizer_runs_here
ran = []
b.launch_host_func(0, launching, lambda: ran.append(1))
b.stream_synchronize(0, launching)
print(json.dumps({"ran": ran, "capturing": int(b.stream_capture_status(0, capturing))}))
"""


def test_a_finalizer_ending_a_capture_inside_a_launch_does_not_deadlock(sim: SimControl) -> None:
    # The launch holds the capture lock while it checks for a capture; the
    # garbage collector can run a finalizer on this thread right then.
    env = {"ACCEL_CUDA_DRIVER": str(build_simulator())}
    result = run_python(REENTRANT_END, env, timeout=30)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == {"ran": [1], "capturing": 0}
