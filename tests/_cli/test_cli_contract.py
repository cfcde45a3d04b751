"""Every ``accel`` subcommand (found the way the CLI finds them) has --help and
rejects a bad argument in one line with a non-zero exit, never a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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


def test_version(capsys):
    import accel

    code, out, err = _run(["--version"], capsys)
    assert (code, out, err) == (0, f"accel {accel.__version__}\n", "")


@pytest.mark.parametrize(
    ("argv", "code", "kind", "message"),
    [
        (["bench", "--dir", "/no/such/dir", "--json"], 1, "InvalidValueError", "is not a directory"),
        (["memory", "plot", "missing.pickle", "-o", "x.png", "--json"], 1, "InvalidValueError", "does not exist"),
        (["info", "--json", "--bogus"], 2, "UsageError", "unrecognized arguments: --bogus"),
        (["bench", "--json", "--quick", "nosuch", "--dir", "{empty}"], 1, "InvalidValueError", "has no bench_*.py"),
        (["memory", "plot", "x", "-o", "x.png", "--size", "big", "--json"], 2, "UsageError", "is not WIDTHxHEIGHT"),
    ],
)
def test_errors_under_json_are_json_on_stdout(tmp_path, monkeypatch, capsys, argv, code, kind, message):
    import json

    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    result, out, err = _run([a.replace("{empty}", str(tmp_path / "empty")) for a in argv], capsys)
    assert result == code and err == ""
    report = json.loads(out)
    assert report["kind"] == kind and message in report["error"]


# What a user may type: words from the real command lines, odd values and junk.
_words = st.one_of(
    st.sampled_from(["info", "bench", "memory", "plot", "config", "demo", "--json", "--quick", "--list", "--help",
                     "-o", "x.png", "x.html", "--device", "--size", "--dir", "--keys", "--backend", "cuda", "-1",
                     "0", "1280x800", "99999999999999999999999", "--", "-", "", "nosuch"]),
    st.text(max_size=10),
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(argv=st.lists(_words, max_size=6))
def test_any_command_line_is_handled_or_refused_in_one_line(tmp_path, monkeypatch, capsys, argv):
    """Fuzzed arguments: exit 0, an accel error in one line (exit 1) or a usage error in one line (exit 2)."""
    if "demo" in argv or ("bench" in argv and "--list" not in argv) or "--help" in argv:
        argv = [a for a in argv if a not in ("demo", "bench", "--help")]  # these run work or print pages
    monkeypatch.chdir(tmp_path)
    code, out, err = _run(argv, capsys)
    assert code in (0, 1, 2), (argv, code, err)
    if code:
        assert err.count("\n") <= 1 and "Traceback" not in err, (argv, err)
        if "--json" in argv:
            assert err == "" and '"error"' in out, (argv, out, err)
        else:
            assert err.count("\n") == 1, (argv, err)
