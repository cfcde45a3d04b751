"""torch interop on the host backend: tensors on accel memory, streams both ways."""

from __future__ import annotations

import array
import gc
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest
import torch

import accel
from accel._interop import as_tensor


def test_as_tensor_views_the_buffer(host_buffer):
    buf = host_buffer(64)
    tensor = as_tensor(buf, torch.float32, (4, 4))
    assert tensor.shape == (4, 4) and tensor.dtype == torch.float32
    assert tensor.data_ptr() == buf.ptr
    tensor.copy_(torch.arange(16, dtype=torch.float32).reshape(4, 4))
    assert np.from_dlpack(buf).view(np.float32)[-1] == 15.0


def test_as_tensor_defaults_to_bytes(host_buffer):
    tensor = as_tensor(host_buffer(10))
    assert tensor.shape == (10,) and tensor.dtype == torch.uint8


def test_as_tensor_accepts_dtype_names(host_buffer):
    assert as_tensor(host_buffer(8), "bfloat16").shape == (4,)
    assert as_tensor(host_buffer(8), "bool", 3).dtype == torch.bool


def test_as_tensor_waits_for_the_buffer_stream(host_buffer):
    producer = accel.Stream()
    buf = host_buffer(1 << 16, stream=producer)
    producer.launch_host_func(lambda: __import__("time").sleep(0.05))
    producer.fill(buf, 1)
    assert int(as_tensor(buf).min()) == 1


@pytest.mark.parametrize(
    ("dtype", "shape", "error", "message"),
    [
        (torch.float32, (5,), accel.InvalidValueError, "needs 20 bytes, but the buffer has 16"),
        ("Tensor", (1,), accel.InvalidValueError, "dtype='Tensor' is not a torch dtype name"),
        ("nonsense", None, accel.InvalidValueError, "is not a torch dtype name"),
        (np.float32, None, accel.InvalidValueError, "must be a torch.dtype or its name"),
        (torch.qint8, None, accel.InvalidValueError, "cannot be exported through DLPack"),
        (torch.uint8, (2, -1), accel.InvalidValueError, "non-negative ints"),
        # torch refused it with a raw TypeError from view().
        (torch.uint8, (0, 1 << 70), accel.InvalidValueError, "below 2"),
        # No elements, but strides past int64: torch raised "numel: integer multiplication overflow".
        (torch.int32, (1 << 40, 1 << 40, 1 << 40, 0), accel.InvalidValueError, "product of its non-zero dims"),
    ],
)
def test_as_tensor_bad_arguments(host_buffer, dtype, shape, error, message):
    with pytest.raises(error, match=message):
        as_tensor(host_buffer(16), dtype, shape)


def _released() -> memoryview:
    view = memoryview(b"abcd")
    view.release()
    return view


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        (b"abcd", r"bytes is not: .*read-only, so view a writable copy: torch\.frombuffer\(bytearray\(obj\)"),
        (memoryview(b"abcd"), r"memoryview is not: .*read-only"),
        (bytearray(b"abcd"), r"bytearray is not: .*torch\.frombuffer\(obj, dtype=\.\.\.\) views its bytes"),
        (array.array("f", [1.0, 2.0]), r"array is not: torch\.as_tensor\(obj\) gives its values with its own dtype"),
        (np.arange(4, dtype=np.float32), r"ndarray is not: .*torch\.frombuffer\(obj, dtype=\.\.\.\)"),
        (np.arange(8)[::2], r"ndarray is not: .*not contiguous"),
        ([1, 2, 3], r"list is not: torch\.as_tensor\(obj\) makes a tensor of data such as a list \(a copy\)"),
        (torch.ones(2), r"Tensor is not: it is a tensor already"),
        # Their buffers cannot be exported: memoryview() raised ValueError, which escaped.
        (np.array(["2020-01-01"], dtype="datetime64[D]"), r"ndarray is not: its buffer cannot be viewed \(cannot"),
        (_released(), r"memoryview is not: its buffer cannot be viewed \(operation forbidden on released"),
    ],
)
def test_as_tensor_refuses_what_is_not_accel_memory_and_names_the_torch_call(obj, message):
    """Before, each got "<type>.device is None; DLPack export needs an accel.Device"."""
    with pytest.raises(accel.InvalidValueError, match=r"accel\.as_tensor views accel memory \(an accel Buffer, "
                       r"HostBuffer or ForeignBuffer\), and " + message):
        as_tensor(obj)


