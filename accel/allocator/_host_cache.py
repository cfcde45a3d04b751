"""A cache of page-locked host memory for asynchronous copies.

``Backend.host_malloc`` is slow on real drivers (cuMemHostAlloc pins pages,
zeMemAllocHost maps them into the device's address space), so freed staging
blocks are kept and reused, as PyTorch's CachingHostAllocator does. A block
used by copies on streams (``record_stream``) is reused only after those
streams passed an event recorded when it was freed.

Sizes up to ``pinned_max_round_threshold`` (every size when unset) round up
to a power of two, so that blocks are reusable across near sizes; larger
sizes round to whole pages. ``pinned_max_cached_size`` caps what is kept.

Graph captures (see :meth:`HostCachingAllocator.begin_capture`): while one
runs, no event is queried (a query would touch the capture's events, and
invalidates a CUDA capture in the global mode) and none is recorded on a
capturing stream. A block that captured work used (``record_stream`` on a
capturing stream) belongs to the capture's graph once freed: every replay
reads or writes it, so it is reused only after the graph's pool is released
and the device passed the graph's last replay.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, NoReturn

from accel._errors import DeviceError, InvalidHandleError, InvalidValueError, OutOfMemoryError
from accel.allocator._fork import track_lock
from accel.allocator._pool_ids import PoolId, check_pool_id
from accel.allocator.config import AllocatorConfig
from accel.backends.base import Backend, CaptureStatus
from accel.stream import Stream

_MAX_REQUEST = 1 << 60  # 1 EiB, the device allocators' limit too


__all__ = ["HostBlock", "HostCachingAllocator"]

_PAGE = 4096


class _Stat:
    """One of torch's host statistics: current, peak, total increase, total decrease."""

    __slots__ = ("current", "peak", "allocated", "freed")

    def __init__(self) -> None:
        self.current = self.peak = self.allocated = self.freed = 0

    def rise(self, n: int) -> None:
        self.current += n
        self.allocated += n
        if self.current > self.peak:
            self.peak = self.current

    def fall(self, n: int) -> None:
        self.current -= n
        self.freed += n


class _Timer:
    """Microseconds spent in one kind of driver call: total, max, min, count."""

    __slots__ = ("total", "max", "min", "count")

    def __init__(self) -> None:
        self.total = self.max = self.min = self.count = 0

    def add(self, ns: int) -> None:
        us = ns // 1000
        self.total += us
        self.max = max(self.max, us)
        self.min = us if self.count == 0 else min(self.min, us)
        self.count += 1


class HostBlock:
    """One staging allocation: ``ptr``, ``size`` (rounded) and who used it."""

    __slots__ = ("ptr", "size", "allocated", "stream_uses", "events", "graphs")

    def __init__(self, ptr: int, size: int) -> None:
        self.ptr = ptr
        self.size = size
        self.allocated = False
        self.stream_uses: set[tuple[int, int]] = set()  # (device, stream handle)
        self.events: list[tuple[int, int]] = []  # (device, event) recorded at free
        self.graphs: set[PoolId] = set()  # pools of the graphs whose captured work uses it

    def __repr__(self) -> str:
        return f"<HostBlock {self.ptr:#x} {self.size} bytes>"


