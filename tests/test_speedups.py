"""The optional compiled fast paths (accel/_speedups.c, loaded by accel/_native.py).

README's test command runs the suite as installed (compiled where a compiler built
the extension), then the tests of what the extension replaces (marked ``speedups``:
tests/conftest.py ``SPEEDUPS_TESTS``) with ``ACCEL_PURE_PYTHON=1``. These tests say
which path this run is, check the switch and the build in fresh processes, and that
every module with a compiled twin has tests in that second run.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import accel
from accel._native import speedups
from accel.allocator._buffer import Buffer

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import accel, types
from accel._native import speedups
from accel.allocator._buffer import Buffer
print(speedups is not None, isinstance(Buffer.__dict__["free"], types.FunctionType),
      isinstance(accel.memory.allocate, types.FunctionType))
"""


def _probe(**env: str) -> list[str]:
    environ = {k: v for k, v in os.environ.items() if k != "ACCEL_PURE_PYTHON"}
    environ.update(env)
    environ["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", _PROBE], env=environ, capture_output=True, text=True, timeout=120, check=True
    )
    return out.stdout.split()


def _compiler() -> bool:
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    return shutil.which(cc) is not None


def test_this_run_uses_the_path_its_environment_asks_for() -> None:
    built = importlib.util.find_spec("accel._speedups") is not None
    pure = os.environ.get("ACCEL_PURE_PYTHON") == "1"
    from accel._native import describe

    assert (speedups is not None) == (built and not pure), describe()["reason"]
    compiled = speedups is not None
    # One seam per module: the replaced functions are Python functions exactly when pure.
    assert inspect.isfunction(Buffer.__dict__["free"]) != compiled
    assert inspect.isfunction(accel.memory.allocate) != compiled


@pytest.mark.skipif(not _compiler(), reason="no C compiler here: accel is pure Python by design")
def test_a_compiler_builds_the_extension_and_accel_uses_it() -> None:
    assert importlib.util.find_spec("accel._speedups") is not None, (
        "a C compiler is here but accel._speedups was not built: reinstall with "
        '`pip install -e ".[test]" --config-settings editable_mode=compat`'
    )
    assert _probe() == ["True", "False", "False"]


def test_every_module_with_a_compiled_twin_has_tests_in_the_pure_python_run(request: pytest.FixtureRequest) -> None:
    # A module that plugs in accel._speedups (it imports `speedups` from accel._native)
    # without an entry would have its Python twin run by no test of README's second run.
    from tests.conftest import SPEEDUPS_TESTS

    plugged = {"accel/_native.py"}
    for path in (ROOT / "accel").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "accel._native":
                if any(alias.name == "speedups" for alias in node.names):
                    plugged.add(path.relative_to(ROOT).as_posix())
    assert set(SPEEDUPS_TESTS) == plugged
    for module, tests in SPEEDUPS_TESTS.items():
        assert tests, module
        for test in tests:
            assert (ROOT / test).is_file() and Path(test).name.startswith("test_"), (module, test)
    assert request.node.get_closest_marker("speedups") is not None  # conftest marked this file


def test_accel_pure_python_switches_the_extension_off() -> None:
    assert _probe(ACCEL_PURE_PYTHON="1") == ["False", "True", "True"]


def test_a_quiet_run_says_which_path_it_tested_in_its_last_lines() -> None:
    # README runs pytest -q twice, and -q drops the report header.
    environ = {k: v for k, v in os.environ.items() if k != "ACCEL_PURE_PYTHON"}
    environ.update(ACCEL_PURE_PYTHON="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow",
         "tests/test_units.py::test_format_size"],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    *_, path, summary = result.stdout.splitlines()
    assert path == "accel: pure Python (ACCEL_PURE_PYTHON=1), tests marked 'not slow'"
    assert summary.startswith("1 passed")


_STALE_PROBE = """
import warnings
warnings.simplefilter("always")
import accel  # line 4
from accel._native import describe, speedups
from accel.allocator._buffer import Buffer
import types
accel.memory.allocate(64).free()
print(speedups is None, isinstance(Buffer.__dict__["free"], types.FunctionType), describe()["compiled"])
"""


def _tree_with_the_extension(tmp_path: Path) -> Path:
    """A copy of the accel package with this tree's built extension."""
    built = sorted((ROOT / "accel").glob("_speedups.*.so"))
    if not built:
        pytest.skip("accel._speedups is not built in this tree")
    shutil.copytree(ROOT / "accel", tmp_path / "accel", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _run_stale_probe(tree: Path) -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "ACCEL_PURE_PYTHON"}
    environ["PYTHONPATH"] = str(tree)
    return subprocess.run([sys.executable, "-c", _STALE_PROBE], env=environ, cwd=tree, capture_output=True,
                          text=True, timeout=120)


def test_an_extension_built_from_this_source_is_used(tmp_path: Path) -> None:
    tree = _tree_with_the_extension(tmp_path)
    result = _run_stale_probe(tree)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "True"]
    assert "RuntimeWarning" not in result.stderr


def test_an_extension_built_from_another_source_is_refused(tmp_path: Path) -> None:
    # An old .so reused when a later build had no compiler: its source changed since.
    tree = _tree_with_the_extension(tmp_path)
    with open(tree / "accel" / "_speedups.c", "a") as source:
        source.write("/* a later edit */\n")
    result = _run_stale_probe(tree)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "False"]  # pure Python, and it works
    assert "<string>:4: RuntimeWarning:" in result.stderr  # the user's import, not accel's line
    assert "was built from another version of accel/_speedups.c" in result.stderr
    assert "the source's is" in result.stderr and "Rebuild it" in result.stderr


