"""The broker that carries exports to other processes (accel/backends/_sharing.py).

Vendor-neutral: a payload and file descriptors go to an importing process
over a Unix socket, and the importer's connection is its hold on what the
export keeps alive. The importers here are fresh interpreters with timeouts.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest

import accel
from accel.backends._sharing import _HEADER, ExportTicket, broker, open_export

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


def run_python(
    script: str, *args: str, stdin: str | None = None, timeout: float = 60, check: bool = False
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` (``args`` in its argv, ``stdin`` its input) in a fresh interpreter
    that imports this accel, under a timeout; its output captured."""
    return subprocess.run(
        [sys.executable, "-c", script, *args], input=stdin, capture_output=True, text=True,
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=timeout, check=check,
    )


def start_python(script: str, *args: str, stdin: bool = True) -> subprocess.Popen[str]:
    """Start ``script`` (``args`` in its argv) in a fresh interpreter that imports this
    accel, its stdout (and with ``stdin``, its stdin) a pipe to the test."""
    return subprocess.Popen(
        [sys.executable, "-c", script, *args], stdin=subprocess.PIPE if stdin else None, stdout=subprocess.PIPE,
        text=True, cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )


@contextlib.contextmanager
def listening(script: str, address: bytes, *args: str) -> Iterator[subprocess.Popen[str]]:
    """A broker of the test's own: ``script`` (``address`` and ``args`` in its argv) once
    it printed "listening" on ``address``; killed on leaving."""
    server = start_python(script, address.hex(), *args, stdin=False)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        yield server
    finally:
        server.kill()
        server.wait(30)


def start_importer(ticket: ExportTicket) -> subprocess.Popen[str]:
    return start_python(IMPORTER, pickle.dumps(ticket).hex())


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
    gone = ExportTicket(b"\0accel-ipc-no-such-broker", "0" * 32, 999_999_999, 0)
    with pytest.raises(accel.InvalidHandleError, match="has exited"):
        open_export(gone, "test", "here", "an export")
    here = ExportTicket(broker().address, "0" * 32, os.getpid(), 0)
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
        "print(s.recv(200)[int(sys.argv[2]):].decode())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code, address.hex(), str(_HEADER.size)], capture_output=True, text=True, timeout=60, check=False
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
    result = run_python(FULL_TABLE_IMPORTER, pickle.dumps(ticket).hex())
    assert result.stdout.startswith("InvalidHandleError") and "too many open files" in result.stdout, (
        result.stdout + result.stderr
    )
    assert wait_for(lambda: broker().stats()["holds"] == 0)


# -- who answers: an exited exporter's address taken by another process ---------------

EXITING_EXPORTER = """
import pickle, weakref
from accel.backends._sharing import broker
class Kept: pass
kept = Kept()
print(pickle.dumps(broker().offer("test", "here", b"payload", [], weakref.ref(kept), hold=True)).hex(), flush=True)
"""

SQUATTER = """
import os, socket, sys
if sys.argv[2] != "same":
    os.setuid(int(sys.argv[2]))
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.bind(bytes.fromhex(sys.argv[1]))
s.listen(1)
print("bound", flush=True)
s.settimeout(30)
conn, _ = s.accept()
conn.settimeout(30)
got = b""
try:
    while True:
        more = conn.recv(100)
        if not more:
            break
        got += more
except OSError:
    pass
print("received", got.hex(), flush=True)
"""


