"""accel's exception hierarchy.

Every error accel raises on purpose is an :class:`AccelError`. Messages name
the device, the call and what to do next, so that a log line alone is enough
to act on.
"""

from __future__ import annotations

import os
import sys
import warnings
from types import FrameType

__all__ = [
    "AccelError",
    "AllocatorConfigError",
    "BackendUnavailableError",
    "CaptureError",
    "DeviceError",
    "DriverError",
    "HostFunctionError",
    "InvalidHandleError",
    "InvalidValueError",
    "NotSupportedError",
    "OutOfMemoryError",
    "exception_text",
    "function_name",
    "warn_at_caller",
]


class AccelError(RuntimeError):
    """Base class of every error accel raises on purpose."""


class BackendUnavailableError(AccelError):
    """The requested backend cannot be used on this machine.

    ``backend`` names it and ``reason`` says why (no driver library, no
    device, a driver error code), so callers can report it in one line.
    """

    def __init__(self, backend: str, reason: str, *, remedy: str = "") -> None:
        self.backend = backend
        self.reason = reason
        self.remedy = remedy
        text = f"accel backend '{backend}' is unavailable: {reason}"
        if remedy:
            text += f". {remedy}"
        super().__init__(text)


class DeviceError(AccelError, ValueError):
    """A device argument is wrong: bad index, wrong type, unknown form."""


class InvalidValueError(AccelError, ValueError):
    """An argument has a value the call cannot accept (a size past a buffer's end,
    a byte outside 0..255, events without timing asked for elapsed time...)."""


class InvalidHandleError(AccelError):
    """A stream, event, graph or buffer was used after it was closed or freed."""


class NotSupportedError(AccelError):
    """The backend or device cannot do what was asked (e.g. virtual memory)."""


class CaptureError(AccelError):
    """Graph capture was misused or hit an operation that cannot be captured."""


class HostFunctionError(AccelError):
    """A host function enqueued on a stream raised; the original is ``__cause__``."""


class DriverError(AccelError):
    """A vendor driver call failed.

    Carries the numeric ``code``, its symbolic ``name`` (``CUDA_ERROR_INVALID_VALUE``,
    ``ZE_RESULT_ERROR_UNINITIALIZED``...), the driver's own description and the
    ``call`` that failed.
    """

    def __init__(
        self,
        backend: str,
        call: str,
        code: int,
        name: str,
        description: str = "",
        *,
        device: int | None = None,
        remedy: str = "",
    ) -> None:
        self.backend = backend
        self.call = call
        self.code = code
        self.name = name
        self.description = description
        self.device = device
        where = f" on {backend}:{device}" if device is not None else f" ({backend})"
        text = f"{call} failed{where}: {name} ({code})"
        if description:
            text += f": {description}"
        if remedy:
            text += f". {remedy}"
        super().__init__(text)


class OutOfMemoryError(AccelError, MemoryError):
    """A device allocation could not be satisfied.

    ``requested`` is the size asked of the driver or allocator, in bytes;
    ``device`` the device index. The caching allocator raises a richer
    message (capacity, free, allocated, reserved, fragmentation) but the
    same type, so one ``except accel.OutOfMemoryError`` catches both.
    """

    def __init__(self, message: str, *, requested: int = 0, device: int | None = None) -> None:
        self.requested = requested
        self.device = device
        super().__init__(message)


class AllocatorConfigError(AccelError, ValueError):
    """An allocator configuration string or value is invalid."""


# accel's own directory: a warning is attributed to the first frame outside it.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def warn_at_caller(message: str, category: type[Warning]) -> None:
    """``warnings.warn``, attributed to the line outside accel that led here.

    A fixed ``stacklevel`` names the right line from one call path only; the
    allocator's configuration is read from many (``accel.memory_stats()``, the
    first allocation, a ``set_settings()``), so the frames of accel are skipped
    instead: the warning names the user's file and line, and a filter on
    ``module=`` matches the user's module.
    """
    if sys.version_info >= (3, 12):
        warnings.warn(message, category, skip_file_prefixes=(_PACKAGE,))
        return
    # What skip_file_prefixes does: the stack level of the first frame outside accel,
    # counted as warnings counts (the import system's own frames are not counted).
    frame = sys._getframe(0)
    level = 1
    while frame.f_back is not None:
        frame = frame.f_back
        if _is_import_system(frame):
            continue
        level += 1
        if not frame.f_code.co_filename.startswith(_PACKAGE):
            break
    warnings.warn(message, category, stacklevel=level)


def _is_import_system(frame: FrameType) -> bool:
    """Whether warnings skips ``frame`` when it counts the stack level."""
    filename = frame.f_code.co_filename
    return "importlib" in filename and "_bootstrap" in filename


def function_name(fn: object) -> str:
    """``fn`` in a message: its qualified name, else its repr, else its type's name.

    Never raises: a failing host function is reported (or its stream's worker
    carries on) whatever its object's ``__repr__`` does.

    >>> function_name(len), function_name(object())[:8]
    ('len', '<object ')
    """
    try:
        name = getattr(fn, "__qualname__", None)
        return name if isinstance(name, str) else repr(fn)
    except Exception:  # noqa: BLE001 - only a name for a message
        return f"<{type(fn).__qualname__} object>"


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or a note that it failed: an exception's ``__str__`` may raise,
    and the error that reports ``exc`` must not become that one.

    >>> exception_text(ValueError("bad"))
    'bad'
    """
    try:
        return str(exc)
    except Exception as failure:  # noqa: BLE001 - only a text for a message
        return f"<str() of the {type(exc).__qualname__} raised {type(failure).__name__}>"
