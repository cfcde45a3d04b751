"""Freeing a buffer opened from another process (accel/allocator/_sharing.py,
``_ImportedMemory``) while the importer's streams still have work queued on it: the
memory is unmapped, and the exporter's hold ended, only after that work ran, closed
streams included; a finalizer never waits, prints, or takes a stream's failures; the
interpreter's exit is silent.

Every scenario runs in a fresh exporting interpreter with a timeout (a crash fails one
test), on each backend, with its importer started by multiprocessing's spawn method;
the importer writes to the exporter's stderr, which must stay empty.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.conftest import CONFORMANCE_BACKENDS
from tests.fixtures.sharing import run_exporter

backends = pytest.mark.parametrize("backend", CONFORMANCE_BACKENDS)


def run_scenario(backend: str, name: str) -> Any:
    """The scenario's JSON line; its stderr (the importer's too) must be empty."""
    return run_exporter(backend, "-X", "faulthandler", "-m", "tests.allocator.sharing_lifetime_scenarios", name)


@backends
def test_freeing_waits_for_the_work_of_closed_streams_before_unmapping(backend: str) -> None:
    # The free synchronized only the streams still open: it unmapped the memory while a
    # closed stream's fill was still queued, and the importer died of SIGSEGV when the
    # fill ran (explicit free and garbage collection alike).
    result = run_scenario(backend, "free_behind_closed_streams")
    assert result["exitcode"] == 0 and result["reply"] == "done", result
    assert result["seen"] == [[0x11], [0x22]], "the fills landed in the shared memory"
    assert result["holds"] == 0


@backends
def test_freeing_while_a_stream_it_was_used_on_captures_waits_for_that_streams_work(backend: str) -> None:
    # The free synchronized the capturing stream: the capture refused it, the error
    # escaped free() and the hold ended with the memory still mapped and the stream's
    # fill still queued.
    result = run_scenario(backend, "free_while_capturing")
    assert result["exitcode"] == 0 and result["reply"] == "done", result
    assert result["seen"] == [0x55]
    assert result["holds"] == 0


@backends
def test_a_collected_buffer_leaves_a_pending_failure_to_its_stream_and_still_unmaps(backend: str) -> None:
    # The finalizer synchronized the stream: the host function's HostFunctionError was
    # printed as "Exception ignored in Buffer.__del__", lost to the stream's next
    # synchronize, and the memory stayed mapped and held.
    result = run_scenario(backend, "collect_with_a_failure_pending")
    assert result["collected"] == "collected" and result["exitcode"] == 0, result
    assert result["holds"] == 0, "the hold ended while the importer lives"
    assert result["mapped"] == 0, "the importer unmapped the memory"
    assert result["raised"] == ["ValueError", "from the host function"]
    assert result["seen"] == [0x33], "the fill behind the failure ran before the unmap"


@backends
def test_exiting_with_an_imported_buffer_alive_on_a_created_stream_is_silent(backend: str) -> None:
    # "Exception ignored in Buffer.__del__ ... not a live stream": the stream was
    # destroyed at exit before the buffer's finalizer synchronized it.
    result = run_scenario(backend, "exit_holding")
    assert result["reply"] == "holding" and result["exitcode"] == 0, result
    assert result["holds"] == 0, "the importer's exit ended its hold"
    assert result["seen"] == [0x44]


@backends
def test_a_collected_buffer_whose_stream_never_finishes_keeps_no_other_buffer_held(backend: str) -> None:
    # The unmapping thread waited for one buffer at a time: a buffer behind a stream
    # that never finished kept every buffer collected after it mapped and held.
    result = run_scenario(backend, "one_slow_unmap")
    assert result["while_one_waits"] == 1, "the second buffer's hold lasted as long as the first's"
    assert result["reply"] == "done" and result["exitcode"] == 0
    assert result["holds"] == 0 and result["seen"] == [[0x55], [0x55]]
