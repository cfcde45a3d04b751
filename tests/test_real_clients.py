"""Code written for torch.accelerator runs on accel unchanged (tests/clients/), once per backend.

Each run is a subprocess with a timeout (the backend is chosen once per process).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFORMANCE_BACKENDS, backend_skip_reason

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", CONFORMANCE_BACKENDS)
def test_torch_accelerator_client_runs_on_accel(name: str) -> None:
    pytest.importorskip("torch")
    reason = backend_skip_reason(name)
    if reason:
        pytest.skip(reason)
    result = subprocess.run(
        [sys.executable, "-X", "faulthandler", "-m", "tests.clients.run_client"],
        cwd=ROOT, env={**os.environ, "ACCEL_BACKEND": name}, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, f"{name}: exit {result.returncode}\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}"
    assert f"ok: the torch.accelerator client ran on {name}" in result.stdout


def test_the_client_is_plain_torch_accelerator_code() -> None:
    """The client names torch's API only; the runner's substitution is the only change."""
    source = (ROOT / "tests" / "clients" / "accelerator_client.py").read_text()
    assert "accel." not in source.replace("torch.accelerator", "")
    assert "torch.accelerator." in source and "torch.Event(" in source and "torch.Stream(" in source
