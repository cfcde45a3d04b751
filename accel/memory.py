"""Device memory: buffers from the caching allocator, statistics, snapshots.

The names follow ``torch.accelerator`` / ``torch.cuda.memory``::

    import accel

    buf = accel.memory.allocate(1 << 20)          # on the current device and stream
    s = accel.Stream()
    s.fill(buf, 0)
    buf.record_stream(s)                          # reuse waits for s
    buf.free()                                    # or let it be garbage collected
    accel.memory.memory_stats()["allocated_bytes.all.current"]

Device arguments accept an index, ``"cuda:1"``, an :class:`accel.Device` or
a ``torch.device``; None means the current device.
"""

from __future__ import annotations

import itertools
import os
import pickle
import sys
import threading
from collections import OrderedDict
from typing import Any

from typing_extensions import Self

from accel._device import Device, DeviceLike
from accel._errors import DeviceError, InvalidHandleError, InvalidValueError
from accel._runtime import Runtime, get_runtime
from accel._units import format_size
from accel.allocator._blocks import Block
from accel.allocator._caching import DeviceAllocator
from accel.allocator._history import History
from accel.allocator._host_cache import HostBlock, HostCachingAllocator
from accel.allocator._resources import MemoryResource
from accel.stream._stream import Stream, as_stream

__all__ = [
    "Buffer",
    "DeviceAllocator",
    "HostBuffer",
    "allocate",
    "allocate_host",
    "dump_snapshot",
    "empty_cache",
    "empty_host_cache",
    "get_allocator",
    "graph_pool_handle",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory_allocated",
    "memory_reserved",
    "memory_snapshot",
    "memory_stats",
    "memory_summary",
    "record_memory_history",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_per_process_memory_fraction",
    "set_upstream",
]

_EXTENSION = "accel.memory"


class _State:
    """Per-runtime memory state: one allocator per device, the staging cache."""

    def __init__(self, runtime: Runtime) -> None:
        from accel.allocator.config import add_change_observer, config_for_backend

        self.runtime = runtime
        self.lock = threading.Lock()
        self.config = config_for_backend(runtime.name)
        self.allocators: dict[int, DeviceAllocator] = {}
        self.upstreams: dict[int, MemoryResource] = {}
        self.host: HostCachingAllocator | None = None
        self.history: tuple[str, str | None, str, int] | None = None
        add_change_observer(self._config_changed)

    def _config_changed(self, backend: str, old: Any, new: Any) -> None:
        if backend != self.runtime.name:
            return
        self.config = new
        for allocator in list(self.allocators.values()):
            allocator.update_config(new)
        if self.host is not None:
            self.host.update_config(new)

    def allocator(self, index: int) -> DeviceAllocator:
        allocator = self.allocators.get(index)
        if allocator is None:
            with self.lock:
                allocator = self.allocators.get(index)
                if allocator is None:
                    allocator = DeviceAllocator(
                        self.runtime.backend, index, self.config, upstream=self.upstreams.get(index)
                    )
                    if self.history is not None:
                        allocator.record_history(History(*self.history))
                    self.allocators[index] = allocator
        return allocator

    def host_allocator(self) -> HostCachingAllocator:
        if self.host is None:
            with self.lock:
                if self.host is None:
                    self.host = HostCachingAllocator(self.runtime.backend, self.config)
        return self.host


def _state(runtime: Runtime | None = None) -> _State:
    runtime = runtime if runtime is not None else get_runtime()
    state = runtime.extensions.get(_EXTENSION)
    if state is None:
        with runtime._lock:
            state = runtime.extensions.get(_EXTENSION)
            if state is None:
                state = runtime.extensions[_EXTENSION] = _State(runtime)
    return state  # type: ignore[return-value]


def get_allocator(device: DeviceLike = None) -> DeviceAllocator:
    """The caching allocator of ``device`` (created on first use).

    >>> import accel
    >>> accel.memory.get_allocator().device
    0
    """
    runtime = get_runtime()
    return _state(runtime).allocator(runtime.index(device))


