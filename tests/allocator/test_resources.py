"""Upstream memory resources and their adaptors."""

from __future__ import annotations

import logging

import pytest

from accel._errors import InvalidValueError, OutOfMemoryError
from accel._runtime import Runtime
from accel.allocator._caching import DeviceAllocator
from accel.allocator._resources import (
    BackendResource,
    LimitingAdaptor,
    LoggingAdaptor,
    MemoryResource,
    StatisticsAdaptor,
)
from accel.allocator.config import parse
from accel.backends.cpu import CpuBackend

MiB = 1 << 20


@pytest.fixture
def backend():
    return CpuBackend(1, None)


def test_backend_resource_round_trip(backend):
    r = BackendResource(backend, 0)
    ptr = r.allocate(MiB)
    assert backend._memory[0]._held == MiB
    r.deallocate(ptr, MiB)
    assert backend._memory[0]._held == 0
    assert r.supports_virtual_memory() and r.vm_granularity() == 2 * MiB
    assert r.memory_info()[1] > 0 and "cpu:0" in repr(r)


def test_limiting_adaptor_counts_plain_and_physical_memory(backend):
    r = LimitingAdaptor(BackendResource(backend, 0), 6 * MiB)
    ptr = r.allocate(2 * MiB)
    handle = r.vm_create(2 * MiB)
    assert r.held == 4 * MiB and r.memory_info()[1] == 6 * MiB
    with pytest.raises(OutOfMemoryError, match="LimitingAdaptor"):
        r.allocate(4 * MiB)
    with pytest.raises(OutOfMemoryError):
        r.vm_create(4 * MiB)
    assert r.held == 4 * MiB
    r.vm_release(handle, 2 * MiB)
    r.deallocate(ptr, 2 * MiB)
    assert r.held == 0 and backend._memory[0]._held == 0
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidValueError):
            LimitingAdaptor(BackendResource(backend, 0), bad)  # type: ignore[arg-type]


def test_limiting_adaptor_refunds_when_upstream_fails():
    small = CpuBackend(1, 4 * MiB)
    r = LimitingAdaptor(BackendResource(small, 0), 64 * MiB)
    with pytest.raises(OutOfMemoryError):
        r.allocate(8 * MiB)
    assert r.held == 0


def test_statistics_adaptor(backend):
    r = StatisticsAdaptor(BackendResource(backend, 0))
    a = r.allocate(MiB)
    b = r.allocate(2 * MiB)
    r.deallocate(a, MiB)
    h = r.vm_create(2 * MiB)
    r.vm_release(h, 2 * MiB)
    r.deallocate(b, 2 * MiB)
    c = r.counts
    assert (c.allocations, c.deallocations, c.current_bytes, c.peak_bytes, c.total_bytes) == (
        3, 3, 0, 4 * MiB, 5 * MiB
    )
    limited = StatisticsAdaptor(LimitingAdaptor(BackendResource(backend, 0), MiB))
    with pytest.raises(OutOfMemoryError):
        limited.allocate(2 * MiB)
    assert limited.counts.failures == 1


def test_logging_adaptor(backend, caplog):
    r = LoggingAdaptor(BackendResource(backend, 0), logging.getLogger("accel.test.mr"))
    with caplog.at_level(logging.DEBUG, logger="accel.test.mr"):
        ptr = r.allocate(MiB)
        r.deallocate(ptr, MiB)
        with pytest.raises(OutOfMemoryError):
            LoggingAdaptor(LimitingAdaptor(BackendResource(backend, 0), MiB), r.logger).allocate(2 * MiB)
    text = caplog.text
    assert f"allocate(1048576) on device 0 -> {ptr:#x}" in text
    assert "deallocate(" in text and "failed" in text


def test_adaptor_refuses_what_is_not_a_resource():
    with pytest.raises(InvalidValueError, match="not a MemoryResource"):
        StatisticsAdaptor(object())  # type: ignore[arg-type]


def test_plain_resource_without_virtual_memory_disables_expandable(backend):
    class Plain(MemoryResource):
        device = 0

        def allocate(self, nbytes: int) -> int:
            return backend.malloc(0, nbytes)

        def deallocate(self, ptr: int, nbytes: int) -> None:
            backend.free(0, ptr)

        def memory_info(self) -> tuple[int, int]:
            return backend.memory_info(0)

    a = DeviceAllocator(backend, 0, parse("expandable_segments:True"), upstream=Plain())
    b = a.malloc(MiB, Runtime(backend).default_stream(0))
    assert [seg["is_expandable"] for seg in a.snapshot()] == [False]
    a.free(b)
    a.empty_cache()
    assert backend._memory[0]._held == 0


def test_allocator_over_an_adaptor_stack(backend):
    stats = StatisticsAdaptor(LimitingAdaptor(BackendResource(backend, 0), 64 * MiB))
    for config in ("", "expandable_segments:True"):
        a = DeviceAllocator(backend, 0, parse(config or "expandable_segments:False"), upstream=stats)
        s = Runtime(backend).default_stream(0)
        b = a.malloc(30 * MiB, s)
        with pytest.raises(OutOfMemoryError):
            a.malloc(40 * MiB, s)
        a.free(b)
        a.empty_cache()
        assert stats.counts.current_bytes == 0
