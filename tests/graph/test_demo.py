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
