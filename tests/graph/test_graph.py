"""Graph, graph(), is_capturing and pools over the host backend's stream capture."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import accel
from accel.graph import Graph, graph, graph_pool_handle, is_capturing
from tests.conftest import CONFORMANCE_BACKENDS
from tests.fixtures import scripts


def _array(n: int = 64) -> np.ndarray:
    return np.zeros(n, dtype=np.uint8)


def test_stream_work_is_recorded_not_run_and_replays_in_order() -> None:
    dst, src = _array(), np.full(64, 5, dtype=np.uint8)
    seen: list[int] = []
    g = Graph()
    with graph(g):
        s = accel.current_stream()
        assert is_capturing() and s.is_capturing()
        s.fill(dst, 1)
        s.launch_host_func(lambda: seen.append(int(dst[0])))
        s.copy(dst, src)
        s.launch_host_func(lambda: seen.append(int(dst[0])))
    assert not is_capturing()
    assert seen == [] and not dst.any()
    g.replay()
    g.replay()
    accel.synchronize()
    assert seen == [1, 5, 1, 5]
    assert (dst == 5).all()


def test_replay_sees_new_data_at_the_captured_addresses() -> None:
    static_in, out = _array(), _array()
    g = Graph()
    with graph(g):
        accel.current_stream().copy(out, static_in)
    for value in (3, 9):
        static_in[:] = value
        g.replay()
        accel.synchronize()
        assert (out == value).all()


def test_forked_stream_work_replays_with_its_dependencies() -> None:
    seen: list[str] = []
    side = accel.Stream()
    g = Graph()
    with graph(g):
        main = accel.current_stream()
        main.launch_host_func(lambda: seen.append("before"))
        side.wait_stream(main)  # fork: the side stream joins the capture
        side.launch_host_func(lambda: seen.append("side"))
        main.wait_stream(side)  # join
        main.launch_host_func(lambda: seen.append("after"))
    g.replay()
    accel.synchronize()
    assert seen == ["before", "side", "after"]


def test_graph_context_manager_captures_on_the_current_stream_like_torch() -> None:
    arr = _array()
    s = accel.Stream()
    g = Graph()
    with s, g:
        assert accel.current_stream() == s and s.is_capturing()
        s.fill(arr, 2)
    assert not s.is_capturing()
    g.replay()
    accel.synchronize()
    assert (arr == 2).all()


def test_capture_on_the_default_stream_is_refused_and_leaves_nothing_behind() -> None:
    g = Graph()
    with pytest.raises(accel.CaptureError, match="default stream"):
        with g:
            pass
    assert not is_capturing()
    with graph(g):  # the same graph captures fine on a side stream
        accel.current_stream().launch_host_func(lambda: None)
    g.replay()


def test_a_second_capture_needs_reset() -> None:
    g = Graph()
    with graph(g):
        accel.current_stream().launch_host_func(lambda: None)
    with pytest.raises(accel.CaptureError, match="reset"):
        with graph(g):
            pass
    assert not is_capturing()
    g.reset()
    with pytest.raises(accel.CaptureError, match="no captured graph"):
        g.replay()
    with graph(g):
        accel.current_stream().launch_host_func(lambda: None)
    g.replay()


def test_misuse_of_capture_calls_is_refused_with_capture_error() -> None:
    g = Graph()
    with pytest.raises(accel.CaptureError, match="not capturing"):
        g.capture_end()
    with pytest.raises(accel.CaptureError, match="no captured graph"):
        g.replay()
    with pytest.raises(accel.CaptureError, match="without a preceding successful capture"):
        g.pool()
    s = accel.Stream()
    with s:
        g.capture_begin()
        with pytest.raises(accel.CaptureError, match="already capturing"):
            g.capture_begin()
        with pytest.raises(accel.CaptureError, match="while it is capturing"):
            g.replay()
        g.capture_end()


def test_only_one_capture_per_device() -> None:
    g1, g2 = Graph(), Graph()
    with graph(g1):
        with pytest.raises(accel.CaptureError, match="only one capture"):
            with graph(g2, stream=accel.Stream()):
                pass
        accel.current_stream().launch_host_func(lambda: None)
    g1.replay()


def test_invalidated_capture_fails_at_end_and_the_next_capture_works() -> None:
    g = Graph()
    with pytest.raises(accel.CaptureError, match="invalidated"):
        with graph(g):
            s = accel.current_stream()
            with pytest.raises(accel.CaptureError):
                s.synchronize()
    assert not is_capturing()
    with graph(g):
        accel.current_stream().launch_host_func(lambda: None)
    g.replay()


def test_an_exception_in_the_block_abandons_the_capture() -> None:
    g = Graph()
    with pytest.raises(KeyError):
        with graph(g):
            raise KeyError("boom")
    assert not is_capturing()
    with pytest.raises(accel.CaptureError, match="no captured graph"):
        g.replay()


def test_pools_private_and_shared() -> None:
    g1 = Graph()
    with graph(g1):
        accel.current_stream().launch_host_func(lambda: None)
    own = g1.pool()
    assert own[0] > 0 and own[1] == 0
    handle = graph_pool_handle()
    assert handle[0] == 0 and handle[1] > 0
    g2, g3 = Graph(pool=handle), Graph()
    with graph(g2):
        accel.current_stream().launch_host_func(lambda: None)
    with graph(g3, pool=g2.pool()):
        accel.current_stream().launch_host_func(lambda: None)
    assert g2.pool() == g3.pool() == handle


@pytest.mark.parametrize("pool", [(1, 1), (0, 0), (-1, 0), "pool", (1, 0, 0)])
def test_bad_pool_ids_are_refused(pool: object) -> None:
    with pytest.raises(accel.InvalidValueError, match="pool"):
        Graph(pool=pool)  # type: ignore[arg-type]


def test_bad_capture_error_mode_is_refused() -> None:
    with pytest.raises(accel.InvalidValueError, match="thread_local"):
        Graph(capture_error_mode="strict")
    g = Graph()
    with pytest.raises(accel.InvalidValueError, match="capture_error_mode"):
        g.capture_begin(capture_error_mode="loose")
    # An unhashable mode is refused the same way, not with a TypeError from the lookup.
    with pytest.raises(accel.InvalidValueError, match="capture_error_mode"):
        Graph(capture_error_mode=["global"])  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", [[], {}, np.zeros(3), "", 0], ids=["list", "dict", "ndarray", "empty", "zero"])
def test_a_capture_error_mode_of_another_type_is_refused(mode: object) -> None:
    # A list raised TypeError (unhashable), an array ValueError (truth value),
    # and "" or 0 in capture_begin silently meant the constructor's mode.
    with pytest.raises(accel.InvalidValueError, match="capture_error_mode"):
        Graph(capture_error_mode=mode)  # type: ignore[arg-type]
    with pytest.raises(accel.InvalidValueError, match="capture_error_mode"):
        Graph().capture_begin(capture_error_mode=mode)  # type: ignore[arg-type]


@pytest.mark.parametrize("mode", ["default", "global", "thread_local", "relaxed"])
def test_every_capture_mode_captures(mode: str) -> None:
    seen: list[int] = []
    g = Graph(capture_error_mode=mode)
    with graph(g):
        accel.current_stream().launch_host_func(lambda: seen.append(1))
    g.replay()
    accel.synchronize()
    assert seen == [1]


def test_keep_graph_debug_dump_and_explicit_instantiate(tmp_path) -> None:
    g = Graph(keep_graph=True)
    with graph(g):
        accel.current_stream().fill(_array(), 1)
    path = tmp_path / "g.txt"
    g.debug_dump(str(path))
    assert "fill" in path.read_text()
    g.instantiate()
    g.replay()
    dropped = Graph()
    with graph(dropped):
        accel.current_stream().launch_host_func(lambda: None)
    with pytest.raises(accel.CaptureError, match="keep_graph=True"):
        dropped.debug_dump(str(path))
    with pytest.raises(accel.CaptureError, match="keep_graph=True"):
        dropped.instantiate()


def test_enable_debug_mode_keeps_the_graph_as_torch(tmp_path) -> None:
    g = Graph()
    g.enable_debug_mode()
    with graph(g):
        accel.current_stream().fill(_array(), 1)
    g.debug_dump(str(tmp_path / "g.txt"))
    assert "fill" in (tmp_path / "g.txt").read_text()
    with pytest.raises(accel.CaptureError, match="must come before the capture"):
        g.enable_debug_mode()


def test_replay_on_a_created_stream_is_asynchronous() -> None:
    gate = threading.Event()
    seen: list[int] = []
    g = Graph()
    with graph(g):
        accel.current_stream().launch_host_func(lambda: (gate.wait(5), seen.append(1)))
    s = accel.Stream()
    with s:
        g.replay()
    assert seen == [] and not s.query()
    gate.set()
    s.synchronize()
    assert seen == [1]


def test_graph_rejects_a_non_graph_and_a_non_stream() -> None:
    with pytest.raises(accel.InvalidValueError, match="accel.Graph"):
        graph(object())  # type: ignore[arg-type]
    with pytest.raises(accel.InvalidValueError, match="stream"):
        graph(Graph(), stream=7)  # type: ignore[arg-type]


def test_the_package_is_the_capture_context_manager_too() -> None:
    arr = _array()
    g = Graph()
    with accel.graph(g, stream=accel.Stream()):  # like torch.cuda.graph(g)
        accel.current_stream().fill(arr, 4)
    g.replay()
    accel.synchronize()
    assert (arr == 4).all()
    assert accel.graph.graph is graph and accel.graph.Graph is Graph


COLLECTED_INSIDE_THE_ALLOCATOR = """
import gc, sys, threading
import accel
from accel.graph import Graph, graph
g = Graph()
with graph(g):
    accel.current_stream().launch_host_func(lambda: None)
