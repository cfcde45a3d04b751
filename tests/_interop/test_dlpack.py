"""The DLPack producer: capsules, lifetimes, stream semantics and refusals."""

from __future__ import annotations

import ctypes
import math
import threading
import time
import weakref

import numpy as np
import pytest
import torch

import accel
from accel._interop import _dlpack
from accel._interop._dlpack import DLDeviceType, DLPackExportError
from accel.stream._dlpack_abi import DLManagedTensor, DLManagedTensorVersioned


def _managed(capsule, name: bytes):
    get = ctypes.pythonapi["PyCapsule_GetPointer"]
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    struct = DLManagedTensorVersioned if name.endswith(b"versioned") else DLManagedTensor
    return struct.from_address(get(capsule, name))


def test_numpy_reads_and_writes_host_memory(host_buffer):
    buf = host_buffer(64)
    accel.current_stream().fill(buf, 0x2A)
    array = np.from_dlpack(buf)
    assert array.dtype == np.uint8 and array.shape == (64,)
    assert (array == 0x2A).all()
    array[:8] = 1  # a view, not a copy: visible through a second export
    assert (np.from_dlpack(buf)[:8] == 1).all()
    assert array.ctypes.data == buf.ptr


def test_torch_reads_host_memory_without_copy(host_buffer):
    buf = host_buffer(32)
    accel.current_stream().fill(buf, 7)
    tensor = torch.from_dlpack(buf)
    assert tensor.dtype == torch.uint8 and tensor.device.type == "cpu"
    assert tensor.data_ptr() == buf.ptr
    assert tensor.tolist() == [7] * 32
    tensor.fill_(9)
    assert (np.from_dlpack(buf) == 9).all()


def test_typed_export_through_capsule(host_buffer):
    buf = host_buffer(64)
    values = np.from_dlpack(buf).view(np.float32)
    values[:] = np.arange(16, dtype=np.float32)
    tensor = torch.from_dlpack(_dlpack.to_capsule(buf, dtype="float32", shape=(4, 4)))
    assert tensor.shape == (4, 4)
    assert tensor[3, 3].item() == 15.0


def test_legacy_capsule_layout(host_buffer):
    buf = host_buffer(48)
    capsule = buf.__dlpack__()
    assert 'capsule object "dltensor"' in repr(capsule)
    tensor = _managed(capsule, b"dltensor").dl_tensor
    assert tensor.data == buf.ptr
    assert (tensor.device.device_type, tensor.device.device_id) == (1, 0)
    assert (tensor.ndim, tensor.shape[0], tensor.strides[0], tensor.byte_offset) == (1, 48, 1, 0)
    assert (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) == (1, 8, 1)


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_no_elements_with_strides_past_int64_are_refused(host_buffer, versioned):
    # The strides did not fit the int64 fields: a raw struct.error from pack_into.
    buf = host_buffer(16)
    with pytest.raises(accel.InvalidValueError, match="product of its non-zero dims"):
        _dlpack.to_capsule(buf, shape=(1 << 40, 1 << 40, 1 << 40, 0), max_version=(1, 0) if versioned else None)
    widest = torch.from_dlpack(_dlpack.to_capsule(buf, shape=(2, (1 << 62) - 1, 0)))
    assert widest.shape == (2, (1 << 62) - 1, 0) and widest.stride()[0] == (1 << 62) - 1


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
@pytest.mark.parametrize("shape", [(), (5,), (2, 3, 4), (2,) + (1,) * 39], ids=["0-d", "1-d", "3-d", "40-d"])
def test_every_capsule_field_reads_back_through_the_ctypes_structures(host_buffer, versioned, shape):
    # The producer packs the structures with struct formats: they must say
    # what dlpack.h (as the ctypes types spell it) says, field by field.
    buf = host_buffer(8 * math.prod(shape), device=accel.Device("cpu", 3))
    capsule = _dlpack.to_capsule(buf, dtype="complex64", shape=shape, max_version=(1, 0) if versioned else None)
    managed = _managed(capsule, b"dltensor_versioned" if versioned else b"dltensor")
    if versioned:
        assert (managed.version.major, managed.version.minor, managed.flags) == (1, 0, 0)
    assert managed.manager_ctx == ctypes.addressof(managed)
    deleter_address = ctypes.cast(managed.deleter, ctypes.c_void_p).value
    assert deleter_address == ctypes.cast(_dlpack._deleter, ctypes.c_void_p).value
    tensor = managed.dl_tensor
    assert tensor.data == buf.ptr and tensor.byte_offset == 0
    assert (tensor.device.device_type, tensor.device.device_id) == (1, 3)
    assert (tensor.dtype.code, tensor.dtype.bits, tensor.dtype.lanes) == (5, 64, 1)
    assert tensor.ndim == len(shape)
    assert tuple(tensor.shape[i] for i in range(len(shape))) == shape
    strides = tuple(tensor.strides[i] for i in range(len(shape)))
    assert strides == tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    assert tensor.shape and tensor.strides  # never NULL, not even for 0-d
    del tensor, managed, capsule


