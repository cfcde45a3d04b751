"""Buffers: device and staging memory from the caching allocators, freed in stream order.

:func:`allocate` and :func:`allocate_host` are the ``malloc`` of accel's
memory; a :class:`Buffer` or :class:`HostBuffer` goes back to its cache on
``free()``, at the end of a ``with`` block, or when it is garbage collected.

A Buffer speaks DLPack (and the CUDA Array Interface on CUDA). Those exchange
formats live in :mod:`accel._interop`, a layer above this one: it installs
them here (:func:`install_exports`) when it is imported, which the first
export asks for through the loader ``accel`` gave the runtime
(:func:`accel._runtime.load_interop`), so this module never imports it.

>>> from accel.allocator import allocate
>>> with allocate(4096) as buf:
...     buf.nbytes
4096
"""

from __future__ import annotations

import gc
import sys
import threading
from typing import TYPE_CHECKING, Any, Protocol

from accel import _runtime
from accel._device import Device, DeviceLike
from accel._native import speedups
from accel._errors import DeviceError, InvalidHandleError, NotSupportedError
from accel._runtime import check_not_forked, get_runtime
from accel.allocator import _mempool
from accel.allocator._fork import track_lock
from accel.allocator._blocks import CoreBlock
from accel.allocator._mempool import routed_allocator
from accel.allocator._registry import _EXTENSION, registry
from accel.allocator._sharing import export_buffer
from accel.stream import Stream, as_stream

if TYPE_CHECKING:
    from typing_extensions import Self  # typing's own from Python 3.11; only annotations need it

    from accel.allocator._caching import DeviceAllocator

__all__ = ["Buffer", "BufferExports", "HostBuffer", "allocate", "allocate_host", "install_exports"]


class BufferExports(Protocol):
    """The exchange formats a :class:`Buffer` speaks, provided by :mod:`accel._interop`."""

    def to_capsule(
        self,
        buffer: Buffer,
        *,
        stream: Any,
        max_version: tuple[int, int] | None,
        dl_device: tuple[int, int] | None,
        copy: bool | None,
    ) -> Any: ...

    def dlpack_device(self, buffer: Buffer | HostBuffer) -> tuple[int, int]: ...

    def host_capsule(
        self,
        buffer: HostBuffer,
        *,
        stream: Any,
        max_version: tuple[int, int] | None,
        dl_device: tuple[int, int] | None,
        copy: bool | None,
    ) -> Any: ...

    def host_memoryview(self, buffer: HostBuffer) -> memoryview: ...

    def cuda_array_interface(self, buffer: Buffer) -> dict[str, Any]: ...

    def release_unconsumed(self) -> None:
        """Let go of exports whose capsules died unconsumed (a consumer refused them)."""


_exports: BufferExports | None = None


def install_exports(exports: BufferExports) -> None:
    """Give buffers their exchange formats (called once, by :mod:`accel._interop`)."""
    global _exports
    _exports = exports


def _installed() -> BufferExports:
    if _exports is None:
        _runtime.load_interop()  # imports accel._interop, which calls install_exports
        if _exports is None:
            raise NotSupportedError("accel's buffer exports are not installed: import accel first")
    return _exports


# A garbage collection can start inside the allocators' locked sections (any
# allocation there may trigger one), and the finalizers it runs may call
# free() (``weakref.finalize(obj, buf.free)``), which would then wait forever
# on a lock its own thread holds. While a collection runs, free() takes the
# finalizer path: it never blocks, and a free it cannot make now is made by
# the allocator's next call.
_collecting = False


def _note_collection(phase: str, info: dict[str, int]) -> None:
    global _collecting
    _collecting = phase == "start"


gc.callbacks.append(_note_collection)


# Creating a buffer's lease is rare (its first export) and never happens in
# a finalizer, so a plain lock is safe here.
_lease_lock = threading.Lock()
track_lock(sys.modules[__name__], "_lease_lock")


