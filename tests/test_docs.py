"""The docs stay true: the API reference is regenerated, the getting-started
code runs, links and the accel names the pages mention exist."""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = ("index.md", "getting-started.md", "concepts.md", "graphs.md", "distributed.md")



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


#: Every page a reader can reach: links and anchors must resolve on all of them.
ALL_PAGES = sorted(str(p.relative_to(ROOT)) for p in [ROOT / "README.md", *DOCS.rglob("*.md")])


def _anchors(path: Path) -> set[str]:
    """The heading anchors GitHub gives ``path``: lower case, punctuation dropped, spaces as dashes."""
    anchors = set()
    for heading in re.findall(r"^#{1,6} (.+)$", path.read_text(), flags=re.M):
        anchors.add(re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-"))
    return anchors


@pytest.mark.parametrize("page", ALL_PAGES)
def test_links_resolve(page):
    path = ROOT / page
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for target, anchor in re.findall(r"\]\(([^)#:\s]*)(?:#([^)\s]*))?\)", text):
        resolved = (path.parent / target).resolve() if target else path
        assert resolved.exists(), f"{page} links to {target}, which does not exist"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), f"{page} links to {target}#{anchor}, which has no such heading"


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


# --------------------------------------------------------------------------- what ran where
#
# docs/verify.md's table of real-hardware runs is the one record of what accel ran on
# real GPUs. Each row with a report is checked against the committed report, and every
# other page must agree with the record: no page may say that nothing ran on a real GPU,
# name a GPU the record does not have, or quote GPU figures the report does not hold.

VERIFY = DOCS / "verify.md"
REPORTS = DOCS / "verify"


def _table(text: str, marker: str) -> list[dict[str, str]]:
    """The markdown table between ``<!-- marker...-->`` and ``<!-- /marker -->``, as dicts."""
    block = re.search(rf"<!-- {marker}\b.*?-->\n(.*?)<!-- /{marker} -->", text, flags=re.S)
    assert block, f"no <!-- {marker} --> table"
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in block.group(1).splitlines() if line.startswith("|")]
    header, _, *body = rows
    assert body and all(len(row) == len(header) for row in body)
    return [dict(zip(header, row)) for row in body]


def _hardware_runs() -> list[dict[str, str]]:
    return _table(VERIFY.read_text(), "real-hardware-runs")


def _report_of(row: dict[str, str]) -> dict | None:
    link = re.fullmatch(r"\[[^\]]+\]\(verify/([^)]+)\.md\)", row["report"])
    return json.loads((REPORTS / f"{link.group(1)}.json").read_text()) if link else None


def test_the_record_of_real_hardware_runs_is_copied_from_the_reports():
    runs = _hardware_runs()
    recorded = set()
    for row in runs:
        report = _report_of(row)
        if report is None:
            assert row["report"] == "none committed", row
            continue
        driver = next(step for step in report["steps"] if step["name"] == "driver")
        assert row["started (UTC)"] == report["started"][:19].replace("T", " ")
        assert row["backend"] == report["backend"]
        assert row["device"] == driver["device"]["name"]
        assert row["driver"] == driver["device"]["driver_version"]
        assert row["torch"] == report["versions"]["torch"]
        assert row["result"] == report["status"]
        assert row["steps"] == "; ".join(f"{s['name']} {s['status']} ({s['summary']})" for s in report["steps"])
        recorded.add(re.search(r"\(verify/([^)]+)\.md\)", row["report"]).group(1))
    committed = {path.stem for path in REPORTS.glob("*.json")}
    assert committed <= recorded, f"reports with no row in verify.md's record: {sorted(committed - recorded)}"


#: What a page may not say: that accel never ran on a real GPU. (Statements that one
#: feature or one vendor was not run stay allowed: the record says which.)
_NEVER_RAN = [
    r"no accel code has (ever )?(run|ran)",
    r"no real (nvidia )?gpu (so far|yet|has|was|run)",
    r"no gpu (numbers|results|run)",
    r"no gpu was (available|lent)",
    r"(has|have) never been run",
    r"(has|have) not (yet )?been run\b",
    r"not verified on (a real gpu|real hardware|hardware)\b",
]
#: GPU models as pages name them (NVIDIA data-center and consumer parts, AMD Instinct, Intel).
_GPU_MODEL = re.compile(
    r"\b(?:[ABHLV]100|H200|H20|A10G?|A30|A40|L4|L40S?|T4|GH200|GB200|B200|MI\d{3}X?|RTX ?\d{4}"
    r"|Arc ?[AB]\d{3}|Max ?1[15]\d0|Ponte Vecchio|Gaudi\d?)\b")


def _pages_that_must_agree() -> list[Path]:
    """Every page but the record, its reports and the archive (history, dated as written)."""
    return [ROOT / page for page in ALL_PAGES
            if not page.startswith(("docs/archive/", "docs/verify/")) and page != "docs/verify.md"]


def test_no_page_says_accel_never_ran_on_a_real_gpu():
    assert any(row["result"] == "passed" for row in _hardware_runs())
    found = []
    for path in _pages_that_must_agree():
        text = " ".join(path.read_text().split())  # a phrase may wrap
        for pattern in _NEVER_RAN:
            found += [f"{path.relative_to(ROOT)}: ...{m.group(0)}..." for m in re.finditer(pattern, text, re.I)]
    assert not found, "pages contradicting docs/verify.md's record of real-hardware runs:\n" + "\n".join(found)


def test_every_gpu_a_page_names_is_in_the_record_and_linked():
    recorded = {m.group(0) for row in _hardware_runs() for m in _GPU_MODEL.finditer(row["device"])}
    assert recorded == {"H100"}
    for path in [*_pages_that_must_agree(), VERIFY]:
        text = path.read_text()
        named = {m.group(0) for m in _GPU_MODEL.finditer(text)}
        assert named <= recorded, f"{path.relative_to(ROOT)} names {sorted(named - recorded)}, which no recorded run used"
        if named and path != VERIFY:
            assert "verify.md" in text, f"{path.relative_to(ROOT)} names {sorted(named)} without linking docs/verify.md"


def test_gpu_figures_are_the_reports():
    text = (DOCS / "benchmarks.md").read_text()
    section = text[text.index("## On a real GPU"):]
    report_link = re.search(r"\[report\]\(verify/([^)]+)\.md\)", section).group(1)
    assert report_link in {re.search(r"verify/([^)]+)\.md", row["report"]).group(1)
                           for row in _hardware_runs() if row["report"] != "none committed"}
    report = json.loads((REPORTS / f"{report_link}.json").read_text())
    measured = {row["name"]: row for step in report["steps"] if step["name"] == "benchmarks"
                for module in step["modules"] for row in module["rows"]}
    every_run = [json.loads(path.read_text()) for path in sorted(REPORTS.glob("*.json"))]
    rows = _table(section, "gpu-figures")
    assert {row["case"] for row in rows} == set(measured)
    for row in rows:
        figure = measured[row["case"]]
        assert row["accel / torch"] == f"{figure['ratio']:.2f}x", row
        assert row["baseline"] == f"{figure['baseline']} ({figure['metric']})", row
        ratios = [r["ratio"] for run in every_run for step in run["steps"] if step["name"] == "benchmarks"
                  for module in step["modules"] for r in module["rows"] if r["name"] == row["case"]]
        assert row["the three runs"] == f"{min(ratios):.2f}x–{max(ratios):.2f}x", row