@pytest.mark.parametrize("max_version", [(1, 0), (1, 3), (2, 0)])
def test_versioned_capsule_when_the_consumer_can_take_it(host_buffer, max_version):
    buf = host_buffer(16)
    capsule = buf.__dlpack__(max_version=max_version)
    assert 'capsule object "dltensor_versioned"' in repr(capsule)
    managed = _managed(capsule, b"dltensor_versioned")
    assert (managed.version.major, managed.version.minor) == _dlpack.DLPACK_VERSION
    assert managed.flags == 0  # writable, not a copy
    assert managed.dl_tensor.data == buf.ptr and managed.dl_tensor.shape[0] == 16


def test_c_contiguous_strides_in_elements(host_buffer):
    capsule = _dlpack.to_capsule(host_buffer(2 * 3 * 4 * 8), dtype="float64", shape=(2, 3, 4))
    tensor = _managed(capsule, b"dltensor").dl_tensor
    assert [tensor.shape[i] for i in range(3)] == [2, 3, 4]
    assert [tensor.strides[i] for i in range(3)] == [12, 4, 1]
    assert torch.from_dlpack(capsule).is_contiguous()


def test_no_elements_means_a_null_data_pointer(host_buffer):
    capsule = _dlpack.to_capsule(host_buffer(16), dtype="int32", shape=(0, 4))
    tensor = _managed(capsule, b"dltensor").dl_tensor
    assert tensor.data is None and [tensor.strides[0], tensor.strides[1]] == [4, 1]


def test_pre_1_0_consumers_get_the_legacy_capsule(host_buffer):
    capsule = host_buffer(16).__dlpack__(max_version=(0, 8))
    assert 'capsule object "dltensor"' in repr(capsule)


def test_owner_lives_until_the_consumer_is_done(host_buffer):
    buf = host_buffer(16)
    alive = weakref.ref(buf)
    tensor = torch.from_dlpack(buf)
    del buf
    assert alive() is not None, "the exporting buffer died while a tensor still used its memory"
    view = tensor[4:]
    del tensor
    assert alive() is not None, "a view still uses the memory"
    del view
    assert alive() is None


def test_unconsumed_capsule_releases_its_owner(host_buffer):
    """An unconsumed capsule has no destructor; the next sweep (any export,
    or live_exports()) releases what it held."""
    buf = host_buffer(16)
    alive = weakref.ref(buf)
    capsule = buf.__dlpack__(max_version=(1, 0))
    del buf
    assert _dlpack.live_exports() == 1
    assert alive() is not None
    del capsule
    assert _dlpack.live_exports() == 0
    assert alive() is None


def test_the_next_export_releases_an_unconsumed_capsule(host_buffer):
    first, second = host_buffer(16), host_buffer(16)
    alive = weakref.ref(first)
    first.__dlpack__()  # the capsule dies unconsumed at once
    del first
    tensor = torch.from_dlpack(second)
    assert alive() is None
    del tensor


