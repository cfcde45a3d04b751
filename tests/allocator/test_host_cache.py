"""The page-locked staging cache (accel/allocator/_host_cache.py) when a call is
interrupted (Ctrl-C) in the middle: its books stay whole and it stays usable."""

from __future__ import annotations

import pytest

from accel._runtime import Runtime
from accel.allocator._host_cache import HostBlock, HostCachingAllocator
from accel.allocator.config import AllocatorConfig
from accel.backends.base import CaptureMode
from tests.allocator.test_caching import _interrupt_call, stream


def check_books(host: HostCachingAllocator) -> None:
    """Every block the cache holds is handed out, cached, pending, the graphs' or retired, once."""
    with host._lock:
        cached = [b for blocks in host._free.values() for b in blocks]
        places = (
            [b for b in host._live.values() if b.allocated]
            + cached
            + list(host._pending)
            + list(host._graph_owned)
            + [b for b, _ in host._retired]
        )
        assert sorted(id(b) for b in places) == sorted(id(b) for b in host._live.values()), "a block is lost or twice"
        assert host.reserved_bytes == sum(b.size for b in host._live.values())
        assert host.cached_bytes == sum(b.size for b in cached)
        assert host._held.current == len(host._live)
        assert host._active.current == len(host._live) - len(cached)


def _retired_block(backend, host: HostCachingAllocator, rt: Runtime) -> tuple[HostBlock, object]:
    """A block a captured copy used, its graph released: reusable once the device passed it."""
    s = stream(rt)
    block = host.malloc(4096)
    backend.stream_begin_capture(0, s.native_handle, CaptureMode.RELAXED)
    host.begin_capture(0, (7, 0))
    host.record_stream(block, s)
    host.end_capture(0)
    backend.graph_destroy(0, backend.stream_end_capture(0, s.native_handle))
    host.free(block)
    host.release_pool((7, 0))
    assert host._retired
    return block, s


def test_an_interrupt_while_waiting_for_a_released_graph_keeps_its_blocks(backend, monkeypatch):
    """The blocks of released graphs were taken off their list before the wait for the
    device: a KeyboardInterrupt in that wait lost them (held for ever, never reused)."""
    rt = Runtime(backend)
    host = HostCachingAllocator(backend, AllocatorConfig())
    block, s = _retired_block(backend, host, rt)
    _interrupt_call(monkeypatch, backend, "device_synchronize", 1)
    with pytest.raises(KeyboardInterrupt):
        host.malloc(4096)
    monkeypatch.undo()
    check_books(host)
    again = host.malloc(4096)
    assert again.ptr == block.ptr, "the released graph's block is reused"
    host.free(again)
    host.empty_cache()
    check_books(host)
    assert host.reserved_bytes == 0
    del s


@pytest.mark.parametrize("call", ["event_create", "event_record"])
def test_an_interrupt_while_free_records_events_keeps_the_block(backend, monkeypatch, call):
    """free() of a block copies on streams used made and recorded an event per stream: a
    KeyboardInterrupt in event_create left the block on no list (never reused nor freed)."""
    rt = Runtime(backend)
    host = HostCachingAllocator(backend, AllocatorConfig())
    sides = [stream(rt), stream(rt)]
    block = host.malloc(4096)
    for side in sides:
        host.record_stream(block, side)
    _interrupt_call(monkeypatch, backend, call, 1)
    with pytest.raises(KeyboardInterrupt):
        host.free(block)
    monkeypatch.undo()
    check_books(host)
    host.stats()  # orders the uses the interrupt left
    for side in sides:
        side.synchronize()
    host.empty_cache()
    check_books(host)
    assert host.reserved_bytes == 0
    host.free(host.malloc(4096))
    check_books(host)
