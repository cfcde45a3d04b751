"""The public allocate+free pair against ``torch.empty`` and ``numpy.empty``, and its cost
with many cached holes: issue 16's allocation rows, in one run, interleaved.

Each round times one batch of every case in turn (the order rotates), on the
host backend's current device and stream; a case's figure is the median of its
per-round CPU time per pair, and each ratio is the median of the per-round
ratios with their 10th-90th percentile (the spread). Cases:

- ``accel.memory.allocate(4096).free()`` (cached) and the DeviceAllocator's own pair;
- ``torch.empty(4096, dtype=torch.uint8)`` then ``del``; ``numpy.empty(4096, dtype=uint8)``;
- the public pair with 10 and with 100,000 free 4 KiB blocks cached on the
  stream (every other block of twice as many), for 4 KiB and 1 MiB requests.

Run: ``python benchmarks/bench_allocator_pair.py [--quick]`` from the repository root.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZE = 4096


def _rounds(cases: dict[str, Callable[[], None]], rounds: int, number: int) -> dict[str, list[float]]:
    """Per case, the CPU µs per call of each round; the cases' order rotates per round."""
    names = list(cases)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = cases[name]
            c0 = time.thread_time_ns()
            for _ in range(number):
                fn()
            out[name].append((time.thread_time_ns() - c0) / number / 1000)
    return out


def _ratio(a: list[float], b: list[float]) -> tuple[float, float, float]:
    """Median of the per-round ratios a/b, with their 10th and 90th percentiles."""
    ratios = sorted(x / y for x, y in zip(a, b))
    k = len(ratios) // 10
    return statistics.median(ratios), ratios[k], ratios[-1 - k]


def measure(quick: bool) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    import numpy as np
    import torch

    import accel
    from accel._runtime import activate

    rounds, number = (5, 500) if quick else (21, 4000)
    with activate("cpu") as runtime:
        device = runtime.current_index
        stream = runtime.current_stream(device)
        alloc = accel.memory.get_allocator(device)

        def public() -> None:
            accel.memory.allocate(SIZE).free()

        def device_pair() -> None:
            alloc.free(alloc.malloc(SIZE, stream))

        def torch_empty() -> None:
            t = torch.empty(SIZE, dtype=torch.uint8)
            del t

        def numpy_empty() -> None:
            a = np.empty(SIZE, dtype=np.uint8)
            del a

        def public_1mib() -> None:
            accel.memory.allocate(1 << 20).free()

        def holes(n: int) -> list[object]:
            blocks = [alloc.malloc(SIZE, stream) for _ in range(2 * n)]
            for b in blocks[::2]:
                alloc.free(b)
            return blocks[1::2]

        for fn in (public, device_pair, torch_empty, numpy_empty, public_1mib):
            fn()
        pairs = _rounds(
            {"accel.memory.allocate": public, "DeviceAllocator": device_pair,
             "torch.empty": torch_empty, "numpy.empty": numpy_empty},
            rounds, number,
        )
        by_holes: dict[str, list[float]] = {}
        for n in (10, 100_000):
            kept = holes(n)
            got = _rounds({"4 KiB": public, "1 MiB": public_1mib}, rounds, number)
            for size, values in got.items():
                by_holes[f"{size}, {n} holes"] = values
            for b in kept:
                alloc.free(b)  # type: ignore[arg-type]
            alloc.empty_cache()
    return pairs, by_holes


def run(quick: bool) -> list[dict]:
    """Rows for ``accel bench``: higher ratio is better for accel."""
    pairs, by_holes = measure(quick)
    rows = []
    for baseline in ("torch.empty", "numpy.empty"):
        ratio, lo, hi = _ratio(pairs[baseline], pairs["accel.memory.allocate"])
        rows.append({
            "name": f"accel.memory.allocate({SIZE}).free() vs {baseline}",
            "ratio": ratio, "ratio_p10": lo, "ratio_p90": hi, "baseline": baseline, "metric": "CPU time",
            "accel_us": statistics.median(pairs["accel.memory.allocate"]),
            "baseline_us": statistics.median(pairs[baseline]),
        })
    for size in ("4 KiB", "1 MiB"):
        ratio, lo, hi = _ratio(by_holes[f"{size}, 10 holes"], by_holes[f"{size}, 100000 holes"])
        rows.append({
            "name": f"allocate+free {size} with 100,000 cached holes vs 10",
            "ratio": ratio, "ratio_p10": lo, "ratio_p90": hi, "baseline": "the same pair with 10 holes",
            "metric": "CPU time",
            "accel_us": statistics.median(by_holes[f"{size}, 100000 holes"]),
            "baseline_us": statistics.median(by_holes[f"{size}, 10 holes"]),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    import torch

    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
          f"torch {torch.__version__}, load average {os.getloadavg()[0]:.1f}")
    pairs, by_holes = measure(args.quick)
    print("µs of CPU per pair, median of interleaved rounds")
    for name, values in {**pairs, **by_holes}.items():
        print(f"  {name:>24}: {statistics.median(values):6.2f}")
    for baseline in ("torch.empty", "numpy.empty"):
        ratio, lo, hi = _ratio(pairs["accel.memory.allocate"], pairs[baseline])
        print(f"accel.memory.allocate / {baseline}: {ratio:.2f}x [{lo:.2f}-{hi:.2f}]")
    for size in ("4 KiB", "1 MiB"):
        ratio, lo, hi = _ratio(by_holes[f"{size}, 100000 holes"], by_holes[f"{size}, 10 holes"])
        print(f"{size} pair, 100,000 holes / 10 holes: {ratio:.2f}x [{lo:.2f}-{hi:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
