"""The runtime: the backend this process uses and the per-thread device state.

One backend serves a process, chosen on first use (``ACCEL_BACKEND`` or the
first available of cuda, xpu, cpu). The current device and each device's
current stream are thread-local, like CUDA's.
"""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from accel._device import Device, as_device
from accel._errors import AccelError, DeviceError, HostFunctionError, NotSupportedError, exception_text
from accel._native import speedups
from accel.backends import BACKEND_NAMES, initialized_backend_names, load_backend, select_backend
from accel.backends.base import Backend

if TYPE_CHECKING:
    from accel.stream import Stream

__all__ = [
    "Runtime",
    "activate",
    "check_not_forked",
    "current_backend_name",
    "get_runtime",
    "install_default_stream_wrapper",
    "install_interop_loader",
    "load_interop",
    "requested_backend_name",
]


# Every change of a thread's current streams is made by
# accel._speedups.set_current(streams, index, stream or None): the compiled graphed call
# then asks the thread's state again, and need not ask it otherwise. One C call that tells
# it and stores: told after the store, a call made in between (from a signal handler, a
# profile or trace hook, run as the store's next Python code starts) took the default
# stream, remembered from before, for current; told before, one made in between
# remembered the old state as the new.
_set_current = speedups.set_current


class _ThreadState(threading.local):
    def __init__(self) -> None:
        self.device = 0
        self.streams: dict[int, Stream] = {}
        self.stream_stack: list[tuple[int, int, Stream | None]] = []


def _shared(errors: collections.deque[tuple[str, BaseException]]) -> bool:
    """Whether something besides a list entry (a queued host function, a stream's
    worker) still holds ``errors``: this parameter, getrefcount's argument and the
    entry's tuple account for three references."""
    return sys.getrefcount(errors) > 3


