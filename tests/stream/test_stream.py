"""Stream API details on the host backend."""

from __future__ import annotations

import gc

import pytest

import accel
from accel._runtime import activate
from accel.stream import as_stream


def test_repr_names_device_and_handle() -> None:
    s = accel.Stream(1, priority=-1)
    assert repr(s) == f"accel.Stream(device=cpu:1, native_handle={s.native_handle:#x}, priority=-1)"
    s.close()
    assert repr(s).endswith(" closed)")


def test_cuda_stream_protocol_only_on_cuda() -> None:
    class TorchLikeCudaStream:
        def __cuda_stream__(self):
            return (0, 1234)

    # Pinned: the suite also runs with ACCEL_BACKEND=cuda (accel verify on a GPU).
    with activate("cpu"):
        s = accel.Stream()
        assert not hasattr(s, "__cuda_stream__")
        with pytest.raises(accel.DeviceError, match="is a CUDA stream, but the current accelerator is 'cpu'"):
            as_stream(TorchLikeCudaStream())
        with pytest.raises(accel.InvalidValueError, match="not a stream"):
            as_stream(42)
        assert as_stream(None) == accel.current_stream()


def test_numpy_operands_are_kept_alive_until_the_copy_ran() -> None:
    np = pytest.importorskip("numpy")
    s = accel.Stream()
    dst = np.zeros(1 << 16, dtype=np.uint8)
    opened = __import__("threading").Event()
    s.launch_host_func(lambda: opened.wait(10))
    s.copy(dst, np.full(1 << 16, 7, dtype=np.uint8))  # the source has no other reference
    gc.collect()
    opened.set()
    s.synchronize()
    assert (dst == 7).all()
    with pytest.raises(accel.InvalidValueError, match="non-contiguous"):
        s.fill(dst[::2], 1)


def test_copy_size_rules() -> None:
    np = pytest.importorskip("numpy")
    s = accel.Stream()
    a, b = np.zeros(16, np.uint8), np.ones(8, np.uint8)
    s.copy(a, b)  # defaults to the smaller operand
    s.synchronize()
    assert a.tolist() == [1] * 8 + [0] * 8
    with pytest.raises(accel.InvalidValueError, match="nbytes is required"):
        s.copy(a.ctypes.data, b.ctypes.data)
    with pytest.raises(accel.InvalidValueError, match="not a valid address"):
        s.copy(0, b)
    with pytest.raises(accel.InvalidValueError, match="non-negative int"):
        s.copy(a, b, -1)


def test_external_stream_argument_checks() -> None:
    with pytest.raises(accel.InvalidValueError):
        accel.ExternalStream("0x10")  # type: ignore[arg-type]
    with pytest.raises(accel.InvalidHandleError):
        accel.ExternalStream(0xDEAD)


def test_garbage_collected_streams_release_their_worker() -> None:
    import threading

    before = threading.active_count()
    for _ in range(20):
        s = accel.Stream()
        s.launch_host_func(lambda: None)
        del s
    gc.collect()
    deadline = __import__("time").monotonic() + 5
    while threading.active_count() > before and __import__("time").monotonic() < deadline:
        __import__("time").sleep(0.01)
    assert threading.active_count() <= before


def test_default_stream_is_not_capturable_and_not_closable() -> None:
    default = accel.current_stream()
    assert not default.is_capturing()
    default.close()  # not owned: nothing happens
    default.synchronize()


def test_read_only_arrays_are_refused_as_destinations() -> None:
    np = pytest.importorskip("numpy")
    constant = np.frombuffer(b"abcdefgh", np.uint8)
    with pytest.raises(accel.InvalidValueError, match="read-only"):
        accel.Stream().copy(constant, np.zeros(8, np.uint8))
    accel.current_stream().copy(np.zeros(8, np.uint8), constant)  # reading it is fine


def test_an_event_made_for_one_device_refuses_another_devices_stream() -> None:
    event = accel.Event(device=1)
    with pytest.raises(accel.DeviceError, match="lives on cpu:1"):
        event.record(accel.Stream(0))
    event.record(accel.Stream(1))
    assert event.device == accel.Device("cpu", 1)
