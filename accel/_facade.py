"""The torch.accelerator-style functions, on every backend including the host.

Device arguments accept an index of the current backend, a string
(``"cuda:1"``), an :class:`accel.Device` or a ``torch.device``; None means the
current device. Unlike torch.accelerator, a negative or out-of-range index is
an error, never a silent no-op.
"""

from __future__ import annotations

import warnings
from types import TracebackType
from typing import Any

from accel._device import Device, DeviceLike
from accel._errors import BackendUnavailableError, DeviceError
from accel._runtime import get_runtime, requested_backend_name
from accel.backends.base import DeviceProperties
from accel.stream import Stream, as_stream

__all__ = [
    "can_device_access_peer",
    "current_accelerator",
    "current_device_idx",
    "current_device_index",
    "current_stream",
    "default_stream",
    "device_count",
    "device_index",
    "get_device_capability",
    "get_device_properties",
    "get_memory_info",
    "is_available",
    "set_device_idx",
    "set_device_index",
    "set_stream",
    "synchronize",
]

_COMMON_DTYPES = frozenset(
    {
        "bool", "uint8", "uint16", "uint32", "uint64", "int8", "int16", "int32", "int64",
        "float16", "float32", "float64", "complex64", "complex128",
    }
)


def is_available() -> bool:
    """Whether the accelerator this process uses can be used.

    True on any machine with the host backend; False when ``ACCEL_BACKEND``
    names a backend that cannot load here (then other calls raise
    :class:`~accel.BackendUnavailableError` saying why).

    >>> import accel
    >>> accel.is_available()
    True
    """
    try:
        get_runtime()
    except BackendUnavailableError:
        return False
    return True


def current_accelerator(check_available: bool = False) -> Device | None:
    """The accelerator type this process uses, as a Device with no index.

    With ``check_available=True``, None when it cannot be used here; None too
    when ``ACCEL_BACKEND`` names no device type (``ACCEL_BACKEND=nonsense``) or a
    device rather than a type (``ACCEL_BACKEND=cuda:1``: no backend has that name).

    >>> import accel
    >>> accel.current_accelerator()
    Device(type='cpu', index=None)
    """
    try:
        return Device(get_runtime().name)
    except BackendUnavailableError:
        requested = requested_backend_name()
        if check_available or requested is None:
            return None
        try:
            device = Device(requested)
        except DeviceError:  # no device type: there is no accelerator to name
            return None
        return device if device.index is None else None  # a type, never one device


def device_count() -> int:
    """Number of devices of the current accelerator (0 if it cannot be used)."""
    try:
        return get_runtime().device_count()
    except BackendUnavailableError:
        return 0


def current_device_index() -> int:
    """Index of this thread's current device."""
    return get_runtime().current_index


def set_device_index(device: DeviceLike, /) -> None:
    """Make ``device`` this thread's current device."""
    runtime = get_runtime()
    runtime.set_current_index(runtime.index(device, optional=False))


def current_device_idx() -> int:
    """Deprecated alias of :func:`current_device_index`, as in torch.accelerator."""
    warnings.warn(
        "accel.current_device_idx is deprecated (as torch.accelerator's); use current_device_index",
        DeprecationWarning,
        stacklevel=2,
    )
    return current_device_index()


def set_device_idx(device: DeviceLike, /) -> None:
    """Deprecated alias of :func:`set_device_index`, as in torch.accelerator."""
    warnings.warn(
        "accel.set_device_idx is deprecated (as torch.accelerator's); use set_device_index",
        DeprecationWarning,
        stacklevel=2,
    )
    set_device_index(device)


class device_index:  # noqa: N801 - named like torch.accelerator.device_index
    """Context manager: ``device`` is current inside the block; None does nothing.

    >>> import accel
    >>> with accel.device_index(0):
    ...     accel.current_device_index()
    0
    """

    def __init__(self, device: DeviceLike, /) -> None:
        self._device = device
        self._previous: list[int] = []

    def __enter__(self) -> None:
        if self._device is None:
            return
        runtime = get_runtime()
        index = runtime.index(self._device)
        self._previous.append(runtime.current_index)
        runtime.set_current_index(index)

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._device is not None:
            get_runtime().set_current_index(self._previous.pop())


