"""Interop over real accel.memory buffers: torch tensors on the caching allocator."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import accel
from accel import memory
from accel._interop import _dlpack, as_tensor, empty
from accel.stream._dlpack_abi import read_capsule


def test_empty_gives_a_correct_tensor_on_accel_memory():
    before = memory.memory_allocated()
    a = empty((64, 32), dtype=torch.float32)
    b = empty((32, 16), dtype="float32")
    assert memory.memory_allocated() >= before + (64 * 32 + 32 * 16) * 4
    a.copy_(torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32) / 100)
    b.copy_(torch.linspace(-1, 1, 32 * 16).reshape(32, 16))
    expected = a.clone() @ b.clone()
    assert torch.equal(a @ b, expected)
    assert a.shape == (64, 32) and a.dtype == torch.float32 and a.device.type == "cpu"
    assert a.is_contiguous() and a.data_ptr() % 512 == 0  # the allocator's alignment


def test_freeing_the_tensor_returns_memory_to_accels_cache():
    memory.empty_cache()
    before = memory.memory_allocated()
    tensor = empty((256, 256), dtype=torch.float32)  # 256 KiB: small pool
    size = 256 * 256 * 4
    assert memory.memory_allocated() == before + size
    reserved, ptr = memory.memory_reserved(), tensor.data_ptr()
    view = tensor[7]
    del tensor
    assert memory.memory_allocated() == before + size, "a view still uses the memory"
    del view
    assert memory.memory_allocated() == before
    assert memory.memory_reserved() == reserved, "the memory went to the driver, not to the cache"
    again = empty((256, 256), dtype=torch.float32)
    assert again.data_ptr() == ptr, "the cached block was not reused"


def test_empty_on_a_side_stream_and_zero_elements():
    stream = accel.Stream()
    before = memory.memory_allocated()
    tensor = empty(0, dtype=torch.int64, stream=stream)
    assert tensor.shape == (0,) and tensor.dtype == torch.int64
    del tensor
    stream.synchronize()
    assert memory.memory_allocated() == before


@pytest.mark.parametrize("dtype", ["bool", "int8", "uint16", "int64", "float16", "bfloat16", "float64", "complex128"])
@pytest.mark.parametrize("shape", [(5,), (3, 4), (2, 0, 3), ()])
def test_empty_and_as_tensor_cover_dtypes_and_shapes(dtype, shape):
    tensor = empty(shape, dtype=dtype)
    assert tensor.shape == shape and str(tensor.dtype) == f"torch.{dtype}" and tensor.is_contiguous()
    tensor.zero_()
    buf = memory.allocate(max(tensor.numel(), 1) * tensor.element_size())
    view = as_tensor(buf, dtype, shape)
    assert view.shape == shape and view.dtype == tensor.dtype
    view.copy_(tensor)
    assert torch.equal(view, tensor)
    buf.free()


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"shape": (2, -1)}, accel.InvalidValueError, "non-negative ints"),
        # A zero-element shape with a dim beyond int64: a raw TypeError from torch's view().
        ({"shape": (0, 1 << 70)}, accel.InvalidValueError, "below 2"),
        ({"shape": 3, "dtype": "complex32"}, accel.InvalidValueError, "cannot be exported through DLPack"),
        ({"shape": 3, "device": "cpu:9"}, accel.DeviceError, "out of range"),
        ({"shape": 3, "device": "cuda:0"}, accel.DeviceError, "does not match the current accelerator"),
    ],
)
def test_empty_bad_arguments(kwargs, error, message):
    before = memory.memory_allocated()
    with pytest.raises(error, match=message):
        empty(**kwargs)
    assert memory.memory_allocated() == before


def test_as_tensor_over_a_real_buffer():
    buf = memory.allocate(4096)
    accel.current_stream().fill(buf, 0)
    tensor = as_tensor(buf, torch.int32, (32, 32))
    tensor += 3
    assert int(torch.from_dlpack(_dlpack.to_capsule(buf, dtype="int32")).sum()) == 3 * 1024
    del tensor
    assert not buf.freed  # as_tensor never frees what it did not allocate
    buf.free()


def test_numpy_and_torch_read_a_real_buffer():
    class Exported:
        """Buffer's protocol methods, as the report asks Buffer to define them."""

        def __init__(self, buffer):
            self.buffer = buffer

        def __dlpack__(self, **kwargs):
            return _dlpack.to_capsule(self.buffer, **kwargs)

        def __dlpack_device__(self):
            return _dlpack.dlpack_device(self.buffer)

    side = accel.Stream()
    buf = memory.allocate(1 << 16, stream=side)
    side.launch_host_func(lambda: __import__("time").sleep(0.05))
    side.fill(buf, 0x11)
    array = np.from_dlpack(Exported(buf))  # waits for the fill on `side`
    assert array.shape == (1 << 16,) and (array == 0x11).all()
    assert torch.from_dlpack(Exported(buf)).sum().item() == 0x11 * (1 << 16)


def test_buffer_speaks_dlpack():
    buf = memory.allocate(64)
    assert buf.__dlpack_device__() == (1, 0)
    assert np.from_dlpack(buf).shape == (64,)
    assert torch.from_dlpack(buf).data_ptr() == buf.ptr
    assert not hasattr(buf, "__cuda_array_interface__")


def test_a_freed_buffer_cannot_be_exported():
    buf = memory.allocate(64)
    buf.free()
    with pytest.raises(accel.InvalidHandleError, match="was freed"):
        _dlpack.to_capsule(buf)
    with pytest.raises(accel.InvalidHandleError, match="was freed"):
        as_tensor(buf)


def test_a_buffer_on_the_second_host_device_exports_that_device():
    buf = memory.allocate(64, device="cpu:1")
    assert buf.__dlpack_device__() == (1, 1) == _dlpack.dlpack_device(buf)
    capsule = buf.__dlpack__()
    tensor = read_capsule(capsule)
    assert tensor is not None and (tensor.device_type, tensor.device_id) == (1, 1)
    del capsule
    buf.free()
