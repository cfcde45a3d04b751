"""Streams: ordered queues of device work."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import functools
import sys
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from accel._device import Device, DeviceLike
from accel._errors import (
    AccelError,
    DeviceError,
    HostFunctionError,
    InvalidHandleError,
    InvalidValueError,
    NotSupportedError,
    exception_text,
    function_name,
)
from accel._runtime import Runtime, get_runtime, install_default_stream_wrapper
from accel._torch import import_torch
from accel.backends.base import CaptureStatus
from accel.stream._operands import byte_count, operand

if TYPE_CHECKING:
    from accel.stream._event import Event

__all__ = ["ExternalStream", "Stream", "as_stream"]


def _launch_slow(ref: weakref.ref[Stream], fn: Callable[[], object]) -> None:
    """The full launch_host_func path, for a call the backend's fast path cannot take."""
    stream = ref()
    if stream is None:  # only reachable through a launch_host_func kept past its stream
        raise InvalidHandleError("the stream of this launch_host_func was garbage-collected (and so closed)")
    Stream.launch_host_func(stream, fn)


class Stream:
    """An ordered queue of work on one device.

    Work queued on a stream runs in order; work on different streams may
    overlap unless ordered with events. ``with stream:`` makes it the current
    stream (and its device the current device) inside the block.

    >>> import accel
    >>> s = accel.Stream()
    >>> with s:
    ...     assert accel.current_stream() == s
    >>> s.synchronize()
    """

    _runtime: Runtime
    _device: int
    _handle: int
    _priority: int
    _owned: bool

    def __init__(self, device: DeviceLike = None, *, priority: int = 0) -> None:
        runtime = get_runtime()
        index = runtime.index(device)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidValueError(f"priority={priority!r} must be an int")
        least, greatest = runtime.backend.stream_priority_range(index)
        clamped = min(max(priority, greatest), least)  # lower number = higher priority
        handle = runtime.backend.stream_create(index, clamped)
        self._init(runtime, index, handle, clamped, owned=True)
        # The backend's fast path for host functions, bound as this object's method: one
        # call from the user to the queue. It holds no reference to this Stream (the
        # finalizer must still run when the last user reference goes).
        launcher = runtime.backend.host_func_launcher(
            index, handle, self._host_errors(), functools.partial(_launch_slow, weakref.ref(self))
        )
        if launcher is not None:
            launcher.__doc__ = Stream.launch_host_func.__doc__
            self.launch_host_func = launcher  # type: ignore[method-assign,assignment]

    def _init(self, runtime: Runtime, index: int, handle: int, priority: int, *, owned: bool) -> None:
        self._runtime = runtime
        self._device = index
        self._handle = handle
        self._priority = priority
        self._owned = owned
        self._closed = False
        # Where host functions report failures: shared by every wrapper of the stream.
        self._errors: collections.deque[tuple[str, BaseException]] | None = None
        self._end: Event | None = None  # marks the end of the work queued before close()
        self._close_lock = threading.Lock()
        self._finalizer = (
            weakref.finalize(self, runtime.destroy_stream, index, handle) if owned else None
        )

    @classmethod
    def _wrap(cls, runtime: Runtime, index: int, handle: int, *, owned: bool) -> Stream:
        stream = cls.__new__(cls)
        stream._init(runtime, index, handle, 0, owned=owned)
        return stream

    # -- identity ---------------------------------------------------------

    @property
    def native_handle(self) -> int:
        """The backend's handle as an int: a ``CUstream`` address on CUDA, a
        ``ze_command_list_handle_t`` (immediate command list) on Level Zero, an
        accel queue id on the host."""
        return self._handle

    @property
    def device(self) -> Device:
        return self._runtime.device(self._device)

    @property
    def device_index(self) -> int:
        return self._device

    @property
    def stream_id(self) -> int:
        """An int that names this stream among the device's streams, as
        ``torch.Stream.stream_id``: the native handle."""
        return self._handle

    @property
    def device_type(self) -> int:
        """torch's ``DeviceType`` number of the stream's device (as
        ``torch.Stream.device_type``: 0 host, 1 CUDA, 12 XPU); ``device.type``
        is its name."""
        return _TORCH_DEVICE_TYPES[self._runtime.name]

    @property
    def priority(self) -> int:
        """The priority the stream was created with (clamped to the device's range)."""
        return self._priority

    @property
    def __cuda_stream__(self) -> Callable[[], tuple[int, int]]:
        """The CUDA stream protocol, ``(version, CUstream address)``; CUDA streams only."""
        if self._runtime.backend.stream_protocol != "__cuda_stream__":
            raise AttributeError(f"__cuda_stream__ is only defined for CUDA streams, not {self._runtime.name}")
        handle = self._handle
        return lambda: (0, handle)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Stream):
            return NotImplemented
        return (self._runtime.name, self._device, self._handle) == (
            other._runtime.name,
            other._device,
            other._handle,
        )

    def __hash__(self) -> int:
        return hash((self._runtime.name, self._device, self._handle))

    def __repr__(self) -> str:
        kind = type(self).__name__
        state = " closed" if self._closed else ""
        return f"accel.{kind}(device={self.device}, native_handle={self._handle:#x}, priority={self._priority}{state})"

    # -- state -------------------------------------------------------------

    def _live(self) -> int:
        if self._closed:
            raise InvalidHandleError(f"{self!r} was closed; create a new accel.Stream")
        return self._handle

    def close(self) -> None:
        """Destroy the stream (work already queued still completes).

        New work is refused afterwards, but the stream can still be waited
        on: ``other.wait_stream(s)`` and ``s.record_event()`` order after the
        work queued before the close. Closing an :class:`ExternalStream` only
        retires this wrapper; the device's default stream cannot be closed
        (this is a no-op)."""
        if self._handle == self._runtime.backend.default_stream(self._device) and not self._owned:
            return
        capture = 0
        with self._close_lock:
            if self._closed:
                return
            if self._finalizer is not None:
                with contextlib.suppress(AccelError):
                    capture = self._runtime.backend.stream_capture_id(self._device, self._handle)
                self._end = self._mark_end()
            self._closed = True
        if self._finalizer is not None:
            self._finalizer()
        if capture:
            # Closing may have dropped a capture: nothing can replay it, so what its
            # graph holds (freed buffers' memory, its pool) must go now, not when
            # the graph is next touched or collected.
            self._runtime.stream_closed_in_capture(capture, self._device, self._handle)

    def _mark_end(self) -> Event | None:
        """An event after all work queued so far, recorded just before the stream is
        destroyed (None when there is nothing left to wait for)."""
        from accel.stream._event import Event

        try:
            if self.is_capturing():
                return None  # the capture is abandoned: its work never runs
            end = Event(device=self._device)
            end.record(self)
            return end
        except AccelError:
            # The driver refused the record: wait here instead, so that waiting
            # on the closed stream later has nothing left to wait for.
            with contextlib.suppress(AccelError):
                self._runtime.backend.stream_synchronize(self._device, self._handle)
            return None

    def query(self) -> bool:
        """True when all work queued so far has completed."""
        return self._runtime.backend.stream_query(self._device, self._live())

    def synchronize(self) -> None:
        """Wait for all work queued so far; re-raises a failed host function."""
        self._runtime.backend.stream_synchronize(self._device, self._live())
        self._raise_host_errors()

    def is_capturing(self) -> bool:
        """Whether the stream is recording into a graph."""
        status = self._runtime.backend.stream_capture_status(self._device, self._live())
        return status != CaptureStatus.NONE

    # -- ordering ------------------------------------------------------------

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``'s last record."""
        from accel.stream._event import as_event

        as_event(event, "event").wait(self)

    def wait_stream(self, stream: Stream) -> None:
        """Make later work on this stream wait for the work queued on ``stream`` so far.

        ``stream`` may be a torch stream of the same device, or closed: then this
        waits for the work queued before its close.
        """
        from accel.stream._event import Event

        other = as_stream(stream, role="stream", optional=False)
        if other._closed and other._owned:
            if other._end is not None:
                self.wait_event(other._end)
            return
        self.wait_event(other.record_event(Event()))

    def record_event(self, event: Event | None = None) -> Event:
        """Record ``event`` (a new one if None) at the current end of this stream.

        On a closed stream, a new event completes with the work queued before
        the close; recording a given event there is refused."""
        from accel.stream._event import Event, as_event

        if event is None and self._closed and self._owned:
            return self._event_after_end()
        event = Event() if event is None else event
        as_event(event, "event")  # an accel or torch event, else an error naming the argument
        if isinstance(event, Event):
            event.record(self)
            return event
        try:
            event.record(self.to_torch())
        except RuntimeError as exc:  # torch's CPU events cannot be recorded at all
            raise NotSupportedError(f"torch cannot record {event!r} on {self!r}: {exc}") from exc
        return event

    def _event_after_end(self) -> Event:
        """A new event that completes with a closed stream's last work."""
        from accel.stream._event import Event

        event = Event(device=self._device)
        # The end event stays private (a caller could re-record the one it is given):
        # record the new one on a helper stream that waits for the end.
        helper = Stream(self._device)
        try:
            helper.wait_stream(self)
            event.record(helper)
        finally:
            helper.close()
        return event

    # -- work ----------------------------------------------------------------

    def copy(self, dst: Any, src: Any, nbytes: int | None = None) -> None:
        """Copy ``nbytes`` from ``src`` to ``dst`` in stream order.

        Operands are addresses, accel buffers or contiguous arrays; ``nbytes``
        defaults to the smaller operand and may not run past either.
        """
        d, s = operand(dst, "dst"), operand(src, "src")
        n = byte_count(nbytes, d, s)
        if n:
            self._runtime.backend.memcpy_async(self._device, d.ptr, s.ptr, n, self._live())
            self._keep_alive(d.owner, s.owner)

    def fill(self, dst: Any, value: int, nbytes: int | None = None) -> None:
        """Set ``nbytes`` bytes of ``dst`` to ``value`` (0..255) in stream order."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 255:
            raise InvalidValueError(f"fill value {value!r} must be a byte, 0..255")
        d = operand(dst, "dst")
        n = byte_count(nbytes, d)
        if n:
            self._runtime.backend.memset_async(self._device, d.ptr, value, n, self._live())
            self._keep_alive(d.owner)

    def launch_host_func(self, fn: Callable[[], object]) -> None:
        """Run ``fn()`` on a host thread once the work queued before it completed.

        An exception from ``fn`` is re-raised (as :class:`~accel.HostFunctionError`)
        by the next :meth:`synchronize` of this stream, whichever wrapper of
        the stream calls it. As with CUDA host functions, ``fn`` must not wait
        on accel streams or events (it would wait on itself); it may do host
        work and set Python-level flags.
        """
        if not callable(fn):
            raise InvalidValueError(f"{fn!r} is not callable")
        if self._closed:
            self._live()  # raises
        handle = self._handle
        errors = self._host_errors()
        name = function_name(fn)

        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported at synchronize
                errors.append((name, exc))

        run.__qualname__ = name
        self._runtime.backend.launch_host_func(self._device, handle, run)

    def _host_errors(self) -> collections.deque[tuple[str, BaseException]]:
        """Where host functions queued on this stream report failures (shared by its wrappers)."""
        errors = self._errors
        if errors is None:
            errors = self._errors = self._runtime.host_errors(self._device, self._handle)
        return errors

    def _keep_alive(self, *owners: object) -> None:
        """Hold Python objects that own copy operands until the work ran.

        accel buffers free in stream order and need no holding, except in a
        capture: every replay writes them, so the capturing graph holds their
        memory (a free() meanwhile takes effect when the graph is gone), whichever
        of the capture's streams the work was queued on."""
        if self._runtime.capture_holds:
            self._hold_for_capture(owners)
        owners = tuple(o for o in owners if o is not None and not _is_stream_ordered(o))
        if owners:

            def keep(_owners: tuple[object, ...] = owners) -> None:
                """Does nothing: the backend holds it, and its default the owners, until the work ran."""

            self._runtime.backend.launch_host_func(self._device, self._handle, keep)

    def _hold_for_capture(self, owners: tuple[object, ...]) -> None:
        """Give the accel buffers among ``owners`` to the graph whose capture this
        stream takes part in (began it, or was forked into it), if any."""
        leases = [lease for o in owners if _is_stream_ordered(o) and (lease := getattr(o, "_export_lease", None))]
        if leases:
            capture = self._runtime.backend.stream_capture_id(self._device, self._handle)
            held = self._runtime.capture_holds.get(capture) if capture else None
            if held is not None:
                held.extend(lease() for lease in leases)

    def _raise_host_errors(self) -> None:
        failures = self._runtime.take_host_errors(self._device, self._handle)
        if failures:
            name, first = failures[0]
            more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            raise HostFunctionError(
                f"host function {name} on {self!r} raised {type(first).__name__}: {exception_text(first)}{more}"
            ) from first

    # -- current stream ------------------------------------------------------

    def __enter__(self) -> Stream:
        self._live()
        self._runtime.push_stream(self)
        return self

    def __exit__(self, *exc: object) -> None:
        self._runtime.pop_stream()

    # -- torch interop -------------------------------------------------------

    @classmethod
    def from_torch(cls, torch_stream: Any) -> Stream:
        """The accel Stream for a torch stream (``torch.Stream``, ``torch.cuda.Stream``).

        CUDA: an :class:`ExternalStream` over the same ``CUstream``. CPU: the
        host backend's default stream of the current device, which runs work
        inline like torch's CPU stream.

        >>> import accel, torch
        >>> accel.Stream.from_torch(torch.Stream("cpu")) == accel.current_stream()
        True
        """
        torch = import_torch()
        if not isinstance(torch_stream, torch.Stream) and not hasattr(torch_stream, "__cuda_stream__"):
            raise InvalidValueError(
                f"{torch_stream!r} ({type(torch_stream).__name__}) is not a torch stream; "
                "pass a torch.Stream or torch.cuda.Stream"
            )
        device = getattr(torch_stream, "device", None)
        kind = getattr(device, "type", "cuda")
        runtime = get_runtime()
        if kind != runtime.backend.torch_device_type:
            raise DeviceError(f"{torch_stream!r} is a {kind} stream, but the current accelerator is {runtime.name!r}")
        if kind == "cpu":
            return runtime.default_stream(runtime.current_index)
        if kind == "cuda":
            if hasattr(torch_stream, "__cuda_stream__"):
                _, handle = torch_stream.__cuda_stream__()
            else:
                handle = torch_stream.native_handle
            return ExternalStream(int(handle), getattr(device, "index", None))
        raise NotSupportedError(_NO_SHARED_STREAMS.format(kind=kind))

    def to_torch(self) -> Any:
        """The torch stream for this stream.

        CUDA: ``torch.cuda.ExternalStream`` over the same ``CUstream``. Host:
        torch's CPU stream; torch CPU work runs inline on the calling thread,
        so synchronize a non-default accel host stream before torch reads its
        results.

        >>> import accel
        >>> accel.current_stream().to_torch()
        torch.Stream device_type=cpu, device_index=-1, stream_id=0
        """
        torch = import_torch()
        kind = self._runtime.backend.torch_device_type
        if kind == "cpu":
            return torch.Stream("cpu")
        if kind == "cuda":
            try:
                return torch.cuda.ExternalStream(self.native_handle, device=torch.device("cuda", self._device))
            except (RuntimeError, AssertionError) as exc:  # a torch built without CUDA
                raise NotSupportedError(
                    f"torch {torch.__version__} cannot use {self!r} ({exc}); install a torch build "
                    "for CUDA, or order work across accel and torch with synchronize()"
                ) from exc
        raise NotSupportedError(_NO_SHARED_STREAMS.format(kind=kind))


