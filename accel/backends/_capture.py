"""Stream-capture rules for backends whose driver does not capture for them.

Such a backend records work itself, and keeps the rules of capture here: a
capture sequence begins on a created stream; an event recorded while
capturing marks a position in it (a *captured event*); a stream that waits
on a captured event is forked into the sequence; the sequence ends on the
stream that began it, and only once every forked stream's last node was
joined back. How a node is recorded and replayed stays with each backend.

Messages name the device as ``<kind>:<index>``, ``kind`` being the backend's
device-name prefix, like the backends' other errors.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Iterable
from typing import Any, Generic, NamedTuple, NoReturn, Protocol, TypeVar

from accel._errors import CaptureError
from accel.backends.base import CaptureMode, CaptureStatus

__all__ = [
    "Capture",
    "CaptureStream",
    "Mark",
    "check_begin",
    "end_capture",
    "ident",
    "refuse_captured_event",
    "refuse_device_synchronize",
    "refuse_while_capturing",
    "status",
    "wait_event",
]

N = TypeVar("N")


class CaptureStream(Protocol):
    """What the capture rules need of a backend's stream."""

    handle: int
    device: int
    capture: Capture[Any] | None

    @property
    def is_default(self) -> bool: ...


class Mark(NamedTuple):
    """Where an event was recorded inside a capture."""

    capture: Capture[Any]
    stream: int  # handle of the member stream it was recorded on
    node: int  # index of that stream's last node then (-1: none yet)


_idents = itertools.count(1)


class Capture(Generic[N]):
    """One capture sequence, shared by the stream that began it and the streams forked into it.

    ``nodes`` holds what the backend recorded, in recording order, which is a
    valid order to replay them in; the rest tracks who recorded what, so that
    the end can tell whether every fork was joined back.

    Example::

        check_begin("cpu", stream)
        stream.capture = Capture("cpu", stream, CaptureMode.GLOBAL)
        stream.capture.add(stream, node)     # each piece of work while capturing
        event.captured = stream.capture.mark(stream)
        graph = end_capture("cpu", stream).nodes
    """

    def __init__(self, kind: str, origin: CaptureStream, mode: CaptureMode) -> None:
        self.kind = kind
        self.ident = next(_idents)  # unique in the process, never 0 (CUDA's capture id)
        self.origin = origin
        self.mode = CaptureMode(mode)
        # Reentrant: finalizers run by garbage collection while this thread
        # holds the lock may destroy a member stream, which invalidates.
        self.lock = threading.RLock()
        self.streams: set[CaptureStream] = {origin}
        self.nodes: list[N] = []
        self.last_node: dict[int, int] = {}  # stream handle -> index of its last node
        self.joined_upto: dict[int, int] = {}  # stream handle -> its last node joined back
        self.invalid_reason = ""

    @property
    def active(self) -> bool:
        """Whether the capture is still under way (the stream that began it has not ended it)."""
        return self.origin.capture is self

    def invalidate(self, reason: str) -> None:
        """Doom the capture: ending it will raise, naming the first reason given."""
        with self.lock:
            if not self.invalid_reason:
                self.invalid_reason = reason

    def refuse(self, reason: str, device: int, message: str) -> NoReturn:
        """Invalidate the capture for ``reason`` and raise CaptureError with ``message`` about ``device``."""
        self.invalidate(reason)
        raise CaptureError(f"{self.kind}:{device}: {message}")

    def add(self, stream: CaptureStream, node: N) -> None:
        """Append ``node``, recorded by the member ``stream``."""
        with self.lock:
            self.nodes.append(node)
            self.last_node[stream.handle] = len(self.nodes) - 1

    def mark(self, stream: CaptureStream) -> Mark:
        """The position of an event recorded now on the member ``stream``."""
        with self.lock:
            return Mark(self, stream.handle, self.last_node.get(stream.handle, -1))

    def join(self, stream: CaptureStream, source: int, node: int) -> None:
        """``stream`` waits on an event recorded on member ``source`` after its node ``node``.

        A stream that is not capturing is forked into this capture (the
        default stream cannot be); one capturing into another capture is
        refused, as captures cannot be merged. Both refusals invalidate.
        """
        current = stream.capture
        if current is None:
            if stream.is_default:
                self.refuse(
                    "the default stream waited on a captured event", stream.device,
                    "the default stream cannot join a capture; fork capture work onto a created "
                    "stream instead. The capture is now invalidated.",
                )
            with self.lock:
                if not self.active:
                    return  # ended by another thread meanwhile: nothing left to join
                self.streams.add(stream)
                stream.capture = self  # fork: the stream now records into this capture
        elif current is not self:
            current.refuse(
                "two captures were merged", stream.device,
                f"stream {stream.handle:#x} waits on an event of another capture; captures cannot "
                "be merged. The capture is now invalidated.",
            )
        if source != stream.handle:
            with self.lock:
                self.joined_upto[source] = max(self.joined_upto.get(source, -1), node)


def check_begin(kind: str, stream: CaptureStream) -> None:
    """Refuse to begin a capture on a default stream or on a stream already capturing."""
    if stream.is_default:
        raise CaptureError(
            f"{kind}:{stream.device}: graphs must be captured on a created stream, not the default "
            "stream (replay may run on any stream). Use `with accel.Stream():`."
        )
    if stream.capture is not None:
        raise CaptureError(f"{kind}:{stream.device}: stream {stream.handle:#x} is already capturing")


