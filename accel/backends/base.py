"""The Backend protocol: the one seam between accel and a vendor runtime.

Everything above this module (devices, streams, events, the caching
allocator, graphs, the facade) talks to hardware only through a
:class:`Backend`. Vendor code (cffi bindings, driver quirks, versioned entry
points) lives below it, in ``accel/backends/<name>/``.

Conventions every implementation follows:

- **Handles are plain ints**: device pointers, streams, events, physical
  memory handles, graphs and executable graphs. ``0`` is never a valid handle
  except where :meth:`Backend.default_stream` returns it (CUDA's legacy
  default stream is ``NULL``).
- **Devices are ints** ``0 <= device < device_count()``; the layer above has
  already validated them, so a backend may assume a valid index.
- **Errors** are accel's own types: :class:`~accel.OutOfMemoryError` when a
  device allocation cannot be satisfied (the allocator relies on this to
  free its cache and retry), :class:`~accel.InvalidHandleError` for a closed
  or unknown handle, :class:`~accel.CaptureError` for misuse of stream
  capture, :class:`~accel.NotSupportedError` for an optional feature the
  device lacks, and :class:`~accel.DriverError` for anything else the driver
  reports.
- **Thread safety**: every method may be called from any thread.
- **Streams are non-blocking**: work on a created stream never waits
  implicitly for the default stream, and the reverse (CUDA's
  ``CU_STREAM_NON_BLOCKING``, the way PyTorch creates its streams).
"""

from __future__ import annotations

import abc
import collections
import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

__all__ = [
    "Backend",
    "BackendInfo",
    "CaptureMode",
    "CaptureStatus",
    "DeviceProperties",
    "TorchIntegration",
]


class CaptureMode(enum.IntEnum):
    """How strictly unsafe calls are refused while a stream captures (CUDA's modes)."""

    GLOBAL = 0
    THREAD_LOCAL = 1
    RELAXED = 2


class CaptureStatus(enum.IntEnum):
    """Capture state of a stream."""

    NONE = 0
    ACTIVE = 1
    INVALIDATED = 2


class TorchIntegration(enum.Enum):
    """How torch ops run during a capture take part in it, as a backend declares
    (:attr:`Backend.torch_integration`); the graph layer picks its one torch
    integration by it, never by the backend's name."""

    #: torch has no devices of this backend: its ops are not part of captures.
    NONE = "none"
    #: torch's CPU ops are this backend's work: a capture records them op by op (the host).
    RECORD_HOST_OPS = "record_host_ops"
    #: torch's device graphs capture on this backend's own driver streams, so its
    #: kernels and the backend's stream work land in one graph (CUDA).
    SHARED_STREAMS = "shared_streams"
    #: torch's device streams are not this backend's: torch ops on its devices
    #: cannot join a capture and are refused (Level Zero under SYCL queues).
    SEPARATE_STREAMS = "separate_streams"


@dataclass(frozen=True)
class DeviceProperties:
    """What a backend knows about one device.

    ``extra`` holds backend-specific facts (clock rate, L2 size, where
    ``(free, total)`` comes from...) under stable string keys.
    """

    name: str
    type: str
    index: int
    total_memory: int
    uuid: str
    multi_processor_count: int
    driver_version: str
    compute_capability: tuple[int, int] | None = None
    pci_bus_id: str | None = None
    is_integrated: bool = False
    extra: Mapping[str, object] = field(default_factory=dict)


@dataclass(frozen=True)
class BackendInfo:
    """Whether a backend can be used here and, if not, why (one line)."""

    name: str
    available: bool
    reason: str = ""
    device_count: int = 0
    driver_version: str = ""


