"""Expandable segments that give back holes, against keeping them and against no expandable segments.

Replays allocation traces through a fresh ``DeviceAllocator`` on the host
backend (one stream), in one run, under four settings:

- ``plain``: ``expandable_segments:False``;
- ``holes kept``: expandable segments that keep every hole mapped until
  ``empty_cache`` (PyTorch's policy): ``expandable_keep_free_mb`` set very large;
- ``given back``: expandable segments with the default ``expandable_keep_free_mb:0``
  (the whole free pages of holes are unmapped when a segment grows);
- ``given back, keep 2``: the same keeping 2 MiB of free pages mapped per segment.

For each it reports peak reserved / peak requested and the backend's map plus
unmap calls per allocation, and for ``given back`` whether peak reserved is at
most peak requested plus two pages per (pool, stream) in use, with what the
excess is made of at the moment of peak reserved: bytes lost to 512-byte
rounding, free bytes of the partial pages at the edges of holes (and how many
holes), whole free pages still mapped, the free ends of the segments' last
pages, less how far requested bytes then were below their peak.

The traces: three reallocation-heavy ones written here (seeded, so every run
replays the same events) and, without ``--quick``, the model traces of
``bench_allocator.py`` (recorded from torch at run time). ``--seeds N`` replays
each written trace with N seeds instead and reports how often the bound holds.

Run: ``python benchmarks/bench_expandable.py [--quick] [--seeds N]`` from the repository root.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from accel._runtime import Runtime  # noqa: E402
from accel.allocator._caching import DeviceAllocator  # noqa: E402
from accel.allocator.config import parse  # noqa: E402
from accel.backends.cpu import CpuBackend  # noqa: E402

MiB = 1 << 20
PAGE = 2 * MiB
Events = list[tuple]  # ("a", id, nbytes) and ("f", id)

CONFIGS = {
    "plain": "expandable_segments:False",
    "holes kept": "expandable_segments:True,expandable_keep_free_mb:1000000",
    "given back": "expandable_segments:True",
    "given back, keep 2": "expandable_segments:True,expandable_keep_free_mb:2",
}


class _Writer:
    def __init__(self) -> None:
        self.events: Events = []
        self._next = 0

    def alloc(self, nbytes: int) -> int:
        ident = self._next
        self._next += 1
        self.events.append(("a", ident, int(nbytes)))
        return ident

    def free(self, ident: int) -> None:
        self.events.append(("f", ident))


def decoder_caches(seed: int = 1, steps: int = 600) -> Events:
    """Per-request caches of 0.25-40 MiB that grow by 10-50% by reallocation (the new
    size allocated, the old freed) and end in random order, plus short-lived
    temporaries every step: the held-out pattern of issue 15."""
    rng = random.Random(seed)
    w = _Writer()
    caches: dict[int, tuple[int, int]] = {}  # request -> (id, bytes)
    serial = 0
    for _ in range(steps):
        if len(caches) < 14 and rng.random() < 0.3:
            size = int(rng.uniform(0.25, 4) * MiB)
            caches[serial] = (w.alloc(size), size)
            serial += 1
        for req in list(caches):
            ident, size = caches[req]
            if rng.random() < 0.25 and size < 40 * MiB:
                new = min(int(size * rng.uniform(1.1, 1.5)), 40 * MiB)
                grown = w.alloc(new)
                w.free(ident)
                caches[req] = (grown, new)
        temps = [w.alloc(rng.uniform(0.05, 12) * MiB) for _ in range(rng.randint(2, 5))]
        rng.shuffle(temps)
        for t in temps:
            w.free(t)
        if caches and rng.random() < 0.08:
            req = rng.choice(list(caches))
            w.free(caches.pop(req)[0])
    for ident, _ in caches.values():
        w.free(ident)
    return w.events


def variable_batches(seed: int = 2, steps: int = 300) -> Events:
    """Inference at a random batch size every step: 60 MiB of weights, a chain of
    8 layers whose activations scale with the batch (each freed after the next
    layer), workspace temporaries, and a per-step output kept for two steps."""
    rng = random.Random(seed)
    w = _Writer()
    weights = [w.alloc(rng.uniform(2, 10) * MiB) for _ in range(10)]
    outputs: list[int] = []
    for _ in range(steps):
        batch = rng.choice((1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64))
        act = w.alloc(batch * 1.3 * MiB)
        for _layer in range(8):
            ws = w.alloc(rng.uniform(0.1, 1.0) * batch * MiB)
            nxt = w.alloc(batch * rng.uniform(0.8, 2.2) * MiB)
            w.free(ws)
            w.free(act)
            act = nxt
        outputs.append(act)
        if len(outputs) > 2:
            w.free(outputs.pop(0))
    for ident in outputs + weights:
        w.free(ident)
    return w.events


def growing_buffers(seed: int = 3, rounds: int = 5) -> Events:
    """Append-only buffers (token lists, growing batches) that grow by 10-50% by
    reallocation up to 30-60 MiB, interleaved with temporaries; each round frees
    them in random order and starts again."""
    rng = random.Random(seed)
    w = _Writer()
    for _ in range(rounds):
        buffers = {i: (w.alloc(0.5 * MiB), 0.5 * MiB, rng.uniform(30, 60) * MiB) for i in range(8)}
        growing = list(buffers)
        while growing:
            i = rng.choice(growing)
            ident, size, cap = buffers[i]
            new = min(size * rng.uniform(1.1, 1.5), cap)
            grown = w.alloc(new)
            w.free(ident)
            buffers[i] = (grown, new, cap)
            if new >= cap:
                growing.remove(i)
            if rng.random() < 0.5:
                t = w.alloc(rng.uniform(0.1, 6) * MiB)
                w.free(t)
        order = list(buffers.values())
        rng.shuffle(order)
        for ident, _, _ in order:
            w.free(ident)
    return w.events


TRACES: dict[str, Callable[[], Events]] = {
    "decoder caches (0.25-40 MiB, +10-50%)": decoder_caches,
    "variable batch sizes": variable_batches,
    "growing buffers": growing_buffers,
}


class _Counting(CpuBackend):
    """The host backend, counting the map and unmap calls the allocator makes."""

    maps = 0
    unmaps = 0

    def vm_map(self, device: int, addr: int, nbytes: int, handle: int) -> None:
        self.maps += 1
        super().vm_map(device, addr, nbytes, handle)

    def vm_unmap(self, device: int, addr: int, nbytes: int) -> None:
        self.unmaps += 1
        super().vm_unmap(device, addr, nbytes)


def _excess(alloc: DeviceAllocator, requested: int) -> dict[str, int]:
    """What the bytes reserved beyond ``requested`` are made of, now (from the native
    core's blocks: the mapped ones of each segment)."""
    out = {"rounding": 0, "holes": 0, "hole_edges": 0, "whole_free": 0, "segment_ends": 0}
    segments: dict[int, list[dict[str, int]]] = {}
    for b in alloc.native_core().blocks():
        if b["mapped"]:
            segments.setdefault(b["segment"], []).append(b)
    for base, blocks in segments.items():
        free = [b for b in blocks if not (b["allocated"] or b["held"])]
        for b in blocks:
            if b["allocated"] or b["held"]:
                out["rounding"] += b["size"] - b["requested"]
        if not blocks[0]["expandable"]:
            out["whole_free"] += sum(b["size"] for b in free)
            continue
        last_live = max((b["ptr"] for b in blocks if b["allocated"] or b["held"]), default=base - 1)
        for b in free:
            first = base + -(-(b["ptr"] - base) // PAGE) * PAGE
            last = base + (b["ptr"] + b["size"] - base) // PAGE * PAGE
            whole = max(0, last - first)
            out["whole_free"] += whole
            if b["ptr"] > last_live:
                out["segment_ends"] += b["size"] - whole
            else:
                out["holes"] += 1
                out["hole_edges"] += b["size"] - whole
    out["requested_then"] = requested
    return out


def replay(events: Events, config: str, explain: bool = False) -> dict[str, float]:
    """Peak requested and reserved bytes, map+unmap calls per allocation, and
    (``explain``) what the excess was made of at the moment of peak reserved."""
    backend = _Counting(1, None)
    stream = Runtime(backend).default_stream(0)
    alloc = DeviceAllocator(backend, 0, parse(config))
    live: dict[int, object] = {}
    sizes: dict[int, int] = {}
    requested = peak = allocations = top = 0
    at_peak: dict[str, int] = {}
    for event in events:
        if event[0] == "a":
            _, ident, nbytes = event
            live[ident] = alloc.malloc(nbytes, stream)
            sizes[ident] = nbytes
            requested += nbytes
            peak = max(peak, requested)
            allocations += 1
            if explain and alloc._core_reserved() > top:
                top = alloc._core_reserved()
                at_peak = _excess(alloc, requested)
        else:
            alloc.free(live.pop(event[1]))  # type: ignore[arg-type]
            requested -= sizes.pop(event[1])
    stats = alloc.stats()
    for block in live.values():
        alloc.free(block)  # type: ignore[arg-type]
    alloc.empty_cache()
    pools = sum(1 for kind in ("small_pool", "large_pool") if stats[f"allocation.{kind}.allocated"])
    return {
        "requested": peak,
        "reserved": stats["reserved_bytes.all.peak"],
        "calls_per_alloc": (backend.maps + backend.unmaps) / allocations,
        "bound": peak + 2 * PAGE * pools,  # two pages per (pool, stream) in use
        **at_peak,
    }


def _traces(quick: bool) -> dict[str, Events]:
    out = {name: make() for name, make in TRACES.items()}
    if not quick:
        import bench_allocator

        for name, build in bench_allocator.models().items():
            out[name] = bench_allocator.record(name, build).events
    return out


def run(quick: bool) -> list[dict]:
    """Rows for ``accel bench``: peak requested / peak reserved per trace and setting."""
    rows = []
    for name, events in _traces(quick).items():
        for label, config in CONFIGS.items():
            r = replay(events, config)
            rows.append({
                "name": f"{name}, {label}",
                "ratio": r["requested"] / r["reserved"],
                "baseline": "peak requested bytes",
                "metric": "peak requested / peak reserved",
                "fragmentation": r["reserved"] / r["requested"],
                "map_unmap_calls_per_allocation": r["calls_per_alloc"],
            })
    return rows


def _seeds(n: int) -> None:
    """Each written trace with ``n`` seeds: how often the bound holds, and the excess."""
    print(f"peak reserved - peak requested over {n} seeds per trace (MiB); bound: two pages per (pool, stream)")
    print(f"{'trace':>40} | {'setting':>18} | met | median | max | never worse than plain")
    for name, make in TRACES.items():
        runs: dict[str, list[dict[str, float]]] = {label: [] for label in CONFIGS}
        seed0 = make.__defaults__[0]  # type: ignore[index]
        for k in range(n):
            events = make(seed0 + 100 * k)
            for label, config in CONFIGS.items():
                runs[label].append(replay(events, config))
        for label in CONFIGS:
            if label == "plain":
                continue
            excess = sorted((r["reserved"] - r["requested"]) / MiB for r in runs[label])
            met = sum(r["reserved"] <= r["bound"] for r in runs[label])
            worse = sum(r["reserved"] > p["reserved"] for r, p in zip(runs[label], runs["plain"]))
            print(f"{name:>40} | {label:>18} | {met:>2}/{n} | {excess[n // 2]:6.1f} | {excess[-1]:5.1f} | "
                  f"{'yes' if not worse else f'no ({worse} worse)'}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the written traces only")
    parser.add_argument("--seeds", type=int, default=0, help="replay each written trace with this many seeds")
    args = parser.parse_args(argv)
    if args.seeds:
        _seeds(args.seeds)
        return 0
    print("peak reserved / peak requested (map+unmap calls per allocation); one stream, host backend")
    print(f"{'trace':>40} | {'events':>6} | {'peak req.':>9} | " + " | ".join(f"{c:>19}" for c in CONFIGS)
          + " | given back: excess, bound, met")
    explained = []
    for name, events in _traces(args.quick).items():
        results = {label: replay(events, config, explain=label == "given back") for label, config in CONFIGS.items()}
        cells = [f"{r['reserved'] / r['requested']:7.3f} ({r['calls_per_alloc']:5.2f})" for r in results.values()]
        given = results["given back"]
        met = given["reserved"] <= given["bound"] and given["reserved"] <= results["plain"]["reserved"]
        print(f"{name:>40} | {len(events):>6} | {results['plain']['requested'] / MiB:>5.0f} MiB | "
              + " | ".join(f"{c:>19}" for c in cells)
              + f" | +{(given['reserved'] - given['requested']) / MiB:.1f} MiB, "
              f"+{(given['bound'] - given['requested']) / MiB:.0f} MiB, {'yes' if met else 'NO'}")
        explained.append((name, given))
    print("\ngiven back, at the moment of peak reserved (MiB): excess = rounding (KiB) + hole edges + whole free pages"
          " + segment ends - (peak requested - requested then)")
    for name, g in explained:
        print(f"{name:>40} | +{(g['reserved'] - g['requested']) / MiB:5.2f} = {g['rounding'] / 1024:.0f} KiB"
              f" + {g['hole_edges'] / MiB:.2f} ({g['holes']:.0f} holes) + {g['whole_free'] / MiB:.2f}"
              f" + {g['segment_ends'] / MiB:.2f} - {(g['requested'] - g['requested_then']) / MiB:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
