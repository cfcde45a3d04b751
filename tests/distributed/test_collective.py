"""accel.distributed.collective and wait (accel/distributed/_collective.py) on live Gloo ranks."""

from __future__ import annotations

from typing import Any

from tests.distributed.ranks import STALL_TIMEOUT_S
from tests.fixtures.scripts import ok, run

# Each rank fills its tensor with the byte rank + 1: the sum over the two ranks, per int32.
SUM = 0x01010101 + 0x02020202


def test_a_collective_called_directly_reads_what_the_stream_has_not_written_yet(main_ranks: list[dict[str, Any]]) -> None:
    # The gap accel.distributed closes: dist.all_reduce ran before the fill queued on
    # the accel stream and reduced the zeros there (then the fill landed over its result).
    assert [r["direct"] for r in main_ranks] == [0, 0]


def test_collective_runs_after_the_streams_work_and_before_its_later_work(main_ranks: list[dict[str, Any]]) -> None:
    for r in main_ranks:
        # Held behind the stream's fill, the collective had not run (its event pending).
        assert r["pending_while_held"]
        # It reduced the filled values, and the copy queued after it copied its result.
        assert r["ordered"] == [SUM, SUM, SUM]
        assert r["event_done"]


def test_an_error_of_the_collective_reaches_the_user_at_synchronize(main_ranks: list[dict[str, Any]]) -> None:
    for r in main_ranks:
        for key in ("error_created", "error_default"):  # a created stream, the default (inline) one
            module, kind, message, cause = r[key]
            assert (module, kind, cause) == ("accel._errors", "HostFunctionError", "TypeError"), r[key]
            assert "accel.distributed.collective(all_reduce)" in message and "torch.Tensor" in message
        assert r["bad_fn"][1] == "InvalidValueError" and "dist.all_reduce" in r["bad_fn"][2]


def test_a_stream_waits_for_a_work(main_ranks: list[dict[str, Any]]) -> None:
    first, _ = main_ranks
    # Rank 1 joined the all_reduce only after rank 0 saw its stream blocked on the Work;
    # the copy queued after the wait copied the reduced value.
    assert first["blocked_on_work"]
    assert first["waited"] == 3
    for r in main_ranks:
        assert r["wait_not_work"][1] == "InvalidValueError" and "async_op=True" in r["wait_not_work"][2]


def test_a_peer_that_stalls_or_dies_is_an_error_within_the_groups_timeout(kill_ranks: dict[str, Any]) -> None:
    r = kill_ranks
    # A live peer that never joins: Gloo's timeout of the group (3 s) ends the wait.
    module, kind, message, cause = r["stalled"]
    assert (kind, cause) == ("HostFunctionError", "RuntimeError"), r["stalled"]
    assert "Timed out" in message
    assert r["stalled_s"] < 5 * STALL_TIMEOUT_S  # bounded by the timeout, not a hang
    # A dead peer: the collective and a queued wait fail (Gloo sees the connection close).
    for key in ("collective", "wait"):
        module, kind, message, cause = r[key]
        assert (kind, cause) == ("HostFunctionError", "RuntimeError"), r[key]
        assert "Connection closed by peer" in message or "Connection reset" in message, message
    assert r["dead_s"] < 5 * STALL_TIMEOUT_S


# The Level Zero backend's streams are not torch's (SYCL queues): the host waits.
BLOCKING = """
import datetime, tempfile, time, torch, torch.distributed as dist, accel, accel.distributed
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=20))
s = accel.Stream()
seen = []
s.launch_host_func(lambda: (time.sleep(0.2), seen.append("earlier")))
done = accel.distributed.collective(lambda: seen.append("collective"), stream=s)
s.launch_host_func(lambda: seen.append("later"))
s.synchronize()
print(seen, done.query())
t = torch.ones(4)
work = dist.all_reduce(t, async_op=True)
accel.distributed.wait(work, stream=s)
print(work.is_completed())
try:
    accel.distributed.collective(dist.all_reduce, "not a tensor", stream=s)
except TypeError as exc:
    print("raised", type(exc).__name__)
g = accel.Graph()
try:
    with accel.graph(g, stream=accel.Stream()):
        accel.distributed.collective(dist.all_reduce, t)
except accel.CaptureError as exc:
    print(exc)
print(type(accel.distributed.comm_pool()).__name__)
dist.destroy_process_group()
print("ok")
"""


def test_on_separate_streams_the_host_waits_and_a_capture_refuses_collectives() -> None:
    result = run("xpu", BLOCKING, timeout=120)
    ok(result)
    lines = result.stdout.splitlines()
    assert lines[0] == "['earlier', 'collective', 'later'] True"
    assert lines[1] == "True"
    assert lines[2] == "raised TypeError"  # the host ran the call: its error is raised at once
    assert "cannot run a collective inside a capture" in lines[3] and "missing from every replay" in lines[3]
    assert lines[4] == "MemPool"
