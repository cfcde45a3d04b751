"""torch's pluggable-allocator ABI over accel's native allocator core.

A C harness (torch_abi_harness.c, compiled here) calls the ABI as torch does: dlopen
the spec's path, dlsym its two names, alloc/free from native threads. It runs while
the main thread holds the GIL: first in a Python loop (cache misses reach the
upstream, whose callback takes the GIL in its turns), then inside one call that
never lets the GIL go (ctypes.PyDLL), where cache hits must still be served.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

import accel
from accel._errors import NotSupportedError
from accel.allocator import torch_allocator, torch_allocator_spec
from tests.allocator import torch_abi
from tests.fixtures.scripts import ok, run

HARNESS = Path(__file__).with_name("torch_abi_harness.c")


@pytest.fixture(scope="module")
def harness(tmp_path_factory: pytest.TempPathFactory) -> Path:
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        pytest.skip("no C compiler for the harness")
    out = tmp_path_factory.mktemp("harness") / "harness.so"
    subprocess.run(
        [compiler, "-O1", "-Wall", "-Werror", "-shared", "-fPIC", "-pthread", str(HARNESS), "-o", str(out), "-ldl"],
        check=True,
    )
    return out


SCRIPT = r"""
import ctypes, sys, time
import accel
from accel.allocator import torch_allocator_spec
from tests.allocator import torch_abi

path, alloc_name, free_name = torch_allocator_spec()
CDLL = ctypes.CDLL(sys.argv[1])  # calls that let the GIL go
HELD = ctypes.PyDLL(sys.argv[1])  # calls that keep it
abi = torch_abi.load()
args = (path.encode(), alloc_name.encode(), free_name.encode(), 0)

# What the ABI hands out is in accel's books.
before = accel.memory.memory_allocated()
ptr = abi.accel_torch_alloc(3000, 0, None)
assert ptr, "alloc returned NULL"
assert accel.memory.memory_allocated() == before + 3072, accel.memory.memory_allocated()
seg = [s for s in accel.memory.memory_snapshot() if s["address"] <= ptr < s["address"] + s["total_size"]]
assert seg and seg[0]["allocated_size"] == 3072, seg
abi.accel_torch_free(ptr, 3000, 0, None)
assert accel.memory.memory_allocated() == before

# 1. Native threads while this thread runs Python: misses take the GIL in turns.
assert CDLL.harness_start(*args, 200, 48 << 10) == 0
deadline = time.monotonic() + 60
spins = 0
while CDLL.harness_running() and time.monotonic() < deadline:
    spins += 1  # holds the GIL but for the interpreter's switches
assert CDLL.harness_join() == 0, "threads saw NULL or memory another thread wrote"
stats = accel.memory.memory_stats()
assert stats["num_device_alloc"] >= 2 and stats["allocation.all.allocated"] >= 8 * 200 * 16, stats
assert stats["allocated_bytes.all.current"] == 0, stats["allocated_bytes.all.current"]

# 2. The GIL held throughout (PyDLL): the cache warmed above serves every request
# (3 whole small segments per stream, 6x what the threads hold at once), and no
# call may wait for the GIL, or this never returns.
reserved = stats["reserved_bytes.all.current"]
assert HELD.harness_start(*args, 200, 32 << 10) == 0
failures = HELD.harness_join()
assert failures == 0, failures
stats = accel.memory.memory_stats()
assert stats["reserved_bytes.all.current"] == reserved, (stats["reserved_bytes.all.current"], reserved)
assert stats["allocated_bytes.all.current"] == 0

