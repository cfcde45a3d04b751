"""The caching device allocator, written once against the Backend protocol.

Its books live in ONE native core per device (csrc/accel_core.c, through
:class:`~accel.allocator._native_core.NativeCore`): the same core torch's pluggable
allocator allocates from (:func:`accel.allocator.torch_allocator_spec`), so accel
buffers and torch tensors share one cache, one set of statistics and one snapshot.
The core keeps the plain segments: blocks, best-fit free lists per (pool, stream),
split and merge, PyTorch's rounding, the garbage-collection threshold, giving back
oversize cached blocks on a miss, the statistics. This class is the policy and API
layer over it: argument checks, streams, the pool a capture allocates to, the events
that order cross-stream reuse (a block freed with other streams' uses is *held* in
the core until they pass), frees deferred during a capture, history, the memory
fraction (the core asks :meth:`DeviceAllocator._admit_core` before each new
segment), dropped MemPools' memory, out-of-memory reports and configuration.

Expandable segments (``expandable_segments:True`` on a resource with virtual
memory) are still kept here, in Python (:class:`~accel.allocator._blocks.Segment`,
:class:`~accel.allocator._blocks.Block`, :class:`~accel.allocator._freelist.FreeList`):
while the setting is on, every allocation maps pages of those; their statistics are
added to the core's.

Behaviour follows PyTorch's ``DeviceCachingAllocator``: 512-byte rounding with optional power-of-two
divisions, a small pool (requests up to 1 MiB, 2 MiB segments) and a large
pool (20 MiB segments for 1-10 MiB, else rounded to 2 MiB), best fit per
stream, splitting and merging, ``max_split_size`` / ``max_non_split_rounding``,
the garbage-collection threshold, a per-process memory fraction, events for
cross-stream frees, private pools for graph capture and expandable segments.

Where accel deliberately differs:

- during a capture nothing is returned upstream, also not by the
  "release available cached blocks" step (PyTorch issue #159594);
- oversize rules are not applied inside expandable segments (PyTorch #193400);
- memory is returned upstream only after the device is synchronized, because
  the host backend's ``free`` (like Level Zero's) is not stream ordered;
- expandable segments can be toggled at runtime: existing expandable blocks
  stay in use while they are allocated, free ones are skipped while the
  setting is off and given back by ``empty_cache``;
- expandable segments map 2 MiB pages in both pools, and one that must grow
  first unmaps the whole free pages of the holes of every expandable segment
  of the allocator and maps their physical pages again where it grows
  (PyTorch keeps holes mapped until ``empty_cache``); the growth goes where
  it adds the fewest pages to those live blocks touch, and a block cut from
  a free block goes at its end when that adds fewer than its start (see
  ``_map_target``, ``_give_back_holes``, ``_place_at_end``);
- memory is cached under a stream's handle only while the stream lives: when
  accel destroys a stream (its queued work may still run, and the driver may
  give the handle to the next stream created), what the allocator keyed by it
  moves to a key no stream has, reused by no stream and given back once an
  event recorded at the destruction completed (PyTorch never destroys the
  streams of its pools; see ``_retire``).
"""

from __future__ import annotations

import os
import sys
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from threading import get_ident
from typing import TYPE_CHECKING, Any, NoReturn

from accel._errors import (
    AccelError,
    CaptureError,
    DeviceError,
    InvalidHandleError,
    InvalidValueError,
    OutOfMemoryError,
    warn_at_caller,
)
from accel.allocator import _stats as S
from accel.allocator._blocks import ALLOCATED, FREE, PENDING, RETIRED, Block, CoreBlock, CoreSteps, Pool, PrivatePool, Segment
from accel.allocator._fork import OwnedLock, track_lock
from accel.allocator._freelist import FreeList
from accel.allocator._stats import OVERSIZE_ALLOCATIONS
from accel.allocator._history import History
from accel.allocator._native_core import GIVE_BACK_FIRST, NO_RETRY, NativeCore, entry_points
from accel.allocator._oom import OutOfMemoryDetails, out_of_memory
from accel.allocator._pool_ids import PoolId, check_pool_id
from accel.allocator._resources import BackendResource, MemoryResource
from accel.allocator.config import AllocatorConfig, AllocatorConfigWarning
from accel.backends.base import Backend, CaptureStatus, record_new_event
from accel.stream import Stream

__all__ = ["DeviceAllocator", "release_orphans", "stream_destroyed"]

KB_MIN = 512  # minimum block size and rounding quantum
SMALL_SIZE = 1 << 20  # requests up to this go to the small pool
SMALL_BUFFER = 2 << 20  # small segments; also the expandable page of the small pool
MAX_REQUEST = 1 << 60  # 1 EiB: PyTorch refuses anything larger
_UNLIMITED = 1 << 62  # max_split_size when unset