pool = g.pool()
g.cycle = g  # only a collection frees it
allocator = accel.memory.get_allocator()
assert pool in allocator.pool_ids()
del g

def collect_inside_the_allocator():
    with allocator._lock:
        gc.collect()

t = threading.Thread(target=collect_inside_the_allocator, daemon=True)
t.start()
t.join(10)
if t.is_alive():
    print("DEADLOCK", flush=True)
    sys.exit(3)
assert pool not in allocator.pool_ids(), "the deferred release is done at the allocator's next locked call"
print("OK")
"""


def test_a_graph_collected_while_its_allocator_is_locked_gives_its_pool_back_later() -> None:
    """Graph.__del__ can run in a garbage collection triggered anywhere, also
    inside the allocator's locked sections: it must not wait for that lock.
    In a subprocess: a deadlocked allocator would hang this one."""
    result = scripts.run("cpu", COLLECTED_INSIDE_THE_ALLOCATOR, timeout=120)
    assert "DEADLOCK" not in result.stdout, "Graph.__del__ deadlocked on the allocator's lock"
    scripts.ok(result, "OK")


REPLAY_AFTER_FREE = """
import accel
from accel.graph import Graph, graph

buf = accel.memory.allocate(1 << 20)
g = Graph()
with graph(g):
    accel.current_stream().fill(buf, 7, 4096)
