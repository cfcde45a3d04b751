"""accel's caching allocator against PyTorch's, side by side on one CUDA GPU, as ratios.

Needs a CUDA GPU, accel's CUDA backend and a CUDA build of torch; elsewhere it
says why and measures nothing. In one run, on device 0:

(a) Latency of a cached allocate+free pair, on one created stream:
    - allocator level: ``DeviceAllocator.malloc`` + ``free`` against torch's
      caching allocator's raw alloc + delete (the C++ entry points under
      ``torch.cuda.caching_allocator_alloc`` / ``caching_allocator_delete``);
    - public API: ``accel.memory.allocate(n).free()`` against
      ``torch.empty(n, dtype=torch.uint8, device="cuda")`` and dropping it
      (torch's also builds a tensor, accel's a Buffer);
    - the driver's ``cuMemAlloc`` + ``cuMemFree`` through accel's backend, for scale.
    Ratios are torch's time / accel's (higher: accel is faster).
(b) Fragmentation: the allocation traces of benchmarks/bench_allocator.py
    (recorded from torch models on the CPU; only their sizes and order
    matter) replayed through a fresh accel allocator on the GPU and through
    torch's caching allocator, with and without expandable segments. Ratios
    are torch's peak reserved bytes / accel's (higher: accel holds less).
(c) The 4096-byte pairs of ``bench_allocator_pair.py --device cuda``, interleaved
    with ``torch.empty`` on torch's caching allocator, with their spread:
    accel's public pair, ``accel.empty``, and ``torch.empty`` through accel's
    pluggable allocator (on a MemPool, and as torch's whole allocator).

Run: ``python benchmarks/bench_allocator_cuda.py [--quick]`` from the
repository root on a machine with a GPU; results go to docs/benchmarks.md with
the GPU, driver and torch version printed first.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench_allocator import SIZES, Trace, _fmt, _per_call_us, models, record, replay  # noqa: E402
from bench_allocator_pair import cuda_rows  # noqa: E402

from accel._errors import AccelError  # noqa: E402
from accel._runtime import activate  # noqa: E402


def unavailable_reason() -> str | None:
    """Why this benchmark cannot run here, or None."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"torch has no CUDA device here (torch {torch.__version__}, CUDA {torch.version.cuda})"
    from accel.backends import load_backend

    try:
        load_backend("cuda")
    except AccelError as exc:
        return f"accel's CUDA backend is unavailable: {exc}"
    return None


def bench_latency(repeat: int) -> list[dict[str, Any]]:
    """One row per size: µs per pair (wall clock / CPU time) for each variant."""
    import torch

    import accel

    rows = []
    with activate("cuda") as runtime:
        stream = accel.Stream(0)  # both allocators on the same CUstream
        torch_stream = torch.cuda.ExternalStream(stream.native_handle, device=torch.device("cuda", 0))
        alloc = accel.memory.get_allocator(0)
        backend = runtime.backend
        # torch's allocator without caching_allocator_alloc's Python wrapper
        # (device lookups and a device switch per call, about as costly as the
        # allocation itself): the C++ entry points that wrapper calls.
        raw_alloc = torch._C._cuda_cudaCachingAllocator_raw_alloc
        raw_delete = torch._C._cuda_cudaCachingAllocator_raw_delete
        for size in SIZES:

            def accel_pair(size: int = size) -> None:
                alloc.free(alloc.malloc(size, stream))

            def torch_pair(size: int = size) -> None:
                raw_delete(raw_alloc(size, torch_stream.cuda_stream))

            def accel_buffer(size: int = size) -> None:
                accel.memory.allocate(size, stream=stream).free()

            def torch_tensor(size: int = size) -> None:
                torch.empty(size, dtype=torch.uint8, device="cuda")

            def raw(size: int = size) -> None:
                backend.free(0, backend.malloc(0, size))

            with torch.cuda.stream(torch_stream):
                for fn in (accel_pair, torch_pair, accel_buffer, torch_tensor):
                    fn()  # warm both caches
                rows.append({
                    "size": _fmt(size),
                    "accel": _per_call_us(accel_pair, 2000, repeat),
                    "torch": _per_call_us(torch_pair, 2000, repeat),
                    "accel_buffer": _per_call_us(accel_buffer, 2000, repeat),
                    "torch_tensor": _per_call_us(torch_tensor, 2000, repeat),
                    "raw": _per_call_us(raw, 100, repeat),
                })
        stream.synchronize()
    return rows


def torch_replay(trace: Trace, expandable: bool) -> tuple[int, int]:
    """(peak requested, peak reserved) of ``trace`` through torch's CUDA caching allocator."""
    import torch

    _set_torch_expandable(expandable)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_reserved()
    stream = torch.cuda.current_stream()
    live: dict[int, int] = {}
    sizes: dict[int, int] = {}
    requested = peak_requested = 0
    for event in trace.events:
        if event[0] == "a":
            _, ident, nbytes = event
            live[ident] = torch.cuda.caching_allocator_alloc(nbytes, 0, stream)
            sizes[ident] = nbytes
            requested += nbytes
            peak_requested = max(peak_requested, requested)
        else:
            ident = event[1]
            torch.cuda.caching_allocator_delete(live.pop(ident))
            requested -= sizes.pop(ident)
    peak_reserved = torch.cuda.max_memory_reserved() - before
    for ptr in live.values():
        torch.cuda.caching_allocator_delete(ptr)
    torch.cuda.empty_cache()
    return peak_requested, peak_reserved


