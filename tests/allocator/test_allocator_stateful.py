"""Random allocate/free/record_stream/empty_cache/sync/capture/stream replacement/config
change sequences, checked after every step against a small model: what is live, which
freed ranges queued work may still use, the peaks seen; and the public views (snapshot,
stats) recounted (tests/allocator/test_caching.py's check_public_views).

Streams used through ``record_stream`` are held by a *gate*: a host function
on that stream that waits for a threading.Event the test opens later. Until
its gates open, a freed block must not be handed out again, and the host
backend's worker threads make that real asynchrony, not a simulation. A stream
is also closed with its gates shut and its handle given to the next stream, as a
driver may do (the host backend never reuses handles: the test moves the new
stream to the old handle).
"""

from __future__ import annotations

import threading

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, initialize, invariant, rule

from accel._runtime import Runtime
from accel.allocator._caching import DeviceAllocator, stream_destroyed
from accel.allocator.config import parse
from accel.backends.cpu import CpuBackend
from accel.stream._stream import Stream
from tests.allocator.test_caching import check_invariants

MiB = 1 << 20

sizes = st.one_of(
    st.integers(1, 4096),
    st.integers(4097, MiB),
    st.integers(MiB + 1, 12 * MiB),
    st.integers(12 * MiB, 48 * MiB),
)


class Live:
    """A live allocation of the model."""

    def __init__(self, block, stream: int) -> None:
        self.block = block
        self.ptr, self.size = block.ptr, block.size
        self.stream = stream
        self.gates: list[threading.Event] = []


