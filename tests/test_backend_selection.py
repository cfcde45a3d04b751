"""ACCEL_TEST_BACKENDS selects the backend-parametrized cases by parameter (tests/conftest.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _collect(backends: str, *paths: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ACCEL_TEST_BACKENDS": backends}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *paths],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300, check=False,
    )


def test_one_backend_keeps_its_cases_whatever_the_test_names_say() -> None:
    # `-k cuda` selected by name: a test named after the CPU missed on cuda, and one
    # named "..._cuda_like" ran on cpu. The variable selects on the parameter.
    result = _collect("xpu", "tests/conformance/test_protocol.py", "tests/graph/test_graph.py")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    ids = [line for line in result.stdout.splitlines() if "::" in line]
    assert not [i for i in ids if i.endswith(("[cpu]", "[cuda]"))]
    assert [i for i in ids if i.endswith("[xpu]")]


def test_an_unknown_backend_is_a_usage_error_naming_the_choices() -> None:
    result = _collect("cpu,gpu", "tests/conformance/test_protocol.py")
    assert result.returncode == 4
    assert "ACCEL_TEST_BACKENDS='cpu,gpu'" in result.stderr and "cpu, cuda, xpu" in result.stderr
