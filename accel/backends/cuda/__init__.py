"""The CUDA backend: the Backend protocol over the CUDA driver API (``libcuda.so.1``).

Importing this package loads nothing; :func:`load` opens the driver
(``ACCEL_CUDA_DRIVER`` if set, else ``libcuda.so.1`` from the loader path),
calls ``cuInit`` and counts devices. Any failure is a
:class:`~accel.BackendUnavailableError` whose ``reason`` is one line.

>>> from accel.backends.cuda import load
>>> backend = load()            # doctest: +SKIP
>>> backend.device_properties(0).compute_capability   # doctest: +SKIP
(9, 0)
"""

from __future__ import annotations

from accel.backends.base import Backend

__all__ = ["load"]


def load() -> Backend:
    """Open the CUDA driver and return the backend (raises BackendUnavailableError)."""
    from accel.backends.cuda._library import require_library

    require_library()  # before cffi and the declarations are loaded: they cost ~100 ms
    from accel.backends.cuda._backend import create_backend

    return create_backend()
