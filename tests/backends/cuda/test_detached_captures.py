"""Captures that another runtime ends (torch's CUDAGraph), seen from the backend.

The graph layer calls ``stream_capture_detach`` just before torch ends the
capture, ``detached_graph_launched`` after each replay of torch's graph and
``detached_graph_release`` when torch's graph is reset. Here the driver's own
``cuStreamEndCapture`` stands in for torch: the backend never sees the end.
"""

from __future__ import annotations

import threading
from typing import Any

import pytest

from accel._errors import InvalidHandleError
from accel.backends.base import CaptureMode
from tests.backends.cuda.conftest import captured_host_function

D = 0


def end_as_torch_does(cuda: Any, stream: int) -> tuple[int, int]:
    """End the capture at the driver, bypassing the backend; (graph, executable graph)."""
    ffi, fn = cuda.driver.ffi, cuda.driver.fn
    graph = ffi.new("CUgraph *")
    assert fn["cuStreamEndCapture"](ffi.cast("CUstream", stream), graph) == 0
    address = int(ffi.cast("uintptr_t", graph[0]))
    return address, cuda.graph_instantiate(D, address)


def replay_and_release(cuda: Any, handle: int, graph: int, graph_exec: int, stream: int, times: int) -> None:
    for _ in range(times):
        cuda.graph_launch(D, graph_exec, stream)
        cuda.detached_graph_launched(D, handle, stream)
    cuda.graph_exec_destroy(D, graph_exec)
    cuda.graph_destroy(D, graph)
    cuda.detached_graph_release(D, handle)
    cuda.stream_synchronize(D, stream)
    cuda.device_synchronize(D)


@pytest.mark.parametrize("before_detach", [0, 1])
def test_host_functions_launched_after_the_detach_go_to_the_handle(
    cuda: Any, stream: int, before_detach: int
) -> None:
    held = cuda.pending_host_functions()
    calls: list[str] = []
    cuda.stream_begin_capture(D, stream, CaptureMode.RELAXED)
    for _ in range(before_detach):
        cuda.launch_host_func(D, stream, lambda: calls.append("before"))
    handle = cuda.stream_capture_detach(D, stream)
    assert handle, "a detached capture always gets a handle: more may be launched into it"
    # Another thread launches into the relaxed capture before torch ends it.
    worker = threading.Thread(target=cuda.launch_host_func, args=(D, stream, lambda: calls.append("after")))
    worker.start()
    worker.join(10)
    graph, graph_exec = end_as_torch_does(cuda, stream)
    replay_and_release(cuda, handle, graph, graph_exec, stream, 2)
    assert calls == (["before"] * before_detach + ["after"]) * 2
    assert cuda.pending_host_functions() == held, "a host function filed after the detach outlived the graph"


def test_a_graph_launched_into_a_detached_capture(cuda: Any, stream: int) -> None:
    held = cuda.pending_host_functions()
    calls: list[str] = []
    inner, inner_exec = captured_host_function(cuda, stream, lambda: calls.append("inner"))
    cuda.stream_begin_capture(D, stream, CaptureMode.RELAXED)
    handle = cuda.stream_capture_detach(D, stream)
    cuda.graph_launch(D, inner_exec, stream)  # after the detach, still in the capture
    graph, graph_exec = end_as_torch_does(cuda, stream)
    cuda.graph_exec_destroy(D, inner_exec)
    cuda.graph_destroy(D, inner)
    replay_and_release(cuda, handle, graph, graph_exec, stream, 2)
    assert calls == ["inner", "inner"]
    assert cuda.pending_host_functions() == held


def test_an_empty_detached_capture(cuda: Any, stream: int) -> None:
    cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL)
    handle = cuda.stream_capture_detach(D, stream)
    graph, graph_exec = end_as_torch_does(cuda, stream)
    replay_and_release(cuda, handle, graph, graph_exec, stream, 1)
    with pytest.raises(InvalidHandleError):
        cuda.detached_graph_launched(D, handle, stream)
    with pytest.raises(InvalidHandleError):
        cuda.detached_graph_release(D, handle)
