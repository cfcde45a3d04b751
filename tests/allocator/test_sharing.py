"""Buffers and events shared between processes (accel/allocator/_sharing.py, Buffer.__reduce__).

Every scenario runs in a fresh exporting interpreter with a timeout, on each
backend that can be tested here (the simulated drivers implement their IPC
calls over memfd-backed memory, so the processes really share it), and
starts its importers with multiprocessing's spawn start method.
"""

from __future__ import annotations

import ctypes
import gc
import json
import mmap
import os
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import accel
from accel.allocator import BackendResource, LimitingAdaptor, MemoryResource
from tests.conftest import CONFORMANCE_BACKENDS, backend_skip_reason
from tests.fixtures import xpu_driver
from tests.fixtures.sharing import run_exporter

REPO_ROOT = Path(__file__).resolve().parents[2]
SIZE = 1 << 20


def run_scenario(backend: str, name: str, stdin: str = "", alloc_conf: str = "") -> Any:
    env = {"ACCEL_ALLOC_CONF": alloc_conf}
    if backend == "xpu" and "expandable" in alloc_conf and not backend_skip_reason(backend):
        # Level Zero 1.15's physical-memory export, past Debian's 1.8.12 loader (see
        # tests/fixtures/xpu_driver.py); the importers inherit the environment. Only
        # where xpu can be tested at all: run_exporter skips it, with its reason, otherwise.
        newer = xpu_driver.physical_export_environment()
        if isinstance(newer, str):
            pytest.skip(newer)
        env.update(newer)
    return run_exporter(backend, "-m", "tests.allocator.sharing_scenarios", name, stdin=stdin, env=env, silent=False)


backends = pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)
# Plain segments (cuMemAlloc: legacy IPC handles) and expandable ones (virtual
# memory: chunks exported as file descriptors) share through different calls.
segments = pytest.mark.parametrize("alloc_conf", ["", "expandable_segments:True"], ids=["plain", "expandable"])


@segments
@backends
def test_a_buffer_and_an_event_cross_a_queue_as_the_same_memory_and_event(backend: str, alloc_conf: str) -> None:
    result = run_scenario(backend, "queue", alloc_conf=alloc_conf)
    assert result["is_buffer"] and result["nbytes"] == SIZE
    # The importer's copy waited for the exporter's fill, queued behind a gate
    # that opened only after the importer had queued its wait.
    assert result["seen"] == "11" * 16
    # What the importer wrote, the exporter reads: one memory, no copy.
    assert result["written"] == "written"
    assert result["after"] == "22" * 16
    assert result["exitcode"] == 0


@backends
def test_an_event_an_importer_records_orders_the_exporters_work(backend: str) -> None:
    # As in CUDA, every process that opened an interprocess event records it (the
    # host backend let only the exporter record).
    result = run_scenario(backend, "importer_records")
    assert result["recorded"] == "recorded"
    assert result["seen"] == "44" * 16, "the exporter's copy ran before the importer's fill"
    assert result["done"] and result["exitcode"] == 0


@segments
@backends
def test_killing_the_importer_mid_use_leaks_nothing_in_the_exporter(backend: str, alloc_conf: str) -> None:
    result = run_scenario(backend, "kill_importer", alloc_conf=alloc_conf)
    assert result["seen"] == "33" * 16
    assert result["held"]["holds"] == 1
    # Freed by the exporter while the importer held it: not reused, still allocated,
    # and what the exporter allocated and wrote next did not land in the importer's view.
    assert not result["reused_while_held"]
    assert result["seen_again"] == "33" * 16
    assert result["allocated_while_held"] >= SIZE
    # The importer's death ended its hold: the block went back, the export and its
    # descriptors (the connection, the duplicated memory descriptor) are gone.
    assert result["after"] == {"exports": 0, "holds": 0}
    assert result["allocated_after"] == 0
    assert result["fds_leaked"] == 0


@backends
def test_an_importer_that_frees_its_buffer_ends_its_hold(backend: str) -> None:
    result = run_scenario(backend, "importer_frees")
    assert result["holds"] == 0
    assert result["allocated_after"] == 0
    assert result["exitcode"] == 0