buf.free()
accel.memory.empty_cache()  # the buffer's segment goes back to the device
try:
    g.replay()
    accel.synchronize()
except accel.AccelError as exc:
    print(type(exc).__name__, exc)
del g  # the graph's hold on the freed buffer goes with it
import time
deadline = time.monotonic() + 5  # Level Zero releases a collected graph from its worker
while accel.memory.memory_allocated() and time.monotonic() < deadline:
    accel.synchronize()
    accel.memory.allocate(64).free()  # a free deferred from a finalizer happens at the next call
    accel.memory.empty_cache()
    time.sleep(0.01)
assert accel.memory.memory_allocated() == 0, accel.memory.memory_allocated()
print("OK")
"""


def run_script_on(backend: str, script: str, *args: str, timeout: int) -> None:
    """Run ``script`` in a fresh interpreter on ``backend``; it must print OK."""
    scripts.ok(scripts.run(backend, script, *args, timeout=timeout), "OK")


REPLAY_AFTER_FREE_ON_FORKED_STREAMS = """
import accel
from accel.graph import Graph, graph

dst, src = accel.memory.allocate(1 << 20), accel.memory.allocate(1 << 20)
side, further = accel.Stream(), accel.Stream()
g = Graph()
with graph(g):
    main = accel.current_stream()
    side.wait_stream(main)  # fork: side joins the capture
    further.wait_stream(side)  # and a stream forked from the fork
    side.fill(dst, 7, 4096)
    further.copy(src, dst, 4096)
    side.wait_stream(further)
    main.wait_stream(side)  # joined back
dst.free()
src.free()
accel.memory.empty_cache()  # the buffers' segments would go back to the device
assert accel.memory.memory_allocated() == 2 << 20, "the graph holds what its forked streams write"
g.replay()
accel.synchronize()
g.reset()
accel.memory.empty_cache()
assert accel.memory.memory_allocated() == 0, accel.memory.memory_allocated()
print("OK")
"""


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_buffers_written_on_streams_forked_into_a_capture_are_held_too(backend: str) -> None:
    """Copies and fills on any stream of the capture (forked from the capturing
    stream, as CUDA graphs allow) hold their buffers for the graph (a replay after
    their free() wrote to memory given back to the device: SIGSEGV on the host)."""
    run_script_on(backend, REPLAY_AFTER_FREE_ON_FORKED_STREAMS, timeout=120)


RESET_WHILE_A_REPLAY_RUNS = """
import threading, sys
import numpy as np
import accel
from accel.graph import Graph, graph