class Backend(abc.ABC):
    """A vendor runtime behind one narrow, int-handle interface.

    Optional features (virtual memory, graphs) have a ``supports_*`` query;
    calling them where unsupported raises :class:`~accel.NotSupportedError`.
    """

    #: Short name used in device strings and ``ACCEL_BACKEND``: "cpu", "cuda", "xpu".
    name: str = ""
    #: torch's device type for this backend's devices ("cpu" for the host), or None.
    torch_device_type: str | None = None
    #: How torch ops take part in captures on this backend.
    torch_integration: TorchIntegration = TorchIntegration.NONE
    #: The stream-exchange protocol its stream handles speak ("__cuda_stream__": they are
    #: CUstreams other CUDA libraries can use), or None.
    stream_protocol: str | None = None
    #: How a user presents more devices, for an out-of-range index's error ("" if they cannot).
    more_devices_hint: str = ""
    #: Whether :meth:`host_malloc` gives page-locked memory the device copies from
    #: asynchronously (cuMemHostAlloc, zeMemAllocHost); False where it is ordinary pages.
    host_memory_page_locked: bool = False
    #: Set by the process's runtime: ``host_errors(device, stream)`` is where a
    #: function the backend runs on a host thread of its own (a host function, an
    #: internal wait) reports an exception, as ``(name, exception)``; the next
    #: synchronize of that stream raises it as HostFunctionError, as CUDA reports
    #: an asynchronous error at the next synchronizing call. None without a runtime.
    host_errors: Callable[[int, int], collections.deque[tuple[str, BaseException]]] | None = None

    @property
    def torch_runs_inline(self) -> bool:
        """Whether torch's work on this backend's devices runs inline in the calling
        thread (done when the op returns: nothing queued to synchronize, host timers
        time it), which follows from its ops being the host's own
        (:attr:`TorchIntegration.RECORD_HOST_OPS`); False where they are queued on a
        device, or where torch has no devices of this backend."""
        return self.torch_integration is TorchIntegration.RECORD_HOST_OPS

    # -- devices ---------------------------------------------------------

    @abc.abstractmethod
    def device_count(self) -> int:
        """Number of devices this backend presents (at least 1 once loaded)."""

    @abc.abstractmethod
    def device_properties(self, device: int) -> DeviceProperties:
        """Static facts about ``device``."""

    @abc.abstractmethod
    def memory_info(self, device: int) -> tuple[int, int]:
        """``(free, total)`` bytes of device memory, device-wide (all processes)."""

    @abc.abstractmethod
    def can_access_peer(self, device: int, peer: int) -> bool:
        """Whether ``device`` can read and write memory allocated on ``peer``."""

    @abc.abstractmethod
    def device_synchronize(self, device: int) -> None:
        """Wait for all work on all streams of ``device``."""

    # -- memory ----------------------------------------------------------

    @abc.abstractmethod
    def malloc(self, device: int, nbytes: int) -> int:
        """Allocate ``nbytes`` (> 0) of device memory, at least 512-byte aligned.

        Raises :class:`~accel.OutOfMemoryError` when the device cannot
        satisfy it, and nothing is leaked.
        """

    @abc.abstractmethod
    def free(self, device: int, ptr: int) -> None:
        """Free memory returned by :meth:`malloc`. Not stream-ordered: the caller
        makes sure no pending work still uses it."""

    @abc.abstractmethod
    def host_malloc(self, nbytes: int) -> int:
        """Allocate page-locked host memory usable for async copies."""

    @abc.abstractmethod
    def host_free(self, ptr: int) -> None:
        """Free memory returned by :meth:`host_malloc`."""

    # -- virtual memory (optional; expandable segments) ------------------

    def supports_virtual_memory(self, device: int) -> bool:
        """Whether the vm_* methods work on ``device``."""
        return False

    def vm_granularity(self, device: int) -> int:
        """Size and alignment unit of reservations and physical chunks."""
        raise self._unsupported("virtual memory")

    def vm_reserve(self, device: int, nbytes: int) -> int:
        """Reserve ``nbytes`` of address space (a multiple of the granularity)."""
        raise self._unsupported("virtual memory")

    def vm_free(self, device: int, addr: int, nbytes: int) -> None:
        """Give back a reservation made by :meth:`vm_reserve` (all of it unmapped)."""
        raise self._unsupported("virtual memory")

    def vm_create(self, device: int, nbytes: int) -> int:
        """Create a physical chunk of ``nbytes``; returns its handle.

        Raises :class:`~accel.OutOfMemoryError` when the device is full."""
        raise self._unsupported("virtual memory")

    def vm_release(self, device: int, handle: int) -> None:
        """Release a physical chunk (its memory goes once it is also unmapped)."""
        raise self._unsupported("virtual memory")

    def vm_map(self, device: int, addr: int, nbytes: int, handle: int) -> None:
        """Map a whole physical chunk at ``addr`` inside a reservation, read-write."""
        raise self._unsupported("virtual memory")

    def vm_unmap(self, device: int, addr: int, nbytes: int) -> None:
        """Unmap ``[addr, addr + nbytes)``; the range stays reserved."""
        raise self._unsupported("virtual memory")

    # -- sharing with other processes (optional) --------------------------
    #
    # An export is ``(payload, fds)``: bytes that describe the memory or event,
    # and file descriptors that must travel with them (SCM_RIGHTS). The caller
    # owns the returned descriptors and closes them; an import takes ownership
    # of the descriptors it is given (it closes them, on success or failure).
    # Carrying them to the other process, and keeping the exporter's memory
    # allocated while an importer holds it, is the layer above's job.

    def supports_ipc(self, device: int) -> bool:
        """Whether the ipc_* methods work on ``device``."""
        return False

    def ipc_memory_export(self, device: int, ptr: int, nbytes: int) -> tuple[bytes, list[int]]:
        """Describe ``[ptr, ptr + nbytes)``, inside memory from :meth:`malloc` or
        mapped by :meth:`vm_map`, so that another process can map it."""
        raise self._unsupported("sharing memory with other processes")

    def ipc_memory_import(self, device: int, payload: bytes, fds: list[int], nbytes: int) -> int:
        """Map memory exported by another process; returns its address here, the
        start of ``nbytes`` mapped bytes. A description that does not map them
        (damaged, or forged by another process) raises InvalidHandleError."""
        raise self._unsupported("sharing memory with other processes")

    def ipc_memory_close(self, device: int, ptr: int) -> None:
        """Unmap memory returned by :meth:`ipc_memory_import` (the caller has
        made sure no queued work still uses it)."""
        raise self._unsupported("sharing memory with other processes")

    def ipc_event_export(self, device: int, event: int) -> tuple[bytes, list[int]]:
        """Describe an event created with ``interprocess=True`` for another process."""
        raise self._unsupported("sharing events with other processes")

    def ipc_event_import(self, device: int, payload: bytes, fds: list[int]) -> int:
        """Open an event exported by another process; returns an event handle
        that :meth:`event_query`, :meth:`event_synchronize`,
        :meth:`stream_wait_event` and :meth:`event_destroy` accept."""
        raise self._unsupported("sharing events with other processes")

    # -- streams ---------------------------------------------------------

    @abc.abstractmethod
    def default_stream(self, device: int) -> int:
        """Handle of the device's default stream (never destroyed)."""

    @abc.abstractmethod
    def stream_priority_range(self, device: int) -> tuple[int, int]:
        """``(least, greatest)`` priority; lower numbers mean higher priority."""

    @abc.abstractmethod
    def stream_create(self, device: int, priority: int) -> int:
        """Create a non-blocking stream; ``priority`` is already clamped to the range."""

    @abc.abstractmethod
    def stream_destroy(self, device: int, stream: int) -> None:
        """Destroy a stream created here; work already queued still completes."""

    @abc.abstractmethod
    def stream_query(self, device: int, stream: int) -> bool:
        """True when all work queued on ``stream`` has completed."""

    @abc.abstractmethod
    def stream_synchronize(self, device: int, stream: int) -> None:
        """Block until all work queued on ``stream`` has completed."""

    @abc.abstractmethod
    def stream_wait_event(self, device: int, stream: int, event: int) -> None:
        """Make future work on ``stream`` wait for the last record of ``event``.

        ``event`` may belong to another device of this backend. Waiting on an
        event that was never recorded is a no-op."""

    # -- events ----------------------------------------------------------

    @abc.abstractmethod
    def event_create(self, device: int, *, timing: bool, blocking: bool, interprocess: bool) -> int:
        """Create an event; ``timing`` enables :meth:`event_elapsed_ms`."""

    @abc.abstractmethod
    def event_destroy(self, device: int, event: int) -> None:
        """Destroy an event."""

    @abc.abstractmethod
    def event_record(self, device: int, event: int, stream: int) -> None:
        """Record ``event`` at the current end of ``stream``'s queue."""

    def event_record_external(self, device: int, event: int, stream: int) -> None:
        """Record ``event`` on ``stream`` so that a capture keeps the record.

        Outside a capture it is :meth:`event_record`. On a capturing stream,
        where :meth:`event_record` only marks a position other streams of the
        capture may wait for, the record becomes a node of the graph: each
        replay records the event when it reaches that point, so timing events
        can time replays (CUDA's ``CU_EVENT_RECORD_EXTERNAL``, torch's
        ``Event(external=True)``). Such an event is not a capture position."""
        raise self._unsupported("event records kept by a capture")

    def stream_wait_event_external(self, device: int, stream: int, event: int) -> None:
        """Make ``stream`` wait for ``event`` so that a capture keeps the wait.

        Outside a capture it is :meth:`stream_wait_event`. On a capturing
        stream, where :meth:`stream_wait_event` refuses an event recorded
        outside the capture, the wait becomes a node of the graph (CUDA's
        ``CU_EVENT_WAIT_EXTERNAL``, torch's ``Event(external=True)``): each
        replay waits, from that node on, for the event's last record as it
        stands when the replay is queued (a record made outside, or by
        another graph's replay queued before). It neither forks ``stream``
        into a capture nor joins one."""
        raise self._unsupported("event waits kept by a capture")

    @abc.abstractmethod
    def event_query(self, device: int, event: int) -> bool:
        """True when the work before the last record has completed (or never recorded)."""

    @abc.abstractmethod
    def event_synchronize(self, device: int, event: int) -> None:
        """Block until the last record of ``event`` has completed."""

    @abc.abstractmethod
    def event_elapsed_ms(self, device: int, start: int, end: int) -> float:
        """Milliseconds between two completed timing events."""

    # -- stream work -----------------------------------------------------

    @abc.abstractmethod
    def memcpy_async(self, device: int, dst: int, src: int, nbytes: int, stream: int) -> None:
        """Copy ``nbytes`` from ``src`` to ``dst`` in stream order.

        Either pointer may be device memory of this backend or host memory
        from :meth:`host_malloc`."""

    @abc.abstractmethod
    def memset_async(self, device: int, dst: int, value: int, nbytes: int, stream: int) -> None:
        """Set ``nbytes`` bytes at ``dst`` to ``value`` (0..255) in stream order."""

    @abc.abstractmethod
    def launch_host_func(self, device: int, stream: int, fn: Callable[[], None]) -> None:
        """Run ``fn`` on a host thread once prior work on ``stream`` completed;
        later work on the stream waits for it. ``fn`` must not raise (the layer
        above wraps it) and must not call into the backend's stream API."""

    def host_func_launcher(
        self,
        device: int,
        stream: int,
        errors: collections.deque[tuple[str, BaseException]],
        fallback: Callable[[Callable[[], object]], None],
    ) -> Callable[[Callable[[], object]], None] | None:
        """Optional fast path for host functions on a created ``stream``: a function
        that queues ``fn`` unwrapped, reporting an exception it raises as
        ``(name, exception)`` in ``errors``, and calls ``fallback(fn)`` whenever
        it cannot (capture, closed stream, ``fn`` not callable). None when the
        backend has no such path (every call then goes to :meth:`launch_host_func`)."""
        return None

    # -- capture and graphs (optional) -----------------------------------

    def supports_graphs(self, device: int) -> bool:
        """Whether stream capture and graph replay work on ``device``."""
        return False

    def stream_begin_capture(self, device: int, stream: int, mode: CaptureMode) -> None:
        """Start recording work queued on ``stream`` into a graph instead of running it."""
        raise self._unsupported("graph capture")

    def stream_end_capture(self, device: int, stream: int) -> int:
        """Stop recording; returns the captured graph's handle.

        Raises :class:`~accel.CaptureError` if the capture was invalidated or
        a forked stream was not joined back."""
        raise self._unsupported("graph capture")

    def stream_capture_status(self, device: int, stream: int) -> CaptureStatus:
        """Capture state of ``stream`` (NONE where graphs are unsupported)."""
        return CaptureStatus.NONE

    def stream_capture_id(self, device: int, stream: int) -> int:
        """The id of the capture ``stream`` takes part in, 0 when it is not capturing
        (CUDA: ``cuStreamGetCaptureInfo``'s id).

        A stream forked into a capture has the id of the stream that began it,
        and ids are unique within the process, so layers above can tell which
        capture work queued on any stream lands in."""
        return 0

    def stream_capture_length(self, device: int, stream: int) -> int | None:
        """How many operations the capture ``stream`` takes part in has recorded
        so far (all its streams together), or None when ``stream`` is not
        capturing or the backend cannot tell.

        Layers above use it to see whether anything else was recorded between
        two of their own operations (e.g. to batch consecutive torch ops into
        one node); None must always be a safe answer."""
        return None

    def graph_node_count(self, device: int, graph: int) -> int | None:
        """How many nodes the captured ``graph`` holds, or None when the backend
        cannot tell (CUDA: ``cuGraphGetNodes(graph, NULL, &count)``).

        An empty capture is almost always a mistake (the work went to another
        stream); the layer above warns about it as PyTorch does."""
        return None

    def graph_instantiate(self, device: int, graph: int) -> int:
        """Turn a captured graph into an executable graph; returns its handle."""
        raise self._unsupported("graph capture")

    def graph_launch(self, device: int, graph_exec: int, stream: int) -> None:
        """Enqueue one replay of an executable graph on ``stream``."""
        raise self._unsupported("graph capture")

    def graph_destroy(self, device: int, graph: int) -> None:
        """Destroy a captured graph."""
        raise self._unsupported("graph capture")

    def graph_exec_destroy(self, device: int, graph_exec: int) -> None:
        """Destroy an executable graph."""
        raise self._unsupported("graph capture")

    def graph_debug_dump(self, device: int, graph: int, path: str) -> None:
        """Write a human-readable description of a captured graph to ``path``."""
        raise self._unsupported("graph debug dumps")

    def graph_holds_host_functions(self, device: int, graph: int) -> bool:
        """Whether launches of captured graph ``graph`` may run host functions (whose
        failures a replay on another stream must forward). A backend that cannot
        tell answers True; one that can lets replays skip that forwarding."""
        return True

    # A capture begun and ended by another runtime on the same driver (torch's
    # own graphs, which also instantiate and replay it) still holds what this
    # backend queued into it, such as host functions: these three methods keep
    # that alive exactly as long as the other runtime's graph can replay.

    def stream_capture_detach(self, device: int, stream: int) -> int:
        """Hand what this backend queued into the capture ``stream`` takes part in
        to a new handle, just before another runtime ends that capture and
        takes the graph over. A backend may return 0 when nothing can need
        keeping; CUDA always returns a handle, because host functions may still
        be launched into the capture until the other runtime ends it.

        Raises :class:`~accel.CaptureError` if ``stream`` is not capturing."""
        raise self._unsupported("captures ended by another runtime")

    def detached_graph_launched(self, device: int, handle: int, stream: int) -> None:
        """Note that the graph holding ``handle``'s resources was just launched on ``stream``."""
        raise self._unsupported("captures ended by another runtime")

    def detached_graph_release(self, device: int, handle: int) -> None:
        """The graph is gone: free ``handle``'s resources once its launches have finished."""
        raise self._unsupported("captures ended by another runtime")

    def detached_graph_holds_host_functions(self, device: int, handle: int) -> bool:
        """Whether the graph of detached capture ``handle`` (ended by the other
        runtime) may run host functions; as :meth:`graph_holds_host_functions`."""
        return True

    # -- helpers ---------------------------------------------------------

    def _unsupported(self, what: str) -> Exception:
        from accel._errors import NotSupportedError

        return NotSupportedError(f"the {self.name} backend does not support {what}")


def record_new_event(backend: Backend, device: int, stream: int) -> int:
    """A new plain event recorded on ``stream`` now (what completes after the work
    queued on it so far); destroyed again if the record fails. The caller owns it."""
    event = backend.event_create(device, timing=False, blocking=False, interprocess=False)
    try:
        backend.event_record(device, event, stream)
    except BaseException:
        backend.event_destroy(device, event)
        raise
    return event
