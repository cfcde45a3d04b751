"""The Level Zero loader before cffi: opening it, the first ``zeInit``, naming result codes.

On a machine with the loader but no GPU driver (Debian's ``libze1`` alone),
selecting a backend must not pay for importing cffi and parsing the Level
Zero declarations (about 50 ms) only to learn that ``zeInit`` fails: the
loader is first opened with ctypes (which ``import accel`` has already
loaded) and ``zeInit`` is called through it. Only when that succeeds are the
declarations parsed; the loader initializes once per process, so the second
``zeInit`` (through cffi) returns the first one's answer.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re

from accel._errors import BackendUnavailableError

__all__ = ["DEFAULT_LOADER", "cannot_open", "describe_result", "first_init", "loader_path", "not_a_loader",
           "result_name"]

#: The soname Debian's ``libze1`` installs (and Intel's packages too).
DEFAULT_LOADER = "libze_loader.so.1"
ZE_INIT_FLAG_GPU_ONLY = 1
#: Entry points every Level Zero loader exports.
LOADER_ENTRY_POINTS = ("zeInit", "zeDriverGet", "zeDeviceGet")

# Short explanations for the codes people meet; the header's comments are terser.
DESCRIPTIONS = {
    "ZE_RESULT_NOT_READY": "the work has not completed yet",
    "ZE_RESULT_ERROR_DEVICE_LOST": "the device hung or was reset; the process must restart its GPU work",
    "ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY": "the driver ran out of host memory",
    "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY": "the device is out of memory",
    "ZE_RESULT_ERROR_UNINITIALIZED": "no Level Zero driver is installed, or none initialized",
    "ZE_RESULT_ERROR_UNSUPPORTED_VERSION": "the driver does not support the requested API version",
    "ZE_RESULT_ERROR_UNSUPPORTED_FEATURE": "the driver does not implement this call",
    "ZE_RESULT_ERROR_INVALID_ARGUMENT": "an argument is invalid",
    "ZE_RESULT_ERROR_INVALID_NULL_HANDLE": "a handle is null or no longer valid",
    "ZE_RESULT_ERROR_INVALID_NULL_POINTER": "a required pointer is null",
    "ZE_RESULT_ERROR_INVALID_SIZE": "a size is zero or too large",
    "ZE_RESULT_ERROR_UNSUPPORTED_SIZE": "the size is larger than the device supports",
    "ZE_RESULT_ERROR_UNSUPPORTED_ALIGNMENT": "the alignment is not supported",
    "ZE_RESULT_ERROR_INVALID_ENUMERATION": "an enumeration value is invalid",
    "ZE_RESULT_ERROR_HANDLE_OBJECT_IN_USE": "the object is still in use by pending work",
}


@functools.cache
def _result_names() -> dict[int, str]:
    """``ze_result_t`` values to names, read from the declarations' text (no cffi needed)."""
    from accel.backends.xpu._cdef import CDEF

    block = CDEF[CDEF.index("typedef enum _ze_result_t"):CDEF.index("} ze_result_t;")]
    names: dict[int, str] = {}
    for name, value in re.findall(r"\b(ZE_RESULT_\w+) = (\w+)", block):
        names.setdefault(int(value, 0), name)
    return names


def result_name(code: int) -> str:
    """Symbolic ``ze_result_t`` name of ``code``.

    >>> result_name(0x78000001)
    'ZE_RESULT_ERROR_UNINITIALIZED'
    >>> result_name(0x7123)
    'ze_result_t 0x7123'
    """
    return _result_names().get(code) or f"ze_result_t {code:#x}"


def describe_result(code: int) -> str:
    """``NAME (0x...): explanation`` for messages.

    >>> describe_result(0x78000001)
    'ZE_RESULT_ERROR_UNINITIALIZED (0x78000001): no Level Zero driver is installed, or none initialized'
    """
    name = result_name(code)
    text = f"{name} ({code:#x})"
    description = DESCRIPTIONS.get(name)
    return f"{text}: {description}" if description else text


def loader_path() -> tuple[str, bool]:
    """``(path, from_env)``: ``ACCEL_ZE_LOADER`` if set, else the default soname."""
    explicit = os.environ.get("ACCEL_ZE_LOADER", "").strip()
    return explicit or DEFAULT_LOADER, bool(explicit)


def cannot_open(path: str, from_env: bool, message: str) -> BackendUnavailableError:
    """The error for a loader that dlopen refused with ``message``."""
    detail = message.splitlines()[0] if message else "dlopen failed"
    missing = "cannot open shared object file" in detail or "No such file" in detail
    if missing and from_env:
        reason = f"ACCEL_ZE_LOADER={path} not found: point it at libze_loader.so.1, or unset it"
    elif missing:
        reason = f"{path} not found: install Debian's libze1 (apt-get install libze1) or set ACCEL_ZE_LOADER"
    else:
        reason = f"cannot load {path}: {detail}"
    return BackendUnavailableError("xpu", reason)


def not_a_loader(path: str, name: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        "xpu", f"{path} does not export {name}: it is not a Level Zero loader (libze_loader.so.1)"
    )


def first_init(path: str, from_env: bool) -> None:
    """Open the loader with ctypes and call ``zeInit`` for GPUs; raise BackendUnavailableError
    when either fails. Costs no cffi import and no declarations."""
    try:
        loader = ctypes.CDLL(path)
    except OSError as exc:
        raise cannot_open(path, from_env, str(exc)) from None
    for name in LOADER_ENTRY_POINTS:
        if not hasattr(loader, name):
            raise not_a_loader(path, name)
    ze_init = loader.zeInit
    ze_init.restype = ctypes.c_uint32
    ze_init.argtypes = (ctypes.c_uint32,)
    code = ze_init(ZE_INIT_FLAG_GPU_ONLY)
    if code != 0:
        raise BackendUnavailableError("xpu", f"zeInit failed: {describe_result(code)}")