_HANDLE_LIMIT = 1 << (8 * ctypes.sizeof(ctypes.c_void_p))

# c10::DeviceType's numbers, which torch.Stream.device_type reports.
_TORCH_DEVICE_TYPES = {"cpu": 0, "cuda": 1, "xpu": 12}

# torch's XPU streams are SYCL queues; accel's are Level Zero command lists.
_NO_SHARED_STREAMS = (
    "accel cannot share {kind} streams with torch: torch's XPU streams are SYCL queues, "
    "accel's are Level Zero command lists. Order work across them with synchronize()"
)


def _is_stream_ordered(owner: object) -> bool:
    """accel buffers manage their own lifetime in stream order."""
    return getattr(owner, "__accel_buffer__", False) is True


class ExternalStream(Stream):
    """A stream accel did not create and does not own (from torch, CuPy, a C library).

    ``handle`` is the native handle as an int (a ``CUstream`` address on CUDA).
    Closing it does nothing to the underlying stream.

    >>> import accel
    >>> s = accel.Stream()
    >>> accel.ExternalStream(s.native_handle) == s
    True
    """

    def __init__(self, handle: int, device: DeviceLike = None) -> None:
        # A handle wider than a pointer would be wrapped silently by the driver binding (2**64: NULL).
        if isinstance(handle, bool) or not isinstance(handle, int) or not 0 <= handle < _HANDLE_LIMIT:
            raise InvalidValueError(f"handle={handle!r} must be a stream handle (a non-negative int of pointer width)")
        runtime = get_runtime()
        index = runtime.index(device)
        # Asking the backend about the handle now turns a wrong handle into an
        # error here, instead of in the middle of later work.
        runtime.backend.stream_capture_status(index, handle)
        self._init(runtime, index, handle, 0, owned=False)


