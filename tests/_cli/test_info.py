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


def test_report_names_the_compiled_extension_and_its_crc() -> None:
    from accel._native import source_crc32

    result = accel_cli("info", "--json")
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    built = sorted((Path(__file__).resolve().parents[2] / "accel").glob("_speedups.*.so"))
    assert "compiled" not in report  # one build: no compiled/pure choice to report
    assert report["speedups"] == {
        "file": str(built[0]), "built_crc32": source_crc32(), "source_crc32": source_crc32(),
    }  # fmt: skip
    text = accel_cli("info").stdout
    assert f"compiled paths: {built[0]} (CRC-32 {source_crc32()})" in text


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
