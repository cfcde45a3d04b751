"""``accel bench``: run the benchmarks and print their ratios.

Benchmarks are the ``benchmarks/bench_*.py`` modules of the accel source
tree. Each one that defines ``run(quick: bool) -> list[dict]`` is run; every
row it returns has a ``name`` and a ``ratio`` (accel against the row's
``baseline``, higher is better for accel: baseline time / accel time for
speed). The contract is written
down in ``benchmarks/README.md``. A progress bar goes to stderr, the results
to stdout (a table, or JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from accel._cli import print_json
from accel._errors import InvalidValueError

NAME = "bench"
HELP = "run the benchmarks (benchmarks/bench_*.py) and print accel's ratios against their baselines"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run, e.g. 'alloc' for bench_alloc.py (default: all)")
    parser.add_argument("--quick", action="store_true", help="fewer repetitions: a smoke run, not a measurement")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--list", action="store_true", help="list the benchmarks found and exit")
    parser.add_argument("--dir", type=Path, default=None, help="the benchmarks directory (default: ./benchmarks, else the one beside the accel package)")


def find_benchmarks_dir(explicit: Path | None) -> Path:
    """The directory holding ``bench_*.py``: ``--dir``, ``./benchmarks``, or the source tree's."""
    if explicit is not None:
        if not explicit.is_dir():
            raise InvalidValueError(f"--dir {str(explicit)!r} is not a directory")
        return explicit
    for candidate in (Path.cwd() / "benchmarks", Path(__file__).resolve().parents[2] / "benchmarks"):
        if candidate.is_dir() and any(candidate.glob("bench_*.py")):
            return candidate
    raise InvalidValueError(
        "no benchmarks directory found: run from the accel source tree or pass --dir DIR "
        "(a directory of bench_*.py modules)"
    )


def select(directory: Path, names: Sequence[str]) -> list[Path]:
    """The benchmark files to run, in name order; unknown names are an error."""
    found = sorted(directory.glob("bench_*.py"))
    if not found:
        raise InvalidValueError(f"{str(directory)!r} has no bench_*.py modules")
    if not names:
        return found
    by_name = {path.stem: path for path in found}
    chosen = []
    for name in names:
        stem = name.removesuffix(".py")
        stem = stem if stem.startswith("bench_") else f"bench_{stem}"
        if stem not in by_name:
            available = ", ".join(s.removeprefix("bench_") for s in by_name)
            raise InvalidValueError(f"no benchmark called {name!r}; available: {available}")
        chosen.append(by_name[stem])
    return chosen


def _load(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"accel_bench_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise InvalidValueError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    # Registered while it runs, as an import would (dataclasses look it up);
    # benchmarks may import helpers that sit beside them.
    sys.modules[spec.name] = module
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(spec.name, None)
        raise
    finally:
        sys.path.remove(str(path.parent))
    return module


def _check_rows(rows: object, module: str) -> list[dict[str, Any]]:
    if not isinstance(rows, list):
        raise InvalidValueError(f"{module}.run() returned {type(rows).__name__}, not a list of rows")
    for row in rows:
        if not isinstance(row, dict) or not isinstance(row.get("name"), str):
            raise InvalidValueError(f"{module}.run() returned a row without a 'name': {row!r}")
        ratio = row.get("ratio")
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not math.isfinite(ratio) or ratio <= 0:
            raise InvalidValueError(f"{module}.run() row {row['name']!r} has ratio={ratio!r}; it must be a positive number")
    return rows


class _Progress:
    """A one-line bar on stderr when it is a terminal; plain lines otherwise."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.tty = sys.stderr.isatty()

    def show(self, done: int, label: str) -> None:
        width = 24
        filled = width * done // max(self.total, 1)
        line = f"[{'#' * filled}{'-' * (width - filled)}] {done}/{self.total} {label}"
        if self.tty:
            sys.stderr.write(f"\r\x1b[2K{line}")
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.tty:
            sys.stderr.write("\r\x1b[2K")
            sys.stderr.flush()


def run_benchmarks(paths: Sequence[Path], quick: bool) -> list[dict[str, Any]]:
    """Run each module's ``run(quick)``; one result per module, errors caught and reported."""
    results = []
    progress = _Progress(len(paths))
    for done, path in enumerate(paths):
        progress.show(done, path.stem)
        started = time.perf_counter()
        result: dict[str, Any] = {"module": path.stem, "rows": []}
        try:
            module = _load(path)
            runner = getattr(module, "run", None)
            if not callable(runner):
                result["status"] = "skipped"
                result["reason"] = f"no run(quick) function; run it directly: python {path}"
            else:
                result["rows"] = _check_rows(runner(quick), path.stem)
                result["status"] = "ok"
        # Benchmarks are scripts too: sys.exit() or argparse's error() in one
        # must end that module's run, not the whole command.
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - one broken benchmark must not hide the others
            result["status"] = "error"
            result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
        result["seconds"] = round(time.perf_counter() - started, 3)
        results.append(result)
    progress.show(len(paths), "done")
    progress.close()
    return results


def run(args: argparse.Namespace) -> int:
    directory = find_benchmarks_dir(args.dir)
    paths = select(directory, args.names)
    if args.list:
        if args.json:
            print_json([p.stem for p in paths])
        else:
            print("\n".join(p.stem.removeprefix("bench_") for p in paths))
        return 0
    results = run_benchmarks(paths, args.quick)
    ok = all(r["status"] != "error" for r in results)
    if args.json:
        print_json({"directory": str(directory), "quick": args.quick, "ok": ok, "modules": results})
    else:
        _print_table(results)
    for result in results:
        if result["status"] == "error":
            print(f"accel bench: {result['module']} failed: {result['error']}", file=sys.stderr)
    return 0 if ok else 1


def _print_table(results: list[dict[str, Any]]) -> None:
    lines = [("benchmark", "case", "ratio", "baseline (metric)")]
    for result in results:
        if result["status"] == "skipped":
            lines.append((result["module"], f"(skipped: {result['reason']})", "", ""))
        elif result["status"] == "error":
            lines.append((result["module"], "(failed, see below)", "", ""))
        for row in result["rows"]:
            baseline = str(row.get("baseline", ""))
            if row.get("metric"):
                baseline += f" ({row['metric']})"
            lines.append((result["module"], row["name"], f"{row['ratio']:.2f}x", baseline))
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    for line in lines:
        print(f"{line[0]:<{widths[0]}}  {line[1]:<{widths[1]}}  {line[2]:>{widths[2]}}  {line[3]}".rstrip())
    print("ratio above 1.00x: accel does better than the baseline (for times: baseline time / accel time)")
