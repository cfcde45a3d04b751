"""The public API under a hostile user (tests/public_api_machine.py), once per backend.

Each run is a subprocess with a timeout, so that a crash (a segfault in a
worker thread) or a hang fails this test with the machine's output instead
of taking the session down. ``ACCEL_MACHINE_EXAMPLES`` raises the number of
runs for a longer soak.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFORMANCE_BACKENDS, backend_skip_reason

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = int(os.environ.get("ACCEL_MACHINE_EXAMPLES", "25"))


@pytest.mark.parametrize("name", CONFORMANCE_BACKENDS)
def test_hostile_sequences_keep_every_invariant(name: str) -> None:
    reason = backend_skip_reason(name)
    if reason:
        pytest.skip(reason)
    # A hang dumps every thread's stack (faulthandler) 20 s before the timeout below.
    env = {**os.environ, "ACCEL_BACKEND": name, "ACCEL_MACHINE_VERBOSE": "", "ACCEL_MACHINE_HANG_S": "220"}
    try:
        result = subprocess.run(
            [sys.executable, "-X", "faulthandler", "-m", "tests.public_api_machine", str(EXAMPLES)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the {name} machine hung (no result in 240 s):\n{exc.stdout}\n{exc.stderr}")
    assert result.returncode == 0, f"{name}: exit {result.returncode}\n{result.stdout[-6000:]}\n{result.stderr[-6000:]}"
    assert f"ok: {EXAMPLES} runs" in result.stdout
