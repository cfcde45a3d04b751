"""``python -m accel demo``: the capture/replay demo, text and JSON."""

from __future__ import annotations

import json

import pytest

from accel._cli import demo, main


def test_demo_json_reports_a_bitwise_replay_that_allocates_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert main(["demo", "--calls", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backend"] == "cpu" and "MLP" in report["workload"]
    assert report["eager_us"] > 0
    replay = report["interpreted"]
    assert replay["bitwise_equal"] is True and replay["max_abs_error"] == 0.0
    assert replay["allocations_during_replays"] == 0
    assert replay["graph_static_bytes"] > 0 and replay["recorded_ops"] > 0


def test_demo_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("torch")
    assert main(["demo", "--calls", "3"]) == 0
    out = capsys.readouterr().out
    assert "eager" in out and "replay (interpreted)" in out and "bitwise equal to eager" in out


def test_demo_without_torch_replays_stream_work(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(demo, "_torch_available", lambda: False)
    assert main(["demo", "--calls", "3", "--compiled", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert "copies" in report["workload"] and "note" in report
    assert report["stream_work"]["allocations_during_replays"] == 0
    assert main(["demo", "--calls", "3"]) == 0
    assert "replay" in capsys.readouterr().out


@pytest.mark.parametrize("calls", ["0", "-3", "many"])
def test_demo_refuses_a_bad_call_count(calls: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--calls", calls])
    assert exit_info.value.code == 2
    assert "positive integer" in capsys.readouterr().err


def test_variants_are_timed_in_interleaved_rotating_rounds() -> None:
    order: list[str] = []
    times = demo._interleaved_us({"eager": lambda: order.append("e"), "replay": lambda: order.append("r")}, 1, rounds=4)
    timed = order[-8:]  # after the warm-up calls
    assert timed == ["e", "r", "r", "e", "e", "r", "r", "e"]
    assert [len(t) for t in times.values()] == [4, 4]


def test_speedup_is_the_median_round_ratio_with_its_spread(capsys: pytest.CaptureFixture[str]) -> None:
    assert demo._speedup([10.0, 20.0, 30.0], [5.0, 5.0, 30.0]) == {"speedup": 2.0, "speedup_spread": [1.0, 4.0]}
    pytest.importorskip("torch")
    assert main(["demo", "--calls", "3", "--json"]) == 0
    replay = json.loads(capsys.readouterr().out)["interpreted"]
    low, high = replay["speedup_spread"]
    assert low <= replay["speedup"] <= high
    assert main(["demo", "--calls", "3"]) == 0
    assert "x, rounds " in capsys.readouterr().out
