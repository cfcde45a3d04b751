"""Per-call inference latency on the host backend: eager vs accel replay vs torch's compilers.

One run measures, for each model and batch size, the latency of one call of:

- ``eager``: the module under ``torch.inference_mode()``;
- ``accel interpreted``: ``accel.graph.make_graphed_callables`` (copy the input into
  the static input, replay the recorded aten ops, return the static output);
  bitwise identical to eager;
- ``accel compiled``: the same with ``tier="compiled", wait=True`` (the captured
  program built by every engine installed, validated against eager, the fastest kept;
  close to eager, not bitwise); ``compiled engine raw`` is that engine's own
  runner called directly on the graph's buffers (ONNX Runtime's
  ``run_with_iobinding``, AOTInductor's loaded runner), to show what accel
  adds per call;
- ``torch.compile``: default mode, under ``torch.inference_mode()``;
- ``jit.trace+freeze``: ``torch.jit.freeze(torch.jit.trace(model, x))``, where it traces;
- ``AOTInductor``: ``torch.export`` + ``aoti_compile_and_package`` with its
  defaults, called through ``aoti_load_package`` as its docs show;
- ``ONNX Runtime``: what a user of ONNX Runtime with IO binding writes:
  ``torch.onnx.export(model, (x,), dynamo=True)`` (its default opset and
  optimisation), an ``InferenceSession`` on ``CPUExecutionProvider`` with
  ``intra_op_num_threads`` = torch's threads, ``inter_op_num_threads`` = 1
  and every other option at its default (graph optimisation
  ``ORT_ENABLE_ALL``, memory arena and memory patterns on, intra-op
  spinning on), IO binding on a staging input (each call copies its input
  in) and a preallocated output, then the public
  ``session.run_with_iobinding(binding)``;
- ``OpenVINO``: ``openvino.convert_model`` + ``compile_model(..., "CPU")`` with
  f32 precision, one reused ``InferRequest`` (where installed).

Each round times ``--calls`` calls of every variant in turn, so that machine
noise hits all of them alike, each after a few untimed calls of its own
(the caches refilled after the variant before it), starting with another
variant each round; a latency is the mean of one round. The report
gives the median round of ``--repeats``, and the spread of the per-round
speed-ups (25th to 75th percentile). Ratios are eager time / variant time
(higher is faster). ``--threads 1,2`` repeats everything per intra-op
thread count (builds included: they depend on it).

    python benchmarks/bench_graph.py                 # Markdown tables (docs/benchmarks.md)
    python benchmarks/bench_graph.py --quick         # batch 1, 1 thread, few rounds
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
from collections.abc import Callable, Sequence
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
            comp = make_graphed_callables(model, (x,), tier="compiled", wait=True)
        except accel.NotSupportedError as exc:
            notes["compiled"] = f"failed: {str(exc).splitlines()[0][:120]}"
        else:
            build["compiled"] = time.perf_counter() - t0
            (entry,) = comp._cache.values()
            chosen = entry.compiled
            notes["compiled"] = (
                f"{chosen.engine} ({'loaded from cache' if not chosen.built else 'built'}); "
                + "; ".join(str(c) for c in chosen.candidates if c.status != "chosen")
            )
            notes["engine"] = chosen.engine
            fns["compiled"] = lambda: comp(x)
            if "raw" in variants:
                fns["raw"] = chosen.raw
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
    if "aoti" in variants:
        try:
            from torch._inductor import aoti_compile_and_package, aoti_load_package

            t0 = time.perf_counter()
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                exported = torch.export.export(model, (x,))
                path = _scratch() / f"aoti-{model_name}-{batch}-{torch.get_num_threads()}.pt2"
                aoti_compile_and_package(exported, package_path=str(path))
                package = aoti_load_package(str(path))
                package(x)
            build["aoti"] = time.perf_counter() - t0
            fns["aoti"] = lambda: package(x)
        except Exception as exc:  # noqa: BLE001 - report "does not apply" with the reason
            notes["aoti"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    if "onnxruntime" in variants:
        try:
            fns["onnxruntime"], build["onnxruntime"] = _onnxruntime(model, x, model_name, batch)
        except Exception as exc:  # noqa: BLE001
            notes["onnxruntime"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
    if "openvino" in variants:
        try:
            fns["openvino"], build["openvino"] = _openvino(model, x)
        except ImportError:
            notes["openvino"] = "not installed"
        except Exception as exc:  # noqa: BLE001
            notes["openvino"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
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
        if name == "raw":
            continue  # the engine's own output, not a result of the model call
        errors[name] = float((out - reference).abs().max())
    if "interpreted" in fns and errors["interpreted"] != 0.0:
        notes["interpreted"] = "NOT bitwise equal to eager"

    for fn in fns.values():  # warm-up
        _time(fn, max(10, calls // 10))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    order = list(fns.items())
    warm = max(2, calls // 20)
    for r in range(repeats):
        # Each round starts with another variant, and each variant's timed calls
        # follow a few untimed ones: the first calls after another variant ran
        # refill the caches (the variant timed right after eager paid 2.5 us
        # more per call than the next one on the attention block at batch 1,
        # 8 us on the CNN at batch 8, however fast its own call was).
        for name, fn in order[r % len(order):] + order[:r % len(order)]:
            _time(fn, warm)
            samples[name].append(_time(fn, calls))
    latency = {name: min(v) for name, v in samples.items()}
    median = {name: statistics.median(v) for name, v in samples.items()}
    spread = {}
    for name, v in samples.items():
        ratios = sorted(e / t for e, t in zip(samples["eager"], v))
        spread[name] = (ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4])
    return {
        "model": model_name,
        "batch": batch,
        "threads": torch.get_num_threads(),
        "latency_us": latency,
        "speedup_vs_eager": {name: latency["eager"] / v for name, v in latency.items()},
        "median_latency_us": median,
        "median_speedup_vs_eager": {name: median["eager"] / v for name, v in median.items()},
        "speedup_spread": spread,
        "paired": _paired(samples),
        "build_s": build,
        "max_abs_error": errors,
        "notes": notes,
    }


def _paired(samples: dict[str, list[float]]) -> dict[str, tuple[float, float, float]]:
    """Per-round comparisons of the compiled tier, as (median, 25th, 75th
    percentile) over the rounds: its latency over ONNX Runtime's, and its
    latency minus its engine's raw runner in µs (each round times both
    side by side, so machine noise mostly cancels)."""
    def quartiles(values: list[float]) -> tuple[float, float, float]:
        v = sorted(values)
        return statistics.median(v), v[len(v) // 4], v[(3 * len(v)) // 4]

    out = {}
    if "compiled" in samples and "onnxruntime" in samples:
        out["compiled/onnxruntime"] = quartiles([c / o for c, o in zip(samples["compiled"], samples["onnxruntime"])])
    if "compiled" in samples and "raw" in samples:
        out["compiled-raw"] = quartiles([c - r for c, r in zip(samples["compiled"], samples["raw"])])
    return out


LABELS = {
    "eager": "eager",
    "interpreted": "accel interpreted (bitwise)",
    "compiled": "accel compiled",
    "raw": "compiled engine raw",
    "torch.compile": "torch.compile",
    "jit": "jit.trace + freeze",
    "aoti": "AOTInductor direct",
    "onnxruntime": "ONNX Runtime (IO binding)",
    "openvino": "OpenVINO",
}


def _scratch() -> Path:
    import tempfile

    path = Path(tempfile.gettempdir()) / "accel-bench-graph"
    path.mkdir(exist_ok=True)
    return path


def _onnxruntime(model: nn.Module, x: torch.Tensor, model_name: str, batch: int) -> tuple[Callable[[], object], float]:
    import logging

    import numpy as np
    import onnxruntime as ort

    t0 = time.perf_counter()
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    path = _scratch() / f"ort-{model_name}-{batch}.onnx"
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (x,), dynamo=True, verbose=False).save(str(path))
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    with torch.inference_mode():
        out = torch.empty_like(model(x))
    staging = torch.empty_like(x)  # bound once; each call copies its new input in, as accel does
    binding = session.io_binding()
    binding.bind_input(session.get_inputs()[0].name, "cpu", 0, np.float32, list(x.shape), staging.data_ptr())
    binding.bind_output(session.get_outputs()[0].name, "cpu", 0, np.float32, list(out.shape), out.data_ptr())
    binding._keep = session  # the binding must not outlive its session
    run = session.run_with_iobinding

    def call() -> torch.Tensor:
        staging.copy_(x)
        run(binding)
        return out

    call()
    return call, time.perf_counter() - t0


def _openvino(model: nn.Module, x: torch.Tensor) -> tuple[Callable[[], object], float]:
    import openvino as ov

    t0 = time.perf_counter()
    core = ov.Core()
    core.set_property("CPU", {"INFERENCE_NUM_THREADS": torch.get_num_threads(), "INFERENCE_PRECISION_HINT": "f32"})
    with torch.no_grad():
        compiled = core.compile_model(ov.convert_model(model, example_input=(x,)), "CPU")
    request = compiled.create_infer_request()
    data = x.numpy()

    def call() -> torch.Tensor:
        request.infer([data], share_inputs=True, share_outputs=True)
        return torch.from_numpy(request.get_output_tensor(0).data)

    call()
    return call, time.perf_counter() - t0


def _markdown(results: list[dict], variants: list[str]) -> str:
    """Median latency per variant, speed-up over eager and its spread across rounds."""
    cols = ["eager", *variants]
    head = "| model, batch, threads | " + " | ".join(LABELS[c] for c in cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 1)]
    for r in results:
        cells = []
        for c in cols:
            latency, speedup = r["median_latency_us"], r["median_speedup_vs_eager"]
            if c not in latency:
                cells.append("n/a")
            elif c == "eager":
                cells.append(f"{latency[c]:.1f} µs")
            else:
                lo, hi = r["speedup_spread"][c]
                cells.append(f"{latency[c]:.1f} µs ({speedup[c]:.2f}x, {lo:.2f}–{hi:.2f})")
        lines.append(f"| {r['model']}, {r['batch']}, {r['threads']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _costs(results: list[dict]) -> str:
    """One-time cost and max error per variant, and the compiled tier's verdicts."""
    lines = []
    for r in results:
        build = ", ".join(f"{LABELS[k]} {v:.1f} s" for k, v in r["build_s"].items())
        err = ", ".join(f"{LABELS[k]} {v:.1e}" for k, v in r["max_abs_error"].items() if k != "eager")
        lat = r["median_latency_us"]
        checks = []
        paired = r.get("paired", {})
        if "compiled/onnxruntime" in paired:
            m, lo, hi = paired["compiled/onnxruntime"]
            checks.append(f"compiled/ONNX Runtime latency per round {m:.3f} ({lo:.3f}–{hi:.3f})")
        if "compiled-raw" in paired:
            m, lo, hi = paired["compiled-raw"]
            checks.append(f"compiled minus its engine's raw runner per round {m:+.2f} µs ({lo:+.2f}–{hi:+.2f})")
        notes = "; ".join(f"{k}: {v}" for k, v in r["notes"].items() if k != "engine")
        lines.append(
            f"- {r['model']} b{r['batch']} t{r['threads']}: one-time {build}; max |error| {err}"
            + (f"; {'; '.join(checks)}" if checks else "")
            + (f"; {notes}" if notes else "")
        )
    return "\n".join(lines)


