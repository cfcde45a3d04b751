"""The allocator's locks across fork() and garbage collections: a forked child may free what it
inherited without waiting forever on a lock another parent thread held at the fork, and a
free run by a collection never waits on a lock its own thread holds."""

from __future__ import annotations

import threading

import pytest

from accel._errors import NotSupportedError
from accel.allocator._fork import OwnedLock
from tests.conftest import CONFORMANCE_BACKENDS
from tests.fixtures.scripts import ok, run


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_explicit_frees_in_a_forked_child_while_a_parent_thread_hammers_the_allocator(backend: str) -> None:
    code = """
    import os, threading, accel

    stop = threading.Event()

    def hammer():
        while not stop.is_set():
            accel.memory.allocate(4096).free()
            accel.memory.allocate_host(4096).free()

    thread = threading.Thread(target=hammer)
    thread.start()
    for _ in range(150):
        buf, staging = accel.memory.allocate(64), accel.memory.allocate_host(64)
        pid = os.fork()
        if pid == 0:
            try:
                buf.free()  # the parent's memory: released in the child without a hang
                staging.free()
            except accel.AccelError as exc:  # or refused, saying to use spawn
                os._exit(0 if "spawn" in str(exc) else 3)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0, status
        buf.free()
        staging.free()
    stop.set()
    thread.join()
    accel.memory.allocate(64).free()  # the parent's allocator still works
    print("ok")
    """
    ok(run(backend, code, timeout=60))


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_free_run_by_a_garbage_collection_inside_the_allocator_does_not_deadlock(backend: str) -> None:
    """``weakref.finalize(obj, buf.free)``: a collection that starts inside the allocator's
    locked sections (any allocation there can start one) ran free(), which waited forever
    on the lock its own thread held."""
    code = """
    import gc, weakref, accel

    gc.set_threshold(1, 1, 1)  # a collection at nearly every allocation, inside the allocators too

    class Cycle:
        pass

    for i in range(300):
        buf, staging = accel.memory.allocate(4096 * (1 + i % 7)), accel.memory.allocate_host(64)
        c = Cycle()
        c.self = c  # only a collection frees it
        weakref.finalize(c, buf.free)
        weakref.finalize(c, staging.free)
        del c, buf, staging
        accel.memory.allocate(8192).free()
        accel.memory.empty_cache()
    gc.collect()
    accel.memory.empty_cache()
    assert accel.memory.memory_allocated() == 0, accel.memory.memory_allocated()
    print("ok")
    """
    ok(run(backend, code, timeout=60))



@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_forked_child_leaves_the_allocator_core_alone(backend: str) -> None:
    # The common pair calls the core without the allocator's lock, so a parent thread may
    # be inside it (its mutex held) at a fork: the child's pairs and finalizers must not
    # call the core, whose mutex would then never be released.
    code = """
    import os, accel

    buf = accel.memory.allocate(64)
    allocator = buf._allocator
    core = allocator.native_core()
    pid = os.fork()
    if pid == 0:
        before = core.stats()["allocated_bytes.all.current"]
        del buf  # Buffer.__del__: the parent's memory, left to the parent's books
        after = core.stats()["allocated_bytes.all.current"]
        os._exit(0 if (allocator._plain, before) == (False, after) else 3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    buf.free()
    accel.memory.allocate(64).free()  # the parent's allocator still works
    print("ok")
    """
    ok(run(backend, code, timeout=60))


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_forked_child_refuses_the_allocator_a_parent_thread_was_inside(backend: str) -> None:
    # A parent thread inside the lock-free common pair holds the core's mutex (and no
    # lock the fork waits for) at the fork: the child's explicit malloc, free,
    # empty_cache and stats of the inherited DeviceAllocator waited for it forever.
    code = """
    import ctypes, os, signal, threading, accel
    from accel.allocator import get_allocator

    allocator = get_allocator()
    stream = accel.current_stream()
    block = allocator.malloc(4096, stream)
    libc = ctypes.CDLL(None)
    mutex = ctypes.c_void_p(allocator.native_core().address)  # accel_core's first field
    inside, leave = threading.Event(), threading.Event()

    def in_the_core():
        libc.pthread_mutex_lock(mutex)
        inside.set()
        leave.wait()
        libc.pthread_mutex_unlock(mutex)

    thread = threading.Thread(target=in_the_core)
    thread.start()
    inside.wait()
    pid = os.fork()
    if pid == 0:
        signal.alarm(20)  # a hang ends the child (SIGALRM's default action)
        calls = {
            "free": lambda: allocator.free(block),
            "malloc": lambda: allocator.malloc(64, stream),
            "empty_cache": allocator.empty_cache,
            "stats": allocator.stats,
        }
        for name, call in calls.items():
            try:
                call()
            except accel.AccelError as exc:
                if "spawn" not in str(exc):
                    os._exit(3)
            else:
                os._exit(4)
        os._exit(0)
    leave.set()
    thread.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    allocator.free(block)
    allocator.free(allocator.malloc(64, stream))  # the parent's allocator still works
    print("ok")
    """
    ok(run(backend, code, timeout=60))


def test_an_owned_lock_refuses_its_own_thread_and_runs_a_call_only_when_free() -> None:
    lock = OwnedLock("the test's allocator")
    with lock:
        assert lock.owner == threading.get_ident()
        with pytest.raises(NotSupportedError, match="the test's allocator was called again on a thread"):
            lock.acquire()
        assert not lock.acquire(timeout=0) and not lock.call_if_free(pytest.fail, "ran while held")
    assert lock.owner == 0
    seen = []
    assert lock.call_if_free(lambda *args: seen.append((args, lock.owner)), 1, 2)
    assert seen == [((1, 2), threading.get_ident())] and lock.owner == 0

    def boom() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        lock.call_if_free(boom)
    assert lock.acquire(blocking=False) and lock.owner == threading.get_ident()  # given back
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()
