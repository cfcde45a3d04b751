"""The host runtime's hot paths against the best plain Python (issue 16's table).

Every row times accel and its alternatives in the same run, in interleaved
rounds (each round runs every variant once, so that noise from neighbours on
a shared machine hits them alike). A row reports the median per-operation
time over the rounds with its spread (lowest..highest round), and the ratio
alternative / accel (higher is better for accel; ``x slower`` = 1 / ratio).

Thread round trips run with the whole process on one CPU (threads started
after the pin inherit it): across two CPUs a wake-up costs about 5 or about
70 us depending on where the OS puts the thread, for accel and the
alternatives alike.

    python benchmarks/bench_host_runtime.py            # Markdown table (docs/benchmarks.md)
    python benchmarks/bench_host_runtime.py --quick    # a smoke run
    python benchmarks/bench_host_runtime.py --json     # raw numbers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import queue
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

Timer = Callable[[], float]  # runs one batch, returns seconds per operation


def _noop() -> None:
    return None


def _interleave(variants: dict[str, Timer], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, timer in variants.items():
            times[name].append(timer())
    return times


def _batch(n: int, op: Callable[[], object], clock: Callable[[], float] = time.perf_counter) -> Timer:
    def timer() -> float:
        start = clock()
        for _ in range(n):
            op()
        return (clock() - start) / n

    return timer


@contextmanager
def _one_cpu() -> Iterator[int | None]:
    """Pin this thread (and the threads it starts meanwhile) to one CPU."""
    getter = getattr(os, "sched_getaffinity", None)
    if getter is None:
        yield None
        return
    before = getter(0)
    cpu = min(before)
    os.sched_setaffinity(0, {cpu})
    try:
        yield cpu
    finally:
        os.sched_setaffinity(0, before)


def _row(name: str, times: dict[str, list[float]], accel_key: str, unit: str = "us", **extra: object) -> dict:
    scale = {"us": 1e6, "ms": 1e3}[unit]
    med = {k: statistics.median(v) for k, v in times.items()}
    alternatives = [k for k in times if k != accel_key]
    primary = alternatives[0]
    row = {
        "name": name,
        "ratio": med[primary] / med[accel_key],
        "baseline": primary,
        "unit": unit,
        "median": {k: med[k] * scale for k in times},
        "spread": {k: (min(v) * scale, max(v) * scale) for k, v in times.items()},
        "ratios": {k: med[k] / med[accel_key] for k in alternatives},
        "accel": accel_key,
    }
    row.update(extra)
    return row


# -- streams and events -----------------------------------------------------------------


def _round_trip(n: int, rounds: int) -> dict:
    import accel

    with _one_cpu() as cpu:
        s = accel.Stream()

        def accel_rt() -> None:
            s.launch_host_func(_noop)
            s.synchronize()

        requests: queue.SimpleQueue = queue.SimpleQueue()
        replies: queue.SimpleQueue = queue.SimpleQueue()

        def worker() -> None:
            while (fn := requests.get()) is not None:
                fn()
                replies.put(None)

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()

        def queue_rt() -> None:
            requests.put(_noop)
            replies.get()

        pool = ThreadPoolExecutor(1)
        times = _interleave(
            {
                "accel": _batch(n, accel_rt),
                "SimpleQueue request/reply + worker": _batch(n, queue_rt),
                "ThreadPoolExecutor(1).submit().result()": _batch(n, lambda: pool.submit(_noop).result()),
            },
            rounds,
        )
        requests.put(None)
        thread.join()
        pool.shutdown()
        s.close()
    return _row("launch_host_func(noop) + synchronize, created stream (round trip)", times, "accel", pinned_cpu=cpu)


def _enqueue(n: int, rounds: int) -> list[dict]:
    import accel

    with _one_cpu() as cpu:
        s = accel.Stream()
        work: queue.SimpleQueue = queue.SimpleQueue()
        done: queue.SimpleQueue = queue.SimpleQueue()

        def worker() -> None:
            while (fn := work.get()) is not None:
                if fn is done:
                    done.put(None)
                else:
                    fn()

        thread = threading.Thread(target=worker, daemon=True)
        thread.start()
        pool = ThreadPoolExecutor(1)
        enqueue: dict[str, list[float]] = {}
        total: dict[str, list[float]] = {}

        def measure(name: str, put: Callable[[], object], finish: Callable[[], object]) -> Timer:
            def timer() -> float:
                start = time.perf_counter()
                for _ in range(n):
                    put()
                mid = time.perf_counter()
                finish()
                end = time.perf_counter()
                enqueue.setdefault(name, []).append((mid - start) / n)
                total.setdefault(name, []).append((end - start) / n)
                return (mid - start) / n

            return timer

        launch = s.launch_host_func
        futures: list = []
        _interleave(
            {
                "accel": measure("accel", lambda: launch(_noop), s.synchronize),
                "SimpleQueue + worker": measure(
                    "SimpleQueue + worker", lambda: work.put(_noop), lambda: (work.put(done), done.get())
                ),
                "ThreadPoolExecutor(1)": measure(
                    "ThreadPoolExecutor(1)",
                    lambda: futures.append(pool.submit(_noop)),
                    lambda: (futures[-1].result(), futures.clear()),
                ),
            },
            rounds,
        )
        work.put(None)
        thread.join()
        pool.shutdown()
        s.close()
    return [
        _row(f"{n:,} launch_host_func(noop): enqueue only", enqueue, "accel", pinned_cpu=cpu),
        _row(f"{n:,} launch_host_func(noop) then one synchronize: whole batch", total, "accel", pinned_cpu=cpu),
    ]


def _event(n: int, rounds: int) -> dict:
    import accel

    with _one_cpu() as cpu:
        s = accel.Stream()
        e = accel.Event()
        flag = threading.Event()

        def accel_ev() -> None:
            e.record(s)
            e.synchronize()

        def thread_ev() -> None:
            flag.set()
            flag.wait()
            flag.clear()

        times = _interleave({"accel": _batch(n, accel_ev), "threading.Event set/wait": _batch(n, thread_ev)}, rounds)
        s.close()
    return _row("Event.record(s) + synchronize, idle created stream", times, "accel", pinned_cpu=cpu)


# -- allocation -----------------------------------------------------------------------------


def _alloc(n: int, rounds: int) -> list[dict]:
    import numpy as np
    import torch

    import accel

    allocate = accel.memory.allocate
    rows = [
        _row(
            "accel.memory.allocate(4096).free(), cached",
            _interleave(
                {
                    "accel": _batch(n, lambda: allocate(4096).free()),
                    "torch.empty(4096, uint8) + del": _batch(n, lambda: torch.empty(4096, dtype=torch.uint8)),
                    "numpy.empty(4096, uint8) + del": _batch(n, lambda: np.empty(4096, dtype=np.uint8)),
                },
                rounds,
            ),
            "accel",
        ),
    ]
    return rows


def _tensors(n: int, rounds: int) -> list[dict]:
    """Torch tensors on accel memory, timed in thread CPU time (none of these
    waits on another thread, so neighbours' load does not count), all in the
    same interleaved rounds: accel.empty, the allocation pair inside it, and
    as_tensor of a live buffer. The tensor part is accel.empty minus that
    pair, round by round: what wrapping the memory as a tensor and letting
    go of it costs."""
    import torch

    import accel

    allocate = accel.memory.allocate
    buf = allocate(4096)
    times = _interleave(
        {
            "accel.empty": _batch(n, lambda: accel.empty(4096, dtype=torch.uint8), time.thread_time),
            "pair": _batch(n, lambda: allocate(4096), time.thread_time),
            "as_tensor": _batch(n, lambda: accel.as_tensor(buf), time.thread_time),
            "torch.empty": _batch(n, lambda: torch.empty(4096, dtype=torch.uint8), time.thread_time),
        },
        rounds,
    )
    buf.free()
    torch_empty = {"torch.empty(4096, uint8) + del": times["torch.empty"]}
    tensor_part = [e - p for e, p in zip(times["accel.empty"], times["pair"])]
    return [
        _row("accel.empty(4096, dtype=torch.uint8) + del (CPU time)", {"accel": times["accel.empty"], **torch_empty}, "accel"),
        _row(
            "its allocation: accel.memory.allocate(4096) + del (CPU time)",
            {"accel": times["pair"], **torch_empty},
            "accel",
        ),
        _row("its tensor part: the two rows above, round by round (CPU time)", {"accel": tensor_part, **torch_empty}, "accel"),
        _row("accel.as_tensor(buf) + del, a live 4 KiB buffer (CPU time)", {"accel": times["as_tensor"], **torch_empty}, "accel"),
    ]


_PER_CHILD = """
import json, sys, time
import torch
import accel

n, batches = int(sys.argv[1]), int(sys.argv[2])
allocate = accel.memory.allocate
ops = {
    "pair": lambda: allocate(4096).free(),
    "empty": lambda: accel.empty(4096, dtype=torch.uint8),
    "torch": lambda: torch.empty(4096, dtype=torch.uint8),
}
best = dict.fromkeys(ops, float("inf"))
for _ in range(batches):  # short batches, interleaved: the least disturbed one of each counts
    for key, op in ops.items():
        start = time.thread_time()
        for _ in range(n):
            op()
        best[key] = min(best[key], (time.thread_time() - start) / n)
print(json.dumps(best))
"""


def _per_child(n: int, batches: int, rounds: int) -> list[dict]:
    """The allocation targets of issue 16 in fresh processes: one child per round; each
    times the pair, accel.empty and torch.empty in ``batches`` interleaved batches of
    ``n`` (thread CPU time) and keeps the best batch of each. ``vs_torch`` is each
    child's own accel / torch.empty ratio (median, lowest..highest over the rounds),
    which a loaded machine disturbs least."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    results: list[dict[str, float]] = []
    for _ in range(rounds):
        out = subprocess.run(
            [sys.executable, "-c", _PER_CHILD, str(n), str(batches)],
            env=env, capture_output=True, text=True, check=True,
        )
        results.append(json.loads(out.stdout))
    rows = []
    for key, name in (
        ("pair", "accel.memory.allocate(4096).free() per child (CPU time)"),
        ("empty", "accel.empty(4096, dtype=torch.uint8) + del per child (CPU time)"),
    ):
        times = {"accel": [r[key] for r in results], "torch.empty(4096, uint8) + del": [r["torch"] for r in results]}
        ratios = [r[key] / r["torch"] for r in results]
        vs_torch = {"accel": (statistics.median(ratios), min(ratios), max(ratios))}
        rows.append(_row(name, times, "accel", vs_torch=vs_torch))
    return rows


def _holes(n: int, rounds: int, holes: int) -> list[dict]:
    """Interleaved: each round punches 10 holes, times the pair, gives them back, then
    the same with ``holes`` holes (the two states cannot coexist)."""
    import accel

    allocate = accel.memory.allocate
    rows = []
    for size, label in ((4096, "4 KiB"), (1 << 20, "1 MiB")):
        times: dict[str, list[float]] = {f"{holes:,} holes": [], "10 holes": []}
        timer = _batch(n, lambda size=size: allocate(size).free())
        for _ in range(rounds):
            for count in (10, holes):
                kept = _hole_punch(count)
                times[f"{count:,} holes"].append(timer())
                del kept
                accel.memory.empty_cache()
        rows.append(_row(f"the {label} pair with {holes:,} free blocks cached (holes)", times, f"{holes:,} holes"))
    return rows


def _hole_punch(count: int) -> list:
    """``count`` cached free 512-byte blocks that cannot merge (every other one stays allocated)."""
    import accel

    bufs = [accel.memory.allocate(512) for _ in range(2 * count)]
    kept = bufs[1::2]
    for buf in bufs[0::2]:
        buf.free()
    return kept


# -- start-up -------------------------------------------------------------------------------


def _startup(rounds: int) -> dict:
    # The children of bench_startup.py: no ACCEL_* or ZE_ENABLE_ALT_DRIVERS, and byte
    # code cached in a private prefix, warmed first, as in an installed package (with
    # PYTHONDONTWRITEBYTECODE inherited, every child compiled accel's sources: about
    # 35 ms of the first call was compiling the host backend).
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_startup import _env

    def spawn(code: str) -> Timer:
        def timer() -> float:
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
            return time.perf_counter() - start

        return timer

    cases = {
        "import accel; accel.current_accelerator()": spawn("import accel; accel.current_accelerator()"),
        "python -c pass": spawn("pass"),
        "import accel": spawn("import accel"),
    }
    with tempfile.TemporaryDirectory(prefix="accel-bench-pyc-") as cache:
        env = _env(cache)
        for timer in cases.values():  # warm the byte-code cache
            timer()
        times = _interleave(cases, rounds)
    return _row(
        "import accel; accel.current_accelerator() (no GPU driver)",
        times,
        "import accel; accel.current_accelerator()",
        unit="ms",
    )


# -- driver -----------------------------------------------------------------------------------


def run(quick: bool) -> list[dict]:
    """The rows of issue 16's table (the ``accel bench`` contract)."""
    rt_n, rounds = (200, 3) if quick else (5000, 15)
    rows = [_round_trip(rt_n, rounds)]
    rows += _enqueue(2000 if quick else 100_000, 3 if quick else 7)
    rows.append(_event(rt_n, rounds))
    rows += _alloc(500 if quick else 20_000, rounds)
    rows += _tensors(500 if quick else 20_000, rounds)
    rows += _per_child(500, 3 if quick else 150, 2 if quick else 7)
    rows += _holes(200 if quick else 5000, 2 if quick else 5, 1000 if quick else 100_000)
    rows.append(_startup(2 if quick else 9))
    return rows


def _markdown(rows: list[dict]) -> str:
    lines = [
        "| operation | accel | alternatives in the same run | alternative / accel |",
        "|---|---|---|---|",
    ]
    for row in rows:
        unit = row["unit"].replace("us", "µs")
        acc = row["accel"]

        def fmt(key: str) -> str:
            lo, hi = row["spread"][key]
            return f"{row['median'][key]:.2f} {unit} ({lo:.2f}..{hi:.2f})"

        alts = "; ".join(f"{k}: {fmt(k)}" for k in row["ratios"])
        ratios = "; ".join(f"{r:.2f} ({1 / r:.1f}x slower)" if r < 1 else f"{r:.2f}" for r in row["ratios"].values())
        name = row["name"]
        if "vs_torch" in row:  # each child's own ratio to torch.empty
            name += " [x torch.empty per child: " + "; ".join(
                f"{k} {m:.2f} ({lo:.2f}..{hi:.2f})" for k, (m, lo, hi) in row["vs_torch"].items()
            ) + "]"
        lines.append(f"| {name} | {fmt(acc)} | {alts} | {ratios} |")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run")
    parser.add_argument("--json", action="store_true", help="print the raw rows as JSON")
    args = parser.parse_args(argv)
    rows = run(args.quick)
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"{platform.processor() or platform.machine()}, {cpus} CPUs, Python {platform.python_version()}, "
          f"{platform.system()} {platform.release()}, load average {os.getloadavg()[0]:.1f}\n")
    print(_markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
