"""Start-up on a machine without GPUs: ``import accel`` and the first device call, against ``python -c pass``.

Each round starts, in turn, one fresh interpreter for each of:

- ``python -c pass``: the interpreter alone (the floor);
- ``import accel``;
- ``import accel; accel.current_accelerator()``: the first call that selects
  a backend, probing the CUDA driver and the Level Zero loader first.

The children run without ``ACCEL_*`` variables and without
``ZE_ENABLE_ALT_DRIVERS``, so on a machine without GPUs the host backend is
selected, with byte code cached (a private ``PYTHONPYCACHEPREFIX``, warmed
before timing) as in an installed package. Reported: the median wall time of
each over the rounds, with the spread (quartiles), and the median cost of the
first call measured inside the child (``perf_counter`` around it), which
start-up noise does not touch. The target (issue 16): the first call costs at
most 20 ms more than ``import accel``.

    python benchmarks/bench_startup.py            # Markdown table
    python benchmarks/bench_startup.py --quick    # a smoke run
    python benchmarks/bench_startup.py --json     # raw numbers
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

CASES = {
    "python -c pass": "pass",
    "import accel": "import accel",
    "import accel; accel.current_accelerator()": (
        "import time, accel\n"
        "t = time.perf_counter()\n"
        "device = accel.current_accelerator()\n"
        "print(time.perf_counter() - t, device)"
    ),
}


def _env(cache: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("ACCEL_") and k not in ("ZE_ENABLE_ALT_DRIVERS", "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    env["PYTHONPYCACHEPREFIX"] = cache
    return env


def _start(code: str, env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT, check=True
    )
    return time.perf_counter() - start, result.stdout


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q1, median, q3 = statistics.quantiles(values, n=4) if len(values) > 1 else (values[0],) * 3
    return q1, median, q3


def measure(rounds: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="accel-bench-pyc-") as cache:
        env = _env(cache)
        for code in CASES.values():  # warm the byte-code cache and the page cache
            _start(code, env)
        wall: dict[str, list[float]] = {name: [] for name in CASES}
        first_call: list[float] = []
        device = ""
        for _ in range(rounds):
            for name, code in CASES.items():
                seconds, out = _start(code, env)
                wall[name].append(seconds)
                if out:
                    inside, device = out.split(maxsplit=1)
                    first_call.append(float(inside))
    ms = {name: [s * 1e3 for s in values] for name, values in wall.items()}
    return {
        "rounds": rounds,
        "device": device.strip(),
        "wall_ms": {name: _quartiles(values) for name, values in ms.items()},
        "first_call_ms": _quartiles([s * 1e3 for s in first_call]),
        # Per round, so that a slow moment hits both sides of the difference.
        "extra_ms": _quartiles([b - a for a, b in zip(ms["import accel"], ms["import accel; accel.current_accelerator()"])]),
        "import_extra_ms": _quartiles([b - a for a, b in zip(ms["python -c pass"], ms["import accel"])]),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, Linux {platform.release()}, Python {platform.python_version()}",
    }


def run(quick: bool) -> list[dict]:
    result = measure(5 if quick else 41)
    wall = result["wall_ms"]
    assert isinstance(wall, dict)
    base, full = wall["import accel"][1], wall["import accel; accel.current_accelerator()"][1]
    floor = wall["python -c pass"][1]
    return [
        {"name": "import accel; current_accelerator() (no GPU) vs import accel", "ratio": base / full,
         "baseline": "import accel", "extra_ms": result["extra_ms"], "first_call_ms": result["first_call_ms"]},
        {"name": "import accel vs python -c pass", "ratio": floor / base, "baseline": "python -c pass",
         "extra_ms": result["import_extra_ms"]},
    ]


def _row(name: str, q: tuple[float, float, float]) -> str:
    return f"| {name} | {q[1]:.1f} | {q[0]:.1f} – {q[2]:.1f} |"


def main(argv: list[str]) -> int:
    result = measure(5 if "--quick" in argv else 41)
    if "--json" in argv:
        print(json.dumps(result, indent=2))
        return 0
    wall = result["wall_ms"]
    assert isinstance(wall, dict)
    print(f"Machine: {result['machine']}; {result['rounds']} interleaved rounds; selected: {result['device']}\n")
    print("| process | median ms | quartiles ms |")
    print("|---|---|---|")
    for name, q in wall.items():
        print(_row(f"`{name}`", q))
    print(_row("first call minus `import accel` (per round)", result["extra_ms"]))  # type: ignore[arg-type]
    print(_row("`import accel` minus `python -c pass` (per round)", result["import_extra_ms"]))  # type: ignore[arg-type]
    print(_row("`current_accelerator()` timed inside the process", result["first_call_ms"]))  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