def test_empty_refuses_no_elements_with_strides_past_int64():
    with pytest.raises(accel.InvalidValueError, match="product of its non-zero dims"):
        accel.empty((1 << 40, 1 << 40, 1 << 40, 0))
    # The widest that fits is a tensor like torch's own.
    assert accel.empty((1 << 62, 1, 0)).stride() == torch.empty((1 << 62, 1, 0)).stride()


def test_torch_cpu_stream_is_the_host_default_stream():
    stream = accel.Stream.from_torch(torch.Stream("cpu"))
    assert stream == accel.current_stream()
    assert accel.Stream.from_torch(torch.Stream()) == stream


def test_accel_stream_to_torch_on_the_host():
    mine = accel.Stream()
    for stream in (mine, accel.current_stream()):
        converted = stream.to_torch()
        assert isinstance(converted, torch.Stream) and converted.device.type == "cpu"
    assert mine.to_torch() == torch.Stream("cpu")


def test_from_torch_refuses_what_is_not_a_torch_stream():
    with pytest.raises(accel.InvalidValueError, match="is not a torch stream"):
        accel.Stream.from_torch(accel.Stream())
    with pytest.raises(accel.InvalidValueError, match="is not a torch stream"):
        accel.Stream.from_torch(3)


def test_cuda_streams_need_the_cuda_backend():
    class TorchCudaLike:
        device = torch.device("cuda", 0)

        def __cuda_stream__(self):
            return (0, 0x1234)

    with pytest.raises(accel.DeviceError, match="is a cuda stream, but the current accelerator is 'cpu'"):
        accel.Stream.from_torch(TorchCudaLike())
    # Everywhere accel takes a stream, __cuda_stream__ objects are read the same way.
    with pytest.raises(accel.DeviceError, match="is a CUDA stream, but the current accelerator is 'cpu'"):
        accel.Event().record(TorchCudaLike())



# -- host tensors over accel memory: what they keep alive -------------------------


def _as_tensor_of_a_freed_buffer(dtype, shape):
    buf = accel.memory.allocate(4096)
    tensor = as_tensor(buf, dtype, shape)
    buf.free()  # the tensor holds the memory now
    return tensor


# Each way a host tensor is built: empty's 1-D path over a whole ctypes view
# and over part of one, its general path (several dims, no elements), and
# as_tensor of a buffer freed while viewed.
_HOST_TENSORS = {
    "empty 1-D, whole view": lambda: accel.empty(4096, dtype=torch.uint8),
    "empty 1-D, part of a view": lambda: accel.empty(1000, dtype="float32"),
    "empty 2-D": lambda: accel.empty((32, 16), dtype=torch.float64),
    "empty, no elements": lambda: accel.empty((0, 4), dtype=torch.int32),
    "as_tensor, buffer freed": lambda: _as_tensor_of_a_freed_buffer(torch.int16, (32, 64)),
}


@pytest.mark.parametrize("make", list(_HOST_TENSORS.values()), ids=list(_HOST_TENSORS))
def test_host_tensor_memory_returns_to_the_cache_with_the_last_view(make):
    make()  # the first host tensor of a process takes a slower path; test the usual one
    gc.collect()  # tensors other tests dropped in cycles go now, not in the middle
    accel.memory.empty_cache()
    before = accel.memory.memory_allocated()
    tensor = make()
    allocated, reserved = accel.memory.memory_allocated(), accel.memory.memory_reserved()
    assert allocated > before
    ptr = tensor.untyped_storage().data_ptr()  # the block's address, even with no elements
    flat = tensor.view(-1)
    holders = {
        "slice": flat[1:],
        "transposed view": tensor.T if tensor.dim() == 2 else tensor.view(1, -1),
        "numpy array (Tensor.numpy)": tensor.numpy(),
        "numpy array (DLPack)": np.from_dlpack(tensor),
    }
    del tensor, flat
    for name in list(holders):
        gc.collect()
        assert accel.memory.memory_allocated() == allocated, f"the memory went back while a {name} used it"
        del holders[name]
    assert accel.memory.memory_allocated() == before
    assert accel.memory.memory_reserved() == reserved, "the memory went to the driver, not to the cache"
    again = accel.memory.allocate(allocated - before)
    assert again.ptr == ptr, "the cached block was not reused"
    again.free()


