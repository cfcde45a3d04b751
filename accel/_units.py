"""Byte sizes written the way people write them: ``"8GiB"``, ``"512 MB"``, ``1048576``."""

from __future__ import annotations

import re
from fractions import Fraction

__all__ = ["format_size", "parse_size"]

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str, *, name: str = "size") -> int:
    """Bytes in ``text``; decimal (kB, MB, GB) and binary (KiB, MiB, GiB) units.

    >>> parse_size("2GiB"), parse_size("1.5 MB"), parse_size("4096")
    (2147483648, 1500000, 4096)
    """
    match = _SIZE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"{name}={text!r} is not a size: write a number of bytes, optionally with a unit "
            "such as 512MiB, 8GiB or 2GB"
        )
    value = int(Fraction(match.group(1)) * _UNITS[unit])  # exact, even past 2**53
    if value <= 0:
        raise ValueError(f"{name}={text!r} must be larger than zero")
    return value


def format_size(nbytes: int) -> str:
    """A short human form, PyTorch style.

    >>> format_size(512), format_size(320 * 2**20), format_size(31.37 * 2**30)
    ('512 bytes', '320.00 MiB', '31.37 GiB')
    """
    value = float(nbytes)
    if abs(value) < 1024:
        return f"{int(value)} bytes"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        value /= 1024
        if abs(value) < 1024:
            break
    return f"{value:.2f} {unit}"
