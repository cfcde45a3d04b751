"""Packaging: the license is declared as SPDX and shipped, and the sdist carries and runs its tests."""

from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def build_distribution(repo: Path, tmp_path: Path, kind: str) -> Path:
    """Build a wheel or an sdist of a clean copy of the source tree (no caches, no build outputs)."""
    source = tmp_path / "src"
    shutil.copytree(repo, source, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.pyc", "*.egg-info", "build", "dist", ".hypothesis", ".pytest_cache",
        "*.so", "*.so.*", ".venv", ".whl", ".gl"))
    out = tmp_path / "dist"
    out.mkdir()
    hook = "build_wheel" if kind == "wheel" else "build_sdist"
    result = subprocess.run(
        [sys.executable, "-c", f"from setuptools import build_meta; print(build_meta.{hook}({str(out)!r}))"],
        cwd=source, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    return out / result.stdout.strip().splitlines()[-1]


def test_license_is_an_spdx_expression_with_its_file() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"  # a string: the {text=...} table is deprecated
    assert project["license-files"] == ["LICENSE"]
    assert "Apache License" in (REPO / "LICENSE").read_text().splitlines()[1]


def test_sdist_carries_its_tests_and_they_run(tmp_path) -> None:
    sdist = build_distribution(REPO, tmp_path, "sdist")
    with tarfile.open(sdist) as archive:
        names = archive.getnames()
        archive.extractall(tmp_path / "unpacked", filter="data")
    root = tmp_path / "unpacked" / sdist.name.removesuffix(".tar.gz")
    for needed in ("LICENSE", "tests/conftest.py", "tests/fixtures/simcuda/simcuda.c", "tests/fixtures/simze/simze.c",
                   "benchmarks/README.md", "docs/api.md", "accel/_speedups.c", "csrc/accel_core.c",
                   "csrc/accel_core.h", "csrc/build_core.py"):
        assert f"{root.name}/{needed}" in names, needed
    assert not [n for n in names if "__pycache__" in n or n.endswith((".pyc", ".so"))]
    assert "License-Expression: Apache-2.0" in (root / "PKG-INFO").read_text()
    # What an install from the sdist does: build the extensions (both are part of every
    # build) from the sources it carries, then run its tests.
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    built = subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace", "-q"], cwd=root, env=env,
                           capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-3000:]
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_device.py", "tests/test_facade.py"],
        cwd=root, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:]
    assert " passed" in result.stdout


def test_wheel_carries_the_extensions_source_and_loads_the_extension(tmp_path) -> None:
    # accel/_native.py loads the extension only when it was built from the _speedups.c
    # installed beside it: the wheel ships both, and a fresh build matches its source.
    wheel = build_distribution(REPO, tmp_path, "wheel")
    unpacked = tmp_path / "installed"
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(unpacked)
    assert "accel/_speedups.c" in names
    built = [n for n in names if n.startswith("accel/_speedups.") and n.endswith(".so")]
    assert len(built) == 1, names
    probe = "from accel._native import describe; import json; print(json.dumps(describe()))"
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(unpacked),
                            "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["file"] == str(unpacked / built[0])
    assert report["built_crc32"] == report["source_crc32"] is not None
    # the allocator's native core (csrc/, cffi API mode) is always built, and loads
    assert [n for n in names if n.startswith("accel/allocator/_core.") and n.endswith(".so")], names
    probe = "from accel.allocator._native_core import library_path; print(library_path())"
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env={"PYTHONPATH": str(unpacked),
                            "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith(str(unpacked)), result.stderr


def test_version_is_the_same_everywhere() -> None:
    import accel

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    result = subprocess.run([sys.executable, "-m", "accel", "--version"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout == f"accel {project['version']}\n" == f"accel {accel.__version__}\n"


def test_the_build_environment_has_what_the_build_scripts_import() -> None:
    # pip builds in an isolated environment holding only build-system.requires: without
    # cffi there, setuptools ignored `cffi_modules` with a warning, and a fresh
    # `pip install -e .` had no allocator core (every test of it failed in CI).
    requires = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    provided = {re.split(r"[<>=!~ \[;]", r, maxsplit=1)[0].lower() for r in requires}
    imported = set()
    for script in (REPO / "setup.py", REPO / "csrc" / "build_core.py"):
        for node in ast.walk(ast.parse(script.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names}
    assert "cffi" in third_party  # (the import this check is about)
    assert third_party <= provided, f"build-system.requires {requires} lacks {sorted(third_party - provided)}"


def test_the_compiled_extension_is_not_optional() -> None:
    # accel._speedups is part of every build, as the allocator's core is: an optional
    # one let a build without a compiler go on, and accel then failed at import.
    calls = [node for node in ast.walk(ast.parse((REPO / "setup.py").read_text()))
             if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Extension"]
    assert len(calls) == 1
    assert "optional" not in {keyword.arg for keyword in calls[0].keywords}