class _CachedMemory:
    """What device buffers and staging buffers share: a block of a caching
    allocator that goes back to it on free(), at the end of a ``with`` block,
    or when the object is garbage collected, or, once exported (a DLPack
    consumer, a tensor, a memoryview, a graph's capture), when the last of
    the object and its exports lets go of it."""

    # Streams do not keep buffers alive for queued work: the allocator's
    # stream-ordered reuse already makes freeing early safe.
    __accel_buffer__ = True
    __slots__ = ("_block", "_allocator", "_nbytes", "_lease", "__weakref__")
    _kind = "buffer"

    def __init__(self, block: Any, allocator: Any, nbytes: int) -> None:
        self._block = block
        self._allocator = allocator
        self._nbytes = nbytes
        self._lease: _Lease | None = None

    @property
    def nbytes(self) -> int:
        """The size asked for (the block behind it may be a little larger)."""
        return self._nbytes

    @property
    def ptr(self) -> int:
        block = self._block
        if block is None:
            raise InvalidHandleError(f"{self!r} was freed; allocate a new {self._kind}")
        return block.ptr  # type: ignore[no-any-return]

    @property
    def freed(self) -> bool:
        return self._block is None

    def free(self) -> None:
        """Return the memory to the cache now (a second call does nothing).

        While an export (a tensor, a DLPack consumer, a memoryview) still
        views the memory, it goes back only when the last view is gone;
        ``ptr`` is invalid at once either way.
        """
        if self._block is not None:
            check_not_forked()
        block, self._block = self._block, None
        if block is None:
            return
        if self._lease is not None:
            # Dropping the lease frees the block, now or with the last export;
            # exports a consumer refused let go of it first.
            self._lease = None
            _installed().release_unconsumed()
        elif _collecting:
            self._allocator.free_from_finalizer(block)
        else:
            self._allocator.free(block)

    def _export_lease(self) -> object:
        """What an export holds so that the memory outlives :meth:`free` while exported."""
        lease = self._lease
        if lease is not None:
            return lease
        check_not_forked()  # the lock may have been held by another parent thread at the fork
        with _lease_lock:
            lease = self._lease
            if lease is None:
                block = self._block
                if block is None:
                    raise InvalidHandleError(f"{self!r} was freed; allocate a new {self._kind}")
                lease = self._lease = _Lease(block, self._allocator)
            return lease

    def record_stream(self, stream: Stream) -> None:
        """Declare that work queued on ``stream`` uses this memory: after a free,
        it is reused only once ``stream`` has passed the free."""
        block = self._block
        if block is None:
            raise InvalidHandleError(f"record_stream on {self!r}, which was freed")
        check_not_forked()
        self._allocator.record_stream(block, as_stream(stream, role="stream", optional=False))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.free()

    def __del__(self) -> None:
        # getattr: __init__ may have failed before setting the slots.
        block = getattr(self, "_block", None)
        if block is not None:
            self._block = None
            if getattr(self, "_lease", None) is None:
                self._allocator.free_from_finalizer(block)
            else:
                self._lease = None  # the lease frees the block with the last export
                if _exports is not None:
                    _exports.release_unconsumed()


class _TakesBlocksBack(Protocol):
    """A caching allocator, of device memory (a Buffer's) or of page-locked memory (a HostBuffer's)."""

    def free_from_finalizer(self, block: Any) -> None: ...

    def record_stream(self, block: Any, stream: Stream) -> None: ...


