"""The examples in the interop docstrings run."""

from __future__ import annotations

import doctest

import pytest

from accel._interop import _cuda_array_interface, _dlpack, _host
from accel._interop import torch as interop_torch
from accel.stream._stream import Stream


@pytest.mark.parametrize("module", [_dlpack, _cuda_array_interface, _host, interop_torch], ids=lambda m: m.__name__)
def test_module_examples(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.failed == 0 and result.attempted > 0


def test_stream_interop_examples():
    for method in (Stream.from_torch,):
        finder = doctest.DocTestFinder()
        runner = doctest.DocTestRunner()
        for test in finder.find(method, globs={}):
            runner.run(test)
        assert runner.failures == 0 and runner.tries > 0
