"""Caching allocator benchmarks on the host backend, printed as ratios.

(a) Latency: a cached allocate+free pair against the backend's raw
    malloc+free, for several sizes, through the DeviceAllocator and through
    ``accel.memory.allocate`` (which adds the Buffer object), all on the host
    backend's current device and its one allocator.
(b) Fragmentation: allocation traces recorded from torch inference models
    (an MLP, a transformer encoder, a CNN) with a TorchDispatchMode, replayed
    through the allocator with and without expandable segments; the figure is
    peak reserved bytes / peak requested bytes.

Run: ``python benchmarks/bench_allocator.py`` from the repository root
(``--quick`` for fewer repeats). Traces are recorded at run time; nothing is
stored.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import weakref
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accel._runtime import Runtime, activate  # noqa: E402
from accel.allocator._caching import DeviceAllocator  # noqa: E402
from accel.allocator.config import parse  # noqa: E402
from accel.backends.base import Backend  # noqa: E402
from accel.backends.cpu import CpuBackend  # noqa: E402
from accel.stream import Stream  # noqa: E402

MiB = 1 << 20
SIZES = (512, 64 << 10, 1 << 20, 8 << 20, 64 << 20)


def _per_call_us(fn: Callable[[], None], number: int, repeat: int) -> tuple[float, float]:
    """Median µs per call of ``fn`` over ``repeat`` batches of ``number`` calls:
    (wall clock, this thread's CPU time). The CPU time is what the code costs;
    the wall clock also counts time the shared machine gave to others."""
    wall, cpu = [], []
    for _ in range(repeat):
        w0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        for _ in range(number):
            fn()
        cpu.append((time.thread_time_ns() - c0) / number / 1000)
        wall.append((time.perf_counter_ns() - w0) / number / 1000)
    return statistics.median(wall), statistics.median(cpu)


def bench_latency(repeat: int) -> list[tuple[str, tuple[float, float], tuple[float, float], tuple[float, float]]]:
    import accel

    # accel.memory.allocate takes no backend or allocator: it uses the process's
    # runtime and that runtime's allocator of the current device. So every row
    # runs there, on the host backend (activated whatever ACCEL_BACKEND says):
    # the DeviceAllocator row times the very allocator the facade calls, and the
    # raw row the very backend and device, so the facade row minus the
    # DeviceAllocator row is what the facade adds (the stream lookup and the
    # Buffer object). That allocator is configured from the environment
    # (ACCEL_ALLOC_CONF...), as for any accel.memory user.
    with activate("cpu") as runtime:
        device = runtime.current_index
        alloc = accel.memory.get_allocator(device)
        return _latency_rows(runtime.backend, device, alloc, runtime.current_stream(device), repeat)


def _latency_rows(
    backend: Backend, device: int, alloc: DeviceAllocator, stream: Stream, repeat: int
) -> list[tuple[str, tuple[float, float], tuple[float, float], tuple[float, float]]]:
    import accel

    rows = []
    for size in SIZES:
        alloc.free(alloc.malloc(size, stream))  # warm the cache

        def cached(size: int = size) -> None:
            alloc.free(alloc.malloc(size, stream))

        def facade(size: int = size) -> None:
            accel.memory.allocate(size).free()

        def raw(size: int = size) -> None:
            backend.free(device, backend.malloc(device, size))

        facade()
        rows.append(
            (
                _fmt(size),
                _per_call_us(cached, 2000, repeat),
                _per_call_us(facade, 2000, repeat),
                _per_call_us(raw, 200, repeat),
            )
        )
    return rows


# -- traces -------------------------------------------------------------------------------------


class Trace:
    """Allocation events of tensors' storages: ("a", id, nbytes) and ("f", id)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self._live: dict[int, list[int]] = {}  # data_ptr -> [id, tensor references]
        self._next = 0

    def see(self, tensor) -> None:  # noqa: ANN001 - a torch.Tensor
        storage = tensor.untyped_storage()
        nbytes = storage.nbytes()
        ptr = storage.data_ptr()
        if nbytes == 0 or ptr == 0:
            return
        entry = self._live.get(ptr)
        if entry is None:
            entry = self._live[ptr] = [self._next, 0]
            self.events.append(("a", self._next, nbytes))
            self._next += 1
        entry[1] += 1
        weakref.finalize(tensor, self._drop, ptr)

    def _drop(self, ptr: int) -> None:
        entry = self._live[ptr]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[ptr]
            self.events.append(("f", entry[0]))


def record(name: str, build: Callable[[], tuple], passes: int = 3) -> Trace:
    """The trace of loading ``build()``'s model and running ``passes`` inference passes."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    trace = Trace()

    class Recorder(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            out = func(*args, **(kwargs or {}))
            for t in torch.utils._pytree.tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    trace.see(t)
            return out

    torch.manual_seed(0)
    model, make_input = build()
    model.eval()
    for tensor in [*model.parameters(), *model.buffers()]:
        trace.see(tensor)  # weights are loaded onto the device first
    with torch.inference_mode():
        for _ in range(passes):
            x = make_input()
            trace.see(x)
            with Recorder():
                y = model(x)
            del x, y
    del model
    return trace


def models() -> dict[str, Callable[[], tuple]]:
    import torch
    from torch import nn

    def mlp():
        layers = []
        for _ in range(4):
            layers += [nn.Linear(2048, 2048), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(2048, 1000)), lambda: torch.randn(256, 2048)

    def transformer():
        layer = nn.TransformerEncoderLayer(512, 8, 2048, batch_first=True, dropout=0.0)
        encoder = nn.TransformerEncoder(layer, 4, enable_nested_tensor=False)
        return encoder, lambda: torch.randn(16, 128, 512)

    def cnn():
        def block(cin: int, cout: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(),
                nn.Conv2d(cout, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2),
            )

        net = nn.Sequential(
            block(3, 32), block(32, 64), block(64, 128), block(128, 256),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(256, 1000),
        )
        return net, lambda: torch.randn(8, 3, 112, 112)

    return {"MLP 4x2048, batch 256": mlp, "transformer encoder 4x512, 16x128": transformer,
            "CNN 8 convs, 8x3x112x112": cnn}


def replay(trace: Trace, config: str, backend: Backend | None = None) -> tuple[int, int, int]:
    """(peak requested, peak reserved, peak allocated) of ``trace`` through a fresh
    allocator on device 0 of ``backend`` (a fresh one-device host backend by default)."""
    backend = backend or CpuBackend(1, None)
    stream = Runtime(backend).default_stream(0)
    alloc = DeviceAllocator(backend, 0, parse(config))
    live: dict[int, object] = {}
    sizes: dict[int, int] = {}
    requested = peak_requested = 0
    for event in trace.events:
        if event[0] == "a":
            _, ident, nbytes = event
            live[ident] = alloc.malloc(nbytes, stream)
            sizes[ident] = nbytes
            requested += nbytes
            peak_requested = max(peak_requested, requested)
        else:
            ident = event[1]
            alloc.free(live.pop(ident))  # type: ignore[arg-type]
            requested -= sizes.pop(ident)
    stats = alloc.stats()
    for block in live.values():
        alloc.free(block)  # type: ignore[arg-type]
    alloc.empty_cache()
    return peak_requested, stats["reserved_bytes.all.peak"], stats["allocated_bytes.all.peak"]


def _fmt(n: int) -> str:
    for unit, scale in (("MiB", MiB), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}".replace(".0 ", " ")
    return f"{n} B"


def run(quick: bool) -> list[dict]:
    """Rows for ``accel bench`` (benchmarks/README.md): speed against the raw
    backend, and memory efficiency (peak requested / peak reserved)."""
    rows: list[dict] = []
    for size, cached, facade, raw in bench_latency(7 if quick else 31):
        for label, (wall, cpu) in (("DeviceAllocator", cached), ("accel.memory.allocate", facade)):
            rows.append({
                "name": f"allocate+free {size}, {label}",
                "ratio": raw[1] / cpu,
                "baseline": "raw backend malloc+free",
                "metric": "CPU time",
                "accel_us": cpu,
                "accel_wall_us": wall,
                "baseline_us": raw[1],
            })
    for name, build in models().items():
        trace = record(name, build)
        for config in ("expandable_segments:False", "expandable_segments:True"):
            requested, reserved, _ = replay(trace, config)
            rows.append({
                "name": f"{name}, {config}",
                "ratio": requested / reserved,
                "baseline": "peak requested bytes",
                "metric": "peak requested / peak reserved",
                "fragmentation": reserved / requested,
            })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    args = parser.parse_args()
    repeat = 7 if args.quick else 31

    import torch

    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"Python {platform.python_version()}, torch {torch.__version__}, {platform.system()} {platform.release()}")
    print("\n(a) allocate+free pair, µs per pair, median of batches: wall clock / CPU time")
    print(f"{'size':>8} | {'DeviceAllocator':>15} | {'memory.allocate':>15} | {'raw backend':>15} | raw/cached (CPU)")
    for size, cached, facade, raw in bench_latency(repeat):
        cells = [f"{w:6.2f} / {c:5.2f}" for w, c in (cached, facade, raw)]
        print(f"{size:>8} | {cells[0]:>15} | {cells[1]:>15} | {cells[2]:>15} | {raw[1] / cached[1]:>9.1f}x")

    print("\n(b) fragmentation: peak reserved / peak requested")
    print(f"{'model':>36} | {'events':>6} | {'peak requested':>14} | {'plain':>6} | {'expandable':>10}")
    for name, build in models().items():
        trace = record(name, build)
        plain = replay(trace, "expandable_segments:False")
        expandable = replay(trace, "expandable_segments:True")
        print(f"{name:>36} | {len(trace.events):>6} | {_fmt(plain[0]):>14} | "
              f"{plain[1] / plain[0]:>6.3f} | {expandable[1] / expandable[0]:>10.3f}")


if __name__ == "__main__":
    main()
