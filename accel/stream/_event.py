"""Events: markers in a stream's work, for ordering and timing."""

from __future__ import annotations

import re
import sys
import threading
import weakref
from typing import TYPE_CHECKING, Any

from accel._device import Device, DeviceLike
from accel._errors import DeviceError, InvalidHandleError, InvalidValueError, NotSupportedError
from accel._runtime import Runtime, get_runtime
from accel.stream._stream import Stream, as_stream

if TYPE_CHECKING:
    from accel.backends._sharing import ExportTicket

__all__ = ["Event"]


class Event:
    """A marker recorded into a stream; completes when the stream reaches it.

    The backend event is created on first use, on the device of the stream it
    is first recorded on (or of ``device``), like ``torch.cuda.Event``.

    >>> import accel, time
    >>> s = accel.Stream()
    >>> start, end = accel.Event(enable_timing=True), accel.Event(enable_timing=True)
    >>> start.record(s); s.launch_host_func(lambda: time.sleep(0.01)); end.record(s)
    >>> start.elapsed_time(end) >= 5.0
    True
    """

    def __init__(
        self,
        device: DeviceLike = None,
        *,
        enable_timing: bool = False,
        blocking: bool = False,
        interprocess: bool = False,
        external: bool = False,
    ) -> None:
        self._runtime: Runtime = get_runtime()
        self._external = bool(external)
        self._device: int | None = None if device is None else self._runtime.index(device)
        self._timing = bool(enable_timing)
        self._blocking = bool(blocking)
        self._interprocess = bool(interprocess)
        self._handle = 0
        self._recorded = False
        self._closed = False
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize[[Runtime, int, int], Event] | None = None
        # One export however often the event is pickled: each holds descriptors until closed.
        self._ticket: ExportTicket | None = None
        self._opened_from: int | None = None  # the exporter's pid, for an event unpickled here

    # -- identity ---------------------------------------------------------

    @property
    def enable_timing(self) -> bool:
        return self._timing

    @property
    def external(self) -> bool:
        """Whether a graph capture keeps this event's records (see :meth:`record`)."""
        return self._external

    @property
    def event_id(self) -> int:
        """An int that names this event, as ``torch.Event.event_id``: the native
        handle, 0 before the backend event exists."""
        return self._handle

    @property
    def device(self) -> Device | None:
        """The event's device, or None before its first record."""
        return None if self._device is None else self._runtime.device(self._device)

    @property
    def native_handle(self) -> int:
        """The backend's event handle as an int (creates the event on the
        current device if it was never recorded)."""
        return self._ensure(self._device if self._device is not None else self._runtime.current_index)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("recorded" if self._recorded else "unrecorded")
        return (
            f"accel.Event(device={self.device}, enable_timing={self._timing}, "
            f"native_handle={self._handle:#x}, {state})"
        )

    def _ensure(self, index: int) -> int:
        with self._lock:
            if self._closed:
                raise InvalidHandleError(f"{self!r} was closed; create a new accel.Event")
            if self._device is not None and index != self._device:
                raise DeviceError(
                    f"{self!r} lives on {self.device}; it cannot be recorded on a stream of "
                    f"{self._runtime.device(index)}. Use one event per device."
                )
            if self._handle == 0:
                backend = self._runtime.backend
                self._handle = backend.event_create(
                    index, timing=self._timing, blocking=self._blocking, interprocess=self._interprocess
                )
                self._device = index
                self._finalizer = weakref.finalize(self, _destroy, self._runtime, index, self._handle)
            return self._handle

    def close(self) -> None:
        """Destroy the backend event; using the Event afterwards is an error."""
        with self._lock:
            self._closed = True
            finalizer = self._finalizer
        if finalizer is not None:
            finalizer()

    # -- operations --------------------------------------------------------

    def record(self, stream: Stream | None = None) -> None:
        """Record at the current end of ``stream`` (default: the current stream;
        a torch stream of the same device works too).

        Inside a graph capture, a record only marks a point that other streams
        of the capture can wait for, unless the event was created with
        ``external=True`` (as ``torch.cuda.Event``): then the graph keeps the
        record, and each replay records the event, so a pair of timing events
        recorded in the capture times each replay:

        >>> import accel
        >>> start = accel.Event(enable_timing=True, external=True)
        >>> end = accel.Event(enable_timing=True, external=True)
        >>> g = accel.Graph()
        >>> with accel.graph(g):
        ...     start.record(); accel.current_stream().launch_host_func(lambda: None); end.record()
        >>> g.replay(); accel.synchronize()
        >>> start.elapsed_time(end) >= 0.0
        True
        """
        stream = as_stream(stream, self._device)
        if stream._runtime is not self._runtime:
            raise DeviceError(f"{stream!r} belongs to another backend than {self!r}")
        handle = self._ensure(stream.device_index)
        if self._external:
            self._runtime.backend.event_record_external(stream.device_index, handle, stream._live())
        else:
            self._runtime.backend.event_record(stream.device_index, handle, stream._live())
        self._recorded = True

    def query(self) -> bool:
        """True when the recorded work completed (True if never recorded)."""
        self._check_open()
        if not self._recorded:
            return True
        assert self._device is not None  # _ensure set it before the first record
        return self._runtime.backend.event_query(self._device, self._handle)

    def synchronize(self) -> None:
        """Block until the recorded work completed (returns at once if never recorded)."""
        self._check_open()
        if not self._recorded:
            return
        assert self._device is not None  # _ensure set it before the first record
        self._runtime.backend.event_synchronize(self._device, self._handle)

    def wait(self, stream: Stream | None = None) -> None:
        """Make later work on ``stream`` (default: current) wait for this event.

        Inside a graph capture, a wait on an event recorded outside the capture
        is refused, unless the event was created with ``external=True`` (as
        ``torch.cuda.Event``): then the graph keeps the wait, and each replay
        waits there for the event's last record as it stands when the replay
        is queued (a record on another stream, or by another graph's replay):
        CUDA's event-wait node.

        >>> import accel
        >>> ready = accel.Event(external=True)
        >>> g = accel.Graph()
        >>> with accel.graph(g):
        ...     ready.wait(); accel.current_stream().launch_host_func(lambda: None)
        >>> ready.record(); g.replay(); accel.synchronize()
        """
        self._check_open()
        stream = as_stream(stream, self._device)
        if self._external and (self._recorded or stream.is_capturing()):
            # In a capture even before any record: a later one (another graph's) is what replays wait for.
            handle = self._ensure(stream.device_index if self._device is None else self._device)
            self._runtime.backend.stream_wait_event_external(stream.device_index, stream._live(), handle)
            return
        if not self._recorded:
            return  # nothing recorded, nothing to wait for
        self._runtime.backend.stream_wait_event(stream.device_index, stream._live(), self._handle)

    def elapsed_time(self, end_event: Event) -> float:
        """Milliseconds from this event to ``end_event``; waits for both to complete."""
        if not isinstance(end_event, Event):
            raise InvalidValueError(f"end_event={end_event!r} ({type(end_event).__name__}) is not an accel.Event")
        end = end_event
        if not (self._timing and end._timing):
            raise InvalidValueError("Both events must be created with argument 'enable_timing=True'.")
        if not (self._recorded and end._recorded):
            raise InvalidValueError("Both events must be recorded before calculating elapsed time.")
        if self._device != end._device:
            raise DeviceError(f"cannot time events of different devices: {self.device} and {end.device}")
        self.synchronize()
        end.synchronize()
        assert self._device is not None  # _ensure set it before the first record
        return self._runtime.backend.event_elapsed_ms(self._device, self._handle, end._handle)

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickle as a handle another process opens to the same event (the event
        must be created with ``interprocess=True``): work recorded here can be
        waited on there, through ``multiprocessing`` with the spawn start method.

        Keep this event alive until every importer has unpickled it.
        """
        return _open_event, self._export()

    def ipc_handle(self) -> bytes:
        """A handle to this event that another process opens with
        :meth:`from_ipc_handle`, as ``torch.cuda.Event.ipc_handle``: bytes, to send
        any way bytes go (a pipe, a queue, a file). The event must be created with
        ``interprocess=True``; if never recorded, it is created on the current device.

        Keep this event alive until every importer has opened it (the handle names
        it in this process, and opens nothing once the event is closed or
        collected); this process cannot open its own handle.

        >>> import accel
        >>> event = accel.Event(interprocess=True)
        >>> event.record()
        >>> handle = event.ipc_handle()
        >>> isinstance(handle, bytes) and handle == event.ipc_handle()
        True
        """
        ticket, backend_name, index, uuid = self._export()
        fields = {
            "address": ticket.address.hex(), "token": ticket.token, "pid": ticket.pid,
            "backend": backend_name, "device": index, "uuid": uuid,
        }  # fmt: skip
        import json  # here, not at import: `import accel` loads no JSON (tests/test_facade.py)

        return _IPC_HANDLE_PREFIX + json.dumps(fields, separators=(",", ":")).encode()

    @classmethod
    def from_ipc_handle(cls, device: DeviceLike, handle: bytes) -> Event:
        """Open the event of another process that ``handle`` (from its
        :meth:`ipc_handle`) names, as ``torch.cuda.Event.from_ipc_handle``.

        ``device`` is the event's device (None: the one the handle names); the
        processes must see it at the same index. Waiting for, querying and
        synchronizing the opened event see the other process's records, and
        records made here are seen there.
        """
        ticket, backend_name, index, uuid = _read_ipc_handle(handle)
        if device is not None:
            runtime = get_runtime()
            wanted = runtime.index(device)
            if wanted != index:
                raise DeviceError(
                    f"the IPC handle names an event of {backend_name}:{index}, not of "
                    f"{runtime.device(wanted)}; pass that device, or None"
                )
        return _open_event(ticket, backend_name, index, uuid)

    def _export(self) -> tuple[ExportTicket, str, int, str]:
        """This event's export (one, however often it is shared): the broker's ticket, and
        the backend, device index and device UUID an importer checks it against."""
        self._check_open()
        if not self._interprocess:
            raise InvalidValueError(
                f"{self!r} cannot be shared with another process: create it with "
                "accel.Event(interprocess=True)"
            )
        if self._opened_from is not None:
            # The backends cannot export an opened event (CUDA and Level Zero answered with a
            # misleading "destroyed or freed" or a raw driver error, the host backend with
            # "create it with interprocess=True"): say what to do, as for an opened buffer.
            raise NotSupportedError(
                f"{self!r} was opened from process {self._opened_from}; pickle the event in the process "
                "that created it instead, or call ipc_handle() there (an opened event is not exported again)"
            )
        index = self._device if self._device is not None else self._runtime.current_index
        handle = self._ensure(index)
        backend = self._runtime.backend
        if not backend.supports_ipc(index):
            raise NotSupportedError(
                f"{self.device} cannot share events with other processes (the {backend.name} backend "
                "has no IPC support here)"
            )
        uuid = backend.device_properties(index).uuid
        # Sharing loads sockets, secrets and JSON: not at `import accel`, at the first export.
        from accel.backends._sharing import broker, export_origin

        with self._lock:
            ticket = self._ticket
            if ticket is None:
                payload, fds = backend.ipc_event_export(index, handle)
                ref = weakref.ref(self)

                def target() -> Event | None:
                    event = ref()
                    return None if event is None or event._closed else event

                ticket = self._ticket = broker().offer(
                    "event", export_origin(backend.name, index, uuid), payload, fds, target, hold=False
                )
        return ticket, backend.name, index, uuid

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidHandleError(f"{self!r} was closed; create a new accel.Event")


# What Event.ipc_handle() starts with: the format, versioned, so that bytes of another
# kind (torch's 64-byte cudaIpcEventHandle_t, a damaged handle) are told apart.
_IPC_HANDLE_PREFIX = b"accel-event-ipc-1:"
_HEX = re.compile(r"(?:[0-9a-f]{2})+")


def _read_ipc_handle(handle: object) -> tuple[ExportTicket, str, int, str]:
    """The ticket, backend, device index and UUID an :meth:`Event.ipc_handle` holds."""
    if not isinstance(handle, (bytes, bytearray, memoryview)):
        raise InvalidValueError(
            f"handle={handle!r} ({type(handle).__name__}) is not an IPC handle: pass the bytes "
            "accel.Event.ipc_handle() returned in the exporting process"
        )
    import json  # here, not at import: `import accel` loads no JSON

    from accel.backends._sharing import ExportTicket  # loaded at the first use of sharing

    data = bytes(handle)
    fields: object = None
    if data.startswith(_IPC_HANDLE_PREFIX):
        try:
            fields = json.loads(data[len(_IPC_HANDLE_PREFIX) :])
        except (ValueError, RecursionError):  # not UTF-8, not JSON, nested past the recursion limit
            pass
    if isinstance(fields, dict):
        address, token, pid = fields.get("address"), fields.get("token"), fields.get("pid")
        backend_name, index, uuid = fields.get("backend"), fields.get("device"), fields.get("uuid")
        if (
            isinstance(address, str) and _HEX.fullmatch(address) and isinstance(token, str)
            and isinstance(pid, int) and not isinstance(pid, bool)
            and isinstance(index, int) and not isinstance(index, bool)
            and isinstance(backend_name, str) and isinstance(uuid, str)
        ):  # what each names is checked when it is opened (open_export, check_device)
            return ExportTicket(bytes.fromhex(address), token, pid), backend_name, index, uuid
    raise InvalidHandleError(
        f"{data[:40]!r}... is not an accel event IPC handle (damaged, or made by another library, "
        "such as torch's): pass the bytes accel.Event.ipc_handle() returned in the exporting process"
    )


def _open_event(ticket: ExportTicket, backend_name: str, index: int, uuid: str) -> Event:
    """Open an event exported by another process (what unpickling an Event calls)."""
    from accel.backends._sharing import check_device, export_origin, open_export

    what = f"an event of {backend_name}:{index} from another process"
    runtime = get_runtime()
    backend = runtime.backend
    check_device(backend, backend_name, index, uuid, what)
    payload, fds, held = open_export(ticket, "event", export_origin(backend_name, index, uuid), what)
    held.release()  # an event holds nothing in the exporter: its state is shared memory
    handle = backend.ipc_event_import(index, payload, fds)
    event = Event(index, interprocess=True)
    event._handle = handle
    event._recorded = True  # the exporter's records count: query and wait ask the backend
    event._opened_from = ticket.pid
    event._finalizer = weakref.finalize(event, _destroy, runtime, index, handle)
    return event


def _destroy(runtime: Runtime, index: int, handle: int) -> None:
    # Through the runtime, not a bound method of the backend: after a fork the
    # runtime's backend is a stand-in that ignores releases of the parent's events.
    runtime.backend.event_destroy(index, handle)


def as_event(obj: object, role: str) -> Event | _ForeignEvent:
    """``obj`` as something with ``wait(stream)``: an accel Event, or a torch event
    (which then waits on the torch view of the accel stream)."""
    if isinstance(obj, Event):
        return obj
    torch = sys.modules.get("torch")  # a torch event implies torch is imported already
    if torch is not None and isinstance(obj, (torch.Event, torch.cuda.Event)):
        return _ForeignEvent(obj)
    raise InvalidValueError(
        f"{role}={obj!r} ({type(obj).__name__}) is not an event: pass an accel.Event or a torch event"
    )


class _ForeignEvent:
    """A torch event waited on by an accel stream, through the stream's torch view."""

    def __init__(self, torch_event: Any) -> None:
        self._event = torch_event

    def wait(self, stream: Stream) -> None:
        kind = getattr(getattr(self._event, "device", None), "type", "cuda")
        if kind != stream.device.type:
            raise DeviceError(f"{self._event!r} is a {kind} event; {stream!r} cannot wait for it")
        self._event.wait(stream.to_torch())
