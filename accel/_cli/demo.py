"""``accel demo``: capture a small model once, replay it, compare with eager.

On the host backend with torch installed, a small MLP is captured with
:func:`accel.graph.make_graphed_callables` and replayed; so it is on CUDA
with a CUDA build of torch (torch's CUDA graph carries the capture).
Elsewhere (no torch, or a backend whose streams torch cannot share) a graph
of stream copies is captured instead. Either way the report gives the eager and replay
time per call (timed in interleaved rounds; the speedup is the median of the
per-round ratios, with their spread), whether the outputs match, the memory the graph holds and the
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


def _interleaved_us(variants: dict[str, Callable[[], object]], calls: int, rounds: int = 7) -> dict[str, list[float]]:
    """Per-call microseconds of each variant in each of ``rounds`` rounds.

    Variants take turns within every round, in a rotating order, so that a
    change of machine load or clock speed hits them alike (timed one after the
    other, the same model showed 1.1x to 10x). Warmed up first: the first calls
    pay torch's lazy initialisation.
    """
    for fn in variants.values():
        for _ in range(max(50, calls // 4)):
            fn()
    names = list(variants)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = variants[name]
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls * 1e6)
    return times


def _speedup(eager: list[float], replay: list[float]) -> dict[str, Any]:
    """The median of the per-round ratios, and their spread (lowest, highest)."""
    ratios = [e / r for e, r in zip(eager, replay)]
    return {"speedup": statistics.median(ratios), "speedup_spread": [min(ratios), max(ratios)]}


def _allocations(device_type: str = "cpu") -> int:
    """Allocations made so far by accel's allocator (and torch's, on a GPU)."""
    from accel.memory import memory_stats

    count = int(memory_stats().get("allocation.all.allocated", 0))
    if device_type == "cuda":
        import torch

        count += int(torch.cuda.memory_stats().get("allocation.all.allocated", 0))
    return count


def _torch_demo(calls: int, compiled: bool, device_type: str) -> dict[str, Any]:
    import torch

    from accel.graph import make_graphed_callables

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.GELU(), torch.nn.Linear(128, 128), torch.nn.GELU(),
        torch.nn.Linear(128, 10),
    ).eval().to(device_type)
    x = torch.randn(1, 64, device=device_type)
    # On a GPU a call returns before its kernels ran: time them to the end.
    finish: Callable[[], None] = torch.cuda.synchronize if device_type == "cuda" else (lambda: None)

    def eager() -> Any:
        with torch.inference_mode():
            out = model(x)
        finish()
        return out

    where = "host backend" if device_type == "cpu" else f"{device_type}, torch's graphs"
    report: dict[str, Any] = {"workload": f"MLP 64-128-128-10, batch 1 (torch, {where})"}
    # On a GPU backend torch's graph replays the captured kernels: no aten interpretation.
    default_tier = "interpreted" if device_type == "cpu" else "torch_graph"
    variants = {default_tier: make_graphed_callables(model, (x,))}
    if compiled:
        variants["compiled"] = make_graphed_callables(model, (x,), tier="compiled", wait=True)
    reference = eager()
    outputs = {}
    calls_of: dict[str, Callable[[], object]] = {"eager": eager}
    for name, fn in variants.items():
        outputs[name] = fn(x)
        finish()

        def call(fn: Any = fn) -> None:
            fn(x)
            finish()

        calls_of[name] = call
    times = _interleaved_us(calls_of, calls)
    report["eager_us"] = statistics.median(times["eager"])
    for name, fn in variants.items():
        (entry,) = fn._cache.values()
        out = outputs[name]
        before = _allocations(device_type)
        for _ in range(10):
            calls_of[name]()
        # Counted before the comparisons below, which allocate on the device.
        allocations = _allocations(device_type) - before
        report[name] = {
            "replay_us": statistics.median(times[name]),
            **_speedup(times["eager"], times[name]),
            "bitwise_equal": bool(torch.equal(out, reference)),
            "max_abs_error": float((out - reference).abs().max()),
            "allocations_during_replays": allocations,
        }
        program = entry.graph.program  # the recorded aten program (host backend)
        if program is not None:
            report[name]["graph_static_bytes"] = program.static_bytes
            report[name]["recorded_ops"] = len(program.records)
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

        times = _interleaved_us({"eager": eager, "replay": replay}, calls)
        before = _allocations()
        for _ in range(10):
            replay()
        return {
            "workload": f"{pieces} copies of {nbytes} bytes on one stream",
            "eager_us": statistics.median(times["eager"]),
            "stream_work": {
                "replay_us": statistics.median(times["replay"]),
                **_speedup(times["eager"], times["replay"]),
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

    from accel.backends.base import TorchIntegration

    runtime = get_runtime()
    report: dict[str, Any] = {"backend": runtime.name}
    # Torch ops are captured where they are the backend's own work (the host) or
    # where torch's device graphs share the backend's streams.
    host_ops = runtime.backend.torch_integration is TorchIntegration.RECORD_HOST_OPS
    device_type = runtime.backend.torch_device_type
    if _torch_available() and device_type and (host_ops or _torch_graphs_available(device_type)):
        if compiled and not host_ops:
            report["note"] = "--compiled compiles host programs; ignored on a GPU backend"
            compiled = False
        import torch

        # Inference: graphed calls run with autograd off (in grad mode they are refused).
        with torch.no_grad():
            report.update(_torch_demo(calls, compiled, device_type))
    else:
        if compiled:
            report["note"] = "--compiled needs torch on the host backend; timing stream work instead"
        report.update(_stream_demo(calls))
    return report


def _torch_graphs_available(device_type: str) -> bool:
    import torch  # noqa: F401 - accel hands captures to torch only once it is imported

    from accel.graph._torch_graphs import torch_graph_api

    return torch_graph_api(device_type) is not None


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
    labels = {
        "interpreted": "replay (interpreted)",
        "torch_graph": "replay (torch graph)",
        "compiled": "replay (compiled)",
        "stream_work": "replay",
    }
    for name, label in labels.items():
        r = report.get(name)
        if r is None:
            continue
        low, high = r["speedup_spread"]
        line = f"  {label:<21} {r['replay_us']:9.1f} µs per call ({r['speedup']:.2f}x, rounds {low:.2f}x..{high:.2f}x)"
        if "bitwise_equal" in r:
            match = "bitwise equal to eager" if r["bitwise_equal"] else f"max |error| {r['max_abs_error']:.1e}"
            line += f", {match}"
        if "recorded_ops" in r:
            line += f", {r['recorded_ops']} ops, {r['graph_static_bytes']} bytes held by the graph"
        line += f", {r['allocations_during_replays']} allocations during replays"
        print(line)
    return 0
