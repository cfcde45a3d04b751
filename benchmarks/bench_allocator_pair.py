"""The public allocate+free pair against ``torch.empty`` and ``numpy.empty``, and its cost
with many cached holes: issue 16's allocation rows, in one run, interleaved.

Each round times one batch of every case in turn (the order rotates), on the
host backend's current device and stream; a case's figure is the median of its
per-round CPU time per pair, and each ratio is the median of the per-round
ratios with their 10th-90th percentile (the spread). Cases:

- ``accel.memory.allocate(4096).free()`` (cached) and the DeviceAllocator's own pair;
- ``accel.empty(4096, dtype=torch.uint8)`` then ``del`` (a torch tensor on accel memory);
- the native allocator core's pair through its cffi binding (``NativeCore.malloc/free``);
- ``torch.empty(4096, dtype=torch.uint8)`` then ``del``; ``numpy.empty(4096, dtype=uint8)``;
- the public pair with 10 and with 100,000 free 4 KiB blocks cached on the
  stream (every other block of twice as many), for 4 KiB and 1 MiB requests.

Besides, the pair of torch's pluggable-allocator C ABI (``accel_torch_alloc`` +
``accel_torch_free`` of :func:`accel.allocator.torch_allocator_spec`, 4096 bytes, cached)
is timed in C, as torch calls it: a loop compiled at run time (needs a C compiler),
in ns of thread CPU time per pair, beside libc's ``malloc`` + ``free`` in the same loop.

With ``--device cuda`` (issue 27's GPU rows; needs a CUDA GPU, accel's CUDA
backend and a CUDA build of torch, else it says why and exits 2), the same
interleaved rounds on device 0, all on accel's current stream, against
``torch.empty(4096, dtype=torch.uint8, device="cuda")`` + ``del`` (torch's caching allocator):

- ``accel.memory.allocate(4096).free()`` and ``accel.empty(4096, dtype=torch.uint8)`` + ``del``;
- ``torch.empty`` inside ``torch.cuda.use_mem_pool`` of a ``MemPool`` over
  :func:`accel.allocator.torch_allocator` (torch's books in front, accel's below);
- ``torch.empty`` with accel as torch's whole allocator
  (``change_current_allocator``, every tensor an ``accel_torch_alloc``/``free``).
  That must precede torch's first CUDA allocation, so it runs in a child
  process: its rounds are compared with this process's ``torch.empty`` rounds,
  not interleaved with them.

``bench_allocator_cuda.py`` carries these rows into ``accel bench`` and ``accel verify``.

Run: ``python benchmarks/bench_allocator_pair.py [--quick] [--device cuda]`` from the repository root.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any, ContextManager

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SIZE = 4096


def _rounds(
    cases: dict[str, Callable[[], None]], rounds: int, number: int,
    contexts: dict[str, Callable[[], ContextManager[Any]]] | None = None,
) -> dict[str, list[float]]:
    """Per case, the CPU µs per call of each round; the cases' order rotates per round.
    A case in ``contexts`` runs its batch inside that context (entered outside the timing)."""
    names = list(cases)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[: r % len(names)]:
            fn = cases[name]
            with (contexts or {}).get(name, contextlib.nullcontext)():
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


# The C-ABI loop: dlopen + dlsym as torch does, then alloc/free pairs of one size on
# the default stream; thread CPU ns per pair, the best of ``rounds`` batches.
_ABI_LOOP = r"""
#include <dlfcn.h>
#include <stdlib.h>
#include <sys/types.h>
#include <time.h>
typedef void *(*alloc_fn)(ssize_t, int, void *);
typedef void (*free_fn)(void *, ssize_t, int, void *);
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return t.tv_sec * 1e9 + t.tv_nsec;
}
double abi_pair_ns(const char *path, const char *an, const char *fn, long n, int rounds) {
    void *lib = dlopen(path, RTLD_NOW);
    if (!lib) return -1;
    alloc_fn a = (alloc_fn)dlsym(lib, an);
    free_fn f = (free_fn)dlsym(lib, fn);
    if (!a || !f) return -1;
    double best = 1e18;
    for (int r = 0; r < rounds; r++) {
        double t0 = now();
        for (long i = 0; i < n; i++) {
            void *p = a(4096, 0, NULL);
            if (!p) return -1;
            f(p, 4096, 0, NULL);
        }
        double per = (now() - t0) / n;
        if (per < best) best = per;
    }
    return best;
}
double libc_pair_ns(long n, int rounds) {
    double best = 1e18;
    for (int r = 0; r < rounds; r++) {
        double t0 = now();
        for (long i = 0; i < n; i++) {
            void *volatile p = malloc(4096);
            free(p);
        }
        double per = (now() - t0) / n;
        if (per < best) best = per;
    }
    return best;
}
"""


def measure_abi(quick: bool) -> dict[str, float] | None:
    """ns per pair of the C ABI and of libc in the same C loop; None without a compiler."""
    import ctypes

    from accel._runtime import activate
    from accel.allocator import torch_allocator_spec

    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "abi_loop.c"), os.path.join(tmp, "abi_loop.so")
        with open(src, "w") as f:
            f.write(_ABI_LOOP)
        subprocess.run([compiler, "-O2", "-shared", "-fPIC", src, "-o", lib, "-ldl"], check=True)
        loop = ctypes.CDLL(lib)
        loop.abi_pair_ns.restype = loop.libc_pair_ns.restype = ctypes.c_double
        loop.abi_pair_ns.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_long, ctypes.c_int]
        loop.libc_pair_ns.argtypes = [ctypes.c_long, ctypes.c_int]
        n, rounds = (20_000, 5) if quick else (200_000, 21)
        with activate("cpu"):
            path, alloc_name, free_name = torch_allocator_spec()
            abi = loop.abi_pair_ns(path.encode(), alloc_name.encode(), free_name.encode(), n, rounds)
        return {"C ABI alloc+free": abi, "libc malloc+free": loop.libc_pair_ns(n, rounds)}


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

        def accel_empty() -> None:
            t = accel.empty(SIZE, dtype=torch.uint8)
            del t

        core = alloc.native_core()
        handle = stream._handle

        def core_pair() -> None:
            core.free(core.malloc(SIZE, handle)[0])

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

        for fn in (public, device_pair, accel_empty, core_pair, torch_empty, numpy_empty, public_1mib):
            fn()
        pairs = _rounds(
            {"accel.memory.allocate": public, "DeviceAllocator": device_pair, "accel.empty": accel_empty,
             "NativeCore (cffi)": core_pair, "torch.empty": torch_empty, "numpy.empty": numpy_empty},
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


def cuda_unavailable_reason() -> str | None:
    """Why the ``--device cuda`` rows cannot be measured here, or None."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_allocator_cuda import unavailable_reason

    return unavailable_reason()


