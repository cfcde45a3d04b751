"""The core steps (accel/_speedups.c's CoreSteps): a core block and its handle in the
allocator's ``_live`` change together, in one C call, so that neither a racing free nor
an interrupt (Ctrl-C's KeyboardInterrupt, raised between bytecodes) separates them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

import accel
from accel._errors import InvalidHandleError
from accel._runtime import Runtime
from accel.allocator._blocks import ALLOCATED, PENDING, RETIRED, CoreBlock
from accel.allocator._caching import DeviceAllocator
from accel.allocator._native_core import NO_RETRY
from accel.allocator.config import AllocatorConfig
from accel.backends.cpu import CpuBackend
from tests.conftest import backend_skip_reason

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def pair():
    backend = CpuBackend(1, None)
    runtime = Runtime(backend)
    return DeviceAllocator(backend, 0, AllocatorConfig()), runtime.default_stream(0)


def _allocated(a: DeviceAllocator) -> int:
    return a.stats()["allocated_bytes.all.current"]


def test_a_block_and_its_handle_come_and_go_together(pair):
    a, s = pair
    b = a._steps.malloc(1000, s._handle, 0, NO_RETRY)
    assert isinstance(b, CoreBlock) and b.state == ALLOCATED and b.owner is a
    assert (b.size, b.requested, b.stream, b.segment, b.stream_uses) == (1024, 1000, s._handle, None, None)
    assert a._live[b.ptr] is b and s._handle in a._known and _allocated(a) == 1024
    a._steps.free(b)
    assert b.state == RETIRED and b.ptr not in a._live and _allocated(a) == 0


def test_a_held_block_stays_live_until_released(pair):
    a, s = pair
    b = a._steps.malloc(1000, s._handle, 0, NO_RETRY)
    a._steps.hold(b)
    assert b.state == PENDING and a._live[b.ptr] is b and _allocated(a) == 0
    with pytest.raises(InvalidHandleError, match="not allocated"):
        a._steps.free(b)  # held: not the caller's to free again
    a._steps.release(b)
    assert b.state == RETIRED and b.ptr not in a._live
    with pytest.raises(InvalidHandleError, match="not held"):
        a._steps.release(b)


def test_a_bad_size_is_the_cores_refusal_and_changes_nothing(pair):
    a, s = pair
    assert a._steps.malloc(0, s._handle, 0, NO_RETRY) == 2  # ACCEL_CORE_BAD_SIZE
    assert a._steps.malloc(1 << 60, s._handle, 0, NO_RETRY) == 2
    with pytest.raises(OverflowError):
        a._steps.malloc(1 << 64, s._handle, 0, NO_RETRY)
    with pytest.raises(TypeError, match="four ints"):
        a._steps.malloc(1.5, s._handle, 0, NO_RETRY)
    assert a._live == {} and _allocated(a) == 0
    with pytest.raises(accel.InvalidValueError):
        accel.memory.allocate(0)


def test_a_double_free_and_a_stale_handle_are_refused_and_spare_the_next_owner(pair):
    a, s = pair
    b = a.malloc(1000, s)
    a.free(b)
    with pytest.raises(InvalidHandleError):
        a.free(b)
    with pytest.raises(InvalidHandleError):
        a._steps.free(b)
    again = a.malloc(1000, s)  # the same memory, cached
    assert again.ptr == b.ptr and again is not b
    with pytest.raises(InvalidHandleError):
        a.free(b)
    assert a._live[again.ptr] is again and _allocated(a) == 1024
    a.free(again)
    assert _allocated(a) == 0


def test_a_block_of_another_allocator_is_refused(pair):
    a, s = pair
    other = DeviceAllocator(a.backend, 0, AllocatorConfig())
    b = a.malloc(1000, s)
    for free in (other.free, other._steps.free, other._steps.hold, other.free_from_finalizer):
        with pytest.raises(InvalidHandleError):
            free(b)
    assert b.state == ALLOCATED and a._live[b.ptr] is b
    with pytest.raises(InvalidHandleError):
        a._steps.free(object())  # type: ignore[arg-type]
    a.free(b)


def test_racing_frees_free_the_block_once(pair):
    a, s = pair
    for _ in range(50):
        b = a.malloc(1000, s)
        outcomes: list[str] = []
        go = threading.Barrier(4)

        def free(block=b) -> None:
            go.wait()
            try:
                a.free(block)
                outcomes.append("freed")
            except InvalidHandleError:
                outcomes.append("refused")

        threads = [threading.Thread(target=free) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(outcomes) == ["freed"] + ["refused"] * 3
        assert _allocated(a) == 0


def test_block_handles_are_made_by_the_steps_only():
    with pytest.raises(TypeError):
        CoreBlock()


# -- an interrupt storm ---------------------------------------------------------------
#
# The loop gives nothing back upstream (no empty_cache): an interrupt at the entry of the
# core's upstream callbacks (accel/allocator/_native_core.py) loses a segment at the
# driver, which the simulated CUDA device's 1 GiB does not survive for long.

_STORM = """
import faulthandler, gc, os, random, signal, sys, threading, time
faulthandler.dump_traceback_later(60, exit=True)  # a hang: every thread's stack, and out
import accel
from accel.allocator._blocks import ALLOCATED

