"""``accel bench``: discovery, the run(quick) contract, progress on stderr, --json, failures."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from accel._cli import main

_GOOD = """
CALLS = []

def run(quick):
    CALLS.append(quick)
    return [{"name": "alloc 4 KiB", "ratio": 2.5, "baseline": "raw malloc", "accel_us": 1.0},
            {"name": "alloc 1 MiB", "ratio": 0.8, "baseline": "raw malloc"}]

def main(argv):
    return 0
"""


def _bench_dir(tmp_path: Path, **modules: str) -> Path:
    directory = tmp_path / "benchmarks"
    directory.mkdir(exist_ok=True)
    for name, source in modules.items():
        (directory / f"bench_{name}.py").write_text(textwrap.dedent(source))
    return directory


def _run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_table_of_ratios_and_progress_on_stderr(tmp_path, capsys):
    directory = _bench_dir(tmp_path, alloc=_GOOD, graph="def run(quick):\n    return [{'name': 'replay', 'ratio': 3, 'baseline': 'eager', 'metric': 'CPU time'}]\n")
    code, out, err = _run(["bench", "--dir", str(directory)], capsys)
    assert code == 0
    assert "bench_alloc  alloc 4 KiB" in out and "2.50x  raw malloc" in out and "0.80x" in out
    assert "bench_graph  replay" in out and "3.00x  eager (CPU time)" in out
    assert "ratio above 1.00x: accel does better than the baseline" in out
    # Not a terminal here: one progress line per step.
    assert err.splitlines() == [
        "[------------------------] 0/2 bench_alloc",
        "[############------------] 1/2 bench_graph",
        "[########################] 2/2 done",
    ]


def test_json_and_quick(tmp_path, capsys):
    directory = _bench_dir(tmp_path, alloc=_GOOD)
    code, out, _ = _run(["bench", "--dir", str(directory), "--quick", "--json"], capsys)
    assert code == 0
    report = json.loads(out)
    assert report["ok"] is True and report["quick"] is True
    (module,) = report["modules"]
    assert module["module"] == "bench_alloc" and module["status"] == "ok"
    assert module["rows"][0] == {"name": "alloc 4 KiB", "ratio": 2.5, "baseline": "raw malloc", "accel_us": 1.0}


def test_quick_flag_reaches_run(tmp_path, capsys):
    directory = _bench_dir(tmp_path, probe="def run(quick):\n    return [{'name': 'quick' if quick else 'full', 'ratio': 1.0}]\n")
    assert '"name": "quick"' in _run(["bench", "--dir", str(directory), "--quick", "--json"], capsys)[1]
    assert '"name": "full"' in _run(["bench", "--dir", str(directory), "--json"], capsys)[1]


def test_select_by_name_and_list(tmp_path, capsys):
    directory = _bench_dir(tmp_path, alloc=_GOOD, graph="raise SystemError('never imported')\n")
    code, out, _ = _run(["bench", "--dir", str(directory), "--list"], capsys)
    assert (code, out.split()) == (0, ["bench_alloc", "bench_graph"])
    code, listed, _ = _run(["bench", "--dir", str(directory), "--list", "--json"], capsys)
    assert json.loads(listed) == out.split()  # the same names both ways, as results name them
    code, out, _ = _run(["bench", "--dir", str(directory), "alloc", "--json"], capsys)
    assert code == 0 and [m["module"] for m in json.loads(out)["modules"]] == ["bench_alloc"]
    code, out, _ = _run(["bench", "--dir", str(directory), "bench_alloc.py", "--json"], capsys)
    assert code == 0 and len(json.loads(out)["modules"]) == 1


def test_failures_are_reported_and_the_rest_still_run(tmp_path, capsys):
    directory = _bench_dir(
        tmp_path,
        a_broken="def run(quick):\n    raise RuntimeError('device fell off\\nsecond line')\n",
        b_badrow="def run(quick):\n    return [{'name': 'x', 'ratio': float('nan')}]\n",
        c_noname="def run(quick):\n    return [{'ratio': 1.0}]\n",
        d_notlist="def run(quick):\n    return {'name': 'x', 'ratio': 1.0}\n",
        e_import="import no_such_module_for_accel_tests\n",
        f_main_only="def main(argv):\n    return 0\n",
        g_good=_GOOD,
        h_exits="import sys\ndef run(quick):\n    sys.exit('replay is not bitwise eager')\n",
    )
    code, out, err = _run(["bench", "--dir", str(directory), "--json"], capsys)
    assert code == 1
    status = {m["module"]: m["status"] for m in json.loads(out)["modules"]}
    assert status == {
        "bench_a_broken": "error", "bench_b_badrow": "error", "bench_c_noname": "error",
        "bench_d_notlist": "error", "bench_e_import": "error", "bench_f_main_only": "skipped",
        "bench_g_good": "ok", "bench_h_exits": "error",
    }
    failures = [line for line in err.splitlines() if line.startswith("accel bench:")]
    assert failures == [
        "accel bench: bench_a_broken failed: RuntimeError: device fell off",
        "accel bench: bench_b_badrow failed: InvalidValueError: bench_b_badrow.run() row 'x' has ratio=nan; it must be a positive number",
        "accel bench: bench_c_noname failed: InvalidValueError: bench_c_noname.run() returned a row without a 'name': {'ratio': 1.0}",
        "accel bench: bench_d_notlist failed: InvalidValueError: bench_d_notlist.run() returned dict, not a list of rows",
        "accel bench: bench_e_import failed: ModuleNotFoundError: No module named 'no_such_module_for_accel_tests'",
        "accel bench: bench_h_exits failed: SystemExit: replay is not bitwise eager",
    ]
    assert "Traceback" not in err


def test_skipped_module_in_the_table(tmp_path, capsys):
    directory = _bench_dir(tmp_path, only_main="def main(argv):\n    return 0\n")
    code, out, _ = _run(["bench", "--dir", str(directory)], capsys)
    assert code == 0 and "(skipped: no run(quick) function; run it directly" in out


@pytest.mark.parametrize(
    ("argv", "code", "message"),
    [
        (["bench", "--dir", "{missing}"], 1, "is not a directory"),
        (["bench", "--dir", "{empty}"], 1, "has no bench_*.py modules"),
        (["bench", "--dir", "{bench}", "nosuch"], 1, "no benchmark called 'nosuch'; available: alloc"),
        (["bench", "--repeat"], 2, "unrecognized arguments: --repeat"),
    ],
)
def test_bad_arguments(tmp_path, capsys, argv, code, message):
    bench = _bench_dir(tmp_path, alloc=_GOOD)
    (tmp_path / "empty").mkdir()
    subs = {"{missing}": str(tmp_path / "nope"), "{empty}": str(tmp_path / "empty"), "{bench}": str(bench)}
    result, _, err = _run([subs.get(a, a) for a in argv], capsys)
    assert result == code and message in err and err.count("\n") == 1


def test_no_benchmarks_directory(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("accel._cli.bench.Path.resolve", lambda self: tmp_path / "x" / "y" / "z")
    code, _, err = _run(["bench"], capsys)
    assert code == 1 and "no benchmarks directory found" in err


def test_finds_the_source_tree_benchmarks_from_anywhere(tmp_path):
    """From another directory, the benchmarks beside the accel package are used (listing imports nothing)."""
    repo = Path(__file__).resolve().parents[2]
    if not any((repo / "benchmarks").glob("bench_*.py")):
        pytest.skip("no bench_*.py modules in this checkout yet")
    result = subprocess.run([sys.executable, "-m", "accel", "bench", "--list"], cwd=tmp_path,
                            env={"PYTHONPATH": str(repo), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stdout.strip()


def test_benchmarks_may_use_dataclasses(tmp_path, capsys):
    directory = _bench_dir(tmp_path, rows="""
        from dataclasses import dataclass

        @dataclass
        class Row:
            name: str
            ratio: float

        def run(quick):
            return [vars(Row("case", 1.5))]
    """)
    code, out, err = _run(["bench", "--dir", str(directory), "--quick"], capsys)
    assert code == 0, err
    assert "1.50x" in out


def test_a_module_with_no_rows_is_skipped_with_its_reason(tmp_path, capsys):
    directory = _bench_dir(tmp_path, gpu="import sys\ndef run(quick):\n    print('bench_gpu: no GPU here; skipped', file=sys.stderr)\n    return []\n")
    code, out, err = _run(["bench", "--dir", str(directory), "--json"], capsys)
    (module,) = json.loads(out)["modules"]
    assert code == 0 and module["status"] == "skipped" and module["reason"] == "bench_gpu: no GPU here; skipped"
    assert "bench_gpu: no GPU here; skipped" in err  # the module's own words still reach stderr
    code, out, _ = _run(["bench", "--dir", str(directory)], capsys)
    assert "(skipped: bench_gpu: no GPU here; skipped)" in out


def test_progress_per_case_with_elapsed_time_and_estimate(tmp_path, capsys):
    directory = _bench_dir(tmp_path, cases="""
        def run(quick, progress=None):
            rows = []
            for i, case in enumerate(["mlp: eager", "mlp: replay"]):
                progress(i, 2, case)
                rows.append({"name": case, "ratio": 1.0})
            return rows
    """)
    code, _, err = _run(["bench", "--dir", str(directory)], capsys)
    lines = err.splitlines()
    assert code == 0
    assert lines[1].startswith("  bench_cases: 0/2 mlp: eager (") and "elapsed)" in lines[1]
    assert lines[2].startswith("  bench_cases: 1/2 mlp: replay (") and "left)" in lines[2]


def test_progress_ticks_on_a_terminal(tmp_path, monkeypatch):
    """On a terminal the line is redrawn while a case runs, so a long case shows time moving."""
    import io
    import time

    from accel._cli import bench

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    progress = bench._Progress(1)
    progress.show(0, "bench_slow")
    time.sleep(1.2)
    progress.close()
    assert terminal.getvalue().count("bench_slow") >= 2


def test_bench_works_from_an_installed_wheel(tmp_path):
    """The wheel carries the benchmarks as accel/_benchmarks; run from elsewhere, they are found."""
    import zipfile

    from tests.test_packaging import build_distribution

    repo = Path(__file__).resolve().parents[2]
    wheel = build_distribution(repo, tmp_path, "wheel")

    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    assert any((site / "accel" / "_benchmarks").glob("bench_*.py"))
    result = subprocess.run([sys.executable, "-m", "accel", "bench", "--list", "--json"], cwd=tmp_path,
                            env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout) == sorted(p.stem for p in (repo / "benchmarks").glob("bench_*.py"))


def test_help_offers_the_benchmarks_that_exist(tmp_path, capsys, monkeypatch):
    # The names come from the benchmarks found (./benchmarks first), not from a list
    # written in the help that can name one that is gone.
    monkeypatch.chdir(tmp_path)
    _bench_dir(tmp_path, pair="", startup="")
    code, out, _ = _run(["bench", "--help"], capsys)
    assert code == 0
    text = " ".join(out.split())
    assert "e.g. 'pair' for bench_pair.py (default: all); found here: pair, startup" in text
    shipped = sorted(path.stem.removeprefix("bench_") for path in (Path(__file__).resolve().parents[2] / "benchmarks").glob("bench_*.py"))
    monkeypatch.chdir(tmp_path / "benchmarks")  # no ./benchmarks: the ones beside the package
    code, out, _ = _run(["bench", "--help"], capsys)
    assert f"found here: {', '.join(shipped)}" in " ".join(out.split())
