"""``accel demo``: capture a small model once, replay it, compare with eager.

On the host backend with torch installed, a small MLP is captured with
:func:`accel.graph.make_graphed_callables` and replayed; elsewhere (no torch,
or a GPU backend, where accel does not record torch ops) a graph of stream
copies is captured instead. Either way the report gives the eager and replay
time per call, whether the outputs match, the memory the graph holds and the
allocations replays made (none).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable
from typing import Any

NAME = "demo"
HELP = "capture a small model (or stream work) in a graph, replay it, compare with eager"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--calls", type=_positive, default=200, help="calls timed per variant (default 200)"
    )
    parser.add_argument(
        "--compiled",
        action="store_true",
        help="also time the compiled tier (AOTInductor; the first build takes seconds to a minute)",
    )


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _per_call_us(fn: Callable[[], object], calls: int) -> float:
    """Median over five rounds of the mean time of ``calls`` calls, after a
    warm-up (first calls pay torch's lazy initialisation)."""
    for _ in range(max(50, calls // 4)):
        fn()
    rounds = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(rounds)


def _allocations() -> int:
    from accel.memory import memory_stats

    return int(memory_stats().get("allocation.all.allocated", 0))


def _torch_demo(calls: int, compiled: bool) -> dict[str, Any]:
    import torch

    from accel.graph import make_graphed_callables

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(),
        torch.nn.Linear(128, 10),
    ).eval()
    x = torch.randn(1, 64)

    def eager() -> Any:
        with torch.inference_mode():
            return model(x)

    report: dict[str, Any] = {"workload": "MLP 64-128-128-10, batch 1 (torch, host backend)"}
    variants = {"interpreted": make_graphed_callables(model, (x,))}
    if compiled:
        variants["compiled"] = make_graphed_callables(model, (x,), tier="compiled")
    reference = eager()
    report["eager_us"] = _per_call_us(eager, calls)
    for name, fn in variants.items():
        out = fn(x)
        (entry,) = fn._cache.values()
        before = _allocations()
        per_call = _per_call_us(lambda fn=fn: fn(x), calls)
        report[name] = {
            "replay_us": per_call,
            "speedup": report["eager_us"] / per_call,
            "bitwise_equal": bool(torch.equal(out, reference)),
            "max_abs_error": float((out - reference).abs().max()),
            "graph_static_bytes": entry.graph.program.static_bytes,
            "recorded_ops": len(entry.graph.program.records),
            "allocations_during_replays": _allocations() - before,
        }
    return report


def _stream_demo(calls: int) -> dict[str, Any]:
    import accel
    from accel.graph import Graph, graph
    from accel.memory import allocate

    nbytes, pieces = 1 << 16, 8
    src = [allocate(nbytes) for _ in range(pieces)]
    dst = [allocate(nbytes) for _ in range(pieces)]
    try:
        stream = accel.Stream()

        def work() -> None:
            for d, s in zip(dst, src):
                stream.copy(d, s)

        def eager() -> None:
            work()
            stream.synchronize()

        g = Graph()
        with graph(g, stream=stream):
            work()

        def replay() -> None:
            with stream:
                g.replay()
            stream.synchronize()

        eager_us = _per_call_us(eager, calls)
        before = _allocations()
        replay_us = _per_call_us(replay, calls)
        return {
            "workload": f"{pieces} copies of {nbytes} bytes on one stream",
            "eager_us": eager_us,
            "stream_work": {
                "replay_us": replay_us,
                "speedup": eager_us / replay_us,
                "allocations_during_replays": _allocations() - before,
            },
        }
    finally:
        for b in src + dst:
            b.free()


def _torch_available() -> bool:
    return importlib.util.find_spec("torch") is not None


def collect(calls: int, compiled: bool) -> dict[str, Any]:
    """The demo report as plain data."""
    from accel._runtime import get_runtime

    runtime = get_runtime()
    report: dict[str, Any] = {"backend": runtime.name}
    if runtime.name == "cpu" and _torch_available():
        report.update(_torch_demo(calls, compiled))
    else:
        if compiled:
            report["note"] = "--compiled needs torch on the host backend; timing stream work instead"
        report.update(_stream_demo(calls))
    return report


def run(args: argparse.Namespace) -> int:
    from accel._cli import print_json

    report = collect(args.calls, args.compiled)
    if args.json:
        print_json(report)
        return 0
    print(f"accel demo on {report['backend']}: {report['workload']}")
    if "note" in report:
        print(f"  note: {report['note']}")
    print(f"  eager                 {report['eager_us']:9.1f} µs per call")
    for name in ("interpreted", "compiled", "stream_work"):
        r = report.get(name)
        if r is None:
            continue
        label = {"interpreted": "replay (interpreted)", "compiled": "replay (compiled)", "stream_work": "replay"}[name]
        line = f"  {label:<21} {r['replay_us']:9.1f} µs per call ({r['speedup']:.2f}x)"
        if "bitwise_equal" in r:
            match = "bitwise equal to eager" if r["bitwise_equal"] else f"max |error| {r['max_abs_error']:.1e}"
            line += f", {match}, {r['recorded_ops']} ops, {r['graph_static_bytes']} bytes held by the graph"
        line += f", {r['allocations_during_replays']} allocations during replays"
        print(line)
    return 0
