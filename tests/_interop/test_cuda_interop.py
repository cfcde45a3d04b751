"""The CUDA paths of the producer, on the CUDA backend the session prepared
(the simulated driver in CI: this checks accel's logic, not a GPU)."""

from __future__ import annotations

import ctypes
import time

import pytest
import torch

import accel
from accel._interop import _dlpack, cuda_array_interface
from accel._interop._dlpack import DLPackExportError
from accel._runtime import activate
from tests.conftest import backend_skip_reason

pytestmark = pytest.mark.skipif(bool(backend_skip_reason("cuda")), reason=f"cuda: {backend_skip_reason('cuda')}")


@pytest.fixture
def cuda():
    with activate("cuda") as runtime:
        yield runtime


def _slow_fill(stream: accel.Stream, buf, value: int) -> None:
    stream.launch_host_func(lambda: time.sleep(0.05))
    stream.fill(buf, value)


def _first_bytes_seen_by(stream: accel.Stream, buf) -> bytes:
    seen: list[bytes] = []
    stream.launch_host_func(lambda: seen.append(ctypes.string_at(buf.ptr, 4)))  # simulated device memory is host memory
    stream.synchronize()
    return seen[0]


def test_device_codes(cuda):
    from accel import memory

    assert _dlpack.dlpack_device(memory.allocate(16)) == (2, 0)
    if cuda.device_count() > 1:
        other = memory.allocate(16, device=1)
        assert _dlpack.dlpack_device(other) == (2, 1)
        with pytest.raises(DLPackExportError, match=r"lives on DLPack device \(2, 1\), not \(2, 0\)"):
            _dlpack.to_capsule(other, dl_device=(2, 0))


def test_consumer_handle_waits_for_the_producer(cuda):
    from accel import memory

    producer, consumer = accel.Stream(), accel.Stream()
    buf = memory.allocate(1 << 16, stream=producer)
    _slow_fill(producer, buf, 9)
    capsule = _dlpack.to_capsule(buf, stream=consumer.native_handle, max_version=(1, 0))
    assert _first_bytes_seen_by(consumer, buf) == b"\x09" * 4
    del capsule


def test_stream_none_means_the_legacy_default_stream(cuda):
    from accel import memory

    producer = accel.Stream()
    buf = memory.allocate(1 << 16, stream=producer)
    _slow_fill(producer, buf, 4)
    _dlpack.to_capsule(buf)
    assert _first_bytes_seen_by(cuda.default_stream(0), buf) == b"\x04" * 4


@pytest.mark.parametrize("stream", [1, 2, -1])
def test_special_stream_values(cuda, stream):
    from accel import memory

    _dlpack.to_capsule(memory.allocate(16, stream=accel.Stream()), stream=stream)


@pytest.mark.parametrize(("stream", "message"), [(0, "ambiguous"), (-3, "cannot be negative")])
def test_refused_stream_values(cuda, stream, message):
    from accel import memory

    with pytest.raises(DLPackExportError, match=message):
        _dlpack.to_capsule(memory.allocate(16), stream=stream)


def test_unknown_stream_handle_is_an_accel_error(cuda):
    from accel import memory

    with pytest.raises(accel.AccelError):
        _dlpack.to_capsule(memory.allocate(16), stream=0xDEAD0)


def test_cuda_array_interface_reports_the_buffer_stream(cuda):
    from accel import memory

    side = accel.Stream()
    buf = memory.allocate(256, stream=side)
    cai = cuda_array_interface(buf)
    assert cai["stream"] == side.native_handle and cai["data"] == (buf.ptr, False) and cai["shape"] == (256,)
    # The default stream is CUstream 0, which CAI v3 spells 1.
    assert cuda_array_interface(memory.allocate(256))["stream"] == 1


class _TorchCudaStreamLike:
    """What torch.cuda.Stream offers (no CUDA build of torch here)."""

    def __init__(self, handle: int) -> None:
        self.handle = handle
        self.device = torch.device("cuda", 0)

    def __cuda_stream__(self):
        return (0, self.handle)


def test_cuda_stream_protocol_objects_become_accel_streams(cuda):
    side = accel.Stream()
    theirs = _TorchCudaStreamLike(side.native_handle)
    assert accel.Stream.from_torch(theirs) == side
    event = accel.Event()
    event.record(theirs)  # accepted wherever accel takes a stream
    event.synchronize()
    assert side.__cuda_stream__() == (0, side.native_handle)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch holds CUDA tensors")
def test_torch_without_cuda_is_refused_before_allocating(cuda):
    from accel import memory

    # A CPU-only torch raised AssertionError from deep inside torch.cuda.
    with pytest.raises(accel.NotSupportedError, match="cannot hold tensors on cuda.*accel.memory.allocate"):
        accel.empty((4, 4))
    buf = memory.allocate(64)
    with pytest.raises(accel.NotSupportedError, match="cannot hold tensors on cuda"):
        accel.as_tensor(buf)
    buf.free()
    assert memory.memory_allocated() == 0


def test_a_consumer_stream_handle_wider_than_a_pointer_is_refused(cuda):
    # 2**64 was wrapped to 0 by the binding: the export ordered on the NULL stream instead.
    from accel import memory

    buf = memory.allocate(16)
    with pytest.raises(accel.InvalidValueError, match="pointer width"):
        buf.__dlpack__(stream=1 << 64)
    with pytest.raises(accel.InvalidValueError, match="pointer width"):
        accel.ExternalStream(1 << 64)
    buf.free()