def _cuda_rounds(quick: bool) -> tuple[int, int]:
    return (5, 500) if quick else (21, 4000)


def measure_cuda(quick: bool) -> dict[str, list[float]]:
    """The interleaved GPU cases of this process (the docstring's list, less the child's)."""
    import torch

    import accel
    from accel._runtime import activate
    from accel.allocator import torch_allocator

    with activate("cuda") as runtime:
        device = runtime.current_index
        stream = runtime.current_stream(device)
        torch_stream = torch.cuda.ExternalStream(stream.native_handle, device=torch.device("cuda", device))
        pool = torch.cuda.MemPool(torch_allocator().allocator())

        def public() -> None:
            accel.memory.allocate(SIZE).free()

        def accel_empty() -> None:
            t = accel.empty(SIZE, dtype=torch.uint8)
            del t

        def torch_empty() -> None:
            t = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
            del t

        with torch.cuda.stream(torch_stream):
            for fn in (public, accel_empty, torch_empty):
                fn()  # warm every cache
            with torch.cuda.use_mem_pool(pool):
                torch_empty()
            return _rounds(
                {"accel.memory.allocate": public, "accel.empty": accel_empty, "torch.empty": torch_empty,
                 "torch.empty on a MemPool over accel": torch_empty},
                *_cuda_rounds(quick),
                contexts={"torch.empty on a MemPool over accel": lambda: torch.cuda.use_mem_pool(pool)},
            )