class HostCachingAllocator:
    """Staging memory of one backend, cached by rounded size.

    >>> from accel.allocator._host_cache import HostCachingAllocator
    >>> from accel.backends.cpu import CpuBackend
    >>> from accel.allocator.config import AllocatorConfig
    >>> host = HostCachingAllocator(CpuBackend(1, None), AllocatorConfig())
    >>> b = host.malloc(3000); b.size
    4096
    >>> host.free(b); host.malloc(4000).ptr == b.ptr  # the memory is reused
    True
    """

    def __init__(self, backend: Backend, config: AllocatorConfig) -> None:
        self.backend = backend
        self._lock = threading.Lock()
        track_lock(self)
        self._free: dict[int, list[HostBlock]] = {}  # rounded size -> reusable blocks
        self._pending: list[HostBlock] = []  # freed, waiting for their events
        self._live: dict[int, HostBlock] = {}  # ptr -> every block this cache holds
        self._events: dict[int, list[int]] = {}  # device -> pooled events
        self._gc_frees: deque[HostBlock | PoolId] = deque()  # frees and pool releases from finalizers
        # Captures: device -> pool of the capture under way there; pool -> graphs using
        # it; freed blocks graphs still use; blocks of released graphs, reusable once
        # their devices passed the graphs' last replays.
        self._capturing: dict[int, PoolId] = {}
        self._pool_uses: dict[PoolId, int] = {}
        self._graph_owned: list[HostBlock] = []
        self._retired: list[tuple[HostBlock, set[int]]] = []
        self.allocated_bytes = 0
        self.reserved_bytes = 0
        self.cached_bytes = 0
        # torch's host_memory_stats(): blocks and bytes held (active + cached),
        # blocks and bytes handed out and not yet reusable
        self._held = _Stat()
        self._held_bytes = _Stat()
        self._active = _Stat()
        self._active_bytes = _Stat()
        self._alloc_time = _Timer()
        self._free_time = _Timer()
        self.update_config(config)

    def update_config(self, config: AllocatorConfig) -> None:
        if not isinstance(config, AllocatorConfig):
            raise InvalidValueError(
                f"update_config: config={config!r} is not an AllocatorConfig; pass one, such as "
                "accel.allocator.parse('pinned_max_cached_size:1GB')"
            )
        self._round_threshold = config.pinned_max_round_threshold
        self._max_cached = config.pinned_max_cached_size

    def _round(self, nbytes: int) -> int:
        if self._round_threshold is None or nbytes <= self._round_threshold:
            return max(_PAGE, 1 << (nbytes - 1).bit_length())
        return -(-nbytes // _PAGE) * _PAGE

    def malloc(self, nbytes: int) -> HostBlock:
        """A staging block of at least ``nbytes`` (reused when one is free)."""
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise InvalidValueError(f"nbytes={nbytes!r} must be a positive int")
        if nbytes >= _MAX_REQUEST:  # past what a driver's size_t takes; no machine has it
            raise OutOfMemoryError(
                f"host out of memory: tried to allocate more than 1EB ({nbytes} bytes) of "
                "page-locked memory; no machine has that much",
                requested=nbytes,
            )
        size = self._round(nbytes)
        if self._retired and not self._capturing:
            self._reuse_retired()
        with self._lock:
            if self._gc_frees:
                self._drain_gc_frees()
            if not self._capturing:
                self._process_events()
            blocks = self._free.get(size)
            if blocks:
                block = blocks.pop()
                self.cached_bytes -= size
            else:
                block = None
        if block is None:
            # host_malloc can take long on a real driver; do not hold the lock.
            start = time.perf_counter_ns()
            block = HostBlock(self.backend.host_malloc(size), size)
            took = time.perf_counter_ns() - start
            with self._lock:
                self._live[block.ptr] = block
                self.reserved_bytes += size
                self._held.rise(1)
                self._held_bytes.rise(size)
                self._alloc_time.add(took)
        with self._lock:
            block.allocated = True
            self.allocated_bytes += size
            self._active.rise(1)
            self._active_bytes.rise(size)
        return block

    def record_stream(self, block: HostBlock, stream: Stream) -> None:
        """Mark ``block`` as used by work queued on ``stream``."""
        if not isinstance(stream, Stream):
            raise InvalidValueError(
                f"record_stream: stream={stream!r} ({type(stream).__name__}) is not an accel.Stream; "
                "pass the stream whose work uses the block, such as accel.current_stream()"
            )
        if stream._runtime.backend is not self.backend:
            raise DeviceError(f"{stream!r} belongs to another backend than this staging memory")
        self._check_block(block, "record_stream")
        handle = stream._live()
        device = stream.device_index
        pool = self._capturing.get(device)
        captured = pool is not None and self._is_capturing(device, handle)
        with self._lock:
            if not block.allocated or self._live.get(block.ptr) is not block:
                raise InvalidHandleError(f"record_stream on {block!r}, which is not allocated")
            if captured and pool is not None:
                block.graphs.add(pool)  # every replay uses it: it is the graph's until the graph is gone
            else:
                block.stream_uses.add((device, handle))

    def free(self, block: HostBlock) -> None:
        """Give ``block`` back; it is reused after the streams that used it pass this point."""
        self._check_block(block, "free")
        with self._lock:
            if not block.allocated or self._live.get(block.ptr) is not block:
                raise InvalidHandleError(f"{block!r} is not allocated (freed twice?)")
            self._free_locked(block)

    def free_from_finalizer(self, block: HostBlock) -> None:
        """Free from a garbage-collection finalizer, which may run while this
        thread holds the lock: then the free waits for the next call."""
        self._check_block(block, "free_from_finalizer")  # a deferred one would be taken for a pool id
        if self._lock.acquire(blocking=False):
            try:
                if block.allocated:
                    self._free_locked(block)
            finally:
                self._lock.release()
        else:
            self._gc_frees.append(block)

    def _check_block(self, block: object, call: str) -> None:
        if not isinstance(block, HostBlock):
            self._bad_block(block, call)

    def _bad_block(self, block: object, call: str) -> NoReturn:
        raise InvalidValueError(
            f"{call}: block={block!r} ({type(block).__name__}) is not a HostBlock; pass a HostBlock that "
            "malloc() of this staging cache returned"
        )

    def _drain_gc_frees(self) -> None:
        while self._gc_frees:
            item = self._gc_frees.popleft()
            if isinstance(item, HostBlock):
                if item.allocated:
                    self._free_locked(item)
            else:
                self._release_pool_locked(item)

    def _free_locked(self, block: HostBlock) -> None:
        block.allocated = False
        self.allocated_bytes -= block.size
        for device, handle in block.stream_uses:
            capture_pool = self._capturing.get(device)
            if capture_pool is not None and self._is_capturing(device, handle):
                # An event recorded there now would belong to the capture: the
                # block waits for the capture's graph instead.
                block.graphs.add(capture_pool)
        block.graphs &= self._pool_uses.keys()
        if block.graphs:
            # Captured work uses it: it stays the graphs' (its other uses, queued
            # before, are over by the time a released graph gives it back).
            block.stream_uses.clear()
            self._graph_owned.append(block)
            return
        try:
            error = self._order(block)
        except BaseException:
            # Interrupted (Ctrl-C), or no event could be made: the uses left are
            # ordered by _process_events; until then the block is pending.
            self._pending.append(block)
            raise
        if block.events:
            self._pending.append(block)
        else:
            self._cache(block)
        if error is not None:
            raise error

    def _order(self, block: HostBlock) -> BaseException | None:
        """Record an event on each stream ``block`` was used on, each use leaving the
        block once ordered; the error of a stream that refused the record, if any."""
        error: BaseException | None = None
        while block.stream_uses:
            device, handle = use = next(iter(block.stream_uses))
            pool = self._events.setdefault(device, [])
            event = pool.pop() if pool else self.backend.event_create(
                device, timing=False, blocking=False, interprocess=False
            )
            try:
                self.backend.event_record(device, event, handle)
            except BaseException as exc:
                # Stream closed, or the driver failed: wait for the whole
                # device instead, so the block is still reused safely.
                pool.append(event)
                self.backend.device_synchronize(device)
                block.stream_uses.discard(use)
                if not isinstance(exc, InvalidHandleError):
                    error = error or exc
                continue
            block.stream_uses.discard(use)
            block.events.append((device, event))
        return error

    def _cache(self, block: HostBlock) -> None:
        # Reusable now: no longer an active request.
        self._active.fall(1)
        self._active_bytes.fall(block.size)
        if self._max_cached is not None and self.cached_bytes + block.size > self._max_cached:
            # Keeping it would take the cache past pinned_max_cached_size:
            # release this block, and keep what is already cached.
            self._host_free(block)
            return
        # A fresh object holds the cached memory and the freed one is retired (as the
        # device allocator retires its blocks): a stale free of it is then refused
        # instead of freeing the block of whoever gets this memory next.
        fresh = HostBlock(block.ptr, block.size)
        self._live[block.ptr] = fresh
        self._free.setdefault(block.size, []).append(fresh)
        self.cached_bytes += block.size

    # -- captures -------------------------------------------------------------------

    def begin_capture(self, device: int, pool_id: PoolId) -> None:
        """A capture into the graph pool ``pool_id`` begins on ``device``: no event
        queries until it ends, and blocks its work uses become the pool's graphs'."""
        pool_id = check_pool_id(pool_id, where="begin_capture")
        device = self._device_index(device, "begin_capture")
        with self._lock:
            self._capturing[device] = pool_id
            self._pool_uses[pool_id] = self._pool_uses.get(pool_id, 0) + 1

    def end_capture(self, device: int) -> None:
        """The capture on ``device`` ended (its graph, if any, lives on)."""
        device = self._device_index(device, "end_capture")
        with self._lock:
            self._capturing.pop(device, None)

    def release_pool(self, pool_id: PoolId, *, from_finalizer: bool = False) -> None:
        """One graph of ``pool_id`` is gone; at the last, the blocks its replays used
        are reused once their devices passed the last replay (a finalizer's
        release waits for the next call when the lock is taken)."""
        pool_id = check_pool_id(pool_id, where="release_pool")
        if from_finalizer and not self._lock.acquire(blocking=False):
            self._gc_frees.append(pool_id)
            return
        if not from_finalizer:
            self._lock.acquire()
        try:
            self._release_pool_locked(pool_id)
        finally:
            self._lock.release()

    def _release_pool_locked(self, pool_id: PoolId) -> None:
        uses = self._pool_uses.get(pool_id, 0) - 1
        if uses > 0:
            self._pool_uses[pool_id] = uses
            return
        self._pool_uses.pop(pool_id, None)
        still = []
        for block in self._graph_owned:
            block.graphs.discard(pool_id)
            if block.graphs:
                still.append(block)
            else:
                # Which devices replayed it is not known: all of them are waited for.
                self._retired.append((block, set(range(self.backend.device_count()))))
        self._graph_owned = still

    def _reuse_retired(self) -> None:
        """Cache the blocks of released graphs once their devices passed every replay.

        The wait happens outside the lock: a host function queued before it may
        itself allocate staging memory."""
        with self._lock:
            retired = list(self._retired)
        devices = set().union(*(d for _, d in retired)) if retired else set()
        for device in sorted(devices):
            self.backend.device_synchronize(device)
        # They leave the list only now: a wait interrupted (Ctrl-C) keeps them listed,
        # and another thread may have cached them meanwhile.
        waited = {id(block) for block, _ in retired}
        with self._lock:
            still = []
            for entry in self._retired:
                if id(entry[0]) in waited:
                    self._cache(entry[0])
                else:
                    still.append(entry)
            self._retired = still

    def _device_index(self, device: object, call: str) -> int:
        count = self.backend.device_count()
        if isinstance(device, bool) or not isinstance(device, int) or not 0 <= device < count:
            raise DeviceError(
                f"{call}: device={device!r} is not a device index of the {self.backend.name} backend "
                f"(0 to {count - 1})"
            )
        return device

    def _is_capturing(self, device: int, stream: int) -> bool:
        return self.backend.stream_capture_status(device, stream) != CaptureStatus.NONE

    def _process_events(self) -> None:
        still: list[HostBlock] = []
        pending = self._pending
        try:  # each block leaves the list once handled: an interrupt leaves the books whole
            while pending:
                block = pending[-1]
                if block.stream_uses:
                    # Left unordered by an interrupted free, which raised; a stream that
                    # refuses the record now was waited for instead.
                    self._order(block)
                while block.events and self.backend.event_query(*block.events[-1]):
                    device, event = block.events.pop()
                    self._events[device].append(event)
                pending.pop()
                if block.events:
                    still.append(block)
                else:
                    self._cache(block)
        finally:
            pending.extend(reversed(still))

    def _release_free(self) -> None:
        for blocks in self._free.values():
            for block in blocks:
                self._host_free(block)
                self.cached_bytes -= block.size
        self._free.clear()

    def _host_free(self, block: HostBlock) -> None:
        start = time.perf_counter_ns()
        self.backend.host_free(block.ptr)
        self._free_time.add(time.perf_counter_ns() - start)
        del self._live[block.ptr]
        self.reserved_bytes -= block.size
        self._held.fall(1)
        self._held_bytes.fall(block.size)

    def empty_cache(self) -> None:
        """Free every cached block whose copies completed (pending ones stay)."""
        if self._retired and not self._capturing:
            self._reuse_retired()
        with self._lock:
            if self._gc_frees:
                self._drain_gc_frees()
            if not self._capturing:
                self._process_events()
            self._release_free()

    def stats(self) -> dict[str, int]:
        with self._lock:
            if self._gc_frees:
                self._drain_gc_frees()
            if not self._capturing:
                self._process_events()
            return {
                "allocated_bytes": self.allocated_bytes,
                "reserved_bytes": self.reserved_bytes,
                "cached_bytes": self.cached_bytes,
                "pending_blocks": len(self._pending),
            }

    def memory_stats(self) -> dict[str, int | float]:
        """torch's ``host_memory_stats()`` keys, sorted: ``allocations``,
        ``allocated_bytes`` (blocks held, active and cached), ``active_requests``,
        ``active_bytes`` (handed out, not yet reusable), each ``.current``,
        ``.peak``, ``.allocated``, ``.freed``; ``num_host_alloc``,
        ``num_host_free``; ``host_alloc_time`` and ``host_free_time`` (µs) as
        ``.total``, ``.max``, ``.min``, ``.count``, ``.avg``."""
        with self._lock:
            if self._gc_frees:
                self._drain_gc_frees()
            if not self._capturing:
                self._process_events()
            out: dict[str, int | float] = {}
            for name, stat in (
                ("allocations", self._held),
                ("allocated_bytes", self._held_bytes),
                ("active_requests", self._active),
                ("active_bytes", self._active_bytes),
            ):
                for metric in _Stat.__slots__:
                    out[f"{name}.{metric}"] = getattr(stat, metric)
            out["num_host_alloc"] = self._held.allocated
            out["num_host_free"] = self._held.freed
            for name, timer in (("host_alloc_time", self._alloc_time), ("host_free_time", self._free_time)):
                for metric in _Timer.__slots__:
                    out[f"{name}.{metric}"] = getattr(timer, metric)
                out[f"{name}.avg"] = timer.total // timer.count if timer.count else 0
            return dict(sorted(out.items()))

    def reset_peak_stats(self) -> None:
        """Set the peaks to the current values (torch's ``reset_peak_host_memory_stats``)."""
        with self._lock:
            for stat in (self._held, self._held_bytes, self._active, self._active_bytes):
                stat.peak = stat.current

    def reset_accumulated_stats(self) -> None:
        """Zero the totals (``.allocated``, ``.freed``, the call counts and times)."""
        with self._lock:
            for stat in (self._held, self._held_bytes, self._active, self._active_bytes):
                stat.allocated = stat.freed = 0
            self._alloc_time = _Timer()
            self._free_time = _Timer()