accel.memory.empty_cache()
assert accel.memory.memory_reserved() == 0, accel.memory.memory_reserved()
print("ok")
"""


@pytest.mark.parametrize("name", ["cpu", "cuda", "xpu"])
def test_c_harness_calls_the_abi_from_native_threads(name: str, harness: Path) -> None:
    """Native threads alloc/free through the ABI as torch does, while the main thread
    holds the GIL; the memory shows in memory_stats and snapshots. A call that waited
    for the GIL on a cache hit hangs part 2 (the timeout fails the test)."""
    ok(run(name, SCRIPT, str(harness), timeout=180))


def test_spec_names_exported_functions() -> None:
    path, alloc, free = torch_allocator_spec()
    symbols = subprocess.run(["nm", "-D", "--defined-only", path], capture_output=True, text=True).stdout
    assert f" T {alloc}" in symbols and f" T {free}" in symbols


def test_abi_refuses_what_it_cannot_serve() -> None:
    """alloc of a device with no core, a negative size, or more than the device has
    returns NULL (torch raises its out-of-memory error); free of a foreign or NULL
    pointer does nothing."""
    abi = torch_abi.load()
    assert abi.accel_torch_alloc(512, 63, None) is None
    assert abi.accel_torch_alloc(512, -1, None) is None
    assert abi.accel_torch_alloc(-5, 0, None) is None
    ooms = accel.memory.memory_stats()["num_ooms"]
    assert abi.accel_torch_alloc(1 << 59, 0, None) is None
    assert accel.memory.memory_stats()["num_ooms"] == ooms + 1
    before = accel.memory.memory_allocated()
    ptr = abi.accel_torch_alloc(0, 0, None)  # torch asks for 0 bytes too
    assert ptr is not None and accel.memory.memory_allocated() == before + 512
    abi.accel_torch_free(ptr + 512, 0, 0, None)  # not handed out: ignored
    abi.accel_torch_free(None, 0, 0, None)
    assert accel.memory.memory_allocated() == before + 512
    abi.accel_torch_free(ptr, 0, 0, None)
    assert accel.memory.memory_allocated() == before


def test_torch_free_of_an_accel_block_is_ignored() -> None:
    """torch's free of a pointer accel handed out (a stale or foreign pointer) does not
    free it: else its memory would go to the next allocation while the accel buffer
    still lives, and accel's own free would then free that allocation's block."""
    abi = torch_abi.load()
    buf = accel.memory.allocate(3000)
    before = accel.memory.memory_allocated()
    abi.accel_torch_free(buf.ptr, 3000, 0, None)
    assert accel.memory.memory_allocated() == before
    other = accel.memory.allocate(3000)
    assert other.ptr != buf.ptr
    buf.free()
    other.free()
    assert accel.memory.memory_allocated() == before - 3072


def test_torch_allocator_on_the_host_says_torch_has_none() -> None:
    if accel.current_accelerator().type != "cpu":
        pytest.skip("the host backend's answer")
    with pytest.raises(NotSupportedError, match="torch has no pluggable allocator for cpu"):
        torch_allocator()


def test_torch_allocator_on_simulated_cuda_without_torch_cuda() -> None:
    """torch built without CUDA cannot take the allocator: an accel error that says so."""
    ok(
        run(
            "cuda",
            """
            import torch
            import accel
            from accel._errors import NotSupportedError
            if torch.cuda.is_available():
                print("ok")
                raise SystemExit
            try:
                accel.allocator.torch_allocator()
            except NotSupportedError as exc:
                assert "cannot take a pluggable cuda allocator" in str(exc), exc
                print("ok")
            """,
        )
    )


def test_resets_and_empty_cache_reach_what_torch_allocated() -> None:
    """The device's resets and empty_cache act on the core's books too."""
    abi = torch_abi.load()
    accel.memory.empty_cache()
    ptr = abi.accel_torch_alloc(5 << 20, 0, None)
    assert accel.memory.memory_reserved() >= 20 << 20  # a large segment of the core's
    abi.accel_torch_free(ptr, 5 << 20, 0, None)
    accel.memory.reset_peak_memory_stats()
    assert accel.memory.max_memory_allocated() == accel.memory.memory_allocated()
    accel.memory.reset_accumulated_memory_stats()
    stats = accel.memory.memory_stats()
    assert stats["allocation.all.allocated"] == stats["allocation.all.freed"] == 0
    accel.memory.empty_cache()
    assert accel.memory.memory_reserved() == 0


def test_the_memory_fraction_caps_accel_and_torch_together() -> None:
    """One cap for what accel's buffers and torch's tensors reserve on a device: the
    ABI returns NULL past it, and accel's allocation counts torch's segments."""
    ok(
        run(
            "cpu",
            """
            import accel
            from accel._errors import OutOfMemoryError
            from tests.allocator import torch_abi

            abi = torch_abi.load()
            total = accel.memory.get_allocator().upstream.memory_info()[1]
            accel.memory.set_per_process_memory_fraction((5 << 20) / total)
            held = [abi.accel_torch_alloc(1 << 20, 0, None) for _ in range(4)]  # two per 2 MiB segment
            assert all(held) and accel.memory.memory_reserved() == 4 << 20, accel.memory.memory_reserved()
            assert abi.accel_torch_alloc(1 << 20, 0, None) is None  # a third segment passes the cap
            try:
                accel.memory.allocate(1 << 20)
            except OutOfMemoryError as exc:
                assert "4.00 MiB is allocated by accel" in str(exc), exc  # torch's, counted
            else:
                raise AssertionError("accel's allocation passed the cap torch's segments filled")
            print("ok")
            """,
        )
    )


def test_a_forked_child_gets_null_not_a_hang() -> None:
    """A child forked while a native thread held the core's mutex would wait forever:
    in a child the ABI serves nothing (accel does not run in a child forked after it
    started), so torch raises its out-of-memory error there instead."""
    ok(
        run(
            "cpu",
            """
            import os
            from tests.allocator import torch_abi

            abi = torch_abi.load()
            assert abi.accel_torch_alloc(4096, 0, None)
            pid = os.fork()
            if pid == 0:
                os._exit(0 if abi.accel_torch_alloc(4096, 0, None) is None else 3)
            _, status = os.waitpid(pid, 0)
            assert os.WEXITSTATUS(status) == 0, status
            assert abi.accel_torch_alloc(4096, 0, None)  # the parent's still serves
            print("ok")
            """,
        )
    )


# An accel buffer's freed block serves torch's next request, and one set of statistics
# counts both: the start of each one-cache scenario below.
_SHARED_BLOCK = r"""
import accel
from tests.allocator import torch_abi