def _set_torch_expandable(expandable: bool) -> None:
    import torch

    setting = f"expandable_segments:{expandable}"
    set_settings = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if set_settings is not None:  # torch >= 2.9; torch.cuda.memory's spelling is deprecated there
        set_settings(setting)
    else:
        torch.cuda.memory._set_allocator_settings(setting)


def bench_fragmentation() -> list[dict[str, Any]]:
    from accel.backends import load_backend

    cuda = load_backend("cuda")
    # Restored afterwards: `accel bench` runs every benchmark in this process.
    configured = " ".join(os.environ.get(v, "") for v in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    rows = []
    try:
        for name, build in models().items():
            trace = record(name, build)
            for expandable in (False, True):
                config = f"expandable_segments:{expandable}"
                requested, accel_reserved, _ = replay(trace, config, backend=cuda)
                _, torch_reserved = torch_replay(trace, expandable)
                rows.append({
                    "model": name,
                    "config": config,
                    "events": len(trace.events),
                    "requested": requested,
                    "accel": accel_reserved,
                    "torch": torch_reserved,
                })
    finally:
        _set_torch_expandable("expandable_segments:True" in configured.replace(" ", ""))
    return rows


def run(quick: bool) -> list[dict]:
    """Rows for ``accel bench`` (benchmarks/README.md); none, with the reason on stderr, without a GPU."""
    reason = unavailable_reason()
    if reason:
        print(f"bench_allocator_cuda: {reason}; skipped", file=sys.stderr)
        return []
    rows: list[dict] = []
    for r in bench_latency(5 if quick else 31):
        for level, mine, theirs, baseline in (
            ("allocator", "accel", "torch", "torch caching allocator raw alloc+delete"),
            ("public API", "accel_buffer", "torch_tensor", "torch.empty + drop"),
        ):
            rows.append({
                "name": f"allocate+free {r['size']}, {level}",
                "ratio": r[theirs][1] / r[mine][1],
                "baseline": baseline,
                "metric": "CPU time",
                "accel_us": r[mine][1],
                "baseline_us": r[theirs][1],
            })
    rows += cuda_rows(quick)
    if not quick:
        for r in bench_fragmentation():
            rows.append({
                "name": f"{r['model']}, {r['config']}",
                "ratio": r["torch"] / r["accel"],
                "baseline": "torch peak reserved bytes",
                "metric": "peak reserved bytes",
                "accel_fragmentation": r["accel"] / r["requested"],
                "torch_fragmentation": r["torch"] / r["requested"],
            })
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats, no fragmentation traces")
    args = parser.parse_args()
    reason = unavailable_reason()
    if reason:
        print(f"bench_allocator_cuda: {reason}", file=sys.stderr)
        return 2
    import torch

    from accel.backends import load_backend

    props = load_backend("cuda").device_properties(0)
    print(f"GPU: {props.name}, {props.total_memory >> 20} MiB, compute capability {props.compute_capability}, "
          f"driver {props.driver_version}; torch {torch.__version__} (CUDA {torch.version.cuda})")

    def pair(t: tuple[float, float]) -> str:
        return f"{t[0]:6.2f} / {t[1]:5.2f}"

    print("\n(a) allocate+free pair, µs per pair, median of batches: wall clock / CPU time")
    print(f"{'size':>8} | {'accel alloc':>15} | {'torch alloc':>15} | {'accel Buffer':>15} | "
          f"{'torch.empty':>15} | {'cuMemAlloc':>15} | torch/accel (CPU)")
    for r in bench_latency(5 if args.quick else 31):
        cells = [pair(r[k]) for k in ("accel", "torch", "accel_buffer", "torch_tensor", "raw")]
        print(f"{r['size']:>8} | " + " | ".join(f"{c:>15}" for c in cells)
              + f" | {r['torch'][1] / r['accel'][1]:.2f}x, {r['torch_tensor'][1] / r['accel_buffer'][1]:.2f}x")
    print("\n(c) 4096-byte pairs, interleaved, µs of CPU per pair; torch.empty / the case [p10-p90]")
    for row in cuda_rows(args.quick):
        print(f"  {row['name']:>80}: {row['accel_us']:6.2f}, {row['ratio']:.2f}x [{row['ratio_p10']:.2f}-{row['ratio_p90']:.2f}]")
    if args.quick:
        return 0
    print("\n(b) fragmentation: peak reserved / peak requested")
    print(f"{'model':>36} | {'config':>26} | {'events':>6} | {'requested':>10} | {'accel':>6} | {'torch':>6}")
    for r in bench_fragmentation():
        print(f"{r['model']:>36} | {r['config']:>26} | {r['events']:>6} | {_fmt(r['requested']):>10} | "
              f"{r['accel'] / r['requested']:>6.3f} | {r['torch'] / r['requested']:>6.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
