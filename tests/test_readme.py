"""The README's commands and example are the ones that work."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _test_command() -> str:
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    return next(b for b in blocks if "pytest" in b)


def test_ci_runs_exactly_the_readme_test_command() -> None:
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _test_command() in ci_lines


@pytest.mark.parametrize(("installed", "tested"), [(0, 0), (0, 1), (1, 0)])
def test_the_suite_runs_once_and_the_command_fails_if_it_failed(tmp_path: pathlib.Path, installed: int,
                                                                tested: int) -> None:
    # As .ci/run runs it (errexit on), with stand-ins for pip and python that log each
    # call and fail where asked: one pytest run, after the install, and only after one
    # that worked.
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    start = ci_lines.index(_test_command())
    log = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text('#!/bin/sh\necho "pip $*" >> "$CALLS"\nexit "$PIP_STATUS"\n')
    (bin_dir / "python").write_text('#!/bin/sh\necho "python $*" >> "$CALLS"\nexit "$PYTEST_STATUS"\n')
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    script = "set -euo pipefail\n" + "\n".join(ci_lines[start:]) + "\n"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(log),
           "PIP_STATUS": str(installed), "PYTEST_STATUS": str(tested)}
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    runs = [line.split(" ", 1)[0] for line in log.read_text().splitlines()]
    assert runs == (["pip"] if installed else ["pip", "python"]), log.read_text()
    assert (result.returncode != 0) == bool(installed or tested), result.stderr


def test_readme_example_runs() -> None:
    example = re.search(r"```python\n(.*?)\n```", README, re.S).group(1)
    exec(compile(example, "README.md", "exec"), {})