abi = torch_abi.load()
stream = accel.current_stream().native_handle  # torch passes the stream it allocates on

buf = accel.memory.allocate(4096)
mine = buf.ptr
buf.free()
theirs = abi.accel_torch_alloc(4096, 0, stream)
assert theirs == mine, "torch's allocation did not reuse the block the accel buffer freed"
stats = accel.memory.memory_stats()
# one cache: 4096 bytes were allocated at any time (two caches' peaks would sum to 8192)
assert stats["allocated_bytes.all.peak"] == 4096, stats["allocated_bytes.all.peak"]
assert stats["allocated_bytes.all.current"] == 4096 and stats["allocation.all.allocated"] == 2, stats
"""

ONE_CACHE = _SHARED_BLOCK + r"""
assert stats["segment.all.current"] == 1 and stats["num_device_alloc"] == 1, stats
abi.accel_torch_free(theirs, 4096, 0, stream)
again = accel.memory.allocate(4096)
assert again.ptr == theirs, "the accel buffer did not reuse the block torch freed"
assert [b["state"] for s in accel.memory.memory_snapshot() for b in s["blocks"]][0] == "active_allocated"
again.free()
print("ok")
"""


@pytest.mark.parametrize("name", ["cpu", "cuda", "xpu"])
def test_accel_buffers_and_torch_allocations_share_one_cache(name: str) -> None:
    """One cache per device: a block an accel buffer freed serves torch's next request
    and the other way round, and memory_stats counts both once (peaks not summed)."""
    ok(run(name, ONE_CACHE, timeout=120))


ONE_EXPANDABLE_CACHE = _SHARED_BLOCK + r"""
assert accel.memory.get_allocator().config.expandable_segments

def segments():
    return accel.memory.memory_snapshot()

# one page of one expandable segment, mapped once (no plain segment)
assert stats["reserved_bytes.all.current"] == 2 << 20 and stats["num_device_alloc"] == 1, stats
assert stats["segment.all.current"] == 0, stats
assert [s["is_expandable"] for s in segments()] == [True], segments()
# torch's large allocations grow the large pool's expandable segment, as in PyTorch
big = abi.accel_torch_alloc(8 << 20, 0, stream)
assert big and all(s["is_expandable"] for s in segments()), segments()
abi.accel_torch_free(big, 8 << 20, 0, stream)
abi.accel_torch_free(theirs, 4096, 0, stream)
again = accel.memory.allocate(4096)
assert again.ptr == theirs, "the accel buffer did not reuse the block torch freed"
stats = accel.memory.memory_stats()
assert stats["allocated_bytes.all.peak"] == (8 << 20) + 4096, stats["allocated_bytes.all.peak"]
again.free()
accel.memory.empty_cache()
assert accel.memory.memory_reserved() == 0 and segments() == [], segments()
print("ok")
"""


@pytest.mark.parametrize("name", ["cpu", "cuda", "xpu"])
def test_with_expandable_segments_accel_and_torch_share_one_cache(name: str) -> None:
    """With expandable_segments:True, torch's allocations land in the same expandable
    segments as accel buffers: a block one side freed serves the other, and one set of
    statistics counts both (peaks not summed)."""
    ok(run(name, ONE_EXPANDABLE_CACHE, timeout=120, env={"ACCEL_ALLOC_CONF": "expandable_segments:True"}))


GIL_HELD_GROWTH = r"""
import ctypes, sys, threading
import accel
from accel.allocator import torch_allocator_spec

path, alloc_name, free_name = torch_allocator_spec()
held = ctypes.PyDLL(path)  # torch.empty's way: the GIL held throughout the call
held.accel_torch_alloc.restype = ctypes.c_void_p
held.accel_torch_alloc.argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
held.accel_torch_free.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
stop = False

def give_back():  # unmaps without the GIL (cffi lets it go); the callbacks take it
    while not stop:
        accel.memory.empty_cache()

other = threading.Thread(target=give_back)
other.start()
sys.setswitchinterval(1e-5)
try:
    for i in range(3000):
        # the pages freed last time are given back meanwhile: a growth, the GIL held
        ptr = held.accel_torch_alloc(10 << 20, 0, None)
        assert ptr, "NULL"
        held.accel_torch_free(ptr, 10 << 20, 0, None)
finally:
    stop = True
    other.join()
accel.memory.empty_cache()
assert accel.memory.memory_reserved() == 0, accel.memory.memory_reserved()
print("ok")
"""


def test_a_growth_with_the_gil_held_never_waits_for_another_thread() -> None:
    """Expandable segments map pages through callbacks that take the GIL. A thread that
    holds the GIL while it allocates (torch.empty's does) and must grow a segment while
    another thread maps or unmaps pages (without the GIL, its callback waiting for it)
    does not wait for that thread: its growth goes on at once (no deadlock)."""
    ok(run("cpu", GIL_HELD_GROWTH, timeout=120, env={"ACCEL_ALLOC_CONF": "expandable_segments:True"}))
