"""The allocator's native core (csrc/accel_core.c), bound with cffi's API mode.

The core keeps the books of a caching allocator in typed C structs under its own
mutex: segments (plain, and expandable ones mapped page by page) cut into blocks,
best-fit free lists per (pool, stream), split and merge, the statistics. It includes
no Python.h, so it needs no GIL and is correct without one; cffi's generated wrapper
releases the GIL around every call into it. Its upstream (where new segments and
expandable segments' pages come from) is a :class:`MemoryResource`, reached through
``extern "Python"`` callbacks that take the GIL themselves and run with the core's
mutex released.

The same shared library exports torch's pluggable-allocator C ABI over the cores
registered per device (see :mod:`accel.allocator._torch_allocator`).

>>> from accel.allocator._native_core import NativeCore
>>> from accel.allocator import BackendResource
>>> from accel.backends.cpu import CpuBackend
>>> core = NativeCore(BackendResource(CpuBackend(1, None), 0))
>>> ptr, size = core.malloc(1000, stream=0)
>>> size, core.stats()["allocated_bytes.all.current"]
(1024, 1024)
>>> core.free(ptr); core.empty_cache()
2097152
"""

from __future__ import annotations

import importlib
import itertools
import os
import queue
import sys
import threading
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from queue import SimpleQueue
from types import ModuleType
from typing import Any, NoReturn

from accel._errors import InvalidValueError, OutOfMemoryError
from accel.allocator._fork import acting_for
from accel.allocator._resources import MemoryResource
from accel.allocator._stats import STAT_NAMES

__all__ = ["GIL_MODE", "GIVE_BACK_FIRST", "NO_RETRY", "NativeCore", "core_module", "entry_points", "library_path"]

#: The core never takes or needs the GIL (csrc/accel_core.c includes no Python.h);
#: cffi releases it around each call and its callbacks take it themselves.
GIL_MODE = "not used"

_module: ModuleType | None = None

#: malloc's flags (accel_core.h): on a refusal, return without giving the whole cache
#: back; give it back (counting a retry) before asking upstream.
NO_RETRY = 1
GIVE_BACK_FIRST = 2


def core_module() -> ModuleType:
    """The compiled core (``accel.allocator._core``), imported on first use."""
    global _module
    if _module is None:
        try:
            # by name: the module is cffi's, built by setup.py from csrc/
            _module = importlib.import_module("accel.allocator._core")
        except ImportError as exc:
            raise ImportError(
                f"accel's native allocator core is not built ({exc}): build it with "
                "`python setup.py build_ext --inplace` (needs a C compiler), or reinstall accel"
            ) from exc
    return _module


def library_path() -> str:
    """The path of the core's shared library (it exports torch's allocator ABI too)."""
    path = core_module().__file__
    assert path is not None
    return path


def entry_points() -> tuple[int, int, int, int]:
    """The addresses of the core's ``accel_core_malloc``, ``accel_core_free``,
    ``accel_core_hold`` and ``accel_core_release_held`` (accel_core.h), for the core
    steps of accel/_speedups.c."""
    module = core_module()
    ffi, lib = module.ffi, module.lib
    names = ("accel_core_malloc", "accel_core_free", "accel_core_hold", "accel_core_release_held")
    return tuple(int(ffi.cast("uintptr_t", ffi.addressof(lib, name))) for name in names)  # type: ignore[return-value]


_SLOTS = 93
_U64 = (1 << 64) - 1
_SCALARS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")
_POOLS = ("all", "small_pool", "large_pool")
_METRICS = ("current", "peak", "allocated", "freed")

# Upstream callbacks find their core by the handle cffi made for it.
_installed = False
_install_lock = threading.Lock()


