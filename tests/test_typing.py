"""accel type-checks strictly, and a user's type checker sees its real types.

``mypy --strict accel`` must be clean (pyproject's ``[tool.mypy]`` says why
the few third-party exceptions are there). A user script is then checked,
outside the source tree, in an environment that holds only what the README's
``pip install -e . --config-settings editable_mode=compat`` installs (plus the
test environment's packages, for torch): mypy and pyright must resolve
``import accel`` and reveal the real types of the lazily loaded names, not
``Any`` or ``Unknown``.
"""

from __future__ import annotations

import ast
import json
import re
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# Git-ignored and kept between runs: a cold check reads torch's stubs (~40 s of CPU), a warm
# one takes ~1 s. One cache for both checks: the user script's check reuses what the check
# of accel stored of torch (25 s of CPU instead of 40 in a fresh clone); which files
# `import accel` and `import torch` resolve to is searched anew each run, not cached.
MYPY_CACHE = REPO / "build" / "mypy-cache"

# What the user script reveals, and the types each checker must name: accel's
# own classes (wherever inside accel they live), torch's Tensor, exact containers.
REVEALED = [
    ("accel.Graph()", r"accel(\.\w+)*\.Graph", "Graph"),
    ("accel.memory_stats()", r"collections\.OrderedDict\[str, int\]", "OrderedDict[str, int]"),
    ("accel.empty((2, 3))", r"torch\._tensor\.Tensor", "Tensor"),
    ("accel.as_tensor(accel.memory.allocate(16))", r"torch\._tensor\.Tensor", "Tensor"),
    ("accel.memory.allocate(16)", r"accel(\.\w+)*\.Buffer", "Buffer"),
    ("accel.current_stream()", r"accel(\.\w+)*\.Stream", "Stream"),
]


def test_mypy_strict_passes_on_accel() -> None:
    pytest.importorskip("mypy", reason="mypy is in the [test] extra: pip install -e '.[test]'")
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(MYPY_CACHE), "accel"],
        capture_output=True, text=True, cwd=REPO, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    assert "Success: no issues found" in result.stdout


def test_every_lazy_name_is_imported_for_type_checkers() -> None:
    # accel's __getattr__ loads these on first use; a checker only sees what the
    # `if TYPE_CHECKING:` block imports, and types anything else as Any.
    import accel

    tree = ast.parse((REPO / "accel" / "__init__.py").read_text())
    blocks = [node for node in tree.body if isinstance(node, ast.If) and ast.unparse(node.test) == "TYPE_CHECKING"]
    seen = {
        alias.asname or alias.name
        for block in blocks
        for node in ast.walk(block)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }
    lazy = set(accel._LAZY_NAMES) | set(accel._LAZY_MODULES)
    assert lazy <= seen, f"not imported under TYPE_CHECKING in accel/__init__.py: {sorted(lazy - seen)}"


@pytest.fixture(scope="module")
def user_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a fresh environment with the README's editable install of this tree."""
    tmp = tmp_path_factory.mktemp("user-env")
    built = subprocess.run(
        [sys.executable, "-c", "import sys; from setuptools import build_meta; "
         "print(build_meta.build_editable(sys.argv[1], {'editable_mode': 'compat'}))", str(tmp)],
        capture_output=True, text=True, cwd=REPO, timeout=300, check=False,
    )
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = tmp / built.stdout.strip().splitlines()[-1]
    env = tmp / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        capture_output=True, text=True, check=True, timeout=60,
    ).stdout.strip()
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(purelib)
    # torch and numpy from the test environment, as plain path entries: its own
    # .pth files (an editable install of another checkout) are not read.
    dirs = [*site.getsitepackages(), sysconfig.get_path("purelib")]
    (Path(purelib) / "_test_deps.pth").write_text("\n".join(dict.fromkeys(dirs)) + "\n")
    found = subprocess.run(
        [str(python), "-c", "import accel; print(accel.__file__)"],
        capture_output=True, text=True, cwd=tmp, timeout=60, check=False,
    )
    assert found.stdout.strip() == str(REPO / "accel" / "__init__.py"), found.stdout + found.stderr
    return python


def _user_script(tmp_path: Path) -> Path:
    script = tmp_path / "user.py"
    script.write_text("import accel\n\n" + "".join(f"reveal_type({expr})\n" for expr, _, _ in REVEALED))
    return script


def test_mypy_sees_accel_types_after_the_editable_install(user_python: Path, tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy is in the [test] extra: pip install -e '.[test]'")
    script = _user_script(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--python-executable", str(user_python),
         "--cache-dir", str(MYPY_CACHE), str(script)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, check=False,
    )
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-2000:]
    revealed = re.findall(r'Revealed type is "(.*)"', result.stdout)
    assert len(revealed) == len(REVEALED), result.stdout
    for (expr, pattern, _), got in zip(REVEALED, revealed):
        assert re.fullmatch(pattern, got), f"mypy types {expr} as {got!r}"


def test_pyright_sees_accel_types_after_the_editable_install(user_python: Path, tmp_path: Path) -> None:
    pytest.importorskip("pyright", reason="pyright is in the [test] extra: pip install -e '.[test]'")
    script = _user_script(tmp_path)
    result = subprocess.run(
        [sys.executable, "-m", "pyright", "--pythonpath", str(user_python), "--outputjson", str(script)],
        capture_output=True, text=True, cwd=tmp_path, timeout=600, check=False,
    )
    report = json.loads(result.stdout)
    diagnostics = report["generalDiagnostics"]
    problems = [d["message"] for d in diagnostics if d["severity"] != "information"]
    assert not problems, problems
    revealed = [re.fullmatch(r'Type of "(.*)" is "(.*)"', d["message"], re.S) for d in diagnostics]
    got = {m.group(1): m.group(2) for m in revealed if m}
    for expr, _, expected in REVEALED:
        assert got.get(expr) == expected, f"pyright types {expr} as {got.get(expr)!r}"
