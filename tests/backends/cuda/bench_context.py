"""Micro-benchmark: what leaving the thread's CUDA context as found costs per backend call.

Times hot-path backend calls (the stream work that every copy, fill and event
record goes through) in three thread states: no context current (a process
that only uses accel), the target device's primary context current (what torch
leaves on its current device) and another device's context current. It also
times the bare context entry points through cffi, the floor of any mechanism.

By default it runs on accel's simulated driver (two simulated devices), so the
numbers are Python and cffi overhead plus the simulator's bookkeeping, not GPU
costs; ``--real`` uses the system driver (the other-device case then needs two
GPUs). The stream captures (relaxed mode) while the calls are timed, so that
they only append to a graph: on the simulator, queueing real work would wake a
worker thread per call and drown the difference in scheduling noise. Run it
from the repository root::

    python tests/backends/cuda/bench_context.py [--real] [--calls N] [--rounds N] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))


def _best_us(cases: dict[str, Callable[[], None]], calls: int, rounds: int,
             before: Callable[[str], None]) -> dict[str, float]:
    """Per case, the best round's mean time per call in microseconds.

    Each round runs every case in turn, so that load from other processes
    falls on all of them alike; ``before(case)`` runs untimed first.
    """
    best = dict.fromkeys(cases, float("inf"))
    for _ in range(rounds):
        for name, call in cases.items():
            before(name)
            start = time.perf_counter()
            for _ in range(calls):
                call()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    return {name: seconds * 1e6 for name, seconds in best.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--real", action="store_true", help="use the system CUDA driver instead of the simulator")
    parser.add_argument("--calls", type=int, default=1000, help="calls per case and round (default 1000)")
    parser.add_argument("--rounds", type=int, default=30, help="rounds; the best one is reported (default 30)")
    parser.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    args = parser.parse_args(argv)

    if not args.real:
        from tests.fixtures.cuda_driver import build_simulator

        os.environ["ACCEL_CUDA_DRIVER"] = str(build_simulator())
        os.environ["ACCEL_SIMCUDA_DEVICE_COUNT"] = "2"
    from accel.backends.base import CaptureMode
    from accel.backends.cuda import load

    b: Any = load()
    ffi, fn = b.driver.ffi, b.driver.fn
    devices = b.device_count()
    contexts = []
    for device in range(min(devices, 2)):
        out = ffi.new("CUcontext *")
        assert fn["cuDevicePrimaryCtxRetain"](out, device) == 0
        contexts.append(out[0])

    def make_current(ctx: Any) -> Callable[[], None]:
        return lambda: fn["cuCtxSetCurrent"](ctx)

    states = {"no context current": make_current(ffi.NULL), "target device current": make_current(contexts[0])}
    if len(contexts) > 1:
        states["other device current"] = make_current(contexts[1])

    stream = b.stream_create(0, 0)
    event = b.event_create(0, timing=False, blocking=False, interprocess=False)
    dst, src = b.malloc(0, 4096), b.malloc(0, 4096)
    work = {
        "memcpy_async": lambda: b.memcpy_async(0, dst, src, 64, stream),
        "memset_async": lambda: b.memset_async(0, dst, 0, 64, stream),
        "event_record": lambda: b.event_record(0, event, stream),
    }

    cases = {f"{state}|{name}": call for state in states for name, call in work.items()}

    def before(case: str) -> None:
        # A fresh capture per timed batch keeps the graph small.
        b.graph_destroy(0, b.stream_end_capture(0, stream))
        b.stream_begin_capture(0, stream, CaptureMode.RELAXED)
        states[case.split("|")[0]]()

    b.stream_begin_capture(0, stream, CaptureMode.RELAXED)
    results: dict[str, dict[str, float]] = {}
    for case, us in _best_us(cases, args.calls, args.rounds, before).items():
        state, name = case.split("|")
        results.setdefault(state, {})[name] = us
    b.graph_destroy(0, b.stream_end_capture(0, stream))
    fn["cuCtxSetCurrent"](ffi.NULL)

    current = ffi.new("CUcontext *")
    primitives = {"cuCtxGetCurrent": lambda: fn["cuCtxGetCurrent"](current)}
    if "cuCtxPushCurrent" in fn:
        primitives["cuCtxPushCurrent + cuCtxPopCurrent"] = lambda: (
            fn["cuCtxPushCurrent"](contexts[0]), fn["cuCtxPopCurrent"](current))
    primitives["cuCtxSetCurrent x2"] = lambda: (fn["cuCtxSetCurrent"](contexts[0]), fn["cuCtxSetCurrent"](ffi.NULL))
    results["driver entry points (no backend)"] = _best_us(primitives, args.calls, args.rounds, lambda _: None)

    b.free(0, dst)
    b.free(0, src)
    b.event_destroy(0, event)
    b.stream_destroy(0, stream)

    if args.json:
        print(json.dumps({"driver": b.driver.path, "results": results}))
        return 0
    print(f"driver: {b.driver.path}; best of {args.rounds} rounds, microseconds per call")
    for state, row in results.items():
        print(f"{state}:")
        for name, us in row.items():
            print(f"  {name:40s} {us:7.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
