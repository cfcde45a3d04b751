"""The cached allocate+free pair of two versions of accel, side by side in one run.

Each version (a git revision, or the working tree) runs in a worker process of
its own, importing its own copy of ``accel``; the rounds are interleaved (A, B,
B, A, ...) so that the shared machine's load falls on both alike. Each worker
times, per round, batches of pairs on the host backend:

- ``DeviceAllocator``: ``alloc.free(alloc.malloc(n, stream))`` on the process's allocator;
- ``memory.allocate``: ``accel.memory.allocate(n).free()`` (the public pair);
- the same two with ``--holes`` free 4 KiB blocks cached on the stream (every
  other block of ``2 * holes`` allocated ones), the case where sorted Python
  lists made each free-list update O(n).

It prints the median per-pair CPU time of each version and the ratio
``new / old`` with its spread (the 10th-90th percentile of the per-round
ratios). Run from the repository root::

    python benchmarks/bench_allocator_commits.py --old c980d91 [--new WORKTREE] [--rounds 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_WORKER = r"""
import json, sys, time
from accel._runtime import activate
import accel

holes = int(sys.argv[1])
size = int(sys.argv[2])
with activate("cpu") as runtime:
    device = runtime.current_index
    alloc = accel.memory.get_allocator(device)
    stream = runtime.current_stream(device)
    kept = []
    if holes:
        blocks = [alloc.malloc(4096, stream) for _ in range(2 * holes)]
        for b in blocks[::2]:
            alloc.free(b)
        kept = blocks[1::2]

    def dev():
        alloc.free(alloc.malloc(size, stream))

    def facade():
        accel.memory.allocate(size).free()

    cases = {"DeviceAllocator": dev, "memory.allocate": facade}
    for fn in cases.values():
        fn()
    for line in sys.stdin:
        number = int(line)
        out = {}
        for name, fn in cases.items():
            c0 = time.thread_time_ns()
            for _ in range(number):
                fn()
            out[name] = (time.thread_time_ns() - c0) / number / 1000
        print(json.dumps(out), flush=True)
"""


def _tree(rev: str, tmp: str) -> str:
    """A directory holding ``accel/`` as of ``rev`` (``WORKTREE``: this checkout)."""
    if rev == "WORKTREE":
        return ROOT
    dest = os.path.join(tmp, rev.replace("/", "_"))
    os.makedirs(dest)
    archive = subprocess.run(["git", "-C", ROOT, "archive", rev, "accel"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
    return dest


def _spawn(tree: str, holes: int, size: int) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=tree)
    return subprocess.Popen(
        [sys.executable, "-c", _WORKER, str(holes), str(size)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=tree,
    )


def _round(worker: subprocess.Popen[str], number: int) -> dict[str, float]:
    assert worker.stdin is not None and worker.stdout is not None
    worker.stdin.write(f"{number}\n")
    worker.stdin.flush()
    return json.loads(worker.stdout.readline())  # type: ignore[no-any-return]


def compare(old: str, new: str, holes: int, size: int, rounds: int, number: int) -> dict[str, tuple[float, float, float, float, float]]:
    """Per case: (old µs, new µs, new/old median ratio, 10th and 90th percentile of the ratio)."""
    with tempfile.TemporaryDirectory() as tmp:
        workers = {rev: _spawn(_tree(rev, tmp), holes, size) for rev in (old, new)}
        try:
            samples: dict[str, list[dict[str, float]]] = {old: [], new: []}
            for r in range(rounds):
                order = (old, new) if r % 2 == 0 else (new, old)
                for rev in order:
                    samples[rev].append(_round(workers[rev], number))
        finally:
            for w in workers.values():
                assert w.stdin is not None
                w.stdin.close()
                w.wait()
    out = {}
    for case in samples[old][0]:
        a = [s[case] for s in samples[old]]
        b = [s[case] for s in samples[new]]
        ratios = sorted(y / x for x, y in zip(a, b))
        lo, hi = ratios[len(ratios) // 10], ratios[-1 - len(ratios) // 10]
        out[case] = (statistics.median(a), statistics.median(b), statistics.median(ratios), lo, hi)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="git revision of the baseline")
    parser.add_argument("--new", default="WORKTREE", help="git revision to compare (default: the working tree)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--number", type=int, default=5000, help="pairs per round")
    parser.add_argument("--size", type=int, default=4096)
    args = parser.parse_args(argv)
    print(f"cached allocate+free pair of {args.size} bytes, µs of CPU per pair (median of {args.rounds} "
          f"interleaved rounds of {args.number}); ratio new/old with its 10th-90th percentile")
    for holes in (0, 10, 100_000):
        for case, (a, b, ratio, lo, hi) in compare(args.old, args.new, holes, args.size, args.rounds, args.number).items():
            print(f"{case:>16}, {holes:>6} holes: old {a:6.2f}  new {b:6.2f}  new/old {ratio:5.2f} [{lo:.2f}-{hi:.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