def test_deleter_may_run_on_another_thread(host_buffer):
    buf = host_buffer(16)
    alive = weakref.ref(buf)
    holder = [torch.from_dlpack(buf)]
    del buf
    worker = threading.Thread(target=holder.clear)
    worker.start()
    worker.join()
    assert alive() is None


def _slow_fill(stream: accel.Stream, buf, value: int) -> None:
    stream.launch_host_func(lambda: time.sleep(0.05))
    stream.fill(buf, value)


def test_stream_none_on_the_host_waits_for_the_producer(host_buffer):
    producer = accel.Stream()
    buf = host_buffer(1 << 16, stream=producer)
    _slow_fill(producer, buf, 5)
    # numpy reads from the host at once: the export must wait for the fill.
    assert (np.from_dlpack(buf) == 5).all()


def test_consumer_stream_is_ordered_after_the_producer(host_buffer):
    producer, consumer = accel.Stream(), accel.Stream()
    buf = host_buffer(1 << 16, stream=producer)
    _slow_fill(producer, buf, 3)
    capsule = buf.__dlpack__(stream=consumer)
    seen = []
    consumer.launch_host_func(lambda: seen.append(int(np.from_dlpack(buf).min())))
    consumer.synchronize()
    assert seen == [3]
    del capsule


def test_consumer_on_the_producer_stream_needs_no_event(host_buffer, monkeypatch):
    producer = accel.Stream()
    buf = host_buffer(16, stream=producer)
    monkeypatch.setattr(accel.Stream, "wait_stream", lambda *a: pytest.fail("no wait expected"))
    monkeypatch.setattr(accel.Stream, "record_event", lambda *a: pytest.fail("no sync expected"))
    buf.__dlpack__(stream=producer)
    buf.__dlpack__(stream=-1)


def test_dlpack_device_codes():
    class Like:
        def __init__(self, kind, index):
            self.device = accel.Device(kind, index)

    assert _dlpack.dlpack_device(Like("cpu", 0)) == (DLDeviceType.kDLCPU, 0)
    assert _dlpack.dlpack_device(Like("cuda", 1)) == (2, 1)
    assert _dlpack.dlpack_device(Like("xpu", 0)) == (14, 0)
    with pytest.raises(accel.InvalidValueError, match="accel.Device"):
        _dlpack.dlpack_device(Like("mps", 0))
    with pytest.raises(accel.InvalidValueError, match="accel.Device"):
        _dlpack.dlpack_device(object())


def test_dl_device_is_honoured(host_buffer):
    buf = host_buffer(16)
    buf.__dlpack__(dl_device=(1, 0))
    with pytest.raises(DLPackExportError, match=r"lives on DLPack device \(1, 0\), not \(2, 0\)") as info:
        buf.__dlpack__(dl_device=(2, 0))
    assert isinstance(info.value, BufferError) and isinstance(info.value, accel.AccelError)
    with pytest.raises(DLPackExportError, match="pair"):
        buf.__dlpack__(dl_device="cpu")


@pytest.mark.parametrize("copy", ["yes", 1, 0, [True]])
@pytest.mark.parametrize("kind", ["device", "host"])
def test_a_copy_argument_that_is_not_a_bool_or_none_is_refused(kind: str, copy: object) -> None:
    """A truthy string exported a copy nobody meant (and a falsy 0 none): the array
    API's copy is True, False or None."""
    buf = accel.memory.allocate(16) if kind == "device" else accel.memory.allocate_host(16)
    with pytest.raises(DLPackExportError, match=r"copy=.* must be True, False or None"):
        buf.__dlpack__(copy=copy)


@pytest.mark.parametrize("consumer", [np.from_dlpack, torch.from_dlpack])
def test_copy_true_gives_the_consumer_its_own_memory(consumer):
    buf = accel.memory.allocate(16)
    accel.current_stream().fill(buf, 5)
    copied = consumer(buf, copy=True)
    accel.current_stream().fill(buf, 6)
    accel.synchronize()
    assert copied.tolist() == [5] * 16, "a copy, not a view"
    view = consumer(buf, copy=False)
    assert view.tolist() == [6] * 16
    before = accel.memory.memory_allocated()
    del copied
    assert accel.memory.memory_allocated() < before, "the copy goes back to the cache with the consumer"
    del view
    buf.free()


