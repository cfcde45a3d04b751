"""Allocator configuration strings are untrusted input: only accel's errors may escape the parser.

Random text, and near-valid text built from real keys, separators and numbers
of any length, are parsed; each either parses or raises AllocatorConfigError
(a ValueError, but accel's). Environment variables go through the same parser.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accel._errors import AllocatorConfigError
from accel.allocator import parse
from accel.allocator._config_keys import KEYS_BY_NAME, MAX_MIB
from accel.allocator.config import read_environment


def test_a_5000_digit_integer_is_a_config_error_and_leading_zeros_are_fine() -> None:
    with pytest.raises(AllocatorConfigError, match="a 5000-digit number is out of range"):
        parse("max_split_size_mb:" + "9" * 5000)
    with pytest.raises(AllocatorConfigError, match="a 5000-digit number is out of range"):
        parse("roundup_power2_divisions:[" + "1" * 5000 + ":4]")
    # PyTorch reads numbers with std::stoull, which skips leading zeros.
    assert parse("max_split_size_mb:" + "0" * 5000 + "20").max_split_size == 20 << 20
    assert parse("roundup_power2_divisions:[256:0004]").roundup_power2_divisions[0] == 4
    assert parse(f"max_split_size_mb:{MAX_MIB:08d}").max_split_size == MAX_MIB << 20


_numbers = st.one_of(
    st.integers(0, 2**70).map(str),
    st.integers(0, 6000).map(lambda n: "9" * n),
    st.integers(0, 6000).map(lambda n: "0" * n + "1"),
    st.floats(allow_nan=True).map(repr),
    st.sampled_from(["-1", "1e999", "0x10", "1_000", "", "True", "nan", "inf", "١٢"]),
)
_tokens = st.one_of(
    st.builds("{}:{}".format, st.sampled_from(sorted(KEYS_BY_NAME)), _numbers),
    st.builds("[{}:{}]".format, _numbers, _numbers),
    st.sampled_from(sorted(KEYS_BY_NAME)),
    st.sampled_from([":", ",", "[", "]", ">", " ", "\t", "\n", "cuda", "xpu", "native", "cudaMallocAsync"]),
    _numbers,
    st.text(max_size=6),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(_tokens, max_size=12).map("".join))
def test_near_valid_strings_parse_or_raise_a_config_error(text: str) -> None:
    try:
        parse(text)
    except AllocatorConfigError:
        pass


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_any_text_parses_or_raises_a_config_error(text: str) -> None:
    try:
        parse(text)
    except AllocatorConfigError:
        pass


@settings(max_examples=100, deadline=None)
@given(st.lists(_tokens, max_size=8).map("".join))
def test_environment_variables_are_read_through_the_same_checks(text: str) -> None:
    try:
        read_environment({"PYTORCH_ALLOC_CONF": text, "ACCEL_ALLOC_CONF": text})
    except AllocatorConfigError:
        pass
