"""PyTorch interop: tensors on accel memory, and streams both ways.

torch is imported on first use only, so that ``import accel`` stays cheap
and torch stays an optional dependency.

- :func:`empty` allocates from accel's caching allocator and returns a
  tensor over that memory; when the tensor (and every view of it) dies, the
  memory goes back to accel's cache, not to the driver.
- :func:`as_tensor` views an existing accel buffer as a tensor, without a
  copy; the tensor keeps the buffer alive.
- :func:`stream_from_torch` / :func:`stream_to_torch` map streams: on CUDA
  the same ``CUstream`` seen from both sides (torch's ``ExternalStream``);
  on the host backend torch's CPU stream, which like accel's host default
  stream runs work inline on the calling thread.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from accel._device import DeviceLike
from accel._errors import DeviceError, InvalidValueError, NotSupportedError
from accel._interop import _dlpack

if TYPE_CHECKING:
    import torch

    from accel.stream._stream import Stream

__all__ = ["as_tensor", "empty", "stream_from_torch", "stream_to_torch"]


def _torch() -> Any:
    try:
        import torch
    except ImportError:
        raise NotSupportedError(
            "this needs PyTorch, which is not installed; install it with `pip install accel[torch]`"
        ) from None
    return torch


def _dtype_name(dtype: object) -> tuple[Any, str]:
    """The torch dtype and its DLPack name for a torch dtype or a name such as ``"float16"``."""
    torch = _torch()
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
        handle = _torch().cuda.current_stream(index).cuda_stream
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
    from accel import memory

    torch_dtype, name = _dtype_name(dtype)
    dims = _dlpack.as_shape(shape)
    nbytes = math.prod(dims) * torch_dtype.itemsize
    if stream is None:
        from accel._runtime import get_runtime

        runtime = get_runtime()
        if runtime.name == "cuda":
            index = runtime.index(device)
            stream = stream_from_torch(_torch().cuda.current_stream(index))
    # The allocator takes at least one byte; a zero-element tensor still gets
    # its (tiny) block so that it is accel memory like any other.
    buffer = memory.allocate(max(nbytes, 1), device=device, stream=stream)
    # Legacy ("dltensor") capsules: every torch this package supports reads
    # them, while versioned DLPack 1.0 capsules need a recent torch.
    capsule = _dlpack.export_owned(buffer, dtype=name, shape=dims, on_release=buffer.free, versioned=False)
    return _torch().from_dlpack(capsule)


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
    return _torch().from_dlpack(capsule)


def stream_from_torch(torch_stream: Any) -> Stream:
    """The accel Stream for a torch stream (``torch.cuda.Stream``, ``torch.Stream``).

    CUDA: an :class:`accel.ExternalStream` over the same ``CUstream``. CPU:
    the host backend's default stream of the current device, which runs work
    inline like torch's CPU stream.

    >>> import accel, torch
    >>> accel.Stream.from_torch(torch.Stream("cpu")) == accel.current_stream()
    True
    """
    from accel._runtime import get_runtime
    from accel.stream._stream import ExternalStream

    torch = _torch()
    if not isinstance(torch_stream, torch.Stream) and not hasattr(torch_stream, "__cuda_stream__"):
        raise InvalidValueError(
            f"{torch_stream!r} ({type(torch_stream).__name__}) is not a torch stream; "
            "pass a torch.Stream or torch.cuda.Stream"
        )
    device = getattr(torch_stream, "device", None)
    kind = getattr(device, "type", "cuda")
    runtime = get_runtime()
    if kind != runtime.name:
        raise DeviceError(
            f"{torch_stream!r} is a {kind} stream, but the current accelerator is {runtime.name!r}"
        )
    if kind == "cpu":
        return runtime.default_stream(runtime.current_index)
    if kind == "cuda":
        if hasattr(torch_stream, "__cuda_stream__"):
            _, handle = torch_stream.__cuda_stream__()
        else:
            handle = torch_stream.native_handle
        return ExternalStream(int(handle), getattr(device, "index", None))
    raise NotSupportedError(
        f"accel cannot share {kind} streams with torch: torch's XPU streams are SYCL queues, "
        "accel's are Level Zero command lists. Order work across them with synchronize()"
    )


def stream_to_torch(stream: Stream) -> Any:
    """The torch stream for an accel Stream.

    CUDA: ``torch.cuda.ExternalStream`` over the same ``CUstream``. Host:
    torch's CPU stream; torch CPU work runs inline on the calling thread, so
    synchronize a non-default accel host stream before torch reads its
    results.

    >>> import accel
    >>> accel.current_stream().to_torch()
    torch.Stream device_type=cpu, device_index=-1, stream_id=0
    """
    from accel.stream._stream import Stream

    if not isinstance(stream, Stream):
        raise InvalidValueError(f"{stream!r} is not an accel.Stream")
    torch = _torch()
    kind = stream.device.type
    if kind == "cpu":
        return torch.Stream("cpu")
    if kind == "cuda":
        return torch.cuda.ExternalStream(stream.native_handle, device=torch.device("cuda", stream.device_index))
    raise NotSupportedError(
        f"accel cannot share {kind} streams with torch: torch's XPU streams are SYCL queues, "
        "accel's are Level Zero command lists. Order work across them with synchronize()"
    )
