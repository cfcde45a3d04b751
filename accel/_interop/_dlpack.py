"""A DLPack producer for accel memory, built with ctypes.

Any object with ``ptr`` (int), ``nbytes`` (int), ``device`` (an
:class:`accel.Device`) and ``stream`` (the :class:`accel.Stream` its data was
last written on) can be exported: :func:`to_capsule` returns the PyCapsule
that ``__dlpack__`` hands to consumers (``torch.from_dlpack``,
``np.from_dlpack``, CuPy...), and :func:`dlpack_device` the
``__dlpack_device__`` pair.

Both capsule kinds are produced: the legacy ``"dltensor"`` capsule holding a
``DLManagedTensor``, and, when the consumer passes ``max_version`` with a
major version of at least 1, the DLPack 1.0 ``"dltensor_versioned"`` capsule
holding a ``DLManagedTensorVersioned``. The exporting object (for an accel
Buffer, its memory, even past ``Buffer.free()``) is kept alive until the
consumer calls the tensor's deleter, or, if the capsule is never consumed,
until the next export (or the free of the Buffer) after the capsule died. Exports still held at
interpreter exit are safe: the deleter stays valid for the life of the
process.

Stream semantics follow the array API standard's ``__dlpack__``: the
consumer names the stream it will use and the producer makes that stream
wait for the producer's own stream with an accel event, without blocking
the host; only a consumer with no stream accel can order (numpy on the
host) makes the host wait for the data.

>>> import accel, numpy as np
>>> from accel.backends import load_backend
>>> class Buf:  # what accel.memory's Buffer provides
...     def __init__(self, nbytes):
...         self.nbytes, self.device, self.stream = nbytes, accel.Device("cpu", 0), accel.current_stream()
...         self.ptr = load_backend("cpu").malloc(0, nbytes)
...     def __dlpack__(self, **kw): return to_capsule(self, **kw)
...     def __dlpack_device__(self): return dlpack_device(self)
>>> np.from_dlpack(Buf(16)).shape
(16,)
"""

from __future__ import annotations

import ctypes
import enum
import math
import struct
import sys
import warnings
from collections.abc import Callable
from typing import Any

from accel._errors import InvalidValueError
from accel.allocator import Buffer, HostBuffer, allocate, allocate_host
from accel.stream import ExternalStream, Stream, as_stream
# The C structures (dlpack.h, v1.0) live in the stream layer, which reads
# DLPack operands of copies and fills.
from accel.stream._dlpack_abi import Deleter as _Deleter, capsule_is_valid as _capsule_is_valid

__all__ = [
    "DLDeviceType",
    "DLPACK_VERSION",
    "DLPackExportError",
    "dlpack_device",
    "dtype_from_name",
    "host_capsule",
    "make_capsule",
    "live_exports",
    "to_capsule",
]

#: The DLPack ABI version of the versioned capsules produced here.
DLPACK_VERSION: tuple[int, int] = (1, 0)


class DLPackExportError(InvalidValueError, BufferError):
    """The buffer cannot be exported as asked (wrong device, a copy requested...).

    A :class:`BufferError` as the array API standard requires, and an accel
    error like every other refusal.
    """


class DLDeviceType(enum.IntEnum):
    """DLPack's device type codes for the backends accel has."""

    kDLCPU = 1
    kDLCUDA = 2
    kDLOneAPI = 14


#: DLPack's device type for each accel device type (the consumer reads it backwards).
DEVICE_TYPES: dict[str, DLDeviceType] = {"cpu": DLDeviceType.kDLCPU, "cuda": DLDeviceType.kDLCUDA, "xpu": DLDeviceType.kDLOneAPI}

# DLDataTypeCode values.
_INT, _UINT, _FLOAT, _BFLOAT, _COMPLEX, _BOOL = 0, 1, 2, 4, 5, 6

