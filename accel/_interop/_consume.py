"""A DLPack consumer: foreign memory (a torch tensor, a numpy array...) seen as an accel buffer.

:func:`from_dlpack` takes the producer's tensor (it renames the capsule, as
the protocol asks) and returns a :class:`ForeignBuffer`: ``ptr``, ``nbytes``,
``device`` and ``stream`` like an accel Buffer, so stream copies and fills,
``accel.as_tensor`` and a DLPack export of it all work. The producer's
deleter runs when the ForeignBuffer and everything derived from it are gone.

>>> import accel, numpy as np
>>> source = np.arange(4, dtype=np.int32)
>>> buf = accel.from_dlpack(source)
>>> buf.nbytes, buf.shape
(16, (4,))
"""

from __future__ import annotations

import ctypes
from typing import Any

from accel._device import Device
from accel._errors import InvalidHandleError, InvalidValueError
from accel._interop._dlpack import DEVICE_TYPES, DLDeviceType, DLPackExportError, to_capsule
from accel._runtime import get_runtime
from accel.stream import Stream
from accel.stream._dlpack_abi import read_capsule

__all__ = ["ForeignBuffer", "from_dlpack"]

_DEVICE_NAMES: dict[int, str] = {kind: name for name, kind in DEVICE_TYPES.items()}

_PyCapsule_SetName = ctypes.pythonapi["PyCapsule_SetName"]
_PyCapsule_SetName.restype = ctypes.c_int
_PyCapsule_SetName.argtypes = [ctypes.py_object, ctypes.c_void_p]

# A renamed capsule points at its new name for the rest of its life, which
# may reach past this module's teardown: the names are leaked on purpose.
_USED_NAMES = {b"dltensor": b"used_dltensor", b"dltensor_versioned": b"used_dltensor_versioned"}
for _name in _USED_NAMES.values():
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_name))


class ForeignBuffer:
    """Memory owned by another library, taken through DLPack (see :func:`from_dlpack`).

    ``ptr``, ``nbytes``, ``device`` and ``stream`` as on an accel Buffer;
    ``shape`` and ``readonly`` as the producer described them. ``free()``
    lets the producer go now (otherwise it happens when this object dies).
    """

    def __init__(self, managed: Any, ptr: int, nbytes: int, shape: tuple[int, ...], readonly: bool,
                 device: Device, stream: Stream) -> None:
        self._managed = managed
        self._ptr = ptr
        self.nbytes = nbytes
        self.shape = shape
        self.readonly = readonly
        self.device = device
        self.stream = stream

    @property
    def ptr(self) -> int:
        if self._managed is None:
            raise InvalidHandleError(f"{self!r} was freed")
        return self._ptr

    @property
    def freed(self) -> bool:
        return self._managed is None

    def free(self) -> None:
        """Give the memory back to its producer (a second call does nothing)."""
        managed, self._managed = self._managed, None
        if managed is not None and managed.deleter:
            managed.deleter(ctypes.addressof(managed))

    def __del__(self) -> None:
        self.free()

    def __dlpack__(self, *, stream: Any = None, max_version: tuple[int, int] | None = None,
                   dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> Any:
        """Export again, with accel's producer semantics (the array API's)."""
        return to_capsule(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self) -> tuple[int, int]:
        return DEVICE_TYPES[self.device.type], self.device.index or 0

    def __repr__(self) -> str:
        where = "freed" if self._managed is None else f"ptr={self._ptr:#x}"
        return f"accel.ForeignBuffer({where}, nbytes={self.nbytes}, shape={self.shape}, device={self.device})"


def _consumer_stream_arg(kind: int, stream: Stream) -> object:
    if kind == DLDeviceType.kDLCUDA:
        return stream.native_handle or 1  # 0 is ambiguous in DLPack; 1 is the legacy default stream
    return None  # the host, and queues the producer cannot name: it makes the data ready


def from_dlpack(x: Any) -> ForeignBuffer:
    """View a DLPack producer's memory (a torch tensor, a numpy array, a capsule...) as an accel buffer.

    No copy is made. The memory must be on the active backend's device kind
    (host memory on the host backend, CUDA memory on CUDA...), C-contiguous.
    The producer orders its work before accel's current stream of that
    device, which becomes the buffer's stream.

    >>> import accel, torch
    >>> tensor = torch.zeros(8, dtype=torch.uint8)
    >>> view = accel.from_dlpack(tensor)
    >>> accel.current_stream().fill(view, 1); accel.synchronize()
    >>> int(tensor.sum())
    8
    """
    runtime = get_runtime()
    if hasattr(x, "__dlpack__"):
        try:
            kind, index = x.__dlpack_device__()
        except Exception as exc:  # the producer's own error, whatever its type
            raise InvalidValueError(f"{type(x).__name__}.__dlpack_device__() failed: {exc}") from exc
        name = _DEVICE_NAMES.get(kind)
        if name is None or name != runtime.name:
            raise DLPackExportError(
                f"{type(x).__name__} lives on DLPack device ({kind}, {index}); accel's active backend is "
                f"{runtime.name!r}: copy it to {runtime.name} memory first"
            )
        stream = runtime.current_stream(index)
        try:
            try:
                capsule = x.__dlpack__(stream=_consumer_stream_arg(kind, stream), max_version=(1, 0))
            except TypeError:  # a producer older than DLPack 1.0
                capsule = x.__dlpack__(stream=_consumer_stream_arg(kind, stream))
        except Exception as exc:
            raise InvalidValueError(f"{type(x).__name__} refused a DLPack export: {type(exc).__name__}: {exc}") from exc
    else:
        capsule, stream = x, None
    tensor = read_capsule(capsule)
    if tensor is None:
        raise InvalidValueError(
            f"from_dlpack takes a DLPack producer (an object with __dlpack__) or an unused DLPack capsule, "
            f"not {type(x).__name__}"
        )
    if _DEVICE_NAMES.get(tensor.device_type) != runtime.name:
        raise DLPackExportError(
            f"the capsule's tensor lives on DLPack device ({tensor.device_type}, {tensor.device_id}); "
            f"accel's active backend is {runtime.name!r}"
        )
    if not tensor.contiguous:
        raise InvalidValueError("from_dlpack needs a C-contiguous tensor; pass x.contiguous() or a copy")
    # Taken: from here on the deleter is ours to call.
    _PyCapsule_SetName(capsule, ctypes.cast(ctypes.c_char_p(_USED_NAMES[tensor.name]), ctypes.c_void_p))
    if stream is None:
        stream = runtime.current_stream(tensor.device_id)
    return ForeignBuffer(
        tensor.managed, tensor.ptr, tensor.nbytes, tensor.shape, tensor.readonly, runtime.device(tensor.device_id), stream
    )
