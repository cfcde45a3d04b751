"""Process life cycle with streams: fork, interpreter exit with queued work, SIGINT.

Every case runs in a subprocess with a timeout: what they guard against is a
hang (a forked child waiting for a thread that does not exist, a lock held
across fork) or work silently lost at exit.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.conftest import CONFORMANCE_BACKENDS
from tests.fixtures.scripts import ok, run

# In a forked child: every way of touching accel fails at once, saying to use spawn.
CHILD_IS_REFUSED = """
def child_checks(stream, event, buf):
    import accel
    calls = {
        "Stream()": lambda: accel.Stream(),
        "stream.synchronize": stream.synchronize,
        "stream.launch_host_func": lambda: stream.launch_host_func(print),
        "event.synchronize": event.synchronize,
        "event.record": lambda: event.record(stream),
        "memory.allocate": lambda: accel.memory.allocate(64),
        "empty_cache": accel.memory.empty_cache,
        "synchronize": accel.synchronize,
        "current_stream().synchronize": lambda: accel.current_stream().synchronize(),
        # These reach the parent's allocator without the runtime: free() hung on the
        # allocator's lock when another parent thread held it at the fork.
        "buf.free": buf.free,
        "buf.record_stream": lambda: buf.record_stream(stream),
        "buf.__dlpack__": buf.__dlpack__,
    }
    for name, call in calls.items():
        try:
            call()
        except accel.AccelError as exc:
            assert "spawn" in str(exc), (name, exc)
        else:
            raise AssertionError(f"{name} worked in a forked child")
    # The parent's buffer, collected in the child: never a hang.
    del buf
    __import__("gc").collect()
"""


@pytest.mark.parametrize("busy_thread", [False, True], ids=["idle", "busy-parent-thread"])
@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_forked_child_is_refused_at_once(backend: str, busy_thread: bool) -> None:
    """With a parent thread busy in accel (holding its locks) at the fork, or not."""
    code = (
        CHILD_IS_REFUSED
        + """
import os, threading, accel

stream, event = accel.Stream(), accel.Event()
event.record(stream)
buf = accel.memory.allocate(64, stream=stream)
stop = threading.Event()

def busy():
    while not stop.is_set():
        s = accel.Stream()
        e = s.record_event()
        b = accel.memory.allocate(4096, stream=s)
        s.fill(b, 1)
        s.launch_host_func(lambda: None)
        e.synchronize()
        b.free()
        s.synchronize()
        s.close()
        accel.memory.empty_cache()

worker = threading.Thread(target=busy) if BUSY else None
if worker:
    worker.start()
for _ in range(10 if BUSY else 1):
    pid = os.fork()
    if pid == 0:
        try:
            child_checks(stream, event, buf)
            del buf
        except BaseException as exc:
            print("child failed:", repr(exc), flush=True)
            os._exit(1)
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    buf = accel.memory.allocate(64, stream=stream)
stop.set()
if worker:
    worker.join()
