"""The oneAPI (Level Zero) paths of the producer, on the xpu backend the session
prepared (the simulated driver in CI: this checks accel's logic, not a GPU)."""

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

pytestmark = pytest.mark.skipif(bool(backend_skip_reason("xpu")), reason=f"xpu: {backend_skip_reason('xpu')}")


@pytest.fixture
def xpu():
    with activate("xpu") as runtime:
        yield runtime


def _slow_fill(stream: accel.Stream, buf, value: int) -> None:
    stream.launch_host_func(lambda: time.sleep(0.05))
    stream.fill(buf, value)


def test_device_code_is_oneapi(xpu):
    from accel import memory

    buf = memory.allocate(16)
    assert _dlpack.dlpack_device(buf) == (14, 0)
    with pytest.raises(DLPackExportError, match=r"lives on DLPack device \(14, 0\), not \(1, 0\)"):
        _dlpack.to_capsule(buf, dl_device=(1, 0))


def test_stream_none_makes_the_data_ready_on_the_host(xpu):
    from accel import memory

    producer = accel.Stream()
    buf = memory.allocate(1 << 16, stream=producer)
    _slow_fill(producer, buf, 9)
    _dlpack.to_capsule(buf)  # no consumer queue accel can order: the host waits
    assert ctypes.string_at(buf.ptr, 4) == b"\x09" * 4  # simulated device memory is host memory


@pytest.mark.parametrize("by_handle", [False, True])
def test_consumer_stream_waits_for_the_producer(xpu, by_handle):
    from accel import memory

    producer, consumer = accel.Stream(), accel.Stream()
    buf = memory.allocate(1 << 16, stream=producer)
    _slow_fill(producer, buf, 5)
    _dlpack.to_capsule(buf, stream=consumer.native_handle if by_handle else consumer)
    seen: list[bytes] = []
    consumer.launch_host_func(lambda: seen.append(ctypes.string_at(buf.ptr, 4)))
    consumer.synchronize()
    assert seen == [b"\x05" * 4]


def test_no_cuda_array_interface(xpu):
    from accel import memory

    buf = memory.allocate(16)
    with pytest.raises(AttributeError, match="only defined for CUDA buffers; this one is on xpu:0"):
        cuda_array_interface(buf)


def test_streams_are_not_shared_with_torch(xpu):
    with pytest.raises(accel.NotSupportedError, match="SYCL queues"):
        accel.Stream().to_torch()

    with pytest.raises(accel.DeviceError, match="is a cpu stream, but the current accelerator is 'xpu'"):
        accel.Stream.from_torch(torch.Stream("cpu"))


@pytest.mark.skipif(torch.xpu.is_available(), reason="this torch holds xpu tensors")
def test_torch_without_xpu_is_refused_before_allocating(xpu):
    from accel import memory

    # A CPU-only torch raised RuntimeError from from_dlpack, after the memory was taken.
    with pytest.raises(accel.NotSupportedError, match="cannot hold tensors on xpu.*accel.memory.allocate"):
        accel.empty((4, 4))
    buf = memory.allocate(64)
    with pytest.raises(accel.NotSupportedError, match="cannot hold tensors on xpu"):
        accel.as_tensor(buf)
    buf.free()
    assert memory.memory_allocated() == 0
