"""Fixtures for the XPU backend's own tests (on accel's simulated Level Zero driver)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import backend_skip_reason

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def xpu():
    """The XPU backend over the simulated driver prepared at session start."""
    from accel.backends import load_backend

    require_simulator()
    return load_backend("xpu")


def require_simulator() -> None:
    """Skip unless the session prepared the simulated driver (loader, gcc, headers)."""
    reason = backend_skip_reason("xpu")
    if reason:
        pytest.skip(reason)


def run_python(code: str, **env: str | None) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (the loader reads its environment once
    per process and cannot retry a failed zeInit); ``None`` removes a variable."""
    require_simulator()
    environ = dict(os.environ)
    for key, value in env.items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=environ, cwd=REPO, timeout=120
    )


def run_json(code: str, **env: str | None) -> dict:
    """Run ``code``, which prints one JSON object last, and return that object."""
    result = run_python(code, **env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
