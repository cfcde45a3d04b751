"""Reading the memory operands of stream copies and fills.

An operand is an int address, an object with ``ptr`` (and ``nbytes``), such as
accel's own buffers, or an array speaking ``__array_interface__`` /
``__cuda_array_interface__`` (numpy, CuPy, torch tensors through numpy...).
Python objects that own the memory are kept alive until the work ran.
"""

from __future__ import annotations

from dataclasses import dataclass

from accel._errors import InvalidValueError


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
    raise InvalidValueError(
        f"{role} ({type(obj).__name__}) is not memory: pass an address (int), an accel buffer, "
        "or an array with __array_interface__ / __cuda_array_interface__"
    )


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