def test_host_tensor_held_by_a_reference_cycle_goes_back_when_collected():
    gc.collect()
    before = accel.memory.memory_allocated()
    cycle: list[object] = [accel.empty(4096, dtype=torch.uint8)[8:].numpy()]
    cycle.append(cycle)
    allocated = accel.memory.memory_allocated()
    del cycle
    assert accel.memory.memory_allocated() == allocated
    gc.collect()  # the buffer is freed from inside the collection (a finalizer)
    assert accel.memory.memory_allocated() == before
    accel.memory.allocate(4096).free()  # the allocator took the collected free


def test_as_tensor_of_a_buffer_waits_for_its_stream():
    producer = accel.Stream()
    buf = accel.memory.allocate(1 << 16, stream=producer)
    producer.launch_host_func(lambda: __import__("time").sleep(0.05))
    producer.fill(buf, 1)
    assert int(as_tensor(buf).min()) == 1
    buf.free()


def test_as_tensor_of_a_buffer_whose_stream_was_closed_waits_for_it():
    producer = accel.Stream()
    buf = accel.memory.allocate(1 << 16, stream=producer)
    producer.launch_host_func(lambda: __import__("time").sleep(0.05))
    producer.fill(buf, 2)
    producer.close()
    assert int(as_tensor(buf).min()) == 2
    buf.free()


# -- the compiled empty on the host (accel/_speedups.c): a DLPack capsule over a core block


def _allocated() -> int:
    return accel.memory_stats()["allocated_bytes.all.current"]


@pytest.mark.parametrize(
    "shape, dtype, strides",
    [(7, torch.float32, (1,)), ((2, 3), "int16", (3, 1)), ((), torch.float64, ()), ((0,), torch.uint8, (1,)),
     ((2, 0, 3), torch.float32, (3, 3, 1))],
)
def test_empty_on_the_host_is_contiguous_accel_memory_given_back_with_the_tensor(shape, dtype, strides):
    before = _allocated()
    for _ in range(2):  # the first call of a dtype resolves it in Python, the second is compiled
        t = accel.empty(shape, dtype=dtype)
        assert t.stride() == strides and t.is_contiguous() and t.device.type == "cpu"
        assert tuple(t.shape) == ((shape,) if isinstance(shape, int) else shape)
        assert _allocated() > before  # a tensor with no elements holds a block too
        t.fill_(3) if t.numel() else None
        assert int(t.sum()) == 3 * t.numel()
        del t
        assert _allocated() == before


def test_empty_refuses_bad_and_huge_shapes_with_accel_errors():
    before = _allocated()
    with pytest.raises(accel.InvalidValueError):
        accel.empty(-1)
    with pytest.raises(accel.InvalidValueError):
        accel.empty((2, -3))
    with pytest.raises(accel.InvalidValueError):
        accel.empty(1 << 64)
    with pytest.raises(accel.OutOfMemoryError):
        accel.empty((1 << 30, 1 << 30))  # fits int64, not the device
    with pytest.raises(accel.OutOfMemoryError):
        accel.empty((1 << 62, 1 << 62), dtype=torch.uint8)  # past int64 in all
    assert _allocated() == before


def test_an_empty_tensor_dropped_in_another_thread_gives_its_memory_back():
    before = _allocated()
    held = [accel.empty((64, 64), dtype=torch.float32) for _ in range(8)]
    views = [t[1:] for t in held]
    worker = threading.Thread(target=lambda: (held.clear(), views.clear()))
    worker.start()
    worker.join()
    assert _allocated() == before


def test_an_empty_tensor_freed_while_the_allocator_is_not_plain_takes_its_locked_free():
    # History recording turns the lock-free pair off: the tensor's deleter then frees
    # through the allocator's finalizer path.
    alloc = accel.memory.get_allocator()
    t = accel.empty(100, dtype=torch.uint8)
    before = _allocated()
    accel.memory.record_memory_history("all")
    try:
        assert not alloc._plain
        del t
        assert _allocated() == before - 512
    finally:
        accel.memory.record_memory_history(None)


def test_empty_tensors_alive_at_interpreter_exit_end_it_quietly():
    code = textwrap.dedent(
        """
        import threading, accel, torch
        keep = [accel.empty((16, 16), dtype=torch.float32) for _ in range(4)]
        cycle = [accel.empty(8, dtype=torch.uint8)]
        cycle.append(cycle)
        def hold():
            threading.current_thread().kept = accel.empty(4)
        threading.Thread(target=hold).start()
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stdout.strip(), out.stderr) == (0, "ok", "")
