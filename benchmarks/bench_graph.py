"""Per-call inference latency on the host backend: eager vs accel replay vs torch's compilers.

One run measures, for each model and batch size, the latency of one call of:

- ``eager``: the module under ``torch.inference_mode()``;
- ``accel interpreted``: ``accel.graph.make_graphed_callables`` (copy the input into
  the static input, replay the recorded aten ops, return the static output);
  bitwise identical to eager;
- ``accel compiled``: the same with ``tier="compiled"`` (the captured program
  compiled by AOTInductor; close to eager, not bitwise);
- ``torch.compile``: default mode, under ``torch.inference_mode()``;
- ``jit.trace+freeze``: ``torch.jit.freeze(torch.jit.trace(model, x))``, where it traces.

Each round times ``--calls`` calls of every variant in turn, so that machine
noise hits all of them alike; a latency is the mean of one round. The report
gives the best round of ``--repeats`` (what the code costs when neighbours on a
shared machine leave it alone) and the median round. Ratios are eager time /
variant time (higher is faster).

    python benchmarks/bench_graph.py                 # Markdown tables (docs/benchmarks.md)
    python benchmarks/bench_graph.py --json          # raw numbers
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch import nn  # noqa: E402

import accel  # noqa: E402
from accel.graph import make_graphed_callables  # noqa: E402


class TinyMLP(nn.Module):
    """6 x (Linear(64, 64) -> tanh -> residual add), then softmax."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + torch.tanh(layer(x))
        return torch.softmax(x, dim=-1)


def _models() -> dict[str, tuple[Callable[[], nn.Module], Callable[[int], tuple[int, ...]]]]:
    return {
        "mlp": (TinyMLP, lambda b: (b, 64)),
        "transformer": (
            lambda: nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, norm_first=True),
            lambda b: (b, 16, 128),
        ),
        "cnn": (
            lambda: nn.Sequential(
                nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
                nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(),
                nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(32, 10),
            ),
            lambda b: (b, 3, 32, 32),
        ),
        "gru_step": (lambda: _GRUStep(), lambda b: (b, 1, 64)),
    }


class _GRUStep(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru = nn.GRU(64, 128, batch_first=True)
        self.register_buffer("h", torch.zeros(1, 1, 128))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x, self.h.expand(1, x.shape[0], 128).contiguous())
        return out