@backends
def test_opening_a_buffer_the_exporter_freed_is_a_clear_error(backend: str) -> None:
    result = run_scenario(backend, "freed_before_open")
    kind, message = result["result"]
    assert kind == "InvalidHandleError"
    assert "no longer exports" in message and "keep it alive" in message
    assert result["exports"] == 0


@segments
@backends
def test_opening_exports_of_an_exited_process_is_a_clear_error(backend: str, alloc_conf: str) -> None:
    pickles = run_scenario(backend, "print_pickle", alloc_conf=alloc_conf)
    result = run_scenario(backend, "open_pickles", json.dumps(pickles), alloc_conf=alloc_conf)
    for name in ("buffer", "event"):
        kind, message = result[name]
        assert kind == "InvalidHandleError", (name, message)
        assert "has exited" in message, message


@backends
def test_a_pickle_claiming_a_larger_size_than_exported_is_refused(backend: str) -> None:
    # Mapping the claimed 1 TiB over a 1 MiB export let the importer read past the
    # mapping (a segfault on the first copy, on every backend).
    result = run_scenario(backend, "forged_size")
    kind, message = result["result"]
    assert kind == "InvalidHandleError", message
    assert "exports 1.00 MiB" in message and "forged" in message
    assert result["exitcode"] == 0 and result["holds"] == 0


@backends
def test_pickling_a_buffer_and_an_event_again_reuses_their_exports(backend: str) -> None:
    # Each pickle used to export afresh, duplicating descriptors that stayed open
    # until the buffer died: a Queue carrying one buffer every step ran out of them.
    result = run_scenario(backend, "repickle")
    assert result["fds_grown"] == 0
    assert result["exports"] == 2
    assert result["seen"] == "44" * 4 and result["exitcode"] == 0


@backends
def test_a_pickle_naming_an_export_of_the_other_kind_is_refused(backend: str) -> None:
    # An event opened over a buffer's export (and the reverse) used to reach the
    # backend: ValueError / struct.error on the host, DriverError on Level Zero.
    result = run_scenario(backend, "swapped_tickets")
    (buffer_kind, buffer_message), (event_kind, event_message) = result["result"]
    assert buffer_kind == event_kind == "InvalidHandleError", (buffer_message, event_message)
    assert "an export of kind 'event', not 'buffer'" in buffer_message
    assert "an export of kind 'buffer', not 'event'" in event_message
    assert result["exitcode"] == 0 and result["holds"] == 0


@backends
def test_a_description_too_short_for_its_size_is_a_clear_error(backend: str) -> None:
    # A broker answering with fewer bytes than the exported size needs raised a
    # raw struct.error from the importer's unpickling.
    result = run_scenario(backend, "short_description")
    kind, message = result["result"]
    assert kind == "InvalidHandleError", message
    assert "damaged description" in message
    assert result["exitcode"] == 0 and result["holds"] == 0


@backends
def test_a_pickle_claiming_another_device_than_the_exporters_is_refused(backend: str) -> None:
    # The importer checked the claimed device against its own devices only: an
    # export of device 0 edited to say device 1 was mapped as device 1's memory.
    result = run_scenario(backend, "forged_device")
    for kind, message in result["result"]:
        assert kind == "InvalidHandleError", message
        assert f"exports it from {backend}:0:" in message and f"not {backend}:1:" in message, message
        assert "forged" in message
    assert result["exitcode"] == 0 and result["holds"] == 0