class AllocatorMachine(RuleBasedStateMachine):
    buffers = Bundle("buffers")

    @initialize(
        config=st.sampled_from(
            [
                "",
                "expandable_segments:True",
                "max_split_size_mb:30,roundup_power2_divisions:4",
                "expandable_segments:True,max_split_size_mb:30",
                # holes given back as soon as a segment grows
                "expandable_segments:True,expandable_keep_free_mb:0",
                "expandable_segments:True,expandable_keep_free_mb:0,max_split_size_mb:30",
            ]
        )
    )
    def setup(self, config: str) -> None:
        self.backend = CpuBackend(1, None)
        self.runtime = Runtime(self.backend)
        self.streams = [self.runtime.default_stream(0)] + [
            Stream._wrap(self.runtime, 0, self.backend.stream_create(0, 0), owned=True) for _ in range(2)
        ]
        self.alloc = DeviceAllocator(self.backend, 0, parse(config) if config else parse("expandable_segments:False"))
        self.expandable = "expandable" in config
        # as the allocator registry does for the runtime's allocators
        self.runtime.stream_destroy_listeners.append(lambda index, handle: stream_destroyed(self.backend, index, handle))
        self.retired = 0  # streams replaced: their gates are kept under keys -1, -2...
        self.live: list[Live] = []
        # freed ranges that must not be reused while any of their gates is closed
        self.quarantine: list[tuple[int, int, list[threading.Event]]] = []
        self.gates: dict[int, list[threading.Event]] = {i: [] for i in range(3)}
        self.peaks: dict[str, int] = {}
        self.capture: tuple[int, int] | None = None
        self.pool_serial = 0
        # Ranges freed on their own stream while work queued there (a gate) may
        # still use them: reusable in stream order, but never to be unmapped.
        self.own_busy: list[tuple[int, int, list[threading.Event], int]] = []
        unmap = self.backend.vm_unmap

        def checked_unmap(device: int, addr: int, nbytes: int) -> None:
            self.check_unmap(addr, addr + nbytes)
            unmap(device, addr, nbytes)

        self.backend.vm_unmap = checked_unmap  # type: ignore[method-assign]

    def check_unmap(self, start: int, end: int) -> None:
        """No page is unmapped under a live block or under work a stream may still run."""
        for item in self.live:
            assert item.ptr + item.size <= start or end <= item.ptr, "a page under a live block was unmapped"
        for lo, hi, gates, *_ in self.quarantine + self.own_busy:
            if not all(g.is_set() for g in gates):
                assert hi <= start or end <= lo, "a page that queued stream work may use was unmapped"

    @rule(target=buffers, nbytes=sizes, which=st.integers(0, 2))
    def allocate(self, nbytes: int, which: int) -> Live:
        block = self.alloc.malloc(nbytes, self.streams[which])
        assert block.size >= nbytes
        for start, end, gates in self.quarantine:
            if not all(g.is_set() for g in gates):
                assert block.ptr + block.size <= start or end <= block.ptr, (
                    "a block was reused before a stream that used it passed its free event"
                )
        for other in self.live:
            assert block.ptr + block.size <= other.ptr or other.ptr + other.size <= block.ptr, "live blocks overlap"
        item = Live(block, which)
        self.live.append(item)
        return item

    @rule(item=buffers, which=st.integers(1, 2))
    def use_on_other_stream(self, item: Live, which: int) -> None:
        if item not in self.live:
            return
        gate = threading.Event()
        self.gates[which].append(gate)
        self.streams[which].launch_host_func(gate.wait)
        self.alloc.record_stream(item.block, self.streams[which])
        if which != item.stream:
            item.gates.append(gate)

    @rule(item=consumes(buffers))
    def free(self, item: Live) -> None:
        if item not in self.live:
            return
        self.live.remove(item)
        self.alloc.free(item.block)
        if item.gates:
            self.quarantine.append((item.ptr, item.ptr + item.size, item.gates))
        if self.gates[item.stream]:
            busy = (item.ptr, item.ptr + item.size, list(self.gates[item.stream]))
            if item.stream < 0:  # its stream was closed: no stream may reuse it in order
                self.quarantine.append(busy)
            else:
                self.own_busy.append((*busy, item.stream))

    @rule(which=st.integers(1, 2))
    def open_gates(self, which: int) -> None:
        for gate in self.gates[which]:
            gate.set()
        self.gates[which].clear()

    @rule()
    def open_closed_streams_gates(self) -> None:
        for key in range(-1, -self.retired - 1, -1):
            for gate in self.gates[key]:
                gate.set()

    @rule(which=st.integers(1, 2))
    def replace_stream(self, which: int) -> None:
        """Close stream ``which`` (its gated work still runs) and give its handle to a new stream."""
        if self.capture is not None:
            return
        old = self.streams[which]
        handle = old._handle
        self.retired += 1
        key = -self.retired
        self.gates[key] = self.gates[which]
        self.gates[which] = []
        # What was freed on it and may be reused in its order may now be reused by no stream.
        for lo, hi, busy, stream in self.own_busy:
            if stream == which:
                self.quarantine.append((lo, hi, busy))
        for item in self.live:
            if item.stream == which:
                item.stream = key
        # What close() does but for its end event (an Event of the process's runtime,
        # not of this machine's): the runtime tells the allocator, the backend destroys it.
        old._closed = True
        assert old._finalizer is not None
        old._finalizer()
        table = self.backend._streams
        new = self.backend.stream_create(0, 0)
        with table._lock:
            host = table._streams.pop(new)
            host.handle = handle
            table._streams[handle] = host
        self.streams[which] = Stream._wrap(self.runtime, 0, handle, owned=True)

    @rule(
        config=st.sampled_from(
            ["max_split_size_mb:30", "roundup_power2_divisions:4", "max_split_size_mb:20,roundup_power2_divisions:2", ""]
        )
    )
    def change_config(self, config: str) -> None:
        """New settings while blocks are live (oversize counts are recounted)."""
        if self.expandable:
            return  # switching expandable segments off and on: test_caching's toggling test
        self.alloc.update_config(parse(config or "expandable_segments:False"))

    @rule(which=st.integers(0, 2))
    def synchronize(self, which: int) -> None:
        if self.gates[which]:
            return  # a closed gate would block forever
        self.streams[which].synchronize()

    @rule(which=st.integers(0, 2))
    def begin_capture(self, which: int) -> None:
        if self.capture is not None:
            return
        self.pool_serial += 1
        pool_id = (self.pool_serial, 0)
        capturing = self.streams[which]
        self.alloc.begin_allocate_to_pool(pool_id, lambda s: s == capturing)
        self.capture = pool_id

    @rule()
    def end_capture(self) -> None:
        if self.capture is None:
            return
        self.alloc.end_allocate_to_pool(self.capture)
        self.alloc.release_pool(self.capture)  # the graph is gone at once
        self.capture = None

    @rule()
    def empty_cache(self) -> None:
        # empty_cache waits for every pending free: open the gates first.
        for which in (1, 2):
            self.open_gates(which)
        self.open_closed_streams_gates()
        self.alloc.empty_cache()
        st_ = self.alloc.stats()
        assert st_["reserved_bytes.all.current"] >= st_["allocated_bytes.all.current"]

    @invariant()
    def structures_hold(self) -> None:
        if hasattr(self, "alloc"):
            check_invariants(self.alloc)
            stats = self.alloc.stats()
            # Peaks, recounted: each step moves a current value at most once upwards.
            for key in ("allocated_bytes", "active_bytes", "active", "reserved_bytes", "requested_bytes"):
                for pool in ("all", "small_pool", "large_pool"):
                    name = f"{key}.{pool}"
                    seen = self.peaks[name] = max(self.peaks.get(name, 0), stats[f"{name}.current"])
                    assert stats[f"{name}.peak"] == seen, f"{name}.peak"
                    assert stats[f"{name}.allocated"] - stats[f"{name}.freed"] == stats[f"{name}.current"]
            mapped = self.alloc.stats()["reserved_bytes.all.current"]
            held = self.backend._memory[0]._held
            assert held == mapped, "reserved bytes differ from what the device holds for us"

    def teardown(self) -> None:
        if not hasattr(self, "alloc"):
            return
        for which in (1, 2):
            self.open_gates(which)
        self.open_closed_streams_gates()
        self.end_capture()
        for item in list(self.live):
            self.alloc.free(item.block)
        self.live.clear()
        for s in self.streams:
            s.synchronize()
        self.alloc.empty_cache()
        check_invariants(self.alloc)
        assert self.alloc.stats()["reserved_bytes.all.current"] == 0
        assert self.backend._memory[0]._held == 0 and not self.backend._memory[0]._reservations
        for s in self.streams[1:]:
            s.close()


AllocatorMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestAllocator = AllocatorMachine.TestCase


def test_a_block_freed_on_a_replaced_stream_is_not_reused_by_the_stream_given_its_handle() -> None:
    """The machine's steps of a case the random search rarely reaches: a block freed on
    stream 1 while its gated work may still use it, stream 1 closed and its handle given
    to a new stream, which allocates (it must not get the block)."""
    machine = AllocatorMachine()
    machine.setup("")
    steps = [
        lambda: machine.allocate(4096, 1),
        lambda: machine.use_on_other_stream(machine.live[0], 1),
        lambda: machine.free(machine.live[0]),
        lambda: machine.replace_stream(1),
        lambda: machine.allocate(4096, 1),
    ]
    for step in steps:
        step()
        machine.structures_hold()
    machine.teardown()