def _install_callbacks(ffi: Any) -> None:
    """Define the ``extern "Python"`` upstream callbacks, once per process.

    Each is called by a C function of csrc/build_core.py with a call record, again and
    again until it sets the record's ``stage`` to 2: a signal's handler may raise (an
    interrupt) at any line of a callback, its first included, and the call must still
    end once, neither lost nor done twice. The upstream's side (the resource's calls,
    whose results an interrupt would lose between a driver's return and the next line)
    runs as one job (:func:`_run_once`), off the main thread, the only one a signal's
    handler interrupts. What left a callback is raised by the next empty_cache.
    """
    global _installed
    with _install_lock:
        if _installed:
            return

        @ffi.def_extern(onerror=_escaped_callback)  # type: ignore[untyped-decorator]
        def accel_py_upstream_alloc(ctx: Any, device: int, size: int, call: Any) -> None:
            upstream: _Upstream = ffi.from_handle(ctx)

            def job(this: _Job) -> None:
                try:
                    if upstream.admit is not None:
                        upstream.admit(size)
                    call.value = upstream.resource.allocate(size)
                except BaseException as exc:  # noqa: BLE001 - raised by the malloc that asked
                    # after anything but a shortage (a driver fault) the malloc stops, and raises it
                    call.rc = _shortage(this, exc)

            _run_once(upstream, call, job)
            _finish(upstream, call, "segment_alloc", call.value, size)

        @ffi.def_extern(onerror=_escaped_callback)  # type: ignore[untyped-decorator]
        def accel_py_upstream_free(ctx: Any, device: int, ptr: int, size: int, call: Any) -> None:
            upstream: _Upstream = ffi.from_handle(ctx)
            wait = _may_wait(upstream)

            def job(this: _Job) -> None:
                # Upstream frees are not stream ordered on every backend (the host's,
                # Level Zero's): queued work on the memory finishes first, as in
                # DeviceAllocator. A device that fails to wait twice keeps the memory
                # (freeing it under queued work would be worse).
                call.rc = 1
                if wait and not _synchronized(upstream, device):
                    return
                try:
                    upstream.resource.deallocate(ptr, size)
                except BaseException as exc:  # noqa: BLE001 - raised by the next empty_cache
                    upstream.free_errors.append(exc)
                    return
                call.rc = 0

            _run_once(upstream, call, job)
            _finish(upstream, call, "segment_free", ptr, size)

        _install_vm_callbacks(ffi)
        _installed = True


# Per thread: what left an upstream callback (an interrupt), for the upstream's
# free_errors once the callback, called again, ends.
_escaped = threading.local()


def _escaped_callback(exc_type: type[BaseException], exc: BaseException, tb: object) -> None:
    """cffi's ``onerror`` of the upstream callbacks: keep what left one (its C caller
    calls it again until it is done)."""
    try:
        _escaped.errors.append(exc)
    except AttributeError:
        _escaped.errors = [exc]


class _Job:
    """The upstream's side of one callback's call: it runs once, whoever asks first.
    ``gate`` is held from its making until it has run: a waiter takes it (not an Event,
    whose wait an interrupt can leave with its condition's lock released twice)."""

    __slots__ = ("work", "caller", "taken", "finished", "gate", "refusal")

    def __init__(self, work: Callable[[_Job], None]) -> None:
        self.work = work
        self.caller = threading.get_ident()
        self.finished = False
        self.refusal: BaseException | None = None  # the upstream's, for the caller's malloc
        self.taken = threading.Lock()
        self.gate = threading.Lock()
        self.gate.acquire()  # interrupted after it, the job is not made (see _run_once)

    def run(self) -> None:
        if self.taken.acquire(blocking=False):
            # a gc callback run here runs inside the caller's call (its locks are held)
            acting_for(self.caller)
            try:
                self.work(self)
            finally:
                acting_for(0)
                self.finished = True
                self.gate.release()

    def wait(self) -> None:
        # taken by a waiter (even one interrupted right after) only once it has run
        while not self.finished:
            self.gate.acquire()


class _Worker:
    """A thread of the process's own that runs the main thread's jobs (only the main
    thread submits), started on first use, and again when it is not alive: in a forked
    child, or after an interrupt ended a start half way."""

    def __init__(self) -> None:
        self.queue: SimpleQueue[_Job] = SimpleQueue()
        self.thread: threading.Thread | None = None

    def submit(self, job: _Job) -> bool:
        """Queue ``job``; False when no thread can run it (the interpreter is ending)."""
        if self.thread is None or not self.thread.is_alive():
            # a queue of its own: a forked child's holds what the parent's thread had left
            self.queue = SimpleQueue()
            thread = threading.Thread(target=self._serve, args=(self.queue,), name="accel-upstream")
            thread.daemon = True
            try:
                thread.start()
            except RuntimeError:  # at interpreter shutdown
                return False
            self.thread = thread
        self.queue.put(job)
        return True

    @staticmethod
    def _serve(queue: SimpleQueue[_Job]) -> None:
        while True:
            queue.get().run()


_worker = _Worker()
_job_keys = itertools.count(1)