a = accel.memory.get_allocator(0)
stream = accel.current_stream()
empty = None
if {host}:
    import torch
    empty = accel.empty
    torch.empty(1)
go = stop = False
def killer():
    while not go:
        time.sleep(0.001)
    while not stop:
        time.sleep(random.random() * 0.002)
        os.kill(os.getpid(), signal.SIGINT)
# Ctrl-C's KeyboardInterrupt, inside the loop's try only (not at its backward jump).
armed = False
def interrupt(signum, frame):
    if armed:
        raise KeyboardInterrupt
signal.signal(signal.SIGINT, interrupt)
r = random.Random(1)
buffers, blocks, tensors = [], [], []
interrupts = 0
threading.Thread(target=killer, daemon=True).start()
sys.setswitchinterval(1e-5)  # the killer gets the GIL back soon after each sleep
t0 = time.time()
while time.time() - t0 < 3:
    try:
        armed = go = True
        c = r.random()
        size = r.choice([100, 3000, 2 << 20, 12 << 20])
        if c < 0.2 and blocks:
            a.free(blocks.pop(r.randrange(len(blocks))))
        elif c < 0.4:
            if len(blocks) < 20:
                blocks.append(a.malloc(size, stream))
        elif c < 0.55 and buffers:
            buffers.pop(r.randrange(len(buffers))).free()
        elif c < 0.7:
            if len(buffers) < 20:
                buffers.append(accel.memory.allocate(size))
        elif c < 0.8 and tensors:
            tensors.pop(r.randrange(len(tensors)))
        elif empty is not None:
            if len(tensors) < 20:
                tensors.append(empty(size, dtype=torch.uint8))
        armed = False
    except KeyboardInterrupt:
        armed = False
        interrupts += 1
stop = True
time.sleep(0.05)
# The survivors: what the loop holds, and handles an interrupt took from it (their
# Buffers and tensors collected, their raw blocks still the allocator's live handles).
for b in buffers:
    b.free()
del buffers, tensors
gc.collect()
for block in list(a._live.values()) + blocks:
    if block.state == ALLOCATED:
        a.free(block)
stream.synchronize()
for _ in range(2):
    try:
        a.empty_cache()
    except KeyboardInterrupt:
        pass
st = accel.memory_stats(0)
print(interrupts, st["allocated_bytes.all.current"], st["reserved_bytes.all.current"], len(a._live))
"""


@pytest.mark.parametrize("backend_name", ["cpu", "cuda"])
def test_a_sigint_storm_at_the_allocation_pair_loses_no_block(backend_name: str) -> None:
    reason = backend_skip_reason(backend_name)
    if reason:
        pytest.skip(reason)
    env = dict(os.environ, ACCEL_BACKEND=backend_name, PYTHONPATH=ROOT)
    script = textwrap.dedent(_STORM).format(host=backend_name == "cpu")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    interrupts, allocated, reserved, live = map(int, out.stdout.split())
    assert interrupts > 200, out.stdout  # the storm reached the loop
    assert (allocated, reserved, live) == (0, 0, 0), out.stdout