_DTYPES: dict[str, tuple[int, int]] = {
    "bool": (_BOOL, 8),
    "int8": (_INT, 8),
    "int16": (_INT, 16),
    "int32": (_INT, 32),
    "int64": (_INT, 64),
    "uint8": (_UINT, 8),
    "uint16": (_UINT, 16),
    "uint32": (_UINT, 32),
    "uint64": (_UINT, 64),
    "float16": (_FLOAT, 16),
    "float32": (_FLOAT, 32),
    "float64": (_FLOAT, 64),
    "bfloat16": (_BFLOAT, 16),
    "complex64": (_COMPLEX, 64),
    "complex128": (_COMPLEX, 128),
}


def dtype_from_name(name: str) -> tuple[int, int]:
    """``(DLPack type code, bits)`` of a dtype named like numpy or torch does.

    >>> dtype_from_name("float32")
    (2, 32)
    """
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise InvalidValueError(
            f"dtype {name!r} cannot be exported through DLPack by accel; use one of "
            + ", ".join(sorted(_DTYPES))
        ) from None


# -- the capsule ------------------------------------------------------------------
#
# Two C callbacks would normally tie an export's life to its consumer: the
# capsule's destructor (for a capsule never consumed) and the tensor's
# deleter (called by the consumer when done). Without a compiler, both can
# only be ctypes thunks into Python, and that has two traps:
#
# - A consumer may drop a capsule it refused with its error already set
#   (numpy for a device buffer); Python code run then loses that error and the
#   consumer fails with SystemError. So capsules get *no* destructor: the
#   registry keeps a reference to each capsule until a consumer renames it
#   ("used_dltensor"), and one nobody else references any more was never
#   consumed and is released by the next sweep (every export, every
#   ``live_exports()`` call and the free of an exported Buffer sweep).
# - A consumer may call the deleter during interpreter shutdown, after
#   module teardown freed a module-level thunk (a jump into freed memory).
#   So the one deleter thunk is leaked on purpose (it lives as long as the
#   process), and the function behind it reaches nothing through module
#   globals (teardown sets them to None) and does nothing while the
#   interpreter is finalizing: the process is ending, its memory with it.

_PyCapsule_New = ctypes.pythonapi["PyCapsule_New"]
_PyCapsule_New.restype = ctypes.py_object
_PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# A capsule keeps a pointer to its name for its whole life: bytes constants
# are never freed while referenced, and these are referenced by the leaked
# deleter's closure below.
_LEGACY_NAME = b"dltensor"
_VERSIONED_NAME = b"dltensor_versioned"


# One export's memory: the managed tensor, then its shape, then its strides
# (C-contiguous, in elements), filled by one ``struct.pack_into`` rather than
# field by field through ctypes (several times cheaper: a ctypes field set
# or cast costs about as much as the whole pack). The formats follow
# dlpack.h with native alignment; tests/_interop/test_dlpack.py checks them
# against the ctypes structures.
_DL_TENSOR = "P ii i BBH P P Q"  # data, device (type, id), ndim, dtype (code, bits, lanes), shape, strides, byte_offset
_LEGACY_HEAD = struct.Struct("@" + _DL_TENSOR + " P P")  # DLManagedTensor: dl_tensor, manager_ctx, deleter
_VERSIONED_HEAD = struct.Struct("@II P P Q " + _DL_TENSOR)  # version, manager_ctx, deleter, flags, dl_tensor


