"""Carrying exports to other processes: a small broker per exporting process.

A backend describes shared memory or a shared event as ``(payload, fds)``
(see :meth:`Backend.ipc_memory_export`); file descriptors cannot travel in
a pickle, so the exporting process runs a broker: a daemon thread serving a
Unix socket in the abstract namespace. An importer connects, names the
export by its token, and receives the payload with the descriptors attached
(``SCM_RIGHTS``, which any unprivileged process may use; ``pidfd_getfd``
would need ptrace rights over the exporter, which Yama's default
``ptrace_scope=1`` refuses a child that opens its parent's export).

The connection is also the importer's *hold*: while it stays open the broker
keeps a strong reference to what the export keeps alive (a buffer's lease,
so the caching allocator cannot reuse the block). Closing it releases the
hold, and so does the importer's death, because the kernel closes its
sockets: an importer killed mid-use leaks nothing in the exporter. An
exporter that has exited leaves no socket, and opening its exports fails
with :class:`~accel.InvalidHandleError`.

Both ends check who is at the other end (``SO_PEERCRED``): the broker
answers only processes of its own user, and an importer talks only to the
process its pickle names (its pid) running as its own user (the *effective*
uid on both ends: what SO_PEERCRED states, and what the kernel checks
access with), before it sends
the token or trusts an answer. An abstract socket name is free once its
exporter exits, and another user can bind it (the names are listed in
/proc/net/unix): without the importer's check, that process would be handed
the token and could hand back memory of its own choosing. An export is named
by a token from a pickle (128 random bits).

Descriptors and sockets are close-on-exec (received ones too:
``MSG_CMSG_CLOEXEC``). A forked child inherits the broker's listening socket
and connections and every hold of its parent: it closes its copies at once
(closing a copy ends nothing for the parent, which keeps the same
connection), so an exited exporter's name is not kept bound by a child that
cannot answer, and an exporter's memory is not held by a child that never
opened it. See docs/guarantees.md, "Sharing across processes".
"""

from __future__ import annotations

import array
import contextlib
import errno
import fcntl
import json
import os
import resource
import secrets
import selectors
import socket
import struct
import termios
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from accel._errors import DeviceError, DriverError, InvalidHandleError, OutOfMemoryError

if TYPE_CHECKING:
    from accel.backends.base import Backend

__all__ = [
    "ExportTicket", "Held", "broker", "check_device", "check_extent", "check_map_count", "description",
    "dup_for_export", "export_origin", "more_descriptors", "natural", "naturals", "open_export",
]

_TOKEN_BYTES = 16
# b"K" + payload length + descriptor count, or b"E" + message length + 0.
_HEADER = struct.Struct("!cII")
# Descriptors go in batches of at most this many per message (the kernel's
# SCM_MAX_FD is 253): the first with the header and payload, each further
# batch with one byte (_MORE), sent once the importer has acknowledged the
# batch before (one byte, _ACK). A buffer of expandable segments has one
# descriptor per physical chunk, so a large one needs many messages; queued
# all at once they stayed in flight together, and the kernel counts
# descriptors in flight against the sender's RLIMIT_NOFILE (ETOOMANYREFS):
# paced, an answer has at most one batch in flight.
_FDS_PER_MESSAGE = 128
_MORE = b"F"
_ACK = b"A"
# The most descriptors an answer may state: more than an importer can hold
# under any limit it can raise to (a forged answer is refused before receiving).
_MAX_FDS = 1 << 20
# The longest answer an accel broker sends is a few hundred bytes (the description
# of a buffer's chunks): a longer stated length is not an accel process.
_MAX_ANSWER = 1 << 20
# How long an importer waits for the exporter's broker to answer (it answers
# from its own thread, so only a stopped or swapped-out exporter is this slow).
_ANSWER_TIMEOUT_S = 60.0
# How soon an importer tries again to connect to a broker whose queue of connections is full.
_CONNECT_RETRY_S = 0.001
# How long the broker leaves its queue of connections alone after its process had no
# descriptor free to accept one (the queue stays readable: trying again at once spins).
_ACCEPT_RETRY_S = 0.05
# Every send: a peer that hung up is EPIPE, never SIGPIPE (a process whose SIGPIPE is
# the default, as command-line tools set it, would die of any connection closed early,
# another user's included).
_SEND = socket.MSG_NOSIGNAL


