"""What device-agnostic torch code expects of accel, on every backend: the default
stream, and whether torch work runs inline."""

from __future__ import annotations

import pytest

import accel


def test_default_stream_is_the_device_s_default_as_torch_cuda_default_stream(runtime) -> None:
    default = accel.default_stream()
    assert default.native_handle == runtime.backend.default_stream(0)
    assert default == accel.current_stream() == accel.default_stream(0) == accel.default_stream(device=accel.Device(runtime.name, 0))
    with accel.Stream() as created:
        assert accel.current_stream() == created != accel.default_stream()
        assert accel.default_stream() == default
    last = accel.device_count() - 1
    assert accel.default_stream(last).device == accel.Device(runtime.name, last)
    with pytest.raises(accel.DeviceError, match="out of range"):
        accel.default_stream(accel.device_count())


def test_the_capability_says_whether_torch_work_runs_inline(runtime) -> None:
    # What libraries test with `device.type == "cpu"`: on the host torch ops are done
    # when they return; on a GPU they are queued on the device.
    expected = {"cpu": True, "cuda": False, "xpu": False}[runtime.name]
    assert accel.get_device_capability()["torch_runs_inline"] is expected
    assert runtime.backend.torch_runs_inline is expected
