"""What the XPU backend keeps for each stream, event, capture, graph, physical chunk and device,
and the handle tables that find them."""

from __future__ import annotations

import itertools
import threading
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from accel._errors import AccelError, InvalidHandleError
from accel.backends._capture import Capture, Mark
from accel.backends.base import CaptureMode, DeviceProperties

if TYPE_CHECKING:
    from accel.backends.xpu._event_pool import EventSlot
    from accel.backends.xpu._host_worker import HostWorker

__all__ = [
    "CaptureState", "DeviceState", "EventState", "GraphState", "PhysicalChunk", "StreamState", "live", "new_handle",
]

_handles = itertools.count(0x10000)


def new_handle() -> int:
    return next(_handles) << 4


class OnDevice(Protocol):
    device: int


_T = TypeVar("_T", bound=OnDevice)


def live(table: Mapping[int, _T], handle: int, device: int, kind: str, *, any_device: bool = False) -> _T:
    """``table[handle]`` if it is live and of ``device`` (of any device with ``any_device``),
    else InvalidHandleError."""
    found = table.get(handle)
    if found is None or (found.device != device and not any_device):
        raise InvalidHandleError(
            f"xpu:{device}: {kind} {handle:#x} is not a live {kind} of this device "
            "(destroyed, never created, or created on another device)"
        )
    return found


@dataclass(eq=False)
class StreamState:
    device: int
    cdata: object
    handle: int
    priority: int
    is_default: bool
    lock: threading.Lock = field(default_factory=threading.Lock)
    seq: int = 0  # commands appended so far
    marked: int = 0  # seq covered by the newest marker
    done: int = 0  # seq known complete
    markers: deque[tuple[int, EventSlot]] = field(default_factory=deque)
    deferred: list[tuple[int, Callable[[], object]]] = field(default_factory=list)
    # Set by the capture rules (accel/backends/_capture.py), which know captures only as
    # Capture; see xpu_capture() for the backend's own view.
    capture: Capture[Any] | None = None
    worker: HostWorker | None = None
    # Failures of the backend's own host functions (a wait on an event whose exporting
    # process exited), raised by the stream's next synchronize.
    failures: deque[AccelError] = field(default_factory=deque)
    # Set (under ``lock``) when the stream's last marker is fixed: its command list is
    # destroyed once that marker is reached, so nothing may be appended after it.
    retired: bool = False

    def xpu_capture(self) -> CaptureState | None:
        """The capture this stream records into: one an xpu stream began, so a CaptureState."""
        capture = self.capture
        assert capture is None or isinstance(capture, CaptureState)
        return capture


@dataclass(eq=False)
class EventState:
    device: int
    handle: int
    timing: bool
    slot: EventSlot | None = None
    captured: Mark | None = None  # where it was recorded inside a capture
    ipc: bool = False  # interprocess: one Level Zero event of its own, re-armed by each record
    exporter: int = -1  # opened from another process: a pidfd of that process, readable once it exited


class CaptureState(Capture[str]):
    """A capture recording into a regular command list; its nodes are command descriptions.

    ``lock`` also serializes appends to the list, which streams forked into
    the capture make from their own threads.
    """

    def __init__(self, origin: StreamState, mode: CaptureMode, cdata: object, start: EventSlot, done: EventSlot) -> None:
        super().__init__("xpu", origin, mode)
        self.cdata = cdata  # the regular command list being recorded
        self.start = start
        self.done = done
        self.host_nodes: list[tuple[EventSlot, EventSlot, Callable[[], None]]] = []
        self.keep: list[object] = []  # memory the recorded commands point at
        self.signals: list[EventSlot] = []  # event slots recorded commands signal (event records)
        self.waits: list[EventState] = []  # events external waits wait for, as of each launch


@dataclass(eq=False)
class GraphState:
    device: int
    handle: int
    cdata: object
    start: EventSlot
    done: EventSlot
    nodes: list[str]
    host_nodes: list[tuple[EventSlot, EventSlot, Callable[[], None]]]
    keep: list[object]
    lock: threading.Lock = field(default_factory=threading.Lock)
    owners: int = 1  # the graph itself plus each executable graph made from it
    last_launch: EventSlot | None = None  # signalled once the last replay is fully consumed
    # Replays share the list's events, so they must run one at a time and in launch
    # order: one command queue runs every replay (two queues could start the same
    # list together), and one thread serves the host nodes of every replay.
    queue: object | None = None
    worker: HostWorker | None = None
    signals: list[EventSlot] = field(default_factory=list)  # one hold each, dropped with the graph
    waits: list[EventState] = field(default_factory=list)  # see CaptureState.waits


@dataclass(eq=False)
class PhysicalChunk:
    """A physical memory chunk; destroyed once released and no longer mapped."""

    cdata: object
    size: int
    maps: int = 0
    released: bool = False


@dataclass(eq=False)
class DeviceState:
    index: int
    cdata: object
    properties: DeviceProperties
    ordinal: int
    ns_per_tick: float
    timestamp_mask: int
    sysman_modules: list[object]
    lock: threading.Lock = field(default_factory=threading.Lock)
    held: int = 0  # bytes accel holds: malloc + physical chunks
    allocations: dict[int, int] = field(default_factory=dict)
    reservations: dict[int, int] = field(default_factory=dict)
    physical: dict[int, PhysicalChunk] = field(default_factory=dict)
    mappings: dict[int, tuple[int, int]] = field(default_factory=dict)  # addr -> (size, physical handle)
    vm_page: int | None = None
    next_hint: int = 0
