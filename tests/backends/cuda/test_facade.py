"""The user-level API on the CUDA backend: what is CUDA-specific about it
(``__cuda_stream__``, external streams, where memory info comes from)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

import accel
from accel._runtime import Runtime, activate


@pytest.fixture
def runtime(cuda: Any) -> Iterator[Runtime]:
    with activate("cuda") as rt:
        yield rt


class ForeignStream:
    """What torch.cuda.Stream and CuPy streams look like to accel."""

    def __init__(self, handle: int) -> None:
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def test_streams_speak_cuda_stream_protocol(runtime: Runtime) -> None:
    s = accel.Stream()
    assert s.native_handle != 0
    assert s.__cuda_stream__() == (0, s.native_handle)
    s.close()


def test_foreign_cuda_stream_is_used_without_copying_ownership(runtime: Runtime, cuda: Any) -> None:
    raw = cuda.stream_create(0, 0)
    wrapped = accel.ExternalStream(raw)
    assert wrapped.native_handle == raw
    e = wrapped.record_event()
    e.synchronize()
    # Anything speaking __cuda_stream__ is accepted where a stream is expected.
    marker = accel.Event()
    marker.record(ForeignStream(raw))
    marker.synchronize()
    assert marker.query()
    wrapped.close()  # not owned: the CUstream stays alive
    assert cuda.stream_query(0, raw)
    cuda.stream_destroy(0, raw)


def test_memory_info_is_the_drivers(runtime: Runtime, cuda: Any) -> None:
    free, total = accel.get_memory_info(0)
    assert total == cuda.device_properties(0).total_memory
    assert 0 < free <= total
