"""torch tensors on accel memory against torch's own allocator, on the host backend.

Cases, each a create+drop pair of a 4 KiB tensor, timed in interleaved rounds
(one round of every case, then the next round), so that load on a shared
machine hits all of them alike:

- ``accel.empty(4096, dtype=torch.uint8)`` against ``torch.empty``;
- ``accel.as_tensor(buf)`` of a live 4 KiB buffer against ``torch.empty``;
- for scale, ``torch.from_dlpack(buf)`` (accel's ctypes DLPack producer) and
  ``accel.memory.allocate(4096).free()``.

The ratio is torch time / accel time (higher is better for accel); the
spread is the lowest and highest of the per-round ratios.

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


def _per_call(fn: Callable[[], object], n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n


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
        times: dict[str, list[float]] = {name: [] for name in cases}
        for _ in range(rounds):
            for name, fn in cases.items():
                times[name].append(_per_call(fn, n))
        buf.free()
    base = times["torch.empty"]
    rows = []
    for name in ("accel.empty", "accel.as_tensor", "torch.from_dlpack(buf)", "allocate+free"):
        ratios = [b / a for a, b in zip(times[name], base)]
        rows.append({
            "name": f"{name} 4 KiB (create+drop)",
            "ratio": statistics.median(ratios),
            "baseline": "torch.empty 4 KiB (create+drop)",
            "accel_us": statistics.median(times[name]) * 1e6,
            "baseline_us": statistics.median(base) * 1e6,
            "ratio_min": min(ratios),
            "ratio_max": max(ratios),
        })
    return rows


def main(argv: list[str]) -> int:
    for row in run("--quick" in argv):
        print(
            f"{row['name']:<40} {row['accel_us']:6.2f} us   torch.empty {row['baseline_us']:5.2f} us   "
            f"torch/accel {row['ratio']:.2f}x (rounds {row['ratio_min']:.2f}-{row['ratio_max']:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
