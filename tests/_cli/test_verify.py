"""``accel verify`` passes on the host backend and on both simulated drivers, and
fails (exit 1, the failing step and test named) when something is wrong."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFORMANCE_BACKENDS, backend_skip_reason

REPO = Path(__file__).resolve().parents[2]


def _verify(tmp_path: Path, backend: str, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    # The session's environment points the backends at the simulated drivers (tests/conftest.py).
    full_env = {**os.environ, "PYTHONPATH": str(REPO), "ACCEL_BACKEND": backend, **env}
    out = tmp_path / "report"
    # From another directory: the source tree is found beside the package, as for an installed checkout.
    result = subprocess.run([sys.executable, "-m", "accel", "verify", "--json", "--output", str(out), *args],
                            cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=420)
    assert "Traceback" not in result.stderr, result.stderr
    report = json.loads(result.stdout)
    assert json.loads((out / "report.json").read_text()) == report
    assert (out / "report.md").read_text().startswith(f"# accel verify: {report['status'].upper()}")
    return result, report


@pytest.mark.slow
@pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
def test_verify_passes(backend: str, tmp_path: Path) -> None:
    reason = backend_skip_reason(backend)
    if reason:
        pytest.skip(reason)
    result, report = _verify(tmp_path, backend, "--quick")
    assert result.returncode == 0, (report["failed_steps"], result.stderr[-2000:])
    steps = {step["name"]: step for step in report["steps"]}
    assert list(steps) == ["driver", "abi", "conformance", "real-device", "benchmarks"]
    assert report["status"] == "passed" and report["backend"] == backend
    assert steps["driver"]["device"]["type"] == backend
    tests = steps["conformance"]["tests"]
    # The conformance suite ran on this backend only, and on it nothing failed.
    assert len(tests) >= 30 and all(t["id"].endswith(f"[{backend}]") for t in tests)
    assert sum(t["outcome"] == "passed" for t in tests) >= 30
    assert [m["module"] for m in steps["benchmarks"]["modules"]] == ["bench_allocator_cuda", "bench_graph"]
    if backend == "cpu":  # the graph benchmark measures on the host backend; the host binds no driver
        assert steps["benchmarks"]["status"] == "passed" and steps["abi"]["status"] == "skipped"
    else:  # the vendor headers are here (CI fetches NVIDIA's; libze-dev is installed)
        assert steps["abi"]["status"] == "passed" and len(steps["abi"]["tests"]) >= 3
    if backend == "cuda":  # the torch-graph and torch-allocator scenarios ran and skipped themselves: no real GPU here
        assert steps["real-device"]["status"] == "skipped" and len(steps["real-device"]["tests"]) >= 10
        ids = " ".join(t["id"] for t in steps["real-device"]["tests"])
        assert "test_torch_graphs_real_gpu" in ids and "test_torch_allocator_real_gpu" in ids, ids


def test_verify_fails_when_the_driver_does_not_load(tmp_path: Path) -> None:
    reason = backend_skip_reason("cuda")
    if reason:
        pytest.skip(reason)
    result, report = _verify(tmp_path, "cuda", ACCEL_SIMCUDA_FAIL="cuInit=999")
    assert result.returncode == 1 and report["failed_steps"] == ["driver"]
    assert "CUDA_ERROR_UNKNOWN" in report["steps"][0]["summary"]
    assert {s["status"] for s in report["steps"][1:]} == {"skipped"}


def test_a_failing_conformance_test_fails_verify(tmp_path: Path) -> None:
    source = tmp_path / "tree"
    (source / "tests" / "conformance").mkdir(parents=True)
    (source / "tests" / "conformance" / "test_fake.py").write_text(
        "import os, pytest\n"
        "# as tests/conftest.py does: verify names the backend in ACCEL_TEST_BACKENDS\n"
        "chosen = os.environ['ACCEL_TEST_BACKENDS'].split(',')\n"
        "@pytest.mark.parametrize('backend', [b for b in ['cpu', 'cuda'] if b in chosen])\n"
        "def test_fine(backend): pass\n"
        "@pytest.mark.parametrize('backend', ['cpu'])\n"
        "def test_broken(backend): assert 1 == 2, 'the device said no'\n")
    result, report = _verify(tmp_path, "cpu", "--source", str(source), "--time-limit", "60")
    assert result.returncode == 1 and "conformance" in report["failed_steps"]
    conformance = report["steps"][2]
    outcomes = {t["id"]: t["outcome"] for t in conformance["tests"]}
    assert outcomes == {"tests.conformance.test_fake::test_fine[cpu]": "passed",
                        "tests.conformance.test_fake::test_broken[cpu]": "failed"}
    assert "the device said no" in conformance["tests"][1]["message"]


def test_the_time_limit_cuts_a_step(tmp_path: Path) -> None:
    result, report = _verify(tmp_path, "cpu", "--time-limit", "0.5")
    assert result.returncode == 1
    statuses = {s["name"]: (s["status"], s["summary"]) for s in report["steps"]}
    assert statuses["driver"][0] == "passed"
    # Started with what was left of the half second and cut, or (on a slow machine) not started at all.
    assert statuses["conformance"][0] == "failed"
    assert "timed out after 0." in statuses["conformance"][1] or "time limit" in statuses["conformance"][1]
    assert "time limit was used up" in statuses["benchmarks"][1]


def test_a_bad_time_limit_is_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO), "ACCEL_BACKEND": "cpu"}
    result = subprocess.run([sys.executable, "-m", "accel", "verify", "--time-limit", "-3"], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "--time-limit" in result.stderr