@segments
@backends
def test_damaged_descriptions_of_memory_are_clear_errors(backend: str, alloc_conf: str) -> None:
    # The importer trusted the exporter's description: a broker answering with
    # a damaged one (what a forged or foreign process can send) crashed it
    # (SIGSEGV/SIGBUS reading past what it mapped: an offset past the memory,
    # a size larger than described, missing descriptors on CUDA's virtual
    # memory), gave it silent wrong data (a negative offset: the bytes before
    # the buffer), or escaped as raw ValueError/TypeError/KeyError/IndexError.
    result = run_scenario(backend, "forged_descriptions", alloc_conf=alloc_conf)
    for name, answer in result["results"].items():
        assert answer[0] != "no answer", f"{name}: the importer died (exit code {result['exitcode']})"
        *outcome, fds_grown = answer
        assert fds_grown == 0, (name, outcome)
        if outcome[0] == "opened":  # an edit that still describes the buffer (an unused descriptor)
            assert outcome[1] == [0x55], (name, outcome)
            continue
        assert outcome[0] == "accel._errors", (name, outcome)
        assert outcome[1] in ("InvalidHandleError", "DriverError"), (name, outcome)
    # Memory its exporter could still shrink under the importer's mapping (SIGBUS there):
    # the host backend mapped it; CUDA's legacy handle names the memory, the copies go unused.
    if backend != "cuda" or alloc_conf:
        assert result["results"]["unsealed copies"][0] != "opened", result["results"]["unsealed copies"]
    assert result["exitcode"] == 0 and result["holds"] == 0


@segments
@backends
def test_an_importer_handed_a_small_buffer_reaches_only_its_allocation(backend: str, alloc_conf: str) -> None:
    # The host backend handed over its device's one file, whole: an importer of a
    # 4 KiB buffer read the 16 MiB of other allocations made before and after.
    result = run_scenario(backend, "reach", alloc_conf=alloc_conf)
    assert result["exitcode"] == 0
    assert result["secrets"] == []
    # At most the 2 MiB segment (or chunk) the buffer lies in; CUDA's legacy handles
    # name the allocation without a descriptor.
    assert sum(result["sizes"]) <= 2 << 20, result["sizes"]
    if backend != "cuda" or alloc_conf:
        assert result["sizes"], "no descriptor handed over: the test checks nothing"


@segments
@backends
def test_an_importer_cannot_resize_what_it_was_handed(backend: str, alloc_conf: str) -> None:
    # The host backend's files (device memory, an event's page) could be cut short by
    # any importer: the exporter then died of SIGBUS writing its own buffer.
    result = run_scenario(backend, "importer_resizes", alloc_conf=alloc_conf)
    assert result["exitcode"] == 0
    assert result["seen"] == [0x22]
    assert all(outcome == "EPERM" for *_, outcome in result["outcomes"]), result["outcomes"]
    kinds = {kind for kind, *_ in result["outcomes"]}
    # CUDA's legacy IPC handles (memory from cuMemAlloc, events) carry no descriptor.
    assert kinds == {"cpu": {"buffer", "event"}, "xpu": {"buffer", "event"},
                     "cuda": {"buffer"} if alloc_conf else set()}[backend]


@backends
def test_pickling_an_opened_event_again_says_to_pickle_it_in_its_process(backend: str) -> None:
    # Each backend refused in its own misleading way: "create it with interprocess=True"
    # (host), "already destroyed or freed" (CUDA), a raw zeEventPoolGetIpcHandle
    # DriverError (Level Zero).
    result = run_scenario(backend, "opened_event_pickled_again")
    module, kind, message = result["result"]
    assert (module, kind) == ("accel._errors", "NotSupportedError"), message
    assert f"was opened from process {result['pid']}" in message and "pickle the event in the process" in message
    assert result["exitcode"] == 0


@backends
def test_damaged_descriptions_of_events_are_clear_errors(backend: str) -> None:
    # Raw ValueError/PermissionError/OSError on the host backend (a payload that is
    # not a pid, descriptors missing or not a memfd), struct.error/ValueError on Level
    # Zero; CUDA copied 64 bytes from a shorter payload (reading past its end).
    result = run_scenario(backend, "forged_event_descriptions")
    for name, answer in result["results"].items():
        assert answer[0] != "no answer", f"{name}: the importer died (exit code {result['exitcode']})"
        *outcome, fds_grown = answer
        assert fds_grown == 0, (name, outcome)
        if outcome[0] == "opened":  # CUDA's handle carries no descriptor: those sent are closed, unused
            assert backend == "cuda" and name in ("no descriptors", "a pipe", "an extra descriptor", "an unsealed copy"), name
            continue
        assert outcome[0] == "accel._errors", (name, outcome)
        assert outcome[1] in ("InvalidHandleError", "DriverError"), (name, outcome)
        if name in ("empty", "garbage", "truncated"):
            assert outcome[1] == "InvalidHandleError", (name, outcome)
            assert "damaged" in outcome[2] or "inconsistently" in outcome[2], (name, outcome)
    assert result["exitcode"] == 0


