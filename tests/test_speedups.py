"""The optional compiled fast paths (accel/_speedups.c, loaded by accel/_native.py).

The whole suite runs both ways: as installed (compiled where a compiler built the
extension) and with ``ACCEL_PURE_PYTHON=1``. These tests say which one this run
is, and check the switch and the build in fresh processes.
"""

from __future__ import annotations

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
from accel.allocator._caching import DeviceAllocator

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import accel, types
from accel._native import speedups
from accel.allocator._caching import DeviceAllocator
print(speedups is not None, isinstance(DeviceAllocator.__dict__["malloc"], types.FunctionType),
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
    assert inspect.isfunction(DeviceAllocator.__dict__["malloc"]) != compiled
    assert inspect.isfunction(DeviceAllocator.__dict__["free"]) != compiled
    assert inspect.isfunction(Buffer.__dict__["free"]) != compiled
    assert inspect.isfunction(accel.memory.allocate) != compiled


@pytest.mark.skipif(not _compiler(), reason="no C compiler here: accel is pure Python by design")
def test_a_compiler_builds_the_extension_and_accel_uses_it() -> None:
    assert importlib.util.find_spec("accel._speedups") is not None, (
        "a C compiler is here but accel._speedups was not built: reinstall with "
        '`pip install -e ".[test]" --config-settings editable_mode=compat`'
    )
    assert _probe() == ["True", "False", "False"]


def test_accel_pure_python_switches_the_extension_off() -> None:
    assert _probe(ACCEL_PURE_PYTHON="1") == ["False", "True", "True"]


_STALE_PROBE = """
import warnings
warnings.simplefilter("always")
import accel  # line 4
from accel._native import describe, speedups
from accel.allocator._caching import DeviceAllocator
import types
accel.memory.allocate(64).free()
print(speedups is None, isinstance(DeviceAllocator.__dict__["malloc"], types.FunctionType), describe()["compiled"])
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
    (tree / "accel" / "_speedups.py").write_text("def install_allocator(names): raise AssertionError('used')\n")
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
        (DeviceAllocator.malloc, "malloc"),
        (DeviceAllocator.free, "free"),
        (Buffer.free, "free"),
        (accel.memory.allocate, "allocate"),
    ):
        assert fn.__name__ == name
        assert inspect.unwrap(fn).__doc__ == fn.__doc__
        assert inspect.signature(fn) == inspect.signature(inspect.unwrap(fn))
    buf = accel.memory.allocate(64)
    assert list(inspect.signature(buf.free).parameters) == []
    buf.free()


def test_freed_holes_keep_the_free_lists_bucket_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    # The compiled free of a hole adds its block to the free list without a split only
    # while the bucket stays within 2 * LOAD keys, LOAD read when it runs (as FreeList.add).
    from accel._runtime import Runtime
    from accel.allocator import _freelist
    from accel.allocator.config import parse
    from accel.backends.cpu import CpuBackend

    monkeypatch.setattr(_freelist, "LOAD", 2)
    backend = CpuBackend(1, None)
    alloc = DeviceAllocator(backend, 0, parse("expandable_segments:False"))
    stream = Runtime(backend).default_stream(0)
    blocks = [alloc.malloc(512, stream) for _ in range(40)]
    kept = []
    for block in blocks[::2]:
        # A best fit in the segment's rest, then a hole freed just below it: the hole's
        # key goes where that best fit looked, the add without a search.
        kept.append(alloc.malloc(1024, stream))
        alloc.free(block)
    (free,) = alloc._small.free.values()
    assert len(free) == 21
    assert max(len(keys) for keys in free._keys) <= 4
    assert [size for size, _, _ in free] == sorted(size for size, _, _ in free)
