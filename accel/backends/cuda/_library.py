"""Finding the CUDA driver library, before anything costly is imported.

On a machine without the driver, selecting a backend must not pay for
importing cffi and parsing the CUDA declarations (about 100 ms): the library
is first opened with ctypes (which ``import accel`` has already loaded), and
only a library that opens is bound with cffi. Both go through ``dlopen``, so
they find the same file, and the reason for a failure is the loader's own.
"""

from __future__ import annotations

import ctypes
import os

from accel._errors import BackendUnavailableError

__all__ = ["DEFAULT_LIBRARY", "cannot_load", "driver_path", "require_library"]

DEFAULT_LIBRARY = "libcuda.so.1"


def driver_path(path: str | None = None) -> tuple[str, str | None]:
    """``(target, explicit)``: what to dlopen, and the path the caller or ACCEL_CUDA_DRIVER gave, if any."""
    explicit = path if path is not None else os.environ.get("ACCEL_CUDA_DRIVER") or None
    return explicit or DEFAULT_LIBRARY, explicit


def _dlopen_detail(message: str, target: str) -> str:
    """The dynamic loader's own words from a dlopen error, on one line."""
    text = " ".join(message.split())
    prefix = f"cannot load library '{target}': "
    if text.startswith(prefix):  # cffi's wording
        text = text[len(prefix):]
    # cffi appends a second attempt through ctypes.util.find_library; the first error is the cause.
    text = text.split(" Additionally, ")[0]
    return text.rstrip(".") or "dlopen failed"


def cannot_load(target: str, explicit: str | None, message: str) -> BackendUnavailableError:
    """The error for a driver library that dlopen refused with ``message``."""
    if explicit:
        where = f"ACCEL_CUDA_DRIVER={explicit}"
    else:
        where = f"{DEFAULT_LIBRARY} (searched LD_LIBRARY_PATH, the ld.so cache and the default library directories)"
    return BackendUnavailableError(
        "cuda",
        f"cannot load the CUDA driver library {where}: {_dlopen_detail(message, target)}",
        remedy="Install the NVIDIA driver, or set ACCEL_CUDA_DRIVER to the path of libcuda.so.1",
    )


def require_library() -> None:
    """Raise BackendUnavailableError unless the driver library opens (no cffi involved)."""
    target, explicit = driver_path()
    try:
        ctypes.CDLL(target)
    except OSError as exc:
        raise cannot_load(target, explicit, str(exc)) from None
