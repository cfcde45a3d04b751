"""torch's CUDA tensors on accel's allocator, on a real GPU (``python -m pytest -m gpu``).

Issue 27's hardware check of :func:`accel.allocator.torch_allocator`: torch
tensors allocated through it by ``change_current_allocator`` and by
``torch.cuda.MemPool``, accel's books against what the tensors hold and against
torch's own view, an out-of-memory error, and a CUDA graph capture into such a
pool. Each scenario runs in a fresh interpreter with the system's CUDA driver
(``change_current_allocator`` must come before torch's first CUDA allocation)
and needs a CUDA build of torch; it skips otherwise, with the reason.
tests/allocator/test_torch_allocator.py covers the ABI on the simulated drivers
in every CI run.
"""

from __future__ import annotations

import pytest

from tests.backends.cuda.conftest import run_on_real_gpu

pytestmark = pytest.mark.gpu

# Every scenario starts so: torch with CUDA, accel on the CUDA backend, and the
# size accel books for a request (the core rounds to 512 bytes, as torch does).
PRELUDE = """
import sys
import torch
if not torch.cuda.is_available():
    print("SKIP: torch has no CUDA here (" + str(torch.version.cuda) + ")")
    sys.exit(0)
import accel
from accel.allocator import torch_allocator
assert accel.current_accelerator().type == "cuda"

def booked(n):
    return max(512, -(-n // 512) * 512)

# accel's current stream as torch's, so both sides share one stream's cache. Made after
# change_current_allocator: torch's CUDA initialization would fix its allocator.
def accel_stream():
    return torch.cuda.ExternalStream(accel.current_stream().native_handle, device=torch.device("cuda", 0))
"""

CURRENT_ALLOCATOR = PRELUDE + """
torch.cuda.memory.change_current_allocator(torch_allocator())
stream = accel_stream()
base = accel.memory_allocated()
stats0 = accel.memory_stats()
sizes = [1, 512, 1000, 4096, 1 << 20, (3 << 20) + 5]
with torch.cuda.stream(stream):
    tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in sizes]
    tensors[3].fill_(7)
    assert int(tensors[3].sum()) == 7 * 4096          # the memory is the device's, and usable
held = sum(booked(n) for n in sizes)
assert accel.memory_allocated() - base == held, (accel.memory_allocated() - base, held)
stats = accel.memory_stats()
assert stats["allocated_bytes.all.current"] - stats0["allocated_bytes.all.current"] == held, stats
assert stats["requested_bytes.all.current"] - stats0["requested_bytes.all.current"] == sum(sizes), stats
assert stats["allocation.all.current"] - stats0["allocation.all.current"] == len(sizes), stats
# Every tensor is an active block of accel's snapshot, at its own address.
active = {b["address"] for s in accel.memory.memory_snapshot() for b in s["blocks"] if b["state"] == "active_allocated"}
assert {t.data_ptr() for t in tensors} <= active, "a torch tensor is not in accel's snapshot"
# torch's own view: CUDAPluggableAllocator::getDeviceStats raises "does not yet support
# getDeviceStats" (torch's c10/cuda/CUDAPluggableAllocator.cpp); where a torch answers,
# it must say what accel says.
try:
    theirs = torch.cuda.memory_allocated()
except RuntimeError as exc:
    assert "getDeviceStats" in str(exc), exc
else:
    assert theirs == accel.memory_allocated(), (theirs, accel.memory_allocated())

# Tensors freed: nothing of theirs stays allocated; a block torch freed serves accel.
freed = tensors[3].data_ptr()
del tensors
torch.cuda.synchronize()
assert accel.memory_allocated() == base, (accel.memory_allocated(), base)
buf = accel.memory.allocate(4096)
assert buf.ptr == freed, "the accel buffer did not reuse the block torch freed"
buf.free()
assert accel.memory_allocated() == base
print("OK")
"""

