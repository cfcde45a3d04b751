"""The backends type-check under ``mypy --strict`` (cffi objects are Any by design: see _bindings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_mypy_strict_passes_on_the_backends(tmp_path: Path) -> None:
    pytest.importorskip("mypy")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path), "accel/backends"],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
