"""Devices: what names one, and how device arguments are read."""

from __future__ import annotations

import builtins
import numbers
import re
import sys
from typing import Any, Union

from accel._errors import DeviceError

__all__ = ["Device", "DeviceLike"]

# torch's grammar (c10/core/Device.cpp): an ASCII name, then ":" and a decimal
# index without sign, spaces or leading zeros. fullmatch: "$" would let "cpu\n" in.
_DEVICE_STRING = re.compile(r"([a-zA-Z_]+)(?::([1-9][0-9]*|0))?", re.ASCII)

#: The device types torch 2.13's c10 parses (DeviceType.cpp); torch refuses any
#: other name, so accel does too, and a Device always converts to a torch.device.
TORCH_DEVICE_TYPES: tuple[str, ...] = (
    "cpu", "cuda", "ipu", "xpu", "mkldnn", "opengl", "opencl", "ideep", "hip", "ve", "fpga",
    "maia", "xla", "lazy", "vulkan", "mps", "meta", "hpu", "mtia", "privateuseone",
)  # fmt: skip

_KNOWN_TYPES = frozenset(TORCH_DEVICE_TYPES)

#: torch's c10::DeviceIndex is 8 bits: past 127, torch.device wraps the index
#: silently (torch.device("cpu", 128).index == 65408), so accel refuses it.
MAX_DEVICE_INDEX = 127


def _check_type(name: str) -> str:
    if name in TORCH_DEVICE_TYPES:
        return name
    # A backend renamed from privateuseone (torch.utils.rename_privateuse1_backend)
    # is known only to a loaded torch; ask it rather than import it here.
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            torch.device(name)
        except (RuntimeError, ValueError):
            pass
        else:
            return name
    hint = f"; write {name.lower()!r}" if name.lower() in TORCH_DEVICE_TYPES else ""
    raise DeviceError(
        f"{name!r} is not a device type torch knows{hint}: device types are lowercase, such as "
        "'cpu', 'cuda' or 'xpu' (torch.device refuses it too)"
    )


def _check_index(index: object) -> int | None:
    if index is None:
        return None
    # numbers.Integral takes numpy's integers as torch.device does, and not bool
    # (torch refuses it) or float.
    if isinstance(index, bool) or not isinstance(index, numbers.Integral):
        raise DeviceError(
            f"device index {index!r} ({builtins.type(index).__name__}) must be None or an int "
            f"in 0..{MAX_DEVICE_INDEX}"
        )
    value = int(index)
    if not 0 <= value <= MAX_DEVICE_INDEX:
        raise _out_of_range(str(value))
    return value


def _out_of_range(index: str) -> DeviceError:
    return DeviceError(
        f"device index {index} is out of range: device indexes are 0..{MAX_DEVICE_INDEX} "
        "(torch's DeviceIndex is 8 bits), or None for the current device"
    )


class Device(str):
    """A device of a backend: ``Device("cuda", 1)`` is the string ``"cuda:1"``.

    ``index`` is None for "the current device of this type", as in
    ``torch.device("cuda")``. Types and indexes are read as torch.device reads
    them (``Device("cuda:1")`` works; ``"CPU"``, ``" cpu"`` and ``"cpu:01"`` are
    refused), except that an index past torch's 8-bit range (0..127), which
    torch wraps silently, is refused too. A Device *is* its device string (a ``str``
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
    >>> Device("cuda", 1) == "cuda:1" == Device("cuda:1")
    True
    >>> Device("cpu", 128)
    Traceback (most recent call last):
    accel._errors.DeviceError: device index 128 is out of range: device indexes are 0..127 ...
    """

    __slots__ = ("_type", "_index")
    _type: str
    _index: int | None

    def __new__(cls, type: str, index: int | None = None) -> Device:  # noqa: A002 - torch's name
        if type.__class__ is str and type in _KNOWN_TYPES:  # the common case, without the regex
            kind, parsed = type, None
        else:
            # As torch.device: the type may carry the index ("cuda:1"), but not both ways.
            kind, parsed = _parse(type)
            if parsed is not None and index is not None:
                raise DeviceError(
                    f"device {type!r} already names index {parsed}; pass either {type!r} or "
                    f"({kind!r}, {index!r}), not both"
                )
        if parsed is not None:
            index = parsed
        elif index is not None and not (index.__class__ is int and 0 <= index <= MAX_DEVICE_INDEX):
            index = _check_index(index)
        self = super().__new__(cls, kind if index is None else f"{kind}:{index}")
        object.__setattr__(self, "_type", kind)
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
        """Read ``"type"`` or ``"type:index"`` as torch.device reads it."""
        return cls(*_parse(text))


def _parse(text: object) -> tuple[str, int | None]:
    if not isinstance(text, str):
        raise DeviceError(
            f"device type {text!r} ({type(text).__name__}) must be a str such as 'cpu', 'cuda:1' or 'xpu'"
        )
    match = _DEVICE_STRING.fullmatch(text)
    if match is None:
        raise DeviceError(
            f"{text!r} is not a device string; write 'cpu', 'cuda:1', 'xpu:0'... (a lowercase "
            f"type, then ':' and an index 0..{MAX_DEVICE_INDEX} without spaces or leading zeros)"
        )
    kind, digits = _check_type(match.group(1)), match.group(2)
    if digits is None:
        return kind, None
    # Too long is out of range before int(), which refuses past 4300 digits with its own error.
    if len(digits) > len(str(MAX_DEVICE_INDEX)):
        raise _out_of_range(digits if len(digits) <= 20 else f"{digits[:8]}...({len(digits)} digits)")
    return kind, _check_index(int(digits))


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
    if isinstance(device, numbers.Integral):  # numpy's integers, as torch.device and Device take them
        return int(device)
    dev_type, index = getattr(device, "type", None), getattr(device, "index", device)
    if isinstance(dev_type, str) and (index is None or isinstance(index, numbers.Integral)):
        # torch.device and look-alikes (without an index: not one)
        return Device(dev_type, None if index is None else int(index))
    raise DeviceError(
        f"{device!r} ({type(device).__name__}) is not a device; pass an index, a string such as "
        "'cuda:0', an accel.Device or a torch.device"
    )
