"""The caching device allocator, written once against the Backend protocol.

Its books live in ONE native core per device (csrc/accel_core.c, through
:class:`~accel.allocator._native_core.NativeCore`): the same core torch's pluggable
allocator allocates from (:func:`accel.allocator.torch_allocator_spec`), so accel
buffers and torch tensors share one cache, one set of statistics and one snapshot.
The core keeps the segments, plain and expandable: blocks, best-fit free lists per
(pool, stream), split and merge, PyTorch's rounding, the garbage-collection
threshold, giving back oversize cached blocks on a miss, expandable segments' pages
(mapped and unmapped through the resource's ``vm_*`` calls), the statistics. This
class is the policy and API layer over it: argument checks, streams, the pool a
capture allocates to, the events that order cross-stream reuse (a block freed with
other streams' uses is *held* in the core until they pass), frees deferred during a
capture, history, the memory fraction (the core asks
:meth:`DeviceAllocator._admit_core` before each new segment or page), dropped
MemPools' memory, out-of-memory reports and configuration.

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
  ``map_target``, ``give_back_holes``, ``place_at_end`` in csrc/accel_core.c);
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
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, NoReturn

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
from accel.allocator._blocks import ALLOCATED, CoreBlock, CoreSteps, PrivatePool
from accel.allocator._fork import OwnedLock, caller_ident, track_lock
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


def _idler(ref: weakref.ref[DeviceAllocator]) -> Callable[[int], bool]:
    """The native core's question whether the stream keyed ``key`` has no queued work
    (before an expandable segment's free pages go back for another's growth; held
    weakly, as _admitter). It asks on whichever thread grows a segment, with or without
    the allocator's lock, so it only reads."""

    def idle(key: int) -> bool:
        allocator = ref()
        return allocator is not None and allocator._stream_idle(key, recycle=False)

    return idle


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
    block handle (a :class:`CoreBlock` of the native core) whose ``ptr`` and ``size``
    the caller uses; ``free`` gives
    it back to the cache. Thread safe: one lock guards the policy's state; the core
    has its own, and the common pair (no capture, history or pending events) takes
    only the core's.
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
        # Counters of this allocator's own (the core counts everything else): the
        # out-of-memory errors raised here without asking the core (during a capture)
        # and the device-wide synchronizations before a give-back.
        self._stats = S.Stats()
        self._private: dict[PoolId, PrivatePool] = {}
        # (pool id, stream filter) of the captures under way, innermost last
        self._captures: list[tuple[PrivatePool, Callable[[Stream], bool]]] = []
        # Frees held back until the captures end (or, outside one, until the next release
        # of cached memory: an interrupt left their stream uses unordered).
        self._deferred: list[CoreBlock] = []
        self._pending: dict[int, deque[tuple[int, CoreBlock]]] = {}  # used stream -> (event, block)
        self._events: list[int] = []  # pooled events, ready for reuse
        self._events_created = 0
        # Frees (and pool releases) from finalizers that found the lock taken.
        self._gc_frees: deque[CoreBlock | _PoolRelease | _StreamRetired] = deque()
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
        # Stream handles this allocator keys memory by (segments' streams, record_stream
        # uses): a destroyed one is retired (see _retire), the others cost nothing.
        self._known: set[int] = set()
        # Retired handles' keys (negative: never a live handle) -> the event after the
        # destroyed stream's work (absent: nothing to wait for).
        self._retired: dict[int, int] = {}
        self._next_key = -1
        # The books (plain and expandable segments), shared with torch's pluggable allocator
        # on this device (see native_core); the handles of its blocks callers hold, by address.
        ref = weakref.ref(self)
        self._core = core = NativeCore(
            self.upstream, backend.device_synchronize, _admitter(ref), _notifier(ref), _idler(ref)
        )
        self._live: dict[int, CoreBlock] = {}
        # Every change of the core's books of a block and of its handle in _live is one
        # of these C steps (so an interrupt never lands between the two): the hot paths',
        # the compiled pair's (accel/_speedups.c) and the locked paths' alike.
        self._steps = CoreSteps(self, core.address, self._live, self._known, entry_points(), InvalidHandleError)
        # True while the common pair needs nothing but the core (no capture under way, no
        # history, no pending events, no frees or retired streams
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
        self._ms = _UNLIMITED if config.max_split_size is None else config.max_split_size
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
        if self._expandable:
            page = self._page_size()
            _, total = self.upstream.memory_info()
            # As PyTorch: room for the whole device plus an eighth, never exceeded.
            core.set_expandable(True, page, -(-(total + total // 8) // page) * page, self._keep_free)
        else:
            core.set_expandable(False)
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
        if allowed is not None and self._core_reserved() + size > allowed:
            self._fraction_refused = True
            raise OutOfMemoryError(
                f"{self._name}: a new segment of {size} bytes would pass the "
                f"memory fraction's cap of {allowed} bytes; free memory, or raise the fraction "
                "(set_per_process_memory_fraction)",
                requested=size,
                device=self.device,
            )

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

    def malloc(self, nbytes: int, stream: Stream) -> CoreBlock:
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
        # ``with``, not acquire() then try: an interrupt (Ctrl-C) between those two left the
        # lock held for good (accel/allocator/_fork.py).
        lock = self._lock
        try:
            with lock:  # C: taken and given back with nothing between them and the with's guard
                try:
                    if self._gc_frees:
                        self._drain_gc_frees()
                    if self._pending and not self._captures:
                        self._process_events()
                    private = self._capture_private(stream) if self._captures else None
                    key = 0 if private is None else private.key
                    got = self._steps.malloc(nbytes, handle, key, NO_RETRY)
                    # an int: the core refused
                    block = self._core_refused(got, nbytes, handle, key) if isinstance(got, int) else got
                    if self._history is not None:
                        self._record_alloc(block)
                    if stream._closed:  # after the handle is live: see _closed_meanwhile
                        self._closed_meanwhile(block, stream)
                    return block
                finally:
                    self._refresh_plain()
        finally:
            self._recheck_plain()

    def _malloc_refused(self, rc: int, nbytes: int, stream: Stream, block: CoreBlock | None = None) -> CoreBlock:
        """The lock-free malloc's core call for ``nbytes`` on ``stream`` returned ``rc``
        (not ACCEL_CORE_OK): what the locked path does with a refusal, under the lock.
        ``block``: the call handed it out (``rc`` 0), but ``stream`` was closed meanwhile
        (see _closed_meanwhile). The compiled allocate calls it by name too."""
        lock = self._lock
        try:
            with lock:  # C: taken and given back with nothing between them and the with's guard
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
        finally:
            self._recheck_plain()

    def _closed_meanwhile(self, block: CoreBlock, stream: Stream) -> None:
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
            self._captures or self._pending or self._gc_frees or self._orphaned or self._forked
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

    def _round(self, nbytes: int) -> int:
        """The block size for a request: 512-byte multiples, or power-of-two divisions
        (the core rounds its own requests the same way)."""
        slot = nbytes.bit_length() - 21  # the divisions of [1 MiB, 2 MiB) are slot 0
        return round_size(nbytes, self._divisions[0 if slot < 0 else (slot if slot < 15 else 15)])

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

    # -- expandable segments -------------------------------------------------------

    def _page_size(self) -> int:
        # PyTorch maps the large pool in large_segment_size (20 MiB) pages. accel
        # uses 2 MiB pages (or the granularity, if larger) for both pools: the
        # last page of a segment is the waste expandable segments still have,
        # and 20 MiB of it per stream dominates models of a few hundred MiB
        # (measured in docs/archive/benchmarks-history.md); the price is more map calls.
        unit = self.upstream.vm_granularity()
        return -(-SMALL_BUFFER // unit) * unit

    # -- free ------------------------------------------------------------------------

    def free(self, block: CoreBlock) -> None:
        """Give ``block`` back; it is reused once every stream that used it passed
        this point (see :meth:`record_stream`)."""
        # The common case, without the lock (see _plain): its checks and the claim are one
        # C step, so a record_stream in another thread lands before or after both.
        if self._plain and block.__class__ is CoreBlock and self._steps.free_plain(block):
            return
        if self._forked:
            self._refuse_in_child("free")
        lock = self._lock
        if lock.owner == caller_ident():
            # A gc callback or finalizer run inside this thread's call: deferred to the
            # next call that takes the lock, as a finalizer's free (a free twice refused).
            if getattr(block, "state", ALLOCATED) != ALLOCATED:
                raise InvalidHandleError(f"{block!r} is not allocated by {self!r} (freed twice)")
            self.free_from_finalizer(block)
            return
        try:
            with lock:  # C: taken and given back with nothing between them and the with's guard
                try:
                    try:
                        if block.state != ALLOCATED or block.owner is not self:
                            raise InvalidHandleError(
                                f"{block!r} is not allocated by {self!r} (freed twice, or from another "
                                "allocator)"
                            )
                    except AttributeError:  # not a Block
                        self._bad_block(block, "free")
                    self._free_held(block)
                finally:
                    self._refresh_plain()
        finally:
            self._recheck_plain()

    def _free_held(self, block: CoreBlock) -> None:
        """:meth:`free` of an allocated block of this allocator, the lock held."""
        if block.stream_uses and self._gc_frees:
            self._drain_gc_frees()  # a retired handle among the uses is known before events are recorded
        self._free_locked(block)
        if self._orphaned:
            self._release_if_idle()

    def _free_locked(self, block: CoreBlock) -> None:
        if self._history is not None:
            self._history.record("free_requested", block.ptr, block.size, block.stream, None)
        if block.stream_uses:
            self._steps.hold(block)
            self._order_reuse(block)
        else:
            self._steps.free(block)
            if self._history is not None:
                self._history.record("free_completed", block.ptr, block.size, block.stream, None)

    def _order_reuse(self, block: CoreBlock) -> None:
        """Freed ``block`` (PENDING) is reused once its other streams pass events
        recorded now, or at the end of the captures under way."""
        if self._captures:
            self._deferred.append(block)
        else:
            self._insert_events(block)

    def free_from_finalizer(self, block: CoreBlock) -> None:
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
        try:
            # one C call: no point between taking the lock and its guard for an interrupt
            freed = self._lock.call_if_free(self._free_if_allocated, block)
        finally:
            self._recheck_plain()
        if not freed:
            self._gc_frees.append(block)
            self._plain = False

    def _free_if_allocated(self, block: CoreBlock) -> None:
        """:meth:`free_from_finalizer`'s free, the lock held."""
        try:
            if block.state == ALLOCATED:
                self._free_held(block)
        finally:
            self._refresh_plain()

    def release_when_idle(self) -> None:
        """The owner of this allocator (a :class:`MemPool` that was dropped) needs it
        no more: give every segment back upstream now if nothing is allocated, else
        when the last allocation is freed. Safe from a finalizer: it never waits for
        the device, so memory whose streams still have queued work goes back at the
        device's next ``empty_cache`` or allocation short of memory."""
        self._orphaned = True
        self._plain = False
        if not self._lock.call_if_free(self._drain_and_release_if_idle):  # one C call: see free_from_finalizer
            # Another thread holds the lock: a free may be under way that read the
            # flag before it was set (its fast path then never releases), and it may
            # be the last. Noted as an orphan, the memory goes at the device's next
            # empty_cache or allocation short of memory, which take the lock.
            _orphans.add(self)

    def _drain_and_release_if_idle(self) -> None:
        """:meth:`release_when_idle`'s release, the lock held."""
        if self._gc_frees:
            self._drain_gc_frees()
        self._release_if_idle()

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
        slots = self._core.slots()
        return bool(slots[S.ALLOCATION] or slots[S.ALLOCATION + 1])

    def _streams_idle(self) -> bool:
        streams = {b["stream"] for b in self._core.blocks()}
        return all(self._stream_idle(stream) for stream in streams)

    def _stream_idle(self, key: int, *, recycle: bool = True) -> bool:
        """Whether the stream that segments keyed ``key`` belong to has no queued work.
        ``recycle``: a retired key's completed end event goes back to the event pool
        (only with the lock held: the core asks without it, see _idler)."""
        if key < 0:  # a retired handle: its destroyed stream's end event says
            event = self._retired.get(key)
            if event is None:
                return True
            if event == _UNORDERED or not self.backend.event_query(self.device, event):
                return False
            if recycle and key not in self._pending:  # no free waits for it: the event goes back to the pool
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
        self._lock.call_if_free(self._drain_gc_frees)  # one C call: see free_from_finalizer

    def _retire(self, retired: _StreamRetired) -> None:
        """Key what this allocator keys by a destroyed stream's handle by a new key of its
        own, which no stream has: the core's segments, blocks and free lists (plain and
        expandable), the handles' streams and record_stream uses. Memory cached under
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

    def _free_block(self, block: CoreBlock) -> None:
        """The held ``block`` may be reused: the core puts it on its free list, and the
        caller's handle is retired (a stale second ``free`` of it is refused)."""
        self._steps.release(block)
        if self._history is not None:
            self._history.record("free_completed", block.ptr, block.size, block.stream, None)

    # -- streams -----------------------------------------------------------------------

    def record_stream(self, block: CoreBlock, stream: Stream) -> None:
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
            if self._live.get(block.ptr) is not block:
                # The lock-free free (see _plain) claimed it after the state check above:
                # freed first, its memory may be reused without waiting for this use.
                raise InvalidHandleError(
                    f"record_stream on {block!r}, which another thread freed meanwhile; record the "
                    "stream before the buffer is freed"
                )

    def _insert_events(self, block: CoreBlock) -> None:
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

    def _wait_for_retired(self, block: CoreBlock, key: int) -> None:
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
            before = self._core_reserved()
            if self._gc_frees:
                self._drain_gc_frees()
            if not self._allocated_any():
                self._release_cached_blocks()
            self._note_orphan()
            return before - self._core_reserved()
        finally:
            self._lock.release()

    def _note_orphan(self) -> None:
        """Keep this dropped pool's allocator for a later release while it holds memory."""
        if self._core.blocks():
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
        # The core's wholly free segments and free expandable pages of the default pool
        # and of the private pools no graph uses (those in use are kept: see
        # begin_allocate_to_pool).
        self._core.empty_cache(wait=wait)
        for private in freeable:
            if self._core.pool_segments(private.key) == 0:
                del self._private[private.id]

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
        if not self._lock.call_if_free(self._release_pool_locked, pool_id):  # one C call: see free_from_finalizer
            self._gc_frees.append(_PoolRelease(pool_id))
            self._plain = False

    def _release_pool_locked(self, pool_id: PoolId) -> bool:
        private = self._private.get(pool_id)
        if private is None or private.use_count == 0:
            return False
        private.use_count -= 1
        if private.use_count == 0:
            self._core.keep_pool(private.key, False)  # freeable: the next empty_cache gives it back
        if private.use_count == 0 and self._core.pool_segments(private.key) == 0:
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
        # The core's counters (accel's buffers and torch's tensors alike), plus this
        # allocator's own (see __init__).
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
            out = self._core_segments()
            if self._history is not None:
                active = sum(x["active_size"] for x in out)
                self._history.record("snapshot", 0, active, 0, None)
        return sorted(out, key=lambda x: x["address"])

    def _core_segments(self) -> list[dict[str, Any]]:
        """The native core's segments in :meth:`snapshot`'s layout (the lock held: the
        frames of accel's blocks are on their handles; torch's blocks have none). An
        expandable segment shows as one segment per contiguous mapped range."""
        pool_ids: dict[int, PoolId] = {p.key: p.id for p in self._private.values()}
        out: list[dict[str, Any]] = []
        seg: dict[str, Any] | None = None
        for b in self._core.blocks():
            if not b["mapped"]:
                seg = None  # an unmapped range ends an expandable segment's mapped run
                continue
            if seg is None or seg["key"] != b["segment"]:
                seg = {
                    "key": b["segment"], "device": self.device, "address": b["ptr"], "total_size": 0,
                    "allocated_size": 0, "active_size": 0, "requested_size": 0, "stream": b["stream"],
                    "segment_type": "small" if b["small"] else "large",
                    "segment_pool_id": pool_ids.get(b["pool"], (0, 0)), "is_expandable": b["expandable"],
                    "frames": [], "blocks": [],
                }  # fmt: skip
                out.append(seg)
            state = "active_allocated" if b["allocated"] else "active_pending_free" if b["held"] else "inactive"
            seg["total_size"] += b["size"]
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
        for seg in out:
            del seg["key"]
        return out

    def largest_free_block(self) -> int:
        with self._lock:
            return self._largest_free()

    def _largest_free(self) -> int:
        return max(
            (b["size"] for b in self._core.blocks() if b["mapped"] and not b["allocated"] and not b["held"]),
            default=0,
        )

    def _out_of_memory(self, size: int, handle: int, *, counted: bool = False) -> OutOfMemoryError:
        """The report of a request of ``size`` bytes refused (``counted``: the core
        counted it already)."""
        if not counted:
            self._stats.s[S.NUM_OOMS] += 1
        free, total = self.upstream.memory_info()
        if self._history is not None:
            self._history.record("oom", free, size, handle, None)
        private_reserved = private_allocated = cached_free = 0
        private_keys = {p.key for p in self._private.values()}
        for info in self._core.blocks():
            if not info["mapped"]:
                continue
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
            reserved = core_slots[S.RESERVED_BYTES] + core_slots[S.RESERVED_BYTES + 1]
            allocated = core_slots[S.ALLOCATED_BYTES] + core_slots[S.ALLOCATED_BYTES + 1]
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
            allocated=core["allocated_bytes.all.current"],
            reserved=core["reserved_bytes.all.current"],
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
