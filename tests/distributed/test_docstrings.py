"""The examples in accel.distributed's docstrings run (a one-rank Gloo group, in a fresh interpreter)."""

from __future__ import annotations

import pytest

from tests.fixtures.scripts import ok, run

CODE = """
import doctest, importlib
for name in ("accel.distributed", "accel.distributed._collective", "accel.distributed._memory"):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0, (name, result)
print("ok")
"""


def test_docstring_examples() -> None:
    pytest.importorskip("torch.distributed")
    ok(run("cpu", CODE, timeout=120))
