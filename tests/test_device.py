from __future__ import annotations

import pytest
from hypothesis import given, strategies as st

import accel
from accel._device import as_device


@given(st.sampled_from(["cpu", "cuda", "xpu"]), st.one_of(st.none(), st.integers(0, 1 << 20)))
def test_device_strings_round_trip(kind: str, index: int | None) -> None:
    device = accel.Device(kind, index)
    assert accel.Device.parse(str(device)) == device


@pytest.mark.parametrize("text", ["", "cuda:", ":0", "cuda:-1", "cuda 0", "CUDA:0x1"])
def test_malformed_device_strings(text: str) -> None:
    with pytest.raises(accel.DeviceError, match="is not a device string"):
        accel.Device.parse(text)


def test_as_device_forms() -> None:
    assert as_device(None) is None
    assert as_device(3) == 3
    assert as_device(" cuda : 2 ") == accel.Device("cuda", 2)

    class TorchLike:
        type, index = "xpu", None

    assert as_device(TorchLike()) == accel.Device("xpu")
    with pytest.raises(accel.DeviceError):
        as_device(object())