@segments
@backends
def test_a_buffer_of_hundreds_of_chunks_shares(backend: str, alloc_conf: str) -> None:
    # With expandable segments each chunk under the buffer is a descriptor, and an
    # answer carried at most 64: a 200 MiB buffer failed with a false "too many open
    # files" (simulated CUDA) and a 600 MiB one with "closed the connection" (more
    # than the kernel takes in one message).
    result = run_scenario(backend, "large_buffer", alloc_conf=alloc_conf)
    assert result["ends"] == ["11" * 16, "22" * 16] and result["exitcode"] == 0, result


@pytest.mark.skipif(os.getuid() != 0, reason="drops root's capabilities to have its descriptors in flight counted")
@backends
def test_a_large_expandable_buffer_shares_with_several_importers_under_a_low_open_file_limit(backend: str) -> None:
    # The broker queued every batch of an answer at once; the kernel counts descriptors
    # in flight against the sender's open-file limit, and the fourth importer's answer
    # failed (ETOOMANYREFS): "closed the connection without answering".
    result = run_scenario(backend, "in_flight_under_a_low_limit", alloc_conf="expandable_segments:True")
    assert result["fds"] > 128 and result["got"] == [result["fds"]] * 4, result


@backends
def test_a_buffer_of_more_chunks_than_mappings_left_is_refused_before_mapping(backend: str) -> None:
    # Every chunk is a mapping of its own, and the kernel allows vm.max_map_count per
    # process: mmap failed part way with ENOMEM, reported as memory running out.
    result = run_scenario(backend, "few_mappings_left", alloc_conf="expandable_segments:True")
    kind, message, before, after = result["result"]
    assert kind == "OutOfMemoryError" and "vm.max_map_count" in message, message
    assert after == before, "mappings or descriptors left behind"
    assert result["exitcode"] == 0


def test_an_answer_that_stalls_or_announces_gigabytes_is_refused_closing_what_came_with_it() -> None:
    # The descriptors received with the first part of an answer stayed open when
    # the rest never came (one per timeout), and an announced length was passed
    # to recv() as is: 4 GiB allocated for one answer.
    result = run_scenario("cpu", "stalled_answers")
    kind, message, fds_grown = result["huge"][1:]
    assert kind == "InvalidHandleError" and "announced a 4294967280-byte answer" in message, message
    assert fds_grown == 0
    kind, message, fds_grown = result["stall"][1:]
    assert kind == "InvalidHandleError" and "did not answer within 2 s" in message, message
    assert fds_grown == 0


@pytest.mark.parametrize("backend", ["cpu", "xpu"])
def test_a_stream_waiting_on_an_event_whose_exporter_died_is_an_error_not_a_hang(backend: str) -> None:
    # The stream raises HostFunctionError naming the exit (on Level Zero the wait was
    # a device-side one, and stream.synchronize() waited forever). CUDA is left out: simcuda ends the wait early when the exporter exits (a
    # choice of the simulator), so the stream passes without the work done.
    result = run_scenario(backend, "exporter_dies_while_a_stream_waits")
    assert result["outcome"] != ["hung"]
    module, _, message = result["outcome"]
    assert module == "accel._errors" and "exited before the work it recorded completed" in message, message


@backends
def test_a_full_descriptor_table_while_exporting_is_a_driver_error(backend: str) -> None:
    # Exporting an event (host, Level Zero) or memory (Level Zero) duplicated a
    # descriptor with os.dup and let its OSError escape.
    module, kind, message = run_scenario(backend, "fd_limit")["failure"]
    assert module == "accel._errors", message
    if backend != "cuda":  # the simulated CUDA driver fails first, creating the event's memory
        assert kind == "DriverError" and "EMFILE" in message, message


