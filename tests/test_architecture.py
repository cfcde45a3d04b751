"""The layering of docs/architecture.md, checked on every run.

pyproject.toml's import-linter contracts say which layer may import which;
this runs them (as CI's ``lint-imports`` would) so that an upward import or an
import cycle between subpackages fails the suite.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"],
        cwd=cwd,
        env={"PYTHONPATH": str(cwd), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_layers_point_down_and_subpackages_have_no_cycles() -> None:
    result = _lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_the_contract(tmp_path: Path) -> None:
    # A copy of the package where the stream layer reaches up into the allocator:
    # the check must fail and name the import.
    copy = tmp_path / "repo"
    copy.mkdir()
    (copy / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    subprocess.run(["cp", "-r", str(ROOT / "accel"), str(copy / "accel")], check=True)
    stream = copy / "accel" / "stream" / "_operands.py"
    stream.write_text(stream.read_text() + "\n\ndef _upward() -> object:\n    from accel.allocator import allocate\n\n    return allocate\n")
    result = _lint_imports(copy)
    assert result.returncode != 0
    assert "accel.stream is not allowed to import accel.allocator" in result.stdout


def test_an_import_cycle_between_subpackages_is_named(tmp_path: Path) -> None:
    # The Backend protocol reaching back into a vendor backend (which imports it)
    # closes a cycle inside accel.backends: the acyclic contract must name it.
    copy = tmp_path / "repo"
    copy.mkdir()
    (copy / "pyproject.toml").write_text((ROOT / "pyproject.toml").read_text())
    subprocess.run(["cp", "-r", str(ROOT / "accel"), str(copy / "accel")], check=True)
    base = copy / "accel" / "backends" / "base.py"
    base.write_text(base.read_text() + "\n\ndef _cycle() -> object:\n    from accel.backends.cpu import CpuBackend\n\n    return CpuBackend\n")
    result = _lint_imports(copy)
    assert result.returncode != 0
    assert "No import cycles between accel's subpackages BROKEN" in result.stdout
    assert "No cycles are allowed in accel.backends." in result.stdout
    assert "- .base -> .cpu (1 import)" in result.stdout


# ``runtime.name == "cpu"`` and the like: code above the Backend protocol that
# branches on which vendor it runs on, instead of on a capability the backend
# declares (``torch_integration``, ``torch_device_type``, ``supports_*``).
VENDOR_NAMES = {"cpu", "cuda", "xpu"}


def _branches_on_a_backend_name(source: str) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        names = [o for o in operands if isinstance(o, ast.Attribute) and o.attr == "name"]
        vendors = [o for o in operands if isinstance(o, ast.Constant) and o.value in VENDOR_NAMES]
        if names and vendors:
            lines.append(node.lineno)
    return lines


def test_nothing_above_the_seam_branches_on_a_backend_name() -> None:
    found = {
        str(path.relative_to(ROOT)): lines
        for path in sorted((ROOT / "accel").rglob("*.py"))
        if "backends" not in path.relative_to(ROOT / "accel").parts[:1]
        and (lines := _branches_on_a_backend_name(path.read_text()))
    }
    assert not found, f"choose by a capability the backend declares, not by its name: {found}"


def test_the_name_check_sees_a_comparison_with_a_vendor_name() -> None:
    assert _branches_on_a_backend_name('if runtime.name == "cpu":\n    pass\n') == [1]
    assert _branches_on_a_backend_name('if "cuda" != backend.name:\n    pass\n') == [1]
    assert _branches_on_a_backend_name('if runtime.backend.torch_device_type == "cpu":\n    pass\n') == []
