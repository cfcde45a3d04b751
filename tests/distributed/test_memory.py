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


def test_exchange_in_a_group_without_this_rank_says_so(misuse_ranks: list[dict[str, Any]]) -> None:
    first, second = misuse_ranks
    assert first["not_member_exchange"] == ["ok", 1] and first["not_member_pool"] == ["ok", "MemPool"]
    # It said "group=-100 is not a torch.distributed ProcessGroup" (torch's non-member marker).
    for key in ("not_member_exchange", "not_member_pool"):
        assert second[key][1] == "InvalidValueError", second[key]
        assert "not a member" in second[key][2] and "-100" not in second[key][2], second[key]


def test_a_destroyed_group_is_refused_naming_the_destroy(misuse_ranks: list[dict[str, Any]]) -> None:
    # exchange_buffers raised torch's bare ValueError; comm_pool returned a pool for it.
    for r in misuse_ranks:
        for key in ("destroyed_exchange", "destroyed_pool"):
            assert r[key][1] == "InvalidValueError" and "destroy_process_group" in r[key][2], r[key]


def test_exchange_waits_for_the_writes_queued_on_each_buffers_stream(misuse_ranks: list[dict[str, Any]]) -> None:
    # The peer's fill was queued before the exchange: it read zeros before the fix.
    for rank, r in enumerate(misuse_ranks):
        assert r["exchange_reads_queued_writes"] == f"{0x70 + 1 - rank:02x}"


def test_exchange_in_a_child_forked_after_init_fails_at_once(misuse_ranks: list[dict[str, Any]]) -> None:
    # It took the fork error for a failed export and entered the inherited group's gather: a hang.
    child = misuse_ranks[0]["fork_child_exchange"]
    assert child != "hung"
    assert child[1] == "AccelError" and "forked" in child[2], child
