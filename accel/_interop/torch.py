"""PyTorch interop: tensors on accel memory, and streams both ways.

torch is imported on first use only, so that ``import accel`` stays cheap
and torch stays an optional dependency.

- :func:`empty` allocates from accel's caching allocator and returns a
  tensor over that memory; when the tensor (and every view of it) dies, the
  memory goes back to accel's cache, not to the driver.
- :func:`as_tensor` views an existing accel buffer as a tensor, without a
  copy; the tensor keeps the memory alive, even past ``buffer.free()``.

On the host backend both build the tensor with ``torch.frombuffer``; on
devices, through a DLPack capsule.

Streams map both ways through :meth:`accel.Stream.from_torch` and
:meth:`accel.Stream.to_torch`, in the stream layer.
"""

from __future__ import annotations

import math
import sys
from typing import TYPE_CHECKING, Any

from accel._device import Device, DeviceLike
from accel._errors import InvalidValueError, NotSupportedError
from accel._interop import _dlpack
from accel._native import speedups
from accel._interop._host import view_type as _view_type, view_types as _view_types
from accel._runtime import Runtime, get_runtime
from accel._torch import import_torch
from accel.allocator import Buffer, HostBuffer, allocate
from accel.stream import Stream

if TYPE_CHECKING:
    import torch
    from torch import Tensor  # the name, where a function's local `torch` is the module

__all__ = ["as_tensor", "empty"]

_INT64_MAX = (1 << 63) - 1  # torch and DLPack hold dims as int64


# Resolved dtypes, by what the caller passed (a torch dtype or a valid name):
# the torch dtype, its DLPack name, its size in bytes, its DLPack code and bits
# (the compiled empty reads them here).
_dtypes: dict[object, tuple[Any, str, int, int, int]] = {}


def _dtype_name(dtype: object) -> tuple[Any, str, int, int, int]:
    """The torch dtype, its DLPack name and its itemsize for a torch dtype or a name such as ``"float16"``."""
    try:
        return _dtypes[dtype]
    except (KeyError, TypeError):
        pass
    torch = import_torch()
    key = dtype
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise InvalidValueError(f"dtype={dtype!r} is not a torch dtype name; write e.g. 'float32' or torch.float32")
        dtype = resolved
    if not isinstance(dtype, torch.dtype):
        raise InvalidValueError(f"dtype={dtype!r} must be a torch.dtype or its name")
    name = str(dtype).removeprefix("torch.")
    code, bits = _dlpack.dtype_from_name(name)  # refuses dtypes DLPack export does not cover
    entry = _dtypes[key] = dtype, name, dtype.itemsize, code, bits
    return entry


# Device types this process's torch can hold tensors on, by torch device type.
_torch_devices: dict[str, bool] = {}


def _torch_type(runtime: Runtime) -> str:
    """torch's device type for the runtime's devices, as its backend declares it
    (the interop chooses by it, never by the backend's name)."""
    device_type = runtime.backend.torch_device_type
    if device_type is None:
        raise NotSupportedError(
            f"torch has no device type for the {runtime.name!r} backend's memory; export it to "
            "a DLPack consumer that reads this device"
        )
    return device_type


def _check_torch_holds(device_type: str) -> None:
    """Refuse, before any memory is taken, a device this torch build cannot hold tensors on.

    A CPU-only torch otherwise fails deep inside (an ``AssertionError`` from
    ``torch.cuda``, a ``RuntimeError`` from ``from_dlpack`` on xpu).
    """
    holds = _torch_devices.get(device_type)
    if holds is None:
        module = getattr(import_torch(), device_type, None)
        holds = _torch_devices[device_type] = bool(module is not None and module.is_available())
    if not holds:
        torch = import_torch()
        raise NotSupportedError(
            f"torch {torch.__version__} cannot hold tensors on {device_type} (it was built without "
            f"{device_type} support, or sees no {device_type} device); install a torch build for "
            f"{device_type}, or allocate with accel.memory.allocate and export it to a DLPack "
            "consumer that reads this device"
        )


def _consumer_stream(device_type: str, index: int) -> object:
    """What torch will read on, in ``__dlpack__``'s terms (see accel._interop._dlpack)."""
    if device_type == "cuda":
        handle = import_torch().cuda.current_stream(index).cuda_stream
        return handle or 1  # 0 is ambiguous in DLPack; 1 is the legacy default stream
    return None  # host and xpu: make the data ready before torch sees it


# Host memory reaches torch through the buffer protocol (torch.frombuffer),
# several times cheaper than a DLPack capsule built with ctypes (and than
# torch's own ``_from_blob``, which cannot hold an owner): a ctypes view that
# carries the object that must outlive the tensor (see accel._interop._host);
# torch keeps the view (through the Py_buffer it took) until the tensor's
# storage dies, whatever views, slices or further exports of it exist, and
# reads only ``count`` items of it.