class _Layout:
    """How one kind of export of ``ndim`` dims is laid out in its memory."""

    __slots__ = ("pack", "memory_type", "shape_offset")

    def __init__(self, head: struct.Struct, ndim: int) -> None:
        self.pack = struct.Struct(head.format + " " + "q" * 2 * ndim).pack_into
        self.shape_offset = head.size
        # 64-bit words: the structures' alignment. A 0-d tensor still gets
        # a valid (never read) shape pointer.
        self.memory_type = ctypes.c_uint64 * (head.size // 8 + max(2 * ndim, 1))


# Layouts by (versioned, ndim); one for thousands of dims is made per call
# rather than kept for the life of the process.
_layouts: dict[tuple[bool, int], _Layout] = {}


def _layout(versioned: bool, ndim: int) -> _Layout:
    layout = _layouts.get((versioned, ndim))
    if layout is None:
        layout = _Layout(_VERSIONED_HEAD if versioned else _LEGACY_HEAD, ndim)
        if ndim <= 32:
            _layouts[versioned, ndim] = layout
    return layout


# No lock around these registries, on purpose: a deleter can run from the
# garbage collector at any allocation, including one made while a lock held
# here would be taken, and would then deadlock on it. Single dict operations
# are atomic, which is all they need.
# Exports by managed-tensor address: their memory (released with the entry)
# and the object that must outlive them.
_exports: dict[int, tuple[ctypes.Array[ctypes.c_uint64], object]] = {}
# Capsules handed out and not yet consumed, by managed-tensor address.
_unconsumed: dict[int, tuple[Any, bytes]] = {}


# A consumer that fails may call the deleter with its error still set (torch
# does, e.g. for a CUDA capsule in a CPU-only build). Python code run then
# fails at its first call ("returned a result with an exception set"): the
# export was never released and its memory never went back to the cache.
# Calling PyErr_Occurred through ctypes.pythonapi raises that pending error
# in the deleter, where it is caught. It cannot be handed back: a ctypes
# callback that returns with an error set has it reported and cleared, so the
# consumer raises SystemError. The deleter warns with the consumer's error.
_PyErr_Occurred = ctypes.pythonapi["PyErr_Occurred"]
_PyErr_Occurred.restype = ctypes.c_void_p
_PyErr_Occurred.argtypes = []


def _make_deleter() -> Any:
    exports, is_finalizing, take_pending = _exports, sys.is_finalizing, _PyErr_Occurred
    warn = warnings.warn

    def release(address: int | None) -> None:
        # Called by C code, once per export, from any thread. An error here
        # cannot reach the consumer; ctypes reports it through
        # sys.unraisablehook.
        try:
            take_pending()  # raises the error the consumer left set, if any
            failed = None
        except BaseException as error:
            failed = error
        if address and not is_finalizing():
            exports.pop(address, None)
            if failed is not None:
                warn(
                    f"a DLPack consumer failed with {failed!r} and released accel's export; the error "
                    "cannot pass through the deleter (a ctypes callback), so the consumer raises "
                    "SystemError instead",
                    RuntimeWarning,
                    stacklevel=1,
                )

    thunk = _Deleter(release)
    # Leaked on purpose (see above): a consumer may call it at any time
    # until the process ends.
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(thunk))
    return thunk


_deleter = _make_deleter()
_DELETER: int = ctypes.cast(_deleter, ctypes.c_void_p).value or 0  # its address, for the packed structures


def _make_sweeper() -> Callable[[], None]:
    # Like the deleter, reachable from finalizers (a Buffer's) at shutdown:
    # it reaches nothing through module globals.
    unconsumed, exports, is_valid = _unconsumed, _exports, _capsule_is_valid
    getrefcount, is_finalizing = sys.getrefcount, sys.is_finalizing

    def release_unconsumed() -> None:
        """Release the exports whose capsules died unconsumed; forget consumed ones."""
        if is_finalizing():
            return
        for address in list(unconsumed):
            entry = unconsumed.get(address)
            if entry is None:
                continue
            if not is_valid(entry[0], entry[1]):
                # Renamed: a consumer owns it and will call the deleter.
                unconsumed.pop(address, None)
            elif getrefcount(entry[0]) == 2:  # the registry's and the call's argument
                if unconsumed.pop(address, None) is not None:
                    exports.pop(address, None)

    return release_unconsumed


release_unconsumed = _make_sweeper()


def live_exports() -> int:
    """How many exported tensors still hold their owner (for tests and leak checks).

    Counts after releasing the exports of capsules that died unconsumed.
    """
    release_unconsumed()
    return len(_exports)


# -- devices and streams ---------------------------------------------------------


