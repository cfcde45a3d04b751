"""Stream and event calls take torch's objects and name a bad argument in an accel error."""

from __future__ import annotations

import pytest
import torch

import accel


@pytest.mark.parametrize(
    "call",
    [
        lambda s, e: s.wait_event(None),
        lambda s, e: s.wait_event(5),
        lambda s, e: s.wait_stream(None),
        lambda s, e: s.wait_stream(5),
        lambda s, e: s.record_event(5),
        lambda s, e: e.elapsed_time(5),
        lambda s, e: e.record(5),
    ],
    ids=["wait_event(None)", "wait_event(5)", "wait_stream(None)", "wait_stream(5)", "record_event(5)",
         "elapsed_time(5)", "record(5)"],
)
def test_bad_stream_and_event_arguments_are_accel_errors_naming_them(call) -> None:
    s, e = accel.Stream(), accel.Event(enable_timing=True)
    with pytest.raises(accel.InvalidValueError, match=r"^(event|stream|end_event)="):
        call(s, e)


def test_set_stream_refuses_a_closed_stream_at_once() -> None:
    s = accel.Stream()
    s.close()
    with pytest.raises(accel.InvalidHandleError, match="was closed"):
        accel.set_stream(s)
    assert accel.current_stream() != s


def test_torch_streams_are_taken_wherever_accel_takes_a_stream() -> None:
    ts = torch.Stream("cpu")
    other = accel.Stream()
    accel.set_stream(ts)
    try:
        assert accel.current_stream() == accel.Stream.from_torch(ts)
    finally:
        accel.set_stream(accel.current_stream())
    event = accel.Event()
    event.record(ts)
    event.wait(ts)
    other.wait_stream(ts)
    with pytest.raises(accel.NotSupportedError, match="torch cannot record"):
        other.record_event(torch.Event("cpu"))  # torch has no CPU events to record
    other.wait_event(torch.Event("cpu"))
    other.synchronize()


def test_event_takes_its_device_positionally_as_torch() -> None:
    event = accel.Event("cpu:1", enable_timing=True)
    event.record(accel.Stream(1))
    assert event.device == accel.Device("cpu", 1)
    with pytest.raises(TypeError):
        accel.Event("cpu", True)  # type: ignore[misc] - flags are keyword-only, as in torch


def test_ids_and_device_type_as_torch() -> None:
    s, e = accel.Stream(), accel.Event()
    assert s.stream_id == s.native_handle and s.stream_id != accel.current_stream().stream_id
    assert s.device_type == torch.Stream("cpu").device_type == 0
    assert e.event_id == 0
    e.record(s)
    assert e.event_id == e.native_handle != 0


@pytest.fixture(params=["cpu", "cuda", "xpu"])
def each_backend(request):
    from accel._runtime import activate
    from tests.conftest import backend_skip_reason

    reason = backend_skip_reason(request.param)
    if reason:
        pytest.skip(reason)
    with activate(request.param) as runtime:
        yield runtime


def test_the_stream_class_is_not_taken_for_a_stream(each_backend) -> None:
    # Its __cuda_stream__ is an unbound function: on CUDA calling it raised a raw TypeError.
    event = accel.Event()
    with pytest.raises(accel.InvalidValueError, match="is not a stream"):
        event.record(accel.Stream)
    with pytest.raises(accel.InvalidValueError, match="is not a stream"):
        accel.current_stream().wait_stream(accel.Stream)


def test_a_torch_event_of_another_device_is_refused(each_backend) -> None:
    stream = accel.Stream()
    if each_backend.name == "cpu":
        stream.wait_event(torch.Event("cpu"))  # same device: taken
        return
    # CUDA with a CPU-only torch raised torch's RuntimeError ("compiled without CUDA support").
    with pytest.raises(accel.DeviceError, match="is a cpu event"):
        stream.wait_event(torch.Event("cpu"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch has CUDA")
def test_to_torch_on_cuda_without_a_cuda_torch_is_not_supported() -> None:
    from accel._runtime import activate
    from tests.conftest import backend_skip_reason

    if backend_skip_reason("cuda"):
        pytest.skip(backend_skip_reason("cuda"))
    with activate("cuda"):
        with pytest.raises(accel.NotSupportedError, match="cannot use"):
            accel.Stream().to_torch()
