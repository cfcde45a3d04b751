from __future__ import annotations

import subprocess
import sys

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


def test_a_device_equals_the_torch_device_of_the_same_type_and_index_both_ways() -> None:
    torch = pytest.importorskip("torch")
    for kind, index in (("cpu", 0), ("cpu", None), ("cuda", 1), ("xpu", 0)):
        ours, theirs = accel.Device(kind, index), torch.device(kind, index)
        assert ours == theirs and theirs == ours
        assert not (ours != theirs) and not (theirs != ours)
    # torch's own rules: no index is not index 0, and the type must match.
    assert accel.Device("cpu") != torch.device("cpu:0") and torch.device("cpu:0") != accel.Device("cpu")
    assert accel.Device("cpu", 0) != torch.device("cpu") and accel.Device("cuda", 0) != torch.device("xpu:0")
    # Still its string, and hashed as one (a set of strings finds it).
    assert accel.Device("cpu", 0) == "cpu:0" and accel.Device("cpu", 0) in {"cpu:0"}
    assert accel.Device("cpu", 0) != "cpu" and accel.Device("cpu", 0) != 0


def test_comparing_devices_imports_no_torch() -> None:
    code = (
        "import sys, accel\n"
        "d = accel.Device('cpu', 0)\n"
        "print(d == object(), d != object(), d == 'cpu:0', 'torch' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "True", "True", "False"]