gate = threading.Event()
buf = accel.memory.allocate(1 << 16)
side = accel.Stream()
g = Graph()
with graph(g):
    s = accel.current_stream()
    s.launch_host_func(lambda: gate.wait(30))
    s.fill(buf, 7)
buf.free()  # held by the graph
with side:
    g.replay()  # on the side stream, held up in the host function
threading.Timer(0.5, gate.set).start()
if sys.argv[1] == "reset":
    g.reset()  # the graph lets go of the freed buffer while its replay still runs
else:
    del g
news = [accel.memory.allocate(1 << 16) for _ in range(4)]
for n in news:
    accel.current_stream().fill(n, 1)
side.synchronize()  # the replay's fill ran
host = np.zeros(1 << 16, dtype=np.uint8)
for n in news:
    accel.current_stream().copy(host, n)
    accel.synchronize()
    assert (host == 1).all(), "a replay still running wrote into memory handed out after the graph let go of it"
print("OK")
"""


@pytest.mark.parametrize("how", ["reset", "del"])
@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_memory_a_graph_lets_go_of_is_reused_only_after_its_running_replays(backend: str, how: str) -> None:
    """A replay on another stream writes a freed buffer the graph held; reset() (or
    the graph's collection) meanwhile handed that memory to the next allocation,
    which the replay then overwrote (host and CUDA; Level Zero waits for the replay)."""
    run_script_on(backend, RESET_WHILE_A_REPLAY_RUNS, how, timeout=120)


RESET_WHILE_ANOTHER_THREAD_REPLAYS = """
import threading, time
import accel
from accel.graph import Graph, graph

side = accel.Stream()
seen = {}
for _ in range(15):
    g = Graph()
    with graph(g):
        s = accel.current_stream()
        s.fill(accel.memory.allocate_host(4096), 1)
        s.launch_host_func(lambda: None)  # on CUDA, host functions the backend keeps per launch
    stop = threading.Event()

    def replay():
        while not stop.is_set():
            try:
                with side:
                    g.replay()
            except BaseException as exc:  # noqa: BLE001
                if not (isinstance(exc, accel.CaptureError) and "holds no captured graph" in str(exc)):
                    key = f"{type(exc).__name__}: {str(exc)[:80]}"
                    seen[key] = seen.get(key, 0) + 1

    t = threading.Thread(target=replay)
    t.start()
    time.sleep(0.01)
    g.reset()
    time.sleep(0.005)
    stop.set()
    t.join(30)
    assert not t.is_alive()
    accel.synchronize()
assert not seen, seen
print("OK")
"""


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_reset_racing_replays_on_another_thread_only_refuses_the_later_replays(backend: str) -> None:
    """Replays racing a reset were handed the handle being destroyed (InvalidHandleError,
    "was instantiated at capture_end and its raw graph dropped", and on CUDA a raw
    KeyError from the backend's host-function bookkeeping); now a reset comes before a
    replay (refused: no captured graph) or after its launch was queued."""
    run_script_on(backend, RESET_WHILE_ANOTHER_THREAD_REPLAYS, timeout=240)


EXIT_WITH_A_GRAPH_REPLAYED_ON_A_SIDE_STREAM = """
import accel
from accel.graph import Graph, graph

side = accel.Stream()
buf = accel.memory.allocate(1 << 16)
g = Graph()
g.cycle = g  # collected by the exit's last collection, after the side stream closed
with graph(g):
    accel.current_stream().fill(buf, 1)
buf.free()  # held by the graph
with side:
    g.replay()  # the held memory is now ordered after the side stream
del g
print("OK")
"""


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_the_interpreter_exits_with_a_graph_that_held_memory_for_a_side_stream(backend: str) -> None:
    """The graph's holds, let go at exit after the side stream closed, made the
    allocator wait for the device, which needs threads that no longer run then: a hang."""
    run_script_on(backend, EXIT_WITH_A_GRAPH_REPLAYED_ON_A_SIDE_STREAM, timeout=60)


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_replaying_a_graph_whose_buffer_was_freed_does_not_crash(backend: str) -> None:
    """The graph holds the memory its captured work writes: a free() meanwhile takes
    effect when the graph is gone (a replay wrote to memory given back to the device)."""
    run_script_on(backend, REPLAY_AFTER_FREE, timeout=120)


ABANDONED_CAPTURE = """
import gc, sys
import accel
from accel._runtime import get_runtime
from accel.graph import Graph

runtime = get_runtime()
buf = accel.memory.allocate(1 << 20)
s = accel.Stream()
g = Graph()
with s:
    g.capture_begin()
    s.fill(buf, 1)  # the capture holds buf: every replay would write it
    kept = accel.memory.allocate(1 << 20)  # from the capture's private pool
assert runtime.capture_holds
kept.free()
buf.free()
if sys.argv[1] == "close":
    s.close()  # drops the capture: nothing can replay it
else:
    del g
    gc.collect()
assert not runtime.capture_holds, runtime.capture_holds
accel.memory.empty_cache()
assert accel.memory.memory_allocated() == 0, accel.memory.memory_allocated()
assert accel.memory.memory_reserved() == 0, accel.memory.memory_reserved()
if sys.argv[1] == "close":
    try:
        g.capture_end()
    except accel.CaptureError as exc:
        assert "was closed" in str(exc), exc
    else:
        raise AssertionError("capture_end() after the stream closed must raise")
    with s.__class__() as again:  # the device captures again
        g.capture_begin()
        again.fill(accel.memory.allocate(64), 2)
        g.capture_end()
print("OK")
"""


@pytest.mark.parametrize("how", ["close", "collect"])
@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_an_abandoned_capture_lets_go_of_what_it_held(backend: str, how: str) -> None:
    """A capture dropped by closing its stream kept its holds (runtime.capture_holds)
    and its pool while the graph lived, so freed buffers' memory and the pool's
    stayed reserved, and empty_cache gave nothing back; a collected graph must
    let go too."""
    run_script_on(backend, ABANDONED_CAPTURE, how, timeout=60)


def test_a_capture_dropped_while_the_backend_fails_still_lets_go(monkeypatch: pytest.MonkeyPatch) -> None:
    """reset() of a capture whose end the backend refused with an error other than
    CaptureError (a driver failure, Ctrl-C) skipped releasing its holds and pool:
    empty_cache then gave nothing back for as long as the process ran."""
    from accel._runtime import get_runtime

    runtime = get_runtime()
    buf = accel.memory.allocate(1 << 20)
    s = accel.Stream()
    g = Graph()
    with s:
        g.capture_begin()
        s.fill(buf, 1)

    def refuse(device: int, stream: int) -> int:
        raise accel.DeviceError("the driver failed")

    real = runtime.backend.stream_end_capture
    monkeypatch.setattr(runtime.backend, "stream_end_capture", refuse)
    with pytest.raises(accel.DeviceError):
        g.reset()
    monkeypatch.setattr(runtime.backend, "stream_end_capture", real)
    assert not runtime.capture_holds
    runtime.backend.graph_destroy(0, real(0, s.native_handle))  # the backend's capture ends here
    buf.free()
    accel.memory.empty_cache()
    assert accel.memory.memory_allocated() == 0


RESET_WHILE_A_REPLAY_NEVER_ENDS = """
import sys, threading, time
import accel
from accel.graph import Graph, graph

gate = threading.Event()
holder = {}

def host_function():
    if sys.argv[1] == "from-its-replay":
        holder.pop("g").reset()  # on the thread that runs the replay's host functions
        gate.set()
    gate.wait()  # "never": set only at the end, or never

g = Graph()
with graph(g):
    accel.current_stream().launch_host_func(host_function)
holder["g"] = g
side = accel.Stream()
with side:
    g.replay()
start = time.monotonic()
if sys.argv[1] == "from-its-replay":
    assert gate.wait(20), "reset() from the replay's own host function hung"
else:
    g.reset()
assert time.monotonic() - start < 20, time.monotonic() - start
print("OK", flush=True)
# The interpreter exits with the replay still blocked (but for "from-its-replay").
"""


@pytest.mark.parametrize("how", ["reset", "from-its-replay"])
@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_reset_does_not_wait_for_a_replay_that_never_ends(backend: str, how: str) -> None:
    """Level Zero's reset() waited without a timeout (and without Ctrl-C) for the last
    replay before destroying the command list: a replay blocked in a host function hung
    it for ever, and a reset from the replay's own host function waited for itself.
    The interpreter then exits with the replay still blocked (bounded, with a warning,
    on the host)."""
    run_script_on(backend, RESET_WHILE_A_REPLAY_NEVER_ENDS, how, timeout=60)