@dataclass(frozen=True)
class ExportTicket:
    """What a pickle carries to name an export: where the broker listens, the token,
    the exporter's pid and how many descriptors the export has (an importer receives
    no more, and raises no limit for more, than its pickle says)."""

    address: bytes
    token: str
    pid: int
    fds: int


class _Export:
    __slots__ = ("message", "fds", "target", "hold")

    def __init__(self, payload: bytes, fds: list[int], target: Callable[[], object | None], hold: bool) -> None:
        # The first part of every answer: the header, then the payload (the kind and origin,
        # each length-prefixed, then the backend's description). Made once: answers not
        # all sent yet refer to it, never copy it (hundreds of importers reading slowly).
        self.message = _HEADER.pack(b"K", len(payload), len(fds)) + payload
        self.fds = fds
        self.target = target  # returns what importers hold, or None once it is gone
        self.hold = hold


class _Pending:
    """An answer not all sent yet: the rest of its first part goes as the importer reads
    (never waited for: one importer that reads nothing must not stall the others), and
    each further batch once the importer acknowledges the one before, duplicated then
    (an answer waiting for its importer costs the exporter no descriptors)."""

    __slots__ = ("token", "export", "sent", "hold", "unsent")

    def __init__(self, token: str, export: _Export, sent: int, hold: bool, unsent: memoryview) -> None:
        self.token = token
        self.export = export
        self.sent = sent  # how many of the export's descriptors went
        self.hold = hold  # after the last batch: keep the connection as a hold, or close it
        self.unsent = unsent  # the first part's bytes the socket's buffer had no room for yet


