"""Exportable objects over real host memory, shaped like accel.memory's Buffer."""

from __future__ import annotations

import gc

import pytest

import accel
from accel._interop import _dlpack, cuda_array_interface
from accel.backends import load_backend


class HostBuffer:
    """``ptr``, ``nbytes``, ``device``, ``stream`` over a real host-backend allocation,
    speaking the protocols the way Buffer does. The memory is freed by the
    fixture at teardown, never from a finalizer (a finalizer may run inside
    the backend's own malloc, which holds the lock free needs)."""

    def __init__(self, nbytes: int, stream: accel.Stream | None = None, device: accel.Device | None = None) -> None:
        self.nbytes = nbytes
        self.device = device or accel.Device("cpu", 0)
        self.stream = stream or accel.current_stream()
        self.ptr = load_backend("cpu").malloc(0, max(nbytes, 1))

    def __dlpack__(self, *, stream=None, max_version=None, dl_device=None, copy=None):
        return _dlpack.to_capsule(self, stream=stream, max_version=max_version, dl_device=dl_device, copy=copy)

    def __dlpack_device__(self):
        return _dlpack.dlpack_device(self)

    @property
    def __cuda_array_interface__(self):
        return cuda_array_interface(self)


@pytest.fixture
def host_buffer():
    """A factory of HostBuffers; their memory goes back when the test ends."""
    made: list[int] = []

    def make(nbytes: int, stream: accel.Stream | None = None, device: accel.Device | None = None) -> HostBuffer:
        buf = HostBuffer(nbytes, stream, device)
        made.append(buf.ptr)
        return buf

    yield make
    accel.synchronize()  # stream work queued on them has run
    backend = load_backend("cpu")
    for ptr in made:
        backend.free(0, ptr)


@pytest.fixture(autouse=True)
def _no_leaked_exports():
    """Every test leaves no exported tensor holding its owner."""
    before = _dlpack.live_exports()
    yield
    if _dlpack.live_exports() != before:
        gc.collect()  # slow with torch loaded, so only when refcounting did not settle it
    assert _dlpack.live_exports() == before