def round_size(size: int, divisions: int) -> int:
    """``size`` rounded as PyTorch's ``round_size`` does, for ``divisions`` (0/1: none).

    Power-of-two divisions apply above ``512 * divisions`` bytes only:

    >>> round_size(4800, 4), round_size(1200, 4), round_size(100, 0)
    (5120, 1536, 512)
    """
    if size < KB_MIN:
        return KB_MIN
    if divisions > 1 and size > KB_MIN * divisions:
        if size & (size - 1) == 0:
            return size
        floor2 = 1 << (size.bit_length() - 1)
        step = floor2 >> (divisions.bit_length() - 1)
        if step == 0:
            return 2 * floor2
        return -(-size // step) * step
    return (size + KB_MIN - 1) & ~(KB_MIN - 1)


class _PoolRelease:
    """A pool's use given back by a finalizer that found the allocator's lock taken."""

    __slots__ = ("pool_id",)

    def __init__(self, pool_id: PoolId) -> None:
        self.pool_id = pool_id


class _StreamRetired:
    """A stream handle destroyed while this allocator keyed memory by it (see
    :meth:`DeviceAllocator._retire`): ``event`` completes after the work queued on the
    stream before its destruction (None: nothing of it will run; _UNORDERED: no event
    could be recorded, so only a device synchronization orders after that work)."""

    __slots__ = ("handle", "event")

    def __init__(self, handle: int, event: int | None) -> None:
        self.handle = handle
        self.event = event


_UNORDERED = -1  # a _StreamRetired event that could not be recorded

# Every allocator, so that a destroyed stream reaches those of its device: the
# registry's and the MemPools' alike.
_allocators: weakref.WeakSet[DeviceAllocator] = weakref.WeakSet()


def _forget_the_core_in_child() -> None:
    """In a forked child: another parent thread may have been inside a core call of the
    common pair at the fork (it holds no lock the fork waits for), its mutex then held
    forever here. The child's allocators leave their cores alone: no common pair, and a
    free by a finalizer is dropped (accel refuses to run in the child; the memory is the
    parent's, or a copy that goes with the child)."""
    for allocator in list(_allocators):
        allocator._forked = True
        allocator._plain = False


os.register_at_fork(after_in_child=_forget_the_core_in_child)


def _admitter(ref: weakref.ref[DeviceAllocator]) -> Callable[[int], None]:
    """The native core's admission check of a new segment, holding its allocator weakly
    (the core's callbacks live as long as the core's C side, which may outlive it)."""

    def admit(size: int) -> None:
        allocator = ref()
        if allocator is not None:
            allocator._admit_core(size)

    return admit


def _notifier(ref: weakref.ref[DeviceAllocator]) -> Callable[[str, int, int], None]:
    """The native core's report of a segment taken from or given back upstream: the
    history's segment_alloc / segment_free (held weakly, as _admitter)."""

    def notify(event: str, ptr: int, size: int) -> None:
        allocator = ref()
        history = allocator._history if allocator is not None else None
        if history is not None:
            history.record(event, ptr, size, 0, history.block_frames() if event == "segment_alloc" else None)

    return notify


def stream_destroyed(backend: Backend, device: int, handle: int) -> None:
    """Stream ``handle`` of ``backend``'s ``device`` is about to be destroyed (the
    runtime's stream-destroy listener; it runs in finalizers too, so it never waits)."""
    for allocator in list(_allocators):
        if allocator.backend is backend and allocator.device == device:
            allocator._stream_destroyed(handle)


# Allocators of dropped MemPools that still hold cached memory their release could
# not give back without waiting for the device (it runs in finalizers and in free(),
# maybe on a thread the device's work waits for): a later call that may wait,
# empty_cache or an allocation short of memory on the same device, finishes it.
# No lock: a set's add, discard and copy are each atomic under the GIL.
_orphans: set[DeviceAllocator] = set()


# How long one call of release_orphans waits, in all, for dropped pools' allocators
# that other threads hold (see release_orphans: a bound against a lock cycle the
# rules below should rule out, not a wait expected to run out).
ORPHAN_WAIT_S = 60.0


def release_orphans(backend: Backend, device: int | None, *, busy: DeviceAllocator | None = None) -> int:
    """Give back the cached memory of dropped pools' allocators of ``backend``'s
    ``device`` (None: every device), waiting for the device as empty_cache does:
    call it only where waiting is safe. ``busy``: an allocator whose lock the caller
    holds. Returns the bytes given back.

    An orphan whose lock another thread holds (it is giving the orphan's memory back
    after a wait for the device, or freeing into it) is waited for, so that the
    caller (an allocation short of memory) retries only once the memory that orphan
    held is back. No lock cycle: every thread waiting here holds at most the lock of
    ``busy``, a live pool's allocator (nobody allocates from a dropped pool) that is
    in no ``_orphans`` while its lock is held (only that lock's holder adds it); and
    the holder of an orphan's lock waits for no other allocator. A caller whose own
    allocator was dropped too (allocating through an allocator it holds) waits for
    no orphan, so two of them never wait for each other; ORPHAN_WAIT_S bounds the
    wait should that reasoning miss a case. Orphans noted while this runs (pools
    dropped meanwhile) are taken too."""
    may_wait = busy is None or not busy._orphaned
    deadline = None
    done: set[DeviceAllocator] = set()
    given = 0
    while True:
        todo = [
            orphan
            for orphan in _orphans.copy()
            if orphan not in done
            and orphan is not busy
            and orphan.backend is backend
            and device in (None, orphan.device)
        ]
        if not todo:
            return given
        done.update(todo)
        # Those free now first, then the busy ones: a busy one's holder is waiting
        # for the device, and the others' memory need not wait for it.
        waiting = []
        for orphan in todo:
            if orphan._lock.acquire(blocking=False):
                given += orphan._release_orphaned()
            elif may_wait:
                waiting.append(orphan)
        for orphan in waiting:
            if deadline is None:
                deadline = time.monotonic() + ORPHAN_WAIT_S
            if orphan._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
                given += orphan._release_orphaned()


class DeviceAllocator:
    """Caching allocator for one device of one backend.

    Memory comes from ``upstream`` (default: the backend itself); streams are
    accel :class:`~accel.Stream` objects of that device. ``malloc`` returns a
    block handle (a :class:`CoreBlock` of the native core, or a :class:`Block` of an
    expandable segment) whose ``ptr`` and ``size`` the caller uses; ``free`` gives
    it back to the cache. Thread safe: one lock guards the policy's state; the core
    has its own, and the common pair (no capture, history, expandable segments or
    pending events) takes only the core's.
    ``mempool``: the id of the :class:`~accel.memory.MemPool` it serves, if any
    (an out-of-memory error of another allocator of the device counts the pool's).

    >>> from accel.allocator import DeviceAllocator
    >>> from accel.backends.cpu import CpuBackend
    >>> from accel.allocator.config import AllocatorConfig
    >>> from accel._runtime import Runtime
    >>> backend = CpuBackend(1, None)
    >>> alloc = DeviceAllocator(backend, 0, AllocatorConfig())
    >>> s = Runtime(backend).default_stream(0)
    >>> b = alloc.malloc(1000, s); b.size
    1024
    >>> alloc.free(b); alloc.stats()["reserved_bytes.all.current"]
    2097152
    """

    def __init__(
        self,
        backend: Backend,
        device: int,
        config: AllocatorConfig,
        *,
        upstream: MemoryResource | None = None,
        mempool: PoolId | None = None,
    ) -> None:
        self.backend = backend
        self.device = device
        self.upstream = upstream if upstream is not None else BackendResource(backend, device)
        if self.upstream.device != device:
            raise DeviceError(
                f"the upstream resource serves device {self.upstream.device}, not device {device}"
            )
        # Notes its holder: a gc callback or finalizer that calls in while this thread
        # holds it is refused (a free deferred) rather than waiting forever.
        self._lock = OwnedLock(f"the caching allocator of device {device}")
        track_lock(self)
        self._stats = S.Stats()
        self._s = self._stats.s  # the flat counters, for the hot paths
        self._kinds = self._stats.kinds  # the hot ones, by pool kind
        self._small = Pool(True, None)
        self._large = Pool(False, None)
        self._segments: dict[int, Segment] = {}
        self._private: dict[PoolId, PrivatePool] = {}
        # (pool id, stream filter) of the captures under way, innermost last
        self._captures: list[tuple[PrivatePool, Callable[[Stream], bool]]] = []
        # Frees held back until the captures end (or, outside one, until the next release
        # of cached memory: an interrupt left their stream uses unordered).
        self._deferred: list[Block | CoreBlock] = []
        self._pending: dict[int, deque[tuple[int, Block | CoreBlock]]] = {}  # used stream -> (event, block)
        self._events: list[int] = []  # pooled events, ready for reuse
        self._events_created = 0
        # Frees (and pool releases) from finalizers that found the lock taken.
        self._gc_frees: deque[Block | CoreBlock | _PoolRelease | _StreamRetired] = deque()
        self._history: History | None = None
        self._fraction: float | None = None
        self._fraction_explicit = False
        self._allowed: int | None = None
        self._name = f"{backend.name}:{device}"
        self._vm = self.upstream.supports_virtual_memory()
        self._fraction_refused = False
        self._refusal = ""  # the device's own words when it last refused memory
        # Set when the owner (a dropped MemPool) needs this allocator no more: every
        # segment goes back upstream once nothing is allocated from it.
        self._orphaned = False
        # The MemPool this allocator serves (None: the device's own, or the caller's):
        # an out-of-memory error elsewhere on the device says what the pool caches.
        self._mempool = mempool
        self._growths = 0  # expandable segment growths: the clock of Segment.grown_at
        # Stream handles this allocator keys memory by (segments' streams, record_stream
        # uses): a destroyed one is retired (see _retire), the others cost nothing.
        self._known: set[int] = set()
        # Retired handles' keys (negative: never a live handle) -> the event after the
        # destroyed stream's work (absent: nothing to wait for).
        self._retired: dict[int, int] = {}
        self._next_key = -1
        # The books of the plain segments, shared with torch's pluggable allocator on
        # this device (see native_core); the handles of its blocks callers hold, by address.
        ref = weakref.ref(self)
        self._core = core = NativeCore(self.upstream, backend.device_synchronize, _admitter(ref), _notifier(ref))
        self._live: dict[int, CoreBlock] = {}
        # Every change of the core's books of a block and of its handle in _live is one
        # of these C steps (so an interrupt never lands between the two): the hot paths',
        # the compiled pair's (accel/_speedups.c) and the locked paths' alike.
        self._steps = CoreSteps(self, core.address, self._live, self._known, entry_points(), InvalidHandleError)
        # True while the common pair needs nothing but the core (no capture under way, no
        # history, no expandable segments, no pending events, no frees or retired streams
        # waiting for the lock, not orphaned): malloc and free then take no lock, the
        # core's mutex guards its books and dict operations the handles. Set False
        # wherever one of those begins, recomputed by the locked paths (_refresh_plain).
        self._plain = False
        self._forked = False  # see _forget_the_core_in_child
        self._next_pool_key = 1  # the core's numbers of private pools (0: the default pool)
        self._apply_config(config)
        _allocators.add(self)

    def __repr__(self) -> str:
        return f"<accel DeviceAllocator {self._name}>"

    # -- configuration ---------------------------------------------------------

    def _apply_config(self, config: AllocatorConfig) -> None:
        self.config = config
        old_ms = getattr(self, "_ms", None)
        self._ms = _UNLIMITED if config.max_split_size is None else config.max_split_size
        if old_ms is not None and old_ms != self._ms:
            self._recount_oversize()
        self._nsr = config.max_non_split_rounding
        self._gc_threshold = config.garbage_collection_threshold
        self._divisions = tuple(config.roundup_power2_divisions)
        self._large_segment = config.large_segment_size
        self._expandable = bool(config.expandable_segments) and self._vm
        self._plain = False
        self._keep_free = config.expandable_keep_free
        if config.expandable_segments and not self._vm:
            warn_at_caller(
                f"expandable_segments:True has no effect on {self._name}: its memory resource has "
                "no virtual memory, so segments stay plain allocations",
                AllocatorConfigWarning,
            )
        if not self._fraction_explicit:
            self._set_fraction(config.per_process_memory_fraction, explicit=False)
        self._configure_core()

    def _configure_core(self) -> None:
        core = self._core
        core.configure(self.config.max_split_size, self._nsr, self._large_segment)
        core.set_divisions(self._divisions)
        # PyTorch collects garbage only under a memory fraction: the threshold is of it
        allowed = self._allowed
        core.set_gc_threshold(int(self._gc_threshold * allowed) if self._gc_threshold and allowed else 0)

    def native_core(self) -> NativeCore:
        """The native allocator core that keeps this allocator's books: torch's pluggable
        allocator allocates from it too (:func:`accel.allocator.torch_allocator_spec`),
        so accel buffers and torch tensors share one cache and one set of statistics.
        """
        return self._core

    def _core_reserved(self) -> int:
        """Bytes the native core holds."""
        return self._core.reserved()

    def _admit_core(self, size: int) -> None:
        """The memory fraction caps what the core reserves: refuse a new segment of
        ``size`` bytes past the cap (read without the lock, as a check before asking the
        device; the core's callback runs on torch's threads too)."""
        allowed = self._allowed
        if allowed is not None and self._reserved() + self._core_reserved() + size > allowed:
            self._fraction_refused = True
            raise OutOfMemoryError(
                f"{self._name}: a new segment of {size} bytes would pass the "
                f"memory fraction's cap of {allowed} bytes; free memory, or raise the fraction "
                "(set_per_process_memory_fraction)",
                requested=size,
                device=self.device,
            )

    def _recount_oversize(self) -> None:
        """max_split_size changed: count oversize blocks and segments again, so
        frees under the new bound keep the statistics right."""
        s = self._stats.s
        blocks = segments = 0
        for seg in self._segments.values():
            if not seg.expandable and seg.size >= self._ms:
                segments += 1
            for b in seg.blocks():
                if b.state == ALLOCATED and b.size >= self._ms:
                    blocks += 1
        for base, count in ((S.OVERSIZE_ALLOCATIONS, blocks), (S.OVERSIZE_SEGMENTS, segments)):
            s[base] = count
            s[base + 2] = max(s[base + 2], count)
            s[base + 6] = max(s[base + 6], count)

    def update_config(self, config: AllocatorConfig) -> None:
        """Take new settings (the config module's change listener calls this)."""
        if not isinstance(config, AllocatorConfig):
            raise InvalidValueError(
                f"update_config: config={config!r} is not an AllocatorConfig; pass one, such as "
                "accel.allocator.parse('expandable_segments:True')"
            )
        with self._lock:
            self._apply_config(config)

    def _set_fraction(self, fraction: float, *, explicit: bool) -> None:
        # A call of set_memory_fraction wins over the configuration from then on.
        self._fraction_explicit = self._fraction_explicit or explicit
        if fraction >= 1.0 and not explicit:
            self._fraction, self._allowed = None, None
            self._configure_core()
            return
        _, total = self.upstream.memory_info()
        self._fraction = fraction
        self._allowed = int(fraction * total)
        self._configure_core()

    def set_memory_fraction(self, fraction: float) -> None:
        """Cap what this allocator reserves at ``fraction`` of the device's total memory.

        Going past the cap raises OutOfMemoryError without asking the device.
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0.0 <= fraction <= 1.0:
            raise InvalidValueError(f"memory fraction {fraction!r} must be a number in [0, 1]")
        with self._lock:
            self._set_fraction(float(fraction), explicit=True)

    def get_memory_fraction(self) -> float:
        """The fraction set (1.0 when none)."""
        return 1.0 if self._fraction is None else self._fraction

    # -- allocation --------------------------------------------------------------

    def malloc(self, nbytes: int, stream: Stream) -> Block | CoreBlock:
        """A block of at least ``nbytes`` usable in order on ``stream``.

        Raises :class:`~accel.OutOfMemoryError` (with a diagnosis) when even
        after freeing the cache the memory is not there.
        """
        if nbytes.__class__ is not int or not 0 < nbytes < MAX_REQUEST:
            self._bad_size(nbytes)
        try:
            if stream._device != self.device or stream._runtime.backend is not self.backend or stream._closed:
                self._bad_stream(stream, "an allocation")
            handle = stream._handle
        except AttributeError:  # not a Stream (costs nothing until raised)
            self._bad_stream(stream, "an allocation")
        if self._plain:
            # The common case: the core alone, no lock (see _plain). A refusal is
            # handled by the locked path's steps (give the cache back, ask again).
            got = self._steps.malloc(nbytes, handle, 0, NO_RETRY)
            if isinstance(got, int):  # not ACCEL_CORE_OK
                return self._malloc_refused(got, nbytes, stream)
            if stream._closed:  # after the handle is live: see _closed_meanwhile
                self._malloc_refused(0, nbytes, stream, got)
            return got
        if self._forked:
            self._refuse_in_child("malloc")
        # acquire/release rather than ``with``: half the cost on this hot path.
        lock = self._lock
        lock.acquire()
        try:
            if self._gc_frees:
                self._drain_gc_frees()
            if self._pending and not self._captures:
                self._process_events()
            private = self._capture_private(stream) if self._captures else None
            if self._expandable:
                block: Block | CoreBlock = self._malloc_expandable(nbytes, stream, handle, private)
            else:
                key = 0 if private is None else private.key
                got = self._steps.malloc(nbytes, handle, key, NO_RETRY)
                block = self._core_refused(got, nbytes, handle, key) if isinstance(got, int) else got  # int: refused
                if self._history is not None:
                    self._record_alloc(block)
            if stream._closed:  # after the handle is live: see _closed_meanwhile
                self._closed_meanwhile(block, stream)
            return block
        finally:
            self._refresh_plain()
            lock.release()
            self._recheck_plain()

    def _malloc_refused(self, rc: int, nbytes: int, stream: Stream, block: CoreBlock | None = None) -> CoreBlock:
        """The lock-free malloc's core call for ``nbytes`` on ``stream`` returned ``rc``
        (not ACCEL_CORE_OK): what the locked path does with a refusal, under the lock.
        ``block``: the call handed it out (``rc`` 0), but ``stream`` was closed meanwhile
        (see _closed_meanwhile). The compiled allocate calls it by name too."""
        lock = self._lock
        lock.acquire()
        try:
            if block is None:
                block = self._core_refused(rc, nbytes, stream._handle, 0)
                if self._history is not None:
                    self._record_alloc(block)
            if stream._closed:
                self._closed_meanwhile(block, stream)
            return block
        finally:
            self._refresh_plain()
            lock.release()
            self._recheck_plain()

    def _closed_meanwhile(self, block: Block | CoreBlock, stream: Stream) -> None:
        """``stream`` was closed while malloc handed ``block`` out on it (the lock held).
        Its destroy may have looked for the handle in ``_known`` before malloc noted it
        there, or retired the handle before the core keyed new memory by it: either way
        memory would stay cached under a handle the driver may give to the next stream.
        The block goes back, what is keyed by the handle is retired (unordered: only a
        device synchronization orders it after the stream's work; a retirement the
        destroy queued goes first, with its end event), and the closed stream is refused
        as malloc refuses it."""
        if self._gc_frees:
            self._drain_gc_frees()
        if block.state == ALLOCATED:
            self._free_locked(block)
        self._retire(_StreamRetired(stream._handle, _UNORDERED))
        stream._live()  # raises, saying the stream was closed

    def _core_refused(self, rc: int, nbytes: int, handle: int, key: int) -> CoreBlock:
        """The core's malloc of ``nbytes`` in pool ``key`` returned ``rc`` (not
        ACCEL_CORE_OK, the lock held): raise what it means, or grow and serve it."""
        try:
            self._core.raise_for(rc, nbytes)
        except OutOfMemoryError as exc:
            return self._grow_core(nbytes, handle, key, exc)

    def _record_alloc(self, block: CoreBlock) -> None:
        """History of the core's new ``block`` (the lock held, history on)."""
        assert self._history is not None
        block.frames = self._history.block_frames()
        self._history.record("alloc", block.ptr, block.size, block.stream, block.frames)

    # The name accel.memory.allocate called, when it checked the arguments itself
    # and the allocator skipped them: the checks cost less than the second call,
    # so it is malloc (kept, as it is public).
    malloc_checked = malloc

    def _refresh_plain(self) -> None:
        """Recompute :attr:`_plain` (the lock held)."""
        self._plain = self._history is None and not (
            self._captures or self._pending or self._gc_frees or self._orphaned or self._expandable or self._forked
        )

    def _recheck_plain(self) -> None:
        """After :meth:`_refresh_plain` and the lock's release: a finalizer that found
        the lock taken may have queued a free after the recomputation read the queue
        empty (it appends, then sets _plain False: one of the two is seen here)."""
        if self._gc_frees:
            self._plain = False

    def _grow_core(self, nbytes: int, handle: int, key: int, refused: OutOfMemoryError) -> CoreBlock:
        """The core missed and the upstream refused (after the core gave back oversize
        cached blocks): outside a capture, order and give back the held blocks and the
        cache (this allocator's, then dropped pools'), and ask again; or raise OOM."""
        self._note_refusal(refused)
        if not self._captures:
            self._release_cached_blocks()
            # Dropped pools' memory of this device, waiting for those other threads use.
            given = release_orphans(self.backend, self.device, busy=self) if _orphans else 0
            flags = GIVE_BACK_FIRST  # the core's retry: counted, its OOM too
            while True:
                self._fraction_refused = False
                block = self._steps.malloc(nbytes, handle, key, flags)
                if not isinstance(block, int):
                    return block
                try:
                    self._core.raise_for(block, nbytes)
                except OutOfMemoryError as exc:
                    self._note_refusal(exc)
                # Another thread may take what came back first, while others drop pools
                # that hold memory: try again as long as dropped pools give some back.
                given = release_orphans(self.backend, self.device, busy=self) if given and _orphans else 0
                if not given:
                    break
                flags = NO_RETRY
            raise self._out_of_memory(self._round(nbytes), handle, counted=True)
        raise self._out_of_memory(self._round(nbytes), handle)

    def _note_refusal(self, exc: OutOfMemoryError) -> None:
        """What the device said when the core's upstream refused (not the memory
        fraction's cap: _admit_core notes that), for the out-of-memory report."""
        cause = exc.__cause__
        self._refusal = str(cause) if isinstance(cause, OutOfMemoryError) and not self._fraction_refused else ""

    def _malloc_expandable(self, nbytes: int, stream: Stream, handle: int, private: PrivatePool | None) -> Block:
        """:meth:`malloc` from the expandable segments of the Python books (the caller
        holds the lock)."""
        size = self._round(nbytes)
        if private is not None:
            pool = private.small if size <= SMALL_SIZE else private.large
        else:
            pool = self._small if size <= SMALL_SIZE else self._large
        # Find the best-fitting cached block; it stays listed until _split.
        free = pool.free.get(handle)
        block = self._find_free(free, size) if free else None
        listed = free
        if block is None:
            block = self._grow(pool, handle, size, stream)
            listed = None  # the new block is on no list
        elif free is not None and self._place_at_end(block, size, free):
            listed = None  # cut off the free block's end: on no list
        self._split(block, size, pool, handle, listed)
        self._account(block, nbytes, handle)
        return block

    def _round(self, nbytes: int) -> int:
        """The block size for a request: 512-byte multiples, or power-of-two divisions
        (the core rounds its own requests the same way)."""
        slot = nbytes.bit_length() - 21  # the divisions of [1 MiB, 2 MiB) are slot 0
        return round_size(nbytes, self._divisions[0 if slot < 0 else (slot if slot < 15 else 15)])

    def _split(self, block: Block, size: int, pool: Pool, handle: int, listed: FreeList | None) -> None:
        """Cut ``block`` to ``size`` bytes when the rest is worth keeping as a free
        block (PyTorch's ``should_split``); take ``block`` off free list ``listed``
        (None: it is on none), the rest taking its place; keep the inactive-split counts."""
        full = block.size
        remaining = full - size
        # Every block of these books is in an expandable segment: any rest worth a block
        # is cut (PyTorch's should_split for them), and inactive splits are not counted.
        if remaining >= KB_MIN:
            rest = self._stand_in(block, block.ptr + size, remaining, block, block.next)
            block.size = size
            if listed is not None:
                listed.replace(full, block.ptr, rest)
            else:
                free = pool.free.get(handle)
                if free is None:
                    free = pool.free[handle] = FreeList()
                free.add(rest)
        elif listed is not None:
            listed.remove(block)

    def _account(self, block: Block, nbytes: int, handle: int) -> None:
        """Mark ``block`` allocated for a request of ``nbytes`` and count it."""
        block.state = ALLOCATED
        block.requested = nbytes
        size = block.size
        s = self._s
        S.add_allocation(self._kinds[block.pool.kind], s, size, nbytes)
        if size >= self._ms:
            S.inc(s, OVERSIZE_ALLOCATIONS, 0, 1)
        if self._history is not None:
            block.frames = self._history.block_frames()
            self._history.record("alloc", block.ptr, size, handle, block.frames)

    def _bad_size(self, nbytes: object) -> None:
        if isinstance(nbytes, int) and not isinstance(nbytes, bool):
            if nbytes >= MAX_REQUEST:
                raise OutOfMemoryError(
                    f"{self._name} out of memory: tried to allocate more than 1EB "
                    f"({nbytes} bytes); no device has that much memory",
                    requested=nbytes,
                    device=self.device,
                )
            if nbytes < 1:
                raise InvalidValueError(f"cannot allocate {nbytes} bytes: the size must be at least 1")
            # an int subclass in range (malloc takes exact ints only): it was told
            # "the size must be at least 1" of a size of 10
            raise InvalidValueError(
                f"nbytes={nbytes!r} is a {type(nbytes).__name__}, not an int: pass int(nbytes)"
            )
        raise InvalidValueError(f"nbytes={nbytes!r} must be an int number of bytes")

    def _bad_stream(self, stream: object, call: str) -> NoReturn:
        if self._forked:  # the child's streams are not the parent's runtime's
            self._refuse_in_child(call)
        if not isinstance(stream, Stream):
            raise InvalidValueError(
                f"stream={stream!r} ({type(stream).__name__}) is not an accel.Stream; {call} needs a "
                f"stream of {self._name}, such as accel.current_stream({self._name!r})"
            ) from None
        # A closed stream's handle may be the backend's for a new stream: memory
        # cached under it would be ordered on the wrong stream.
        stream._live()  # raises, saying the stream was closed
        raise DeviceError(
            f"{stream!r} is not a stream of {self._name}; {call} needs a stream of "
            "the device the memory lives on"
        )

    def _refuse_in_child(self, call: str) -> NoReturn:
        """Refuse ``call`` in a forked child (see _forget_the_core_in_child): the core's
        mutex may be held for good by a parent thread that was inside the common pair
        at the fork, and waiting for it would hang."""
        raise AccelError(
            f"{call} on {self!r} in a process forked after it was made: another thread of the parent "
            "may have been inside its allocator core at the fork, so the child cannot use it. Start "
            "subprocesses with the 'spawn' or 'forkserver' method (multiprocessing.get_context('spawn'))"
        )

    def _bad_block(self, block: object, call: str) -> NoReturn:
        raise InvalidValueError(
            f"{call}: block={block!r} ({type(block).__name__}) is not a Block; pass a Block that "
            f"malloc() of {self!r} returned"
        ) from None

    def _capture_private(self, stream: Stream) -> PrivatePool | None:
        """The private pool of the innermost capture that takes ``stream``'s allocations."""
        for private, accepts in reversed(self._captures):
            if accepts(stream):
                return private
        return None

    def _find_free(self, free: FreeList, size: int) -> Block | None:
        """Best fit of at least ``size`` (oversize rules do not apply inside expandable
        segments), left on ``free``; None on a miss."""
        return free.best_fit(size)

    def _grow(self, pool: Pool, handle: int, size: int, stream: Stream) -> Block:
        """Expandable cache miss: new pages, after giving back cache if needed; or OOM."""
        capturing = bool(self._captures)
        self._fraction_refused = False  # set when the memory fraction, not the device, says no
        self._refusal = ""
        if self._gc_frees:
            self._drain_gc_frees()  # buffers collected while the lock was taken are free memory
        block = self._alloc_expandable(pool, handle, size)
        if block is None and not capturing:
            self._release_cached_blocks()
            # Dropped pools' memory of this device, waiting for those other threads use.
            given = release_orphans(self.backend, self.device, busy=self) if _orphans else 0
            self._stats.s[S.NUM_ALLOC_RETRIES] += 1
            block = self._alloc_expandable(pool, handle, size)
            # Another thread may take what came back first, while others drop pools
            # that hold memory: try again as long as dropped pools give some back.
            while block is None and given and _orphans:
                given = release_orphans(self.backend, self.device, busy=self)
                block = self._alloc_expandable(pool, handle, size) if given else None
        if block is None:
            raise self._out_of_memory(size, handle)
        return block

    def _reserved(self) -> int:
        """Bytes of this allocator's expandable segments (the core's: _core_reserved)."""
        s = self._stats.s
        return s[S.RESERVED_BYTES] + s[S.RESERVED_BYTES + 1]

    # -- expandable segments -------------------------------------------------------

    def _page_size(self) -> int:
        # PyTorch maps the large pool in large_segment_size (20 MiB) pages. accel
        # uses 2 MiB pages (or the granularity, if larger) for both pools: the
        # last page of a segment is the waste expandable segments still have,
        # and 20 MiB of it per stream dominates models of a few hundred MiB
        # (measured in docs/archive/benchmarks-history.md); the price is more map calls.
        unit = self.upstream.vm_granularity()
        return -(-SMALL_BUFFER // unit) * unit

    def _alloc_expandable(self, pool: Pool, handle: int, size: int) -> Block | None:
        """New expandable pages for ``size`` bytes, as a free block not on any list; None on OOM."""
        seg = pool.expandable.get(handle)
        if seg is None:
            seg = self._reserve_expandable(pool, handle)
            if seg is None:
                return None
        found = self._map_target(seg, size)
        if found is None:
            return None
        b, addr, nbytes, absorb = found
        # The free blocks the new pages join: the give-back leaves alone the part
        # of them the new block will take.
        joined = (b.prev if absorb else None, b.next if addr + nbytes == b.ptr + b.size else None)
        start = b.prev.ptr if absorb and b.prev is not None else addr
        spares: list[int] = []  # physical pages the give-back unmapped, mapped again here
        try:
            # Growing: give back the whole free pages of holes first.
            if self._give_back_holes(seg, nbytes, joined, start + size, spares) and pool.expandable.get(handle) is not seg:
                return self._alloc_expandable(pool, handle, size)  # left wholly unmapped, it went
            if self._allowed is not None and self._reserved() + self._core_reserved() + nbytes > self._allowed:
                self._fraction_refused = True
                return None
            if not self._map_pages(seg, addr, nbytes, spares):
                return None
        finally:
            self._release_pages(spares, seg.page)
        # Pages given back next to the target merged into it: find it again.
        b = self._unmapped_at(seg, addr)
        end = addr + nbytes
        if end < b.ptr + b.size:
            rest = Block(end, b.ptr + b.size - end, seg, mapped=False)
            rest.prev, rest.next = b, b.next
            if b.next is not None:
                b.next.prev = rest
            b.next = rest
            b.size = end - b.ptr
        if addr > b.ptr:
            head = Block(b.ptr, addr - b.ptr, seg, mapped=False)
            head.prev, head.next = b.prev, b
            if b.prev is not None:
                b.prev.next = head
            else:
                seg.head = head
            b.prev = head
            b.ptr, b.size = addr, nbytes
        b.mapped = True
        self._growths += 1
        seg.grown_at = self._growths
        seg.last_growth = nbytes
        s = self._stats.s
        S.inc(s, S.RESERVED_BYTES, pool.kind, nbytes)
        s[S.NUM_DEVICE_ALLOC] += 1
        if self._history is not None:
            self._history.record("segment_map", b.ptr, nbytes, handle, None)
        return self._merge_free(b)

    def _place_at_end(self, b: Block, size: int, free: FreeList) -> bool:
        """Put a new block of ``size`` bytes at the end of free block ``b`` of an
        expandable segment (listed on ``free``) rather than at its start, when that
        adds fewer pages to those live blocks touch, or as many but touches fewer
        bytes of pages beyond its size. Then ``b`` is cut to that end, off the list,
        its start left free; returns whether it was.

        The pages live blocks touch are what stays mapped at the next growth, which
        gives back every other whole free page: so the choice is the one that
        keeps the least memory. At the start, the new block fills the partial page
        of the live block before (if any); at the end, that of the live block after.
        Only ``b``, the best fit, is looked at: trying the next larger free blocks
        as well gave no better peaks on the traces of bench_expandable.py
        (docs/archive/benchmarks-history.md) and costs a search per allocation.
        """
        rest = b.size - size
        if rest < KB_MIN:
            return False  # taken whole
        seg = b.segment
        page = seg.page
        lo = b.ptr - seg.base
        hi = lo + b.size
        nxt = b.next
        # The partial page at b's end (start) is already touched when a live block
        # starts (ends) there.
        tail_used = hi % page != 0 and nxt is not None and nxt.mapped and nxt.state != FREE
        if not tail_used and lo % page == 0:
            # At b's start the new block is page aligned, touching as few pages as
            # it can; and the end has no touched page to fill. (The common case of
            # a segment's free end, checked first: this runs on every hit.)
            return False
        if self._keep_free >= self._s[S.RESERVED_BYTES + seg.pool.kind]:
            # Free pages are all kept (PyTorch's policy, expandable_keep_free_mb set
            # very large): none goes back, and the lowest place keeps holes fewer.
            return False
        prev = b.prev
        head_used = lo % page != 0 and prev is not None and prev.mapped and prev.state != FREE
        # Pages [first, last) the new block touches, at b's start and at its end, and
        # how many of them no live block touches yet (inline: this runs on every
        # allocation that an expandable segment's cache serves).
        first, last = lo // page, -(-(lo + size) // page)
        new_start = last - first - head_used - (
            tail_used and last - 1 == (hi - 1) // page and (last - 1 > first or not head_used)
        )
        first_end, last_end = (hi - size) // page, -(-hi // page)
        new_end = last_end - first_end - tail_used - (
            head_used and first_end == first and (first_end < last_end - 1 or not tail_used)
        )
        if (new_end, last_end - first_end) >= (new_start, last - first):
            return False
        end = b.ptr + b.size
        free.remove(b)
        head = Block(b.ptr, rest, seg)
        head.prev, head.next = prev, b
        if prev is not None:
            prev.next = head
        else:
            seg.head = head
        b.prev = head
        b.ptr, b.size = end - size, size
        self._insert_free(head)
        return True

    @staticmethod
    def _unmapped_at(seg: Segment, addr: int) -> Block:
        b = seg.head
        while b is not None and b.ptr + b.size <= addr:
            b = b.next
        if b is None or b.mapped:
            raise AssertionError(f"no unmapped block of {seg.base:#x} holds {addr:#x}")
        return b

    @staticmethod
    def _map_target(seg: Segment, size: int) -> tuple[Block, int, int, bool] | None:
        """Where ``seg`` grows to hold ``size`` bytes: ``(unmapped block, first address
        to map, bytes to map, whether the new block starts in the free block before)``;
        None when the reservation is full.

        Every unmapped run is a candidate with the free blocks around it (the partial
        pages at the edges of a hole, or the free end of the last page): the new block
        starts at the start of the free block before (or of the run), running into the
        free block after if need be, or it starts on a page boundary and ends in the
        free block after. Chosen, in this order: the fewest pages added to those live
        blocks touch (what stays mapped once the give-back has unmapped every other
        whole free page: a whole free page the new block covers counts, though it is
        mapped already, as it would otherwise go back); the fewest bytes of the pages
        the new block touches beyond its size (each edge of it that is not on a page
        boundary leaves a partial page mapped when its neighbour there is freed); the
        fewest pages to map; the most free bytes taken in (partial pages filled). No
        free block is left stranded between the new block and a live one.
        """
        page = seg.page
        base = seg.base
        best: tuple[tuple[int, int, int, int], Block, int, int, bool] | None = None
        b = seg.head
        while b is not None:
            if not b.mapped:
                prev, nxt = b.prev, b.next
                before = prev.size if prev is not None and prev.state == FREE else 0
                after = nxt.size if nxt is not None and nxt.state == FREE else 0
                run_end = b.ptr + b.size
                # The free region around the run, and whether a live block touches
                # its first (last) page: one ends (starts) off a page boundary there.
                lo = b.ptr - before - base
                hi = run_end + after - base
                left = prev.prev if before and prev is not None else prev
                right = nxt.next if after and nxt is not None else nxt
                head_used = lo % page != 0 and left is not None and left.mapped and left.state != FREE
                tail_used = hi % page != 0 and right is not None and right.mapped and right.state != FREE
                # (bytes to map, first address mapped, whether the free block before is taken in)
                options = []
                if size <= before + b.size:  # from the start of the free block before (or of the run)
                    options.append((-(-(size - before) // page) * page, b.ptr, before > 0))
                elif size <= before + b.size + after:  # across the run into the free block after
                    options.append((b.size, b.ptr, before > 0))
                if after and size <= after + b.size:  # from a page boundary to the end of the free block after
                    n = -(-(size - after) // page) * page
                    if n < b.size:
                        options.append((n, run_end - n, False))
                for n, addr, absorb in options:
                    start = (addr - before if absorb else addr) - base  # of the new block
                    taken = (before if absorb else 0) + (after if addr + n == run_end else 0)
                    first, last = start // page, -(-(start + size) // page)
                    touched = head_used and first == lo // page
                    added = last - first - touched - (
                        tail_used and last - 1 == (hi - 1) // page and (last - 1 > first or not touched)
                    )
                    key = (added, (last - first) * page - size, n, -taken)
                    if best is None or key < best[0]:
                        best = (key, b, addr, n, absorb)
            b = b.next
        return None if best is None else best[1:]

    def _give_back_holes(
        self,
        growing: Segment,
        growth: int,
        joined: tuple[Block | None, Block | None],
        upto: int,
        spares: list[int],
    ) -> int:
        """Before segment ``growing`` maps ``growth`` more bytes: unmap whole free pages
        of the holes of this allocator's expandable segments (both default pools,
        every stream; of ``joined``, the free blocks before and after the growth,
        only the pages after ``upto``, the end of the new block), the
        growing segment's first, highest first, at most ``growth`` bytes in all. Their
        physical pages go to ``spares``, to be mapped again by the growth. Returns the
        bytes unmapped.

        Hysteresis: reserved memory never shrinks here, so a pattern that fits the
        mapped pages maps and unmaps nothing; ``expandable_keep_free`` bytes of each
        segment's free pages stay mapped; and a segment that grew since ``growing``
        last did keeps as many free pages as that growth mapped, so that two
        segments needing pages in turn do not pass them back and forth for ever.
        A segment's pages are touched only when its stream has no queued work (its
        free blocks may still be in use by that work; blocks waiting for other
        streams are not free at all), and nothing during a capture.
        """
        if self._captures:  # nothing goes back upstream during a capture
            return 0
        segments = [growing] + [
            s for pool in (self._small, self._large) for s in pool.expandable.values() if s is not growing
        ]
        idle: dict[int, bool] = {}
        # (bytes that may go, whole free pages of the segment's free blocks, highest first)
        plan: list[tuple[int, list[tuple[Block, int, int]]]] = []
        for seg in segments:
            page = seg.page
            found = []
            whole = 0
            b = seg.head
            while b is not None:
                if b.state == FREE and b.mapped and b is not joined[0]:
                    lo = max(b.ptr, upto) if b is joined[1] else b.ptr
                    first = seg.base + -(-(lo - seg.base) // page) * page
                    last = seg.base + (b.ptr + b.size - seg.base) // page * page
                    if last > first:
                        found.append((b, first, last))
                        whole += last - first
                b = b.next
            keep = self._keep_free
            if seg.grown_at > growing.grown_at:
                keep = max(keep, seg.last_growth)
            if whole <= keep:
                continue
            if seg.stream not in idle:
                idle[seg.stream] = self._stream_idle(seg.stream)
            if idle[seg.stream]:
                plan.append((whole - keep, found[::-1]))
        unmapped = 0
        for allowed, found in plan:
            taken = 0
            for b, first, last in found:
                page = b.segment.page
                take = min(last - first, allowed - taken, growth - unmapped)
                take -= take % page
                if take <= 0:
                    break
                self._take_off_list(b)
                done = self._unmap_pages(b, last - take, last, spares)
                taken += done
                unmapped += done
            if unmapped >= growth:
                break
        return unmapped

    def _reserve_expandable(self, pool: Pool, handle: int) -> Segment | None:
        page = self._page_size()
        _, total = self.upstream.memory_info()
        # As PyTorch: room for the whole device plus an eighth, never exceeded.
        size = -(-(total + total // 8) // page) * page
        try:
            base = self.upstream.vm_reserve(size)
        except OutOfMemoryError as exc:
            self._refusal = str(exc)
            return None
        seg = Segment(self, base, size, handle, pool, True)
        self._known.add(handle)
        seg.page = page
        seg.head = Block(base, size, seg, mapped=False)
        pool.expandable[handle] = seg
        self._segments[base] = seg
        if pool.private is not None:
            pool.private.segments += 1
        return seg

    def _map_pages(self, seg: Segment, addr: int, nbytes: int, spares: list[int]) -> bool:
        """Map physical pages over ``[addr, addr + nbytes)``; all or nothing. Pages in
        ``spares`` (unmapped elsewhere just before) are used first, new ones made for the rest.

        False when upstream is out of memory; other errors propagate, with
        every page made in this call given back first.
        """
        page, done = seg.page, []
        try:
            for start in range(addr, addr + nbytes, page):
                h = spares.pop() if spares else self.upstream.vm_create(page)
                try:
                    self.upstream.vm_map(start, page, h)
                except BaseException:
                    self.upstream.vm_release(h, page)
                    raise
                done.append((start, h))
        except BaseException as exc:
            for start, h in reversed(done):
                self.upstream.vm_unmap(start, page)
                self.upstream.vm_release(h, page)
            if isinstance(exc, OutOfMemoryError):
                self._refusal = str(exc)
                return False
            raise
        for start, h in done:
            seg.pages[(start - seg.base) // page] = h
        return True

    def _unmap_free(self, b: Block) -> int:
        """Unmap the whole pages inside free block ``b`` (already off its list).

        Returns the bytes unmapped; the parts before and after stay free.
        """
        seg, page = b.segment, b.segment.page
        first = seg.base + -(-(b.ptr - seg.base) // page) * page
        last = seg.base + (b.ptr + b.size - seg.base) // page * page
        return self._unmap_pages(b, first, last)

    def _unmap_pages(self, b: Block, first: int, last: int, spares: list[int] | None = None) -> int:
        """Unmap the pages ``[first, last)`` (page aligned, inside free block ``b``, which
        is off its list); the rest of ``b`` goes back on its list. The physical pages
        are released, or kept in ``spares`` when given. Returns the bytes unmapped
        (fewer when the driver fails part way: the error propagates)."""
        seg, page = b.segment, b.segment.page
        if last <= first:
            self._insert_free(b)
            return 0
        done = first
        unmapped: list[int] = [] if spares is None else spares
        try:
            while done < last:
                index = (done - seg.base) // page
                self.upstream.vm_unmap(done, page)
                # Counted as unmapped before anything else can raise (an interrupt
                # in the release left a page unmapped that the blocks called mapped).
                unmapped.append(seg.pages.pop(index))
                done += page
        finally:
            try:
                if done > first:
                    self._carve_unmapped(b, first, done)
                else:
                    self._insert_free(b)
            finally:  # the carve may give the reservation back, and be interrupted there
                if spares is None:
                    self._release_pages(unmapped, page)
        return done - first

    def _release_pages(self, handles: list[int], page: int) -> None:
        """Release the physical pages ``handles`` (unmapped, in no segment's books),
        emptying the list; an error (an interrupt) in one release still releases
        the rest, then propagates."""
        error: BaseException | None = None
        while handles:
            h = handles.pop()
            try:
                self.upstream.vm_release(h, page)
            except BaseException as exc:
                error = error or exc
        if error is not None:
            raise error

    def _carve_unmapped(self, b: Block, first: int, last: int) -> None:
        """Split free block ``b`` so that ``[first, last)`` is an unmapped block."""
        seg, end = b.segment, b.ptr + b.size
        pieces = []
        if first > b.ptr:
            pieces.append((b.ptr, first - b.ptr, True))
        pieces.append((first, last - first, False))
        if end > last:
            pieces.append((last, end - last, True))
        prev, nxt = b.prev, b.next
        made: list[Block] = []
        for ptr, size, mapped in pieces:
            nb = b if not made else Block(ptr, size, seg, mapped)
            nb.ptr, nb.size, nb.mapped = ptr, size, mapped
            nb.prev = made[-1] if made else prev
            if made:
                made[-1].next = nb
            made.append(nb)
        made[-1].next = nxt
        if nxt is not None:
            nxt.prev = made[-1]
        if prev is None:
            seg.head = made[0]
        s = self._stats.s
        unmapped = last - first
        s[S.RESERVED_BYTES + seg.pool.kind] -= unmapped
        s[S.NUM_DEVICE_FREE] += 1
        if self._history is not None:
            self._history.record("segment_unmap", first, unmapped, seg.stream, None)
        for nb in made:
            if nb.mapped:
                self._insert_free(nb)
            else:
                self._merge_unmapped(nb)

    def _merge_unmapped(self, b: Block) -> None:
        for neighbour in (b.prev, b.next):
            if neighbour is not None and not neighbour.mapped:
                self._absorb(b, neighbour)
        seg = b.segment
        if b.prev is None and b.next is None:
            # Wholly unmapped: give the reservation back.
            self.upstream.vm_free(seg.base, seg.size)
            del seg.pool.expandable[seg.stream]
            del self._segments[seg.base]
            if seg.pool.private is not None:
                seg.pool.private.segments -= 1

    # -- free ------------------------------------------------------------------------

    def free(self, block: Block | CoreBlock) -> None:
        """Give ``block`` back; it is reused once every stream that used it passed
        this point (see :meth:`record_stream`)."""
        # The common case, without the lock (see _plain): its checks and the claim are one
        # C step, so a record_stream in another thread lands before or after both.
        if self._plain and block.__class__ is CoreBlock and self._steps.free_plain(block):
            return
        if self._forked:
            self._refuse_in_child("free")
        lock = self._lock
        if lock.owner == get_ident():
            # A gc callback or finalizer run inside this thread's call: deferred to the
            # next call that takes the lock, as a finalizer's free (a free twice refused).
            if getattr(block, "state", ALLOCATED) != ALLOCATED:
                raise InvalidHandleError(f"{block!r} is not allocated by {self!r} (freed twice)")
            self.free_from_finalizer(block)
            return
        lock.acquire()  # not ``with``: see malloc
        try:
            try:
                if block.state != ALLOCATED or block.owner is not self:
                    raise InvalidHandleError(
                        f"{block!r} is not allocated by {self!r} (freed twice, or from another allocator)"
                    )
            except AttributeError:  # not a Block
                self._bad_block(block, "free")
            self._free_held(block)
        finally:
            self._refresh_plain()
            lock.release()
            self._recheck_plain()

    def _free_held(self, block: Block | CoreBlock) -> None:
        """:meth:`free` of an allocated block of this allocator, the lock held."""
        if block.stream_uses and self._gc_frees:
            self._drain_gc_frees()  # a retired handle among the uses is known before events are recorded
        self._free_locked(block)
        if self._orphaned:
            self._release_if_idle()

    def _free_locked(self, block: Block | CoreBlock) -> None:
        if self._history is not None:
            self._history.record("free_requested", block.ptr, block.size, block.stream, None)
        if block.segment is None:  # the core's
            if block.stream_uses:
                self._steps.hold(block)
                self._order_reuse(block)
            else:
                self._steps.free(block)
                if self._history is not None:
                    self._history.record("free_completed", block.ptr, block.size, block.stream, None)
            return
        s = self._s
        kind = block.pool.kind
        size = block.size
        S.drop_allocation(self._kinds[kind], size)
        if size >= self._ms:
            s[OVERSIZE_ALLOCATIONS] -= 1
        if block.stream_uses:
            block.state = PENDING
            S.add_pending(s, kind, size)
            self._order_reuse(block)
        else:
            self._free_block(block)

    def _order_reuse(self, block: Block | CoreBlock) -> None:
        """Freed ``block`` (PENDING) is reused once its other streams pass events
        recorded now, or at the end of the captures under way."""
        if self._captures:
            self._deferred.append(block)
        else:
            self._insert_events(block)

    def free_from_finalizer(self, block: Block | CoreBlock) -> None:
        """Free from a garbage-collection finalizer, which may run while this
        thread already holds the lock: then the free waits for the next call."""
        try:
            owner = block.owner
        except AttributeError:  # not a Block
            self._bad_block(block, "free_from_finalizer")
        if owner is not self:
            # as free() does: freed here, another allocator's block would drive this
            # one's counts below zero and put that allocator's memory on its free list.
            # The owner never changes, so the check needs no lock.
            raise InvalidHandleError(f"{block!r} is not allocated by {self!r} (from another allocator)")
        if self._plain and block.__class__ is CoreBlock and block.state == ALLOCATED and self._steps.free_plain(block):
            return
        if self._forked and block.__class__ is CoreBlock:
            return  # the core's mutex may be held by a parent thread: see _forget_the_core_in_child
        if self._lock.acquire(blocking=False):
            try:
                if block.state == ALLOCATED:
                    self._free_held(block)
            finally:
                self._refresh_plain()
                self._lock.release()
                self._recheck_plain()
        else:
            self._gc_frees.append(block)
            self._plain = False

    def release_when_idle(self) -> None:
        """The owner of this allocator (a :class:`MemPool` that was dropped) needs it
        no more: give every segment back upstream now if nothing is allocated, else
        when the last allocation is freed. Safe from a finalizer: it never waits for
        the device, so memory whose streams still have queued work goes back at the
        device's next ``empty_cache`` or allocation short of memory."""
        self._orphaned = True
        self._plain = False
        if self._lock.acquire(blocking=False):
            try:
                if self._gc_frees:
                    self._drain_gc_frees()
                self._release_if_idle()
            finally:
                self._lock.release()
        else:
            # Another thread holds the lock: a free may be under way that read the
            # flag before it was set (its fast path then never releases), and it may
            # be the last. Noted as an orphan, the memory goes at the device's next
            # empty_cache or allocation short of memory, which take the lock.
            _orphans.add(self)

    def _release_if_idle(self) -> None:
        """A dropped pool's allocator with nothing allocated gives its memory back, without
        waiting for the device: this runs in finalizers and in free(), maybe on the thread
        of a host function the device's work waits for. Only when every stream of its
        segments has no queued work and no cross-stream free is pending; else the allocator
        waits in ``_orphans`` for a call that may wait (see :func:`release_orphans`)."""
        if self._allocated_any() or self._captures:
            return
        if self._pending:
            self._process_events()
        if not (self._pending or self._deferred) and self._streams_idle():
            self._release_cached_blocks(wait=False)
        self._note_orphan()

    def _allocated_any(self) -> bool:
        """Whether any block of this allocator is allocated (not counting pending ones),
        by accel or by torch through the core."""
        small, large = self._kinds
        slots = self._core.slots()
        return bool(small.allocation or large.allocation or slots[S.ALLOCATION] or slots[S.ALLOCATION + 1])

    def _streams_idle(self) -> bool:
        streams = {seg.stream for seg in self._segments.values()} | {b["stream"] for b in self._core.blocks()}
        return all(self._stream_idle(stream) for stream in streams)

    def _stream_idle(self, key: int) -> bool:
        """Whether the stream that segments keyed ``key`` belong to has no queued work."""
        if key < 0:  # a retired handle: its destroyed stream's end event says
            event = self._retired.get(key)
            if event is None:
                return True
            if event == _UNORDERED or not self.backend.event_query(self.device, event):
                return False
            if key not in self._pending:  # no free waits for it: the event goes back to the pool
                del self._retired[key]
                self._events.append(event)
            return True
        try:
            return self.backend.stream_query(self.device, key)
        except AccelError:  # a closed stream's work may still run; or a capture under way
            return False

    def _stream_destroyed(self, handle: int) -> None:
        """Stream ``handle`` is about to be destroyed; the driver may give its handle to
        the next stream created while its queued work still runs. Memory this allocator
        keys by the handle is retired (see :meth:`_retire`) before the next call that
        could reach it under the new stream: the retirement is queued with the frees
        of finalizers, which malloc's fast path and every slow path take first. Never
        waits (it runs in finalizers), so the end of the stream's work is an event
        recorded here, while the handle still names the old stream."""
        if handle not in self._known:
            return
        backend, device = self.backend, self.device
        event: int | None = None
        try:
            if backend.stream_capture_status(device, handle) == CaptureStatus.NONE:
                event = record_new_event(backend, device, handle)
            # else: a capture is abandoned with the stream; its work never runs
        except AccelError:
            event = _UNORDERED
        self._gc_frees.append(_StreamRetired(handle, event))
        self._plain = False
        if self._lock.acquire(blocking=False):
            try:
                self._drain_gc_frees()
            finally:
                self._lock.release()

    def _retire(self, retired: _StreamRetired) -> None:
        """Key what this allocator keys by a destroyed stream's handle by a new key of its
        own, which no stream has: the segments, their blocks (cached, allocated, pending),
        the free lists, the expandable segments, record_stream uses. Memory cached under
        it is then never given to another stream, and its idle checks ask the end event."""
        handle = retired.handle
        self._known.discard(handle)
        key = self._next_key
        self._next_key -= 1
        if retired.event is not None:
            self._retired[key] = retired.event
        self._core.rekey_stream(handle, key)
        # a copy: the lock-free pair adds and removes handles meanwhile
        for block in list(self._live.values()):
            if block.stream == handle:
                block.stream = key
            uses = block.stream_uses
            if uses and handle in uses:
                uses.discard(handle)
                uses.add(key)
        for seg in self._segments.values():
            mine = seg.stream == handle
            if mine:
                seg.stream = key
            b = seg.head
            while b is not None:
                if mine:
                    b.stream = key
                uses = b.stream_uses
                if uses and handle in uses:
                    uses.discard(handle)
                    uses.add(key)
                b = b.next
        for pool in self._all_pools():
            if handle in pool.free:
                pool.free[key] = pool.free.pop(handle)
            if handle in pool.expandable:
                pool.expandable[key] = pool.expandable.pop(handle)

    def _drain_gc_frees(self) -> None:
        while self._gc_frees:
            item = self._gc_frees.popleft()
            if isinstance(item, _PoolRelease):
                self._release_pool_locked(item.pool_id)
            elif isinstance(item, _StreamRetired):
                self._retire(item)
            elif item.state == ALLOCATED:
                self._free_locked(item)
        if self._orphaned:
            self._release_if_idle()

    def _free_block(self, block: Block | CoreBlock) -> None:
        """Return ``block``'s memory to its pool's free list, merged with free neighbours.

        ``block`` itself was handed to a caller, who may still hold it: it is
        retired, and a free neighbour (or a new block object) takes its
        place in the segment, so a stale ``free(block)`` is refused later
        instead of freeing whoever gets this memory next.
        """
        if block.segment is None:  # the core's, held until now
            self._steps.release(block)
            if self._history is not None:
                self._history.record("free_completed", block.ptr, block.size, block.stream, None)
            return
        pool = block.pool
        kind = pool.kind
        k = self._kinds[kind]
        if block.state == PENDING:
            S.drop_pending(self._s, kind, block.size)
        k.requested_bytes -= block.requested
        if self._history is not None:
            self._history.record("free_completed", block.ptr, block.size, block.stream, None)
        block.state = RETIRED
        free = pool.free.get(block.stream)
        if free is None:
            free = pool.free[block.stream] = FreeList()
        prev = block.prev
        nxt = block.next
        block.prev = block.next = None
        if prev is not None and prev.state == FREE and prev.mapped:
            # The free block before absorbs this one (and the one after, if free).
            survivor = prev
            listed_size = prev.size
            survivor.size += block.size
            if nxt is not None and nxt.state == FREE and nxt.mapped:
                free.remove(nxt)
                survivor.size += nxt.size
                nxt = nxt.next
            survivor.next = nxt
            if nxt is not None:
                nxt.prev = survivor
            prev = survivor.prev
            free.replace(listed_size, survivor.ptr, survivor)
        elif nxt is not None and nxt.state == FREE and nxt.mapped:
            # The free block after takes this one's place and start.
            survivor = nxt
            listed_size, listed_ptr = nxt.size, nxt.ptr
            survivor.ptr = block.ptr
            survivor.size += block.size
            survivor.prev = prev
            if prev is not None:
                prev.next = survivor
            else:
                block.segment.head = survivor
            nxt = survivor.next
            free.replace(listed_size, listed_ptr, survivor)
        else:
            # No free neighbour: a fresh block object stands in for this one.
            survivor = self._stand_in(block, block.ptr, block.size, prev, nxt)
            free.add(survivor)

    def _stand_in(self, like: Block, ptr: int, size: int, prev: Block | None, nxt: Block | None) -> Block:
        """A FREE block object of ``like``'s segment for ``[ptr, ptr + size)``, linked
        between ``prev`` and ``nxt``."""
        new = Block(ptr, size, like.segment)
        new.prev = prev
        new.next = nxt
        if prev is not None:
            prev.next = new
        else:
            like.segment.head = new
        if nxt is not None:
            nxt.prev = new
        return new

    def _merge_free(self, block: Block) -> Block:
        """Merge free mapped neighbours into ``block`` (FREE, off every list)."""
        for neighbour in (block.prev, block.next):
            if neighbour is not None and neighbour.state == FREE and neighbour.mapped:
                self._take_off_list(neighbour)
                self._absorb(block, neighbour)
        return block

    def _absorb(self, block: Block, neighbour: Block) -> None:
        if neighbour is block.prev:
            block.ptr = neighbour.ptr
            block.prev = neighbour.prev
            if block.prev is not None:
                block.prev.next = block
            else:
                block.segment.head = block
        else:
            block.next = neighbour.next
            if block.next is not None:
                block.next.prev = block
        block.size += neighbour.size

    def _insert_free(self, block: Block) -> None:
        """Put FREE mapped ``block`` on its free list."""
        pool = block.pool
        free = pool.free.get(block.stream)
        if free is None:
            free = pool.free[block.stream] = FreeList()
        free.add(block)

    def _take_off_list(self, block: Block) -> None:
        block.pool.free[block.stream].remove(block)

    # -- streams -----------------------------------------------------------------------

    def record_stream(self, block: Block | CoreBlock, stream: Stream) -> None:
        """Mark ``block`` as used on ``stream`` too: after a free it is reused only
        once ``stream`` passed an event recorded at free time."""
        try:
            if stream._device != self.device or stream._runtime.backend is not self.backend:
                self._bad_stream(stream, "record_stream")
        except AttributeError:  # not a Stream
            self._bad_stream(stream, "record_stream")
        handle = stream._live()
        with self._lock:
            if self._gc_frees:  # a retirement of this handle queued before must go first
                self._drain_gc_frees()
            try:
                if block.state != ALLOCATED or block.owner is not self:
                    raise InvalidHandleError(f"record_stream on {block!r}, which is not allocated here")
            except AttributeError:  # not a Block
                self._bad_block(block, "record_stream")
            if handle == block.stream:
                return
            self._known.add(handle)
            if block.stream_uses is None:
                block.stream_uses = {handle}
            else:
                block.stream_uses.add(handle)
            if block.segment is None and self._live.get(block.ptr) is not block:
                # The lock-free free (see _plain) claimed it after the state check above:
                # freed first, its memory may be reused without waiting for this use.
                raise InvalidHandleError(
                    f"record_stream on {block!r}, which another thread freed meanwhile; record the "
                    "stream before the buffer is freed"
                )

    def _insert_events(self, block: Block | CoreBlock) -> None:
        remaining = list(block.stream_uses or ())
        block.stream_uses = None
        error: BaseException | None = None
        try:
            while remaining:
                handle = remaining[-1]
                if handle < 0:  # a use by a destroyed stream: wait for its end event
                    self._wait_for_retired(block, handle)
                    remaining.pop()
                    continue
                event = self._events.pop() if self._events else self._new_event()
                try:
                    self.backend.event_record(self.device, event, handle)
                except BaseException as exc:
                    # The stream was closed (its queued work still runs) or the
                    # driver failed: wait for the whole device instead, so the
                    # block is still freed safely and nothing leaks. Not during
                    # interpreter exit (streams closed, a graph's holds let go):
                    # the threads such a wait needs no longer run, and nothing
                    # will be allocated again.
                    self._events.append(event)
                    if not sys.is_finalizing():
                        self.backend.device_synchronize(self.device)
                    remaining.pop()
                    if not isinstance(exc, InvalidHandleError):
                        error = error or exc
                    continue
                remaining.pop()
                block.event_count += 1
                queue = self._pending.get(handle)
                if queue is None:
                    queue = self._pending[handle] = deque()
                queue.append((event, block))
                self._plain = False
        except BaseException:
            # Interrupted (Ctrl-C in the wait above), or no event could be made: the
            # uses left are ordered by the next call that gives memory back (see
            # _release_cached_blocks); until then the block stays pending.
            block.stream_uses = set(remaining)
            self._deferred.append(block)
            raise
        if block.event_count == 0:
            self._free_block(block)
        if error is not None:
            raise error

    def _wait_for_retired(self, block: Block | CoreBlock, key: int) -> None:
        """Order the reuse of freed ``block`` after the work of the destroyed stream
        retired as ``key``: its end event joins the block's pending events (shared: the
        queue of ``key`` does not return it to the pool)."""
        event = self._retired.get(key)
        if event is None:
            return
        if event == _UNORDERED:
            if not sys.is_finalizing():  # see the record failure in _insert_events
                self.backend.device_synchronize(self.device)
            return
        block.event_count += 1
        queue = self._pending.get(key)
        if queue is None:
            queue = self._pending[key] = deque()
        queue.append((event, block))

    def _new_event(self) -> int:
        self._events_created += 1
        return self.backend.event_create(self.device, timing=False, blocking=False, interprocess=False)

    def _process_events(self) -> None:
        for handle in list(self._pending):
            queue = self._pending[handle]
            while queue:
                event, block = queue[0]
                if not self.backend.event_query(self.device, event):
                    break
                queue.popleft()
                if handle >= 0:  # a retired handle's end event is shared: see _wait_for_retired
                    self._events.append(event)
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)
            if not queue:
                del self._pending[handle]

    def _synchronize_and_free_events(self) -> None:
        self._stats.s[S.NUM_SYNC_ALL_STREAMS] += 1
        # Each entry leaves its queue once waited for: a wait interrupted (Ctrl-C)
        # leaves the books whole, with the rest still pending.
        for handle in list(self._pending):
            queue = self._pending[handle]
            while queue:
                event, block = queue[0]
                self.backend.event_synchronize(self.device, event)
                queue.popleft()
                if handle >= 0:  # a retired handle's end event is shared: see _wait_for_retired
                    self._events.append(event)
                block.event_count -= 1
                if block.event_count == 0:
                    self._free_block(block)
            del self._pending[handle]

    @property
    def events_created(self) -> int:
        """Backend events created for cross-stream frees (they are pooled and reused)."""
        return self._events_created

    # -- giving memory back --------------------------------------------------------------

    def empty_cache(self) -> None:
        """Give every unused cached segment (and unused expandable page) back upstream.

        Partly used segments stay. Does nothing to the driver while a capture
        is under way.
        """
        if self._forked:
            self._refuse_in_child("empty_cache")
        with self._lock:
            if self._gc_frees:
                self._drain_gc_frees()
            self._release_cached_blocks()
        if _orphans:
            release_orphans(self.backend, self.device)

    def _release_orphaned(self) -> int:
        """:func:`release_orphans`' work on this dropped pool's allocator, whose lock the
        caller took (released here): every cached segment goes back, after waiting for
        the device (its streams may still run work queued on the memory). Returns the
        bytes given back."""
        try:
            before = self._reserved() + self._core_reserved()
            if self._gc_frees:
                self._drain_gc_frees()
            if not self._allocated_any():
                self._release_cached_blocks()
            self._note_orphan()
            return before - self._reserved() - self._core_reserved()
        finally:
            self._lock.release()

    def _note_orphan(self) -> None:
        """Keep this dropped pool's allocator for a later release while it holds memory."""
        if self._segments or self._core_reserved():
            _orphans.add(self)
        else:
            _orphans.discard(self)

    def _release_cached_blocks(self, *, wait: bool = True) -> None:
        """Give back every free whole segment and free expandable page of the
        default pools and of the private pools no graph uses any more.

        ``wait=False``: the caller saw the streams idle and nothing pending, and
        must not wait for the device."""
        if self._captures:
            return  # never return memory upstream during a capture
        if wait:
            while self._deferred:  # frees an interrupt left with stream uses unordered
                self._insert_events(self._deferred.pop())
            self._synchronize_and_free_events()
            if self._retired:
                # Every destroyed stream's work is done after a device synchronization:
                # their end events go to the pool, and their memory is idle for good.
                self.backend.device_synchronize(self.device)
                self._events += [e for e in self._retired.values() if e != _UNORDERED]
                self._retired.clear()
        freeable = [p for p in self._private.values() if p.use_count == 0]
        pools = [self._small, self._large]
        for private in freeable:
            pools += [private.small, private.large]
        victims = [b for pool in pools for lst in pool.free.values() for _, _, b in lst]
        if victims:
            self._release(victims, wait=wait)
        # Reservations left wholly unmapped (a failed first map) go back too.
        for pool in pools:
            for seg in list(pool.expandable.values()):
                head = seg.head
                if head is not None and not head.mapped and head.next is None:
                    self._merge_unmapped(head)
        # The core's wholly free segments of the default pool and of the private pools
        # no graph uses (those in use are kept: see begin_allocate_to_pool).
        self._core.empty_cache(wait=wait)
        for private in freeable:
            if private.segments == 0 and self._core.pool_segments(private.key) == 0:
                del self._private[private.id]

    def _release(self, blocks: list[Block], *, wait: bool = True) -> None:
        """Give free expandable ranges ``blocks`` back upstream (unmapped)."""
        # Upstream frees are not stream ordered on every backend: let queued work finish.
        if wait:
            self.backend.device_synchronize(self.device)
        for b in blocks:
            self._take_off_list(b)
            self._unmap_free(b)

    # -- private pools ------------------------------------------------------------------

    def begin_allocate_to_pool(self, pool_id: PoolId, stream_filter: Callable[[Stream], bool]) -> None:
        """Route allocations on streams that ``stream_filter`` accepts to private pool
        ``pool_id`` (created here, or its use count raised) until :meth:`end_allocate_to_pool`."""
        pool_id = check_pool_id(pool_id, where="begin_allocate_to_pool")
        if not callable(stream_filter):
            raise InvalidValueError(f"stream_filter={stream_filter!r} must be callable")
        with self._lock:
            if self._gc_frees:
                self._drain_gc_frees()
            if any(p.id == pool_id for p, _ in self._captures):
                raise CaptureError(f"begin_allocate_to_pool: already recording to pool {pool_id}")
            private = self._private.get(pool_id)
            if private is None or private.use_count == 0:
                # In use: empty_cache leaves it. Kept first: when the core cannot (no host
                # memory for its books), it raises before anything here is registered.
                key = self._next_pool_key if private is None else private.key
                self._core.keep_pool(key, True)
                if private is None:
                    private = self._private[pool_id] = PrivatePool(pool_id, key)
                    self._next_pool_key += 1
                else:
                    private.use_count = 1
            else:
                private.use_count += 1
            self._captures.append((private, stream_filter))
            self._plain = False
            # nothing goes back upstream during a capture, torch's allocations' misses included
            self._core.freeze(True)

    def end_allocate_to_pool(self, pool_id: PoolId) -> None:
        """Stop routing allocations to ``pool_id``; the pool stays until :meth:`release_pool`."""
        pool_id = check_pool_id(pool_id, where="end_allocate_to_pool")
        with self._lock:
            for i, (private, _) in enumerate(self._captures):
                if private.id == pool_id:
                    del self._captures[i]
                    if not self._captures:
                        self._core.freeze(False)
                    break
            else:
                raise CaptureError(f"end_allocate_to_pool: not currently recording to pool {pool_id}")
            if not self._captures:
                while self._deferred:  # one at a time: an interrupt keeps the rest listed
                    self._insert_events(self._deferred.pop())

    def release_pool(self, pool_id: PoolId) -> None:
        """Drop one use of ``pool_id`` (a graph that is gone).

        At zero uses the pool is *freeable*, as in PyTorch: its memory goes
        back upstream at the next :meth:`empty_cache` or when an allocation
        needs the room (that flush waits for the streams; doing it here would
        make deleting a graph wait for unrelated work). A pool that holds no
        memory goes at once.
        """
        pool_id = check_pool_id(pool_id, where="release_pool")
        with self._lock:
            if self._gc_frees:
                self._drain_gc_frees()
            if not self._release_pool_locked(pool_id):
                raise InvalidValueError(f"release_pool: {pool_id} is not a live private pool")

    def release_pool_from_finalizer(self, pool_id: PoolId) -> None:
        """:meth:`release_pool` from a garbage-collection finalizer (a graph
        collected), which may run while this thread holds the lock. When the
        lock is taken (by this thread or another), the release waits for the
        allocator's next call that takes it."""
        pool_id = check_pool_id(pool_id, where="release_pool_from_finalizer")
        if self._lock.acquire(blocking=False):
            try:
                self._release_pool_locked(pool_id)
            finally:
                self._lock.release()
        else:
            self._gc_frees.append(_PoolRelease(pool_id))
            self._plain = False

    def _release_pool_locked(self, pool_id: PoolId) -> bool:
        private = self._private.get(pool_id)
        if private is None or private.use_count == 0:
            return False
        private.use_count -= 1
        if private.use_count == 0:
            self._core.keep_pool(private.key, False)  # freeable: the next empty_cache gives it back
        if private.use_count == 0 and private.segments == 0 and self._core.pool_segments(private.key) == 0:
            del self._private[pool_id]
        elif private.use_count == 0 and self._orphaned:
            # Nobody is left to call empty_cache on a dropped MemPool's allocator.
            self._release_if_idle()
        return True

    def pool_ids(self) -> list[PoolId]:
        """Ids of the private pools that still exist."""
        with self._lock:
            if self._gc_frees:
                self._drain_gc_frees()
            return list(self._private)

    # -- introspection -----------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        """PyTorch's ``memory_stats`` keys for this device, sorted."""
        if self._forked:
            self._refuse_in_child("stats")
        with self._lock:
            if self._gc_frees:
                self._drain_gc_frees()
            out = self._stats.as_dict(-1 if self._ms == _UNLIMITED else self._ms)
        # The core's counters (accel's buffers and torch's tensors alike), plus those of
        # the expandable segments kept here: all zero unless expandable segments were
        # used (then a peak shown is the sum of the two peaks).
        for key, value in self._core.stats().items():
            if key != "max_split_size":
                out[key] += value
        return out

    def reset_peak_stats(self) -> None:
        with self._lock:
            self._stats.reset_peak()
        self._core.reset_peak()

    def reset_accumulated_stats(self) -> None:
        with self._lock:
            self._stats.reset_accumulated()
        self._core.reset_accumulated()

    def record_history(self, history: History | None) -> None:
        """Start (or, with None, stop and clear) recording the trace."""
        if history is not None and not isinstance(history, History):
            raise InvalidValueError(
                f"record_history: history={history!r} is not a History; pass None to stop, or turn "
                "recording on with accel.memory.record_memory_history()"
            )
        with self._lock:
            self._history = history
            self._plain = False

    def trace(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._history.entries) if self._history is not None else []

    def snapshot(self) -> list[dict[str, Any]]:
        """Segments and their blocks in the layout of PyTorch's ``memory_snapshot()``.

        An expandable segment shows as one segment per contiguous mapped range.
        """
        with self._lock:
            if self._gc_frees:
                self._drain_gc_frees()
            out = []
            for seg in self._segments.values():
                pool_id = seg.pool.private.id if seg.pool.private is not None else (0, 0)
                runs: list[list[Block]] = [[]]
                for b in seg.blocks():
                    if b.mapped:
                        runs[-1].append(b)
                    elif runs[-1]:
                        runs.append([])
                for run in runs:
                    if run:
                        out.append(self._segment_dict(seg, run, pool_id))
            out += self._core_segments()
            if self._history is not None:
                active = sum(x["active_size"] for x in out)
                self._history.record("snapshot", 0, active, 0, None)
        return sorted(out, key=lambda x: x["address"])

    def _core_segments(self) -> list[dict[str, Any]]:
        """The native core's segments in :meth:`snapshot`'s layout (the lock held: the
        frames of accel's blocks are on their handles; torch's blocks have none)."""
        pool_ids: dict[int, PoolId] = {p.key: p.id for p in self._private.values()}
        segments: dict[int, dict[str, Any]] = {}
        for b in self._core.blocks():
            seg = segments.get(b["segment"])
            if seg is None:
                seg = segments[b["segment"]] = {
                    "device": self.device, "address": b["segment"], "total_size": b["segment_size"],
                    "allocated_size": 0, "active_size": 0, "requested_size": 0, "stream": b["stream"],
                    "segment_type": "small" if b["small"] else "large",
                    "segment_pool_id": pool_ids.get(b["pool"], (0, 0)), "is_expandable": False, "frames": [],
                    "blocks": [],
                }  # fmt: skip
            state = "active_allocated" if b["allocated"] else "active_pending_free" if b["held"] else "inactive"
            if state != "inactive":
                seg["active_size"] += b["size"]
                seg["requested_size"] += b["requested"]
            if b["allocated"]:
                seg["allocated_size"] += b["size"]
            handle = self._live.get(b["ptr"]) if state != "inactive" else None
            seg["blocks"].append(
                {
                    "address": b["ptr"], "size": b["size"], "requested_size": b["requested"], "state": state,
                    "frames": (handle.frames or []) if handle is not None else [],
                }  # fmt: skip
            )
        return list(segments.values())

    def _segment_dict(self, seg: Segment, run: list[Block], pool_id: PoolId) -> dict[str, Any]:
        blocks = []
        allocated = active = requested = 0
        for b in run:
            if b.state == ALLOCATED:
                state = "active_allocated"
                allocated += b.size
            elif b.state == PENDING:
                state = "active_pending_free"
            else:
                state = "inactive"
            if state != "inactive":
                active += b.size
                requested += b.requested
            blocks.append(
                {
                    "address": b.ptr,
                    "size": b.size,
                    "requested_size": b.requested if state != "inactive" else 0,
                    "state": state,
                    "frames": b.frames or [],
                }
            )
        return {
            "device": self.device,
            "address": run[0].ptr,
            "total_size": sum(b.size for b in run),
            "allocated_size": allocated,
            "active_size": active,
            "requested_size": requested,
            "stream": seg.stream,
            "segment_type": "small" if seg.pool.small else "large",
            "segment_pool_id": pool_id,
            "is_expandable": seg.expandable,
            "frames": seg.frames,
            "blocks": blocks,
        }

    def largest_free_block(self) -> int:
        with self._lock:
            return self._largest_free()

    def _largest_free(self) -> int:
        core = (b["size"] for b in self._core.blocks() if not b["allocated"] and not b["held"])
        return max(
            (*(free.largest() for pool in self._all_pools() for free in pool.free.values()), *core),
            default=0,
        )

    def _all_pools(self) -> list[Pool]:
        pools = [self._small, self._large]
        for private in self._private.values():
            pools += [private.small, private.large]
        return pools

    def _out_of_memory(self, size: int, handle: int, *, counted: bool = False) -> OutOfMemoryError:
        """The report of a request of ``size`` bytes refused (``counted``: the core
        counted it already)."""
        if not counted:
            self._stats.s[S.NUM_OOMS] += 1
        free, total = self.upstream.memory_info()
        if self._history is not None:
            self._history.record("oom", free, size, handle, None)
        private_reserved = 0
        private_allocated = 0
        for private in self._private.values():
            for pool in (private.small, private.large):
                for seg in self._segments.values():
                    if seg.pool is pool:
                        for b in seg.blocks():
                            if b.mapped:
                                private_reserved += b.size
                                if b.state != FREE:
                                    private_allocated += b.size
        cached_free = sum(t[0] for pool in self._all_pools() for lst in pool.free.values() for t in lst)
        private_keys = {p.key for p in self._private.values()}
        for info in self._core.blocks():
            if not info["allocated"] and not info["held"]:
                cached_free += info["size"]
            if info["pool"] in private_keys:
                private_reserved += info["size"]
                if info["allocated"] or info["held"]:
                    private_allocated += info["size"]
        # What the device's other allocators hold: dropped pools (buffers of theirs still
        # alive, or a release still under way on another thread), MemPools in use, the
        # device's own allocator when a MemPool's ran short. Read without their locks,
        # for the diagnosis only.
        dropped = dropped_allocated = mempools = mempools_allocated = others = others_allocated = 0
        for other in list(_allocators):
            if other is self or other.backend is not self.backend or other.device != self.device:
                continue
            core_slots = other._core.slots()
            reserved = other._reserved() + core_slots[S.RESERVED_BYTES] + core_slots[S.RESERVED_BYTES + 1]
            allocated = (
                other._stats.current(S.ALLOCATED_BYTES) + core_slots[S.ALLOCATED_BYTES] + core_slots[S.ALLOCATED_BYTES + 1]
            )
            if other._orphaned:
                dropped += reserved
                dropped_allocated += allocated
            elif other._mempool is not None:
                mempools += reserved
                mempools_allocated += allocated
            else:
                others += reserved
                others_allocated += allocated
        core = self._core.stats()
        details = OutOfMemoryDetails(
            device=self._name,
            requested=size,
            total=total,
            free=free,
            allowed=self._allowed,
            fraction=self._fraction,
            allocated=self._stats.current(S.ALLOCATED_BYTES) + core["allocated_bytes.all.current"],
            reserved=self._reserved() + core["reserved_bytes.all.current"],
            private_pools=private_allocated,
            private_reserved=private_reserved,
            largest_free_block=self._largest_free(),
            cached_free=cached_free,
            expandable_segments=self._expandable,
            capturing=bool(self._captures),
            fraction_refused=self._fraction_refused,
            refusal=self._refusal,
            dropped_pools=dropped,
            dropped_pools_allocated=dropped_allocated,
            mempools=mempools,
            mempools_allocated=mempools_allocated,
            others=others,
            others_allocated=others_allocated,
        )
        return out_of_memory(details, self.device)
