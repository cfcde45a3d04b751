"""Reading the memory operands of stream copies and fills.

An operand is an int address, an object with ``ptr`` (and ``nbytes``), such as
accel's own buffers, an array speaking ``__array_interface__`` /
``__cuda_array_interface__`` (numpy, CuPy...), any DLPack producer (torch
tensors, JAX arrays...) or any object with the buffer protocol
(``bytearray``, ``memoryview``, ``array.array``; ``bytes`` as a source).
Python objects that own the memory are kept alive until the work ran.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from accel._errors import InvalidValueError
from accel.stream._dlpack_abi import read_capsule


@dataclass(frozen=True)
class Operand:
    ptr: int
    nbytes: int | None  # None when the caller passed a bare address
    owner: object  # what must stay alive until the work ran (None for bare ints)


def operand(obj: object, role: str) -> Operand:
    if isinstance(obj, bool):
        raise InvalidValueError(f"{role}={obj!r} is not memory")
    if isinstance(obj, int):
        if obj <= 0:
            raise InvalidValueError(f"{role}={obj:#x} is not a valid address")
        return Operand(obj, None, None)
    ptr = getattr(obj, "ptr", None)
    if isinstance(ptr, int) and not isinstance(ptr, bool):
        nbytes = getattr(obj, "nbytes", None)
        return Operand(ptr, nbytes if isinstance(nbytes, int) else None, obj)
    for attr in ("__cuda_array_interface__", "__array_interface__"):
        interface = getattr(obj, attr, None)
        if isinstance(interface, dict) and "data" in interface:
            nbytes = getattr(obj, "nbytes", None)
            if role == "dst" and interface["data"][1]:
                raise InvalidValueError(f"{role} is a read-only array; copy into a writable one")
            strides = interface.get("strides")
            if strides is not None:
                raise InvalidValueError(
                    f"{role} is a strided (non-contiguous) array; pass a contiguous one"
                )
            return Operand(int(interface["data"][0]), nbytes if isinstance(nbytes, int) else None, obj)
    if hasattr(obj, "__dlpack__"):
        return _dlpack_operand(obj, role)
    try:
        view = memoryview(obj)  # type: ignore[arg-type]
    except TypeError:
        pass
    else:
        return _buffer_operand(view, obj, role)
    raise InvalidValueError(
        f"{role} ({type(obj).__name__}) is not memory: pass an address (int), an accel buffer, "
        "an array with __array_interface__ / __cuda_array_interface__, a DLPack producer "
        "(a torch tensor...) or an object with the buffer protocol (bytearray, memoryview...)"
    )


class _PyBuffer(ctypes.Structure):
    """CPython's Py_buffer (only ``buf`` and ``len`` are read)."""

    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_PyObject_GetBuffer = ctypes.pythonapi["PyObject_GetBuffer"]
_PyObject_GetBuffer.restype = ctypes.c_int
_PyObject_GetBuffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_PyBuffer_Release = ctypes.pythonapi["PyBuffer_Release"]
_PyBuffer_Release.restype = None
_PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
_PyBUF_SIMPLE = 0  # a contiguous block of bytes


def _buffer_operand(view: memoryview, obj: object, role: str) -> Operand:
    if not view.contiguous:
        raise InvalidValueError(f"{role} is a strided (non-contiguous) buffer; pass a contiguous one")
    if role == "dst" and view.readonly:
        raise InvalidValueError(f"{role} ({type(obj).__name__}) is read-only; pass a writable buffer (bytearray...)")
    raw = _PyBuffer()
    _PyObject_GetBuffer(view, ctypes.byref(raw), _PyBUF_SIMPLE)
    ptr = raw.buf
    _PyBuffer_Release(ctypes.byref(raw))
    # The memoryview is the owner kept alive: while it lives, the object's
    # memory stays where it is (a bytearray cannot be resized under it).
    return Operand(ptr or 0, view.nbytes, view)


def _dlpack_operand(obj: Any, role: str) -> Operand:
    """Read a DLPack producer's tensor without consuming its capsule: the
    capsule is kept alive with the work, and its own destructor lets the
    producer go afterwards."""
    try:
        try:
            capsule = obj.__dlpack__(max_version=(1, 0))
        except TypeError:  # a producer older than DLPack 1.0
            capsule = obj.__dlpack__()
    except Exception as exc:  # the producer's own refusal, whatever its type
        raise InvalidValueError(
            f"{role} ({type(obj).__name__}) refused a DLPack export: {type(exc).__name__}: {exc}"
        ) from exc
    tensor = read_capsule(capsule)
    if tensor is None:
        raise InvalidValueError(f"{role} ({type(obj).__name__}).__dlpack__() did not return a DLPack capsule")
    if role == "dst" and tensor.readonly:
        raise InvalidValueError(f"{role} ({type(obj).__name__}) is read-only; copy into a writable one")
    if not tensor.contiguous:
        raise InvalidValueError(f"{role} is a strided (non-contiguous) tensor; pass a contiguous one (.contiguous())")
    return Operand(tensor.ptr, tensor.nbytes, (obj, capsule))


def byte_count(nbytes: int | None, *operands: Operand) -> int:
    """The number of bytes to touch: ``nbytes`` checked against every operand's size."""
    sizes = [op.nbytes for op in operands if op.nbytes is not None]
    if nbytes is None:
        if not sizes:
            raise InvalidValueError("nbytes is required when both operands are bare addresses")
        nbytes = min(sizes)
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise InvalidValueError(f"nbytes={nbytes!r} must be a non-negative int")
    for op in operands:
        if op.nbytes is not None and nbytes > op.nbytes:
            raise InvalidValueError(
                f"nbytes={nbytes} is past the end of a {op.nbytes}-byte operand at {op.ptr:#x}"
            )
    return nbytes