stream.synchronize()  # the parent is untouched
print("ok")
""".replace("BUSY", str(busy_thread))
    )
    ok(run(backend, code))


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_child_forked_while_another_thread_loads_the_backend_is_refused(backend: str) -> None:
    """The loading thread held the backend registry's lock at the fork: the child hung on it
    (and would have used a driver the parent had initialized)."""
    code = """
    import importlib, os, sys, threading, time, accel

    module = importlib.import_module(f"accel.backends.{os.environ['ACCEL_BACKEND']}")
    real_load, loading = module.load, threading.Event()

    def slow_load():
        loading.set()
        time.sleep(1.0)  # the fork happens in here
        return real_load()

    module.load = slow_load
    loader = threading.Thread(target=lambda: accel.memory.allocate(64))
    loader.start()
    loading.wait()
    pid = os.fork()
    if pid == 0:
        try:
            accel.memory.allocate(64)
        except accel.AccelError as exc:
            os._exit(0 if "spawn" in str(exc) else 2)
        os._exit(3)
    _, status = os.waitpid(pid, 0)
    loader.join()
    assert os.waitstatus_to_exitcode(status) == 0, status
    print("ok")
    """
    ok(run(backend, code, timeout=30))


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_child_forked_before_accel_was_used_starts_fresh(backend: str) -> None:
    code = """
    import os, accel
    pid = os.fork()
    if pid == 0:
        ran = []
        s = accel.Stream()
        s.launch_host_func(lambda: ran.append(1))
        s.synchronize()
        os._exit(0 if ran == [1] else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    accel.synchronize()
    print("ok")
    """
    ok(run(backend, code))


def test_a_multiprocessing_fork_pool_reports_the_error(tmp_path: Path) -> None:
    code = """
    import multiprocessing, accel

    def work(i):
        s = accel.Stream()
        s.synchronize()
        return i

    if __name__ == "__main__":
        accel.Stream().synchronize()  # initialized in the parent
        with multiprocessing.get_context("fork").Pool(2) as pool:
            try:
                pool.map(work, range(4))
            except accel.AccelError as exc:
                assert "spawn" in str(exc), exc
            else:
                raise AssertionError("fork pool workers used the parent's accel")
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            assert pool.map(work, range(2)) == [0, 1]
        print("ok")
    """
    # -c scripts cannot be re-imported by spawn workers: run it as a file.
    path = tmp_path / "life_cycle_pool.py"
    path.write_text(textwrap.dedent(code))
    ok(run("cpu", f"import runpy; runpy.run_path({str(path)!r}, run_name='__main__')", timeout=120))


def test_host_functions_queued_at_exit_still_run() -> None:
    result = run(
        "cpu",
        """
        import time, accel
        s = accel.Stream()
        s.launch_host_func(lambda: time.sleep(0.3))
        s.launch_host_func(lambda: print("ran", flush=True))
        """,
    )
    ok(result, "ran")
    assert "dropped" not in result.stderr


def test_host_functions_that_cannot_finish_at_exit_are_reported() -> None:
    result = run(
        "cpu",
        """
        import threading, accel
        s = accel.Stream()
        never = threading.Event()
        s.launch_host_func(lambda: never.wait(60))
        s.launch_host_func(lambda: print("ran", flush=True))
        t = accel.Stream()
        t.launch_host_func(lambda: never.wait(60))
        t.close()
        print("ok")
        """,
    )
    ok(result)
    assert "ran" not in result.stdout
    # Two host functions on s; on t one and the end marker its close() records.
    assert "4 item(s) of work queued on host streams" in result.stderr and "dropped" in result.stderr, result.stderr


# On CUDA and Level Zero the wait happens inside the driver: the backends must wait so
# that the interpreter still runs its signal handlers (helper threads, sliced waits).
@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
@pytest.mark.parametrize("wait", ["stream", "event", "device"])
def test_sigint_interrupts_synchronize_and_leaves_the_stream_usable(backend: str, wait: str) -> None:
    code = """
    import os, signal, threading, time, accel
    s = accel.Stream()
    gate = threading.Event()
    s.launch_host_func(lambda: gate.wait(30))
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
    start = time.monotonic()
    waits = {"stream": s.synchronize, "event": s.record_event().synchronize, "device": accel.synchronize}
    try:
        waits[WAIT]()
    except KeyboardInterrupt:
        waited = time.monotonic() - start
    else:
        raise AssertionError("synchronize returned before the host function ran")
    assert waited < 10, f"KeyboardInterrupt took {waited:.1f} s"
    gate.set()
    s.launch_host_func(lambda: print("after", flush=True))
    s.synchronize()
    e = s.record_event()
    e.synchronize()
    accel.synchronize()
    print("ok")
    """
    result = run(backend, code.replace("WAIT", repr(wait)))
    ok(result)
    assert "after" in result.stdout
