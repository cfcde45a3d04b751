"""Ranks of a torch.distributed (Gloo) group on this machine, for tests/distributed.

``run_ranks(scenario)`` starts ``world`` fresh interpreters (``python -m
tests.distributed.ranks SCENARIO RANK WORLD STORE``), each its own session,
under one timeout; they meet through a ``FileStore`` in a temporary directory,
with a bounded process-group timeout. Each rank runs ``scenario_<name>`` and
prints one JSON line of what it saw. Starting ranks costs seconds (torch,
Gloo), so one scenario holds many checks, each under its own key.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
#: The process group's timeout: what bounds a collective whose peer never answers.
PG_TIMEOUT_S = 20
#: The timeout of the group the kill scenario's stalled collective runs in.
STALL_TIMEOUT_S = 3
N = 1024  # int32 elements of the tensors the collectives reduce


def run_ranks(
    scenario: str, world: int = 2, timeout: float = 120, dies: frozenset[int] = frozenset()
) -> list[dict[str, Any] | None]:
    """Run ``scenario`` on ``world`` ranks; each rank's JSON result (None for the ranks in
    ``dies``, which must die). A rank still running after ``timeout`` seconds, or one that
    fails or dies unexpectedly, fails the test with every rank's output."""
    import pytest

    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "ACCEL_BACKEND": "cpu", "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo"}
        procs = [
            subprocess.Popen(
                [sys.executable, "-X", "faulthandler", "-m", "tests.distributed.ranks", scenario, str(rank),
                 str(world), str(Path(tmp) / "store")],
                cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                start_new_session=True,
            )
            for rank in range(world)
        ]
        deadline = time.monotonic() + timeout
        outputs: list[tuple[str, str]] = []
        hung = False
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 0.1)))
            except subprocess.TimeoutExpired:
                hung = True
                for other in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(other.pid, signal.SIGKILL)
                outputs.append(proc.communicate())
        report = "\n".join(
            f"--- rank {rank}: exit {proc.returncode}\n{out[-3000:]}\n{err[-3000:]}"
            for rank, (proc, (out, err)) in enumerate(zip(procs, outputs))
        )
        if hung:
            pytest.fail(f"{scenario}: no result within {timeout} s (a hang)\n{report}")
    results: list[dict[str, Any] | None] = []
    for rank, (proc, (out, err)) in enumerate(zip(procs, outputs)):
        lines = out.strip().splitlines()
        finished = proc.returncode == 0 and bool(lines)
        if finished == (rank in dies):
            pytest.fail(f"{scenario}: rank {rank} {'finished' if finished else 'failed'}\n{report}")
        results.append(json.loads(lines[-1]) if finished else None)
    return results


# -- helpers the scenarios share ---------------------------------------------------


