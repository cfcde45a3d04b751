"""Time to the first fast replay: how soon a compiled graphed callable serves a compiled engine.

For each benchmark model of ``bench_graph.py`` (batch 1, then batch 8 in the
same process), a fresh process with an empty graph cache calls
``make_graphed_callables(model, (x,), tier="compiled")`` and then calls the
result in a loop (one call a millisecond, as a server might), recording:

- ``capture``: seconds until ``make_graphed_callables`` returned (warm-up and
  capture; the interpreted tier serves from then on);
- ``first``: seconds after the capture until a call ran a compiled engine,
  and which (the first engine to agree with eager: ``onnxruntime-fx``, the
  ONNX accel emits itself, where ONNX Runtime is installed and the emitter
  maps the program's ops; else the exporter's ``onnxruntime``);
- ``final``: seconds after the capture until the build made its final choice
  (every engine built, validated and timed), and which engine;
- the slowest call while the build ran, beside the median call of the
  interpreted tier (what a background build costs the calls: they share the
  GIL and the cores).

Then a second fresh process on the same cache (``warm``): the chosen engine
comes from the disk cache and the kept choice (``choice-*.json``); ``stable``
says whether it chose the same engine as the first. Batch 8 is the second
graph of its process: what a process does once (imports, the exporter's op
table) is done already.

Times are wall-clock seconds on a machine others may be loading: give the
load average with them.

    python benchmarks/bench_first_replay.py                    # Markdown table
    python benchmarks/bench_first_replay.py --models mlp --json
    python benchmarks/bench_first_replay.py --first-only       # the first replay only: seconds, not minutes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _child(model_name: str, batches: list[int], threads: int, first_only: bool) -> list[dict[str, Any]]:
    """In a fresh process: one compiled graphed callable per batch size, timed as the module docstring says."""
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import torch

    from accel.graph import make_graphed_callables
    from bench_graph import _models

    torch.set_num_threads(threads)
    torch.set_grad_enabled(False)  # graphed callables are inference-only
    make, shape = _models()[model_name]
    rows = []
    for batch in batches:
        torch.manual_seed(0)
        model = make().eval()
        x = torch.randn(*shape(batch))
        with torch.inference_mode():
            expected = model(x)
        t0 = time.perf_counter()
        fast = make_graphed_callables(model, (x,), tier="compiled")
        captured = time.perf_counter()
        (entry,) = fast._cache.values()
        build = entry.compiled
        first = first_engine = None
        interpreted: list[float] = []
        slowest = 0.0
        calls = 0
        while True:
            serving = build.compiled  # the engine this call runs (None: the interpreted tier)
            c0 = time.perf_counter()
            out = fast(x)
            took = time.perf_counter() - c0
            calls += 1
            if serving is None:
                interpreted.append(took)
            slowest = max(slowest, took)
            if serving is not None and first is None:
                first, first_engine = c0 - captured, serving.engine
                if first_only:
                    build.stop()  # no final choice: the next step ends the build
            if build.state != "building":
                break
            time.sleep(1e-3)
        final = time.perf_counter() - captured
        if first is None and build.compiled is not None:  # it served during the last call, at once final
            first, first_engine = final, build.compiled.engine
        error = float((fast(x) - expected).abs().max())
        rows.append({
            "model": model_name, "batch": batch, "threads": threads,
            "capture_s": captured - t0,
            "first_s": first, "first_engine": first_engine,
            "final_s": final, "final_engine": build.compiled.engine if build.compiled else None,
            "status": build.status(), "max_abs_error": error, "calls": calls,
            "interpreted_call_us": statistics.median(interpreted) * 1e6 if interpreted else None,
            "slowest_call_ms": slowest * 1e3,
            "report": build.compiled.report() if build.compiled else str(build.error),
        })
    return rows


def _run(model: str, batches: list[int], threads: int, cache: Path, first_only: bool) -> list[dict[str, Any]]:
    env = {**os.environ, "ACCEL_GRAPH_CACHE": str(cache), "ACCEL_BACKEND": "cpu", "PYTHONPATH": str(ROOT)}
    args = [sys.executable, __file__, "--child", model, "--batches", ",".join(map(str, batches)),
            "--threads", str(threads), *(["--first-only"] if first_only else [])]
    done = subprocess.run(args, env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{model}: the child exited with {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.splitlines()[-1])  # type: ignore[no-any-return]


def _markdown(rows: list[dict[str, Any]]) -> str:
    def secs(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f} s"

    lines = [
        "| model, batch, threads | capture | first compiled replay (cold) | final choice (cold) | "
        "warm: first / final | stable | slowest call while building (interpreted median) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        cold, warm = r["cold"], r["warm"]
        lines.append(
            f"| {cold['model']}, {cold['batch']}, {cold['threads']} | {secs(cold['capture_s'])} | "
            f"{secs(cold['first_s'])} ({cold['first_engine']}) | {secs(cold['final_s'])} ({cold['final_engine']}) | "
            f"{secs(warm['first_s'])} / {secs(warm['final_s'])} ({warm['final_engine']}) | "
            f"{'yes' if warm['final_engine'] == cold['final_engine'] else 'NO'} | "
            f"{cold['slowest_call_ms']:.1f} ms ({cold['interpreted_call_us'] or 0:.0f} µs) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer,cnn,gru_step")
    parser.add_argument("--batches", default="1,8", help="batch sizes, each a graph of the same process")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true", help="print raw results as JSON")
    parser.add_argument("--first-only", action="store_true",
                        help="stop each build once an engine serves (minutes less; no final choice, no warm run)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",") if b]
    if args.child:
        print(json.dumps(_child(args.child, batches, args.threads, args.first_only)))
        return 0
    rows = []
    for model in [m for m in args.models.split(",") if m]:
        with tempfile.TemporaryDirectory(prefix="accel-first-replay-") as cache:
            cold = _run(model, batches, args.threads, Path(cache), args.first_only)
            warm = cold if args.first_only else _run(model, batches, args.threads, Path(cache), False)
        for c, w in zip(cold, warm):
            rows.append({"cold": c, "warm": w})
            if not args.first_only:
                print(_markdown(rows[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    env = {"load average": os.getloadavg(), "cores": os.cpu_count()}
    if args.json:
        print(json.dumps({"environment": env, "results": rows}, indent=2))
    elif args.first_only:
        print(f"# {env}\n")
        print("| model, batch, threads | capture | first compiled replay | slowest call while building "
              "(interpreted median) |\n|---|---|---|---|")
        for r in rows:
            c = r["cold"]
            first = "-" if c["first_s"] is None else f"{c['first_s']:.2f} s ({c['first_engine']})"
            print(f"| {c['model']}, {c['batch']}, {c['threads']} | {c['capture_s']:.2f} s | {first} | "
                  f"{c['slowest_call_ms']:.1f} ms ({c['interpreted_call_us'] or 0:.0f} µs) |")
    else:
        print(f"# {env}\n")
        print(_markdown(rows))
        for r in rows:
            print(f"\n{r['cold']['model']} b{r['cold']['batch']}, cold:\n{r['cold']['report']}")
            print(f"warm: {r['warm']['status']}; {r['warm']['report'].splitlines()[0] if r['warm']['report'] else ''}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