def _run_once(upstream: _Upstream, call: Any, work: Callable[[_Job], None]) -> None:
    """Run ``work`` (which writes its results into ``call``) once for this call record,
    however often the callback is called again: on the main thread, by the worker while
    this thread waits (an interrupt of the wait leaves the callback, whose next call
    waits again); elsewhere (no signal's handler runs there) on this thread. Then
    ``call.stage`` is 1."""
    if call.stage:
        return
    if not call.job:
        key = next(_job_keys)
        upstream.jobs[key] = _Job(work)
        call.job = key
    job = upstream.jobs[call.job]
    if not job.finished:
        # (by ident: a thread torch made would get a dummy Thread object for good)
        inline = threading.get_ident() != threading.main_thread().ident or sys.is_finalizing()
        if inline or not _worker.submit(job):
            job.run()
    job.wait()
    call.stage = 1


def _finish(upstream: _Upstream, call: Any, event: str | None, ptr: int, size: int) -> None:
    """End a call whose job ran: report it (unless refused), keep what left the
    callback on the way for the next empty_cache, and say it is done (stage 2)."""
    job = upstream.jobs.get(call.job)
    if job is not None and job.refusal is not None:
        upstream.refusal.exc = job.refusal  # this thread's malloc raises it (raise_for)
    upstream.jobs.pop(call.job, None)
    call.stage = 2
    if event is not None and call.rc == 0:
        _report(upstream, event, ptr, size)
    errors = getattr(_escaped, "errors", None)
    while errors:
        upstream.free_errors.append(errors.pop(0))


def _may_wait(upstream: _Upstream) -> bool:
    """Whether a give-back on this thread may wait for the device (see ``no_wait``)."""
    return upstream.synchronize is not None and not getattr(upstream.no_wait, "on", False)


def _shortage(job: _Job, exc: BaseException) -> int:
    """What a refusal of the upstream means to the core (ACCEL_UPSTREAM_*), kept for the
    malloc that asked (see _finish): only a shortage is worth giving the cache back and
    asking again."""
    job.refusal = exc
    return 1 if isinstance(exc, OutOfMemoryError) else 2


def _install_vm_callbacks(ffi: Any) -> None:
    """The ``extern "Python"`` callbacks of expandable segments' virtual memory
    (accel_core.h's accel_vm_ops), over the resource's ``vm_*`` methods: each page is one
    physical allocation, mapped at its address (``_Upstream.pages``). Called as those
    of :func:`_install_callbacks` are."""

    @ffi.def_extern(onerror=_escaped_callback)  # type: ignore[untyped-decorator]
    def accel_py_vm_reserve(ctx: Any, device: int, size: int, call: Any) -> None:
        upstream: _Upstream = ffi.from_handle(ctx)

        def job(this: _Job) -> None:
            try:
                call.value = upstream.resource.vm_reserve(size)
            except BaseException as exc:  # noqa: BLE001 - raised by the malloc that asked
                call.rc = _shortage(this, exc)

        _run_once(upstream, call, job)
        _finish(upstream, call, None, 0, 0)

    @ffi.def_extern(onerror=_escaped_callback)  # type: ignore[untyped-decorator]
    def accel_py_vm_unreserve(ctx: Any, device: int, va: int, size: int, call: Any) -> None:
        upstream: _Upstream = ffi.from_handle(ctx)

        def job(this: _Job) -> None:
            _twice(upstream, lambda: upstream.resource.vm_free(va, size))

        _run_once(upstream, call, job)
        _finish(upstream, call, None, 0, 0)

    @ffi.def_extern(onerror=_escaped_callback)  # type: ignore[untyped-decorator]
    def accel_py_vm_map(ctx: Any, device: int, va: int, nbytes: int, call: Any) -> None:
        upstream: _Upstream = ffi.from_handle(ctx)
        spares = _spares(upstream)  # this thread's: its growth's give-back left them

        def job(this: _Job) -> None:
            resource, page, pages = upstream.resource, upstream.page, upstream.pages
            done: list[tuple[int, int]] = []
            try:
                if upstream.admit is not None:
                    upstream.admit(nbytes)
                for start in range(va, va + nbytes, page):
                    # the physical pages the growth's give-back just unmapped first
                    handle = spares.pop() if spares else resource.vm_create(page)
                    try:
                        resource.vm_map(start, page, handle)
                    except BaseException:
                        resource.vm_release(handle, page)
                        raise
                    done.append((start, handle))
                    pages[start] = handle
            except BaseException as exc:  # noqa: BLE001 - raised by the malloc that asked
                # all or nothing: the pages mapped so far go back (what that raises is the
                # next empty_cache's to raise)
                for start, handle in reversed(done):
                    pages.pop(start, None)
                    _unmap_page(upstream, start, handle)
                call.rc = _shortage(this, exc)
            finally:
                _release_spares(upstream, spares)

        _run_once(upstream, call, job)
        _finish(upstream, call, "segment_map", va, nbytes)

    @ffi.def_extern(onerror=_escaped_callback)  # type: ignore[untyped-decorator]
    def accel_py_vm_unmap(ctx: Any, device: int, va: int, nbytes: int, wait: int, call: Any) -> None:
        upstream: _Upstream = ffi.from_handle(ctx)
        # A growth's give-back (no wait) keeps the physical pages for the growth's map,
        # which follows on this thread: not released and made anew.
        spares = None if wait else _spares(upstream)
        may_wait = wait and _may_wait(upstream)

        def job(this: _Job) -> None:
            # Pages whose stream was not seen idle: its queued work may use them, and
            # unmapping is not stream ordered on every backend (see accel_py_upstream_free).
            if may_wait and not _synchronized(upstream, device):
                call.rc = 1  # the device failed to wait twice: the pages stay mapped (and in no book)
                return
            for start in range(va, va + nbytes, upstream.page):
                handle = upstream.pages.pop(start, None)
                if handle is not None:
                    _unmap_page(upstream, start, handle, spares)

        _run_once(upstream, call, job)
        _finish(upstream, call, "segment_unmap", va, nbytes)

    @ffi.def_extern(error=0)  # type: ignore[untyped-decorator]
    def accel_py_vm_idle(ctx: Any, device: int, stream: int) -> int:
        upstream: _Upstream = ffi.from_handle(ctx)
        if upstream.idle is None:
            return 0
        try:
            return int(upstream.idle(stream - (stream >> 63 << 64)))
        except BaseException as exc:  # noqa: BLE001 - not idle; raised by the next empty_cache
            upstream.free_errors.append(exc)
            return 0


