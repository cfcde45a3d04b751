"""AllocatorConfig: grammar, values, errors, sources, environment precedence, runtime changes."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from accel._errors import AccelError, AllocatorConfigError, DeviceError
from accel.allocator import (
    AllocatorConfig,
    AllocatorConfigWarning,
    ConfigStringError,
    add_change_listener,
    config_for_backend,
    get_config,
    keys,
    parse,
    read_environment,
    reload_from_environment,
    remove_change_listener,
    set_settings,
)
from accel.allocator import config as config_module

MIB = 1 << 20


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """No allocator variable set and the environment not yet read (a fresh process)."""
    for name in config_module._WATCHED:
        monkeypatch.delenv(name, raising=False)
    config_module._forget_for_tests()
    yield monkeypatch
    config_module._forget_for_tests()


# --------------------------------------------------------------------------- values


def test_defaults_match_pytorch() -> None:
    config = parse("")
    assert config == AllocatorConfig()
    assert config.large_segment_size == 20 * MIB
    assert config.max_split_size is None
    assert config.max_non_split_rounding == 20 * MIB
    assert config.garbage_collection_threshold == 0.0
    assert config.roundup_power2_divisions == (0,) * 16
    assert config.expandable_segments is False
    assert config.per_process_memory_fraction == 1.0
    assert config.pinned_max_round_threshold is None and config.pinned_max_cached_size is None
    assert config.pinned_num_register_threads == 1
    assert str(config) == ""
    assert set(config.sources.values()) == {"default"}


def test_sizes_are_bytes_and_whitespace_is_dropped_everywhere() -> None:
    config = parse(" max_split_size_mb : 2 56 ,\tpinned_max_cached_size_mb:0 , ")
    assert config.max_split_size == 256 * MIB
    assert config.pinned_max_cached_size == 0


@pytest.mark.parametrize(
    ("word", "value"),
    [("True", True), ("true", True), ("1", True), ("False", False), ("false", False), ("0", False)],
)
def test_booleans_accept_six_spellings(word: str, value: bool) -> None:
    assert parse(f"expandable_segments:{word}").expandable_segments is value


def test_large_segment_size_is_read_first_and_drags_non_split_rounding() -> None:
    config = parse("max_split_size_mb:40, large_segment_size_mb:40")
    assert config.large_segment_size == config.max_split_size == 40 * MIB
    assert config.max_non_split_rounding == 40 * MIB
    assert config.sources["max_non_split_rounding"] == "default"
    assert str(config) == "large_segment_size_mb:40,max_split_size_mb:40"
    explicit = parse("large_segment_size_mb:40,max_non_split_rounding_mb:64")
    assert explicit.max_non_split_rounding == 64 * MIB


def test_max_split_size_minus_one_means_unlimited() -> None:
    assert parse("max_split_size_mb:-1").max_split_size is None


def test_aliases_set_the_same_field() -> None:
    assert parse("release_lock_on_hipmalloc:True").release_lock_on_cudamalloc is True
    assert parse("pinned_use_hip_host_register:True").pinned_use_cuda_host_register is True


def test_last_duplicate_wins_with_a_warning() -> None:
    config = parse("max_split_size_mb:64,max_split_size_mb:128")
    assert config.max_split_size == 128 * MIB
    assert any("more than once" in w and "max_split_size_mb:128" in w for w in config.warnings)


# Vectors of the reference, §1.5 (c10 AllocatorConfigTest).
def test_roundup_example_a() -> None:
    config = parse("roundup_power2_divisions:[64:8,128:2,256:4,512:2,1024:4,>:1]")
    got = [config.roundup_divisions(mib * MIB) for mib in (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)]
    assert got == [8, 8, 2, 4, 2, 4, 1, 1, 1]


def test_roundup_example_b() -> None:
    config = parse("roundup_power2_divisions:[128:8,256:16,512:1,2048:8,>:2]")
    got = [config.roundup_divisions(mib * MIB) for mib in (64, 128, 256, 512, 1024, 2048, 4096)]
    assert got == [8, 8, 16, 1, 0, 8, 2]


def test_roundup_scalar_empty_list_and_lonely_tail() -> None:
    assert parse("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16
    assert parse("roundup_power2_divisions:[]").roundup_power2_divisions == (0,) * 16
    # PyTorch's rule: '>' fills from the slot after the last boundary, slot 1 when alone.
    assert parse("roundup_power2_divisions:[>:4]").roundup_power2_divisions == (0,) + (4,) * 15
    # Boundaries beyond 32768 MiB land in the last slot, as in PyTorch.
    assert parse("roundup_power2_divisions:[65536:4]").roundup_power2_divisions == (4,) * 16


def test_roundup_slot_rule() -> None:
    table = tuple(range(16))
    config = dataclasses.replace(AllocatorConfig(), roundup_power2_divisions=tuple(1 << i for i in table))
    assert config.roundup_divisions(0) == 1
    assert config.roundup_divisions(2 * MIB - 1) == 1
    assert config.roundup_divisions(2 * MIB) == 2
    assert config.roundup_divisions(3 * MIB) == 2
    assert config.roundup_divisions(32 << 30) == 1 << 15
    assert config.roundup_divisions(1 << 50) == 1 << 15


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("expandable_segments:true, max_split_size_mb:256", "max_split_size_mb:256,expandable_segments:True"),
        ("roundup_power2_divisions:[1:4,>:4]", "roundup_power2_divisions:4"),
        ("roundup_power2_divisions:[256:1,512:2,>:4]", "roundup_power2_divisions:[256:1,512:2,>:4]"),
        ("roundup_power2_divisions:[2:0,8:4]", "roundup_power2_divisions:[4:0,8:4]"),
        ("garbage_collection_threshold:5e-1", "garbage_collection_threshold:0.5"),
        ("backend:native", ""),
    ],
)
def test_canonical_form(text: str, canonical: str) -> None:
    config = parse(text)
    assert str(config) == canonical
    assert parse(canonical) == config


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "position", "fragment"),
    [
        ("max_split_size:128", 0, "did you mean max_split_size_mb?"),
        ("expandable_segments:True,garbage_collect_threshold:0.5", 25, "did you mean garbage_collection_threshold?"),
        ("Expandable_Segments:True", 0, "did you mean expandable_segments?"),
        ("zzz:1", 0, "--keys"),
        ("max_split_size_mb=128", 17, "not '='"),
        ("max_split_size_mb", 17, "expected ':'"),
        ("max_split_size_mb,30", 17, "expected ':'"),
        ("max_split_size_mb:", 18, "has no value"),
        ("max_split_size_mb:,expandable_segments:True", 18, "has no value"),
        (",max_split_size_mb:30", 0, "expected a key"),
        ("expandable_segments:True,,", 25, "empty setting"),
        ("expandable_segments:True:False", 24, "expected ','"),
        ("expandable_segments:yes", 20, "expected True or False"),
        ("max_split_size_mb:30abc", 18, "non-negative integer"),
        ("max_split_size_mb:-5", 18, "negative"),
        ("max_split_size_mb:19", 18, "must be >= large_segment_size_mb (20, the default)"),
        ("max_split_size_mb:17592186044416", 18, "out of range"),
        ("large_segment_size_mb:10", 22, "greater than 10"),
        ("large_segment_size_mb:40,max_non_split_rounding_mb:30", 51, "must be >= large_segment_size_mb (40)"),
        ("garbage_collection_threshold:1.0", 29, "(0.0, 1.0)"),
        ("garbage_collection_threshold:0", 29, "(0.0, 1.0)"),
        ("garbage_collection_threshold:nan", 29, "decimal number"),
        ("garbage_collection_threshold:1e-310", 29, "too small"),
        ("per_process_memory_fraction:1.01", 28, "[0.0, 1.0]"),
        ("roundup_power2_divisions:3", 25, "not a power of two"),
        ("roundup_power2_divisions:0", 25, "not a power of two"),
        ("roundup_power2_divisions:[100:1]", 26, "not a power of two"),
        ("roundup_power2_divisions:[64:3]", 29, "neither 0 nor a power of two"),
        ("roundup_power2_divisions:[128:8,64:4]", 32, "must increase"),
        ("roundup_power2_divisions:[64:8,>:2,1024:1]", 35, "must be the last"),
        ("roundup_power2_divisions:[64:8", 30, "expected ',' or ']'"),
        ("roundup_power2_divisions:[64:8,", 31, "not closed"),
        ("max_split_size_mb:[1]", 18, "not a list"),
        ("backend:cudamallocasync", 8, "did you mean cudaMallocAsync?"),
        ("pinned_num_register_threads:256", 28, "between 1 and 128"),
        ("pinned_reserve_segment_size_mb:0", 31, "greater than 0"),
    ],
)
def test_bad_strings_point_at_the_mistake(text: str, position: int, fragment: str) -> None:
    with pytest.raises(ConfigStringError) as info:
        parse(text)
    error = info.value
    assert isinstance(error, AllocatorConfigError) and isinstance(error, ValueError)
    assert isinstance(error, AccelError)
    assert error.position == position
    assert fragment in str(error)
    lines = str(error).splitlines()
    assert lines[1] == f"    '{text}'"
    assert lines[2].index("^") == 5 + position
    assert f"position {position}" in lines[0]


def test_suggestion_attribute() -> None:
    with pytest.raises(ConfigStringError) as info:
        parse("expandable_segment:True")
    assert info.value.suggestion == "expandable_segments"
    assert info.value.reason.startswith("unknown key")


def test_control_characters_do_not_break_the_caret() -> None:
    with pytest.raises(ConfigStringError) as info:
        parse("expandable_segments:True,\nfoo:1")
    lines = str(info.value).splitlines()
    assert lines[1] == "    'expandable_segments:True, foo:1'"
    assert lines[2].index("^") == 5 + 26


def test_not_a_string() -> None:
    with pytest.raises(AllocatorConfigError, match="must be a string"):
        parse(b"expandable_segments:True")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- the dataclass


def test_config_is_frozen_and_hashable_ignoring_sources() -> None:
    config = parse("expandable_segments:True")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.expandable_segments = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        config.sources["expandable_segments"] = "x"  # type: ignore[index]
    same = AllocatorConfig(expandable_segments=True)
    assert same == config and hash(same) == hash(config)
    assert same.sources["expandable_segments"] == "AllocatorConfig()"
    assert same.sources["max_split_size"] == "default"


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"max_split_size": 100}, "whole number of MiB"),
        ({"large_segment_size": 10 * MIB}, "large_segment_size"),
        ({"large_segment_size": 40 * MIB}, "max_non_split_rounding must be >= large_segment_size"),
        ({"garbage_collection_threshold": 1.0}, "garbage_collection_threshold"),
        ({"per_process_memory_fraction": 1}, "must be a float"),
        ({"per_process_memory_fraction": 5e-324}, "subnormal"),
        ({"roundup_power2_divisions": (3,) * 16}, "roundup_power2_divisions"),
        ({"roundup_power2_divisions": (0,) * 15}, "roundup_power2_divisions"),
        ({"expandable_segments": 1}, "must be a bool"),
        ({"allocator_backend": "async"}, "native, cudaMallocAsync"),
        ({"pinned_num_register_threads": 3}, "pinned_num_register_threads"),
        ({"sources": {"nope": "x"}}, "unknown fields"),
    ],
)
def test_direct_construction_is_validated(changes: dict, fragment: str) -> None:
    with pytest.raises(AllocatorConfigError, match="invalid AllocatorConfig|unknown fields") as info:
        AllocatorConfig(**changes)
    assert fragment in str(info.value)


def test_describe() -> None:
    config = parse("max_split_size_mb:256,pinned_max_cached_size_mb:64")
    assert config.describe("max_split_size") == "256 MiB"
    assert AllocatorConfig().describe("max_split_size") == "unlimited"
    assert AllocatorConfig().describe("pinned_max_round_threshold") == "unset"
    assert AllocatorConfig().describe("roundup_power2_divisions") == "0 (no rounding)"
    with pytest.raises(AllocatorConfigError, match="no allocator setting called 'max_split_size_mb'"):
        config.describe("max_split_size_mb")


def test_keys_cover_every_field_once() -> None:
    fields = [f.name for f in dataclasses.fields(AllocatorConfig) if f.name not in ("sources", "warnings")]
    assert sorted(spec.field for spec in keys()) == sorted(fields)
    assert {spec.key for spec in keys() if not spec.used_by_accel} == {
        "backend",
        "pinned_use_background_threads",
        "release_lock_on_cudamalloc",
        "pinned_use_cuda_host_register",
        "pinned_num_register_threads",
        "pinned_reserve_segment_size_mb",
        "graph_capture_record_stream_reuse",
        "pinned_free_catch_all",
        "throw_on_cudamalloc_oom",
    }


# --------------------------------------------------------------------------- warnings


def test_not_used_and_pinned_warnings() -> None:
    config = parse("throw_on_cudamalloc_oom:True,pinned_max_round_threshold_mb:256,pinned_max_cached_size_mb:128")
    assert any("throw_on_cudamalloc_oom (from parse()) is a PyTorch setting not used by accel" in w for w in config.warnings)
    assert any("pinned_max_round_threshold_mb (256) > pinned_max_cached_size_mb (128)" in w for w in config.warnings)
    assert parse("pinned_max_round_threshold_mb:64,pinned_max_cached_size_mb:128").warnings == ()


# --------------------------------------------------------------------------- environment (pure)


def test_environment_accel_variables_layer_key_by_key() -> None:
    report = read_environment(
        {
            "ACCEL_ALLOC_CONF": "max_split_size_mb:256,expandable_segments:True",
            "ACCEL_CUDA_ALLOC_CONF": "expandable_segments:False,garbage_collection_threshold:0.8",
        }
    )
    cuda, cpu = report.configs["cuda"], report.configs["cpu"]
    assert cuda.max_split_size == cpu.max_split_size == 256 * MIB
    assert cuda.expandable_segments is False and cpu.expandable_segments is True
    assert cuda.sources["max_split_size"] == "ACCEL_ALLOC_CONF"
    assert cuda.sources["expandable_segments"] == "ACCEL_CUDA_ALLOC_CONF"
    assert cpu.sources["garbage_collection_threshold"] == "default"
    assert report.used == ("ACCEL_ALLOC_CONF", "ACCEL_CUDA_ALLOC_CONF")
    assert report.warnings == ()


def test_environment_backend_variable_alone() -> None:
    report = read_environment({"ACCEL_XPU_ALLOC_CONF": "expandable_segments:True"})
    assert report.configs["xpu"].expandable_segments is True
    assert report.configs["cuda"].expandable_segments is False


def test_environment_cross_key_rule_spans_variables() -> None:
    with pytest.raises(ConfigStringError) as info:
        read_environment({"ACCEL_ALLOC_CONF": "max_split_size_mb:30", "ACCEL_CUDA_ALLOC_CONF": "large_segment_size_mb:40"})
    assert info.value.origin == "ACCEL_CUDA_ALLOC_CONF"
    assert "would exceed max_split_size_mb (30, from ACCEL_ALLOC_CONF)" in str(info.value)


def test_environment_pytorch_precedence_cuda_then_hip_then_alloc() -> None:
    report = read_environment(
        {"PYTORCH_ALLOC_CONF": "max_split_size_mb:30", "PYTORCH_HIP_ALLOC_CONF": "max_split_size_mb:50"}
    )
    assert report.configs["cpu"].max_split_size == 50 * MIB
    assert report.configs["cuda"].sources["max_split_size"] == "PYTORCH_HIP_ALLOC_CONF"
    assert report.used == ("PYTORCH_HIP_ALLOC_CONF",)
    (message,) = report.warnings
    assert "PYTORCH_HIP_ALLOC_CONF is used and PYTORCH_ALLOC_CONF ignored" in message
    report = read_environment(
        {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:40", "PYTORCH_ALLOC_CONF": "max_split_size_mb:30"}
    )
    assert report.configs["xpu"].max_split_size == 40 * MIB


def test_environment_empty_pytorch_variable_still_wins_and_says_so() -> None:
    report = read_environment({"PYTORCH_CUDA_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert report.configs["cuda"].expandable_segments is False
    assert any("PYTORCH_CUDA_ALLOC_CONF is used although it is empty" in w for w in report.warnings)


def test_environment_same_value_twice_is_no_conflict() -> None:
    report = read_environment({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert report.warnings == ()


def test_environment_accel_beats_pytorch_and_says_so() -> None:
    report = read_environment({"ACCEL_ALLOC_CONF": "", "PYTORCH_ALLOC_CONF": "expandable_segments:True"})
    assert report.configs["cuda"].expandable_segments is False
    (message,) = report.warnings
    assert "PYTORCH_ALLOC_CONF ignored by accel because ACCEL_ALLOC_CONF is set" in message
    assert report.configs["cpu"].warnings == (message,)


def test_environment_pytorch_xpu_variable_is_flagged() -> None:
    report = read_environment({"PYTORCH_XPU_ALLOC_CONF": "expandable_segments:True"})
    assert report.configs["xpu"].expandable_segments is False
    assert any("ACCEL_XPU_ALLOC_CONF" in w for w in report.warnings)


def test_environment_error_names_the_variable() -> None:
    with pytest.raises(ConfigStringError) as info:
        read_environment({"ACCEL_XPU_ALLOC_CONF": "expandable_segments:Ture"})
    assert info.value.origin == "ACCEL_XPU_ALLOC_CONF"
    assert str(info.value).startswith("invalid allocator configuration in ACCEL_XPU_ALLOC_CONF at position 20")


# --------------------------------------------------------------------------- process state


def test_environment_is_read_once_lazily(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("ACCEL_ALLOC_CONF", "max_split_size_mb:64")
    assert config_module._state.configs is None
    assert config_for_backend("cpu").max_split_size == 64 * MIB
    fresh.setenv("ACCEL_ALLOC_CONF", "max_split_size_mb:128")
    with pytest.warns(AllocatorConfigWarning, match="ACCEL_ALLOC_CONF changed after accel read"):
        assert config_for_backend("cpu").max_split_size == 64 * MIB
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config_for_backend("cpu")  # the same change is reported once
    reload_from_environment()
    assert config_for_backend("cuda").max_split_size == 128 * MIB


def test_invalid_environment_fails_every_call_until_fixed(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("ACCEL_CUDA_ALLOC_CONF", "max_split_size:64")
    for _ in range(2):
        with pytest.raises(ConfigStringError, match="ACCEL_CUDA_ALLOC_CONF"):
            config_for_backend("cpu")
    fresh.setenv("ACCEL_CUDA_ALLOC_CONF", "max_split_size_mb:64")
    assert config_for_backend("cuda").max_split_size == 64 * MIB


def test_warnings_are_emitted_once(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("ACCEL_ALLOC_CONF", "pinned_free_catch_all:True")
    with pytest.warns(AllocatorConfigWarning) as record:
        config_for_backend("cpu")
        config_for_backend("cuda")
    assert len(record) == 1
    assert "not used by accel" in str(record[0].message)
    assert config_for_backend("xpu").warnings == (str(record[0].message),)


_WARNING_PATHS = """\
import os, warnings
import accel
from accel.allocator import BackendResource, get_config

