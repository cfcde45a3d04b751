"""The compiled hot paths (accel/_speedups.c, loaded by accel/_native.py).

The extension is part of every build, as the allocator's native core is: these tests
check that it is plugged in where accel's hot paths are, that a missing or stale build
is refused at import with the fix in the message (never a silent fallback), that a
run's last line names the extension, and that the source uses no private layout or
symbol and declares its GIL mode. The behaviour of each hot path is tested where its
module is (tests/stream, tests/allocator, tests/graph).
"""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import accel
from accel import _runtime
from accel._native import speedups
from accel.allocator._buffer import Buffer
from accel.graph._graphed import GraphedCallable

ROOT = Path(__file__).resolve().parents[1]


def test_the_hot_paths_are_the_extensions() -> None:
    # Each module plugs in the C at import: no Python twin of the common case is left.
    assert type(Buffer.__dict__["free"]).__module__ == "accel._speedups"
    assert type(Buffer.__dict__["__del__"]).__module__ == "accel._speedups"
    assert type(accel.memory.allocate).__module__ == "accel._speedups"
    assert _runtime._set_current is speedups.set_current
    assert GraphedCallable.__mro__[1] is speedups._CallHead


def test_set_current_stores_pops_and_refuses_what_is_not_a_dict() -> None:
    # The current-stream store (accel._runtime), in C only: a stream stores, None pops
    # (an absent key too), anything but a plain dict is refused before a store.
    streams: dict[int, object] = {}
    stream = object()
    speedups.set_current(streams, 1, stream)
    assert streams == {1: stream}
    speedups.set_current(streams, 1, None)
    speedups.set_current(streams, 0, None)
    assert streams == {}

    class Streams(dict):  # type: ignore[type-arg]
        pass

    for bad in (Streams(), [], None):
        with pytest.raises(TypeError, match=r"set_current\(streams, index, stream\)"):
            speedups.set_current(bad, 0, stream)  # type: ignore[arg-type]


def test_a_quiet_run_names_the_extension_in_its_last_lines() -> None:
    # README runs pytest -q, which drops the report header.
    environ = dict(os.environ, PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_units.py::test_format_size"],
        cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    *_, path, summary = result.stdout.splitlines()
    assert path == f"accel: compiled hot paths {speedups.__file__}"
    assert summary.startswith("1 passed")


_PROBE = """
try:
    import accel
except ImportError as exc:
    print("refused:", exc)
else:
    accel.memory.allocate(64).free()
    print("loaded:", accel._native.describe())
"""


def _tree_with_the_extension(tmp_path: Path) -> Path:
    """A copy of the accel package with this tree's built extensions."""
    shutil.copytree(ROOT / "accel", tmp_path / "accel", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def _run_probe(tree: Path) -> str:
    environ = dict(os.environ, PYTHONPATH=str(tree))
    result = subprocess.run([sys.executable, "-c", _PROBE], env=environ, cwd=tree, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "Warning" not in result.stderr, result.stderr
    return result.stdout


def test_an_extension_built_from_this_source_is_used(tmp_path: Path) -> None:
    out = _run_probe(_tree_with_the_extension(tmp_path))
    assert out.startswith("loaded:") and f"'built_crc32': '{speedups.SOURCE_CRC32}'" in out, out


def test_an_extension_built_from_another_source_is_refused(tmp_path: Path) -> None:
    # An old .so left beside a changed source: it reads accel's classes as they were.
    tree = _tree_with_the_extension(tmp_path)
    with open(tree / "accel" / "_speedups.c", "a") as source:
        source.write("/* a later edit */\n")
    out = _run_probe(tree)
    assert out.startswith("refused:"), out
    assert "was built from another version of accel/_speedups.c" in out and "the source's is" in out
    assert "rebuild it: `python setup.py build_ext --inplace`" in out


def test_an_extension_that_records_no_source_is_refused(tmp_path: Path) -> None:
    # Built before extensions recorded their source: nothing says it matches.
    tree = _tree_with_the_extension(tmp_path)
    for built in (tree / "accel").glob("_speedups.*.so"):
        built.unlink()
    (tree / "accel" / "_speedups.py").write_text("def install_buffers(names): raise AssertionError('used')\n")
    out = _run_probe(tree)
    assert out.startswith("refused:") and "(CRC-32 not recorded, the source's is" in out, out


def test_a_missing_extension_is_refused_with_the_fix(tmp_path: Path) -> None:
    tree = _tree_with_the_extension(tmp_path)
    for built in (tree / "accel").glob("_speedups.*.so"):
        built.unlink()
    out = _run_probe(tree)
    assert out.startswith("refused: accel._speedups is not built"), out
    assert "rebuild it: `python setup.py build_ext --inplace`" in out


def test_describe_names_the_file_and_both_crcs() -> None:
    from accel._native import describe, source_crc32

    assert describe() == {"file": speedups.__file__, "built_crc32": speedups.SOURCE_CRC32,
                          "source_crc32": source_crc32()}
    assert speedups.SOURCE_CRC32 == source_crc32()


def test_compiled_stand_ins_keep_the_python_names_docs_and_signatures() -> None:
    # help(), inspect.signature and docs/gen_api.py see the Python functions they stand in for.
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
    # interpreter would run SteadyCall's unlocked steps without the GIL. Declared where the
    # headers define the slot (#ifdef: no version number to keep in step).
    source = (ROOT / "accel" / "_speedups.c").read_text()
    assert "#ifdef Py_mod_gil\n    {Py_mod_gil, Py_MOD_GIL_USED},\n#endif" in source
    assert "PyModuleDef_Init(&module)" in source
    assert speedups.__spec__ is not None and speedups.SteadyCall.__module__ == "accel._speedups"