def _spares(upstream: _Upstream) -> list[int]:
    """This thread's physical pages unmapped by a growth's give-back, for its map."""
    try:
        spares: list[int] = upstream.spares.pages
    except AttributeError:
        spares = upstream.spares.pages = []
    return spares


def _release_spares(upstream: _Upstream, spares: list[int]) -> None:
    """Release the spare physical pages a map did not use (what that raises is the next
    empty_cache's to raise)."""
    while spares:
        handle = spares.pop()
        _twice(upstream, lambda: upstream.resource.vm_release(handle, upstream.page))


def _twice(upstream: _Upstream, call: Callable[[], None]) -> bool:
    """``call()``, run again if it raised (an interrupt: uninterrupted, it ends), what it
    raised kept for the next empty_cache. False: it failed twice."""
    for _ in range(2):
        try:
            call()
            return True
        except BaseException as exc:  # noqa: BLE001 - raised by the next empty_cache
            upstream.free_errors.append(exc)
    return False


def _unmap_page(upstream: _Upstream, start: int, handle: int, spares: list[int] | None = None) -> None:
    """Unmap and release one page (kept in ``spares`` instead, when given). The core's
    books call it unmapped already: each step runs again after an interrupt, what it
    raised is the next empty_cache's to raise; a page the driver failed to unmap twice
    is not released (its physical memory is lost rather than freed under a mapping)."""
    resource, page = upstream.resource, upstream.page
    if not _twice(upstream, lambda: resource.vm_unmap(start, page)):
        return
    if spares is not None:
        spares.append(handle)
    else:
        _twice(upstream, lambda: resource.vm_release(handle, page))


def _synchronized(upstream: _Upstream, device: int) -> bool:
    """Wait for the device before memory goes back upstream; an interrupt of the wait
    runs it again, kept for the next empty_cache. False: the device failed to wait
    twice."""
    synchronize = upstream.synchronize
    assert synchronize is not None  # see _may_wait
    return _twice(upstream, lambda: synchronize(device))


def _report(upstream: _Upstream, event: str, ptr: int, size: int) -> None:
    """``upstream.notify(event, ptr, size)``, what it raises kept for the next
    empty_cache: a callback's exception would reach no caller (cffi prints it)."""
    if upstream.notify is not None:
        try:
            upstream.notify(event, ptr, size)
        except BaseException as exc:  # noqa: BLE001 - raised by the next empty_cache
            upstream.free_errors.append(exc)


