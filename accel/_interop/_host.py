"""Host memory seen through Python's buffer protocol: ctypes views that keep an owner alive.

A ctypes array made ``from_address`` over accel's host memory is what the buffer
protocol can read (``torch.frombuffer``, ``memoryview``); its ``owner`` slot holds
the object that must outlive every view of it (a buffer's lease), because
whatever took a Py_buffer from the array (a tensor's storage, a memoryview)
keeps the array alive. Array types are made per power of two (each type lives
forever); readers take only the bytes they were told.

>>> import ctypes
>>> data = ctypes.create_string_buffer(b"accel", 5)
>>> view = byte_view(ctypes.addressof(data), 5, owner=data)
>>> bytes(view), view.readonly
(b'accel', False)
"""

from __future__ import annotations

import ctypes
from typing import Any

from accel.allocator import HostBuffer

__all__ = ["byte_view", "host_memoryview", "view_type", "view_types"]

#: The view array types made so far, by size in bytes (a power of two).
view_types: dict[int, Any] = {}


def view_type(size: int) -> Any:
    """The ctypes array type of ``size`` bytes (a power of two) with an ``owner`` slot."""
    made = view_types.get(size)
    if made is None:
        made = view_types.setdefault(
            size, type(f"accel_host_view_{size}", (ctypes.c_char * size,), {"__slots__": ("owner",)})
        )
    return made


def byte_view(ptr: int, nbytes: int, owner: object) -> memoryview:
    """A writable memoryview of the ``nbytes`` (> 0) at ``ptr``, unsigned bytes, that keeps ``owner`` alive."""
    size = 1 << (nbytes - 1).bit_length()
    view = (view_types.get(size) or view_type(size)).from_address(ptr)
    view.owner = owner
    return memoryview(view).cast("B")[:nbytes]  # the slice's .obj is still the array


def host_memoryview(buffer: HostBuffer) -> memoryview:
    """``HostBuffer.__buffer__``: its bytes, held past ``buffer.free()`` while the view lives."""
    return byte_view(buffer.ptr, buffer.nbytes, buffer._export_lease())
