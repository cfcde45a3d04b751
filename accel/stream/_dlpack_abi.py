"""DLPack's C structures (dlpack.h, v1.0), as ctypes types.

Shared by the producer (:mod:`accel._interop._dlpack`), the consumer
(:mod:`accel._interop._consume`) and the stream layer, which reads the
tensors that DLPack producers hand to copies and fills: all of them read a
capsule with :func:`read_capsule`.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

__all__ = [
    "CAPSULE_NAMES",
    "CapsuleTensor",
    "DLDataType",
    "DLDevice",
    "DLManagedTensor",
    "DLManagedTensorVersioned",
    "DLPackVersion",
    "DLTensor",
    "Deleter",
    "FLAG_READ_ONLY",
    "capsule_is_valid",
    "read_capsule",
]

#: DLPACK_FLAG_BITMASK_READ_ONLY
FLAG_READ_ONLY = 1


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


# Both managed-tensor deleters take a pointer to the struct; one C signature
# serves both.
Deleter = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", Deleter)]


class DLPackVersion(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32)]


class DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [
        ("version", DLPackVersion),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", Deleter),
        ("flags", ctypes.c_uint64),
        ("dl_tensor", DLTensor),
    ]


_PyCapsule_IsValid = ctypes.pythonapi["PyCapsule_IsValid"]
_PyCapsule_IsValid.restype = ctypes.c_int
_PyCapsule_IsValid.argtypes = [ctypes.py_object, ctypes.c_char_p]
_PyCapsule_GetPointer = ctypes.pythonapi["PyCapsule_GetPointer"]
_PyCapsule_GetPointer.restype = ctypes.c_void_p
_PyCapsule_GetPointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

#: The capsule names of an unused DLPack tensor, newest protocol first.
CAPSULE_NAMES = (b"dltensor_versioned", b"dltensor")


def capsule_is_valid(capsule: object, name: bytes) -> bool:
    """Whether ``capsule`` is a capsule named ``name`` (False for any other object)."""
    return bool(_PyCapsule_IsValid(capsule, name))


@dataclass(frozen=True)
class CapsuleTensor:
    """The tensor an unused DLPack capsule holds, read without consuming it."""

    name: bytes  # which of CAPSULE_NAMES the capsule has
    managed: DLManagedTensor | DLManagedTensorVersioned
    ptr: int  # data + byte_offset
    shape: tuple[int, ...]
    nbytes: int
    readonly: bool
    device_type: int
    device_id: int
    contiguous: bool  # C-contiguous (strides of size-1 dimensions do not count)


def read_capsule(capsule: object) -> CapsuleTensor | None:
    """The tensor in ``capsule``, or None when it is not an unused DLPack capsule."""
    managed: DLManagedTensor | DLManagedTensorVersioned
    if _PyCapsule_IsValid(capsule, CAPSULE_NAMES[0]):
        name = CAPSULE_NAMES[0]
        managed = DLManagedTensorVersioned.from_address(_PyCapsule_GetPointer(capsule, name))
        readonly = bool(managed.flags & FLAG_READ_ONLY)
    elif _PyCapsule_IsValid(capsule, CAPSULE_NAMES[1]):
        name = CAPSULE_NAMES[1]
        managed = DLManagedTensor.from_address(_PyCapsule_GetPointer(capsule, name))
        readonly = False
    else:
        return None
    tensor = managed.dl_tensor
    shape = tuple(tensor.shape[i] for i in range(tensor.ndim))
    contiguous = True
    if tensor.strides and math.prod(shape):
        expected = 1
        for dim, stride in zip(reversed(shape), reversed([tensor.strides[i] for i in range(tensor.ndim)])):
            if dim != 1 and stride != expected:
                contiguous = False
                break
            expected *= dim
    return CapsuleTensor(
        name=name,
        managed=managed,
        ptr=(tensor.data or 0) + tensor.byte_offset,
        shape=shape,
        nbytes=math.prod(shape) * tensor.dtype.bits * tensor.dtype.lanes // 8,
        readonly=readonly,
        device_type=tensor.device.device_type,
        device_id=tensor.device.device_id,
        contiguous=contiguous,
    )
