"""``python -m accel config``: explain, check, list keys; text and JSON."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel._cli import main
from accel.allocator import config as config_module

ROOT = Path(__file__).parents[2]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in config_module._WATCHED:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(["config", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def test_check_valid_string(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--check", " max_split_size_mb: 1024, backend:native, expandable_segments:true")
    assert code == 0
    assert out.splitlines()[0] == "valid (3 settings)"
    assert "max_split_size_mb    1024 MiB" in out
    assert "(not used by accel)" in out
    assert "canonical form: 'max_split_size_mb:1024,expandable_segments:True'" in out
    assert "warning: backend (from the --check string)" in out


def test_check_invalid_string_exits_1_with_a_pointed_message(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "--check", "expandable_segments:True,max_split_size:256")
    assert code == 1 and out == ""
    lines = err.splitlines()
    assert lines[0].startswith("accel config: invalid allocator configuration in the --check string at position 25")
    assert "did you mean max_split_size_mb?" in lines[0]
    assert lines[2].index("^") == 5 + 25
    assert "Traceback" not in err


def test_check_json(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--check", "roundup_power2_divisions:[64:8,>:2]", "--json")
    assert code == 0
    payload = json.loads(out)
    assert payload["valid"] is True
    assert payload["settings"] == {"roundup_power2_divisions": [8] * 7 + [2] * 9}
    assert payload["canonical"] == "roundup_power2_divisions:[64:8,>:2]"
    code, out, _ = run(capsys, "--check", "garbage_collection_threshold:2", "--json")
    assert code == 1
    payload = json.loads(out)
    assert payload["valid"] is False and payload["position"] == 29 and payload["end"] == 30
    assert "(0.0, 1.0)" in payload["reason"]


def test_check_is_pure(env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    env.setenv("ACCEL_ALLOC_CONF", "not valid at all")
    config_module._forget_for_tests()
    code, _, _ = run(capsys, "--check", "expandable_segments:True")
    assert code == 0
    assert config_module._state.configs is None


def test_show_environment_text(env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    env.setenv("ACCEL_ALLOC_CONF", "max_split_size_mb:256,pinned_num_register_threads:4")
    env.setenv("ACCEL_CUDA_ALLOC_CONF", "expandable_segments:True")
    env.setenv("PYTORCH_ALLOC_CONF", "expandable_segments:False")
    code, out, _ = run(capsys, "--backend", "cuda")
    assert code == 0
    assert "ACCEL_ALLOC_CONF         'max_split_size_mb:256,pinned_num_register_threads:4'  used" in out
    assert "PYTORCH_ALLOC_CONF       'expandable_segments:False'  ignored" in out
    assert "ACCEL_XPU_ALLOC_CONF     not set" in out
    assert "Backend cuda:  'max_split_size_mb:256,expandable_segments:True,pinned_num_register_threads:4'" in out
    assert "Backend cpu" not in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and len(line.split()) > 2}
    assert rows["max_split_size_mb"].split()[1:] == ["256", "MiB", "ACCEL_ALLOC_CONF"]
    assert rows["expandable_segments"].split()[1:] == ["True", "ACCEL_CUDA_ALLOC_CONF"]
    assert "default (= large_segment_size_mb)" in rows["max_non_split_rounding_mb"]
    assert rows["pinned_num_register_threads"].endswith("(not used by accel)")
    assert "PYTORCH_ALLOC_CONF ignored by accel because" in out
    assert "pinned_num_register_threads (from ACCEL_ALLOC_CONF)" in out


def test_show_environment_json_every_backend(env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    env.setenv("PYTORCH_CUDA_ALLOC_CONF", "garbage_collection_threshold:0.5")
    code, out, _ = run(capsys, "--json")
    assert code == 0
    payload = json.loads(out)
    assert payload["used"] == ["PYTORCH_CUDA_ALLOC_CONF"]
    assert set(payload["backends"]) == {"cpu", "cuda", "xpu"}
    rows = {row["key"]: row for row in payload["backends"]["xpu"]["settings"]}
    assert rows["garbage_collection_threshold"]["value"] == 0.5
    assert rows["garbage_collection_threshold"]["source"] == "PYTORCH_CUDA_ALLOC_CONF"
    assert rows["max_split_size_mb"]["value"] is None
    assert rows["max_split_size_mb"]["display"] == "unlimited"
    assert payload["warnings"] == []


def test_show_environment_invalid_variable(env: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    env.setenv("ACCEL_CPU_ALLOC_CONF", "expandable_segments:maybe")
    code, out, err = run(capsys)
    assert code == 1
    assert err.startswith("accel config: invalid allocator configuration in ACCEL_CPU_ALLOC_CONF at position 20")


def test_keys(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--keys")
    assert code == 0
    assert "release_lock_on_cudamalloc (alias: release_lock_on_hipmalloc)" in out
    code, out, _ = run(capsys, "--keys", "--json")
    payload = json.loads(out)
    assert {row["key"] for row in payload} >= {"max_split_size_mb", "throw_on_cudamalloc_oom"}
    assert all(set(row) >= {"default_text", "range_text", "backends", "used_by_accel"} for row in payload)


def test_bad_arguments_are_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["config", "--check", "x", "--keys"])
    assert info.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_module_entry_point_and_cheap_import() -> None:
    environ = {k: v for k, v in os.environ.items() if k not in config_module._WATCHED}
    result = subprocess.run(
        [sys.executable, "-m", "accel", "config", "--check", "expandable_segments:True"],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("valid (1 setting)")
    probe = "import sys, accel.allocator; print(sorted(m for m in ('torch', 'cffi', 'accel.backends.cpu') if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=60)
    assert result.stdout.strip() == "[]", result.stderr
