"""torch.distributed collectives in a host capture (accel/graph/_collectives.py) on live Gloo ranks."""

from __future__ import annotations

from typing import Any


def test_collectives_captured_on_the_host_run_once_per_replay(main_ranks: list[dict[str, Any]]) -> None:
    for r in main_ranks:
        # Nothing ran at capture: x as it was, the captured y zero until a replay.
        assert r["captured"] == [[1.0] * 4, [0.0] * 4]
        # Each replay: dist.all_reduce (recorded) and collective() (queued) double x once each.
        assert r["replays"] == [[[4.0] * 4, [5.0] * 4], [[16.0] * 4, [17.0] * 4]]