ALL_VARIANTS = "interpreted,compiled,raw,torch.compile,jit,aoti,onnxruntime,openvino"


def run(quick: bool, progress: Callable[[int, int, str], None] | None = None) -> list[dict]:
    """Rows for ``accel bench`` (benchmarks/README.md): replay against eager.

    ``quick`` is a smoke run: the MLP at batch 1 on one thread, accel's tiers
    and ONNX Runtime, few rounds (the compiled tier's builds come from the
    disk cache after the first run). A full run times every variant at batch
    sizes 1 and 8 on 1 and 2 threads, and takes minutes (every build).
    ``progress(done, total, label)`` hears of each model, batch size and thread count.
    """
    if accel.current_accelerator().type != "cpu":
        print("bench_graph: torch capture and replay run on the host backend only; skipped", file=sys.stderr)
        return []
    if quick:
        variants, models = ["interpreted", "compiled", "raw", "onnxruntime"], ["mlp"]
        calls, repeats, batches, threads = 50, 5, (1,), (1,)
    else:
        variants, models = ALL_VARIANTS.split(","), list(_models())
        calls, repeats, batches, threads = 100, 21, (1, 8), (1, 2)
    rows: list[dict] = []
    for result in _sweep(models, batches, threads, calls, repeats, variants, progress):
        lat = result["median_latency_us"]
        if "compiled" in lat and "onnxruntime" in lat:
            rows.append({
                "name": f"{result['model']}, batch {result['batch']}, {result['threads']} thread(s): "
                "accel compiled vs ONNX Runtime",
                "ratio": lat["onnxruntime"] / lat["compiled"],
                "baseline": LABELS["onnxruntime"],
                "metric": "median-round latency",
            })
        for variant in variants:
            if variant not in result["median_latency_us"]:
                continue  # it could not be built here; bench() noted why
            rows.append({
                "name": f"{result['model']}, batch {result['batch']}, {result['threads']} thread(s): {LABELS[variant]}",
                "ratio": result["median_speedup_vs_eager"][variant],
                "baseline": "eager torch",
                "metric": "median-round latency",
                "latency_us": result["median_latency_us"][variant],
                "baseline_us": result["median_latency_us"]["eager"],
            })
    return rows


