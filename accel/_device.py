"""Devices: what names one, and how device arguments are read."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Union

from accel._errors import DeviceError

__all__ = ["Device", "DeviceLike"]

_DEVICE_STRING = re.compile(r"^\s*([a-z]+)\s*(?::\s*(\d+))?\s*$")


@dataclass(frozen=True)
class Device:
    """A device of a backend: ``Device("cuda", 1)`` prints as ``cuda:1``.

    ``index`` is None for "the current device of this type", as in
    ``torch.device("cuda")``.

    >>> Device.parse("cpu:0")
    Device(type='cpu', index=0)
    >>> str(Device("xpu"))
    'xpu'
    """

    type: str
    index: int | None = None

    def __str__(self) -> str:
        return self.type if self.index is None else f"{self.type}:{self.index}"

    @classmethod
    def parse(cls, text: str) -> Device:
        """Read ``"type"`` or ``"type:index"``."""
        match = _DEVICE_STRING.match(text)
        if match is None:
            raise DeviceError(
                f"{text!r} is not a device string; write 'cpu', 'cuda:1', 'xpu:0'..."
            )
        index = match.group(2)
        return cls(match.group(1), None if index is None else int(index))


#: What accel accepts wherever it takes a device: an index of the current
#: backend, a string, an accel.Device, a torch.device, or None (current).
DeviceLike = Union[int, str, Device, Any, None]


def as_device(device: object) -> Device | int | None:
    """Normalise a device argument to an int, a Device, or None (no range check)."""
    if device is None:
        return None
    if isinstance(device, bool):
        raise DeviceError(f"{device!r} is not a device; pass an index, a string or a Device")
    if isinstance(device, int):
        return device
    if isinstance(device, Device):
        return device
    if isinstance(device, str):
        return Device.parse(device)
    dev_type, index = getattr(device, "type", None), getattr(device, "index", -1)
    if isinstance(dev_type, str) and (index is None or isinstance(index, int)):
        return Device(dev_type, index)  # torch.device and look-alikes
    raise DeviceError(
        f"{device!r} ({type(device).__name__}) is not a device; pass an index, a string such as "
        "'cuda:0', an accel.Device or a torch.device"
    )
