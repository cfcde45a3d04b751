"""Host functions run on the driver's callback thread, but are let go on user threads.

CUDA forbids CUDA calls on the callback thread. A host function's closure can
hold objects whose finalizers make such calls (an accel Event or Stream, a
torch tensor), so the last reference to the callable must not be dropped
there: the backend keeps spent callables until the next launch or
synchronize on a user thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

D = 0


class Finalized:
    """Notes the thread its finalizer runs on."""

    def __init__(self, threads: list[str]) -> None:
        self._threads = threads

    def __del__(self) -> None:
        self._threads.append(threading.current_thread().name)


def holding(owner: Finalized, also: Callable[[], None] = lambda: None) -> Callable[[], None]:
    """A host function whose closure holds the only reference to ``owner``."""
    return lambda: (owner, also())[1]


def callback_thread(cuda: Any, stream: int) -> str:
    """The name of the thread that runs ``stream``'s host functions. A finalizer
    must not run there; any user thread will do (this one, or another whose
    garbage collection ran accel's finalizers, which call the backend and so let
    go of spent host functions too)."""
    names: list[str] = []
    cuda.launch_host_func(D, stream, lambda: names.append(threading.current_thread().name))
    cuda.stream_synchronize(D, stream)
    return names[0]


def synchronizers(cuda: Any, stream: int) -> dict[str, Callable[[], None]]:
    def by_event() -> None:
        event = cuda.event_create(D, timing=False, blocking=False, interprocess=False)
        cuda.event_record(D, event, stream)
        cuda.event_synchronize(D, event)
        cuda.event_destroy(D, event)

    return {
        "stream_synchronize": lambda: cuda.stream_synchronize(D, stream),
        "event_synchronize": by_event,
        "device_synchronize": lambda: cuda.device_synchronize(D),
    }


@pytest.mark.parametrize("synchronize", ["stream_synchronize", "event_synchronize", "device_synchronize"])
def test_a_spent_host_function_dies_on_the_synchronizing_thread(cuda: Any, stream: int, synchronize: str) -> None:
    threads: list[str] = []
    cuda.launch_host_func(D, stream, holding(Finalized(threads)))
    synchronizers(cuda, stream)[synchronize]()
    assert len(threads) == 1 and callback_thread(cuda, stream) not in threads


def test_the_next_launch_lets_go_of_spent_host_functions(cuda: Any, stream: int) -> None:
    threads: list[str] = []
    ran = threading.Event()
    launched = threading.Event()
    # The first ends only after the second's launch: a launch lets go of what is
    # spent by then, so a callback thread faster than this one must not finish it first.
    cuda.launch_host_func(D, stream, holding(Finalized(threads), lambda: None if launched.wait(10) else None))
    cuda.launch_host_func(D, stream, ran.set)
    launched.set()
    assert ran.wait(10)
    assert threads == []
    cuda.launch_host_func(D, stream, lambda: None)
    assert len(threads) == 1 and callback_thread(cuda, stream) not in threads


def test_a_failing_host_function_is_let_go_on_a_user_thread(
    cuda: Any, stream: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The exception's traceback holds the call's frames, and what they hold.
    # It is reported as cffi reports any error in a callback.
    threads: list[str] = []
    reports: list[str] = []
    monkeypatch.setattr("sys.unraisablehook", lambda args: reports.append(str(args.exc_value)))

    def fail() -> None:
        local = Finalized(threads)  # noqa: F841 - dies with the frame
        raise ValueError("from a host function")

    cuda.launch_host_func(D, stream, holding(Finalized(threads), fail))
    cuda.stream_synchronize(D, stream)
    assert reports == ["from a host function"]
    assert len(threads) == 2 and callback_thread(cuda, stream) not in threads


def test_replays_torch_drives_do_not_pile_up_spent_callables(cuda: Any, stream: int) -> None:
    """A graph's callable stays in the registry when it runs: nothing is queued
    per replay, even when only torch launches and synchronizes (no accel entry
    point but detached_graph_launched runs)."""
    from accel.backends.base import CaptureMode

    ffi, fn = cuda.driver.ffi, cuda.driver.fn
    calls: list[int] = []
    cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL)
    cuda.launch_host_func(D, stream, lambda: calls.append(1))
    handle = cuda.stream_capture_detach(D, stream)
    graph, graph_exec = ffi.new("CUgraph *"), ffi.new("CUgraphExec *")
    assert fn["cuStreamEndCapture"](ffi.cast("CUstream", stream), graph) == 0
    assert fn["cuGraphInstantiateWithFlags"](graph_exec, graph[0], 0) == 0
    for _ in range(200):
        assert fn["cuGraphLaunch"](graph_exec[0], ffi.cast("CUstream", stream)) == 0  # torch's replay
        cuda.detached_graph_launched(D, handle, stream)
    assert fn["cuStreamSynchronize"](ffi.cast("CUstream", stream)) == 0  # torch's synchronize
    assert len(calls) == 200
    assert len(cuda._spent) == 0, "a replayed graph's callables must not queue up"
    fn["cuGraphExecDestroy"](graph_exec[0])
    fn["cuGraphDestroy"](graph[0])
    cuda.detached_graph_release(D, handle)
    cuda.device_synchronize(D)


def test_a_finalizer_calling_the_backend_as_a_graph_lets_go_of_its_callable(cuda: Any, stream: int) -> None:
    """The last reference to a graph's callable goes outside the registry's lock:
    a finalizer of what it holds may call the backend (an accel Graph's does)."""
    from accel.backends.base import CaptureMode

    class CallsBack:
        def __del__(self) -> None:
            cuda.pending_host_functions()

    def work() -> None:
        owner = CallsBack()
        cuda.stream_begin_capture(D, stream, CaptureMode.GLOBAL)
        cuda.launch_host_func(D, stream, lambda owner=owner: None)
        del owner
        cuda.graph_destroy(D, cuda.stream_end_capture(D, stream))

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(10)
    assert not t.is_alive(), "graph_destroy deadlocked in the finalizer of its host function's closure"


COLLECTED_INSIDE_THE_REGISTRY = """
import gc, sys, threading
import accel
from accel.graph import Graph, graph
assert accel.current_accelerator().type == "cuda"
g = Graph()
with graph(g):
    accel.current_stream().launch_host_func(lambda: None)
g.cycle = g  # only a collection frees it
del g
registry = accel._runtime.get_runtime().backend._host_fns

def collect_inside_the_registry():
    with registry._lock:
        gc.collect()  # Graph.__del__ releases the graph's host functions

t = threading.Thread(target=collect_inside_the_registry, daemon=True)
t.start()
t.join(10)
print("DEADLOCK" if t.is_alive() else "OK", flush=True)
sys.exit(3 if t.is_alive() else 0)
"""


def test_a_graph_collected_inside_the_host_function_registry_does_not_deadlock(sim: Any) -> None:
    """In a subprocess: a deadlocked backend would hang this one."""
    from tests.backends.cuda.conftest import run_python
    from tests.fixtures.cuda_driver import build_simulator

    env = {"ACCEL_CUDA_DRIVER": str(build_simulator()), "ACCEL_BACKEND": "cuda"}
    result = run_python(COLLECTED_INSIDE_THE_REGISTRY, env, timeout=60)
    assert "DEADLOCK" not in result.stdout, "a graph's finalizer deadlocked on the host-function registry's lock"
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-2000:]
