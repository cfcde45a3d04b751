"""The README's commands and example are the ones that work."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_ci_runs_exactly_the_readme_test_command() -> None:
    blocks = re.findall(r"```bash\n(.*?)\n```", README, re.S)
    test_command = next(b for b in blocks if "pytest" in b)
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


def test_readme_example_runs() -> None:
    example = re.search(r"```python\n(.*?)\n```", README, re.S).group(1)
    exec(compile(example, "README.md", "exec"), {})