class Broker:
    """The exporting side: a listening socket and the thread that serves it."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.address = b"\0accel-ipc-" + f"{self.pid}-{secrets.token_hex(8)}".encode()
        self._lock = threading.Lock()
        self._exports: dict[str, _Export] = {}
        self._holds: dict[socket.socket, object] = {}  # connection -> what it keeps alive
        # What the serving thread has in hand outside the selector and the holds (for a
        # forked child to close): connections being accepted or answered, and duplicates
        # of exports' descriptors being sent (each removed before it is closed, so that a
        # child never closes a number the parent gave to another file meanwhile).
        self._in_hand: set[socket.socket] = set()
        self._copies: list[int] = []
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        # As many waiting connections as the system allows: any user can connect (and is
        # turned away at once), and a full queue refuses everyone, importers included.
        self._listener.listen(socket.SOMAXCONN)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._listener, selectors.EVENT_READ)
        self._accept_again_at: float | None = None  # while the listener is left alone (see _accept)
        self._thread = threading.Thread(target=self._serve, name="accel-ipc-broker", daemon=True)
        self._thread.start()

    def close_in_child(self) -> None:
        """Close this process's copies of a forked parent's broker: the listening
        socket (or the parent's name stays bound after it exits, and importers wait
        for an answer that never comes), its connections (each an importer's hold)
        and the descriptors of its exports, and what the serving thread had in hand at
        the fork (a connection it was answering, the copies it was sending). No thread
        serves them here."""
        for export in self._exports.values():
            for fd in export.fds:
                _close_quietly(fd)
        self._exports.clear()
        for conn in self._holds:
            conn.close()
        self._holds.clear()
        for conn in list(self._in_hand):
            conn.close()
        self._in_hand.clear()
        for fd in self._copies:
            _close_quietly(fd)
        self._copies.clear()
        for key in list(self._selector.get_map().values()):
            sock = key.fileobj
            if isinstance(sock, socket.socket):
                sock.close()
        self._selector.close()
        self._listener.close()

    def offer(
        self,
        kind: str,
        origin: str,
        payload: bytes,
        fds: list[int],
        target: Callable[[], object | None],
        *,
        hold: bool,
    ) -> ExportTicket:
        """Serve an export of ``kind`` from ``origin`` (see :func:`export_origin`) until
        ``target()`` returns None; the broker owns ``fds`` from now on. Importers name
        the kind and origin their pickle claims, and are refused unless both match.

        With ``hold``, each importer's connection keeps ``target()`` alive until it closes."""
        token = secrets.token_hex(_TOKEN_BYTES)
        named = _label(kind) + _label(origin) + payload
        with self._lock:
            self._forget_dead()
            self._exports[token] = _Export(named, fds, target, hold)
        return ExportTicket(self.address, token, self.pid, len(fds))

    def _forget_dead(self) -> None:
        """Drop exports whose target is gone, closing their descriptors (lock held)."""
        for token in [t for t, e in self._exports.items() if e.target() is None]:
            for fd in self._exports.pop(token).fds:
                os.close(fd)

    def stats(self) -> dict[str, int]:
        """``{"exports": n, "holds": n}``: exports still served, importer connections holding."""
        with self._lock:
            self._forget_dead()
            return {"exports": len(self._exports), "holds": len(self._holds)}

    def _serve(self) -> None:
        while True:
            wait = None if self._accept_again_at is None else max(0.0, self._accept_again_at - time.monotonic())
            for key, _ in self._selector.select(wait):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    self._accept()
                elif isinstance(key.data, bytearray):
                    self._read_token(sock, key.data)
                elif isinstance(key.data, _Pending) and key.data.unsent:
                    self._send_unsent(sock, key.data)
                elif isinstance(key.data, _Pending):
                    self._next_batch(sock, key.data)
                else:
                    self._release(sock)  # importers send nothing after the token: EOF or error
            if self._accept_again_at is not None and time.monotonic() >= self._accept_again_at:
                self._accept_again_at = None
                self._selector.register(self._listener, selectors.EVENT_READ)

    def _accept(self) -> None:
        # The token is read as it arrives, never waited for: one importer that
        # connects and sends nothing must not stall every other one.
        # Other users are turned away at once (the abstract namespace is open to
        # them), so that they cannot pile up connections waiting for a token.
        try:
            conn, _ = self._listener.accept()
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                # The connection stays queued and the listener readable: trying again at
                # once spun this thread (a core, and the GIL) while the table was full.
                self._selector.unregister(self._listener)
                self._accept_again_at = time.monotonic() + _ACCEPT_RETRY_S
            return
        self._in_hand.add(conn)
        try:
            self._admit(conn)
        finally:
            self._in_hand.discard(conn)

    def _admit(self, conn: socket.socket) -> None:
        try:
            creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            conn.close()
            return
        _, uid, _ = struct.unpack("3i", creds)
        if uid != os.geteuid():  # SO_PEERCRED states the effective uid: compared with ours
            message = b"only processes of the same user may open accel exports"
            try:
                conn.sendall(_HEADER.pack(b"E", len(message), 0) + message, _SEND)
            except OSError:
                pass
            conn.close()
            return
        conn.setblocking(False)
        self._selector.register(conn, selectors.EVENT_READ, bytearray())

    def _read_token(self, conn: socket.socket, token: bytearray) -> None:
        try:
            more = conn.recv(2 * _TOKEN_BYTES - len(token))
        except BlockingIOError:
            return
        except OSError:
            more = b""
        if not more:  # closed before naming an export
            self._selector.unregister(conn)
            conn.close()
            return
        token += more
        if len(token) < 2 * _TOKEN_BYTES:
            return
        self._in_hand.add(conn)
        self._selector.unregister(conn)
        try:
            conn.settimeout(_ANSWER_TIMEOUT_S)
            self._answer(conn, token.decode("ascii", "replace"))
        except OSError:
            self._release(conn)
        finally:
            self._in_hand.discard(conn)

    def _answer(self, conn: socket.socket, token: str) -> None:
        with self._lock:
            self._forget_dead()
            export = self._exports.get(token)
            target = None if export is None else export.target()
            # Copies taken under the lock: once it is released, another thread may close
            # the export (an event closed) and _forget_dead its descriptors, whose numbers
            # the process may then give to other files, which would be sent instead.
            fds = [] if export is None or target is None else _dup_all(export.fds[:_FDS_PER_MESSAGE], self._copies)
        if export is None or target is None:
            message = (
                f"process {self.pid} no longer exports that object: it was freed or closed there "
                "before this process opened it (keep it alive in the exporting process until "
                "every importer has opened it)"
            ).encode()
            conn.sendall(_HEADER.pack(b"E", len(message), 0) + message, _SEND)
            conn.close()
            return
        try:
            # The hold is taken before the importer can map anything: from the moment
            # it has the descriptors, the exporter's memory must not be reused.
            if export.hold:
                with self._lock:
                    self._holds[conn] = target
            first = memoryview(export.message)
            # sendmsg sends what fits in the socket's buffer (the descriptors go with the
            # first byte): the rest of a long answer follows as the importer reads it.
            conn.setblocking(False)
            sent = socket.send_fds(conn, [first], fds, _SEND)
        finally:
            self._close_copies(fds)
        self._go_on(conn, _Pending(token, export, len(fds), export.hold, first[sent:]))

    def _send_unsent(self, conn: socket.socket, rest: _Pending) -> None:
        """Send what the socket's buffer has room for of the rest of an answer's first part."""
        try:
            sent = conn.send(rest.unsent, _SEND)
        except BlockingIOError:
            return
        except OSError:
            self._release(conn)
            return
        rest.unsent = rest.unsent[sent:]
        self._go_on(conn, rest)

    def _go_on(self, conn: socket.socket, rest: _Pending) -> None:
        """Wait for what comes next on an answer's connection: room for the rest of its first
        part, the importer's acknowledgement of a batch, or the end of its hold (the
        release); or end it, answered."""
        if rest.unsent:
            events, data = selectors.EVENT_WRITE, rest
        elif rest.sent < len(rest.export.fds):
            events, data = selectors.EVENT_READ, rest
        elif rest.hold:
            events, data = selectors.EVENT_READ, None
        else:
            self._release(conn)
            return
        if conn in self._selector.get_map():
            self._selector.modify(conn, events, data)
        else:
            self._selector.register(conn, events, data)

    def _next_batch(self, conn: socket.socket, rest: _Pending) -> None:
        """Send the next batch of an answer once its importer acknowledged the one before
        (anything else, or the connection's end, ends the answer)."""
        try:
            ack = conn.recv(1)
            # An importer acknowledges once it has read all that came: one that acknowledges
            # ahead (b"AA") would otherwise have every batch in flight at once, unpaced.
            if ack == _ACK and _unread(conn):
                ack = b""
        except OSError:
            ack = b""
        batch: list[int] | None = None
        with self._lock:
            # Duplicated under the lock, as in _answer; an export closed meanwhile ends the answer,
            # and so does a full descriptor table here (the importer is told the connection closed).
            if ack == _ACK and self._exports.get(rest.token) is rest.export:
                with contextlib.suppress(OSError):
                    batch = _dup_all(rest.export.fds[rest.sent : rest.sent + _FDS_PER_MESSAGE], self._copies)
        if batch is None:
            self._release(conn)
            return
        try:
            socket.send_fds(conn, [_MORE], batch, _SEND)
        except OSError:
            self._release(conn)
            return
        finally:
            self._close_copies(batch)
        rest.sent += len(batch)
        self._go_on(conn, rest)

    def _close_copies(self, fds: list[int]) -> None:
        for fd in fds:
            self._copies.remove(fd)  # first: see _in_hand
            os.close(fd)

    def _release(self, conn: socket.socket) -> None:
        """End a connection: what it holds, and the descriptors of an answer not sent yet."""
        with contextlib.suppress(KeyError, ValueError):  # not registered: failed while answering
            self._selector.unregister(conn)
        conn.close()
        with self._lock:
            target = self._holds.pop(conn, None)
        del target  # outside the lock: dropping the last reference may free memory


def _unread(conn: socket.socket) -> int:
    """How many bytes sent on ``conn`` its peer has not read yet (SIOCOUTQ: a Unix
    socket's sent data stays charged to the sender until the receiver reads it)."""
    unread: int = struct.unpack("i", fcntl.ioctl(conn.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
    return unread


def _dup_all(fds: list[int], copies: list[int]) -> list[int]:
    """Duplicates of ``fds``, each also appended to ``copies`` as it is made (none left
    open if one fails: OSError)."""
    made: list[int] = []
    try:
        for fd in fds:
            made.append(os.dup(fd))
            copies.append(made[-1])
    except OSError:
        for fd in made:
            if fd in copies:
                copies.remove(fd)
            os.close(fd)
        raise
    return made


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _label(text: str) -> bytes:
    data = text.encode("utf-8")
    if len(data) > 255:
        raise ValueError(f"export label {text!r} is longer than 255 bytes")
    return bytes([len(data)]) + data


def _read_label(body: bytes, at: int) -> tuple[str, int]:
    """The label at ``body[at]`` and the offset after it ("" past the end)."""
    if at >= len(body):
        return "", at
    end = at + 1 + body[at]
    return body[at + 1 : end].decode("utf-8", "replace"), end


def export_origin(backend_name: str, device: int, uuid: str) -> str:
    """Where an export comes from, as its exporter states it and its pickle claims it."""
    return f"{backend_name}:{device}:{uuid}"


_broker: Broker | None = None
_broker_lock = threading.Lock()


def broker() -> Broker:
    """This process's broker, started on first use (and again in a forked child)."""
    global _broker
    with _broker_lock:
        if _broker is None or _broker.pid != os.getpid():
            _broker = Broker()
        return _broker


def _after_fork_in_child() -> None:
    """Drop what a forked child inherits of its parent's sharing: the broker (its
    socket, connections and exports' descriptors) and the parent's holds. The child
    has none of the threads that served or used them."""
    global _broker, _broker_lock
    _broker_lock = threading.Lock()  # another parent thread may have held it at the fork
    inherited, _broker = _broker, None
    if inherited is not None:
        inherited.close_in_child()
    for held in list(_holds):
        held.drop_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def dup_for_export(fd: int, backend: str, device: int) -> int:
    """A duplicate of ``fd`` for an export to own; a full descriptor table is a DriverError."""
    try:
        return os.dup(fd)
    except OSError as exc:
        code = exc.errno or 0
        raise DriverError(
            backend, "exporting to another process", code, errno.errorcode.get(code, "OSError"), str(exc),
            device=device, remedy="close exports no longer needed (free the buffers, close the events) or "
            "raise the open-file limit (ulimit -n)",
        ) from None



# -- reading another process's description of its memory ----------------------------
#
# A description comes from whatever process answers at the address a pickle
# names: an importer checks it before mapping anything, because a wrong offset
# or size is not an error of any call (the mapping succeeds) but a read past it
# (SIGSEGV, SIGBUS) or of the wrong bytes.


def _damaged(where: str, detail: str) -> InvalidHandleError:
    return InvalidHandleError(
        f"{where}: the exporting process described its memory inconsistently ({detail}); is it an "
        "accel process? Pickle the buffer again in its process"
    )


def description(payload: bytes, where: str) -> dict[str, Any]:
    """The JSON object ``payload`` holds, or InvalidHandleError naming ``where``."""
    try:
        layout = json.loads(payload)
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested past the recursion limit
        layout = None
    if not isinstance(layout, dict):
        raise _damaged(where, f"{payload[:40]!r} is not a description")
    return layout


def natural(layout: dict[str, Any], key: str, where: str, *, positive: bool = False) -> int:
    """``layout[key]``, an int at least 0 (1 with ``positive``), or InvalidHandleError."""
    value = layout.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < int(positive):
        raise _damaged(where, f"{key}={value!r}")
    return value


def naturals(layout: dict[str, Any], key: str, where: str, count: int) -> list[int]:
    """``layout[key]``, a list of ``count`` (at least one) positive ints, or InvalidHandleError."""
    values = layout.get(key)
    if not (isinstance(values, list) and len(values) == count > 0
            and all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in values)):
        raise _damaged(where, f"{key}={values!r} for {count} descriptor(s)")
    return values


def check_extent(where: str, lead: int, nbytes: int, total: int) -> None:
    """Refuse a buffer of ``nbytes`` at ``lead`` bytes into ``total`` mapped bytes that runs past them."""
    if lead + nbytes > total:
        raise _damaged(where, f"{nbytes} bytes from {lead} bytes in, past the {total} bytes it maps")


# Imports of fewer pieces cost no look at the process's mappings.
_MAP_CHECK_FROM = 16
# Mappings left for what runs beside an import (other threads, the reservation's ends).
_MAP_MARGIN = 64


def check_map_count(pieces: int, where: str, device: int) -> None:
    """Refuse to map ``pieces`` separate mappings (one per piece of an export) where they
    would pass the kernel's limit on mappings per process (vm.max_map_count, 65530 by
    default): mmap would fail part way with ENOMEM, as if memory had run out."""
    if pieces < _MAP_CHECK_FROM:
        return
    try:
        with open("/proc/sys/vm/max_map_count", "rb") as limit_file:
            limit = int(limit_file.read())
        with open("/proc/self/maps", "rb") as maps:
            current = sum(1 for _ in maps)
    except (OSError, ValueError):  # no procfs: mmap's own failure says it
        return
    if current + pieces + _MAP_MARGIN > limit:
        raise OutOfMemoryError(
            f"{where}: the export is {pieces} separate pieces of memory, each a mapping of its own, and this "
            f"process has {current} mappings of the {limit} the kernel allows (vm.max_map_count); free buffers "
            "opened from other processes, share smaller buffers (or without expandable segments), or raise "
            "the limit (sysctl vm.max_map_count)",
            device=device,
        )


class Held:
    """An importer's hold on an export: the open connection. :meth:`release` closes it.

    A forked child does not hold what its parent imported (see
    :func:`_after_fork_in_child`): its copy of the connection is closed at the fork."""

    def __init__(self, sock: socket.socket | None, receiving: list[int] | None = None) -> None:
        self._sock = sock
        # While the answer comes in: the descriptors received so far (see opened()).
        self._receiving = receiving
        if sock is not None:
            _holds.add(self)

    def opened(self) -> Held:
        """The answer is in, and its descriptors are the caller's: a fork no longer closes them."""
        self._receiving = None
        return self

    def release(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

    def drop_in_child(self) -> None:
        """Close a forked child's copy of the connection: the parent's hold goes on.
        (Never ``shutdown()``: that would end the connection for the parent too.)
        Forked by another thread while the answer came in, the child closes the
        descriptors received so far too (its parent maps them; it never will)."""
        receiving, self._receiving = self._receiving, None
        for fd in receiving or ():
            _close_quietly(fd)
        self.release()


# Every hold still open in this process, for a forked child to drop.
_holds: weakref.WeakSet[Held] = weakref.WeakSet()


def open_export(ticket: ExportTicket, kind: str, origin: str, what: str) -> tuple[bytes, list[int], Held]:
    """Fetch ``(payload, fds, hold)`` of an export of ``kind`` from ``origin`` (what the
    pickle claims); ``what`` names it in errors.

    The caller owns the descriptors and must release the hold when done."""
    if not (
        isinstance(ticket, ExportTicket)
        and isinstance(ticket.address, bytes)
        and isinstance(ticket.pid, int)
        and isinstance(ticket.token, str)
        and isinstance(ticket.fds, int)
        and 0 <= ticket.fds <= _MAX_FDS
        and len(ticket.token) == 2 * _TOKEN_BYTES
        and all(c in "0123456789abcdef" for c in ticket.token)
    ):
        raise InvalidHandleError(
            f"cannot open {what}: the pickle does not name an accel export (damaged, or not "
            "made by pickling an accel object); pickle the object again in its process"
        )
    if ticket.pid == os.getpid():
        raise InvalidHandleError(
            f"{what} was exported by this very process; use the original object instead of "
            "unpickling it here"
        )
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(_ANSWER_TIMEOUT_S)
    fds: list[int] = []  # closed on every failure below: they came with the answer's first part
    # Held from the start, not once the answer is in: a child that another thread forks
    # meanwhile closes its copies (of the connection, which would otherwise hold the
    # exporter's memory until the child exits, and of the descriptors received so far).
    held = Held(sock, fds)
    limit = resource.getrlimit(resource.RLIMIT_NOFILE)  # what a refused answer leaves as it was
    try:
        try:
            _connect(sock, ticket.address)
        except (ConnectionRefusedError, FileNotFoundError):
            raise InvalidHandleError(
                f"cannot open {what}: the process that exported it (pid {ticket.pid}) has exited. "
                "Keep the exporting process alive while others use what it shares."
            ) from None
        _check_peer(sock, ticket, what)
        sock.sendall(ticket.token.encode("ascii"), _SEND)
        status, body = _receive_answer(sock, fds, ticket, what)
    except TimeoutError:
        _close_all(held, fds, limit)
        raise InvalidHandleError(
            f"cannot open {what}: the process that exported it (pid {ticket.pid}) did not answer "
            f"within {_ANSWER_TIMEOUT_S:g} s (is it stopped?)"
        ) from None
    except OSError as exc:
        # An address no socket can have (empty, or longer than AF_UNIX allows:
        # a damaged pickle), or a connection the exporter broke off.
        _close_all(held, fds, limit)
        raise InvalidHandleError(
            f"cannot open {what}: no answer from the process that exported it (pid {ticket.pid}) at the "
            f"address its pickle names ({exc}); the pickle is damaged or the process is gone. Pickle "
            "the object again in its process"
        ) from None
    except BaseException:
        _close_all(held, fds, limit)
        raise
    exported, at = _read_label(body, 0) if status == b"K" else ("", 0)
    source, at = _read_label(body, at)
    if status != b"K" or exported != kind or source != origin:
        _close_all(held, fds, limit)
        if status != b"K":
            reason = body.decode(errors="replace")
        elif exported != kind:
            reason = f"the pickle names an export of kind {exported!r}, not {kind!r} (it is damaged or forged)"
        else:
            # Mapping memory of one device as another's would give the importer
            # a buffer whose device is a lie (and a wrong context on a GPU).
            reason = (
                f"its process exports it from {source}, not {origin} as the pickle says "
                "(it is damaged or forged); pickle the object again in its process"
            )
        raise InvalidHandleError(f"cannot open {what}: {reason}")
    return body[at:], list(fds), held.opened()


def _connect(sock: socket.socket, address: bytes) -> None:
    """Connect to a broker, waiting while its queue of connections is full (EAGAIN, at
    once, whatever the timeout): other processes, of any user, may flood it; each is
    turned away at once, so room comes. TimeoutError past the answer's timeout."""
    deadline = time.monotonic() + _ANSWER_TIMEOUT_S
    while True:
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise TimeoutError from None
            time.sleep(_CONNECT_RETRY_S)


def _check_peer(sock: socket.socket, ticket: ExportTicket, what: str) -> None:
    """Refuse to talk to anyone but the exporter the pickle names: its pid, and this
    process's user. After the exporter exits its abstract name is free, and whoever
    binds it next would otherwise get the token and choose the memory mapped here."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", creds)
    if pid != ticket.pid or uid != os.geteuid():  # SO_PEERCRED states the effective uid
        raise InvalidHandleError(
            f"cannot open {what}: the process answering at the address its pickle names is pid {pid} "
            f"of user {uid}, not its exporter (pid {ticket.pid} of user {os.geteuid()}); the exporter has "
            "exited and another process took its address. Nothing was sent to it or taken from it; "
            "pickle the object again in a live exporting process"
        )


def _receive_answer(sock: socket.socket, fds: list[int], ticket: ExportTicket, what: str) -> tuple[bytes, bytes]:
    """``(status, body)`` of the broker's answer; its descriptors are appended to ``fds``
    as they arrive (so that the caller closes them on any failure). TimeoutError once
    the whole answer took longer than the answer's timeout."""
    # One deadline for the whole answer, not each receive: an exporter that sent a byte
    # a little within each timeout held the importer for as long as it liked.
    deadline = time.monotonic() + _ANSWER_TIMEOUT_S
    data = b""
    while len(data) < _HEADER.size:
        data += _receive(sock, fds, ticket, what, deadline)
    status, length, count = _HEADER.unpack_from(data)
    # recv() would otherwise take what a forged header states, up to 4 GiB; and the
    # open-file limit is raised for no more descriptors than the pickle names.
    if length > _MAX_ANSWER or (status == b"K" and count != ticket.fds) or (status != b"K" and count):
        raise InvalidHandleError(
            f"cannot open {what}: the process at the address its pickle names (pid {ticket.pid}) "
            f"announced a {length}-byte answer with {count} descriptors where its pickle names {ticket.fds} "
            "(is it an accel process?); pickle the object again in its process"
        )
    _make_room(count, what)
    while len(data) < _HEADER.size + length:
        data += _receive(sock, fds, ticket, what, deadline)
    # Each part brings a whole batch (what an accel broker sends), and a further one
    # only its tag: anything else is refused, closing what came (the caller).
    if len(data) > _HEADER.size + length or len(fds) != min(count, _FDS_PER_MESSAGE):
        raise _not_announced(ticket, what, len(fds), count)
    while len(fds) < count:
        # Paced: the exporter sends each further batch once this one is in (see _ACK).
        sock.sendall(_ACK, _SEND)
        batch = min(count - len(fds), _FDS_PER_MESSAGE)
        before = len(fds)
        if _receive(sock, fds, ticket, what, deadline) != _MORE or len(fds) != before + batch:
            raise _not_announced(ticket, what, len(fds), count)
    return data[:1], data[_HEADER.size :]


def _receive(sock: socket.socket, fds: list[int], ticket: ExportTicket, what: str, deadline: float) -> bytes:
    """One part of an answer (its descriptors appended to ``fds``) by ``deadline``; never empty."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    sock.settimeout(left)
    before = len(fds)
    more, flags = _recv_fds(sock, fds)
    # Truncated with room for a whole batch filled: the part brought more than the protocol's
    # batch (a forged answer; the kernel closes the rest), not a full table here.
    if flags & socket.MSG_CTRUNC and len(fds) - before == _FDS_PER_MESSAGE:
        raise InvalidHandleError(
            f"cannot open {what}: the process that exported it (pid {ticket.pid}) sent more than "
            f"{_FDS_PER_MESSAGE} descriptors in one part, which the protocol has not (is it an accel "
            "process?); pickle the object again in its process"
        )
    if flags & socket.MSG_CTRUNC:
        raise InvalidHandleError(
            f"cannot open {what}: this process has too many open files to receive its descriptors; "
            "close some, or raise the open-file limit (ulimit -n)"
        )
    if not more:
        raise InvalidHandleError(
            f"cannot open {what}: the process that exported it (pid {ticket.pid}) closed the "
            "connection without answering (it is exiting?)"
        )
    return more


def _not_announced(ticket: ExportTicket, what: str, received: int, count: int) -> InvalidHandleError:
    return InvalidHandleError(
        f"cannot open {what}: the process that exported it (pid {ticket.pid}) sent {received} "
        f"descriptors where it announced {count}, or parts the protocol has not (is it an accel "
        "process?); pickle the object again in its process"
    )


def _recv_fds(sock: socket.socket, fds: list[int]) -> tuple[bytes, int]:
    """``(data, flags)`` of one receive, appending the descriptors it carried to ``fds``.

    ``socket.recv_fds`` drops its ``flags`` argument (CPython 3.11), and without
    MSG_CMSG_CLOEXEC the descriptors would be inheritable: a subprocess started with
    ``close_fds=False``, or an ``os.exec``, would keep the exporter's memory."""
    size = array.array("i").itemsize
    data, ancillary, flags, _ = sock.recvmsg(1 << 16, socket.CMSG_LEN(_FDS_PER_MESSAGE * size), socket.MSG_CMSG_CLOEXEC)
    for level, kind, cmsg in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.extend(array.array("i", cmsg[: len(cmsg) - len(cmsg) % size]))
    return data, flags


def more_descriptors() -> bool:
    """Raise the soft limit on open files to the hard limit; whether it rose.

    Called only when descriptors are short, never at start-up: a process that
    never needs more keeps its soft limit (1024 by default, which ``select()``
    users rely on)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or (hard != resource.RLIM_INFINITY and soft >= hard):
        return False
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    except (OSError, ValueError):  # an infinite hard limit is more than the kernel allows (nr_open)
        return False
    return True


def _make_room(count: int, what: str) -> None:
    """Raise the soft limit on open files when ``count`` descriptors would not fit
    (the kernel drops descriptors it cannot install, and they cannot be asked for
    again). Few descriptors, the common case, cost no look at the table."""
    if count <= _FDS_PER_MESSAGE:
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and len(os.listdir("/proc/self/fd")) + count > soft:
        more_descriptors()


def _close_all(held: Held, fds: list[int], limit: tuple[int, int]) -> None:
    """Close the connection and the descriptors received on it (an answer that failed
    part way: a stalled or broken-off sender kept them open in this process before),
    and put back the open-file limit raised for them (a refused answer leaves none)."""
    held.opened().release()
    for fd in fds:
        os.close(fd)
    fds.clear()
    if resource.getrlimit(resource.RLIMIT_NOFILE) != limit:
        with contextlib.suppress(OSError, ValueError):
            resource.setrlimit(resource.RLIMIT_NOFILE, limit)


def check_device(backend: Backend, backend_name: str, device: int, uuid: str, what: str) -> None:
    """Refuse to open ``what`` unless this process sees the exporter's device at the same index."""
    if backend.name != backend_name:
        raise DeviceError(
            f"cannot open {what}: it was exported by the {backend_name} backend, and this process "
            f"uses {backend.name} (set ACCEL_BACKEND={backend_name} before importing accel)"
        )
    if not isinstance(device, int) or device < 0 or device >= backend.device_count() or backend.device_properties(device).uuid != uuid:
        raise DeviceError(
            f"cannot open {what}: this process does not see the exporter's device as "
            f"{backend_name}:{device} (device visibility differs between the processes)"
        )
