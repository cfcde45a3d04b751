"""``accel verify``: check the current backend's device 0 end to end, and report.

The first thing to run the day a real GPU is lent (docs/verify.md). In order,
each step bounded in time so the whole run ends within ``--time-limit``
(8 minutes by default):

1. **driver**: the backend loads (every required entry point of the driver
   resolved), device 0 answers; its name, UUID, driver version, memory and
   the optional features (virtual memory and its granularity, graphs) are
   recorded.
2. **abi**: accel's declarations of the driver API against the vendor's
   headers (``tests/backends/test_abi.py``; it skips where the headers
   cannot be had).
3. **conformance**: the conformance suite (``tests/conformance``) on this
   backend, in a fresh interpreter, pass/fail per test.
4. **real-device scenarios**: the backend's real-hardware tests (for CUDA,
   torch's CUDA graphs carrying accel captures, torch tensors on accel's
   allocator through ``torch_allocator()``, and the survey of what the
   driver refuses during a global capture, its VMM granularity and the UUID
   it reports); they skip themselves where no real device is present.
5. **benchmarks**: the allocator against torch's caching allocator (its
   4096-byte pairs interleaved with ``torch.empty``, torch through accel's
   pluggable allocator among them) and graph replay against eager
   (``benchmarks/``), with their figures.

The report goes to stdout (markdown, or JSON with ``--json``) and, with
``--output DIR``, to ``DIR/report.md`` and ``DIR/report.json``. The exit code
is 1 when a step failed, else 0. Steps 2 to 5 need the accel source tree
(its ``tests/`` and ``benchmarks/``) and pytest.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

from accel._errors import AccelError, InvalidValueError

NAME = "verify"
HELP = "check the current backend's device 0 end to end (driver, conformance, real-device tests, benchmarks) and report"

#: The ABI test of each backend's bindings: (test file, -k expression).
ABI_TESTS: dict[str, tuple[str, str]] = {"cuda": ("tests/backends/test_abi.py", "not level_zero"),
                                         "xpu": ("tests/backends/test_abi.py", "level_zero")}
#: Real-hardware test files per backend, run after the conformance suite: their ``gpu``-marked
#: tests, which skip without real hardware.
REAL_DEVICE_TESTS: dict[str, tuple[str, ...]] = {
    "cuda": ("tests/graph/test_torch_graphs_real_gpu.py", "tests/allocator/test_torch_allocator_real_gpu.py",
             "tests/backends/cuda/test_known_unknowns.py"),
}
#: The benchmarks the report carries (names as ``accel bench`` takes them).
BENCHMARKS = ("allocator_cuda", "graph")
#: Each step's own ceiling in seconds (the overall --time-limit also applies).
STEP_SECONDS = {"abi": 60, "conformance": 240, "real-device": 240, "benchmarks": 240}
DEFAULT_TIME_LIMIT = 480


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON instead of markdown")
    parser.add_argument("--output", type=Path, default=None, metavar="DIR",
                        help="also write DIR/report.md and DIR/report.json")
    parser.add_argument("--quick", action="store_true", help="benchmarks as a smoke run (no figures worth keeping)")
    parser.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT, metavar="SECONDS",
                        help=f"stop starting steps and cut the running one after this long (default {DEFAULT_TIME_LIMIT})")
    parser.add_argument("--source", type=Path, default=None, metavar="DIR",
                        help="the accel source tree holding tests/ and benchmarks/ (default: ./, else beside the package)")


def find_source_tree(explicit: Path | None) -> Path | None:
    """The accel source tree (``tests/conformance`` inside), or None when there is none."""
    if explicit is not None:
        if not (explicit / "tests" / "conformance").is_dir():
            raise InvalidValueError(f"--source {str(explicit)!r} has no tests/conformance: pass the accel source tree")
        return explicit.resolve()
    for candidate in (Path.cwd(), Path(__file__).resolve().parents[2]):
        if (candidate / "tests" / "conformance").is_dir() and (candidate / "accel").is_dir():
            return candidate
    return None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


@dataclasses.dataclass
class _Clock:
    limit: float
    start: float = dataclasses.field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.limit - (time.monotonic() - self.start)


def _step(name: str, status: str, summary: str, started: float, **extra: Any) -> dict[str, Any]:
    return {"name": name, "status": status, "summary": summary,
            "seconds": round(time.monotonic() - started, 2), **extra}


def check_driver() -> tuple[dict[str, Any], str | None]:
    """The driver step, and the backend's name when device 0 is usable."""
    started = time.monotonic()
    from accel._runtime import get_runtime

    try:
        runtime = get_runtime()
        backend = runtime.backend
        if runtime.device_count() < 1:
            return _step("driver", "failed", f"backend {runtime.name} sees no device", started), None
        props = backend.device_properties(0)
        free, total = backend.memory_info(0)
        device: dict[str, Any] = dataclasses.asdict(props)
        device["extra"] = {key: value for key, value in sorted(props.extra.items())}
        device.update(memory_free=free, memory_total=total, vm_supported=backend.supports_virtual_memory(0),
                      graphs_supported=backend.supports_graphs(0), stream_priority_range=backend.stream_priority_range(0))
        device["vm_granularity"] = backend.vm_granularity(0) if device["vm_supported"] else None
    except AccelError as exc:
        return _step("driver", "failed", str(exc), started), None
    summary = f"{runtime.name}:0 {props.name}, driver {props.driver_version}"
    return _step("driver", "passed", summary, started, backend=runtime.name, device=device), runtime.name


