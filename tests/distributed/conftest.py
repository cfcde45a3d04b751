"""Each rank scenario starts once per test session: the tests of tests/distributed read
what its ranks saw (starting two interpreters with torch and Gloo costs seconds)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.distributed.ranks import run_ranks


@pytest.fixture(scope="package")
def main_ranks() -> list[dict[str, Any]]:
    """Both ranks' results of ``scenario_main``: every point of accel.distributed."""
    pytest.importorskip("torch.distributed")
    return [r for r in run_ranks("main") if r is not None]


@pytest.fixture(scope="package")
def kill_ranks() -> dict[str, Any]:
    """Rank 0's result of ``scenario_kill`` (rank 1 stalls, then dies)."""
    pytest.importorskip("torch.distributed")
    survivor, _ = run_ranks("kill", dies=frozenset({1}))
    assert survivor is not None
    return survivor
