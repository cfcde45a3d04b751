"""Devices: what names one, and how device arguments are read."""

from __future__ import annotations

import builtins
import re
import sys
from typing import Any, Union

from accel._errors import DeviceError

__all__ = ["Device", "DeviceLike"]

_DEVICE_STRING = re.compile(r"^\s*([a-z]+)\s*(?::\s*(\d+))?\s*$")


class Device(str):
    """A device of a backend: ``Device("cuda", 1)`` is the string ``"cuda:1"``.

    ``index`` is None for "the current device of this type", as in
    ``torch.device("cuda")``. A Device *is* its device string (a ``str``
    subclass), because torch takes no other foreign object as a device: it
    works wherever torch takes a device, ``tensor.to(dev)``, ``device=dev``
    and ``torch.device(dev)``, and compares equal to its string and, both
    ways round, to the ``torch.device`` of the same type and index.

    It hashes as its string (it is one), which ``torch.device`` does not: do
    not mix the two as keys of one dict or set.

    >>> import torch
    >>> from accel import Device
    >>> Device("cpu", 0) == torch.device("cpu:0") and torch.device("cpu:0") == Device("cpu", 0)
    True
    >>> Device("cpu") == torch.device("cpu:0")  # no index is not index 0, as in torch
    False
    >>> Device.parse("cpu:0")
    Device(type='cpu', index=0)
    >>> str(Device("xpu"))
    'xpu'
    >>> Device("cuda", 1) == "cuda:1"
    True
    """

    __slots__ = ("_type", "_index")
    _type: str
    _index: int | None

    def __new__(cls, type: str, index: int | None = None) -> Device:  # noqa: A002 - torch's name
        if not isinstance(type, str) or not type.isalpha():
            raise DeviceError(f"device type {type!r} must be a word such as 'cpu', 'cuda' or 'xpu'")
        if index is not None and (isinstance(index, bool) or not isinstance(index, int) or index < 0):
            raise DeviceError(f"device index {index!r} must be None or a non-negative int")
        type = str(type)  # a Device passed as the type must not nest
        self = super().__new__(cls, type if index is None else f"{type}:{index}")
        object.__setattr__(self, "_type", type)
        object.__setattr__(self, "_index", index)
        return self

    @property
    def type(self) -> str:
        """The backend's name: ``"cpu"``, ``"cuda"`` or ``"xpu"``."""
        return self._type

    # torch.device's attribute; it hides str.index (a Device is a str so that torch takes it).
    @property
    def index(self) -> int | None:  # type: ignore[override]
        """The device's index, or None for the current device of :attr:`type`."""
        return self._index

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"accel.Device is immutable; cannot set {name!r}")

    def __repr__(self) -> str:
        return f"Device(type={self._type!r}, index={self._index!r})"

    def __str__(self) -> str:
        return str.__str__(self)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str):
            return str.__eq__(self, other)
        # A torch.device exists only once torch is imported: no import here (accel stays cheap).
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(other, torch.device):
            return bool(self._type == other.type and self._index == other.index)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = str.__hash__  # defining __eq__ would otherwise make Device unhashable

    def __reduce__(self) -> tuple[builtins.type[Device], tuple[str, int | None]]:  # `type` is the property
        return (Device, (self._type, self._index))

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
