"""Host functions on created host streams: the direct path (one append per call,
the worker catching errors) keeps every guarantee of the full path."""

from __future__ import annotations

import gc
import threading

import pytest

import accel
from tests.conftest import CONFORMANCE_BACKENDS
from tests.fixtures import scripts


def test_direct_and_wrapped_work_run_in_queue_order() -> None:
    s = accel.Stream()
    ran: list[object] = []
    buf = accel.memory.allocate(16, stream=s)
    gate = threading.Event()
    s.launch_host_func(lambda: gate.wait(10))
    for i in range(100):
        s.launch_host_func(lambda i=i: ran.append(i))
        if i == 50:
            s.fill(buf, 7)  # a backend item between host functions
            s.launch_host_func(lambda: ran.append("after fill"))
    assert not s.query()
    gate.set()
    s.synchronize()
    assert ran == [*range(51), "after fill", *range(51, 100)]
    assert s.query()
    buf.free()
    s.close()


def test_errors_reach_synchronize_with_the_function_name_and_the_stream_goes_on() -> None:
    s = accel.Stream()
    ran = []

    def failing_host_function() -> None:
        raise ValueError("boom")

    s.launch_host_func(failing_host_function)
    s.launch_host_func(lambda: ran.append(1))
    with pytest.raises(accel.HostFunctionError, match=r"failing_host_function .* raised ValueError: boom") as info:
        s.synchronize()
    assert isinstance(info.value.__cause__, ValueError)
    assert ran == [1]
    s.synchronize()  # reported once
    s.close()


def test_a_callable_object_without_a_name_is_reported_by_its_repr() -> None:
    class Fails:
        def __call__(self) -> None:
            raise KeyError("k")

        def __repr__(self) -> str:
            return "<Fails>"

    s = accel.Stream()
    s.launch_host_func(Fails())
    with pytest.raises(accel.HostFunctionError, match="<Fails> .* raised KeyError"):
        s.synchronize()
    s.close()


UNPRINTABLE_FAILURES = """
import gc
import pytest
import accel


class Unnamed:  # no __qualname__, and a __repr__ that raises
    def __call__(self):
        raise RuntimeError("x")

    def __repr__(self):
        raise ValueError("no repr")


class Unprintable(Exception):
    def __str__(self):
        raise ValueError("no str")


def unprintable():
    raise Unprintable()


s = accel.Stream()
s.launch_host_func(Unnamed())
ran = []
s.launch_host_func(lambda: ran.append(1))
with pytest.raises(accel.HostFunctionError, match=r"<Unnamed object> on .* raised RuntimeError: x"):
    s.synchronize()
assert ran == [1]
s.launch_host_func(unprintable)
with pytest.raises(accel.HostFunctionError, match=r"unprintable on .* raised Unprintable: <str\\(\\) of the Unprintable raised ValueError>") as info:
    s.synchronize()
assert isinstance(info.value.__cause__, Unprintable)
closed = accel.Stream()
closed.launch_host_func(unprintable)
del closed
gc.collect()
with pytest.raises(accel.HostFunctionError, match=r"unprintable on closed stream .* raised Unprintable: <str"):
    accel.synchronize()
print("OK")
"""


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_failure_whose_function_or_exception_cannot_be_printed_is_still_reported(backend: str) -> None:
    """A host function whose repr raised: launch_host_func raised that (cuda, xpu), or
    the host stream's worker died reporting it and the next synchronize hung (cpu).
    An exception whose __str__ raised: synchronize raised that instead, and the
    failure was lost. In a subprocess: the worker's death hangs."""
    scripts.ok(scripts.run(backend, UNPRINTABLE_FAILURES, timeout=120), "OK")


def test_not_callable_and_closed_are_refused_at_the_call() -> None:
    s = accel.Stream()
    with pytest.raises(accel.InvalidValueError, match="is not callable"):
        s.launch_host_func(5)  # type: ignore[arg-type]
    s.close()
    with pytest.raises(accel.InvalidHandleError, match="was closed"):
        s.launch_host_func(lambda: None)


def test_a_kept_launch_host_func_of_a_collected_stream_is_refused() -> None:
    s = accel.Stream()
    launch = s.launch_host_func
    del s
    gc.collect()
    with pytest.raises(accel.InvalidHandleError, match="garbage-collected"):
        launch(lambda: None)


def test_while_capturing_host_functions_are_recorded_not_run() -> None:
    s = accel.Stream()
    ran = []
    g = accel.graph.Graph()
    with accel.graph.graph(g, stream=s):
        s.launch_host_func(lambda: ran.append("replayed"))
    s.synchronize()
    assert ran == []
    g.replay()
    accel.synchronize()
    assert ran == ["replayed"]
    s.launch_host_func(lambda: ran.append("eager"))  # direct again after the capture
    s.synchronize()
    assert ran == ["replayed", "eager"]
    s.close()


def test_threads_launching_on_one_stream_lose_nothing() -> None:
    s = accel.Stream()
    ran: list[tuple[int, int]] = []

    def producer(t: int) -> None:
        for i in range(2000):
            s.launch_host_func(lambda t=t, i=i: ran.append((t, i)))

    threads = [threading.Thread(target=producer, args=(t,)) for t in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    s.synchronize()
    assert len(ran) == 8000
    for t in range(4):  # each thread's functions in its own order
        assert [i for u, i in ran if u == t] == list(range(2000))
    s.close()