def _environment(source: Path, backend: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, (str(source), env.get("PYTHONPATH"))))
    env["ACCEL_BACKEND"] = backend
    # The test fixtures would otherwise swap in the simulated drivers: use the one this run verifies.
    env[f"ACCEL_TEST_{backend.upper()}"] = "real"
    # The suite's backend-parametrized tests run for this backend only (selected by parameter, not by name).
    env["ACCEL_TEST_BACKENDS"] = backend
    return env


def _junit_cases(path: Path) -> list[dict[str, str]]:
    cases = []
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or child.text or "")
            elif child.tag == "skipped":
                outcome, message = "skipped", child.get("message") or ""
        test_id = f"{case.get('classname', '')}::{case.get('name', '')}"
        cases.append({"id": test_id, "outcome": outcome, "message": " ".join(message.split())[:300]})
    return cases


def run_pytest(name: str, source: Path, backend: str, paths: list[str], options: list[str],
               seconds: float, *, need_a_pass: bool) -> dict[str, Any]:
    """One pytest run in a fresh interpreter, as a report step with pass/fail per test."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={xml}", *options, *paths]
        try:
            result = subprocess.run(command, cwd=source, env=_environment(source, backend),
                                    capture_output=True, text=True, timeout=seconds, check=False)
        except subprocess.TimeoutExpired:
            return _step(name, "failed", f"timed out after {seconds:.1f} s", started)
        cases = _junit_cases(xml) if xml.exists() else []
    counts = {o: sum(c["outcome"] == o for c in cases) for o in ("passed", "failed", "skipped")}
    summary = ", ".join(f"{n} {o}" for o, n in counts.items() if n) or "no tests"
    tail = (result.stdout + result.stderr).strip().splitlines()[-20:]
    if result.returncode not in (0, 5) or counts["failed"]:
        status = "failed"
    elif need_a_pass and not counts["passed"]:
        status, summary = "failed", f"no test passed on {backend} ({summary})"
    elif not counts["passed"]:
        status = "skipped"
    else:
        status = "passed"
    return _step(name, status, summary, started, tests=cases, output_tail=tail if status == "failed" else [])


def run_benchmarks(source: Path, backend: str, quick: bool, seconds: float) -> dict[str, Any]:
    """``accel bench`` in a fresh interpreter: each benchmark's status and figures."""
    started = time.monotonic()
    command = [sys.executable, "-m", "accel", "bench", "--json", "--dir", str(source / "benchmarks"), *BENCHMARKS]
    if quick:
        command.append("--quick")
    try:
        result = subprocess.run(command, cwd=source, env=_environment(source, backend),
                                capture_output=True, text=True, timeout=seconds, check=False)
    except subprocess.TimeoutExpired:
        return _step("benchmarks", "failed", f"timed out after {seconds:.1f} s", started)
    try:
        modules = json.loads(result.stdout)["modules"]
    except (ValueError, KeyError):
        tail = (result.stdout + result.stderr).strip().splitlines()[-20:]
        return _step("benchmarks", "failed", "accel bench gave no report", started, output_tail=tail)
    # What a benchmark printed about itself (why it skipped) is on stderr, one line per remark.
    notes = [line for line in result.stderr.splitlines() if line.startswith("bench_")]
    failed = [m["module"] for m in modules if m["status"] == "error"]
    rows = sum(len(m["rows"]) for m in modules)
    status = "failed" if failed or result.returncode != 0 else ("passed" if rows else "skipped")
    summary = f"{rows} figures from {len(modules)} benchmarks" + (f"; failed: {', '.join(failed)}" if failed else "")
    return _step("benchmarks", status, summary, started, quick=quick, modules=modules, notes=notes)