def dlpack_device(obj: Any) -> tuple[DLDeviceType, int]:
    """``__dlpack_device__`` of an accel buffer: ``(device type code, device index)``.

    >>> from accel._interop import dlpack_device
    >>> from accel import Device
    >>> class B: device = Device("cpu", 0)
    >>> dlpack_device(B())
    (<DLDeviceType.kDLCPU: 1>, 0)
    """
    if obj.__class__ is Buffer:
        # Read from its stream: building the Device object that
        # ``buffer.device`` returns costs most of a microsecond, on every export.
        stream = obj._stream
        return DEVICE_TYPES[stream._runtime.name], stream._device
    if isinstance(obj, HostBuffer):
        # Page-locked memory is host memory to consumers: torch refuses kDLCUDAHost
        # ("Unsupported device_type: 3"), numpy and torch read kDLCPU.
        return DLDeviceType.kDLCPU, 0
    device = getattr(obj, "device", None)
    kind = getattr(device, "type", None)
    index = getattr(device, "index", None)
    if kind not in DEVICE_TYPES or not isinstance(index, int):
        raise InvalidValueError(
            f"{type(obj).__name__}.device is {device!r}; DLPack export needs an accel.Device "
            "with a type of 'cpu', 'cuda' or 'xpu' and an index"
        )
    return DEVICE_TYPES[kind], index


def _producer_stream(obj: Any) -> Any:
    stream = getattr(obj, "stream", None)
    if not isinstance(stream, Stream):
        raise InvalidValueError(
            f"{type(obj).__name__}.stream is {stream!r}; DLPack export needs the accel.Stream "
            "the data was last written on"
        )
    return stream


def _consumer_stream(stream: object, producer: Any, kind: DLDeviceType) -> Any:
    """The accel Stream the consumer will use, or None to block the host instead.

    Returns ``False`` when the consumer asked for no synchronization (``-1``).
    """
    if isinstance(stream, Stream):
        return stream
    if stream is None:
        if kind == DLDeviceType.kDLCUDA:
            # The array API: None means the legacy default stream on CUDA.
            return producer._runtime.default_stream(producer.device_index)
        # The consumer reads from the host (numpy) or from a queue accel
        # cannot see: make the data ready before handing it out.
        return None
    if isinstance(stream, bool) or not (isinstance(stream, int) or hasattr(stream, "__cuda_stream__")):
        raise DLPackExportError(
            f"__dlpack__(stream={stream!r}): the stream must be None, -1, an int stream handle, "
            "an accel.Stream or an object with __cuda_stream__"
        )
    if not isinstance(stream, int):
        return as_stream(stream, producer.device)
    if stream == -1:
        return False
    if kind == DLDeviceType.kDLCPU:
        raise DLPackExportError(
            f"__dlpack__(stream={stream}): host buffers take stream=None (or -1, or an accel.Stream); "
            "an int handle names a device stream"
        )
    if kind == DLDeviceType.kDLCUDA:
        if stream == 0:
            raise DLPackExportError(
                "__dlpack__(stream=0) is ambiguous and disallowed by the array API; pass 1 for the "
                "legacy default stream, 2 for the per-thread default stream, or a stream handle"
            )
        if stream == 1:
            return producer._runtime.default_stream(producer.device_index)
    if stream < 0:
        raise DLPackExportError(f"__dlpack__(stream={stream}): a stream handle cannot be negative (only -1 is special)")
    return ExternalStream(stream, producer.device)


def synchronize(obj: Any, stream: object, kind: DLDeviceType) -> None:
    """Order the consumer after the work queued on the buffer's stream so far."""
    producer = _producer_stream(obj)
    consumer = _consumer_stream(stream, producer, kind)
    if consumer is None:
        wait_on_host(producer)
    elif consumer is not False and consumer != producer:
        if producer._closed:
            wait_on_host(producer)
        else:
            consumer.wait_stream(producer)


def wait_on_host(producer: Stream) -> None:
    """Block the host until the work queued on ``producer`` so far is done."""
    if producer._closed:
        # A closed stream takes no new work, not even an event, but finishes
        # what it had: wait for the device, which waits for it too.
        producer._runtime.backend.device_synchronize(producer.device_index)
    elif not producer.query():  # an idle stream has nothing to wait for (the common case, and cheap)
        producer.record_event().synchronize()


# -- export ------------------------------------------------------------------------


_INT64_MAX = (1 << 63) - 1