def test_a_versioned_copy_is_flagged(host_buffer):
    buf = host_buffer(16)
    capsule = buf.__dlpack__(max_version=(1, 0), copy=True)
    pointer = ctypes.pythonapi.PyCapsule_GetPointer
    pointer.restype, pointer.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    managed = DLManagedTensorVersioned.from_address(pointer(capsule, b"dltensor_versioned"))
    assert managed.flags == 2  # DLPACK_FLAG_BITMASK_IS_COPIED
    assert managed.dl_tensor.data != buf.ptr
    del managed, capsule


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        (7, "host buffers take stream=None"),
        ("s", "must be None, -1, an int stream handle"),
        (True, "must be None, -1"),
    ],
)
def test_bad_streams_on_the_host(host_buffer, stream, message):
    with pytest.raises(DLPackExportError, match=message):
        host_buffer(16).__dlpack__(stream=stream)


def test_cuda_stream_rules():
    """The CUDA-only stream values, checked before any device is touched."""

    class CudaLike:
        ptr, nbytes, device = 0x10000, 16, accel.Device("cuda", 0)
        stream = accel.current_stream()

    with pytest.raises(DLPackExportError, match="stream=0. is ambiguous"):
        _dlpack.to_capsule(CudaLike(), stream=0)
    with pytest.raises(DLPackExportError, match="cannot be negative"):
        _dlpack.to_capsule(CudaLike(), stream=-5)


def test_cuda_stream_objects_are_streams_of_the_cuda_backend(host_buffer):
    class TorchLikeCudaStream:
        def __cuda_stream__(self):
            return (0, 0x1234)

    with pytest.raises(accel.DeviceError, match="CUDA stream, but the current accelerator is 'cpu'"):
        host_buffer(16).__dlpack__(stream=TorchLikeCudaStream())


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_version": 1}, "max_version=1 must be a"),
        ({"max_version": (1,)}, "must be a .major, minor. tuple"),
        ({"dtype": "float128"}, "cannot be exported through DLPack"),
        ({"dtype": "float32", "shape": (5,)}, "needs 20 bytes, but the buffer has 16"),
        ({"dtype": "float64", "shape": None, "nbytes": 12}, "not a whole number of 8-byte items"),
        ({"shape": (-1,)}, "non-negative ints"),
        ({"shape": "ab"}, "non-negative ints"),
        ({"shape": 3.5}, "an int or a sequence"),
        # ctypes wrapped a dim wider than int64 silently into the capsule's shape.
        ({"shape": (0, 1 << 64)}, "below 2\\*\\*63"),
        ({"shape": (0, 1 << 63)}, "below 2\\*\\*63"),
    ],
)
def test_bad_exports_are_refused(host_buffer, kwargs, message):
    buf = host_buffer(kwargs.pop("nbytes", 16))
    with pytest.raises(accel.InvalidValueError, match=message):
        _dlpack.to_capsule(buf, **kwargs)


def test_objects_without_memory_are_refused():
    class NoPtr:
        device, stream, nbytes = accel.Device("cpu", 0), accel.current_stream(), 4

    class NoStream:
        device, ptr, nbytes, stream = accel.Device("cpu", 0), 0x1000, 4, None

    with pytest.raises(accel.InvalidValueError, match="no int ptr and nbytes"):
        _dlpack.to_capsule(NoPtr())
    with pytest.raises(accel.InvalidValueError, match="needs the accel.Stream"):
        _dlpack.to_capsule(NoStream())


def test_zero_size_buffer(host_buffer):
    buf = host_buffer(0)
    assert np.from_dlpack(buf).shape == (0,)
    assert torch.from_dlpack(buf).numel() == 0


def test_many_exports_do_not_leak(host_buffer):
    buf = host_buffer(256)
    for _ in range(200):
        np.from_dlpack(buf).sum()
        torch.from_dlpack(buf).sum()
    assert all(owner is not buf for _, owner in _dlpack._exports.values())
