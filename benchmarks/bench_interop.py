"""torch tensors on accel memory against torch's own allocator, on the host backend.

Cases, each a create+drop pair of a 4 KiB tensor, timed in interleaved rounds
(one round of every case, then the next round), so that load on a shared
machine hits all of them alike:

- ``accel.empty(4096, dtype=torch.uint8)`` against ``torch.empty``;
- ``accel.as_tensor(buf)`` of a live 4 KiB buffer against ``torch.empty``;
- for scale, ``torch.from_dlpack(buf)`` (accel's ctypes DLPack producer) and
  ``accel.memory.allocate(4096).free()``.

The ratio is torch time / accel time (higher is better for accel), on the
thread's CPU time (what the code costs; none of these cases waits on
another thread) and on the wall clock; the spread is the lowest and highest
of the per-round ratios.

Run: ``python benchmarks/bench_interop.py [--quick]`` from the repository root.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NBYTES = 4096


def _per_call(fn: Callable[[], object], n: int) -> tuple[float, float]:
    """(wall, thread CPU) seconds per call."""
    wall, cpu = time.perf_counter(), time.thread_time()
    for _ in range(n):
        fn()
    return (time.perf_counter() - wall) / n, (time.thread_time() - cpu) / n


def run(quick: bool) -> list[dict]:
    os.environ.setdefault("ACCEL_BACKEND", "cpu")
    import torch

    import accel
    from accel._runtime import activate

    rounds, n = (3, 300) if quick else (15, 5000)
    with activate("cpu"):
        buf = accel.memory.allocate(NBYTES)
        cases: dict[str, Callable[[], object]] = {
            "torch.empty": lambda: torch.empty(NBYTES, dtype=torch.uint8),
            "accel.empty": lambda: accel.empty(NBYTES, dtype=torch.uint8),
            "accel.as_tensor": lambda: accel.as_tensor(buf),
            "torch.from_dlpack(buf)": lambda: torch.from_dlpack(buf),
            "allocate+free": lambda: accel.memory.allocate(NBYTES).free(),
        }
        for fn in cases.values():  # warm every cache once
            _per_call(fn, 100)
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, fn in cases.items():
                times[name].append(_per_call(fn, n))
        buf.free()
    base = times["torch.empty"]
    rows = []
    for name in ("accel.empty", "accel.as_tensor", "torch.from_dlpack(buf)", "allocate+free"):
        cpu_ratios = [b[1] / a[1] for a, b in zip(times[name], base)]
        wall_ratios = [b[0] / a[0] for a, b in zip(times[name], base)]
        rows.append({
            "name": f"{name} 4 KiB (create+drop)",
            "ratio": statistics.median(cpu_ratios),
            "baseline": "torch.empty 4 KiB (create+drop)",
            "metric": "CPU time",
            "accel_cpu_us": statistics.median(t[1] for t in times[name]) * 1e6,
            "baseline_cpu_us": statistics.median(t[1] for t in base) * 1e6,
            "ratio_min": min(cpu_ratios),
            "ratio_max": max(cpu_ratios),
            "accel_wall_us": statistics.median(t[0] for t in times[name]) * 1e6,
            "baseline_wall_us": statistics.median(t[0] for t in base) * 1e6,
            "wall_ratio": statistics.median(wall_ratios),
        })
    return rows


def main(argv: list[str]) -> int:
    print(f"{'case (4 KiB, create+drop)':<26} {'accel CPU':>10} {'torch.empty':>12} {'torch/accel':>12} "
          f"{'rounds':>12}   {'wall: accel':>11} {'torch':>7} {'ratio':>6}")
    for row in run("--quick" in argv):
        print(
            f"{row['name'].removesuffix(' 4 KiB (create+drop)'):<26} {row['accel_cpu_us']:8.2f}us "
            f"{row['baseline_cpu_us']:10.2f}us {row['ratio']:11.2f}x {row['ratio_min']:5.2f}-{row['ratio_max']:<5.2f}"
            f"   {row['accel_wall_us']:9.2f}us {row['baseline_wall_us']:5.2f}us {row['wall_ratio']:5.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