def current_stream(device: DeviceLike = None, /) -> Stream:
    """This thread's current stream on ``device`` (the default stream unless one was set)."""
    runtime = get_runtime()
    return runtime.current_stream(runtime.index(device))


def default_stream(device: DeviceLike = None) -> Stream:
    """The default stream of ``device``, as ``torch.cuda.default_stream`` (CUDA's
    legacy NULL stream; on the host, work on it runs inline in the calling thread).

    It is the current stream until another is set; streams accel creates never
    wait for it implicitly (they are non-blocking, as torch's).

    >>> import accel
    >>> accel.default_stream() == accel.current_stream()  # until a stream is made current
    True
    >>> with accel.Stream() as s:
    ...     accel.default_stream() == s
    False
    """
    runtime = get_runtime()
    return runtime.default_stream(runtime.index(device))


def set_stream(stream: Stream) -> None:
    """Make ``stream`` current on its device, and its device current.

    ``stream`` is an accel Stream or a torch stream of the current accelerator
    (``torch.Stream``, ``torch.cuda.Stream``); a closed stream is refused here,
    not at its first use.

    >>> import accel, torch
    >>> accel.set_stream(torch.Stream("cpu"))
    """
    stream = as_stream(stream, role="stream", optional=False)
    stream._live()  # a closed stream is an error now, not in later work
    get_runtime().set_current_stream(stream)


def synchronize(device: DeviceLike = None, /) -> None:
    """Wait for all work on every stream of ``device``, closed streams included.

    A host function of a closed stream that failed after the close (no
    ``Stream.synchronize`` could report it) raises
    :class:`~accel.HostFunctionError` here, once."""
    runtime = get_runtime()
    runtime.synchronize_device(runtime.index(device))


def get_memory_info(device: DeviceLike = None, /) -> tuple[int, int]:
    """``(free, total)`` bytes of ``device``'s memory, device-wide.

    >>> import accel
    >>> free, total = accel.get_memory_info()
    >>> 0 <= free <= total
    True
    """
    runtime = get_runtime()
    return runtime.backend.memory_info(runtime.index(device))


def get_device_properties(device: DeviceLike = None, /) -> DeviceProperties:
    """Name, total memory, UUID and what else the backend knows about ``device``."""
    runtime = get_runtime()
    return runtime.backend.device_properties(runtime.index(device))


def get_device_capability(device: DeviceLike = None, /) -> dict[str, Any]:
    """What ``device`` can do: ``{"supported_dtypes": {...}, "torch_runs_inline": bool, ...}``.

    dtypes are named as strings (``getattr(torch, name)`` maps them to torch's),
    so that asking does not import torch. CUDA adds ``compute_capability``.

    ``torch_runs_inline`` says whether torch's work on the device runs inline in
    the calling thread (done when each op returns, so host timers time it and
    there is nothing to synchronize), as on the host, rather than queued on the
    device: ask it instead of testing ``device.type == "cpu"``.

    >>> import accel
    >>> "uint16" in accel.get_device_capability()["supported_dtypes"]
    True
    >>> accel.get_device_capability()["torch_runs_inline"]  # the host backend
    True
    """
    props = get_device_properties(device)
    dtypes = set(_COMMON_DTYPES)
    capability: dict[str, Any] = {}
    cc = props.compute_capability
    if cc is not None:
        capability["compute_capability"] = cc
        if cc >= (8, 0):
            dtypes.add("bfloat16")
        if cc >= (8, 9):
            dtypes.update({"float8_e4m3fn", "float8_e5m2"})
    else:
        dtypes.add("bfloat16")
    capability["supported_dtypes"] = dtypes  # a set, as torch's
    capability["torch_runs_inline"] = get_runtime().backend.torch_runs_inline
    return capability


def can_device_access_peer(device: DeviceLike, peer: DeviceLike, /) -> bool:
    """Whether ``device`` can read and write memory allocated on ``peer``."""
    runtime = get_runtime()
    a, b = runtime.index(device, optional=False), runtime.index(peer, optional=False)
    return a == b or runtime.backend.can_access_peer(a, b)
