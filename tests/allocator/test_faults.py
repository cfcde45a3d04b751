"""Fault injection: the upstream fails at every call of the allocation path in turn.

After each failure the caller has an OutOfMemoryError (or the upstream's own
error), the allocator's invariants hold, and once everything is freed nothing
is left held by the device.
"""

from __future__ import annotations

import pytest

from accel._errors import DriverError, OutOfMemoryError
from accel._runtime import Runtime
from accel.allocator._caching import DeviceAllocator
from accel.allocator._resources import BackendResource, ResourceAdaptor
from accel.allocator.config import parse
from accel.backends.cpu import CpuBackend
from accel.stream._stream import Stream
from tests.allocator.test_caching import check_invariants

MiB = 1 << 20


class Faulty(ResourceAdaptor):
    """Counts allocation-path calls; fails call number ``at`` (or every call from it on)."""

    def __init__(self, upstream, at: int, *, sticky: bool, error: str) -> None:
        super().__init__(upstream)
        self.at, self.sticky, self.error = at, sticky, error
        self.calls = 0

    def _maybe_fail(self, what: str, nbytes: int) -> None:
        self.calls += 1
        if self.calls == self.at or (self.sticky and self.calls > self.at > 0):
            if self.error == "oom":
                raise OutOfMemoryError(f"injected: {what} #{self.calls}", requested=nbytes, device=0)
            raise DriverError("cpu", what, 999, "INJECTED", device=0)

    def allocate(self, nbytes: int) -> int:
        self._maybe_fail("allocate", nbytes)
        return super().allocate(nbytes)

    def vm_reserve(self, nbytes: int) -> int:
        self._maybe_fail("vm_reserve", nbytes)
        return super().vm_reserve(nbytes)

    def vm_create(self, nbytes: int) -> int:
        self._maybe_fail("vm_create", nbytes)
        return super().vm_create(nbytes)

    def vm_map(self, addr: int, nbytes: int, handle: int) -> None:
        self._maybe_fail("vm_map", nbytes)
        super().vm_map(addr, nbytes, handle)


def workload(alloc: DeviceAllocator, streams: list[Stream]) -> list[type]:
    """A scripted mix of sizes, streams and frees; returns the errors it met."""
    errors: list[type] = []
    live = []
    plan = [
        (300, 0), (2 * MiB - 1, 0), (5 * MiB, 1), (25 * MiB, 0), (700_000, 1),
        ("free", 1), (45 * MiB, 0), ("free", 0), (3 * MiB, 1), (64 * MiB, 0),
        ("free", 2), (12 * MiB, 0), (40 * MiB, 1), ("free", 0), (600, 1), (30 * MiB, 0),
    ]
    for step in plan:
        if step[0] == "free":
            if len(live) > step[1]:
                alloc.free(live.pop(step[1]))
            continue
        nbytes, which = step
        try:
            block = alloc.malloc(nbytes, streams[which])
        except (OutOfMemoryError, DriverError) as exc:
            errors.append(type(exc))
            check_invariants(alloc)
            continue
        if which == 1 and live:
            alloc.record_stream(live[0], streams[1])
        live.append(block)
        check_invariants(alloc)
    for block in live:
        alloc.free(block)
    return errors


CONFIGS = ["max_split_size_mb:40", "expandable_segments:True", "garbage_collection_threshold:0.5"]


def run(config: str, at: int, *, sticky: bool, error: str) -> tuple[Faulty, list[type], CpuBackend]:
    backend = CpuBackend(1, 256 * MiB)
    runtime = Runtime(backend)
    streams = [runtime.default_stream(0), Stream._wrap(runtime, 0, backend.stream_create(0, 0), owned=True)]
    upstream = Faulty(BackendResource(backend, 0), at, sticky=sticky, error=error)
    alloc = DeviceAllocator(backend, 0, parse(config), upstream=upstream)
    if "garbage" in config:
        alloc.set_memory_fraction(1.0)  # GC runs only under a fraction limit
    errors = workload(alloc, streams)
    streams[1].synchronize()
    alloc.empty_cache()
    check_invariants(alloc)
    memory = backend._memory[0]
    assert alloc.stats()["reserved_bytes.all.current"] == 0
    assert memory._held == 0 and not memory._physical and not memory._reservations, "leaked"
    return upstream, errors, backend


@pytest.mark.parametrize("config", CONFIGS)
def test_fail_each_call_once_and_from_each_call_on(config):
    clean, errors, _ = run(config, 0, sticky=False, error="oom")
    assert not errors
    total = clean.calls
    assert total >= 5
    for at in range(1, total + 1):
        _, errors, _ = run(config, at, sticky=False, error="oom")
        assert set(errors) <= {OutOfMemoryError}  # a single failure may be retried away
        _, errors, _ = run(config, at, sticky=True, error="oom")
        assert errors and set(errors) == {OutOfMemoryError}


@pytest.mark.parametrize("config", CONFIGS)
def test_backend_errors_reach_the_caller_unchanged(config):
    clean, _, _ = run(config, 0, sticky=False, error="oom")
    for at in range(1, clean.calls + 1):
        _, errors, _ = run(config, at, sticky=False, error="driver")
        assert errors == [DriverError]


def test_a_failing_event_record_at_free_still_frees_the_block() -> None:
    """A cross-stream free records an event on each stream that used the block;
    if the driver fails there, the block is still freed (after a device wait)
    and the error reaches the caller; nothing leaks."""
    backend = CpuBackend(1, 256 * MiB)
    runtime = Runtime(backend)
    side = Stream._wrap(runtime, 0, backend.stream_create(0, 0), owned=True)
    alloc = DeviceAllocator(backend, 0, parse(""))
    block = alloc.malloc(MiB, runtime.default_stream(0))
    alloc.record_stream(block, side)
    real_record = backend.event_record

    def failing_record(device: int, event: int, stream: int) -> None:
        raise DriverError("cpu", "event_record", 999, "INJECTED", "injected by the test")

    backend.event_record = failing_record  # type: ignore[method-assign]
    try:
        with pytest.raises(DriverError, match="INJECTED"):
            alloc.free(block)
    finally:
        backend.event_record = real_record  # type: ignore[method-assign]
    check_invariants(alloc)
    assert alloc.stats()["active.all.current"] == 0
    alloc.empty_cache()
    assert alloc.stats()["reserved_bytes.all.current"] == 0 and backend._memory[0]._held == 0