class NoVirtualMemory(BackendResource):
    def supports_virtual_memory(self):
        return False

warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    backend = accel.memory.get_allocator(0).backend  # warns: the environment read
    accel.memory.set_upstream(NoVirtualMemory(backend, 1), device=1)
    accel.memory.memory_stats(1)  # warns: an allocator made without virtual memory
    os.environ["ACCEL_ALLOC_CONF"] = "expandable_segments:False"
    get_config()  # warns: the change noticed
for w in caught:
    print(w.category.__name__, os.path.basename(w.filename), w.lineno)
"""


def test_configuration_warnings_name_the_callers_line(tmp_path: Path) -> None:
    # Each warning is reached through several of accel's frames, a different number on
    # each path: it must name the user's line, not one of accel's.
    script = tmp_path / "user_code.py"
    script.write_text(_WARNING_PATHS)
    env = {k: v for k, v in os.environ.items() if k not in config_module._WATCHED}
    env.update(ACCEL_BACKEND="cpu", ACCEL_CPU_DEVICES="2", PYTHONPATH=str(Path(__file__).resolve().parents[2]),
               ACCEL_ALLOC_CONF="expandable_segments:True,pinned_free_catch_all:True")
    result = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    expected = [f"AllocatorConfigWarning user_code.py {number}"
                for number, line in enumerate(_WARNING_PATHS.splitlines(), 1) if "# warns" in line]
    assert len(expected) == 3
    assert sorted(result.stdout.splitlines()) == sorted(expected), result.stdout


def test_set_settings_changes_only_named_keys(fresh: pytest.MonkeyPatch) -> None:
    fresh.setenv("ACCEL_ALLOC_CONF", "max_split_size_mb:256,garbage_collection_threshold:0.6")
    set_settings("expandable_segments:True", backend="cuda")
    cuda = config_for_backend("cuda")
    assert cuda.expandable_segments is True
    assert cuda.max_split_size == 256 * MIB and cuda.garbage_collection_threshold == 0.6
    assert cuda.sources["expandable_segments"] == "set_settings()"
    assert cuda.sources["max_split_size"] == "ACCEL_ALLOC_CONF"
    assert config_for_backend("cpu").expandable_segments is False
    set_settings("max_split_size_mb:-1")
    assert all(config_for_backend(name).max_split_size is None for name in ("cpu", "cuda", "xpu"))


def test_set_settings_large_segment_keeps_rules(fresh: pytest.MonkeyPatch) -> None:
    set_settings("large_segment_size_mb:32")
    assert config_for_backend("cpu").max_non_split_rounding == 32 * MIB
    set_settings("max_split_size_mb:40")
    with pytest.raises(ConfigStringError, match="would exceed max_split_size_mb"):
        set_settings("large_segment_size_mb:64")
    assert config_for_backend("cpu").large_segment_size == 32 * MIB


def test_set_settings_is_all_or_nothing_on_bad_input(fresh: pytest.MonkeyPatch) -> None:
    before = config_for_backend("cuda")
    with pytest.raises(ConfigStringError) as info:
        set_settings("expandable_segments:True,max_split_size_mb:1")
    assert info.value.origin == "set_settings()"
    assert config_for_backend("cuda") == before
    with pytest.raises(AllocatorConfigError, match="no backend called 'gpu'"):
        set_settings("expandable_segments:True", backend="gpu")


def test_listener_sees_old_and_new_and_can_refuse(fresh: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, bool, bool]] = []

    def listener(backend: str, old: AllocatorConfig, new: AllocatorConfig) -> None:
        calls.append((backend, old.expandable_segments, new.expandable_segments))
        if backend == "xpu" and new.expandable_segments:
            raise AllocatorConfigError("xpu:0 has live segments; cannot switch expandable_segments now")

    add_change_listener(listener)
    try:
        with pytest.raises(AllocatorConfigError, match="live segments"):
            set_settings("expandable_segments:True")
        assert calls[-1] == ("xpu", False, True)
        # Refused by one backend: nothing changed anywhere.
        assert not any(config_for_backend(name).expandable_segments for name in ("cpu", "cuda", "xpu"))
        calls.clear()
        set_settings("expandable_segments:True", backend="cuda")
        assert calls == [("cuda", False, True)]
        calls.clear()
        set_settings("expandable_segments:True", backend="cuda")  # no change, no call
        assert calls == []
    finally:
        remove_change_listener(listener)
    with pytest.raises(AllocatorConfigError, match="not a registered change listener"):
        remove_change_listener(listener)
    with pytest.raises(AllocatorConfigError, match="must be callable"):
        add_change_listener("not a function")  # type: ignore[arg-type]


def test_reload_goes_through_listeners(fresh: pytest.MonkeyPatch) -> None:
    set_settings("expandable_segments:True")
    refusals = []

    def refuse(backend: str, old: AllocatorConfig, new: AllocatorConfig) -> None:
        refusals.append(backend)
        raise AllocatorConfigError("busy")

    add_change_listener(refuse)
    try:
        with pytest.raises(AllocatorConfigError, match="busy"):
            reload_from_environment()
    finally:
        remove_change_listener(refuse)
    assert refusals and config_for_backend("cpu").expandable_segments is True
    reload_from_environment()
    assert config_for_backend("cpu").expandable_segments is False


def test_get_config_resolves_the_backend(fresh: pytest.MonkeyPatch) -> None:
    set_settings("expandable_segments:True", backend="xpu")
    assert get_config("xpu:1").expandable_segments is True
    assert get_config("cuda").expandable_segments is False

    class FakeDevice:
        type = "xpu"

    assert get_config(FakeDevice()).expandable_segments is True
    for bad in ("tpu:0", 1.5, object()):
        with pytest.raises(DeviceError, match="cannot tell the backend"):
            get_config(bad)
    with pytest.raises(AllocatorConfigError, match="no backend called 'tpu'"):
        config_for_backend("tpu")


def test_concurrent_readers_and_writers(fresh: pytest.MonkeyPatch) -> None:
    errors: list[BaseException] = []
    values = (64, 128, 256)

    def writer(mib: int) -> None:
        try:
            for _ in range(50):
                set_settings(f"max_split_size_mb:{mib}")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def reader() -> None:
        try:
            for _ in range(200):
                assert config_for_backend("cuda").max_split_size in (None, *(v * MIB for v in values))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(v,)) for v in values]
    threads += [threading.Thread(target=reader) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    final = {config_for_backend(name).max_split_size for name in ("cpu", "cuda", "xpu")}
    assert len(final) == 1


def test_error_pickles_and_names_its_public_module() -> None:
    import pickle

    with pytest.raises(ConfigStringError) as info:
        parse("expandable_segment:True")
    copy = pickle.loads(pickle.dumps(info.value))
    assert str(copy) == str(info.value) and copy.suggestion == "expandable_segments"
    assert ConfigStringError.__module__ == "accel.allocator"


def test_docs_cover_every_key() -> None:
    from pathlib import Path

    docs = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for spec in keys():
        for name in (spec.key, *spec.aliases):
            assert f"`{name}`" in docs, name
        assert f"`{spec.field}`" in docs, spec.field


def test_listener_cannot_change_settings(fresh: pytest.MonkeyPatch) -> None:
    def meddle(backend: str, old: AllocatorConfig, new: AllocatorConfig) -> None:
        set_settings("max_split_size_mb:64")

    add_change_listener(meddle)
    try:
        with pytest.raises(AllocatorConfigError, match="inside a change listener"):
            set_settings("expandable_segments:True")
    finally:
        remove_change_listener(meddle)
    assert config_for_backend("cpu") == AllocatorConfig()


def test_get_config_without_device_asks_the_runtime(fresh: pytest.MonkeyPatch) -> None:
    import sys
    import types

    runtime = types.ModuleType("accel._runtime")
    runtime.current_backend_name = lambda: "xpu"  # type: ignore[attr-defined]
    fresh.setitem(sys.modules, "accel._runtime", runtime)
    set_settings("expandable_segments:True", backend="xpu")
    assert get_config().expandable_segments is True
    assert get_config(0).expandable_segments is True


def test_repeated_roundup_list_overlays_like_pytorch() -> None:
    # PyTorch resets the table once per string, so a later list only overwrites the slots it reaches.
    config = parse("roundup_power2_divisions:4,roundup_power2_divisions:[64:8]")
    assert config.roundup_power2_divisions == (8,) * 7 + (4,) * 9
    assert any("applied on top of the earlier value" in w for w in config.warnings)
    assert parse("roundup_power2_divisions:1,roundup_power2_divisions:[]").roundup_power2_divisions == (1,) * 16
    # Across strings (a set_settings() call) the named key is replaced whole.
    base = parse("roundup_power2_divisions:4")
    later = config_module._apply(base, config_module.parse_settings("roundup_power2_divisions:[64:8]", "x"), "x", "")
    assert later.roundup_power2_divisions == (8,) * 7 + (0,) * 9


def test_docstring_examples(fresh: pytest.MonkeyPatch) -> None:
    import doctest

    import accel.allocator
    from accel.allocator import _config_keys, _config_parse

    for module in (accel.allocator, config_module, _config_keys, _config_parse):
        result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
        assert result.failed == 0, module.__name__
    assert doctest.testmod(config_module).attempted >= 8