def _metrics(slots: list[int], offsets: list[int], i: int) -> tuple[int, int, int, int]:
    """current, peak, allocated, freed of slot ``i`` (a statistic's base plus its pool);
    ``offsets`` hold the allocated and freed totals at the last reset_accumulated."""
    current, total = slots[i], slots[i + 4]
    return current, slots[i + 2], total - offsets[i + 4], total - current - offsets[i]


def stats_dict(slots: list[int], max_split_size: int, offsets: list[int] | None = None) -> OrderedDict[str, int]:
    """The core's statistic slots as PyTorch's ``memory_stats`` keys, sorted."""
    off = offsets if offsets is not None else [0] * _SLOTS
    out: dict[str, int] = {}
    for k, name in enumerate(STAT_NAMES):
        base = 8 * k
        small, large = _metrics(slots, off, base), _metrics(slots, off, base + 1)
        every = (small[0] + large[0], slots[base + 6], small[2] + large[2], small[3] + large[3])
        for pool, values in zip(_POOLS, (every, small, large)):
            for metric, value in zip(_METRICS, values):
                out[f"{name}.{pool}.{metric}"] = value
    for name, base in (("oversize_allocations", 72), ("oversize_segments", 80)):
        for metric, value in zip(_METRICS, _metrics(slots, off, base)):
            out[f"{name}.{metric}"] = value
    for i, name in enumerate(_SCALARS):
        out[name] = slots[88 + i] - off[88 + i]
    out["max_split_size"] = max_split_size
    return OrderedDict(sorted(out.items()))


class _Upstream:
    """What a core's callbacks reach: its resource, and what the resource raised per
    thread (a malloc that saw a refusal raises it). Not the NativeCore itself, so that
    the core's finalizer can keep it alive while the core gives its cache back."""

    __slots__ = (
        "resource", "refusal", "synchronize", "free_errors", "admit", "notify", "no_wait", "idle", "page", "pages",
        "spares", "jobs",
    )

    def __init__(
        self,
        resource: MemoryResource,
        synchronize: Callable[[int], None] | None,
        admit: Callable[[int], None] | None,
        notify: Callable[[str, int, int], None] | None,
        idle: Callable[[int], bool] | None = None,
    ) -> None:
        self.resource = resource
        self.idle = idle
        # expandable segments: the bytes of a page, and the physical page mapped at each
        # page's address
        self.page = 0
        self.pages: dict[int, int] = {}
        # per thread: physical pages a growth's give-back unmapped, for its map
        self.spares = threading.local()
        # the jobs of callbacks under way (see _run_once), by their call record's key
        self.jobs: dict[int, _Job] = {}
        self.admit = admit
        self.notify = notify
        # The upstream's last refusal on each thread, as ``refusal.exc``: thread-local, so
        # that it goes with its thread. Nothing reads the refusals of torch's threads
        # (accel_torch_alloc returns NULL), which come and go over a long process: a
        # table by thread id kept one per thread id forever, and an id the OS reused
        # read a dead thread's refusal. One slot per core, instead, would let a
        # thread's refusal be overwritten by another thread's before its malloc raised
        # it (the wrong error, or none, in the report).
        self.refusal = threading.local()
        self.synchronize = synchronize
        # set on a thread whose give-back must not wait for the device (the callbacks
        # run on the thread that called into the core)
        self.no_wait = threading.local()
        # what giving memory back (or a report of a segment) raised: the core calls
        # back on any thread, torch's too, where no caller sees it; the next
        # empty_cache raises the first
        self.free_errors: list[BaseException] = []


# A dropped core gives its cache back on a thread of its own. Its finalizer runs wherever
# the last reference went or a collection started: perhaps inside a backend call that
# holds a lock the give-back's device wait needs (Level Zero's event pool collected an old
# allocator there, and the wait took the backend's lock: that thread waited for itself).
# The reaper takes such locks as any thread does, once their holder lets go.
_dropped: queue.SimpleQueue[tuple[Any, Any, Any]] = queue.SimpleQueue()
_reaper: threading.Thread | None = None
_reaper_lock = threading.Lock()


def _destroy(lib: Any, core: Any, handle: Any) -> None:
    """Hand a dropped core to the reaper (``handle`` is kept alive until it is destroyed:
    the upstream callbacks need it). Puts only: no lock, nothing that can wait."""
    _dropped.put((lib, core, handle))
    if _reaper is None:
        _start_reaper()


def _start_reaper() -> None:
    global _reaper
    with _reaper_lock:
        if _reaper is None:
            _reaper = threading.Thread(target=_reap, name="accel-core-reaper", daemon=True)
            _reaper.start()