# torch.frombuffer, looked up once: the per-call import and attribute
# lookup cost about a tenth of a microsecond, a tenth of the whole wrapping.
_frombuffer: Any = None


def _host_tensor(ptr: int, nbytes: int, owner: object, torch_dtype: Any, itemsize: int, dims: tuple[int, ...]) -> Tensor:
    """A CPU tensor of ``dims`` over ``nbytes`` at ``ptr`` that keeps ``owner`` alive."""
    global _frombuffer
    frombuffer = _frombuffer
    if frombuffer is None:
        frombuffer = _frombuffer = import_torch().frombuffer
    size = 1 << (nbytes - 1).bit_length()
    view = (_view_types.get(size) or _view_type(size)).from_address(ptr)
    view.owner = owner
    if len(dims) == 1:  # the common case first
        count = dims[0]
        if count * itemsize == size:  # ``count`` only when needed (a keyword costs)
            flat: Tensor = frombuffer(view, dtype=torch_dtype)
            return flat
        if count:
            flat = frombuffer(view, dtype=torch_dtype, count=count)
            return flat
    count = math.prod(dims)
    if not count:
        # frombuffer refuses zero items: view one, then none (the block has room for one).
        flat = frombuffer(view, dtype=torch_dtype, count=1)[:0]
    else:
        flat = frombuffer(view, dtype=torch_dtype, count=count)
    return flat.view(*dims) if dims else flat.view(dims)  # view(*dims) is the cheaper call; () needs the tuple


def empty(
    shape: int | tuple[int, ...],
    *,
    dtype: torch.dtype | str = "float32",
    device: DeviceLike = None,
    stream: Stream | None = None,
) -> torch.Tensor:
    """An uninitialised tensor on memory from accel's caching allocator.

    Allocated on ``stream``; by default, on CUDA, torch's current stream of
    the device (as torch's own allocator does, so that freeing is ordered
    after torch's work), elsewhere accel's current stream. When the tensor
    and all its views are gone, the memory returns to accel's cache in that
    stream's order.

    >>> import accel, torch
    >>> t = accel.empty((2, 3), dtype=torch.float32)
    >>> t.shape, t.dtype
    (torch.Size([2, 3]), torch.float32)
    """
    try:  # _dtype_name's cache, inline: this is the hot path
        torch_dtype, name, itemsize, code, bits = _dtypes[dtype]
    except (KeyError, TypeError):
        torch_dtype, name, itemsize, code, bits = _dtype_name(dtype)
    if shape.__class__ is int and 0 < shape <= _INT64_MAX:  # the common case, checked
        dims: tuple[int, ...] = (shape,)
        nbytes = shape * itemsize
    else:
        dims = _dlpack.as_shape(shape)
        # A zero-element tensor still gets a block of one item, so that it
        # is accel memory like any other.
        nbytes = max(math.prod(dims) * itemsize, itemsize)
    runtime = get_runtime()
    device_type = _torch_type(runtime)
    if device_type == "cpu":
        # The tensor holds the buffer: when the tensor dies, so does the
        # buffer, which gives the memory back.
        buffer = allocate(nbytes, device=device, stream=stream)
        if len(dims) != 1 or not dims[0] or _frombuffer is None:
            return _host_tensor(buffer.ptr, nbytes, buffer, torch_dtype, itemsize, dims)
        # _host_tensor for one non-empty dimension, inline (a fifth of the wrapping's cost).
        size = 1 << (nbytes - 1).bit_length()
        view = (_view_types.get(size) or _view_type(size)).from_address(buffer.ptr)
        view.owner = buffer
        if nbytes == size:
            tensor: Tensor = _frombuffer(view, dtype=torch_dtype)
        else:
            tensor = _frombuffer(view, dtype=torch_dtype, count=dims[0])
        return tensor
    _check_torch_holds(device_type)
    if stream is None and device_type == "cuda":
        index = runtime.index(device)
        stream = Stream.from_torch(import_torch().cuda.current_stream(index))
    buffer = allocate(nbytes, device=device, stream=stream)
    # Legacy ("dltensor") capsules: every torch this package supports reads
    # them, while versioned DLPack 1.0 capsules need a recent torch.
    capsule = _dlpack.make_capsule(
        buffer, buffer.ptr, _dlpack.dlpack_device(buffer), code, bits, dims, versioned=False
    )
    tensor = import_torch().from_dlpack(capsule)  # import_torch() is typed Any
    return tensor