@pytest.mark.parametrize(
    "user",
    ["same", pytest.param("65534", marks=pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user"))],
    ids=["same-user-other-pid", "other-user"],
)
def test_an_importer_talks_only_to_the_exporter_its_pickle_names(user: str) -> None:
    # After the exporter exits its abstract name is free; the importer sent the token
    # to whoever bound it next and mapped what that process chose to send.
    made = run_python(EXITING_EXPORTER, check=True)
    ticket = pickle.loads(bytes.fromhex(made.stdout.strip()))
    squatter = subprocess.Popen(
        [sys.executable, "-c", SQUATTER, ticket.address.hex(), user], stdout=subprocess.PIPE, text=True
    )
    try:
        assert squatter.stdout is not None and squatter.stdout.readline().strip() == "bound"
        with pytest.raises(accel.InvalidHandleError, match=f"is pid {squatter.pid} .*not its exporter"):
            open_export(ticket, "test", "here", "an export")
        out, _ = squatter.communicate(timeout=60)
    finally:
        squatter.kill()
        squatter.wait(30)
    assert out.split() == ["received"], out  # not even the token


# -- fork: a child drops what it inherited and never used ------------------------------

HOLDING_EXPORTER = """
import json, pickle, sys, weakref
from accel.backends._sharing import broker
class Kept: pass
kept = Kept()
print(pickle.dumps(broker().offer("test", "here", b"payload", [], weakref.ref(kept), hold=True)).hex(), flush=True)
for _ in sys.stdin:
    print(json.dumps(broker().stats()), flush=True)
"""

FORKING_IMPORTER = """
import os, pickle, sys, time
from accel.backends._sharing import open_export
payload, fds, held = open_export(pickle.loads(bytes.fromhex(sys.argv[1])), "test", "here", "an export")
child = os.fork()
if child == 0:
    quiet = os.open(os.devnull, os.O_RDWR)
    os.dup2(quiet, 1)
    os.dup2(quiet, 2)
    time.sleep(60)  # a helper that never touches the import
    os._exit(0)
print(child, flush=True)
sys.stdin.readline()
held.release()
print("released", flush=True)
sys.stdin.readline()
"""


def test_a_forked_child_of_an_importer_does_not_keep_the_exporters_memory() -> None:
    exporter = start_python(HOLDING_EXPORTER)
    importer = None
    child = 0
    try:
        assert exporter.stdout is not None and exporter.stdin is not None
        ticket_hex = exporter.stdout.readline().strip()
        importer = start_python(FORKING_IMPORTER, ticket_hex)
        assert importer.stdout is not None and importer.stdin is not None
        child = int(importer.stdout.readline())
        importer.stdin.write("\n")
        importer.stdin.flush()
        assert importer.stdout.readline().strip() == "released"

        def holds() -> int:
            exporter.stdin.write("\n")  # type: ignore[union-attr]
            exporter.stdin.flush()  # type: ignore[union-attr]
            return int(json.loads(exporter.stdout.readline())["holds"])  # type: ignore[union-attr]

        assert wait_for(lambda: holds() == 0, timeout=20)  # while the forked child lives on
    finally:
        for process in (importer, exporter):
            if process is not None:
                process.kill()
                process.wait(30)
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)


FORKING_EXPORTER = """
import os, pickle, time, weakref
from accel.backends._sharing import broker
class Kept: pass
kept = Kept()
ticket = broker().offer("test", "here", b"payload", [], weakref.ref(kept), hold=True)
child = os.fork()
if child == 0:
    quiet = os.open(os.devnull, os.O_RDWR)
    os.dup2(quiet, 1)  # or the test would wait for this child's end of the pipe
    os.dup2(quiet, 2)
    time.sleep(60)  # a helper that lives on after the exporter
    os._exit(0)
print(pickle.dumps(ticket).hex(), child, flush=True)
"""


def test_an_exporter_that_exited_is_reported_at_once_though_its_forked_child_lives(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The child kept the listening socket open: importers connected, sent the token
    # and waited the whole answer timeout (60 s) for a broker thread that is not there.
    from accel.backends import _sharing

    monkeypatch.setattr(_sharing, "_ANSWER_TIMEOUT_S", 30.0)
    made = run_python(FORKING_EXPORTER, check=True)
    ticket_hex, child = made.stdout.split()
    try:
        with pytest.raises(accel.InvalidHandleError, match="has exited"):
            open_export(pickle.loads(bytes.fromhex(ticket_hex)), "test", "here", "an export")
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(child), signal.SIGKILL)


# -- exec: nothing of the sharing crosses it --------------------------------------------

EXECING_IMPORTER = """
import os, pickle, subprocess, sys
from accel.backends._sharing import open_export
payload, fds, held = open_export(pickle.loads(bytes.fromhex(sys.argv[1])), "test", "here", "an export")
ours = [*fds, held._sock.fileno()]
print([os.get_inheritable(fd) for fd in ours], flush=True)
files = "import os, sys\\nfor fd in map(int, sys.argv[1:]):\\n    try: print(fd, os.fstat(fd).st_ino)\\n    except OSError: pass"
child = subprocess.run([sys.executable, "-c", files, *map(str, ours)], close_fds=False, capture_output=True, text=True)
mine = {f"{fd} {os.fstat(fd).st_ino}" for fd in ours}
print(sorted(mine & set(child.stdout.splitlines())), flush=True)
"""


def test_received_descriptors_and_the_hold_do_not_cross_exec() -> None:
    # Descriptors received over SCM_RIGHTS were inheritable: a subprocess started with
    # close_fds=False (or after os.exec) kept the exporter's memory and its hold.
    kept = Kept()
    ticket = offer_pipe(kept, b"x")
    result = run_python(EXECING_IMPORTER, pickle.dumps(ticket).hex())
    assert result.stdout.splitlines() == ["[False, False]", "[]"], result.stdout + result.stderr


def test_an_answer_of_hundreds_of_descriptors_arrives_whole() -> None:
    # One message carried at most 64 descriptors (the kernel takes 253 at most).
    kept = Kept()
    pipes = [os.pipe() for _ in range(300)]
    for read, write in pipes:
        os.write(write, b"y")
        os.close(write)
    ticket = broker().offer("test", "here", b"payload", [read for read, _ in pipes], weakref.ref(kept), hold=False)
    code = (
        "import os, pickle, sys\n"
        "from accel.backends._sharing import open_export\n"
        "payload, fds, held = open_export(pickle.loads(bytes.fromhex(sys.argv[1])), 'test', 'here', 'it')\n"
        "print(payload.decode(), len(fds), b''.join(os.read(fd, 1) for fd in fds).decode().count('y'))\n"
    )
    result = run_python(code, pickle.dumps(ticket).hex())
    assert result.stdout.split() == ["payload", "300", "300"], result.stdout + result.stderr


# -- SIGPIPE: a peer that hangs up must not kill the process that writes to it ----------

HUNG_UP_ON = """
import os, signal, socket, time, weakref
from accel.backends._sharing import broker
signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # as command-line tools piping into `head` do
class Kept: pass
kept = Kept()
address = broker().offer("test", "here", b"payload", [], weakref.ref(kept), hold=True).address
child = os.fork()
if child == 0:
    os.setuid(65534)
    for _ in range(20):  # connect and hang up before the broker's refusal arrives
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(address)
        s.close()
    os._exit(0)
os.waitpid(child, 0)
time.sleep(0.5)
print("alive", broker().stats()["exports"], flush=True)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to connect as another user")
def test_another_user_who_hangs_up_does_not_kill_the_exporter() -> None:
    # The broker wrote its refusal without MSG_NOSIGNAL: another user that connects and
    # closes at once killed an exporter whose SIGPIPE is the default (exit 141).
    result = run_python(HUNG_UP_ON)
    assert result.returncode == 0 and result.stdout.split() == ["alive", "1"], (result.returncode, result.stderr)


LONG_ANSWER_IMPORTER = """
import pickle, sys
from accel.backends import _sharing
_sharing._ANSWER_TIMEOUT_S = 20.0
ticket = pickle.loads(bytes.fromhex(sys.stdin.read()))
try:
    payload, fds, held = _sharing.open_export(ticket, "test", "here", "the test's export")
    print("payload", len(payload), set(payload), flush=True)
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
"""


def test_an_answer_longer_than_the_sockets_buffer_arrives_whole() -> None:
    # send_fds sends what fits in the socket's buffer (about 200 KiB) and the broker
    # dropped the rest: the importer waited the whole answer timeout, then blamed a
    # stopped exporter. (A buffer of thousands of chunks is described at that length.)
    kept = Kept()
    ticket = broker().offer("test", "here", b"x" * 900_000, [], lambda: kept, hold=True)
    result = run_python(LONG_ANSWER_IMPORTER, stdin=pickle.dumps(ticket).hex())
    assert result.stdout.split() == ["payload", "900000", "{120}"], result.stdout + result.stderr
    assert wait_for(lambda: broker().stats()["holds"] == 0)

# -- answers whose descriptors do not match their header --------------------------------

# A broker of a test's own (see listening()): serve(answer) listens on argv[1], says
# so, and calls answer with each connection once it read the token, then keeps the
# connection open.
LISTENER = """
import os, socket, sys
from accel.backends._sharing import _HEADER, _label
body = _label("test") + _label("here")

def serve(answer):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(bytes.fromhex(sys.argv[1]))
    listener.listen(4)
    print("listening", flush=True)
    kept = []
    while True:
        conn, _ = listener.accept()
        conn.recv(32)
        answer(conn)
        kept.append(conn)
"""

# Answers every connection with a header announcing argv[2] descriptors and sends
# argv[3] of them, then sends nothing more.
LIAR = LISTENER + """
def lie(conn):
    pipes = [os.pipe() for _ in range(int(sys.argv[3]))]
    socket.send_fds(conn, [_HEADER.pack(b"K", len(body), int(sys.argv[2])) + body], [r for r, _ in pipes])

serve(lie)
"""


@pytest.mark.parametrize(
    ("announced", "sent", "expected"),
    [
        (1 << 31, 1, "announced a 10-byte answer with 2147483648 descriptors"),
        (1, 2, "sent 2 descriptors where it announced 1"),
        (2, 1, "sent 1 descriptors where it announced 2"),
        # A part of more descriptors than a batch was reported as a full table here.
        (200, 200, "sent more than 128 descriptors in one part"),
    ],
    ids=["more-than-anyone-holds", "more-than-announced", "fewer-than-announced", "more-than-a-batch"],
)
def test_an_answer_whose_descriptors_do_not_match_its_header_is_refused_leaking_none(
    monkeypatch: pytest.MonkeyPatch, announced: int, sent: int, expected: str
) -> None:
    # The header states how many descriptors follow: the importer refuses a count no
    # process could hold before receiving any, and an answer that brings more or fewer
    # than it stated, closing what did come.
    from accel.backends import _sharing

    monkeypatch.setattr(_sharing, "_ANSWER_TIMEOUT_S", 2.0)  # what waiting for a missing part costs
    address = f"\0accel-test-liar-{os.getpid()}".encode()
    with listening(LIAR, address, str(announced), str(sent)) as liar:
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(accel.InvalidHandleError, match=expected):
            open_export(ExportTicket(address, "ab" * 16, liar.pid, min(announced, 1 << 20)), "test", "here", "an export")
        assert len(os.listdir("/proc/self/fd")) == before


def test_an_export_closed_while_it_is_answered_sends_its_own_descriptors(monkeypatch: pytest.MonkeyPatch) -> None:
    # The broker looked an export up under its lock and sent its descriptors after
    # releasing it: an event closed on another thread in between had them closed
    # (_forget_dead), and the send used numbers the process had given to other files.
    import socket

    read, write = os.pipe()
    os.write(write, b"mine")
    os.close(write)
    alive: list[object] = [Kept()]
    ticket = broker().offer("test", "here", b"payload", [read], lambda: alive[0] if alive else None, hold=False)
    original = socket.send_fds
    decoys: list[int] = []

    def closed_meanwhile(conn: socket.socket, buffers: list[bytes], fds: list[int], *args: int) -> int:
        alive.clear()  # the export is closed on another thread...
        with broker()._lock:
            broker()._forget_dead()  # ...which closes its descriptors
        other, end = os.pipe()  # and the process opens other files
        os.write(end, b"else")
        os.close(end)
        decoys.append(other)
        return original(conn, buffers, fds, *args)

    monkeypatch.setattr(socket, "send_fds", closed_meanwhile)
    importer = start_importer(ticket)
    try:
        out, _ = importer.communicate("\n\n", timeout=60)
    finally:
        for fd in decoys:
            os.close(fd)
    assert out.split()[:2] == ["payload", "mine"], out


# -- descriptors in flight: the kernel counts them against the sender's open-file limit -----

# As another user (root is exempt from the count), with a soft limit of 1024: one export
# of 300 descriptors, answered to four importers that have not read yet (other processes
# of the user, slower than the broker). Each then reads its whole answer.
IN_FLIGHT = """
import os, resource, socket, sys, time
from accel.backends import _sharing
os.setuid(65534)  # after the imports: this interpreter's files may be root's only
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
class Kept: pass
kept = Kept()
pipes = [os.pipe() for _ in range(300)]
for read, write in pipes:
    os.close(write)
ticket = _sharing.broker().offer("test", "here", b"payload", [r for r, _ in pipes], lambda: kept, hold=False)
conns = []
for _ in range(4):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.settimeout(30)
    conn.connect(ticket.address)
    conn.sendall(ticket.token.encode())
    conns.append(conn)
time.sleep(1)  # the broker answers all four before any reads (it did in microseconds)
for conn in conns:
    fds = []
    try:
        _sharing._receive_answer(conn, fds, ticket, "it")
        print(len(fds), flush=True)
    except Exception as exc:
        print(type(exc).__name__, exc, flush=True)
    for fd in fds:
        os.close(fd)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to become another user (root is exempt from the count)")
def test_answers_of_many_descriptors_stay_under_the_senders_limit_in_flight() -> None:
    # The broker queued every batch of an answer at once: with several importers the
    # descriptors in flight passed the exporter's RLIMIT_NOFILE, sendmsg failed with
    # ETOOMANYREFS and the importer heard "closed the connection without answering".
    result = run_python(IN_FLIGHT, timeout=120)
    assert result.stdout.split() == ["300"] * 4, result.stdout + result.stderr


# Announces argv[2] descriptors, sends the first batch (128 pipes) with the header, then
# at once a further part: argv[3] as its tag with argv[4] pipes (it never waits for the
# importer's acknowledgement).
TAGGED_LIAR = LISTENER + """
def lie(conn):
    first = [os.pipe()[0] for _ in range(128)]
    socket.send_fds(conn, [_HEADER.pack(b"K", len(body), int(sys.argv[2])) + body], first)
    socket.send_fds(conn, [bytes.fromhex(sys.argv[3])], [os.pipe()[0] for _ in range(int(sys.argv[4]))])

serve(lie)
"""


@pytest.mark.parametrize(
    ("tag", "further"), [("46", 10), ("47", 10), ("4646", 10), ("46", 20)], ids=["F", "G", "FF", "too-many"]
)
def test_a_further_part_of_an_answer_must_be_the_protocols_leaking_none(
    monkeypatch: pytest.MonkeyPatch, tag: str, further: int
) -> None:
    # Further parts were counted, never read: any byte (or two) passed as the tag.
    from accel.backends import _sharing

    monkeypatch.setattr(_sharing, "_ANSWER_TIMEOUT_S", 10.0)
    address = f"\0accel-test-tagged-{os.getpid()}-{tag}-{further}".encode()
    with listening(TAGGED_LIAR, address, "138", tag, str(further)) as liar:
        before = len(os.listdir("/proc/self/fd"))
        ticket = ExportTicket(address, "ab" * 16, liar.pid, 138)
        if tag == "46" and further == 10:  # what a broker sends: accepted
            payload, fds, held = open_export(ticket, "test", "here", "an export")
            assert (payload, len(fds)) == (b"", 138)
            for fd in fds:
                os.close(fd)
            held.release()
        else:
            with pytest.raises(accel.InvalidHandleError, match="sent 1.. descriptors where it announced 138, or parts"):
                open_export(ticket, "test", "here", "an export")
        assert len(os.listdir("/proc/self/fd")) == before


LIMIT_IMPORTER = """
import os, pickle, resource, sys
from accel.backends import _sharing
from accel.backends._sharing import ExportTicket, open_export
_sharing._ANSWER_TIMEOUT_S = 2.0
resource.setrlimit(resource.RLIMIT_NOFILE, (256, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    open_export(ExportTicket(bytes.fromhex(sys.argv[1]), "ab" * 16, int(sys.argv[2]), int(sys.argv[3])), "test", "here", "it")
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], flush=True)
"""


@pytest.mark.parametrize(("announced", "named"), [(3000, 1), (3000, 3000)], ids=["more-than-the-pickle", "refused-later"])
def test_a_refused_answer_leaves_the_open_file_limit_as_it_was(announced: int, named: int) -> None:
    # A hostile answer announced up to 2**20 descriptors, and the importer raised its
    # soft limit to the hard one for good before refusing it.
    address = f"\0accel-test-limit-{os.getpid()}-{named}".encode()
    with listening(LIAR, address, str(announced), "1") as liar:
        result = run_python(LIMIT_IMPORTER, address.hex(), str(liar.pid), str(named))
    lines = result.stdout.splitlines()
    assert lines[0].startswith("InvalidHandleError") and lines[1:] == ["256"], result.stdout + result.stderr


# -- which uid: the effective one, on both ends ------------------------------------------

# A set-user-ID program as the kernel runs it: real uid nobody, effective uid root.
SETUID = "import os\nos.setresuid(65534, 0, 0)\n"

SETUID_EXPORTER = SETUID + """
import pickle, sys, weakref
from accel.backends._sharing import broker
class Kept: pass
kept = Kept()
read, write = os.pipe()
os.write(write, b"effective")
os.close(write)
print(pickle.dumps(broker().offer("test", "here", b"payload", [read], weakref.ref(kept), hold=True)).hex(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to run as a set-user-ID program does")
def test_both_ends_compare_effective_uids() -> None:
    # SO_PEERCRED states the peer's effective uid, and each end compared it with its own
    # real uid: a set-user-ID exporter turned its own user's importers away, and a
    # set-user-ID importer refused its own user's exporter.
    exporter = start_python(SETUID_EXPORTER)
    try:
        assert exporter.stdout is not None
        payload, fds, held = open_export(pickle.loads(bytes.fromhex(exporter.stdout.readline())), "test", "here", "it")
        assert (payload, os.read(fds[0], 100)) == (b"payload", b"effective")
        os.close(fds[0])
        held.release()
    finally:
        exporter.kill()
        exporter.wait(30)
    kept = Kept()
    importer = run_python(SETUID + IMPORTER, pickle.dumps(offer_pipe(kept, b"effective")).hex(), stdin="\n\n")
    assert importer.stdout.split()[:2] == ["payload", "effective"], importer.stdout + importer.stderr


# -- fork while the broker answers ------------------------------------------------------

# Forks (from the main thread) while the broker's thread is inside an answer: in the
# first part of it (argv[1] == "first", one descriptor) or sending a further batch
# ("further", 200 descriptors). The child reports which of what that thread had in
# hand (the connection, its copies of the export's descriptors) it still has open.
FORK_IN_ANSWER = """
import os, pickle, socket, sys, threading, weakref
from accel.backends import _sharing
class Kept: pass
kept = Kept()
pipes = [os.pipe() for _ in range(1 if sys.argv[1] == "first" else 200)]
for read, write in pipes:
    os.write(write, b"x")
    os.close(write)
ticket = _sharing.broker().offer("test", "here", b"payload", [r for r, _ in pipes], weakref.ref(kept), hold=True)
answering, forked = threading.Event(), threading.Event()
in_hand = []
calls = []
original = socket.send_fds
def paused(conn, buffers, fds, *args):
    calls.append(1)
    if len(calls) == (1 if sys.argv[1] == "first" else 2):
        in_hand.extend([conn.fileno(), *fds])
        answering.set()
        forked.wait(30)
    return original(conn, buffers, fds, *args)
socket.send_fds = paused
print(pickle.dumps(ticket).hex(), flush=True)
answering.wait(60)
r, w = os.pipe()
child = os.fork()
if child == 0:
    def is_open(fd):
        try:
            os.fstat(fd)
            return True
        except OSError:
            return False
    os.write(w, repr([fd for fd in in_hand if is_open(fd)]).encode())
    os._exit(0)
forked.set()
os.waitpid(child, 0)
print("child kept", os.read(r, 10000).decode(), flush=True)
sys.stdin.readline()
"""


@pytest.mark.parametrize("part", ["first", "further"])
def test_a_child_forked_while_the_broker_answers_keeps_nothing_of_the_answer(part: str) -> None:
    # The child closed the broker's listener, holds and exports, but not the connection
    # being answered nor the copies being sent: it kept the importer's connection (and
    # the exporter's memory) open after the exporter exited.
    exporter = start_python(FORK_IN_ANSWER, part)
    importer = None
    try:
        assert exporter.stdout is not None and exporter.stdin is not None
        importer = start_importer(pickle.loads(bytes.fromhex(exporter.stdout.readline())))
        assert importer.stdout is not None
        assert exporter.stdout.readline().strip() == "child kept []"
        assert importer.stdout.readline().split() == ["payload", "x"]  # the parent's answer went on
    finally:
        for process in (importer, exporter):
            if process is not None:
                process.kill()
                process.wait(30)


MANY_IMPORTER = """
import os, pickle, sys
from accel.backends import _sharing
_sharing._ANSWER_TIMEOUT_S = 10.0
try:
    payload, fds, held = _sharing.open_export(pickle.loads(bytes.fromhex(sys.argv[1])), "test", "here", "it")
    print(payload.decode(), len(fds), flush=True)
except Exception as exc:
    print(type(exc).__name__, exc, flush=True)
"""


def test_a_full_descriptor_table_while_sending_a_further_batch_ends_that_answer_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Duplicating a further batch failed (EMFILE) out of the broker's thread, which died:
    # every later importer waited the whole answer timeout for an answer.
    import errno

    from accel.backends import _sharing

    kept = Kept()
    pipes = [os.pipe() for _ in range(200)]
    for _, write in pipes:
        os.close(write)
    ticket = broker().offer("test", "here", b"payload", [read for read, _ in pipes], weakref.ref(kept), hold=False)
    original = _sharing._dup_all
    calls: list[int] = []

    def full_once(fds: list[int], copies: list[int]) -> list[int]:
        calls.append(len(fds))
        if len(calls) == 2:  # the first answer's second batch
            raise OSError(errno.EMFILE, "Too many open files")
        return original(fds, copies)

    monkeypatch.setattr(_sharing, "_dup_all", full_once)
    outs = [
        run_python(MANY_IMPORTER, pickle.dumps(ticket).hex()).stdout
        for _ in range(2)
    ]
    assert outs[0].startswith("InvalidHandleError") and "closed the connection" in outs[0], outs
    assert outs[1].split() == ["payload", "200"], outs


# -- hostile importers: acknowledgements the protocol has not ---------------------------


def raw_answer_part(sock, fds: list[int]) -> bytes:
    """One receive of an answer as a hand-written importer makes it (descriptors appended)."""
    import array
    import socket

    data, ancillary, _, _ = sock.recvmsg(1 << 20, socket.CMSG_LEN(256 * 4))
    for _, _, cmsg in ancillary:
        fds.extend(array.array("i", cmsg[: len(cmsg) - len(cmsg) % 4]))
    return data


def test_an_importer_that_acknowledges_ahead_gets_no_second_batch_in_flight() -> None:
    # Each acknowledgement sent a further batch, received or not: an importer that sent
    # b"AA" (or a stream of them) and read nothing had every batch in flight at once,
    # against the pacing (the kernel counts them against the exporter's RLIMIT_NOFILE,
    # and the broker blocked on a full socket buffer). The broker now ends an answer
    # acknowledged while what it sent before is unread.
    import select
    import socket

    kept = Kept()
    pipes = [os.pipe() for _ in range(300)]
    for _, write in pipes:
        os.close(write)
    # No hold: the broker closes the connection once it is done with the answer, so that
    # the test reads what it sent only then (reading earlier would be acknowledging in time).
    ticket = broker().offer("test", "here", b"payload", [read for read, _ in pipes], weakref.ref(kept), hold=False)
    received: list[int] = []
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    try:
        sock.connect(ticket.address)
        sock.sendall(ticket.token.encode())
        data = b""
        while len(data) < _HEADER.size + len(b"\x04test\x04here") + len(b"payload"):
            data += raw_answer_part(sock, received)
        assert len(received) == 128
        sock.sendall(b"AA")  # one for the batch just received, one ahead of the next
        poll = select.poll()
        poll.register(sock, select.POLLRDHUP)
        assert poll.poll(30_000), "the broker neither ended the answer nor finished it"
        parts = []
        while True:
            part = raw_answer_part(sock, received)
            if not part:
                break
            parts.append(part)
        assert parts == [b"F"] and len(received) == 256, (parts, len(received))
    finally:
        sock.close()
        for fd in received:
            os.close(fd)


def test_an_importer_that_never_reads_a_long_answer_does_not_stall_the_others(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The broker's thread sent the first part of an answer with a blocking sendall: an
    # answer longer than the socket's buffer (a buffer of thousands of chunks) to an
    # importer that sent its token and read nothing stalled every other importer for
    # the whole answer timeout (and a stream of such importers, for good).
    import socket

    from accel.backends import _sharing

    monkeypatch.setattr(_sharing, "_ANSWER_TIMEOUT_S", 600.0)
    kept = Kept()
    read, write = os.pipe()
    os.write(write, b"x")
    os.close(write)
    ticket = broker().offer("test", "here", b"p" * 900_000, [read], weakref.ref(kept), hold=True)
    silent = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    silent.connect(ticket.address)
    silent.sendall(ticket.token.encode())  # and reads nothing
    importer = start_importer(ticket)
    try:
        out, _ = importer.communicate("\n\n", timeout=45)
        assert out.split()[1:] == ["x", "released"], out[-200:]
    finally:
        silent.close()
        importer.kill()
        importer.wait(30)
    assert wait_for(lambda: broker().stats()["holds"] == 0)


# Fills its own descriptor table, has one importer connect (its connection waits in the
# queue: the broker cannot accept it), counts the broker's tries to accept meanwhile,
# then frees the table: the importer is answered.
FULL_TABLE_EXPORTER = """
import os, resource, socket, sys, threading, time, weakref
from accel.backends import _sharing
tries = [0]
accept = socket.socket.accept
def counted(self):
    tries[0] += 1
    return accept(self)
socket.socket.accept = counted
class Kept: pass
kept = Kept()
read, write = os.pipe()
os.write(write, b"x")
os.close(write)
ticket = _sharing.broker().offer("test", "here", b"payload", [read], weakref.ref(kept), hold=False)
importer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
importer.settimeout(30)
resource.setrlimit(resource.RLIMIT_NOFILE, (len(os.listdir("/proc/self/fd")) + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
fill = []
with __import__("contextlib").suppress(OSError):
    while True:
        fill.append(os.open("/dev/null", os.O_RDONLY))
importer.connect(ticket.address)
importer.sendall(ticket.token.encode())
time.sleep(1)  # the broker's thread tries to accept meanwhile
print(tries[0], flush=True)
for fd in fill:
    os.close(fd)
print(len(importer.recv(1000)) > 0, flush=True)
"""


def test_a_full_descriptor_table_does_not_spin_the_brokers_thread() -> None:
    # accept() failed (EMFILE) and the broker went back to select(), where the queued
    # connection was readable at once: tens of thousands of tries a second, a core and the
    # GIL taken from the exporter while its table was full. The broker now leaves the
    # queue alone a moment after such a failure (and answers once a descriptor is free).
    result = run_python(FULL_TABLE_EXPORTER)
    tries, answered = result.stdout.split()
    assert int(tries) < 1000 and answered == "True", result.stdout + result.stderr


# Answers every connection with a header announcing a 100-byte payload, then sends it
# one byte at a time, argv[2] seconds apart (each within the importer's timeout).
SLOW_LORIS = LISTENER + """
import time

def trickle(conn):
    conn.sendall(_HEADER.pack(b"K", 100, 0))
    for _ in range(100):
        time.sleep(float(sys.argv[2]))
        conn.sendall(b"x")

serve(trickle)
"""


def test_an_exporter_that_answers_a_byte_at_a_time_is_timed_out_as_a_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    # The timeout bounded each receive, not the answer: an exporter sending one byte a
    # little within it held the importer for as long as it liked (a 1 MiB answer: weeks).
    from accel.backends import _sharing

    monkeypatch.setattr(_sharing, "_ANSWER_TIMEOUT_S", 1.0)
    address = f"\0accel-test-loris-{os.getpid()}".encode()
    with listening(SLOW_LORIS, address, "0.2") as loris:
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(accel.InvalidHandleError, match="did not answer within 1 s"):
            open_export(ExportTicket(address, "ab" * 16, loris.pid, 0), "test", "here", "an export")
        assert len(os.listdir("/proc/self/fd")) == before


# Offers a 900 KB answer, has argv[1] importers send their token and read nothing, and
# prints how many bytes the exporter's Python heap grew by once each has its first bytes.
SLOW_READERS = """
import os, select, socket, sys, tracemalloc, weakref
from accel.backends import _sharing
class Kept: pass
kept = Kept()
read, write = os.pipe()
ticket = _sharing.broker().offer("test", "here", b"p" * 900_000, [read], weakref.ref(kept), hold=True)
tracemalloc.start()
before = tracemalloc.get_traced_memory()[0]
readers = []
for _ in range(int(sys.argv[1])):
    reader = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    reader.connect(ticket.address)
    reader.sendall(ticket.token.encode())
    readers.append(reader)
for reader in readers:
    assert select.select([reader], [], [], 30)[0]
print(tracemalloc.get_traced_memory()[0] - before, flush=True)
"""


def test_answers_waiting_for_slow_readers_share_one_copy_of_the_answer() -> None:
    # Each answer not all sent kept its own copy of the rest (up to 1 MiB): a few hundred
    # importers reading slowly, each a connection the exporter's open-file limit allows,
    # cost the exporter hundreds of MiB.
    result = run_python(SLOW_READERS, "100", timeout=120)
    assert result.stdout and int(result.stdout) < 10_000_000, result.stdout + result.stderr
