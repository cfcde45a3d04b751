"""What stream copies and fills take: DLPack producers and buffer-protocol objects too."""

from __future__ import annotations

import array
import gc
import time
import weakref

import numpy as np
import pytest
import torch

import accel
from tests.conftest import CONFORMANCE_BACKENDS
from tests.fixtures.scripts import ok, run


@pytest.fixture
def filled():
    buf = accel.memory.allocate(16)
    accel.current_stream().fill(buf, 7)
    yield buf
    accel.synchronize()
    buf.free()


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.zeros(16, dtype=torch.uint8),
        lambda: torch.zeros(4, dtype=torch.float32),
        lambda: bytearray(16),
        lambda: memoryview(bytearray(16)),
        lambda: array.array("B", bytes(16)),
    ],
    ids=["torch-uint8", "torch-float32", "bytearray", "memoryview", "array"],
)
def test_copy_and_fill_take_dlpack_and_buffer_protocol_objects(filled, make):
    stream = accel.current_stream()
    dst = make()
    stream.copy(dst, filled)
    stream.synchronize()
    assert bytes(memoryview(np.asarray(dst)).cast("B")) == b"\x07" * 16
    stream.fill(dst, 3)
    stream.copy(filled, dst)
    check = bytearray(16)
    stream.copy(check, filled)
    stream.synchronize()
    assert check == b"\x03" * 16


def test_bytes_is_a_source_not_a_destination(filled):
    stream = accel.current_stream()
    stream.copy(filled, b"abcdefghijklmnop")
    out = bytearray(16)
    stream.copy(out, filled)
    stream.synchronize()
    assert out == b"abcdefghijklmnop"
    with pytest.raises(accel.InvalidValueError, match="read-only"):
        stream.copy(b"x" * 16, filled)


def test_a_tensor_view_is_copied_at_its_offset(filled):
    base = torch.zeros(8, dtype=torch.uint8)
    accel.current_stream().copy(base[4:], filled)
    accel.synchronize()
    assert base.tolist() == [0, 0, 0, 0, 7, 7, 7, 7]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: torch.zeros(4, 4, dtype=torch.uint8).t(), "non-contiguous"),
        (lambda: memoryview(bytearray(32))[::2], "non-contiguous"),
        (lambda: torch.zeros(16, requires_grad=True), "refused a DLPack export"),
    ],
    ids=["transposed-tensor", "strided-memoryview", "tensor-requiring-grad"],
)
def test_unusable_operands_are_refused_clearly(filled, make, match):
    with pytest.raises(accel.InvalidValueError, match=match):
        accel.current_stream().copy(make(), filled)


def test_a_dlpack_operand_lives_until_the_copy_ran(filled):
    stream = accel.Stream()
    gate = __import__("threading").Event()
    stream.launch_host_func(gate.wait)
    dst = torch.zeros(16, dtype=torch.uint8)
    alive = weakref.ref(dst)
    stream.copy(dst, filled)
    del dst
    gc.collect()
    assert alive() is not None, "the tensor died with its copy still queued"
    gate.set()
    stream.synchronize()
    stream.close()


@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_addresses_wider_than_a_pointer_are_refused(backend):
    # ctypes wrapped 2**64 to NULL: the host backend's worker segfaulted in memmove.
    code = """
import accel
buf = accel.memory.allocate(16)
stream = accel.Stream()
for address in (1 << 64, 1 << 100):
    for call in (lambda: stream.copy(buf, address, 16), lambda: stream.copy(address, buf, 16),
                 lambda: stream.fill(address, 0, 16)):
        try:
            call()
        except accel.InvalidValueError as exc:
            assert "is not a valid address" in str(exc), exc
        else:
            raise AssertionError(f"{address:#x} was taken")
stream.synchronize()
print("ok")
"""
    ok(run(backend, code, timeout=60))


def test_a_numpy_scalar_source_is_read_before_its_temporary_dies():
    # A numpy scalar's __array_interface__ points into a temporary array held
    # only by the interface dict: the copy read freed memory.
    stream = accel.Stream()
    buf = accel.memory.allocate(8, stream=stream)
    host = np.zeros(1, np.int64)
    for value in range(1, 50):
        stream.launch_host_func(lambda: time.sleep(0.001))  # the copy runs after the scalar's temporary is gone
        stream.copy(buf, np.int64(value))
        reuse = [np.full(1, -5, np.int64) for _ in range(4)]  # reuses freed memory of that size
        stream.copy(host, buf)
        stream.synchronize()
        del reuse
        assert host[0] == value
    buf.free()


def test_a_numpy_scalar_is_refused_as_a_destination():
    buf = accel.memory.allocate(8)
    with pytest.raises(accel.InvalidValueError, match="immutable scalar"):
        accel.current_stream().copy(np.int64(3), buf)
    buf.free()