# Inference, as eager runs it: graphed calls replay without autograd, and one in
# grad mode with parameters that require grad is refused.
@torch.no_grad()
def _sweep(
    models: list[str],
    batches: Sequence[int],
    threads: Sequence[int],
    calls: int,
    repeats: int,
    variants: list[str],
    progress: Callable[[int, int, str], None] | None = None,
) -> list[dict]:
    results: list[dict] = []
    total = len(threads) * len(models) * len(batches)
    previous = torch.get_num_threads()
    try:
        for n in threads:
            torch.set_num_threads(n)
            for model_name in models:
                for batch in batches:
                    if progress is not None:
                        progress(len(results), total, f"{model_name}, batch {batch}, {n} thread(s): {', '.join(variants)}")
                    results.append(bench(model_name, batch, calls, repeats, variants))
                    print(_markdown(results[-1:], variants).splitlines()[-1], file=sys.stderr, flush=True)
    finally:
        torch.set_num_threads(previous)
    return results


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("ACCEL_BACKEND", "cpu")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,transformer,cnn,gru_step")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--calls", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=21)
    parser.add_argument("--variants", default=ALL_VARIANTS)
    parser.add_argument("--quick", action="store_true", help="batch 1, 1 thread, 7 rounds of 50 calls")
    parser.add_argument("--json", action="store_true", help="print raw results as JSON")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.threads, args.calls, args.repeats = "1", "1", 50, 7
    variants = [v for v in args.variants.split(",") if v]
    unknown = set(variants) - set(LABELS)
    if unknown:
        parser.error(f"unknown variants {sorted(unknown)}; choose from {sorted(set(LABELS) - {'eager'})}")
    if "raw" in variants and "compiled" not in variants:
        parser.error("the 'raw' variant is the compiled tier's engine: add 'compiled'")
    models = [m for m in args.models.split(",") if m]
    if set(models) - set(_models()):
        parser.error(f"unknown models {sorted(set(models) - set(_models()))}; choose from {sorted(_models())}")
    batches = [int(b) for b in args.batches.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    results = _sweep(models, batches, threads, args.calls, args.repeats, variants)
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu": accel.get_device_properties().name,
        "cores": os.cpu_count(),
        "load average": os.getloadavg(),
    }
    if args.json:
        print(json.dumps({"environment": env, "results": results}, indent=2))
    else:
        print(f"# {env}")
        print("\nMedian round (speed-up over eager, 25th–75th percentile of per-round speed-ups):\n")
        print(_markdown(results, variants))
        print()
        print(_costs(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
