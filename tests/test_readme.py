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


@pytest.mark.parametrize(("compiled", "pure"), [(0, 0), (1, 0), (0, 1), (1, 1)])
def test_both_runs_run_and_the_command_fails_if_either_failed(tmp_path: pathlib.Path, compiled: int, pure: int) -> None:
    # As .ci/run runs it (errexit on, then off for the command), with stand-ins for
    # pip and python that log each call and fail where asked.
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    start = ci_lines.index(_test_command()) - 1
    assert ci_lines[start] == "set +e", "the test command must run without errexit, or a failed first run skips the second"
    log = tmp_path / "calls"
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "pip").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "python").write_text(
        '#!/bin/sh\necho "pure=${ACCEL_PURE_PYTHON:-0} $*" >> "$CALLS"\n'
        '[ "${ACCEL_PURE_PYTHON:-0}" = 1 ] && exit "$PURE_STATUS"\nexit "$COMPILED_STATUS"\n'
    )
    for stand_in in bin_dir.iterdir():
        stand_in.chmod(0o755)
    script = "set -euo pipefail\n" + "\n".join(ci_lines[start:]) + "\n"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(log),
           "COMPILED_STATUS": str(compiled), "PURE_STATUS": str(pure)}
    env.pop("ACCEL_PURE_PYTHON", None)
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=60, check=False)
    runs = [line.split(" ", 1)[0] for line in log.read_text().splitlines()]
    assert runs == ["pure=0", "pure=1"], log.read_text()
    assert (result.returncode != 0) == bool(compiled or pure), result.stderr


def test_readme_example_runs() -> None:
    example = re.search(r"```python\n(.*?)\n```", README, re.S).group(1)
    exec(compile(example, "README.md", "exec"), {})
