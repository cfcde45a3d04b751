"""The examples in accel.graph's docstrings run and print what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = ["accel.graph", "accel.graph._graph", "accel.graph._pool", "accel.graph._graphed", "accel.graph._compiled"]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name: str) -> None:
    pytest.importorskip("torch")
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