MEMPOOL = PRELUDE + """
pool = torch.cuda.MemPool(torch_allocator().allocator())
stream = accel_stream()
base = accel.memory_allocated()
with torch.cuda.stream(stream), torch.cuda.use_mem_pool(pool):
    small = torch.ones(1000, dtype=torch.uint8, device="cuda")
    large = torch.ones(12 << 20, dtype=torch.uint8, device="cuda")
outside = torch.empty(4096, dtype=torch.uint8, device="cuda")   # torch's own cache, not the pool
# The pool's segments (torch's caching allocator's books) are what torch took from
# accel: 2 MiB for the small tensor (torch's small-block segment), the large one's own
# size (over 10 MiB: rounded to 2 MiB, no 20 MiB segment), each one allocation.
segments = pool.snapshot()
reserved = sum(s["total_size"] for s in segments)
assert len(segments) == 2 and reserved == (2 << 20) + (12 << 20), segments
assert accel.memory_allocated() - base == reserved, (accel.memory_allocated() - base, reserved)
assert {s["address"] for s in segments} <= {b["address"] for s in accel.memory.memory_snapshot() for b in s["blocks"]}
assert int(small.sum()) == 1000 and int(large.sum()) == 12 << 20
# Tensors dropped: torch caches the pool's segments; dropping the pool gives them to accel.
del small, large
torch.cuda.synchronize()
assert accel.memory_allocated() - base == reserved
del pool
import gc; gc.collect()
torch.cuda.empty_cache()
torch.cuda.synchronize()
assert accel.memory_allocated() == base, (accel.memory_allocated(), base)
del outside
print("OK")
"""

OOM = PRELUDE + """
pool = torch.cuda.MemPool(torch_allocator().allocator())
stream = accel_stream()
ooms = accel.memory_stats()["num_ooms"]
total = torch.cuda.get_device_properties(0).total_memory
with torch.cuda.stream(stream), torch.cuda.use_mem_pool(pool):
    try:
        torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError as exc:
        message = str(exc)
    else:
        raise AssertionError("torch allocated twice the device's memory through accel")
assert "out of memory" in message.lower(), message
# accel saw the refusal and counts it as its own out-of-memory event: once per try,
# and torch's caching allocator tries again after giving back its cache (so 1 or 2).
refused = accel.memory_stats()["num_ooms"] - ooms
assert refused in (1, 2), refused
summary = [line.split("|") for line in accel.memory.memory_summary().splitlines() if "num_ooms" in line]
assert summary and summary[0][2].strip() == str(ooms + refused), summary
print("OK")
"""

# torch.cuda.CUDAPluggableAllocator::malloc does not check what alloc returns
# (c10/cuda/CUDAPluggableAllocator.cpp keeps the pointer and makes the DataPtr), so
# a refusal through change_current_allocator may come back as a tensor at address 0
# instead of torch's OutOfMemoryError. This scenario finds out on hardware.
OOM_CURRENT = PRELUDE + """
torch.cuda.memory.change_current_allocator(torch_allocator())
stream = accel_stream()
ooms = accel.memory_stats()["num_ooms"]
total = torch.cuda.get_device_properties(0).total_memory
with torch.cuda.stream(stream):
    try:
        t = torch.empty(2 * total, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    except RuntimeError as exc:
        raise AssertionError(f"torch raised {type(exc).__name__}, not OutOfMemoryError: {exc}")
    else:
        raise AssertionError(f"torch made a tensor of twice the device at {t.data_ptr():#x} through accel")
assert accel.memory_stats()["num_ooms"] == ooms + 1
print("OK")
"""

GRAPH = PRELUDE + """
pool = torch.cuda.MemPool(torch_allocator().allocator())
base = accel.memory_allocated()
x = torch.ones(1 << 16, device="cuda")
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    y = x * 2 + 1                                   # warm-up, as torch's docs do
torch.cuda.current_stream().wait_stream(side)
del y
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g, pool=pool.id):
    y = x * 2 + 1
# The captured temporary and y (256 KiB each) share one small-block segment of the pool.
segments = pool.snapshot()
assert [s["total_size"] for s in segments] == [2 << 20], segments
assert accel.memory_allocated() - base == 2 << 20, accel.memory_allocated() - base
pool_segments = {s["address"] for s in segments}
assert pool_segments <= {b["address"] for s in accel.memory.memory_snapshot() for b in s["blocks"]}
for value in (1.0, 5.0):
    x.fill_(value)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full_like(x, value * 2 + 1)), (value, y[:4])
del y, g
print("OK")
"""


def test_torch_tensors_through_change_current_allocator_are_accel_memory() -> None:
    run_on_real_gpu(CURRENT_ALLOCATOR)


def test_a_mempool_over_accel_takes_its_segments_from_accel() -> None:
    run_on_real_gpu(MEMPOOL)


def test_torch_out_of_memory_through_a_mempool_over_accel() -> None:
    run_on_real_gpu(OOM)


def test_torch_out_of_memory_through_change_current_allocator() -> None:
    run_on_real_gpu(OOM_CURRENT)


def test_cuda_graph_capture_into_a_mempool_over_accel() -> None:
    run_on_real_gpu(GRAPH)
