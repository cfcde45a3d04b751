"""Interop: accel memory and streams seen by torch, numpy, CuPy and friends.

- :mod:`accel._interop._dlpack`: the DLPack producer behind ``Buffer.__dlpack__``.
- :mod:`accel._interop._cuda_array_interface`: ``Buffer.__cuda_array_interface__`` (CUDA).
- :mod:`accel._interop.torch`: ``accel.empty``, ``accel.as_tensor`` and stream mapping.

Nothing here imports torch or numpy until a function that needs them is called.
"""

from accel._interop._cuda_array_interface import cuda_array_interface
from accel._interop._dlpack import DLDeviceType, DLPackExportError, dlpack_device, to_capsule
from accel._interop.torch import as_tensor, empty, stream_from_torch, stream_to_torch

__all__ = [
    "DLDeviceType",
    "DLPackExportError",
    "as_tensor",
    "cuda_array_interface",
    "dlpack_device",
    "empty",
    "stream_from_torch",
    "stream_to_torch",
    "to_capsule",
]
