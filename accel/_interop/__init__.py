"""Interop: accel memory and streams seen by torch, numpy, CuPy and friends.

- :mod:`accel._interop._dlpack`: the DLPack producer behind ``Buffer.__dlpack__``.
- :mod:`accel._interop._host`: ``HostBuffer``'s buffer protocol (views that keep memory alive).
- :mod:`accel._interop._cuda_array_interface`: ``Buffer.__cuda_array_interface__`` (CUDA).
- :mod:`accel._interop._consume`: ``accel.from_dlpack``, foreign memory as an accel buffer.
- :mod:`accel._interop.torch`: ``accel.empty`` and ``accel.as_tensor``.

This layer sits above the allocator and the streams: buffers reach their
exchange formats through :func:`accel.allocator._buffer.install_exports`, which this
package calls when it is imported: by a buffer's first export (through the loader
``accel`` gives the runtime) or by a name of ``accel`` that lives here. Nothing here
imports torch or numpy until a function that needs them is called.
"""

from accel._interop._consume import ForeignBuffer, from_dlpack
from accel._interop._cuda_array_interface import cuda_array_interface
from accel._interop._dlpack import (
    DLDeviceType, DLPackExportError, dlpack_device, host_capsule, release_unconsumed, to_capsule,
)
from accel._interop._host import host_memoryview
from accel._interop.torch import as_tensor, empty
from accel.allocator._buffer import install_exports

__all__ = [
    "DLDeviceType",
    "DLPackExportError",
    "ForeignBuffer",
    "as_tensor",
    "cuda_array_interface",
    "dlpack_device",
    "empty",
    "from_dlpack",
    "to_capsule",
]


class _BufferExports:
    """The exchange formats of accel buffers (see accel.allocator._buffer.BufferExports)."""

    to_capsule = staticmethod(to_capsule)
    dlpack_device = staticmethod(dlpack_device)
    host_capsule = staticmethod(host_capsule)
    host_memoryview = staticmethod(host_memoryview)
    cuda_array_interface = staticmethod(cuda_array_interface)
    release_unconsumed = staticmethod(release_unconsumed)


install_exports(_BufferExports())