# -- who answers for an exporter that exited; fork helpers of either end -------------------


@pytest.mark.parametrize(
    "user",
    [
        pytest.param(None, id="same-user"),
        pytest.param(65534, id="nobody", marks=pytest.mark.skipif(os.geteuid() != 0, reason="needs root to setuid")),
    ],
)
@backends
def test_an_importer_refuses_a_process_that_took_the_address_of_an_exited_exporter(backend: str, user: int | None) -> None:
    # The importer never asked who answered at the address its pickle names: once the
    # exporter had exited, a process of any user could bind it and hand the importer
    # its own memory as the buffer (the importer read the squatter's 0xee bytes).
    pickles = run_scenario(backend, "print_pickle")
    result = run_scenario(backend, "squatted", json.dumps({**pickles, "user": user}))
    kind, message = result["result"]
    assert kind == "InvalidHandleError", message
    assert f"is pid {result['squatter']} of user {os.geteuid() if user is None else user}, not its exporter" in message, message
    assert "another process took its address" in message, message
    assert not result["asked"], "the importer sent the squatter the pickle's token"


@backends
def test_a_forked_helper_of_an_importer_does_not_keep_the_exporters_memory(backend: str) -> None:
    # The helper inherited the importer's hold (its connection to the broker): the
    # exporter kept the memory allocated until the helper exited.
    result = run_scenario(backend, "importer_forks_a_helper")
    assert result["seen"] == "66" * 16
    assert result["holds"] == 0 and result["allocated"] == 0, result
    assert result["exitcode"] == 0


@segments
@backends
def test_a_forked_child_of_an_exporter_leaves_the_importers_hold_to_the_exporter(backend: str, alloc_conf: str) -> None:
    # The child closes its copies of the broker's connections at the fork: that must
    # end nothing for the exporter (the importer still holds the same connection), and
    # dropping them must not run the allocator's frees inside the child's fork handler.
    result = run_scenario(backend, "exporter_forks_while_an_importer_holds", alloc_conf=alloc_conf)
    assert result["helper_status"] == 0 and result["helper_stderr"] == "", result["helper_stderr"]
    assert result["holds_after_fork"] == 1
    assert not result["reused_while_held"]
    assert result["seen"] == result["seen_again"] == "77" * 16
    assert result["after"] == {"exports": 0, "holds": 0} and result["allocated_after"] == 0
    assert result["exitcode"] == 0


@backends
def test_opening_exports_of_an_exited_process_whose_forked_helper_lives_on_fails_at_once(backend: str) -> None:
    # The helper inherited the broker's listening socket: the importer's connection
    # was accepted into its backlog and nobody answered, so unpickling waited for the
    # answer timeout (60 s) instead of saying that the exporter has exited.
    pickles = run_scenario(backend, "fork_a_helper_then_exit")
    helper = pickles.pop("helper")
    try:
        result = run_scenario(backend, "open_pickles_impatiently", json.dumps(pickles))
        links = [os.readlink(f"/proc/{helper}/fd/{fd}") for fd in os.listdir(f"/proc/{helper}/fd")]
    finally:
        os.kill(helper, 9)
    for name in ("buffer", "event"):
        kind, message = result[name]
        assert kind == "InvalidHandleError" and "has exited" in message, (name, message)
    assert not [link for link in links if link.startswith("socket:")], links


@backends
def test_a_forked_child_pickling_its_parents_buffer_is_told_it_was_forked(backend: str) -> None:
    # The child kept the parent's record of exports by lease (a pickle naming the
    # parent's broker) and, where it got further, blamed the buffer's memory
    # ("comes from BackendResource... not from the backend") for the fork.
    result = run_scenario(backend, "forked_child_pickles_again")
    kind, message, tickets, exported = result["child"]
    assert kind == "AccelError" and "before it forked" in message, message
    assert (tickets, exported) == (0, 0)
    assert result["status"] == 0