def status(stream: CaptureStream) -> CaptureStatus:
    """The capture state of ``stream``."""
    capture = stream.capture
    if capture is None:
        return CaptureStatus.NONE
    return CaptureStatus.INVALIDATED if capture.invalid_reason else CaptureStatus.ACTIVE


def ident(stream: CaptureStream) -> int:
    """The id of the capture ``stream`` takes part in (0 if not capturing)."""
    capture = stream.capture
    return 0 if capture is None else capture.ident


def abandon(stream: CaptureStream) -> Capture[Any] | None:
    """``stream`` is being destroyed: invalidate its capture. When it began the
    capture, every member stream leaves it (nothing can end it any more) and
    the capture is returned so the backend can free what it recorded into."""
    capture = stream.capture
    if capture is None:
        return None
    capture.invalidate(f"stream {stream.handle:#x} was destroyed while capturing")
    if capture.origin is not stream:
        return None
    with capture.lock:
        for member in capture.streams:
            member.capture = None
    return capture


def length(stream: CaptureStream) -> int | None:
    """How many nodes the capture ``stream`` takes part in holds (None if not capturing)."""
    capture = stream.capture
    return None if capture is None else len(capture.nodes)


def end_capture(kind: str, stream: CaptureStream) -> Capture[Any]:
    """End the capture that ``stream`` began and return it; its ``nodes`` are the graph.

    Raises CaptureError if ``stream`` is not capturing, or began no capture
    (it was forked into one: that capture goes on, invalidated). Otherwise
    every member stream stops capturing, and then it raises if the capture
    was invalidated or a forked stream's last node was not joined back.
    """
    capture = stream.capture
    if capture is None:
        raise CaptureError(f"{kind}:{stream.device}: stream {stream.handle:#x} is not capturing")
    where = f"{kind}:{stream.device}"
    if capture.origin is not stream:
        capture.refuse(
            "the capture was ended on a stream other than the one that began it", stream.device,
            f"end the capture on stream {capture.origin.handle:#x}, which began it, not on the "
            f"forked stream {stream.handle:#x}; the capture is now invalidated",
        )
    with capture.lock:
        for member in capture.streams:
            member.capture = None
        if capture.invalid_reason:
            raise CaptureError(f"{where}: the capture was invalidated: {capture.invalid_reason}")
        for member in capture.streams:
            if member is stream:
                continue
            if capture.last_node.get(member.handle, -1) > capture.joined_upto.get(member.handle, -1):
                raise CaptureError(
                    f"{where}: forked stream {member.handle:#x} was not joined back into the "
                    "capturing stream: record an event on it after its last work and make the "
                    "origin stream wait on that event before ending the capture"
                )
    return capture


def wait_event(stream: CaptureStream, mark: Mark | None, event: int) -> bool:
    """Apply the capture rules to ``stream`` waiting on ``event``, recorded at ``mark``.

    Returns True when the wait joined a running capture (its members record
    into one sequence, so there is nothing to enqueue), False when the wait is
    ordinary work. A capturing stream that waits on an event recorded outside
    its capture is refused, and its capture invalidated.
    """
    if mark is not None and mark.capture.active:
        mark.capture.join(stream, mark.stream, mark.node)
        return True
    capture = stream.capture
    if capture is not None:
        capture.refuse(
            "a capturing stream waited on an event recorded outside the capture", stream.device,
            f"stream {stream.handle:#x} is capturing and cannot wait on event {event:#x}, which was "
            "recorded outside the capture (the dependency would cross the capture boundary); the "
            "capture is now invalidated. Create the event with external=True to make the wait a "
            "node of the graph (each replay waits for its last record), or record it before "
            "beginning the capture and synchronize instead.",
        )
    return False


def refuse_captured_event(mark: Mark | None, device: int, event: int, what: str) -> None:
    """Refuse ``what`` (a host-side query or wait) on an event recorded inside a running capture."""
    if mark is not None and mark.capture.active:
        raise CaptureError(
            f"{mark.capture.kind}:{device}: {what} event {event:#x} is not allowed: it was "
            "recorded inside a capture that is still running"
        )


def refuse_while_capturing(stream: CaptureStream, what: str) -> None:
    """Refuse ``what`` (a host-side query or wait) on a capturing stream, invalidating its capture."""
    capture = stream.capture
    if capture is not None:
        capture.refuse(
            f"{what} is not allowed during capture", stream.device,
            f"{what} is not allowed while stream {stream.handle:#x} is capturing; the capture is "
            "now invalidated. End the capture, then synchronize.",
        )


def refuse_device_synchronize(device: int, streams: Iterable[CaptureStream]) -> None:
    """Refuse to synchronize ``device`` while one of its ``streams`` captures, invalidating that capture."""
    for stream in streams:
        capture = stream.capture
        if capture is not None:
            capture.refuse(
                "the device was synchronized during capture", device,
                f"cannot synchronize the device while stream {stream.handle:#x} is capturing; the "
                "capture is now invalidated. End the capture first.",
            )