def test_an_extension_that_records_no_source_is_refused(tmp_path: Path) -> None:
    # Built before extensions recorded their source: nothing says it matches.
    tree = _tree_with_the_extension(tmp_path)
    for built in (tree / "accel").glob("_speedups.*.so"):
        built.unlink()
    (tree / "accel" / "_speedups.py").write_text("def install_buffers(names): raise AssertionError('used')\n")
    result = _run_stale_probe(tree)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "True", "False"]
    assert "(CRC-32 not recorded, the source's is" in result.stderr


def test_info_says_which_path_runs() -> None:
    from accel._native import describe, source_crc32

    report = describe()
    assert report["compiled"] == (speedups is not None)
    if speedups is not None:
        assert report["file"] == speedups.__file__ and report["reason"] is None
        assert speedups.SOURCE_CRC32 == source_crc32() == report["source_crc32"]
    else:
        assert report["file"] is None and report["reason"]


def test_compiled_stand_ins_keep_the_python_names_docs_and_signatures() -> None:
    # help(), inspect.signature and docs/gen_api.py see the Python functions either way.
    for fn, name in (
        (Buffer.free, "free"),
        (accel.memory.allocate, "allocate"),
    ):
        assert fn.__name__ == name
        assert inspect.unwrap(fn).__doc__ == fn.__doc__
        assert inspect.signature(fn) == inspect.signature(inspect.unwrap(fn))
    buf = accel.memory.allocate(64)
    assert list(inspect.signature(buf.free).parameters) == []
    buf.free()


# What accel/_speedups.c may not name anywhere (issue 27):
# CPython's private API (``_Py...``), symbols looked up at run time (dlopen/dlsym, a
# mangled C++ name ``_ZN...``), and reads of an object's fields at an offset (its member
# descriptors', a slot at a computed address, torch's ``_cdata`` pointer): such code breaks
# silently with another CPython or torch, and on a free-threaded one.
_PRIVATE = {
    "CPython's private API": r"\b_Py\w*",
    "a symbol looked up at run time": r"\bdl(?:open|sym)\b",
    "a mangled C++ symbol": r"_ZN\w*",
    "torch's tensor pointer": r"_cdata\b",
    "a member descriptor's offset": r"\bPyMemberDescr\w*|\bd_member\b",
    "a field read at a computed address": r"\(\s*char\s*\*\s*\)|\bSLOT\s*\(|\bslot_offset\s*\(",
}
def _c_items(source: str) -> list[tuple[str, str]]:
    """``source`` without comments, cut into (name, code): each function (its name at
    the start of a line, its body up to the next ``}`` there), each ``typedef struct``
    (its name), each ``#define`` (its macro's name); the rest is named ``""``."""
    import re

    code = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group().count("\n"), source, flags=re.S)
    items: list[tuple[str, str]] = []
    lines = code.splitlines()
    i, rest = 0, []
    while i < len(lines):
        line = lines[i]
        func = re.match(r"([A-Za-z_]\w*)\(", line)
        macro = re.match(r"#\s*define\s+(\w+)", line)
        if func and not line.rstrip().endswith(";"):
            end = lines.index("}", i)
            items.append((func.group(1), "\n".join(lines[i:end + 1])))
            i = end + 1
        elif line.startswith("typedef struct {"):
            end = next(k for k in range(i, len(lines)) if lines[k].startswith("}"))
            items.append((lines[end].strip("}; "), "\n".join(lines[i:end + 1])))
            i = end + 1
        elif macro:
            items.append((macro.group(1), line))
            i += 1
        else:
            rest.append(line)
            i += 1
    items.append(("", "\n".join(rest)))
    return items


def _private_uses(source: str) -> list[str]:
    import re

    return [
        f"{name or 'file level'}: {what} ({found.group()!r})"
        for name, code in _c_items(source)
        for what, pattern in _PRIVATE.items() for found in re.finditer(pattern, code)
    ]


def test_the_extension_names_no_private_layout_or_symbol() -> None:
    assert _private_uses((ROOT / "accel" / "_speedups.c").read_text()) == []


def test_the_private_use_check_finds_each_kind() -> None:
    # The check above cannot pass for want of finding: each kind, in a function of its own.
    source = "\n".join(
        f"static int\nf{k}(PyObject *o)\n{{\n    return {use};\n}}"
        for k, use in enumerate((
            "_PyObject_GetDictPtr(o) != NULL", "dlsym(lib, \"aoti_torch_get_dim\") != NULL",
            "dlsym(lib, \"_ZN2at6native6is_negERKNS_6TensorE\") != NULL", "PyObject_GetAttrString(o, \"_cdata\") != NULL",
            "((PyMemberDescrObject *)o)->d_member->offset", "*(void **)((char *)o + 16) != NULL",
        ))
    ) + "\nstatic int\nf6(PyObject *o)\n{\n    return SLOT(o, 8) != NULL;\n}\n"
    found = _private_uses(source)
    assert [use.split(":")[0] for use in found] == ["f0", "f1", "f2", "f2", "f3", "f4", "f4", "f5", "f6"], found


def test_the_extension_declares_that_it_needs_the_gil() -> None:
    # Python 3.13+ reads Py_mod_gil from a multi-phase module: without it, a free-threaded
    # interpreter would run SteadyCall's unlocked steps without the GIL.
    source = (ROOT / "accel" / "_speedups.c").read_text()
    assert "{Py_mod_gil, Py_MOD_GIL_USED}" in source
    assert "PyModuleDef_Init(&module)" in source
    if speedups is not None:
        assert speedups.__spec__ is not None and speedups.SteadyCall.__module__ == "accel._speedups"
