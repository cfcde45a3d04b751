"""The docs stay true: the API reference is regenerated, the getting-started
code runs, links and the accel names the pages mention exist."""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = ("index.md", "getting-started.md", "concepts.md", "graphs.md")



def _python_blocks(page: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", (DOCS / page).read_text(), flags=re.S)


def test_api_reference_is_up_to_date(monkeypatch):
    spec = importlib.util.spec_from_file_location("gen_api", DOCS / "gen_api.py")
    gen_api = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen_api)
    monkeypatch.setenv("COLUMNS", "100")
    assert (DOCS / "api.md").read_text() == gen_api.render(), "docs/api.md is out of date: run `python docs/gen_api.py`"


def _public_modules() -> list[str]:
    """accel and each module under it that defines __all__ and has no part of its name
    starting with ``_``: what the public API is made of."""
    import pkgutil

    import accel

    names = ["accel"] + [
        info.name for info in pkgutil.walk_packages(accel.__path__, "accel.")
        if not any(part.startswith("_") for part in info.name.split("."))
    ]
    return [name for name in names if hasattr(importlib.import_module(name), "__all__")]


def _public_names() -> dict[str, object]:
    """Every name in __all__ of a public module (less submodules) and its object."""
    found = {}
    for module_name in _public_modules():
        module = importlib.import_module(module_name)
        for name in module.__all__:
            value = getattr(module, name)
            if not inspect.ismodule(value):
                found[f"{module_name}.{name}"] = value
    return found


def test_api_reference_lists_the_public_api_and_only_it():
    headings = re.findall(r"^### `(accel\.[\w.]+)", (DOCS / "api.md").read_text(), flags=re.M)
    assert len(headings) == len(set(headings)), "a name is documented twice"
    public = _public_names()
    assert not sorted(set(headings) - set(public)), "api.md documents names no public __all__ exports"
    documented = [public[name] for name in headings]
    missing = [name for name, value in public.items()
               if name not in headings and not any(value is other for other in documented)]
    assert not missing, "public names missing from api.md (add their module to SECTIONS in docs/gen_api.py)"


def test_allocator_exports_no_machinery():
    # What the allocator's layers above use is imported from its own module, not made public.
    import accel.allocator

    machinery = {"AllocatorRegistry", "registry", "allocators", "Block", "BufferExports", "install_exports",
                 "check_pool_id", "new_private_pool_id", "current_allocator", "HostCachingAllocator",
                 "full_snapshot", "summary"}
    assert not machinery & set(accel.allocator.__all__)
    assert not machinery & set(dir(accel.allocator))


def test_getting_started_runs_on_the_host_backend(tmp_path):
    blocks = _python_blocks("getting-started.md")
    assert len(blocks) >= 8
    script = tmp_path / "getting_started.py"
    script.write_text("\n".join(f"# --- block {i}\n{b}" for i, b in enumerate(blocks)))
    env = {**os.environ, "ACCEL_BACKEND": "cpu", "PYTHONPATH": str(ROOT)}
    for name in ("ACCEL_ALLOC_CONF", "ACCEL_CPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "out of range" in result.stdout and "max_split_size_mb" in result.stdout


@pytest.mark.parametrize("page", PAGES)
def test_links_resolve(page):
    for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", (DOCS / page).read_text()):
        assert (DOCS / target).exists(), f"{page} links to {target}, which does not exist"


@pytest.mark.parametrize("page", PAGES)
def test_accel_names_exist(page):
    import accel
    import accel._interop

    text = (DOCS / page).read_text()
    names = set(re.findall(r"`(accel(?:\.[A-Za-z_][A-Za-z0-9_]*)+)", text))
    assert names
    for name in sorted(names):
        obj = accel
        for part in name.split(".")[1:]:
            assert hasattr(obj, part) or importlib.util.find_spec(f"{obj.__name__}.{part}") is not None, \
                f"{page} mentions {name}, which does not exist"
            obj = getattr(obj, part, None) or importlib.import_module(f"{obj.__name__}.{part}")


_RUN_EACH_BLOCK = r'''
import doctest, io, re, sys, traceback
blocks = re.findall(r"```python\n(.*?)```", open(sys.argv[1]).read(), flags=re.S)
failed = 0
for i, block in enumerate(blocks):
    namespace = {"__name__": f"api_md_block_{i}"}  # nothing from the other blocks
    report = io.StringIO()
    try:
        if block.lstrip().startswith(">>>"):
            test = doctest.DocTestParser().get_doctest(block, namespace, f"block {i}", None, 0)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            runner.run(test, out=report.write)
            ok = not runner.failures
        else:
            exec(compile(block, f"block {i}", "exec"), namespace)
            ok = True
    except BaseException:
        report.write(traceback.format_exc())
        ok = False
    if not ok:
        failed += 1
        print(f"--- block {i} fails when pasted alone:\n{block}\n{report.getvalue()[-1500:]}")
print(f"{len(blocks)} blocks, {failed} failed")
sys.exit(1 if failed else 0)
'''


def test_every_api_example_runs_on_its_own(tmp_path):
    """Each example of docs/api.md, pasted alone into a fresh interpreter namespace, runs as shown."""
    script = tmp_path / "run_blocks.py"
    script.write_text(_RUN_EACH_BLOCK)
    env = {**os.environ, "ACCEL_BACKEND": "cpu", "ACCEL_CPU_DEVICES": "2", "PYTHONPATH": str(ROOT)}
    for name in ("ACCEL_ALLOC_CONF", "ACCEL_CPU_ALLOC_CONF", "PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        env.pop(name, None)
    result = subprocess.run([sys.executable, str(script), str(DOCS / "api.md")], cwd=tmp_path, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert int(result.stdout.split()[-4]) >= 50