def as_shape(shape: object) -> tuple[int, ...]:
    """``shape`` (an int or a sequence of ints) as a tuple of non-negative ints."""
    if type(shape) is int and 0 <= shape <= _INT64_MAX:  # the common case, first
        return (shape,)
    if isinstance(shape, int) and not isinstance(shape, bool):
        shape = (shape,)
    try:
        dims: tuple[Any, ...] = tuple(shape)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidValueError(f"shape={shape!r} must be an int or a sequence of ints") from None
    # DLPack and torch hold dims as int64: a wider one was wrapped by ctypes or refused deep in torch.
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= _INT64_MAX for d in dims):
        raise InvalidValueError(f"shape={shape!r} must hold non-negative ints below 2**63")
    # A tensor with no elements needs no memory, but its strides (the products
    # of the dims after each, a zero counted as one) are int64 too: a wider one
    # failed in struct.pack or deep in torch ("numel: integer multiplication overflow").
    if 0 in dims and math.prod(d for d in dims if d) > _INT64_MAX:
        raise InvalidValueError(
            f"shape={dims} has no elements, but the product of its non-zero dims is not below 2**63 "
            "(DLPack and torch strides are int64); use smaller dims"
        )
    return dims


def read_shape(shape: object, itemsize: int, nbytes: int) -> tuple[int, ...]:
    if shape is None:
        if nbytes % itemsize:
            raise InvalidValueError(
                f"a {nbytes}-byte buffer is not a whole number of {itemsize}-byte items; pass a shape"
            )
        return (nbytes // itemsize,)
    dims = as_shape(shape)
    count = 1
    for dim in dims:
        count *= dim
    if count * itemsize > nbytes:
        raise InvalidValueError(
            f"shape {dims} of {itemsize}-byte items needs {count * itemsize} bytes, "
            f"but the buffer has {nbytes}"
        )
    return dims


def _wants_versioned(max_version: object) -> bool:
    if max_version is None:
        return False
    if (
        not isinstance(max_version, tuple)
        or len(max_version) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in max_version)
    ):
        raise DLPackExportError(f"max_version={max_version!r} must be a (major, minor) tuple of ints")
    major: int = max_version[0]  # checked to be an int above
    return major >= 1