def _not_accel_memory(obj: object) -> str:
    """Why as_tensor refuses ``obj``, and the torch call that does what was meant."""
    what = (
        "accel.as_tensor views accel memory (an accel Buffer, HostBuffer or ForeignBuffer), "
        f"and {type(obj).__name__} is not: "
    )
    if isinstance(obj, import_torch().Tensor):
        return what + "it is a tensor already (tensor.to(device) or accel.empty(...).copy_(tensor) moves it)"
    try:
        view = memoryview(obj)  # type: ignore[arg-type]  # probing the buffer protocol
    except TypeError:
        return what + "torch.as_tensor(obj) makes a tensor of data such as a list (a copy)"
    except (ValueError, BufferError) as exc:  # a buffer that cannot be exported (now)
        return what + f"its buffer cannot be viewed ({exc}); torch.as_tensor(obj) copies what torch can read"
    with view:
        readonly, contiguous = view.readonly, view.c_contiguous
    if not contiguous:
        how = "it is not contiguous, so torch.frombuffer cannot view it"
    elif readonly:
        how = "it is read-only, so view a writable copy: torch.frombuffer(bytearray(obj), dtype=...)"
    else:
        how = "torch.frombuffer(obj, dtype=...) views its bytes without a copy"
    return what + f"torch.as_tensor(obj) gives its values with its own dtype and shape; {how}"


def as_tensor(buffer: Any, dtype: torch.dtype | str = "uint8", shape: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """View an accel buffer as a tensor of ``dtype`` and ``shape``, without a copy.

    ``shape`` defaults to the whole buffer, 1-D. Torch's current stream is
    ordered after the buffer's stream (on the host: the data is ready when
    this returns). The tensor keeps the memory alive: after
    ``buffer.free()`` it goes back to the cache only once the tensor and its
    views are gone. A page-locked :class:`~accel.memory.HostBuffer` is a CPU
    tensor, as torch's pinned memory; it has no stream, so synchronize the
    copies that write it before reading. Its ``is_pinned()`` is False on a
    CPU-only torch, which has no way to register pinned memory:
    ``HostBuffer.page_locked`` tells instead.

    Only accel memory is viewed: an accel Buffer, a HostBuffer, or a DLPack
    exporter whose ``device`` is an :class:`accel.Device` (a ForeignBuffer).
    Other objects (bytes, bytearray, memoryview, array.array, numpy arrays,
    tensors, lists) are refused with the torch call that does what was
    probably meant: ``torch.as_tensor(obj)`` keeps an array's dtype and shape
    where this function's default reads bytes, and copies a list, which this
    function never does; ``torch.frombuffer(obj, dtype=...)`` views a writable
    buffer's bytes.

    >>> import accel
    >>> buf = accel.memory.allocate(16)
    >>> accel.as_tensor(buf, "int32", (2, 2)).shape
    torch.Size([2, 2])
    >>> accel.as_tensor(accel.memory.allocate_host(8), "float32").device
    device(type='cpu')
    >>> accel.as_tensor(b"abcd")
    Traceback (most recent call last):
    accel._errors.InvalidValueError: accel.as_tensor views accel memory (...), and bytes is not: ...
    """
    torch_dtype, name, itemsize, _, _ = _dtype_name(dtype)
    dims = None if shape is None else _dlpack.as_shape(shape)
    if isinstance(buffer, HostBuffer):
        # Page-locked host memory is a CPU tensor, as torch's pinned memory; it has no
        # stream to wait for (its copies are the caller's to synchronize).
        ptr, nbytes = buffer.ptr, buffer.nbytes
        dims = _dlpack.read_shape(dims, itemsize, nbytes)
        return _host_tensor(ptr, nbytes, buffer._export_lease(), torch_dtype, itemsize, dims)
    if isinstance(buffer, Buffer):
        device_type = _torch_type(buffer.stream._runtime)
        if device_type == "cpu":
            ptr, nbytes = buffer.ptr, buffer.nbytes
            dims = _dlpack.read_shape(dims, itemsize, nbytes)
            _dlpack.wait_on_host(buffer.stream)
            return _host_tensor(ptr, nbytes, buffer._export_lease(), torch_dtype, itemsize, dims)
    if not isinstance(getattr(buffer, "device", None), Device):
        raise InvalidValueError(_not_accel_memory(buffer))
    _, index = _dlpack.dlpack_device(buffer)  # also checks buffer.device
    if not isinstance(buffer, Buffer):
        device_type = buffer.device.type  # a DLPack exporter of accel's kind: torch's names
    _check_torch_holds(device_type)
    capsule = _dlpack.to_capsule(
        buffer,
        stream=_consumer_stream(device_type, index),
        max_version=None,  # legacy capsule, as in empty()
        dtype=name,
        shape=dims,
    )
    tensor: torch.Tensor = import_torch().from_dlpack(capsule)  # import_torch() is typed Any
    return tensor


# The compiled empty (accel/_speedups.c): on a host backend, the common case's tensor is
# torch's view of a DLPack capsule made in C over the core step's block (no Buffer, no
# ctypes view); every other case is the Python function above.
speedups.install_empty(sys.modules[__name__])
