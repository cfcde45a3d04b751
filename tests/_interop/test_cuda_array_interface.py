"""``__cuda_array_interface__`` v3: the dict for CUDA buffers, absent elsewhere."""

from __future__ import annotations

import pytest

import accel
from accel._interop import cuda_array_interface


class _Stream:
    def __init__(self, handle: int) -> None:
        self.native_handle = handle


class CudaLike:
    """A CUDA buffer's attributes (no CUDA device is needed to build the dict)."""

    def __init__(self, nbytes: int = 256, stream_handle: int = 0x5000) -> None:
        self.ptr, self.nbytes = 0x7F0000000200, nbytes
        self.device = accel.Device("cuda", 1)
        self.stream = _Stream(stream_handle)


def test_version_3_dict():
    cai = cuda_array_interface(CudaLike())
    assert cai == {
        "version": 3,
        "shape": (256,),
        "typestr": "|u1",
        "descr": [("", "|u1")],
        "data": (0x7F0000000200, False),
        "strides": None,
        "stream": 0x5000,
    }


def test_default_stream_is_reported_as_legacy_default():
    # A CUstream of 0 is forbidden in CAI v3; the legacy default stream is 1.
    assert cuda_array_interface(CudaLike(stream_handle=0))["stream"] == 1


def test_zero_size_buffer_reports_a_null_pointer():
    assert cuda_array_interface(CudaLike(nbytes=0))["data"] == (0, False)


def test_absent_on_host_buffers(host_buffer):
    buf = host_buffer(16)
    assert not hasattr(buf, "__cuda_array_interface__")
    with pytest.raises(AttributeError, match="only defined for CUDA buffers; this one is on cpu:0"):
        cuda_array_interface(buf)


def test_buffer_without_a_stream_handle():
    buf = CudaLike()
    buf.stream = object()
    with pytest.raises(AttributeError, match="no native_handle"):
        cuda_array_interface(buf)