def as_stream(obj: object, device: DeviceLike = None, *, role: str = "stream", optional: bool = True) -> Stream:
    """An accel Stream for ``obj``: a Stream, a torch stream, or an object speaking ``__cuda_stream__``.

    None means the current stream of ``device`` when ``optional``, else an
    error naming the argument ``role``.
    """
    if obj is None:
        if not optional:
            raise InvalidValueError(f"{role}=None: pass a stream (an accel.Stream or a torch stream)")
        runtime = get_runtime()
        return runtime.current_stream(runtime.index(device))
    if isinstance(obj, Stream):
        return obj
    torch = sys.modules.get("torch")  # a torch stream implies torch is imported already
    if torch is not None and isinstance(obj, torch.Stream):
        return Stream.from_torch(obj)
    # Not on a class: its __cuda_stream__ is an unbound function.
    protocol = None if isinstance(obj, type) else getattr(obj, "__cuda_stream__", None)
    if protocol is not None:
        runtime = get_runtime()
        if runtime.backend.stream_protocol != "__cuda_stream__":
            raise DeviceError(
                f"{type(obj).__name__} is a CUDA stream, but the current accelerator is {runtime.name!r}"
            )
        _, handle = protocol()
        return ExternalStream(int(handle), device)
    raise InvalidValueError(
        f"{role}={obj!r} ({type(obj).__name__}) is not a stream: pass an accel.Stream, a torch stream "
        "or an object with __cuda_stream__"
    )


def _wrap_default_stream(runtime: Runtime, index: int, handle: int) -> Stream:
    return Stream._wrap(runtime, index, handle, owned=False)


install_default_stream_wrapper(_wrap_default_stream)
