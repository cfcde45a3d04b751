"""``accel bench``: run the benchmarks and print their ratios.

Benchmarks are the ``benchmarks/bench_*.py`` modules of the accel source
tree, installed with accel as ``accel/_benchmarks``. Each one that defines ``run(quick: bool) -> list[dict]`` is run; every
row it returns has a ``name`` and a ``ratio`` (accel against the row's
``baseline``, higher is better for accel: baseline time / accel time for
speed). The contract is written
down in ``benchmarks/README.md``. A progress bar goes to stderr, the results
to stdout (a table, or JSON with ``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import io
import math
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from accel._cli import print_json
from accel._errors import InvalidValueError

NAME = "bench"
HELP = "run the benchmarks (benchmarks/bench_*.py) and print accel's ratios against their baselines"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    found = _names_found()
    example = found[0] if found else "graph"
    parser.add_argument(
        "names",
        nargs="*",
        metavar="NAME",
        help=f"benchmarks to run, e.g. '{example}' for bench_{example}.py (default: all); found here: "
        + (", ".join(found) if found else "none, pass --dir"),
    )
    parser.add_argument("--quick", action="store_true", help="fewer repetitions: a smoke run, not a measurement")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--list", action="store_true", help="list the benchmarks found and exit")
    parser.add_argument("--dir", type=Path, default=None, help="the benchmarks directory (default: ./benchmarks, else the one installed with accel)")


def find_benchmarks_dir(explicit: Path | None) -> Path:
    """The directory holding ``bench_*.py``: ``--dir``, ``./benchmarks``, the copy
    installed with accel (``accel/_benchmarks`` in a wheel), or the source tree's."""
    if explicit is not None:
        if not explicit.is_dir():
            raise InvalidValueError(f"--dir {str(explicit)!r} is not a directory")
        return explicit
    package = Path(__file__).resolve().parents[1]
    for candidate in (Path.cwd() / "benchmarks", package / "_benchmarks", package.parent / "benchmarks"):
        if candidate.is_dir() and any(candidate.glob("bench_*.py")):
            return candidate
    raise InvalidValueError(
        "no benchmarks directory found: this accel was installed without its benchmarks; "
        "pass --dir DIR (a directory of bench_*.py modules, e.g. benchmarks/ of the accel source tree)"
    )


def _names_found() -> list[str]:
    """The names of the benchmarks ``accel bench`` finds without ``--dir``, for its help."""
    try:
        directory = find_benchmarks_dir(None)
    except InvalidValueError:
        return []
    return [path.stem.removeprefix("bench_") for path in sorted(directory.glob("bench_*.py"))]


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
    """Where the run is, on stderr: the module, and the case it is on with the
    elapsed time and an estimate of what is left, when the module reports its
    cases (``run(quick, progress=...)``, benchmarks/README.md).

    On a terminal one line is redrawn, and ticks every half second so that a
    long case shows time moving; otherwise each step is a plain line.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.stream = sys.stderr  # captured now: a module's own stderr is redirected while it runs
        self.tty = self.stream.isatty()
        self._lock = threading.Lock()
        self._line = ""
        self._started = time.perf_counter()
        self._stop = threading.Event()
        self._ticker: threading.Thread | None = None
        if self.tty:
            self._ticker = threading.Thread(target=self._tick, name="accel-bench-progress", daemon=True)
            self._ticker.start()

    def _bar(self, done: int) -> str:
        width = 24
        filled = width * done // max(self.total, 1)
        return f"[{'#' * filled}{'-' * (width - filled)}] {done}/{self.total}"

    def show(self, done: int, label: str) -> None:
        """Module ``done + 1`` (``label``) starts."""
        with self._lock:
            self._started = time.perf_counter()
            self._line = f"{self._bar(done)} {label}"
            self._write(self._line)

    def step(self, module: str, done: int, total: int, label: str) -> None:
        """A module reports that it starts case ``done + 1`` of ``total`` (``label``)."""
        elapsed = time.perf_counter() - self._started
        left = f", about {_duration(elapsed / done * (total - done))} left" if done else ""
        with self._lock:
            self._line = f"  {module}: {done}/{total} {label} ({_duration(elapsed)} elapsed{left})"
            self._write(self._line)

    def _write(self, line: str) -> None:
        if self.tty:
            since = time.perf_counter() - self._started
            self.stream.write(f"\r\x1b[2K{line} [{_duration(since)}]")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def _tick(self) -> None:
        while not self._stop.wait(0.5):
            with self._lock:
                self._write(self._line)

    def close(self) -> None:
        self._stop.set()
        if self._ticker is not None:
            self._ticker.join()
        if self.tty:
            self.stream.write("\r\x1b[2K")
            self.stream.flush()


def _duration(seconds: float) -> str:
    return f"{seconds:.0f}s" if seconds < 120 else f"{seconds / 60:.0f}min"


def _call(runner: Any, quick: bool, report: Callable[[int, int, str], None]) -> object:
    """``runner(quick)``, with ``progress=report`` when the module takes it."""
    try:
        takes_progress = "progress" in inspect.signature(runner).parameters
    except (TypeError, ValueError):  # a builtin or C callable: no signature to read
        takes_progress = False
    return runner(quick, progress=report) if takes_progress else runner(quick)


def run_benchmarks(paths: Sequence[Path], quick: bool) -> list[dict[str, Any]]:
    """Run each module's ``run(quick)``; one result per module, errors caught and reported."""
    results = []
    progress = _Progress(len(paths))
    try:
        for done, path in enumerate(paths):
            progress.show(done, path.stem)
            results.append(_run_one(path, quick, progress))
        progress.show(len(paths), "done")
    finally:
        progress.close()
    return results


def _run_one(path: Path, quick: bool, progress: _Progress) -> dict[str, Any]:
    started = time.perf_counter()
    result: dict[str, Any] = {"module": path.stem, "rows": []}
    diagnostics = io.StringIO()
    try:
        with contextlib.redirect_stderr(diagnostics):
            module = _load(path)
            runner = getattr(module, "run", None)
            if not callable(runner):
                result["status"] = "skipped"
                result["reason"] = f"no run(quick) function; run it directly: python {path}"
            else:
                rows = _check_rows(
                    _call(runner, quick, lambda done, total, label: progress.step(path.stem, done, total, label)),
                    path.stem,
                )
                result["rows"] = rows
                if rows:
                    result["status"] = "ok"
                else:  # the contract: no rows, and the reason on stderr
                    said = [line for line in diagnostics.getvalue().splitlines() if line.strip()]
                    result["status"] = "skipped"
                    result["reason"] = said[-1].strip() if said else "it measured nothing here"
    # Benchmarks are scripts too: sys.exit() or argparse's error() in one
    # must end that module's run, not the whole command.
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - one broken benchmark must not hide the others
        result["status"] = "error"
        result["error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    finally:
        sys.stderr.write(diagnostics.getvalue())  # what the module said, after its progress lines
    result["seconds"] = round(time.perf_counter() - started, 3)
    return result


def run(args: argparse.Namespace) -> int:
    directory = find_benchmarks_dir(args.dir)
    paths = select(directory, args.names)
    if args.list:
        # The names the table and --json results use (and that NAME accepts).
        if args.json:
            print_json([p.stem for p in paths])
        else:
            print("\n".join(p.stem for p in paths))
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
