"""The broker that carries exports to other processes (accel/backends/_sharing.py).

Vendor-neutral: a payload and file descriptors go to an importing process
over a Unix socket, and the importer's connection is its hold on what the
export keeps alive. The importers here are fresh interpreters with timeouts.
"""

from __future__ import annotations

import gc
import os
import pickle
import subprocess
import sys
import time
from pathlib import Path

import pytest

import accel
from accel.backends._sharing import ExportTicket, broker, open_export

REPO_ROOT = Path(__file__).resolve().parents[2]

IMPORTER = """
import os, pickle, sys
from accel.backends._sharing import open_export
ticket = pickle.loads(bytes.fromhex(sys.argv[1]))
try:
    payload, fds, held = open_export(ticket, "test", "here", "the test's export")
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
    sys.exit(0)
print(payload.decode(), os.read(fds[0], 100).decode(), flush=True)
sys.stdin.readline()  # holds until told to go (or killed)
held.release()
print("released", flush=True)
sys.stdin.readline()
"""


class Kept:
    """What an export keeps alive (weakly referenced by the broker until an importer holds it)."""


def start_importer(ticket: ExportTicket) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", IMPORTER, pickle.dumps(ticket).hex()],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )


def wait_for(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def offer_pipe(kept: Kept, text: bytes) -> ExportTicket:
    import weakref

    read, write = os.pipe()
    os.write(write, text)
    os.close(write)
    return broker().offer("test", "here", b"payload", [read], weakref.ref(kept), hold=True)


def test_an_importer_receives_payload_and_descriptors_and_holds_until_it_releases() -> None:
    kept = Kept()
    ticket = offer_pipe(kept, b"through-the-socket")
    importer = start_importer(ticket)
    try:
        assert importer.stdout is not None and importer.stdin is not None
        assert importer.stdout.readline().split() == ["payload", "through-the-socket"]
        assert broker().stats()["holds"] == 1
        importer.stdin.write("\n")
        importer.stdin.flush()
        assert importer.stdout.readline().strip() == "released"
        assert wait_for(lambda: broker().stats()["holds"] == 0)
    finally:
        importer.kill()
        importer.wait(30)
    del kept
    gc.collect()
    assert broker().stats()["exports"] == 0  # its target died: forgotten, descriptor closed


def test_a_killed_importer_releases_its_hold() -> None:
    kept = Kept()
    importer = start_importer(offer_pipe(kept, b"x"))
    try:
        assert importer.stdout is not None
        importer.stdout.readline()
        assert broker().stats()["holds"] == 1
    finally:
        importer.kill()
        importer.wait(30)
    assert wait_for(lambda: broker().stats()["holds"] == 0)


def test_an_export_whose_target_is_gone_is_refused_with_the_rule() -> None:
    kept = Kept()
    ticket = offer_pipe(kept, b"x")
    del kept
    gc.collect()
    importer = start_importer(ticket)
    out, _ = importer.communicate("\n\n", timeout=60)
    assert out.startswith("InvalidHandleError") and "no longer exports" in out


def test_an_exited_exporter_and_the_exporting_process_itself_are_refused() -> None:
    gone = ExportTicket(b"\0accel-ipc-no-such-broker", "0" * 32, 999_999_999)
    with pytest.raises(accel.InvalidHandleError, match="has exited"):
        open_export(gone, "test", "here", "an export")
    here = ExportTicket(broker().address, "0" * 32, os.getpid())
    with pytest.raises(accel.InvalidHandleError, match="this very process"):
        open_export(here, "test", "here", "an export")


def test_an_importer_that_sends_nothing_does_not_stall_the_others(monkeypatch: pytest.MonkeyPatch) -> None:
    import socket

    from accel.backends import _sharing

    # The broker used to read each token with a blocking receive (this timeout),
    # so one silent connection stalled every importer behind it.
    monkeypatch.setattr(_sharing, "_ANSWER_TIMEOUT_S", 600.0)
    kept = Kept()
    ticket = offer_pipe(kept, b"x")
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(ticket.address)  # and sends nothing
    importer = start_importer(ticket)
    try:
        out, _ = importer.communicate("\n\n", timeout=45)
        assert out.split()[:2] == ["payload", "x"]
    finally:
        silent.close()
        importer.kill()
        importer.wait(30)


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_another_user_is_turned_away_without_sending_anything() -> None:
    # It used to be answered only after sending a token: other users could pile
    # up silent connections (descriptors) in the exporter.
    address = offer_pipe(Kept(), b"x").address
    code = (
        "import os, socket, sys\n"
        "os.setuid(65534)\n"
        "s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)\n"
        "s.settimeout(30)\n"
        "s.connect(bytes.fromhex(sys.argv[1]))\n"
        "print(s.recv(200)[5:].decode())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, address.hex()], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.stdout.strip() == "only processes of the same user may open accel exports", result.stderr



FULL_TABLE_IMPORTER = """
import os, pickle, resource, sys
import accel
from accel.backends._sharing import open_export
ticket = pickle.loads(bytes.fromhex(sys.argv[1]))
count = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (count, count))  # room for the socket only
try:
    open_export(ticket, "test", "here", "the test's export")
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_an_importer_with_a_full_descriptor_table_gets_a_clear_error() -> None:
    # The kernel dropped the descriptors (MSG_CTRUNC) and the importer went on
    # without them: ValueError or a misleading driver error in the backend.
    kept = Kept()
    ticket = offer_pipe(kept, b"x")
    result = subprocess.run(
        [sys.executable, "-c", FULL_TABLE_IMPORTER, pickle.dumps(ticket).hex()], capture_output=True, text=True,
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=60, check=False,
    )
    assert result.stdout.startswith("InvalidHandleError") and "too many open files" in result.stdout, (
        result.stdout + result.stderr
    )
    assert wait_for(lambda: broker().stats()["holds"] == 0)
