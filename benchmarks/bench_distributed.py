"""all_reduce bus bandwidth on accel memory against torch memory: two Gloo ranks on this machine.

Each rank reduces float32 tensors of 1 MiB to 256 MiB (zeros, so that the sums
stay finite and no value costs more than another) three ways:

- ``torch``: ``dist.all_reduce`` on a ``torch.empty`` tensor (the baseline);
- ``accel``: ``dist.all_reduce`` on an ``accel.empty`` tensor (accel's memory);
- ``collective``: ``accel.distributed.collective(dist.all_reduce, t, stream=s)``
  on an accel tensor, queued on an accel stream, then the stream synchronized
  (accel's memory and its ordering on a stream).

Per size, the three run in interleaved rounds (each round times every way
once, in a rotating order, after a barrier), so that load on a shared
machine hits them alike. Bus bandwidth is ``size / time * 2 (n - 1) / n``
(NCCL's convention; for two ranks, size / time), timed on rank 0's wall
clock. The ratio is torch time / accel time per round (higher is better for
accel): the median, and the lowest and highest round as the spread. On a
loaded machine the wall clock mostly measures the load; the CPU time of rank
0's process (Gloo's threads and accel's stream worker included) per
all_reduce is reported beside it, with its own ratio, as the steadier
measure of what each kind of memory costs.

Run: ``python benchmarks/bench_distributed.py [--quick]`` from the repository root.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MIB = 1 << 20
SIZES = (1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB)
KINDS = ("torch", "accel", "collective")
WORLD = 2
TIMEOUT_S = 900


def _rank(rank: int, store_path: str, sizes: list[int], rounds: int) -> dict[str, Any]:
    """One rank's measurement: per size and kind, the seconds per all_reduce of each round."""
    import datetime

    import torch
    import torch.distributed as dist

    import accel
    import accel.distributed

    dist.init_process_group(
        "gloo", store=dist.FileStore(store_path, WORLD), rank=rank, world_size=WORLD,
        timeout=datetime.timedelta(seconds=300),
    )
    stream = accel.Stream()
    times: dict[str, dict[str, list[list[float]]]] = {}
    for size in sizes:
        n = size // 4
        tensors = {
            "torch": torch.zeros(n),
            "accel": accel.empty(n).zero_(),
            "collective": accel.empty(n, stream=stream).zero_(),
        }
        # About 0.1 s per timing at loopback speeds (~1 GB/s), at least one call.
        calls = max(1, (64 * MIB) // size)

        def once(kind: str) -> None:
            if kind == "collective":
                accel.distributed.collective(dist.all_reduce, tensors[kind], stream=stream)
            else:
                dist.all_reduce(tensors[kind])

        for kind in KINDS:  # touch the memory, warm Gloo's buffers
            once(kind)
        stream.synchronize()
        per: dict[str, list[list[float]]] = {kind: [] for kind in KINDS}  # [wall, CPU] per round
        for r in range(rounds):
            for kind in KINDS[r % 3:] + KINDS[: r % 3]:
                dist.barrier()
                start, cpu = time.perf_counter(), time.process_time()
                for _ in range(calls):
                    once(kind)
                stream.synchronize()
                per[kind].append([(time.perf_counter() - start) / calls, (time.process_time() - cpu) / calls])
        times[str(size)] = per
        del tensors
        accel.empty_cache()
    dist.destroy_process_group()
    return times


def _measure(sizes: list[int], rounds: int) -> dict[str, dict[str, list[list[float]]]]:
    """Start the two ranks; rank 0's timings."""
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "ACCEL_BACKEND": "cpu", "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        args = [",".join(map(str, sizes)), str(rounds), os.path.join(tmp, "store")]
        procs = [
            subprocess.Popen([sys.executable, os.path.abspath(__file__), "--rank", str(rank), *args],
                             env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(WORLD)
        ]
        try:
            outputs = [p.communicate(timeout=TIMEOUT_S) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    for p, (_, err) in zip(procs, outputs):
        if p.returncode != 0:
            raise RuntimeError(f"a rank failed (exit {p.returncode}):\n{err[-3000:]}")
    result: dict[str, dict[str, list[list[float]]]] = json.loads(outputs[0][0].strip().splitlines()[-1])
    return result


def run(quick: bool) -> list[dict[str, Any]]:
    try:
        import torch.distributed as dist
    except ImportError:
        print("torch is not installed", file=sys.stderr)
        return []
    if not dist.is_available():
        print("this torch has no torch.distributed", file=sys.stderr)
        return []
    sizes, rounds = ([1 * MIB, 4 * MIB], 2) if quick else (list(SIZES), 9)
    times = _measure(sizes, rounds)
    bus = 2 * (WORLD - 1) / WORLD
    rows = []
    for size in sizes:
        per = times[str(size)]
        base = statistics.median(t[0] for t in per["torch"])
        for kind in ("accel", "collective"):
            ratios = [b[0] / a[0] for a, b in zip(per[kind], per["torch"])]
            cpu_ratios = [b[1] / a[1] for a, b in zip(per[kind], per["torch"])]
            rows.append({
                "name": f"all_reduce {size // MIB} MiB, {'accel memory' if kind == 'accel' else 'collective() on an accel stream'}",
                "ratio": statistics.median(ratios),
                "baseline": "torch memory",
                "metric": "bus bandwidth",
                "size": size,
                "kind": kind,
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "accel_busbw_gbs": size / statistics.median(t[0] for t in per[kind]) * bus / 1e9,
                "torch_busbw_gbs": size / base * bus / 1e9,
                "cpu_ratio": statistics.median(cpu_ratios),
                "cpu_ratio_min": min(cpu_ratios),
                "cpu_ratio_max": max(cpu_ratios),
                "accel_cpu_ms": statistics.median(t[1] for t in per[kind]) * 1e3,
                "torch_cpu_ms": statistics.median(t[1] for t in per["torch"]) * 1e3,
                "rounds": rounds,
            })
    return rows


def main(argv: list[str]) -> int:
    if argv[:1] == ["--rank"]:
        rank, sizes, rounds, store = int(argv[1]), [int(s) for s in argv[2].split(",")], int(argv[3]), argv[4]
        print(json.dumps(_rank(rank, store, sizes, rounds)), flush=True)
        return 0
    rows = run("--quick" in argv)
    print("bus bandwidth (GB/s, wall clock) and the torch/accel ratio per round: median (lowest-highest)")
    print(f"{'size':>8} {'torch':>7} {'accel':>7} {'ratio':>20}   {'collective()':>12} {'ratio':>20}")
    for size in sorted({r["size"] for r in rows}):
        a, c = (next(r for r in rows if r["size"] == size and r["kind"] == k) for k in ("accel", "collective"))
        print(f"{size // MIB:>4} MiB {a['torch_busbw_gbs']:>7.2f} {a['accel_busbw_gbs']:>7.2f} "
              f"{a['ratio']:>6.3f} ({a['ratio_min']:.2f}-{a['ratio_max']:.2f})   {c['accel_busbw_gbs']:>12.2f} "
              f"{c['ratio']:>6.3f} ({c['ratio_min']:.2f}-{c['ratio_max']:.2f})")
    print("CPU time of rank 0's process per all_reduce (ms) and the torch/accel ratio per round")
    print(f"{'size':>8} {'torch':>8} {'accel':>8} {'ratio':>20}   {'collective()':>12} {'ratio':>20}")
    for size in sorted({r["size"] for r in rows}):
        a, c = (next(r for r in rows if r["size"] == size and r["kind"] == k) for k in ("accel", "collective"))
        print(f"{size // MIB:>4} MiB {a['torch_cpu_ms']:>8.2f} {a['accel_cpu_ms']:>8.2f} "
              f"{a['cpu_ratio']:>6.3f} ({a['cpu_ratio_min']:.2f}-{a['cpu_ratio_max']:.2f})   {c['accel_cpu_ms']:>12.2f} "
              f"{c['cpu_ratio']:>6.3f} ({c['cpu_ratio_min']:.2f}-{c['cpu_ratio_max']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