def set_upstream(resource: MemoryResource, device: DeviceLike = None) -> None:
    """Make the allocator of ``device`` take its memory from ``resource``
    (an adaptor stack over :class:`~accel.allocator.BackendResource`).

    Only while the device's caching allocator does not exist yet: the first
    allocation on the device creates it, and so does the first call that reads
    or configures it (``memory_stats()``, ``memory_allocated()``,
    ``set_per_process_memory_fraction()``, ``get_allocator()``...). An
    allocator cannot change where its memory comes from, so call this first.

    >>> import accel
    >>> from accel.allocator import BackendResource, StatisticsAdaptor
    >>> backend = accel.memory.get_allocator(0).backend  # doctest: +SKIP
    >>> accel.memory.set_upstream(StatisticsAdaptor(BackendResource(backend, 1)), device=1)  # doctest: +SKIP
    """
    runtime = get_runtime()
    index = runtime.index(device)
    if not isinstance(resource, MemoryResource) or resource.device != index:
        raise InvalidValueError(f"{resource!r} is not a MemoryResource of device {index}")
    state = _state(runtime)
    with state.lock:
        if index in state.allocators:
            raise InvalidValueError(
                f"set_upstream() is too late for {runtime.device(index)}: its caching allocator already "
                "exists (made by the first allocation on the device, or by the first call that reads or "
                "configures it, such as memory_stats(), memory_allocated(), set_per_process_memory_fraction() "
                "or get_allocator()), and it cannot change where its memory comes from. Call set_upstream() "
                "for this device before any other accel.memory call on it, or give the resource to an "
                f"allocator of your own: accel.allocator.DeviceAllocator(backend, {index}, config, "
                "upstream=resource)"
            )
        state.upstreams[index] = resource


class _CachedMemory:
    """What device buffers and staging buffers share: a block of a caching
    allocator that goes back to it on free(), at the end of a ``with`` block,
    or when the object is garbage collected."""

    # Streams do not keep buffers alive for queued work: the allocator's
    # stream-ordered reuse already makes freeing early safe.
    __accel_buffer__ = True
    __slots__ = ("_block", "_allocator", "_nbytes", "__weakref__")
    _kind = "buffer"

    def __init__(self, block: Any, allocator: Any, nbytes: int) -> None:
        self._block = block
        self._allocator = allocator
        self._nbytes = nbytes

    @property
    def nbytes(self) -> int:
        """The size asked for (the block behind it may be a little larger)."""
        return self._nbytes

    @property
    def ptr(self) -> int:
        block = self._block
        if block is None:
            raise InvalidHandleError(f"{self!r} was freed; allocate a new {self._kind}")
        return block.ptr

    @property
    def freed(self) -> bool:
        return self._block is None

    def free(self) -> None:
        """Return the memory to the cache now (a second call does nothing)."""
        block, self._block = self._block, None
        if block is not None:
            self._allocator.free(block)

    def record_stream(self, stream: Stream) -> None:
        """Declare that work queued on ``stream`` uses this memory: after a free,
        it is reused only once ``stream`` has passed the free."""
        block = self._block
        if block is None:
            raise InvalidHandleError(f"record_stream on {self!r}, which was freed")
        if not isinstance(stream, Stream):
            raise InvalidValueError(f"record_stream needs an accel.Stream, got {stream!r}")
        self._allocator.record_stream(block, stream)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __del__(self) -> None:
        block = self._block
        if block is not None:
            self._block = None
            self._allocator.free_from_finalizer(block)