class Runtime:
    """A loaded backend plus the current-device and current-stream state over it."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.name = backend.name
        self._state = _ThreadState()
        self._lock = threading.Lock()
        self._default_streams: dict[int, Stream] = {}
        self.extensions: dict[str, object] = {}  # per-runtime singletons (allocators...)
        # What captured stream work touches, by the backend's capture id (shared
        # by the capturing stream and every stream forked into its capture): the
        # stream layer adds the holds, the graph capturing owns the list (so
        # memory its replays write outlives a free() until the graph is gone).
        self.capture_holds: dict[int, list[object]] = {}
        # Told, with the stream's handle, when a stream taking part in the capture is
        # closed: the graph capturing lets go of what it holds if that drops its capture.
        self.capture_owners: dict[int, Callable[[int, int], None]] = {}
        # Told (device index, handle) when a stream accel created is destroyed, before
        # the backend destroys it: the driver may give the handle to the next stream
        # while the closed stream's queued work still runs, so what a layer above keys
        # by the handle (the caching allocator's cached memory) must stop naming the
        # new stream. Called from finalizers too: a listener never waits for a lock.
        self.stream_destroy_listeners: list[Callable[[int, int], None]] = []
        # Errors of host functions, per (device, stream handle): shared by every
        # wrapper of one stream (Stream, ExternalStream, from_torch...).
        self._host_errors: dict[tuple[int, int], collections.deque[tuple[str, BaseException]]] = {}
        # Those of destroyed streams, per device: their queued work may still fail
        # after the close; device synchronization reports them (as CUDA reports an
        # asynchronous error at the next synchronizing call).
        self._closed_errors: dict[int, list[tuple[int, collections.deque[tuple[str, BaseException]]]]] = {}
        # Closed streams' error queues not yet filed in _closed_errors: destroy_stream
        # runs in finalizers, which a garbage collection may start inside any section
        # holding self._lock (on this thread: waiting for the lock would hang), so it
        # only appends here (atomic under the GIL) and files them when the lock is free;
        # every section that reads _closed_errors files them first.
        self._closed_pending: collections.deque[tuple[int, int, collections.deque[tuple[str, BaseException]]]] = (
            collections.deque()
        )
        # Per device, the length of _closed_errors' list at which it is next pruned:
        # twice what the last pruning kept, so that filing n streams whose failures
        # nobody reported yet scans n entries in all, not n * n / 2 (20 000 of them
        # took minutes), and the list stays within twice what it must keep.
        self._closed_prune_at: dict[int, int] = {}

    def __repr__(self) -> str:
        return f"<accel runtime {self.name}: {self.device_count()} device(s)>"

    def host_errors(self, index: int, handle: int) -> collections.deque[tuple[str, BaseException]]:
        """Where host functions queued on stream ``handle`` of device ``index`` report failures."""
        key = (index, handle)
        errors = self._host_errors.get(key)
        if errors is None:
            with self._lock:
                errors = self._host_errors.setdefault(key, collections.deque())
        return errors

    def take_host_errors(self, index: int, handle: int) -> list[tuple[str, BaseException]]:
        """The host-function failures of a stream reported so far, oldest first."""
        errors = self._host_errors.get((index, handle))
        taken = []
        while errors:  # popleft: a failure reported meanwhile stays for next time
            taken.append(errors.popleft())
        return taken

    def stream_closed_in_capture(self, capture: int, index: int, handle: int) -> None:
        """Stream ``handle`` of device ``index`` was closed while it took part in
        capture ``capture``; the graph capturing decides what that drops."""
        owner = self.capture_owners.get(capture)
        if owner is not None:
            owner(index, handle)

    def destroy_stream(self, index: int, handle: int) -> None:
        """Destroy a stream accel created; failures of its host functions that no
        stream synchronize reported are kept for :meth:`raise_closed_stream_errors`."""
        errors = self._host_errors.pop((index, handle), None)
        if errors is not None:
            self._closed_pending.append((index, handle, errors))
            del errors  # _shared counts references
            if self._lock.acquire(blocking=False):  # never wait: see _closed_pending
                try:
                    self._file_closed()
                finally:
                    self._lock.release()
        try:
            for listener in self.stream_destroy_listeners:
                listener(index, handle)
        finally:  # the stream goes whatever a listener raised
            self.backend.stream_destroy(index, handle)

    def _file_closed(self) -> None:
        """File the error queues destroy_stream left in _closed_pending (lock held)."""
        pending = self._closed_pending
        while pending:  # a finalizer run meanwhile may add more
            index, handle, errors = pending.popleft()
            kept = self._closed_errors.setdefault(index, [])
            kept.append((handle, errors))
            del errors  # _shared counts references
            if len(kept) >= self._closed_prune_at.get(index, 0):
                # No backend call here (this runs in finalizers): what is dropped is what
                # nothing can report into any more, empty and referenced only by this list.
                kept[:] = [entry for entry in kept if entry[1] or _shared(entry[1])]
                self._closed_prune_at[index] = max(16, 2 * len(kept))

    def synchronize_device(self, index: int) -> None:
        """Wait for every stream of device ``index``, closed ones included, then raise
        :class:`~accel.HostFunctionError` for a host function of a closed stream that
        failed and was never reported."""
        with self._lock:
            self._file_closed()
            closed = self._closed_errors.pop(index, [])
            self._closed_prune_at.pop(index, None)
        try:
            self.backend.device_synchronize(index)
        except BaseException:
            with self._lock:  # not waited for: keep them for the next synchronize
                self._file_closed()
                self._closed_errors[index] = closed + self._closed_errors.get(index, [])
            raise
        failures = [(handle, failure) for handle, errors in closed for failure in errors]
        if failures:
            handle, (name, first) = failures[0]
            more = f" (and {len(failures) - 1} more)" if len(failures) > 1 else ""
            raise HostFunctionError(
                f"host function {name} on closed stream {handle:#x} of {self.name}:{index} raised "
                f"{type(first).__name__}: {exception_text(first)}{more} (a closed stream's work still runs; its failures "
                "are reported by the next accel.synchronize() of its device)"
            ) from first

    # -- devices --------------------------------------------------------------

    def device_count(self) -> int:
        return self.backend.device_count()

    def index(self, device: object, *, optional: bool = True) -> int:
        """The device index that ``device`` names on this backend, range-checked.

        None means the current device (or is refused when ``optional`` is
        False). Strings, accel.Device and torch.device must name this backend's
        type; an index of None in them means the current device.
        """
        dev = as_device(device)
        if dev is None:
            if not optional:
                raise DeviceError("a device is required here; pass an index or a device such as 'cpu:0'")
            return self._state.device
        if isinstance(dev, Device):
            if dev.type != self.name:
                raise DeviceError(
                    f"device {str(dev)!r} does not match the current accelerator {self.name!r}"
                    + self._backend_hint(dev.type)
                )
            if dev.index is None:
                return self._state.device
            dev = dev.index
        count = self.device_count()
        if not 0 <= dev < count:
            raise DeviceError(
                f"device index {dev} is out of range: the {self.name} backend has {count} "
                f"device{'s' if count != 1 else ''} (valid indexes 0..{count - 1})"
                + (f"; {self.backend.more_devices_hint}" if self.backend.more_devices_hint else "")
            )
        return dev

    def _backend_hint(self, wanted: str) -> str:
        if wanted in BACKEND_NAMES:
            return f"; start the process with ACCEL_BACKEND={wanted} to use that backend"
        return "; device types are " + ", ".join(repr(name) for name in sorted(BACKEND_NAMES))

    def device(self, index: int) -> Device:
        return Device(self.name, index)

    @property
    def current_index(self) -> int:
        return self._state.device

    def set_current_index(self, index: int) -> None:
        self._state.device = index

    # -- streams ----------------------------------------------------------------

    def default_stream(self, index: int) -> Stream:
        stream = self._default_streams.get(index)
        if stream is None:
            with self._lock:
                stream = self._default_streams.get(index)
                if stream is None:
                    handle = self.backend.default_stream(index)
                    stream = self._default_streams[index] = _wrap_default_stream(self, index, handle)
        return stream

    def current_stream(self, index: int) -> Stream:
        stream = self._state.streams.get(index)
        return stream if stream is not None else self.default_stream(index)

    def set_current_stream(self, stream: Stream) -> None:
        """Make ``stream`` current on its device and make that device current."""
        if stream._runtime is not self:
            raise DeviceError(
                f"{stream!r} belongs to the {stream._runtime.name} backend, not the current "
                f"accelerator {self.name!r}"
            )
        index = stream.device_index
        _set_current(self._state.streams, index, stream)
        self._state.device = index

    def push_stream(self, stream: Stream) -> None:
        """Enter ``stream`` (``with stream:``): remember what to restore."""
        index = stream.device_index
        self._state.stream_stack.append((self._state.device, index, self._state.streams.get(index)))
        self.set_current_stream(stream)

    def pop_stream(self) -> None:
        device, index, previous = self._state.stream_stack.pop()
        _set_current(self._state.streams, index, previous)
        self._state.device = device


def _no_stream_layer(runtime: Runtime, index: int, handle: int) -> Stream:
    raise AccelError("accel.stream is not loaded: import accel before using accel._runtime")


# Wraps a backend's default-stream handle as an accel Stream. The stream layer sits above
# this module and installs it when imported (accel/__init__.py imports it first), so the
# runtime holds the current-stream state without importing the layer that defines Stream.
_wrap_default_stream: Callable[[Runtime, int, int], Stream] = _no_stream_layer


def install_default_stream_wrapper(wrap: Callable[[Runtime, int, int], Stream]) -> None:
    """Set how default-stream handles become accel Streams (called once, by accel.stream)."""
    global _wrap_default_stream
    _wrap_default_stream = wrap


def _no_interop_layer() -> None:
    raise NotSupportedError("accel's buffer exports are not installed: import accel first")


# Loads accel._interop, which gives buffers their exchange formats (DLPack, the CUDA Array
# Interface) when it is imported. That layer sits above the allocator, and importing it
# imports the allocator: accel/__init__.py installs the loader instead of importing it, so
# that `import accel` loads neither, and the allocator calls it before a buffer's first export.
_load_interop: Callable[[], None] = _no_interop_layer


def install_interop_loader(load: Callable[[], None]) -> None:
    """Set how the interop layer is loaded on first need (called once, by accel/__init__.py)."""
    global _load_interop
    _load_interop = load


def load_interop() -> None:
    """Load the interop layer (it installs the buffer exports as it loads)."""
    _load_interop()


_runtime_lock = threading.Lock()
_runtime: Runtime | None = None
_runtimes: dict[str, Runtime] = {}


def _runtime_for(backend: Backend) -> Runtime:
    """The one Runtime over ``backend`` (caller holds ``_runtime_lock``)."""
    runtime = _runtimes.get(backend.name)
    if runtime is None:
        runtime = _runtimes[backend.name] = Runtime(backend)
        # Only the process's runtime: a Runtime made aside (a doctest's) must not take
        # the failures that the streams of this one report.
        backend.host_errors = runtime.host_errors
    return runtime


def get_runtime() -> Runtime:
    """The process's runtime; selects and loads the backend on first use.

    Raises :class:`~accel.BackendUnavailableError` with the reason when the
    backend named by ``ACCEL_BACKEND`` (or every backend) cannot be used, and
    :class:`~accel.AccelError` in a child forked after accel was initialized.
    """
    global _runtime
    runtime = _runtime
    if runtime is None:
        if _forked_from is not None:
            raise AccelError(_fork_message(_forked_from))
        with _runtime_lock:
            if _runtime is None:
                _runtime = _runtime_for(select_backend())
            runtime = _runtime
    return runtime


# -- fork ------------------------------------------------------------------------
#
# A forked child has none of the parent's threads (host stream workers, driver
# threads) and inherits every lock another parent thread held at the fork, so
# the parent's streams, events and memory would hang it. Like CUDA, a child of
# an initialized process refuses accel at once and says to use spawn; a child
# of a process that never initialized accel starts fresh.

_forked_from: str | None = None  # the backends the parent had initialized


def _fork_message(backends: str) -> str:
    return (
        f"accel ({backends}) was initialized in the parent process before it forked; a forked child cannot "
        "use the parent's streams, events or memory (their threads and driver state do not survive fork()). "
        "Start subprocesses with the 'spawn' or 'forkserver' method (multiprocessing.get_context('spawn')), "
        "or use accel only in the children"
    )


class _ForkedBackend:
    """Stands in for the parent's backend in a forked child: every call fails at once
    instead of waiting for a thread or lock that does not exist there. Releases are
    ignored: the resources belong to the parent (finalizers in the child reach them)."""

    def __init__(self, name: str, message: str) -> None:
        self.name = name
        self._message = message

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("_"):
            raise AttributeError(attr)
        if attr.endswith("_destroy") or attr.endswith("free") or attr == "vm_release":
            return _ignore
        raise AccelError(self._message)


def _ignore(*args: object) -> None:
    return None


def _after_fork_in_child() -> None:
    global _runtime, _runtime_lock, _forked_from
    _runtime_lock = threading.Lock()  # another parent thread may have held it
    # A backend loaded (or being loaded by another thread) in the parent has
    # driver state the child cannot use, even before its runtime exists.
    initialized = set(_runtimes) | initialized_backend_names()
    if not initialized:
        return  # the parent never initialized accel: the child starts fresh
    _forked_from = ", ".join(sorted(initialized))
    message = _fork_message(_forked_from)
    for runtime in _runtimes.values():
        runtime.backend = _ForkedBackend(runtime.name, message)  # type: ignore[assignment]
        runtime._lock = threading.Lock()
    _runtime = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def check_not_forked() -> None:
    """Raise at once in a child forked after accel was initialized.

    For calls that reach the parent's state without going through the
    runtime (a buffer's free takes its allocator's lock, which another
    parent thread may have held at the fork)."""
    if _forked_from is not None:
        raise AccelError(_fork_message(_forked_from))


def current_backend_name() -> str:
    """Name of the backend this process uses ("cpu", "cuda" or "xpu")."""
    return get_runtime().name


def requested_backend_name() -> str | None:
    """The backend ``ACCEL_BACKEND`` asks for, if any (lower case)."""
    return os.environ.get("ACCEL_BACKEND", "").strip().lower() or None


@contextlib.contextmanager
def activate(name: str) -> Iterator[Runtime]:
    """Make backend ``name`` the process's runtime inside the block.

    The conformance suite uses this to run the same device-agnostic tests on
    every backend in one process. Not for use while other threads use accel.
    """
    global _runtime
    backend = load_backend(name)
    with _runtime_lock:
        previous = _runtime
        runtime = _runtime = _runtime_for(backend)
    try:
        yield runtime
    finally:
        with _runtime_lock:
            _runtime = previous