class _Lease:
    """A buffer's block while exports of it may be read: it goes back to the
    cache when the last of the buffer and its exports lets go of it."""

    # Weakly referenced by exports to other processes, which serve importers
    # only while the buffer (or a view of it) still holds the lease.
    __slots__ = ("_block", "_allocator", "__weakref__")

    def __init__(self, block: object, allocator: _TakesBlocksBack) -> None:
        self._block = block
        self._allocator = allocator

    def __del__(self) -> None:
        # Runs wherever the last holder dies: a consumer's deleter, a
        # garbage collection, Buffer.free().
        self._allocator.free_from_finalizer(self._block)

    def record_stream(self, stream: Stream) -> None:
        """Work queued on ``stream`` uses the memory (a graph's replays): once the
        lease is gone, it is reused only after ``stream`` passed that point."""
        self._allocator.record_stream(self._block, stream)


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

    def __init__(self, block: CoreBlock, allocator: DeviceAllocator, stream: Stream, nbytes: int) -> None:
        # Assigned here rather than through super().__init__: this is on the
        # allocation hot path, and the call costs about 0.14 µs.
        self._block = block
        self._allocator = allocator
        self._nbytes = nbytes
        self._stream = stream
        self._lease = None

    def free(self) -> None:
        """Return the memory to the cache now (a second call does nothing).

        While a DLPack consumer (a numpy array, a torch tensor...) still
        views the memory, it goes back only when the last view is gone, as
        a torch storage outlives ``del`` while views of it exist; this
        buffer's ``ptr`` is invalid at once either way.
        """
        block = self._block
        if block is not None:
            if _runtime._forked_from is not None:  # check_not_forked(), without the call
                check_not_forked()  # the allocator's lock may have been held by another parent thread
            self._block = None
            if self._lease is None:
                if _collecting:
                    self._allocator.free_from_finalizer(block)
                else:
                    self._allocator.free(block)
                return
            # Dropping the lease frees the block, now or with the last export;
            # exports a consumer refused let go of it first.
            self._lease = None
            _installed().release_unconsumed()

    def __del__(self) -> None:
        try:
            block = self._block
        except AttributeError:  # __init__ never ran
            return
        if block is not None:
            self._block = None
            if self._lease is None:
                self._allocator.free_from_finalizer(block)
            else:
                self._lease = None  # the lease frees the block with the last export
                if _exports is not None:
                    _exports.release_unconsumed()

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
        this buffer's stream; with ``copy=True`` the consumer gets a copy in
        new memory of its own, otherwise a view."""
        return _installed().to_capsule(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(DLPack device type, index)``: 1 host, 2 CUDA, 14 oneAPI."""
        return _installed().dlpack_device(self)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as a handle another process opens to the same memory, without a
        copy (``multiprocessing`` with the spawn start method, a ``Queue``).

        Keep this buffer alive until every importer has unpickled it; after
        that, its memory is not reused while an importer holds it. See
        :mod:`accel.allocator._sharing` for the rules.
        """
        return export_buffer(self)

    @property
    def __cuda_array_interface__(self) -> dict[str, Any]:
        """CUDA Array Interface v3, with the buffer's stream (CUDA buffers only:
        AttributeError elsewhere, so ``hasattr`` says False)."""
        return _installed().cuda_array_interface(self)

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
    # The compiled allocate (installed below) takes the common case: the current
    # stream, no MemPool, a plain allocator. This is every other case.
    runtime = get_runtime()
    if stream is None:
        index = runtime.index(device)
        stream = runtime.current_stream(index)
    else:
        stream = as_stream(stream)
        if device is not None and runtime.index(device) != stream.device_index:
            raise DeviceError(
                f"stream {stream!r} is on {stream.device}, not on the device asked for ({device!r})"
            )
        index = stream.device_index
    # A MemPool's allocator inside use_mem_pool, else the device's.
    allocator = routed_allocator(runtime, index)
    # malloc checks nbytes and the stream.
    return Buffer(allocator.malloc(nbytes, stream), allocator, stream, nbytes)


class HostBuffer(_CachedMemory):
    """Page-locked host memory for asynchronous copies, from a cache.

    After :meth:`free` the memory is reused only once the streams named with
    :meth:`record_stream` have finished the copies queued before the free.

    It is host memory to torch and numpy, as torch's pinned tensors are:
    ``accel.as_tensor(hb)``, ``torch.from_dlpack(hb)`` and ``np.from_dlpack(hb)``
    view its bytes without a copy, and so does ``memoryview(hb)`` where Python
    has the buffer protocol for classes (3.12). A view keeps the memory alive
    past :meth:`free`. A HostBuffer has no stream: read it after the copies
    that write it are done (synchronize their stream or an event), as with
    ``non_blocking`` copies into pinned tensors.

    Its tensors say ``is_pinned() == False`` unless torch's own accelerator
    runtime recognizes the memory: torch asks CUDA (or XPU) whether a pointer
    is pinned, and a CPU-only torch has no way to register memory as pinned.
    :attr:`page_locked` tells the truth instead (False on the host backend,
    whose staging memory is ordinary pages).

    >>> import accel, torch
    >>> with accel.memory.allocate_host(4096) as staging:
    ...     staging.nbytes
    4096
    >>> staging = accel.memory.allocate_host(8)
    >>> accel.current_stream().fill(staging, 1); accel.current_stream().synchronize()
    >>> torch.from_dlpack(staging)
    tensor([1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.uint8)
    """

    __slots__ = ()
    _kind = "host buffer"

    @property
    def page_locked(self) -> bool:
        """Whether the memory is page-locked (cuMemHostAlloc, zeMemAllocHost), which
        ``torch.Tensor.is_pinned()`` cannot tell on a CPU-only torch.

        >>> import accel
        >>> accel.memory.allocate_host(8).page_locked  # the host backend's pages are not
        False
        """
        return bool(self._allocator.backend.host_memory_page_locked)

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: tuple[int, int] | None = None,
        dl_device: tuple[int, int] | None = None,
        copy: bool | None = None,
    ) -> Any:
        """Export as DLPack, host memory of bytes (``torch.from_dlpack(hb)``): a view,
        or with ``copy=True`` a copy in new page-locked memory. ``stream`` is None,
        -1 or an accel.Stream: there is nothing to order (see the class)."""
        return _installed().host_capsule(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        """``(1, 0)``: DLPack's host device (torch refuses page-locked ``kDLCUDAHost``)."""
        return _installed().dlpack_device(self)

    def __buffer__(self, flags: int, /) -> memoryview:
        """The buffer protocol (PEP 688; ``memoryview(hb)`` from Python 3.12, a call
        before): a writable memoryview of the bytes that keeps the memory alive."""
        return _installed().host_memoryview(self)

    def __repr__(self) -> str:
        where = "freed" if self._block is None else f"ptr={self._block.ptr:#x}"
        return f"accel.memory.HostBuffer({where}, nbytes={self._nbytes})"


def allocate_host(nbytes: int) -> HostBuffer:
    """``nbytes`` of page-locked host memory (cuMemHostAlloc, zeMemAllocHost, host pages)."""
    allocator = registry().host_allocator()
    return HostBuffer(allocator.malloc(nbytes), allocator, nbytes)


# The compiled allocate, Buffer.free and Buffer.__del__ (accel/_speedups.c): the common
# case (current stream, no MemPool, no export); they call the Python versions above for
# every other case. In it, while the allocator is plain (DeviceAllocator._plain), they
# take the allocator's core steps (DeviceAllocator._steps) directly.
speedups.install_buffers(
    {
        "Buffer": Buffer, "runtime_module": _runtime, "buffer_module": sys.modules[__name__],
        "mempool_module": _mempool, "EXTENSION": _EXTENSION,
    }  # fmt: skip
)