@segments
@backends
def test_programs_either_end_starts_inherit_none_of_its_descriptors(backend: str, alloc_conf: str) -> None:
    # The importer received descriptors without close-on-exec (socket.recv_fds drops
    # its flags): a program it started (close_fds=False, os.exec*) had them, for good
    # where the backend keeps one (the host backend, an opened event's page).
    result = run_scenario(backend, "programs_inherit_nothing", alloc_conf=alloc_conf)
    assert result["holds"] == 1 and result["exitcode"] == 0
    assert result["importer"] == [], result["importer"]
    assert result["exporter"] == [], result["exporter"]


# -- refusals in one process (the host backend) -----------------------------------------


def test_a_freed_buffer_refuses_export() -> None:
    buf = accel.memory.allocate(4096)
    buf.free()
    with pytest.raises(accel.InvalidHandleError, match="was freed"):
        pickle.dumps(buf)


def test_unpickling_in_the_exporting_process_gives_back_the_buffer() -> None:
    # It was refused ("exported by this very process"), so torch.distributed's
    # all_gather_object, which unpickles every rank's entry on every rank, failed.
    from accel.allocator._sharing import open_buffer

    buf = accel.memory.allocate(4096)
    data = pickle.dumps(buf)
    assert pickle.loads(data) is buf
    _, (ticket, name, device, uuid, nbytes) = buf.__reduce__()
    with pytest.raises(accel.InvalidHandleError, match="damaged or forged"):
        open_buffer(ticket, name, device, uuid, 2 * nbytes)  # a pickle claiming another size
    buf.free()
    with pytest.raises(accel.InvalidHandleError, match="exported by this very process: it was freed here"):
        pickle.loads(data)
    collected = pickle.dumps(accel.memory.allocate(4096))
    gc.collect()
    with pytest.raises(accel.InvalidHandleError, match="exported by this very process; use the original object"):
        pickle.loads(collected)


class _ForeignMemory(MemoryResource):
    """Memory accel's backend did not allocate (anonymous mappings of its own)."""

    def __init__(self) -> None:
        self.device = 0
        self.maps: dict[int, mmap.mmap] = {}

    def allocate(self, nbytes: int) -> int:
        memory = mmap.mmap(-1, nbytes)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(memory))
        self.maps[ptr] = memory
        return ptr

    def deallocate(self, ptr: int, nbytes: int) -> None:
        self.maps.pop(ptr)  # the mapping goes with the last view (the address read above is none)

    def memory_info(self) -> tuple[int, int]:
        return 1 << 30, 1 << 30


def test_a_buffer_of_memory_from_outside_the_backend_refuses_export_as_not_supported() -> None:
    # The backend was asked to export an address it never allocated: InvalidValueError
    # "is not memory allocated on this device (freed, or partly unmapped)".
    from accel._runtime import get_runtime

    foreign = accel.memory.MemPool("expandable_segments:False", upstream=_ForeignMemory())
    with accel.memory.use_mem_pool(foreign):
        buf = accel.memory.allocate(4096)
    with pytest.raises(accel.NotSupportedError, match=r"its memory comes from .*_ForeignMemory.* not from the cpu backend"):
        pickle.dumps(buf)
    buf.free()
    # accel's adaptors over the backend's own memory still share it.
    adapted = accel.memory.MemPool(upstream=LimitingAdaptor(BackendResource(get_runtime().backend, 0), 1 << 30))
    with accel.memory.use_mem_pool(adapted):
        with accel.memory.allocate(4096) as kept:
            assert pickle.loads(pickle.dumps(kept)) is kept


def test_an_event_must_be_interprocess_and_open_to_be_shared() -> None:
    with pytest.raises(accel.InvalidValueError, match="interprocess=True"):
        pickle.dumps(accel.Event())
    with pytest.raises(accel.NotSupportedError, match="cannot measure time"):
        accel.Event(interprocess=True, enable_timing=True).record()
    event = accel.Event(interprocess=True)
    event.close()
    with pytest.raises(accel.InvalidHandleError, match="was closed"):
        pickle.dumps(event)


