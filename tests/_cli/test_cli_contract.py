"""Every ``accel`` subcommand (found the way the CLI finds them) has --help and
rejects a bad argument in one line with a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest

from accel._cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    """Every command path, nested ones included (``memory plot``)."""
    paths = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                paths.append((*prefix, name))
                paths.extend(_commands(sub, (*prefix, name)))
    return paths


COMMANDS = _commands(build_parser())


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_the_commands_of_this_issue_are_present():
    assert {("bench",), ("memory",), ("memory", "plot")} <= set(COMMANDS)


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help(command, capsys):
    code, out, err = _run([*command, "--help"], capsys)
    assert code == 0 and err == ""
    assert out.startswith(f"usage: accel {' '.join(command)}")


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_bad_option_is_one_line(command, capsys):
    code, out, err = _run([*command, "--no-such-option-xyz"], capsys)
    assert code != 0
    assert err.count("\n") == 1 and "error:" in err and "Traceback" not in err, err
    assert "--no-such-option-xyz" in err or "required" in err


def test_unknown_command_is_one_line(capsys):
    code, _, err = _run(["no-such-command"], capsys)
    assert code == 2 and err.count("\n") == 1 and "invalid choice: 'no-such-command'" in err


def test_top_level_help_lists_every_command(capsys):
    code, out, _ = _run(["--help"], capsys)
    assert code == 0
    for (name, *_rest) in COMMANDS:
        assert name in out


def test_real_process_has_no_traceback(tmp_path):
    """Through ``python -m accel``, as a user runs it (and as the console script does)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "ACCEL_BACKEND": "cpu"}
    for argv, expected in ((["bench", "--bogus"], 2), (["memory", "plot", "missing.pickle", "-o", "x.png"], 1)):
        result = subprocess.run([sys.executable, "-m", "accel", *argv], cwd=tmp_path, env=env,
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == expected
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr


def test_file_errors_are_one_line(tmp_path):
    """An OSError (an unwritable output path) ends in one line, not a traceback."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "ACCEL_BACKEND": "cpu"}
    snapshot = tmp_path / "snap.pickle"
    subprocess.run(
        [sys.executable, "-c", "import accel; accel.memory.allocate(4096); accel.memory.dump_snapshot(%r)" % str(snapshot)],
        env=env, check=True, timeout=60,
    )
    result = subprocess.run(
        [sys.executable, "-m", "accel", "memory", "plot", str(snapshot), "-o", str(tmp_path / "no" / "such" / "x.png")],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 1
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
