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

import ctypes
import math
from typing import TYPE_CHECKING, Any

from accel._device import DeviceLike
from accel._errors import InvalidValueError
from accel._interop import _dlpack
from accel._runtime import get_runtime
from accel._torch import import_torch
from accel.allocator import Buffer, allocate
from accel.stream import Stream

if TYPE_CHECKING:
    import torch
    from torch import Tensor  # the name, where a function's local `torch` is the module

__all__ = ["as_tensor", "empty"]


# Resolved dtypes, by what the caller passed (a torch dtype or a valid name).
_dtypes: dict[object, tuple[Any, str]] = {}


def _dtype_name(dtype: object) -> tuple[Any, str]:
    """The torch dtype and its DLPack name for a torch dtype or a name such as ``"float16"``."""
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
    _dlpack.dtype_from_name(name)  # refuses dtypes DLPack export does not cover
    _dtypes[key] = dtype, name
    return dtype, name


def _consumer_stream(device_type: str, index: int) -> object:
    """What torch will read on, in ``__dlpack__``'s terms (see accel._interop._dlpack)."""
    if device_type == "cuda":
        handle = import_torch().cuda.current_stream(index).cuda_stream
        return handle or 1  # 0 is ambiguous in DLPack; 1 is the legacy default stream
    return None  # host and xpu: make the data ready before torch sees it


# Host memory reaches torch through the buffer protocol (torch.frombuffer),
# several times cheaper than a DLPack capsule built with ctypes. The ctypes
# array carries the object that must outlive the tensor; torch keeps the
# array until the tensor's storage dies. Array types are made per power of
# two (ctypes caches every array type forever); torch reads only ``count``
# items of it.
class _HostView:
    types: dict[int, Any] = {}

    @classmethod
    def over(cls, ptr: int, nbytes: int, owner: object) -> Any:
        size = 1 << (nbytes - 1).bit_length()
        array_type = cls.types.get(size)
        if array_type is None:
            array_type = cls.types.setdefault(
                size, type(f"accel_host_view_{size}", (ctypes.c_char * size,), {"__slots__": ("owner",)})
            )
        view = array_type.from_address(ptr)
        view.owner = owner
        return view


def _host_tensor(ptr: int, nbytes: int, owner: object, torch_dtype: Any, dims: tuple[int, ...]) -> torch.Tensor:
    """A CPU tensor of ``dims`` over ``nbytes`` at ``ptr`` that keeps ``owner`` alive."""
    torch = import_torch()
    count = math.prod(dims)
    itemsize = torch_dtype.itemsize
    if not count:
        # frombuffer refuses zero items: view one, then none (the block has room for one).
        flat: Tensor = torch.frombuffer(_HostView.over(ptr, nbytes, owner), dtype=torch_dtype, count=1)[:0]
        return flat.view(*dims)
    view = _HostView.over(ptr, nbytes, owner)
    # ``count`` only when the view is longer than the tensor (a keyword costs).
    if count * itemsize == len(view):
        flat = torch.frombuffer(view, dtype=torch_dtype)
    else:
        flat = torch.frombuffer(view, dtype=torch_dtype, count=count)
    if len(dims) == 1:
        return flat
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
    torch_dtype, name = _dtype_name(dtype)
    dims = _dlpack.as_shape(shape)
    itemsize = torch_dtype.itemsize
    nbytes = math.prod(dims) * itemsize
    runtime = get_runtime()
    if stream is None and runtime.name == "cuda":
        index = runtime.index(device)
        stream = Stream.from_torch(import_torch().cuda.current_stream(index))
    # A zero-element tensor still gets a block of one item, so that it is
    # accel memory like any other.
    buffer = allocate(max(nbytes, itemsize), device=device, stream=stream)
    # The tensor holds the buffer: when the tensor dies, so does the buffer,
    # which gives the memory back.
    if runtime.name == "cpu":
        return _host_tensor(buffer.ptr, buffer.nbytes, buffer, torch_dtype, dims)
    code, bits = _dlpack.dtype_from_name(name)
    # Legacy ("dltensor") capsules: every torch this package supports reads
    # them, while versioned DLPack 1.0 capsules need a recent torch.
    capsule = _dlpack.make_capsule(
        buffer, buffer.ptr, _dlpack.dlpack_device(buffer), code, bits, dims, versioned=False
    )
    tensor: torch.Tensor = import_torch().from_dlpack(capsule)  # import_torch() is typed Any
    return tensor


def as_tensor(buffer: Any, dtype: torch.dtype | str = "uint8", shape: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """View an accel buffer as a tensor of ``dtype`` and ``shape``, without a copy.

    ``shape`` defaults to the whole buffer, 1-D. Torch's current stream is
    ordered after the buffer's stream (on the host: the data is ready when
    this returns). The tensor keeps the memory alive: after
    ``buffer.free()`` it goes back to the cache only once the tensor and its
    views are gone.

    >>> import accel
    >>> buf = accel.memory.allocate(16)
    >>> accel.as_tensor(buf, "int32", (2, 2)).shape
    torch.Size([2, 2])
    """
    torch_dtype, name = _dtype_name(dtype)
    dims = None if shape is None else _dlpack.as_shape(shape)
    if isinstance(buffer, Buffer) and buffer.stream._runtime.name == "cpu":
        ptr, nbytes = buffer.ptr, buffer.nbytes
        dims = _dlpack.read_shape(dims, torch_dtype.itemsize, nbytes)
        _dlpack.synchronize(buffer, None, _dlpack.DLDeviceType.kDLCPU)
        return _host_tensor(ptr, nbytes, buffer._export_lease(), torch_dtype, dims)
    _, index = _dlpack.dlpack_device(buffer)  # also checks buffer.device
    capsule = _dlpack.to_capsule(
        buffer,
        stream=_consumer_stream(buffer.device.type, index),
        max_version=None,  # legacy capsule, as in empty()
        dtype=name,
        shape=dims,
    )
    tensor: torch.Tensor = import_torch().from_dlpack(capsule)  # import_torch() is typed Any
    return tensor
