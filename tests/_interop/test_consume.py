"""accel.from_dlpack: foreign memory seen as an accel buffer, without a copy."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest
import torch

import accel
from accel._interop import ForeignBuffer, _dlpack


@pytest.mark.parametrize("make", [lambda: torch.zeros(8, dtype=torch.uint8), lambda: np.zeros(8, np.uint8)],
                         ids=["torch", "numpy"])
def test_a_view_of_the_producers_memory(make):
    source = make()
    view = accel.from_dlpack(source)
    assert isinstance(view, ForeignBuffer)
    assert (view.nbytes, view.shape, view.device) == (8, (8,), accel.Device("cpu", 0))
    accel.current_stream().fill(view, 1)
    accel.synchronize()
    assert source.tolist() == [1] * 8
    again = np.from_dlpack(view)  # and it exports again
    assert again.tolist() == [1] * 8


def test_an_offset_view_and_dtype_size():
    base = torch.zeros(8, dtype=torch.int32)
    view = accel.from_dlpack(base[2:6])
    assert view.nbytes == 16
    accel.current_stream().fill(view, 0xFF)
    accel.synchronize()
    assert base.tolist() == [0, 0, -1, -1, -1, -1, 0, 0]


def test_the_producer_is_released_with_the_view():
    accel.memory.empty_cache()
    before = accel.memory.memory_allocated()
    buf = accel.memory.allocate(16)
    view = accel.from_dlpack(buf)
    buf.free()
    assert accel.memory.memory_allocated() > before, "the view still holds the memory"
    view.free()
    assert view.freed
    with pytest.raises(accel.InvalidHandleError):
        view.ptr  # noqa: B018
    assert _dlpack.live_exports() == 0
    assert accel.memory.memory_allocated() == before


def test_a_dropped_view_releases_its_producer():
    source = torch.zeros(4)
    alive = weakref.ref(source)
    view = accel.from_dlpack(source)
    del source
    assert alive() is not None
    del view
    gc.collect()
    assert alive() is None


def test_a_capsule_is_taken_once():
    capsule = torch.zeros(4).__dlpack__()
    view = accel.from_dlpack(capsule)
    assert view.nbytes == 16
    with pytest.raises(accel.InvalidValueError, match="unused DLPack capsule"):
        accel.from_dlpack(capsule)


@pytest.mark.parametrize(
    ("x", "match"),
    [
        (5, "DLPack producer"),
        (torch.zeros(4, 4).t(), "C-contiguous"),
        (torch.zeros(4, requires_grad=True), "refused a DLPack export"),
    ],
    ids=["int", "transposed", "requires-grad"],
)
def test_refusals_are_accel_errors(x, match):
    with pytest.raises(accel.InvalidValueError, match=match):
        accel.from_dlpack(x)