def to_capsule(
    obj: Any,
    *,
    stream: object = None,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
    dtype: str = "uint8",
    shape: int | tuple[int, ...] | None = None,
) -> Any:
    """Export ``obj``'s memory as a DLPack capsule (the body of ``__dlpack__``).

    ``stream``, ``max_version``, ``dl_device`` and ``copy`` have the array
    API meaning. ``dtype`` (a name such as ``"float32"``) and ``shape``
    (default: the whole buffer, 1-D) describe the tensor; the buffer is
    exported C-contiguous with no copy. See the module docstring for a
    complete producer.
    """
    kind, index = dlpack_device(obj)
    _check_dl_device(dl_device, kind, index)
    versioned = _wants_versioned(max_version)
    ptr, nbytes = getattr(obj, "ptr", None), getattr(obj, "nbytes", None)
    if isinstance(ptr, bool) or not isinstance(ptr, int) or isinstance(nbytes, bool) or not isinstance(nbytes, int):
        raise InvalidValueError(
            f"{type(obj).__name__} has no int ptr and nbytes; DLPack export needs both"
        )
    code, bits = dtype_from_name(dtype)
    dims = read_shape(shape, bits // 8, nbytes)
    flags = 0  # writable, not a copy
    if copy:
        # The array API's copy=True: the consumer gets memory of its own, a
        # new buffer filled in the source's stream order, freed when the
        # consumer lets go of it.
        obj = _copy_of(obj, nbytes)
        ptr = obj.ptr
        flags = _FLAG_IS_COPIED
    synchronize(obj, stream, kind)
    # An accel Buffer is held through its lease, so that Buffer.free() while
    # the consumer reads waits for the consumer (the view never aliases new
    # memory); other producers are held themselves.
    owner = obj._export_lease() if isinstance(obj, Buffer) else obj
    return make_capsule(owner, ptr, (kind, index), code, bits, dims, versioned, flags)


def _check_dl_device(dl_device: tuple[int, int] | None, kind: DLDeviceType, index: int) -> None:
    """Refuse a ``dl_device`` the consumer asks for other than where the memory lives."""
    if dl_device is None:
        return
    try:
        wanted = (int(dl_device[0]), int(dl_device[1]))
    except (TypeError, ValueError, IndexError):
        raise DLPackExportError(f"dl_device={dl_device!r} must be a (device type, index) pair") from None
    if wanted != (int(kind), index):
        raise DLPackExportError(
            f"the buffer lives on DLPack device {(int(kind), index)}, not {wanted}; "
            "accel exports without copying, so copy it to that device first"
        )


def host_capsule(
    obj: HostBuffer,
    *,
    stream: object = None,
    max_version: tuple[int, int] | None = None,
    dl_device: tuple[int, int] | None = None,
    copy: bool | None = None,
) -> Any:
    """``HostBuffer.__dlpack__``: its bytes as a 1-D uint8 host tensor, held past
    ``obj.free()`` until the consumer lets go.

    A HostBuffer has no stream, so nothing is ordered: ``stream`` may be None,
    -1 or an accel Stream; an int handle names a device stream and is refused.
    """
    if not (stream is None or isinstance(stream, Stream) or (type(stream) is int and stream == -1)):
        raise DLPackExportError(
            f"__dlpack__(stream={stream!r}): host buffers take stream=None (or -1, or an accel.Stream); "
            "an int handle names a device stream"
        )
    kind, index = dlpack_device(obj)
    _check_dl_device(dl_device, kind, index)
    versioned = _wants_versioned(max_version)
    ptr, nbytes, flags = obj.ptr, obj.nbytes, 0
    if copy:
        copied = allocate_host(nbytes)  # page-locked too; freed when the consumer lets go
        ctypes.memmove(copied.ptr, ptr, nbytes)
        obj, ptr, flags = copied, copied.ptr, _FLAG_IS_COPIED
    code, bits = _DTYPES["uint8"]
    return make_capsule(obj._export_lease(), ptr, (kind, index), code, bits, (nbytes,), versioned, flags)


# DLPack 1.0's DLPACK_FLAG_BITMASK_IS_COPIED.
_FLAG_IS_COPIED = 1 << 1


def _copy_of(obj: Any, nbytes: int) -> Buffer:
    producer = _producer_stream(obj)
    if producer._closed:
        # Nothing more can be queued on it: copy on the device's current
        # stream once the device (the closed stream included) is idle.
        producer._runtime.backend.device_synchronize(producer.device_index)
        producer = producer._runtime.current_stream(producer.device_index)
    copy = allocate(max(nbytes, 1), stream=producer)
    producer.copy(copy, obj.ptr, nbytes)
    return copy


def make_capsule(
    owner: object,
    ptr: int,
    device: tuple[DLDeviceType, int],
    code: int,
    bits: int,
    dims: tuple[int, ...],
    versioned: bool,
    flags: int = 0,
) -> Any:
    """A capsule over ``ptr`` that keeps ``owner`` alive until the consumer is done.

    No checks and no stream synchronization: :func:`to_capsule` is the
    public way in.
    """
    release_unconsumed()
    ndim = len(dims)
    layout = _layout(versioned, ndim)
    memory = layout.memory_type()
    address = ctypes.addressof(memory)
    shape = address + layout.shape_offset
    strides, step = [], 1
    for dim in reversed(dims):
        strides.append(step)
        step *= max(dim, 1)
    strides.reverse()
    # DLPack 1.0: a tensor with no elements has a NULL data pointer.
    data = ptr if ptr and math.prod(dims) else 0
    # Strides are explicit rather than NULL ("compact"), a form every DLPack
    # version and consumer reads the same way.
    tensor = (data, int(device[0]), device[1], ndim, code, bits, 1, shape, shape + 8 * ndim, 0)
    if versioned:
        layout.pack(memory, 0, *DLPACK_VERSION, address, _DELETER, flags, *tensor, *dims, *strides)
        name = _VERSIONED_NAME
    else:
        layout.pack(memory, 0, *tensor, address, _DELETER, *dims, *strides)
        name = _LEGACY_NAME
    _exports[address] = (memory, owner)
    try:
        capsule = _PyCapsule_New(address, name, None)
    except BaseException:
        _exports.pop(address, None)
        raise
    _unconsumed[address] = (capsule, name)
    return capsule