def _reap() -> None:
    """Give dropped cores' caches back and free their books, one at a time."""
    while True:
        lib, core, handle = _dropped.get()
        if lib is None:  # reap_dropped's mark: everything before it is done
            handle.set()
        else:
            lib.accel_core_destroy(core)  # what its callbacks raise stays with the dropped upstream
        del lib, core, handle


def reap_dropped() -> None:
    """Wait until every core dropped so far gave its cache back (for tests and for
    code that must see the memory back upstream, such as a driver's free count)."""
    if _reaper is None:
        return
    done = threading.Event()
    _dropped.put((None, None, done))
    done.wait()


def _new_reaper_in_child() -> None:
    """A forked child has no reaper thread (only the forking thread survives); cores the
    parent had dropped but not destroyed are the parent's to give back."""
    global _dropped, _reaper, _reaper_lock
    _dropped, _reaper, _reaper_lock = queue.SimpleQueue(), None, threading.Lock()


os.register_at_fork(after_in_child=_new_reaper_in_child)


class NativeCore:
    """One native core: the books of a caching allocator of ``upstream``'s device.

    ``synchronize(device)``, when given, runs before memory goes back upstream;
    ``admit(size)`` before a new segment is asked of it (raising OutOfMemoryError refuses
    it: a memory fraction's cap); ``notify(event, ptr, size)`` after a segment came from
    upstream ("segment_alloc") or went back ("segment_free"), on the thread that asked.
    ``idle(stream)``: whether a stream has no queued work (an expandable segment's free
    pages go back for another's growth only then).
    ``stream`` and ``pool`` are opaque keys (a stream's handle, a pool's number):
    blocks are reused only under the keys they were freed with.
    """

    def __init__(
        self,
        upstream: MemoryResource,
        synchronize: Callable[[int], None] | None = None,
        admit: Callable[[int], None] | None = None,
        notify: Callable[[str, int, int], None] | None = None,
        idle: Callable[[int], bool] | None = None,
    ) -> None:
        module = core_module()
        self._ffi = module.ffi
        self._lib = module.lib
        _install_callbacks(self._ffi)
        self.upstream = upstream
        self.device = upstream.device
        self._callbacks = _Upstream(upstream, synchronize, admit, notify, idle)
        handle = self._ffi.new_handle(self._callbacks)
        lib = self._lib
        self._core = lib.accel_core_new(self.device, lib.accel_py_alloc, lib.accel_py_free, handle)
        if self._core == self._ffi.NULL:
            raise MemoryError("the host has no memory for the allocator core's books")
        # not at exit: the process's memory goes with it, and the backend may be gone
        weakref.finalize(self, _destroy, lib, self._core, handle).atexit = False
        self._max_split_size = -1
        self._offsets = [0] * _SLOTS  # see reset_accumulated
        self.virtual_memory = upstream.supports_virtual_memory()
        if self.virtual_memory:
            # the C functions over the callbacks that may not end early (csrc/build_core.py)
            ops = {n: getattr(lib, f"accel_py_{n}") for n in ("reserve", "unreserve", "map", "unmap")}
            lib.accel_core_set_vm(self._core, self._ffi.new("accel_vm_ops *", {**ops, "idle": lib.accel_py_vm_idle}))
        self._tls = threading.local()

    @property
    def address(self) -> int:
        """The core's address, for :func:`accel_core_register_torch`."""
        return int(self._ffi.cast("uintptr_t", self._core))

    def configure(self, max_split_size: int | None, max_non_split_rounding: int, large_segment: int) -> None:
        """The settings of :class:`AllocatorConfig` the core applies (None: unlimited)."""
        self._max_split_size = -1 if max_split_size is None else max_split_size
        self._lib.accel_core_configure(self._core, max_split_size or 0, max_non_split_rounding, large_segment)

    def set_expandable(self, on: bool, page: int = 0, reserve_size: int = 0, keep_free: int = 0) -> None:
        """Expandable segments (PyTorch's ``expandable_segments``) on or off: one
        reservation of ``reserve_size`` bytes per (pool, kind, stream), mapped in
        ``page``-byte pages on demand; ``keep_free`` bytes of each one's free pages stay
        mapped when another grows. Only on a resource with virtual memory."""
        if on and not self.virtual_memory:
            raise InvalidValueError(f"{self.upstream!r} has no virtual memory: no expandable segments")
        if on and not (page >= 512 and page % 512 == 0 and reserve_size >= page and reserve_size % page == 0):
            raise InvalidValueError(
                f"expandable segments need a page of 512-byte multiples and a reservation of pages, "
                f"not page={page}, reserve_size={reserve_size}"
            )
        if on:
            self._callbacks.page = page
        self._lib.accel_core_set_expandable(self._core, int(on), page, reserve_size, keep_free)

    def malloc(self, nbytes: int, stream: int, pool: int = 0, flags: int = 0) -> tuple[int, int]:
        """``(ptr, size)`` of a block of at least ``nbytes`` for ``stream`` in ``pool``.
        ``flags``: :data:`NO_RETRY` and :data:`GIVE_BACK_FIRST` (see accel_core.h)."""
        lib = self._lib
        # Out-parameters per thread (cffi lets the GIL go during the call, so threads
        # cannot share them): two ffi.new per call cost as much as the call itself.
        try:
            out, size = self._tls.out
        except AttributeError:
            out, size = self._tls.out = self.new_out()
        rc = lib.accel_core_malloc(self._core, nbytes, stream, pool, flags, out, size)
        if rc == 0:  # ACCEL_CORE_OK
            return out[0], size[0]
        self.raise_for(rc, nbytes)

    def new_out(self) -> tuple[Any, Any]:
        """New out-parameters for ``accel_core_malloc`` (the pointer, the size): one pair
        per thread, as cffi lets the GIL go during the call."""
        return self._ffi.new("uint64_t *"), self._ffi.new("int64_t *")

    def raise_for(self, rc: int, nbytes: int) -> NoReturn:
        """Raise what ``accel_core_malloc``'s nonzero ``rc`` for ``nbytes`` means: the
        upstream's own exception, InvalidValueError, MemoryError or OutOfMemoryError."""
        lib = self._lib
        refusal: BaseException | None = vars(self._callbacks.refusal).pop("exc", None)
        if rc == lib.ACCEL_CORE_BAD_SIZE:
            raise InvalidValueError(f"cannot allocate {nbytes} bytes: the size must be in [1, 2**60)")
        if refusal is not None and not isinstance(refusal, OutOfMemoryError):
            raise refusal
        if rc == lib.ACCEL_CORE_NO_MEMORY:
            raise MemoryError("the host has no memory for the allocator core's books")
        raise OutOfMemoryError(
            f"device {self.device} out of memory: {nbytes} bytes refused ({refusal}), after the "
            "allocator core gave its cache back",
            requested=nbytes,
            device=self.device,
        ) from refusal

    def free(self, ptr: int) -> None:
        """Give back the block allocated at ``ptr``."""
        if self._lib.accel_core_free(self._core, ptr):  # not ACCEL_CORE_OK
            raise InvalidValueError(f"{ptr:#x} is not allocated by this allocator core (freed twice?)")

    def hold(self, ptr: int) -> None:
        """The caller freed the block at ``ptr`` but its reuse must wait (for other
        streams): it leaves the allocated statistics, stays active and unusable until
        :meth:`release_held`."""
        if self._lib.accel_core_hold(self._core, ptr):  # not ACCEL_CORE_OK
            raise InvalidValueError(f"{ptr:#x} is not allocated by this allocator core (freed twice?)")

    def release_held(self, ptr: int) -> None:
        """The held block at ``ptr`` may be reused: onto its free list."""
        if self._lib.accel_core_release_held(self._core, ptr):  # not ACCEL_CORE_OK
            raise InvalidValueError(f"{ptr:#x} is not a block this allocator core holds")

    def _raise_free_errors(self) -> None:
        errors = self._callbacks.free_errors
        if errors:
            first = errors[0]
            errors.clear()
            raise first

    def empty_cache(self, *, wait: bool = True) -> int:
        """Give the wholly free segments of the pools not kept back upstream; the bytes
        given back. Raises what the upstream raised giving memory back, here or since
        the last call. ``wait=False``: without synchronizing the device first (the
        caller saw its streams idle, and must not wait)."""
        no_wait = self._callbacks.no_wait
        no_wait.on = not wait
        try:
            given = int(self._lib.accel_core_empty_cache(self._core))
        finally:
            no_wait.on = False
        self._raise_free_errors()
        return given

    def keep_pool(self, pool: int, keep: bool) -> None:
        """Whether :meth:`empty_cache` and a miss's give-back leave ``pool`` cached.
        Raises OutOfMemoryError, the core's books unchanged, when the host has no
        memory to note a pool kept."""
        if self._lib.accel_core_keep_pool(self._core, pool, int(keep)):  # ACCEL_CORE_NO_MEMORY
            raise OutOfMemoryError(
                f"device {self.device}: the host has no memory for the allocator core's books to keep "
                f"pool {pool} cached; nothing was changed: free host memory and try again",
                device=self.device,
            )

    def release_pool(self, pool: int) -> int:
        """Give ``pool``'s wholly free segments back upstream (kept or not); the bytes."""
        given = int(self._lib.accel_core_release_pool(self._core, pool))
        self._raise_free_errors()
        return given

    def pool_segments(self, pool: int) -> int:
        """How many segments ``pool`` has."""
        return int(self._lib.accel_core_pool_segments(self._core, pool))

    def freeze(self, frozen: bool) -> None:
        """While frozen, nothing goes back upstream (a capture is under way)."""
        self._lib.accel_core_freeze(self._core, int(frozen))

    def rekey_stream(self, old: int, key: int) -> int:
        """Key by ``key`` what ``old`` keys (a destroyed stream's handle); the segments.
        Keys are 64-bit: a negative one (never a stream's handle) is stored as its
        two's complement and listed by :meth:`blocks` as itself."""
        return int(self._lib.accel_core_rekey_stream(self._core, old & _U64, key & _U64))

    def set_divisions(self, divisions: Sequence[int]) -> None:
        """PyTorch's ``roundup_power2_divisions``, one per power-of-two range from 1 MiB."""
        slots = self._lib.ACCEL_CORE_DIVISION_SLOTS
        if len(divisions) != slots:
            raise InvalidValueError(f"{len(divisions)} roundup divisions given; the core takes {slots}")
        self._lib.accel_core_set_divisions(self._core, self._ffi.new("int64_t[]", list(divisions)))

    def set_gc_threshold(self, threshold: int) -> None:
        """Reserved bytes above which a miss first collects old cached blocks (0: off)."""
        self._lib.accel_core_set_gc_threshold(self._core, threshold)

    def reserved(self) -> int:
        """Bytes of the segments the core holds."""
        slots = self.slots()
        return slots[40] + slots[41]

    def slots(self) -> list[int]:
        """The raw statistic slots (the layout of accel/allocator/_stats.py)."""
        out = self._ffi.new("int64_t[]", _SLOTS)
        self._lib.accel_core_stats(self._core, out)
        return list(out)

    def stats(self) -> OrderedDict[str, int]:
        """PyTorch's ``memory_stats`` keys for what the core holds."""
        return stats_dict(self.slots(), self._max_split_size, self._offsets)

    def reset_peak(self) -> None:
        self._lib.accel_core_reset_peak(self._core)

    def reset_accumulated(self) -> None:
        """Zero the allocated and freed totals and the counters (retries, OOMs...), as
        :class:`accel.allocator._stats.Stats` does: by offsets, the core's slots only grow."""
        slots = self.slots()
        off = [0] * _SLOTS
        for base in range(0, 88, 8):
            for pool in (0, 1):
                i = base + pool
                off[i + 4] = slots[i + 4]
                off[i] = slots[i + 4] - slots[i]
        off[88:] = slots[88:]
        self._offsets = off

    def blocks(self) -> list[dict[str, int]]:
        """Every block of every segment: its segment, stream, pool, state (allocated,
        held, unmapped (of an expandable segment), else free) and sizes."""
        ffi, lib = self._ffi, self._lib
        cap = 64
        while True:
            out = ffi.new("accel_core_block_info[]", cap)
            n = lib.accel_core_blocks(self._core, out, cap)
            if n <= cap:
                break
            cap = n + 64  # blocks added meanwhile: ask again, with room
        return [
            {
                "segment": int(b.segment), "segment_size": int(b.segment_size),
                "stream": int(b.stream) - (int(b.stream) >> 63 << 64),
                "pool": int(b.pool), "small": bool(b.small), "allocated": b.state == lib.ACCEL_CORE_ALLOCATED,
                "held": b.state == lib.ACCEL_CORE_HELD, "expandable": bool(b.expandable),
                "mapped": b.state != lib.ACCEL_CORE_UNMAPPED,
                "ptr": int(b.ptr), "size": int(b.size), "requested": int(b.requested),
            }  # fmt: skip
            for b in out[0:n]
        ]

    def allocated_size(self, ptr: int) -> int | None:
        """The size of the block allocated at ``ptr``; None when none is."""
        size = int(self._lib.accel_core_allocated_size(self._core, ptr))
        return None if size < 0 else size
