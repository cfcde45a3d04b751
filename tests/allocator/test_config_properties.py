"""Property tests: valid configs round-trip, corrupted strings are rejected at the right place."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from accel._errors import AllocatorConfigError
from accel.allocator import AllocatorConfig, ConfigStringError, keys, parse
from accel.allocator._config_keys import KEYS_BY_NAME, MAX_MIB, KeySpec

MIB = 1 << 20
POWERS = [0] + [1 << i for i in range(64)]


@st.composite
def roundup_tables(draw: st.DrawFn) -> tuple[int, ...]:
    """Tables built from runs, so the scalar, list and '>' forms all show up."""
    table: list[int] = []
    while len(table) < 16:
        run = draw(st.integers(1, 16 - len(table)))
        table += [draw(st.sampled_from(POWERS[:12] + [1 << 63]))] * run
    return tuple(table)


mib_sizes = st.one_of(st.integers(0, 4096), st.just(MAX_MIB)).map(lambda m: m * MIB)
fractions = st.floats(0.0, 1.0, allow_nan=False, allow_subnormal=False)


@st.composite
def configs(draw: st.DrawFn) -> AllocatorConfig:
    large = draw(st.one_of(st.integers(11, 128), st.integers(11, MAX_MIB))) * MIB
    at_least_large = st.integers(large // MIB, MAX_MIB).map(lambda m: m * MIB)
    return AllocatorConfig(
        large_segment_size=large,
        max_split_size=draw(st.none() | at_least_large),
        max_non_split_rounding=draw(at_least_large),
        garbage_collection_threshold=draw(
            st.just(0.0) | st.floats(0.0, 1.0, exclude_min=True, exclude_max=True, allow_subnormal=False)
        ),
        roundup_power2_divisions=draw(roundup_tables()),
        expandable_segments=draw(st.booleans()),
        pinned_use_background_threads=draw(st.booleans()),
        pinned_max_round_threshold=draw(st.none() | mib_sizes),
        pinned_max_cached_size=draw(st.none() | mib_sizes),
        per_process_memory_fraction=draw(fractions),
        allocator_backend=draw(st.sampled_from(["native", "cudaMallocAsync"])),
        release_lock_on_cudamalloc=draw(st.booleans()),
        pinned_use_cuda_host_register=draw(st.booleans()),
        pinned_num_register_threads=draw(st.sampled_from([1 << i for i in range(8)])),
        pinned_reserve_segment_size=draw(st.just(0) | st.integers(1, MAX_MIB).map(lambda m: m * MIB)),
        graph_capture_record_stream_reuse=draw(st.booleans()),
        pinned_free_catch_all=draw(st.booleans()),
        throw_on_cudamalloc_oom=draw(st.booleans()),
    )


@settings(max_examples=300, deadline=None)
@given(configs())
def test_render_then_parse_gives_an_equal_config(config: AllocatorConfig) -> None:
    text = str(config)
    again = parse(text)
    assert again == config
    assert str(again) == text


# A second, independent writer: any spelling PyTorch's grammar allows.
def _write_value(draw: st.DrawFn, spec: KeySpec, value: object) -> str:
    if spec.kind == "bool":
        return draw(st.sampled_from(["True", "true", "1"] if value else ["False", "false", "0"]))
    if spec.kind == "float":
        return repr(value)
    if spec.kind == "choice":
        return str(value)
    if spec.kind == "roundup":
        table = value
        assert isinstance(table, tuple)
        if len(set(table)) == 1 and table[0]:
            return str(table[0])
        # One explicit entry per slot always works.
        return "[" + ",".join(f"{1 << slot}:{d}" for slot, d in enumerate(table)) + "]"
    if spec.unit == "MiB":
        if value is None:
            return "-1"
        assert isinstance(value, int)
        return str(value // MIB)
    return str(value)


@st.composite
def written_configs(draw: st.DrawFn) -> tuple[str, AllocatorConfig]:
    config = draw(configs())
    items = []
    for spec in keys():
        value = getattr(config, spec.field)
        if value is None and spec.field != "max_split_size":
            continue  # an unset pinned limit has no spelling
        if value == 0 and spec.field in ("garbage_collection_threshold", "pinned_reserve_segment_size"):
            continue  # "off" is only reachable by leaving the key out
        name = draw(st.sampled_from((spec.key, *spec.aliases)))
        items.append((name, _write_value(draw, spec, value)))
    items = draw(st.permutations(items))
    space = st.sampled_from(["", "", " ", "  ", "\t"])
    parts = [f"{draw(space)}{k}{draw(space)}:{draw(space)}{v}{draw(space)}" for k, v in items]
    text = ",".join(parts) + draw(st.sampled_from(["", ","]))
    return text, config


@settings(max_examples=200, deadline=None)
@given(written_configs())
def test_any_valid_spelling_parses_to_the_same_config(case: tuple[str, AllocatorConfig]) -> None:
    text, config = case
    assert parse(text) == config
    assert parse(str(config)) == config


# --------------------------------------------------------------------------- corruption

CORRUPTIONS = ("typo_key", "bad_value", "drop_colon", "equals", "double_comma", "truncate", "unknown_key")


@st.composite
def corrupted(draw: st.DrawFn) -> tuple[str, int, str]:
    """A valid string with one mistake, the index the error must point at, and the kind."""
    config = draw(configs())
    items = _items(str(config))
    assume(items)
    kind = draw(st.sampled_from(CORRUPTIONS))
    index = draw(st.integers(0, len(items) - 1))
    key, value = items[index]
    prefix = ",".join(f"{k}:{v}" for k, v in items[:index])
    start = len(prefix) + (1 if prefix else 0)  # where item `index` starts
    rest = ",".join(f"{k}:{v}" for k, v in items[index + 1 :])
    tail = ("," + rest) if rest else ""
    lead = prefix + ("," if prefix else "")
    if kind == "typo_key":
        cut = draw(st.integers(0, len(key) - 1))
        typo = key[:cut] + key[cut + 1 :]
        assume(typo not in KEYS_BY_NAME)
        return f"{lead}{typo}:{value}{tail}", start, kind
    if kind == "bad_value":
        garbage = draw(st.sampled_from(["?", "x", "-", "=1", "1.2.3"]))
        return f"{lead}{key}:{garbage}{value}{tail}", start + len(key) + 1, kind
    if kind == "drop_colon":
        # A list value keeps its '[' token, so the error is where the ':' should be.
        return f"{lead}{key}{value}{tail}", start + (len(key) if value.startswith("[") else 0), kind
    if kind == "equals":
        return f"{lead}{key}={value}{tail}", start + len(key), kind
    if kind == "double_comma":
        assume(tail)
        end = start + len(key) + 1 + len(value)
        return f"{lead}{key}:{value},{tail}", end + 1, kind
    if kind == "truncate":
        text = f"{lead}{key}:"
        return text, len(text), kind
    text = f"{lead}no_such_key:1,{key}:{value}{tail}"
    return text, start, kind


def _items(text: str) -> list[tuple[str, str]]:
    """Split a canonical string into (key, value) pairs; list values contain commas."""
    items = []
    depth = 0
    current = ""
    for ch in text + ",":
        if ch == "," and depth == 0:
            if current:
                key, _, value = current.partition(":")
                items.append((key, value))
            current = ""
            continue
        depth += ch == "["
        depth -= ch == "]"
        current += ch
    return items


@settings(max_examples=400, deadline=None)
@given(corrupted())
def test_corrupted_strings_are_rejected_at_the_right_position(case: tuple[str, int, str]) -> None:
    text, position, kind = case
    with pytest.raises(ConfigStringError) as info:
        parse(text)
    error = info.value
    assert error.position == position, (kind, str(error))
    assert error.text == text
    lines = str(error).splitlines()
    assert lines[1] == f"    '{text}'"
    assert lines[2].index("^") == 5 + position
    if kind == "typo_key":
        assert error.suggestion is not None and error.suggestion in str(error)


def test_typo_suggests_the_intended_key() -> None:
    # Every single-character deletion of every key suggests the key itself.
    for spec in keys():
        for cut in range(len(spec.key)):
            typo = spec.key[:cut] + spec.key[cut + 1 :]
            if typo in KEYS_BY_NAME:
                continue
            with pytest.raises(ConfigStringError) as info:
                parse(f"{typo}:1")
            assert info.value.suggestion == spec.key, typo


def test_dataclasses_replace_is_validated() -> None:
    config = parse("large_segment_size_mb:64")
    assert dataclasses.replace(config, max_split_size=128 * MIB).max_split_size == 128 * MIB
    with pytest.raises(AllocatorConfigError, match="max_split_size must be >= large_segment_size"):
        dataclasses.replace(config, max_split_size=32 * MIB)