def measure_cuda_current_allocator(quick: bool) -> list[float]:
    """Per round, CPU µs of ``torch.empty`` + ``del`` with accel as torch's allocator (this process:
    call it before torch's first CUDA allocation, so in a child)."""
    import torch

    import accel
    from accel.allocator import torch_allocator

    torch.cuda.memory.change_current_allocator(torch_allocator())
    stream = torch.cuda.ExternalStream(accel.current_stream().native_handle, device=torch.device("cuda", 0))

    def torch_empty() -> None:
        t = torch.empty(SIZE, dtype=torch.uint8, device="cuda")
        del t

    with torch.cuda.stream(stream):
        torch_empty()
        return _rounds({"torch.empty": torch_empty}, *_cuda_rounds(quick))["torch.empty"]


def _child_current_allocator(quick: bool) -> list[float]:
    command = [sys.executable, os.path.abspath(__file__), "--device", "cuda", "--child-current-allocator"]
    result = subprocess.run(command + (["--quick"] if quick else []), capture_output=True, text=True,
                            env={**os.environ, "ACCEL_BACKEND": "cuda"}, timeout=300, check=False)
    if result.returncode != 0:
        raise RuntimeError(f"the change_current_allocator child failed (exit {result.returncode}): {result.stderr[-2000:]}")
    rounds: list[float] = json.loads(result.stdout.strip().splitlines()[-1])
    return rounds


def cuda_rows(quick: bool) -> list[dict[str, Any]]:
    """The GPU rows for ``accel bench`` (via bench_allocator_cuda.py): torch.empty's time / each case's."""
    cases = measure_cuda(quick)
    cases["torch.empty, accel as torch's allocator (child process)"] = _child_current_allocator(quick)
    rows = []
    for name, values in cases.items():
        if name == "torch.empty":
            continue
        ratio, lo, hi = _ratio(cases["torch.empty"], values)
        rows.append({
            "name": f"cuda: {name} (4096 B) vs torch.empty", "ratio": ratio, "ratio_p10": lo, "ratio_p90": hi,
            "baseline": "torch.empty(4096, uint8, cuda) + del, torch's caching allocator", "metric": "CPU time",
            "accel_us": statistics.median(values), "baseline_us": statistics.median(cases["torch.empty"]),
        })
    return rows


def main_cuda(quick: bool) -> int:
    reason = cuda_unavailable_reason()
    if reason:
        print(f"bench_allocator_pair: --device cuda: {reason}", file=sys.stderr)
        return 2
    import torch

    print(f"GPU: {torch.cuda.get_device_name(0)}; torch {torch.__version__} (CUDA {torch.version.cuda}), "
          f"load average {os.getloadavg()[0]:.1f}")
    print("µs of CPU per pair, median of interleaved rounds; ratio: torch.empty / the case [p10-p90]")
    for row in cuda_rows(quick):
        print(f"  {row['name']:>80}: {row['accel_us']:6.2f} µs, {row['ratio']:.2f}x "
              f"[{row['ratio_p10']:.2f}-{row['ratio_p90']:.2f}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cpu: the host rows (default); cuda: the GPU rows against torch's caching allocator")
    parser.add_argument("--child-current-allocator", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child_current_allocator:
        print(json.dumps(measure_cuda_current_allocator(args.quick)))
        return 0
    if args.device == "cuda":
        return main_cuda(args.quick)
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
    for name in ("accel.empty", "NativeCore (cffi)"):
        ratio, lo, hi = _ratio(pairs[name], pairs["torch.empty"])
        print(f"{name} / torch.empty: {ratio:.2f}x [{lo:.2f}-{hi:.2f}]")
    for size in ("4 KiB", "1 MiB"):
        ratio, lo, hi = _ratio(by_holes[f"{size}, 100000 holes"], by_holes[f"{size}, 10 holes"])
        print(f"{size} pair, 100,000 holes / 10 holes: {ratio:.2f}x [{lo:.2f}-{hi:.2f}]")
    abi = measure_abi(args.quick)
    if abi is None:
        print("C ABI pair: not measured (no C compiler)")
    else:
        print("ns of CPU per pair in a C loop, best of the batches: " + ", ".join(
            f"{name} {ns:.0f}" for name, ns in abi.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