def _time(fn: Callable[[], object], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e6


def bench(model_name: str, batch: int, calls: int, repeats: int, variants: list[str]) -> dict:
    make, shape = _models()[model_name]
    torch.manual_seed(0)
    model = make().eval()
    x = torch.randn(*shape(batch))
    fns: dict[str, Callable[[], object]] = {}
    build: dict[str, float] = {}
    notes: dict[str, str] = {}

    def eager() -> object:
        with torch.inference_mode():
            return model(x)

    fns["eager"] = eager
    if "interpreted" in variants:
        t0 = time.perf_counter()
        interp = make_graphed_callables(model, (x,))
        build["interpreted"] = time.perf_counter() - t0
        fns["interpreted"] = lambda: interp(x)
    if "compiled" in variants:
        t0 = time.perf_counter()
        try:
            comp = make_graphed_callables(model, (x,), tier="compiled")
        except accel.NotSupportedError as exc:
            notes["compiled"] = f"failed: {str(exc).splitlines()[0][:120]}"
        else:
            build["compiled"] = time.perf_counter() - t0
            (entry,) = comp._cache.values()
            notes["compiled"] = "loaded from cache" if not entry.graph.program.compiled.built else "built"
            fns["compiled"] = lambda: comp(x)
    if "torch.compile" in variants:
        compiled_model = torch.compile(model)
        t0 = time.perf_counter()
        with torch.inference_mode():
            compiled_model(x)
        build["torch.compile"] = time.perf_counter() - t0

        def tc() -> object:
            with torch.inference_mode():
                return compiled_model(x)

        fns["torch.compile"] = tc
    if "jit" in variants:
        try:
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                frozen = torch.jit.freeze(torch.jit.trace(model, (x,)))
                frozen(x)
                build["jit"] = time.perf_counter() - t0

            def jit() -> object:
                with torch.inference_mode():
                    return frozen(x)

            fns["jit"] = jit
        except Exception as exc:  # noqa: BLE001 - report "does not apply" with the reason
            notes["jit"] = f"does not apply: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"

    # Correctness first: a fast wrong answer is not a result.
    with torch.inference_mode():
        reference = model(x).clone()
    errors = {}
    for name, fn in fns.items():
        out = fn()
        errors[name] = float((out - reference).abs().max())
    if "interpreted" in fns and errors["interpreted"] != 0.0:
        raise SystemExit(f"{model_name} b{batch}: interpreted replay is not bitwise eager")

    for fn in fns.values():  # warm-up
        _time(fn, max(10, calls // 10))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(_time(fn, calls))
    latency = {name: min(v) for name, v in samples.items()}
    median = {name: statistics.median(v) for name, v in samples.items()}
    return {
        "model": model_name,
        "batch": batch,
        "latency_us": latency,
        "speedup_vs_eager": {name: latency["eager"] / v for name, v in latency.items()},
        "median_latency_us": median,
        "median_speedup_vs_eager": {name: median["eager"] / v for name, v in median.items()},
        "build_s": build,
        "max_abs_error": errors,
        "notes": notes,
    }


LABELS = {
    "eager": "eager",
    "interpreted": "accel replay (interpreted, bitwise)",
    "compiled": "accel replay (compiled)",
    "torch.compile": "torch.compile (default)",
    "jit": "jit.trace + freeze",
}


def _markdown(results: list[dict], variants: list[str], stat: str = "") -> str:
    """The table of ``latency_us`` (best rounds) or, with stat="median_", medians."""
    cols = ["eager", *variants]
    head = "| model, batch | " + " | ".join(LABELS[c] for c in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for r in results:
        cells = []
        for c in cols:
            latency, speedup = r[f"{stat}latency_us"], r[f"{stat}speedup_vs_eager"]
            if c not in latency:
                cells.append("n/a")
            elif c == "eager":
                cells.append(f"{latency[c]:.1f} µs")
            else:
                cells.append(f"{latency[c]:.1f} µs ({speedup[c]:.2f}x)")
        lines.append(f"| {r['model']}, {r['batch']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(quick: bool, progress=None) -> list[dict]:
    """Rows for ``accel bench`` (benchmarks/README.md): replay against eager.

    ``quick`` times the interpreted tier only, at batch 1, with few calls; a
    full run adds the compiled tier and torch.compile at batch sizes 1 and 8.
    ``progress(done, total, label)`` hears of each model and batch size.
    """
    if accel.current_accelerator().type != "cpu":
        print("bench_graph: torch capture and replay run on the host backend only; skipped", file=sys.stderr)
        return []
    variants = ["interpreted"] if quick else ["interpreted", "compiled", "torch.compile"]
    calls, repeats, batches = (20, 3, (1,)) if quick else (100, 31, (1, 8))
    rows: list[dict] = []
    cases = [(model_name, batch) for model_name in _models() for batch in batches]
    for done, (model_name, batch) in enumerate(cases):
        if progress is not None:
            progress(done, len(cases), f"{model_name}, batch {batch}: {', '.join(variants)}")
        result = bench(model_name, batch, calls, repeats, variants)
        for variant in variants:
            if variant not in result["latency_us"]:
                continue  # it could not be built here; bench() noted why
            rows.append({
                "name": f"{model_name}, batch {batch}: {LABELS[variant]}",
                "ratio": result["speedup_vs_eager"][variant],
                "baseline": "eager torch",
                "metric": "best-round latency",
                "latency_us": result["latency_us"][variant],
                "baseline_us": result["latency_us"]["eager"],
            })
    return rows


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("ACCEL_BACKEND", "cpu")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer,cnn,gru_step")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=31)
    parser.add_argument("--variants", default="interpreted,compiled,torch.compile,jit")
    parser.add_argument("--json", action="store_true", help="print raw results as JSON")
    args = parser.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(LABELS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {sorted(set(LABELS) - {'eager'})}")
    models = [m for m in args.models.split(",") if m]
    if set(models) - set(_models()):
        parser.error(f"unknown models {sorted(set(models) - set(_models()))}; choose from {sorted(_models())}")
    results = []
    for model_name in models:
        for batch in (int(b) for b in args.batches.split(",")):
            results.append(bench(model_name, batch, args.calls, args.repeats, variants))
            print(_markdown(results[-1:], variants).splitlines()[-1], file=sys.stderr, flush=True)
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "cpu": accel.get_device_properties().name,
        "cores": os.cpu_count(),
    }
    if args.json:
        print(json.dumps({"environment": env, "results": results}, indent=2))
    else:
        print(f"# {env}")
        print("\nBest round:\n")
        print(_markdown(results, variants))
        print("\nMedian round:\n")
        print(_markdown(results, variants, "median_"))
        print()
        for r in results:
            build = ", ".join(f"{k} {v:.1f} s" for k, v in r["build_s"].items())
            err = ", ".join(f"{k} {v:.1e}" for k, v in r["max_abs_error"].items() if k != "eager")
            extra = "; ".join(f"{k}: {v}" for k, v in r["notes"].items())
            print(f"{r['model']} b{r['batch']}: build {build}; max |error| {err}" + (f"; {extra}" if extra else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
