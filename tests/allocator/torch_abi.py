"""torch's pluggable-allocator C ABI of :func:`accel.allocator.torch_allocator_spec`'s
library, bound with ctypes as torch calls it (calls that let the GIL go), for
tests/allocator/test_torch_allocator.py and the scripts it runs."""

from __future__ import annotations

import ctypes

from accel.allocator import torch_allocator_spec


def load() -> ctypes.CDLL:
    """The library, ``accel_torch_alloc`` and ``accel_torch_free`` typed."""
    path, alloc, free = torch_allocator_spec()
    abi = ctypes.CDLL(path)
    getattr(abi, alloc).restype = ctypes.c_void_p
    getattr(abi, alloc).argtypes = [ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    getattr(abi, free).argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int, ctypes.c_void_p]
    return abi
