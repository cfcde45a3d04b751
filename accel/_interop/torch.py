"""PyTorch interop: tensors on accel memory, and streams both ways.

torch is imported on first use only, so that ``import accel`` stays cheap
and torch stays an optional dependency.

- :func:`empty` allocates from accel's caching allocator and returns a
  tensor over that memory; when the tensor (and every view of it) dies, the
  memory goes back to accel's cache, not to the driver.
- :func:`as_tensor` views an existing accel buffer as a tensor, without a
  copy; the tensor keeps the buffer alive.

Streams map both ways through :meth:`accel.Stream.from_torch` and
:meth:`accel.Stream.to_torch`, in the stream layer.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from accel._device import DeviceLike
from accel._errors import InvalidValueError
from accel._interop import _dlpack
from accel._runtime import get_runtime
from accel._torch import import_torch
from accel.allocator import allocate
from accel.stream import Stream

if TYPE_CHECKING:
    import torch

__all__ = ["as_tensor", "empty"]



def _dtype_name(dtype: object) -> tuple[Any, str]:
    """The torch dtype and its DLPack name for a torch dtype or a name such as ``"float16"``."""
    torch = import_torch()
    if isinstance(dtype, str):
        resolved = getattr(torch, dtype, None)
        if not isinstance(resolved, torch.dtype):
            raise InvalidValueError(f"dtype={dtype!r} is not a torch dtype name; write e.g. 'float32' or torch.float32")
        dtype = resolved
    if not isinstance(dtype, torch.dtype):
        raise InvalidValueError(f"dtype={dtype!r} must be a torch.dtype or its name")
    name = str(dtype).removeprefix("torch.")
    _dlpack.dtype_from_name(name)  # refuses dtypes DLPack export does not cover
    return dtype, name


def _consumer_stream(device_type: str, index: int) -> object:
    """What torch will read on, in ``__dlpack__``'s terms (see accel._interop._dlpack)."""
    if device_type == "cuda":
        handle = import_torch().cuda.current_stream(index).cuda_stream
        return handle or 1  # 0 is ambiguous in DLPack; 1 is the legacy default stream
    return None  # host and xpu: make the data ready before torch sees it


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
    nbytes = math.prod(dims) * torch_dtype.itemsize
    if stream is None:
        runtime = get_runtime()
        if runtime.name == "cuda":
            index = runtime.index(device)
            stream = Stream.from_torch(import_torch().cuda.current_stream(index))
    # The allocator takes at least one byte; a zero-element tensor still gets
    # its (tiny) block so that it is accel memory like any other.
    buffer = allocate(max(nbytes, 1), device=device, stream=stream)
    # Legacy ("dltensor") capsules: every torch this package supports reads
    # them, while versioned DLPack 1.0 capsules need a recent torch.
    capsule = _dlpack.export_owned(buffer, dtype=name, shape=dims, on_release=buffer.free, versioned=False)
    return import_torch().from_dlpack(capsule)


def as_tensor(buffer: Any, dtype: torch.dtype | str = "uint8", shape: int | tuple[int, ...] | None = None) -> torch.Tensor:
    """View an accel buffer as a tensor of ``dtype`` and ``shape``, without a copy.

    ``shape`` defaults to the whole buffer, 1-D. Torch's current stream is
    ordered after the buffer's stream (on the host: the data is ready when
    this returns). The tensor keeps the buffer alive; freeing the buffer
    explicitly while the tensor is in use is the caller's mistake, as with
    any view.

    >>> import accel
    >>> buf = accel.memory.allocate(16)
    >>> accel.as_tensor(buf, "int32", (2, 2)).shape
    torch.Size([2, 2])
    """
    _, name = _dtype_name(dtype)
    dims = None if shape is None else _dlpack.as_shape(shape)
    _, index = _dlpack.dlpack_device(buffer)  # also checks buffer.device
    capsule = _dlpack.to_capsule(
        buffer,
        stream=_consumer_stream(buffer.device.type, index),
        max_version=None,  # legacy capsule, as in empty()
        dtype=name,
        shape=dims,
    )
    return import_torch().from_dlpack(capsule)
