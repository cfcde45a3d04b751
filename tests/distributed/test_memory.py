"""accel.distributed.comm_pool and exchange_buffers (accel/distributed/_memory.py) on live Gloo
ranks, and a rank killed while it holds another's memory."""

from __future__ import annotations

from typing import Any


def test_comm_pool_on_the_host_is_a_pool_the_collectives_buffers_come_from(main_ranks: list[dict[str, Any]]) -> None:
    for r in main_ranks:
        assert r["pool"] == ["MemPool", 1, 3]
        assert r["pool_bad_group"][1] == "InvalidValueError" and "ProcessGroup" in r["pool_bad_group"][2]


def test_all_gather_object_of_a_buffer_gives_each_rank_its_own_buffer_back(main_ranks: list[dict[str, Any]]) -> None:
    # Unpickling its own entry raised "exported by this very process" on every rank.
    for rank, r in enumerate(main_ranks):
        assert r["gathered_own_is_original"]
        assert r["gathered_peer"] == f"{0x10 + 1 - rank:02x}" * 2


def test_exchange_buffers_maps_each_ranks_memory_both_ways(main_ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(main_ranks):
        assert r["exchange_own_is_original"]
        assert r["exchange_types"] == ["Buffer", "Buffer"]
        assert r["exchange_peer_reads"] == f"{0x10 + 1 - rank:02x}" * 2
        assert r["exchange_written_by_peer"] == f"{0x20 + 1 - rank:02x}"  # the peer wrote into this rank's buffer
        # The peer's import held this rank's memory until the peer freed it; then nothing is left.
        assert r["holds_while_opened"] == 1
        assert r["holds_after_peer_freed"] == 0
        assert r["allocated_after"] == 0 and r["exports_after"] == 0


def test_a_rank_that_cannot_export_fails_the_exchange_on_every_rank(main_ranks: list[dict[str, Any]]) -> None:
    first, second = main_ranks
    assert second["exchange_freed"][1] == "InvalidHandleError" and "was freed" in second["exchange_freed"][2]
    assert first["exchange_freed"][1] == "InvalidHandleError"
    assert "rank 1 could not export its buffer" in first["exchange_freed"][2]
    for r in main_ranks:
        assert r["exchange_not_buffer"][1] == "InvalidValueError"


def test_a_killed_rank_leaks_nothing_in_the_survivor(kill_ranks: dict[str, Any]) -> None:
    r = kill_ranks
    assert r["holds_before"] == 1 and r["fds_opened"] > 0 and r["peer_reads"] == "41"
    # The kernel closed the dead rank's connection: its hold ended; once the survivor
    # freed its buffers, no allocation, export, hold or descriptor is left.
    assert r["holds_after"] == 0
    assert r["allocated_after"] == 0
    assert r["broker_after"] == {"exports": 0, "holds": 0}
    assert r["fds_leaked"] == 0