class Buffer(_CachedMemory):
    """Device memory from the caching allocator.

    ``ptr`` is the address, ``nbytes`` the size asked for, ``stream`` the
    stream it is ordered on. The memory goes back to the cache on
    :meth:`free`, at the end of a ``with`` block, or when the buffer is
    garbage collected; afterwards ``ptr`` raises
    :class:`~accel.InvalidHandleError`.

    >>> import accel
    >>> with accel.memory.allocate(4096) as buf:
    ...     accel.current_stream().fill(buf, 7)
    >>> buf.freed
    True
    """

    __slots__ = ("_stream",)

    def __init__(self, block: Block, allocator: DeviceAllocator, stream: Stream, nbytes: int) -> None:
        # Assigned here rather than through super().__init__: this is on the
        # allocation hot path, and the call costs about 0.14 µs.
        self._block = block
        self._allocator = allocator
        self._nbytes = nbytes
        self._stream = stream

    @property
    def device(self) -> Device:
        return self._stream.device

    @property
    def stream(self) -> Stream:
        return self._stream

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """Export as DLPack with the array API's semantics (``np.from_dlpack(buf)``,
        ``torch.from_dlpack(buf)``): the consumer's ``stream`` is ordered after
        this buffer's stream; no copy is ever made."""
        from accel._interop._dlpack import to_capsule

        return to_capsule(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(DLPack device type, index)``: 1 host, 2 CUDA, 14 oneAPI."""
        from accel._interop._dlpack import dlpack_device

        return dlpack_device(self)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3, with the buffer's stream (CUDA buffers only:
        AttributeError elsewhere, so ``hasattr`` says False)."""
        from accel._interop._cuda_array_interface import cuda_array_interface

        return cuda_array_interface(self)

    def __repr__(self) -> str:
        where = "freed" if self._block is None else f"ptr={self._block.ptr:#x}"
        return f"accel.memory.Buffer({where}, nbytes={self._nbytes}, device={self.device})"


def allocate(nbytes: int, *, device: DeviceLike = None, stream: Stream | None = None) -> Buffer:
    """``nbytes`` of device memory, ordered on ``stream`` (default: the current stream
    of ``device``).

    Raises :class:`~accel.OutOfMemoryError` with a diagnosis when the device
    is full even after the cache was freed.

    >>> import accel
    >>> buf = accel.memory.allocate(1000)
    >>> buf.nbytes, buf.ptr % 512
    (1000, 0)
    """
    runtime = get_runtime()
    if stream is None:
        stream = runtime.current_stream(runtime.index(device))
    else:
        stream = as_stream(stream)
        if device is not None and runtime.index(device) != stream.device_index:
            raise DeviceError(
                f"stream {stream!r} is on {stream.device}, not on the device asked for ({device!r})"
            )
    stream._live()
    allocator = _state(runtime).allocator(stream.device_index)
    return Buffer(allocator.malloc(nbytes, stream), allocator, stream, nbytes)


class HostBuffer(_CachedMemory):
    """Page-locked host memory for asynchronous copies, from a cache.

    After :meth:`free` the memory is reused only once the streams named with
    :meth:`record_stream` have finished the copies queued before the free.

    >>> import accel
    >>> with accel.memory.allocate_host(4096) as staging:
    ...     staging.nbytes
    4096
    """

    __slots__ = ()
    _kind = "host buffer"

    def __repr__(self) -> str:
        where = "freed" if self._block is None else f"ptr={self._block.ptr:#x}"
        return f"accel.memory.HostBuffer({where}, nbytes={self._nbytes})"


def allocate_host(nbytes: int) -> HostBuffer:
    """``nbytes`` of page-locked host memory (cuMemHostAlloc, zeMemAllocHost, host pages)."""
    allocator = _state().host_allocator()
    return HostBuffer(allocator.malloc(nbytes), allocator, nbytes)


def empty_host_cache() -> None:
    """Free the cached staging memory whose copies completed."""
    state = _state()
    if state.host is not None:
        state.host.empty_cache()


# -- caches, fractions, statistics ---------------------------------------------------------


def _allocators(device: DeviceLike) -> list[DeviceAllocator]:
    """The allocators ``device`` names; None means every device that has one."""
    runtime = get_runtime()
    state = _state(runtime)
    if device is None:
        return [state.allocators[i] for i in sorted(state.allocators)]
    return [state.allocator(runtime.index(device))]


def empty_cache(device: DeviceLike = None) -> None:
    """Give unused cached memory back to the device: whole free segments and free
    expandable pages. None means every device (unlike torch, not only the current one)."""
    for allocator in _allocators(device):
        allocator.empty_cache()


def set_per_process_memory_fraction(fraction: float, device: DeviceLike = None) -> None:
    """Cap what the allocator of ``device`` reserves at ``fraction`` (0..1) of its memory."""
    get_allocator(device).set_memory_fraction(fraction)


def memory_stats(device: DeviceLike = None) -> OrderedDict[str, int]:
    """PyTorch's ``memory_stats`` keys (``allocated_bytes.all.current``,
    ``num_alloc_retries``...) for ``device``, sorted.

    >>> import accel
    >>> accel.memory.memory_stats()["num_ooms"]
    0
    """
    return OrderedDict(get_allocator(device).stats())


def memory_allocated(device: DeviceLike = None) -> int:
    """Bytes in allocated blocks (rounded sizes)."""
    return get_allocator(device).stats()["allocated_bytes.all.current"]


def max_memory_allocated(device: DeviceLike = None) -> int:
    """Peak of :func:`memory_allocated` since the start or the last peak reset."""
    return get_allocator(device).stats()["allocated_bytes.all.peak"]


def memory_reserved(device: DeviceLike = None) -> int:
    """Bytes the allocator holds from the device (allocated plus cached)."""
    return get_allocator(device).stats()["reserved_bytes.all.current"]


def max_memory_reserved(device: DeviceLike = None) -> int:
    """Peak of :func:`memory_reserved`."""
    return get_allocator(device).stats()["reserved_bytes.all.peak"]


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    """Set every peak to the current value."""
    get_allocator(device).reset_peak_stats()


def reset_accumulated_memory_stats(device: DeviceLike = None) -> None:
    """Zero the ``allocated``/``freed`` totals and the event counters (retries, OOMs...)."""
    get_allocator(device).reset_accumulated_stats()


_pool_ids = itertools.count(1)


def graph_pool_handle() -> tuple[int, int]:
    """A new private pool id ``(0, N)`` that graphs can share (PyTorch's scheme)."""
    return (0, next(_pool_ids))


# -- snapshots and history ---------------------------------------------------------------------


def memory_snapshot(device: DeviceLike = None) -> list[dict[str, Any]]:
    """Segments and blocks (PyTorch's ``memory_snapshot()`` layout); None: every device."""
    return [segment for a in _allocators(device) for segment in a.snapshot()]


def record_memory_history(
    enabled: str | None = "all",
    *,
    context: str | None = "all",
    stacks: str = "all",
    max_entries: int = sys.maxsize,
) -> None:
    """Record allocation events (and their Python stacks) for :func:`dump_snapshot`.

    ``enabled``: "all" keeps a trace ring of ``max_entries``, "state" only the
    stacks of live blocks, None stops and clears. ``context``: which events
    carry stacks ("state", "alloc", "all" or None). ``stacks``: "python" or
    "all" (the same here: accel records Python frames only). Applies to every
    device, including allocators created later.
    """
    state = _state()
    settings = None if enabled is None else (enabled, context, stacks, max_entries)
    if settings is not None:
        History(*settings)  # validate before touching any allocator
    with state.lock:
        state.history = settings
        allocators = list(state.allocators.values())
    for allocator in allocators:
        allocator.record_history(None if settings is None else History(*settings))


def _settings(config: Any) -> dict[str, Any]:
    table = config.roundup_power2_divisions
    return {
        "ACCEL_ALLOC_CONF": str(config),
        "max_split_size": -1 if config.max_split_size is None else config.max_split_size,
        "garbage_collection_threshold": config.garbage_collection_threshold,
        "expandable_segments": config.expandable_segments,
        "roundup_power2_divisions": {str(1 << i): d for i, d in enumerate(table)},
    }


def _full_snapshot() -> dict[str, Any]:
    runtime = get_runtime()
    state = _state(runtime)
    allocators = _allocators(None)
    traces: list[list[dict[str, Any]]] = [[] for _ in range(runtime.device_count())]
    for allocator in allocators:
        traces[allocator.device] = allocator.trace()
    return {
        "segments": [seg for a in allocators for seg in a.snapshot()],
        "device_traces": traces,
        "allocator_settings": _settings(state.config),
        "external_annotations": [],
    }


def dump_snapshot(path: str | os.PathLike[str] = "dump_snapshot.pickle") -> None:
    """Pickle the segments and traces for PyTorch's memory viewer
    (pytorch.org/memory_viz or ``python -m torch.cuda._memory_viz``)."""
    snapshot = _full_snapshot()
    with open(path, "wb") as f:
        pickle.dump(snapshot, f)


def memory_summary(device: DeviceLike = None) -> str:
    """A table of the allocator's statistics for ``device``, like PyTorch's."""
    allocator = get_allocator(device)
    stats = allocator.stats()
    rows = [
        ("Allocated memory", "allocated_bytes", True),
        ("Active memory", "active_bytes", True),
        ("Requested memory", "requested_bytes", True),
        ("Reserved memory", "reserved_bytes", True),
        ("Non-releasable memory", "inactive_split_bytes", True),
        ("Allocations", "allocation", False),
        ("Active allocs", "active", False),
        ("Reserved segments", "segment", False),
        ("Non-releasable allocs", "inactive_split", False),
    ]
    width = 79
    line = "=" * width
    out = [
        line,
        f"|{'accel memory summary, device ' + str(get_runtime().device(allocator.device)):^{width - 2}}|",
        line,
        f"| {'Metric':<25}| {'Cur Usage':>10} | {'Peak Usage':>10} | {'Tot Alloc':>10} | {'Tot Freed':>7} |",
    ]
    for label, key, is_bytes in rows:
        out.append("-" * width)
        for pool, name in (("all", label), ("large_pool", "  from large pool"), ("small_pool", "  from small pool")):
            values = [stats[f"{key}.{pool}.{m}"] for m in ("current", "peak", "allocated", "freed")]
            text = [format_size(v) if is_bytes else str(v) for v in values]
            out.append(f"| {name:<25}| {text[0]:>10} | {text[1]:>10} | {text[2]:>10} | {text[3]:>9} |")
    out.append(line)
    for key in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free"):
        out.append(f"| {key:<25}| {stats[key]:>48} |")
    out.append(line)
    return "\n".join(out)
