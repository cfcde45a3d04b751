"""FreeList against a plain sorted list: same order, same best fit, through bucket splits."""

from __future__ import annotations

from bisect import bisect_left, insort
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accel.allocator import _freelist
from accel.allocator._freelist import FreeList

ops = st.lists(
    st.tuples(st.sampled_from(["add", "remove", "replace", "fit"]), st.integers(1, 64), st.integers(0, 40)),
    max_size=300,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_matches_a_sorted_list(script):
    # Small buckets, so that the examples split buckets and empty them.
    old_load, _freelist.LOAD = _freelist.LOAD, 2
    try:
        run_script(script)
    finally:
        _freelist.LOAD = old_load


def run_script(script):
    free, model, blocks = FreeList(), [], {}
    for op, size, ptr in script:
        size *= 512
        key = (size, ptr)
        if op == "add" and key not in blocks:
            b = blocks[key] = SimpleNamespace(size=size, ptr=ptr)
            free.add(b)
            insort(model, key)
        elif op == "remove" and model:
            victim = model.pop(ptr % len(model))
            free.remove(blocks.pop(victim))
        elif op == "replace" and model:
            old = model.pop(ptr % len(model))
            b = blocks.pop(old)
            if (size, b.ptr) in blocks:
                model.insert(bisect_left(model, old), old)
                blocks[old] = b
                continue
            b.size = size
            free.replace(old[0], old[1], b)
            blocks[(size, b.ptr)] = b
            insort(model, (size, b.ptr))
        elif op == "fit":
            i = bisect_left(model, (size,))
            got = free.best_fit(size)
            assert (got is None) if i == len(model) else (got is blocks[model[i]])
            assert [(b.size, b.ptr) for b in free.at_least(size)] == model[i:]
        assert [(s, p) for s, p, _ in free] == model
        assert len(free) == len(model)
        assert free.largest() == (model[-1][0] if model else 0)
        if model:
            assert free[-1][:2] == model[-1] and free[0][:2] == model[0]


def test_missing_block_is_a_clear_error():
    free = FreeList()
    b = SimpleNamespace(size=512, ptr=0)
    with pytest.raises(ValueError, match="not on this free list"):
        free.remove(b)
    free.add(b)
    with pytest.raises(ValueError, match="no block of 1024 bytes"):
        free.replace(1024, 0, b)
    with pytest.raises(IndexError):
        free[1]