def outcome(fn: Callable[[], object]) -> list[Any]:
    """``["ok", value]``, or ``[module, error type, message, cause type]`` of what ``fn`` raised."""
    try:
        return ["ok", fn()]
    except Exception as exc:  # noqa: BLE001 - reported to the test
        cause = type(exc.__cause__).__name__ if exc.__cause__ is not None else None
        return [type(exc).__module__, type(exc).__name__, str(exc), cause]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def until(check: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


@contextlib.contextmanager
def held(stream: Any) -> Iterator[threading.Event]:
    """Hold ``stream`` back (a host function waiting on a gate) inside the block; open the gate after."""
    gate = threading.Event()
    stream.launch_host_func(lambda: gate.wait(60))
    try:
        yield gate
    finally:
        gate.set()


# -- scenarios ---------------------------------------------------------------------


def scenario_main(rank: int, world: int, store: Any) -> dict[str, Any]:
    """Every point of accel.distributed on live ranks, in one start."""
    import torch
    import torch.distributed as dist

    import accel
    import accel.distributed
    from accel.backends._sharing import broker

    out: dict[str, Any] = {}
    fill = rank + 1  # each rank's byte: the sum over two ranks is 0x03030303 per int32
    nbytes = N * 4
    s = accel.Stream()

    # A collective called directly does not wait for the stream's fill (the measured gap).
    t = accel.empty(N, dtype="int32", stream=s)
    t.zero_()
    with held(s):
        s.fill(t.data_ptr(), fill, nbytes)
        dist.all_reduce(t)
        out["direct"] = int(t[0])
    s.synchronize()
    # collective() runs it after the fill, and what is queued after it sees its result.
    t.zero_()
    after = accel.empty(N, dtype="int32", stream=s)
    with held(s):
        s.fill(t.data_ptr(), fill, nbytes)
        done = accel.distributed.collective(dist.all_reduce, t, stream=s)
        s.copy(after.data_ptr(), t.data_ptr(), nbytes)
        out["pending_while_held"] = not done.query()
    s.synchronize()
    out["ordered"] = [int(t[0]), int(t[-1]), int(after[0])]
    out["event_done"] = done.query()

    # A failing call reaches the user at synchronize, on a created and on the default stream.
    accel.distributed.collective(dist.all_reduce, "not a tensor", stream=s)
    out["error_created"] = outcome(s.synchronize)
    accel.distributed.collective(dist.all_reduce, "not a tensor")
    out["error_default"] = outcome(accel.current_stream().synchronize)
    out["bad_fn"] = outcome(lambda: accel.distributed.collective("all_reduce", t))

    # wait(): the stream waits for a Work; rank 1 joins only after rank 0 saw the stream blocked.
    w = accel.empty(N, dtype="int32").fill_(fill)
    seen = accel.empty(N, dtype="int32").zero_()
    if rank == 0:
        work = dist.all_reduce(w, async_op=True)
        accel.distributed.wait(work, stream=s)
        s.copy(seen.data_ptr(), w.data_ptr(), nbytes)
        out["blocked_on_work"] = not s.query()
        store.set("accel-test/joined", "go")
    else:
        store.wait(["accel-test/joined"])
        dist.all_reduce(w)
    s.synchronize()
    out["waited"] = int(seen[0]) if rank == 0 else None
    out["wait_not_work"] = outcome(lambda: accel.distributed.wait(t))

    # comm_pool: a pool the collectives' buffers come from.
    pool = accel.distributed.comm_pool()
    with accel.memory.use_mem_pool(pool):
        grads = accel.empty(N, dtype="int32", stream=s)
    grads.fill_(fill)
    accel.distributed.collective(dist.all_reduce, grads, stream=s)
    s.synchronize()
    out["pool"] = [type(pool).__name__, pool.memory_stats()["allocation.all.current"], int(grads[0])]
    out["pool_bad_group"] = outcome(lambda: accel.distributed.comm_pool(group="world"))
    del grads, pool

    # all_gather_object of a buffer: this rank's entry is the buffer itself.
    baseline_allocated = accel.memory_allocated()
    own = accel.memory.allocate(4096, stream=s)
    s.fill(own, 0x10 + rank, 4096)
    s.synchronize()
    objs: list[Any] = [None] * world
    dist.all_gather_object(objs, own)
    out["gathered_own_is_original"] = objs[rank] is own
    out["gathered_peer"] = ctypes.string_at(objs[1 - rank].ptr, 2).hex()
    objs[1 - rank].free()
    del objs

    # exchange_buffers: the same memory both ways, and holds that end with the importer's free.
    peers = accel.distributed.exchange_buffers(own)
    out["exchange_own_is_original"] = peers[rank] is own
    out["exchange_types"] = [type(p).__name__ for p in peers]
    out["exchange_peer_reads"] = ctypes.string_at(peers[1 - rank].ptr, 2).hex()
    s.fill(peers[1 - rank].ptr + 100, 0x20 + rank, 1)  # into the peer's memory
    s.synchronize()
    dist.barrier()
    out["exchange_written_by_peer"] = ctypes.string_at(own.ptr + 100, 1).hex()
    # (The peer's free of its all_gather_object import may still be reaching this broker.)
    out["holds_while_opened"] = broker().stats()["holds"] if until(lambda: broker().stats()["holds"] == 1) else -1
    dist.barrier()
    peers[1 - rank].free()
    dist.barrier()
    out["holds_after_peer_freed"] = broker().stats()["holds"] if until(lambda: broker().stats()["holds"] == 0) else -1
    own.free()
    del peers
    gc.collect()
    out["allocated_after"] = accel.memory_allocated() - baseline_allocated
    out["exports_after"] = broker().stats()["exports"]

    # A rank that cannot export fails the exchange on every rank, naming it (no hang).
    bad = accel.memory.allocate(64)
    if rank == 1:
        bad.free()
    out["exchange_freed"] = outcome(lambda: accel.distributed.exchange_buffers(bad))
    bad.free()
    out["exchange_not_buffer"] = outcome(lambda: accel.distributed.exchange_buffers(t))

    # A capture on the host: collectives run once per replay, none at capture.
    x = torch.ones(4)
    g = accel.Graph()
    with accel.graph(g, stream=accel.Stream()):
        g.register_inputs(x)
        dist.all_reduce(x)  # recorded: x * 2 per replay
        accel.distributed.collective(dist.all_reduce, x)  # queued on the capturing stream: x * 2 again
        y = x + 1
    out["captured"] = [x.tolist(), y.tolist()]
    replays = []
    for _ in range(2):
        g.replay()
        accel.synchronize()
        replays.append([x.tolist(), y.tolist()])
    out["replays"] = replays
    return out


def scenario_kill(rank: int, world: int, store: Any) -> dict[str, Any]:
    """Rank 1 stalls, then dies (SIGKILL) holding rank 0's buffer: rank 0 must get errors
    within the process group's timeout, never hang, and leak nothing."""
    import torch.distributed as dist

    import accel
    import accel.distributed
    from accel.backends._sharing import broker

    out: dict[str, Any] = {}
    short = dist.new_group(timeout=datetime.timedelta(seconds=STALL_TIMEOUT_S))
    s = accel.Stream()
    gc.collect()
    fds_before = open_fds()
    own = accel.memory.allocate(1 << 20, stream=s)
    s.fill(own, 0x40 + rank, 1 << 20)
    s.synchronize()
    peers = accel.distributed.exchange_buffers(own)
    if rank == 1:
        store.wait(["accel-test/counted"], datetime.timedelta(seconds=30))
        os.kill(os.getpid(), signal.SIGKILL)
    out["holds_before"] = broker().stats()["holds"]
    out["fds_opened"] = open_fds() - fds_before
    out["peer_reads"] = ctypes.string_at(peers[1].ptr, 1).hex()
    t = accel.empty(N, dtype="int32", stream=s).fill_(1)
    # Rank 1 is alive but never joins: the group's timeout ends the wait.
    start = time.monotonic()
    accel.distributed.collective(dist.all_reduce, t, group=short, stream=s)
    out["stalled"] = outcome(s.synchronize)
    out["stalled_s"] = time.monotonic() - start
    store.set("accel-test/counted", "1")
    # Rank 1 is dead: a collective and a wait fail at once.
    start = time.monotonic()
    accel.distributed.collective(dist.all_reduce, t, stream=s)
    out["collective"] = outcome(s.synchronize)
    work = outcome(lambda: dist.all_reduce(t, async_op=True))
    if work[0] == "ok":
        accel.distributed.wait(work[1], stream=s)
        work = outcome(s.synchronize)
    out["wait"] = work
    out["dead_s"] = time.monotonic() - start
    out["holds_after"] = broker().stats()["holds"] if until(lambda: broker().stats()["holds"] == 0) else -1
    peers[1].free()
    own.free()
    del peers, t
    gc.collect()
    accel.empty_cache()  # the cached segments' descriptors are the allocator's, not leaks
    # t's last reference may still be dropping on the thread that ran the failed
    # collective (a loaded CI machine saw 4096 bytes, t's, at the first look): wait for
    # it, boundedly; a leak still fails.
    until(lambda: gc.collect() >= 0 and accel.memory_allocated() == 0)
    out["allocated_after"] = accel.memory_allocated()
    out["broker_after"] = broker().stats()
    dist.destroy_process_group()
    gc.collect()
    out["fds_leaked"] = max(0, open_fds() - fds_before)
    return out


def scenario_misuse(rank: int, world: int, store: Any) -> dict[str, Any]:
    """exchange_buffers misused: a group this rank is not in, a buffer whose writes are still
    queued, and a child forked after init (which must fail at once, never enter a collective)."""
    import select

    import torch.distributed as dist

    import accel
    import accel.distributed

    out: dict[str, Any] = {}
    only_first = dist.new_group([0])  # every rank creates it; rank 1 is not a member
    own = accel.memory.allocate(4096)
    out["not_member_exchange"] = outcome(lambda: len(accel.distributed.exchange_buffers(own, group=only_first)))
    out["not_member_pool"] = outcome(lambda: type(accel.distributed.comm_pool(group=only_first)).__name__)
    destroyed = dist.new_group()
    dist.destroy_process_group(destroyed)
    out["destroyed_exchange"] = outcome(lambda: accel.distributed.exchange_buffers(own, group=destroyed))
    out["destroyed_pool"] = outcome(lambda: type(accel.distributed.comm_pool(group=destroyed)).__name__)
    dist.barrier()

    # Each rank's fill waits (on its stream) until the peer has read its buffer, or 3 s:
    # an exchange that does not wait for the exporter's queued writes hands out zeros.
    s = accel.Stream()
    pending = accel.memory.allocate(4096, stream=s)
    s.fill(pending, 0, 4096)
    s.launch_host_func(lambda: until(lambda: store.check([f"accel-test/read-{rank}"]), timeout=3))
    s.fill(pending, 0x70 + rank, 4096)
    peers = accel.distributed.exchange_buffers(pending)
    out["exchange_reads_queued_writes"] = ctypes.string_at(peers[1 - rank].ptr, 1).hex()
    store.set(f"accel-test/read-{1 - rank}", "1")
    s.synchronize()
    dist.barrier()
    peers[1 - rank].free()
    del peers
    dist.barrier()

    # A child forked after init: exchange_buffers must refuse at once; entering the
    # inherited group's collective would hang the child (Gloo's threads did not survive).
    if rank == 0:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            os.write(write, json.dumps(outcome(lambda: accel.distributed.exchange_buffers(own))).encode())
            os._exit(0)
        os.close(write)
        ready, _, _ = select.select([read], [], [], 15)
        if ready:
            out["fork_child_exchange"] = json.loads(os.read(read, 65536) or b'"no answer"')
        else:
            out["fork_child_exchange"] = "hung"
            os.kill(pid, signal.SIGKILL)
        os.close(read)
        os.waitpid(pid, 0)
    own.free()
    return out


def main() -> None:
    scenario, rank, world, path = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    import torch.distributed as dist

    store = dist.FileStore(path, world)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S)
    )
    try:
        result = globals()[f"scenario_{scenario}"](rank, world, store)
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if dist.is_initialized():
        dist.destroy_process_group()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