def test_level_zero_through_debians_loader_refuses_to_share_virtual_memory_naming_the_call() -> None:
    # Debian's 1.8.12 loader does not export zePhysicalMemGetProperties (Level Zero 1.15).
    if backend_skip_reason("xpu"):
        pytest.skip(backend_skip_reason("xpu"))
    env = {key: value for key, value in os.environ.items() if key != "ACCEL_ZE_LOADER"}
    result = subprocess.run(
        [sys.executable, "-c", (
            "import pickle, accel\n"
            "buf = accel.memory.allocate(1 << 20)\n"
            "try:\n"
            "    pickle.dumps(buf)\n"
            "except accel.NotSupportedError as exc:\n"
            "    print(exc)\n"
        )],
        capture_output=True, text=True, cwd=REPO_ROOT, timeout=120, check=False,
        env={**env, "ACCEL_BACKEND": "xpu", "ACCEL_ALLOC_CONF": "expandable_segments:True", "PYTHONPATH": str(REPO_ROOT)},
    )
    assert result.returncode == 0, result.stderr
    message = result.stdout
    assert "cannot share Level Zero virtual memory" in message, message
    assert "zePhysicalMemGetProperties (Level Zero 1.15)" in message and "libze_loader.so.1" in message, message
    assert "ACCEL_ZE_LOADER" in message and "without expandable_segments" in message, message


def test_level_zero_virtual_memory_from_a_newer_loader_is_refused_by_an_importer_on_debians_loader() -> None:
    if backend_skip_reason("xpu"):
        pytest.skip(backend_skip_reason("xpu"))
    result = run_scenario("xpu", "importer_on_the_default_loader", alloc_conf="expandable_segments:True")
    kind, message = result["result"]
    assert kind == "NotSupportedError", message
    assert "cannot open Level Zero virtual memory of another process" in message
    assert "zePhysicalMemGetProperties" in message and "1.15" in message
    assert result["holds"] == 0 and result["exitcode"] == 0


def test_damaged_pickles_are_clear_errors() -> None:
    from accel.allocator._sharing import open_buffer
    from accel.backends._sharing import ExportTicket

    with accel.memory.allocate(4096) as buf:
        _, (ticket, name, device, uuid, nbytes) = buf.__reduce__()
        not_hex = ExportTicket(ticket.address, "\u00e9" * 32, ticket.pid, ticket.fds)
        for args in [(("x",), name, device, uuid, nbytes), (not_hex, name, device, uuid, nbytes)]:
            with pytest.raises(accel.InvalidHandleError, match="does not name an accel export"):
                open_buffer(*args)
        with pytest.raises(accel.InvalidHandleError, match="damaged"):
            open_buffer(ticket, name, device, uuid, "4096")  # type: ignore[arg-type]
        with pytest.raises(accel.DeviceError, match="does not see the exporter's device"):
            open_buffer(ticket, name, "0", uuid, nbytes)  # type: ignore[arg-type]


@pytest.mark.parametrize("address", [b"", b"\0" + b"x" * 200, b"/" + b"x" * 200], ids=["empty", "abstract-too-long", "path-too-long"])
def test_a_pickle_naming_an_address_no_socket_can_have_is_a_clear_error(address: bytes) -> None:
    # connect() refused these with a raw OSError (EINVAL, "AF_UNIX path too long").
    from accel._runtime import get_runtime
    from accel.allocator._sharing import open_buffer
    from accel.backends._sharing import ExportTicket
    from accel.stream._event import _open_event

    runtime = get_runtime()
    uuid = runtime.backend.device_properties(0).uuid
    ticket = ExportTicket(address, "ab" * 16, os.getpid() + 1, 1)
    with pytest.raises(accel.InvalidHandleError, match="the pickle is damaged"):
        open_buffer(ticket, runtime.name, 0, uuid, 4096)
    with pytest.raises(accel.InvalidHandleError, match="the pickle is damaged"):
        _open_event(ticket, runtime.name, 0, uuid)
