"""Pure Python against the mypyc build (``ACCEL_MYPYC=1``): issue 16's allocation and
enqueue rows, the same source both ways.

Builds a copy of this source tree with ``ACCEL_MYPYC=1 setup.py build_ext --inplace``
(mypy and a C compiler needed; a few minutes), then times both trees in alternating
child processes, so that a neighbour's load hits them alike: each process runs 5
batches of every row and keeps its best, and a row reports the median over the
processes with the spread (lowest..highest). Not part of ``accel bench`` (no
``run``): the build alone takes minutes.

    python benchmarks/bench_mypyc.py                 # build into a temporary directory
    python benchmarks/bench_mypyc.py --compiled DIR  # reuse a tree built there
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# One child process: every row 5 times, the best batch of each (µs per operation).
_CHILD = r"""
import json, time, torch, accel
from accel._compiled import compiled
from accel._runtime import get_runtime
from accel.allocator._registry import device_allocator
runtime = get_runtime()
stream = runtime.current_stream(0)
alloc = device_allocator(runtime, 0)
allocate = accel.memory.allocate
created = accel.Stream()
launch = created.launch_host_func
def noop(): pass
def batch(n, op):
    start = time.perf_counter()
    for _ in range(n):
        op()
    return (time.perf_counter() - start) / n * 1e6
def enqueue():
    start = time.perf_counter()
    for _ in range(20000):
        launch(noop)
    per = (time.perf_counter() - start) / 20000 * 1e6
    created.synchronize()
    return per
rows = {
    "accel.memory.allocate(4096).free()": lambda: batch(5000, lambda: allocate(4096).free()),
    "DeviceAllocator malloc(4096) + free": lambda: batch(5000, lambda: alloc.free(alloc.malloc(4096, stream))),
    "accel.empty(4096, uint8) + del": lambda: batch(5000, lambda: accel.empty(4096, dtype=torch.uint8)),
    "torch.empty(4096, uint8) + del (reference)": lambda: batch(5000, lambda: torch.empty(4096, dtype=torch.uint8)),
    "launch_host_func(noop), enqueue only": enqueue,
}
best = {name: min(f() for _ in range(5)) for name, f in rows.items()}
print(json.dumps({"compiled": len(compiled()), "rows": best}))
"""


def build(into: Path) -> Path:
    """A copy of the git-tracked tree (and untracked, not ignored files) built with mypyc."""
    files = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout.split()
    for name in files:
        if (ROOT / name).is_file():
            (into / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, into / name)
    subprocess.run(
        [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
        cwd=into, env={**os.environ, "ACCEL_MYPYC": "1"}, check=True, capture_output=True,
    )
    return into


def measure(trees: dict[str, Path], processes: int) -> dict[str, dict]:
    results: dict[str, dict] = {mode: {"compiled": set(), "rows": {}} for mode in trees}
    for _ in range(processes):
        for mode, tree in trees.items():
            out = subprocess.run(
                [sys.executable, "-c", _CHILD], cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)},
                capture_output=True, text=True, check=True,
            ).stdout
            got = json.loads(out)
            results[mode]["compiled"].add(got["compiled"])
            for name, us in got["rows"].items():
                results[mode]["rows"].setdefault(name, []).append(us)
    return results


def markdown(results: dict[str, dict], processes: int) -> str:
    pure, comp = results["pure"], results["compiled"]
    lines = [
        f"{processes} alternating process pairs; modules compiled: pure {sorted(pure['compiled'])}, "
        f"mypyc {sorted(comp['compiled'])}",
        "",
        "| row | pure Python | mypyc | pure / mypyc |",
        "|---|---|---|---|",
    ]
    for name, a in pure["rows"].items():
        b = comp["rows"][name]
        ma, mb = statistics.median(a), statistics.median(b)
        lines.append(
            f"| {name} | {ma:.2f} µs ({min(a):.2f}..{max(a):.2f}) | {mb:.2f} µs ({min(b):.2f}..{max(b):.2f}) "
            f"| {ma / mb:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compiled", type=Path, help="a tree already built with ACCEL_MYPYC=1 (default: build one)")
    parser.add_argument("--processes", type=int, default=8, help="alternating process pairs (default 8)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="accel-mypyc-") as tmp:
        compiled = args.compiled or build(Path(tmp))
        results = measure({"pure": ROOT, "compiled": compiled}, args.processes)
    if results["compiled"]["compiled"] == {0}:
        print(f"{compiled} has no compiled modules: build it with ACCEL_MYPYC=1", file=sys.stderr)
        return 1
    print(markdown(results, args.processes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
