"""``python -m accel`` / ``accel info``: the device report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel._cli import main


def accel_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "accel", *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )


def test_default_command_reports_host_devices_with_real_memory() -> None:
    result = accel_cli()
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("accel 0.1.0: backend cpu")
    assert "cpu:0" in out and "cpu:1" in out
    device = json.loads(accel_cli("info", "--json").stdout)["devices"][0]
    free, total = device["memory_free"], device["memory_total"]
    with open("/proc/meminfo") as f:
        assert total <= int(f.readline().split()[1]) * 1024
    assert 0 < free <= total


def test_json_report_is_complete(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "cpu"
    assert [b["name"] for b in report["backends"]] == ["cuda", "xpu", "cpu"]
    assert len(report["devices"]) == int(os.environ["ACCEL_CPU_DEVICES"])
    device = report["devices"][0]
    assert {"name", "uuid", "total_memory", "memory_free", "memory_total", "driver_version"} <= device.keys()


@pytest.mark.parametrize("pure", ["0", "1"])
def test_report_says_whether_the_compiled_paths_are_in_use(pure: str) -> None:
    from accel._native import source_crc32

    result = accel_cli("info", "--json", ACCEL_PURE_PYTHON=pure)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    built = sorted((Path(__file__).resolve().parents[2] / "accel").glob("_speedups.*.so"))
    compiled = pure == "0" and bool(built)
    assert report["compiled"] is compiled and report["speedups"]["compiled"] is compiled
    assert report["speedups"]["source_crc32"] == source_crc32()
    if compiled:
        assert report["speedups"]["file"] == str(built[0]) and report["speedups"]["reason"] is None
    else:
        assert report["speedups"]["file"] is None
        assert report["speedups"]["reason"] == "ACCEL_PURE_PYTHON=1" if pure == "1" else report["speedups"]["reason"]
    text = accel_cli("info", ACCEL_PURE_PYTHON=pure).stdout
    assert ("compiled paths: in use" in text) is compiled
    assert ("compiled paths: not in use, pure Python" in text) is not compiled


def test_unavailable_backend_is_one_line_and_non_zero() -> None:
    result = accel_cli(ACCEL_BACKEND="nonsense")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "backend 'nonsense' is unavailable" in result.stderr


def test_bad_argument_is_one_line_without_traceback() -> None:
    result = accel_cli("info", "--frobnicate")
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    assert "unrecognized arguments: --frobnicate" in result.stderr


def test_report_shows_allocator_settings_and_their_sources() -> None:
    result = accel_cli(ACCEL_ALLOC_CONF="expandable_segments:True", ACCEL_CPU_ALLOC_CONF="max_split_size_mb:64")
    assert "allocator settings: max_split_size_mb:64,expandable_segments:True" in result.stdout
    assert "expandable_segments from ACCEL_ALLOC_CONF" in result.stdout
    assert "max_split_size from ACCEL_CPU_ALLOC_CONF" in result.stdout
    assert "allocator settings: (all defaults)" in accel_cli().stdout
