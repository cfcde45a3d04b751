"""Conformance fixtures: the user-level API, run once per backend."""

from __future__ import annotations

import pytest

from accel._runtime import Runtime, activate


@pytest.fixture
def runtime(backend) -> Runtime:
    """Make ``backend`` the process's accelerator for the test."""
    with activate(backend.name) as rt:
        yield rt