def collect(source: Path | None, quick: bool, time_limit: float) -> dict[str, Any]:
    """Run every step; the report as plain data (``status`` is ``passed`` or ``failed``)."""
    import accel

    clock = _Clock(time_limit)
    began = datetime.now(timezone.utc)
    driver, backend = check_driver()
    steps = [driver]
    planned = ["abi", "conformance", "real-device", "benchmarks"]
    for name in planned:
        seconds = min(STEP_SECONDS[name], clock.left())
        if backend is None:
            steps.append({"name": name, "status": "skipped", "summary": "the driver step failed", "seconds": 0})
        elif source is None:
            steps.append({"name": name, "status": "failed", "seconds": 0,
                          "summary": "no accel source tree (tests/, benchmarks/): run from a checkout or pass --source"})
        elif seconds <= 0:
            steps.append({"name": name, "status": "failed", "seconds": 0,
                          "summary": f"not started: the {time_limit:.0f} s time limit was used up"})
        elif name == "abi":
            if backend not in ABI_TESTS:
                steps.append({"name": name, "status": "skipped", "seconds": 0, "summary": f"{backend} binds no driver"})
            else:
                print(f"accel verify: {backend} bindings against the vendor headers...", file=sys.stderr)
                path, select = ABI_TESTS[backend]
                steps.append(run_pytest(name, source, backend, [path], ["-k", select], seconds, need_a_pass=False))
        elif name == "conformance":
            print(f"accel verify: conformance suite on {backend}...", file=sys.stderr)
            steps.append(run_pytest(name, source, backend, ["tests/conformance"], [], seconds,
                                    need_a_pass=True))
        elif name == "real-device":
            paths = list(REAL_DEVICE_TESTS.get(backend, ()))
            if not paths:
                steps.append({"name": name, "status": "skipped", "seconds": 0,
                              "summary": f"no real-device tests for {backend}"})
            else:
                print(f"accel verify: real-device tests on {backend}...", file=sys.stderr)
                steps.append(run_pytest(name, source, backend, paths, ["-m", "gpu"], seconds, need_a_pass=False))
        else:
            print(f"accel verify: benchmarks on {backend}...", file=sys.stderr)
            steps.append(run_benchmarks(source, backend, quick, seconds))
    failed = [s["name"] for s in steps if s["status"] == "failed"]
    return {
        "status": "failed" if failed else "passed",
        "failed_steps": failed,
        "backend": backend,
        "started": began.isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - clock.start, 1),
        "time_limit": time_limit,
        "versions": {"accel": accel.__version__, "python": platform.python_version(),
                     "torch": _version("torch"), "numpy": _version("numpy"), "platform": platform.platform()},
        "source_tree": str(source) if source else None,
        "steps": steps,
    }


def render_markdown(report: dict[str, Any]) -> str:
    """The report as a markdown page (what ``accel verify`` prints and writes)."""
    lines = [f"# accel verify: {report['status'].upper()}", ""]
    versions = ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v)
    lines += [f"- backend: {report['backend'] or '(none loaded)'}", f"- started: {report['started']} UTC, "
              f"took {report['seconds']} s (limit {report['time_limit']:.0f} s)", f"- versions: {versions}", ""]
    lines += ["| step | status | seconds | summary |", "|---|---|---|---|"]
    lines += [f"| {s['name']} | {s['status']} | {s['seconds']} | {s['summary']} |" for s in report["steps"]]
    for step in report["steps"]:
        if step["name"] == "driver" and "device" in step:
            lines += ["", "## Device 0", ""]
            device = step["device"]
            for key in sorted(device):
                if key != "extra":
                    lines.append(f"- {key}: {device[key]}")
            lines += [f"- {key}: {value}" for key, value in device["extra"].items()]
        if step.get("tests"):
            lines += ["", f"## {step['name']}", ""]
            lines += [f"- {c['outcome']}: {c['id']}" + (f" ({c['message']})" if c["message"] else "")
                      for c in step["tests"]]
        if step["name"] == "benchmarks" and "modules" in step:
            lines += ["", "## benchmarks" + (" (--quick: smoke run, not a measurement)" if step["quick"] else ""), "",
                      "| benchmark | case | ratio | baseline |", "|---|---|---|---|"]
            if not any(module["rows"] for module in step["modules"]):
                lines.append("| (no figures on this backend) | | | |")
            for module in step["modules"]:
                for row in module["rows"]:
                    lines.append(f"| {module['module']} | {row['name']} | {row['ratio']:.2f}x | "
                                 f"{row.get('baseline', '')} {('(' + row['metric'] + ')') if row.get('metric') else ''} |")
            lines += [f"- {note}" for note in step["notes"]]
        if step.get("output_tail"):
            lines += ["", f"{step['name']} output (last lines):", "", "```", *step["output_tail"], "```"]
    return "\n".join(lines) + "\n"


def run(args: argparse.Namespace) -> int:
    from accel._cli import print_json

    if not args.time_limit > 0:
        raise InvalidValueError(f"--time-limit {args.time_limit}: give a positive number of seconds")
    report = collect(find_source_tree(args.source), args.quick, args.time_limit)
    markdown = render_markdown(report)
    if args.output is not None:
        args.output.mkdir(parents=True, exist_ok=True)
        (args.output / "report.md").write_text(markdown)
        (args.output / "report.json").write_text(json.dumps(report, indent=2, sort_keys=True, default=str) + "\n")
    if args.json:
        print_json(report)
    else:
        print(markdown, end="")
    return 0 if report["status"] == "passed" else 1
