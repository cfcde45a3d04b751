from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

from accel._units import format_size, parse_size


@given(st.integers(1, 1 << 50), st.sampled_from(["", "B", "KiB", "MiB", "GiB", "kB", "MB", "GB"]))
def test_sizes_with_units(n: int, unit: str) -> None:
    factor = {"": 1, "B": 1, "KiB": 1024, "MiB": 1 << 20, "GiB": 1 << 30, "kB": 1000, "MB": 10**6, "GB": 10**9}
    assert parse_size(f"{n}{unit}") == n * factor[unit]
    assert parse_size(f" {n} {unit.lower()} ") == n * factor[unit]


@pytest.mark.parametrize("text", ["", "lots", "-1", "0", "1.5.2GB", "12 parsecs"])
def test_bad_sizes(text: str) -> None:
    with pytest.raises(ValueError, match="ACCEL_X"):
        parse_size(text, name="ACCEL_X")


def test_format_size() -> None:
    assert format_size(0) == "0 bytes"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(5 << 40) == "5.00 TiB"
    assert format_size(3 << 50) == "3072.00 TiB"
