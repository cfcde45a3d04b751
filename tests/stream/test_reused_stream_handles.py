"""Memory a closed stream's queued work still uses is never handed to another
stream, nor given back, before that work ran, also when the driver gives the
closed stream's handle to the next stream created (a real CUDA driver may reuse
the freed CUstream object; the simulated one does, unless ACCEL_SIMCUDA_REUSE_STREAM_HANDLES=0).
The host backend never reuses a handle, and the Level Zero backend destroys a
command list only once its work ran: there the tests guard the same promise.

Each case runs in a subprocess per backend with a timeout (a wrong reuse may hang
or write freed memory).
"""

from __future__ import annotations

import pytest

from tests.conftest import CONFORMANCE_BACKENDS
from tests.stream.test_closed_streams import run_parts

# Stream s, closed with a fill of 7 into p (4 KiB) held back by a gate; s2, created
# next, gets s's handle on a driver that reuses handles.
PREAMBLE = """
import threading
import accel

gate = threading.Event()
s = accel.Stream()
buf = accel.memory.allocate(4096, stream=s)
p = buf.ptr
s.launch_host_func(lambda: gate.wait(10))
s.fill(buf, 7)
"""

SECOND = """
s2 = accel.Stream()
if s2.device.type == "cuda":
    assert s2.native_handle == old, "the simulated driver did not reuse the handle"
"""


def run(backend: str, *parts: str, conf: str = "") -> None:
    run_parts(
        backend, PREAMBLE, *parts, env={"ACCEL_SIMCUDA_REUSE_STREAM_HANDLES": "1", "ACCEL_ALLOC_CONF": conf}
    )


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_block_freed_before_the_close_is_not_given_to_the_next_stream(backend: str) -> None:
    run(
        backend,
        """
        buf.free()
        old = s.native_handle
        s.close()
        """,
        SECOND,
        """
        b2 = accel.memory.allocate(4096, stream=s2)
        assert b2.ptr != p, "a block the closed stream's pending fill writes went to another stream"
        s2.fill(b2, 1)
        s2.synchronize()
        gate.set()
        accel.synchronize()
        import numpy as np
        out = np.zeros(4096, dtype=np.uint8)
        accel.current_stream().copy(out, b2)
        accel.synchronize()
        assert set(out.tolist()) == {1}, f"the new stream's data was overwritten: {set(out.tolist())}"
        """,
    )


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_block_freed_after_the_close_is_not_given_to_the_next_stream(backend: str) -> None:
    run(
        backend,
        """
        old = s.native_handle
        s.close()
        """,
        SECOND,
        """
        buf.free()  # allocated on s, freed after its close
        b2 = accel.memory.allocate(4096, stream=s2)
        assert b2.ptr != p, "a block the closed stream's pending fill writes went to another stream"
        gate.set()
        accel.synchronize()
        """,
    )


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_dropped_pool_keeps_memory_a_closed_stream_still_writes(backend: str) -> None:
    run(
        backend,
        """
        import gc
        buf.free()
        pool = accel.memory.MemPool()
        with accel.memory.use_mem_pool(pool):
            pb = accel.memory.allocate(4096, stream=s)
        ran = []
        s.fill(pb, 9)
        s.launch_host_func(lambda: ran.append("fill"))
        pb.free()
        old = s.native_handle
        s.close()
        """,
        SECOND,
        """
        allocator = pool.allocator()
        del pool
        gc.collect()  # the dropped pool gives back what it may without waiting
        assert ran == [] and allocator.stats()["reserved_bytes.all.current"] > 0, (
            "a dropped pool gave back memory a closed stream's queued fill still writes"
        )
        gate.set()
        accel.synchronize()
        accel.memory.empty_cache()
        assert allocator.stats()["reserved_bytes.all.current"] == 0
        """,
    )


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_growing_expandable_segment_leaves_the_pages_a_closed_stream_still_writes(backend: str) -> None:
    run(
        backend,
        """
        big = accel.memory.allocate(2 << 20, stream=s)
        s.fill(big, 7)
        big.free()
        buf.free()  # the segment's mapped pages are all free, its stream's fills queued
        old = s.native_handle
        s.close()
        allocator = accel.memory.get_allocator()
        before = allocator.stats()["reserved_bytes.all.current"]
        """,
        SECOND,
        """
        b1 = accel.memory.allocate(2 << 20, stream=s2)
        # s2's segment grows again, so the closed stream's segments keep no free pages
        # against it (hysteresis): their whole free pages go first if their stream is idle.
        b2 = accel.memory.allocate(4 << 20, stream=s2)
        assert allocator.stats()["reserved_bytes.all.current"] >= before + (6 << 20), (
            "pages a closed stream's queued fill still writes were given back or given to another stream"
        )
        gate.set()
        accel.synchronize()
        """,
        conf="expandable_segments:True",
    )


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_a_block_a_closed_stream_used_waits_for_its_work_after_the_free(backend: str) -> None:
    run(
        backend,
        """
        main = accel.current_stream()
        x = accel.memory.allocate(1 << 16, stream=main)
        q = x.ptr
        s.fill(x, 5)  # queued behind the gate
        x.record_stream(s)
        old = s.native_handle
        s.close()
        """,
        SECOND,
        """
        # Its reuse waits for s's work, not for s2's; nor does free() wait for the whole device
        # (as it did where the destroyed handle was refused: here until the gate timed out).
        x.free()
        s2.synchronize()
        y = accel.memory.allocate(1 << 16, stream=main)
        assert y.ptr != q, "a block a closed stream's pending fill writes was reused"
        gate.set()
        accel.synchronize()
        """,
    )
