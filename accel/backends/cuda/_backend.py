"""CudaBackend: the Backend protocol implemented with the CUDA driver API.

Design points (the protocol docstrings in ``accel.backends.base`` are the contract):

- **Primary contexts.** Each device's primary context is retained on first
  use. That is the context the CUDA runtime (and so PyTorch) uses, which is
  why streams, events and pointers can be passed between accel and torch.
- **Context hygiene.** Every entry point leaves the calling thread's context
  stack as it found it, also when it raises: it pushes the device's primary
  context only when it is not current already and pops it on the way out.
  torch and CuPy read their current device from the current context, so an
  accel call on device 1 must not switch torch to device 1.
- **Handles** are the driver's pointers as ints: a stream's handle is its
  ``CUstream`` address, ``default_stream`` is 0 (the legacy NULL stream).
- **Capture safety.** ``malloc``/``free`` and host allocations run with the
  thread's capture mode exchanged to relaxed (as PyTorch's allocator does),
  so the caching allocator can grow a pool while a graph is being captured.
- **Host functions** go through one cffi callback; the Python callable is kept
  in a registry until it ran or, for functions captured into a graph, until
  the graph, every executable graph made from it and every pending replay are
  gone. That part (host functions, capture, graphs and their retirement) is
  accel/backends/cuda/_graphs.py, mixed into CudaBackend; the registry is
  _host_functions.py and the driver's constants _constants.py.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from typing import Any

from accel._errors import (
    AccelError,
    BackendUnavailableError,
    CaptureError,
    DriverError,
    InvalidHandleError,
    NotSupportedError,
    OutOfMemoryError,
)
from accel.backends._cffi import resolve_everything
from accel.backends.base import Backend, DeviceProperties, TorchIntegration
from accel.backends.cuda._bindings import Driver, open_driver
from accel.backends.cuda._constants import (
    CUDA_ERROR_ILLEGAL_STATE,
    CUDA_ERROR_INVALID_CONTEXT,
    CUDA_ERROR_INVALID_HANDLE,
    CUDA_ERROR_INVALID_VALUE,
    CUDA_ERROR_NOT_READY,
    CUDA_ERROR_NOT_SUPPORTED,
    CUDA_ERROR_OUT_OF_MEMORY,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
    CUDA_SUCCESS,
    CU_EVENT_BLOCKING_SYNC,
    CU_EVENT_DISABLE_TIMING,
    CU_EVENT_INTERPROCESS,
    CU_MEMHOSTALLOC_PORTABLE,
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
    CU_MEM_ALLOCATION_TYPE_PINNED,
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
    CU_MEM_HANDLE_TYPE_NONE,
    CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
    CU_MEM_LOCATION_TYPE_DEVICE,
    CU_STREAM_CAPTURE_MODE_RELAXED,
    CU_STREAM_NON_BLOCKING,
    _CAPTURE_ERRORS,
)
from accel.backends.cuda._graphs import GraphsAndHostFunctions
from accel.backends.cuda._sharing import Sharing

__all__ = ["CudaBackend", "create_backend"]

# Every C type this backend and its bindings name, parsed when the backend is created.
_CTYPES = (
    "CUcontext *", "CUdeviceptr *", "CUevent", "CUevent *", "CUgraph", "CUgraph *", "CUgraphExec",
    "CUgraphExec *", "CUmemAccessDesc *", "CUmemAllocationProp *", "CUmemGenericAllocationHandle *",
    "CUstream", "CUstream *", "CUuuid *", "char[256]", "char[64]", "const char **", "cuuint64_t *",
    "float *", "int *", "size_t *", "uintptr_t", "void *", "void **", "CUipcMemHandle *",
    "CUipcEventHandle *",
)

# CUdevice_attribute values used for DeviceProperties.
_ATTRIBUTES = {
    "max_threads_per_block": 1,
    "warp_size": 10,
    "clock_rate_khz": 13,
    "multi_processor_count": 16,
    "integrated": 18,
    "l2_cache_bytes": 38,
    "max_threads_per_multiprocessor": 39,
    "async_engine_count": 40,
    "unified_addressing": 41,
    "compute_capability_major": 75,
    "compute_capability_minor": 76,
    "virtual_memory_supported": 102,
    "posix_fd_handles_supported": 103,
    "memory_pools_supported": 115,
}

_MIN_VM_GRANULARITY = 2 << 20


def _version_text(version: int) -> str:
    """``12020`` -> ``"12.2"`` (the driver encodes major * 1000 + minor * 10)."""
    return f"{version // 1000}.{version % 1000 // 10}"


def _format_uuid(raw: bytes) -> str:
    """16 bytes -> ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`` as nvidia-smi prints it."""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


class _Waiters:
    """Blocking driver waits run on helper threads when the main thread asks.

    ``cuStreamSynchronize`` and its kin wait inside the driver, where the
    interpreter cannot run signal handlers: Ctrl-C would only be seen when the
    work ended. The main thread (the only one Python delivers signals to) hands
    the wait to a helper thread and waits on a lock, which a signal interrupts;
    an interrupted wait goes on in its helper and its result is dropped. Other
    threads call the driver directly. Helpers are reused; one is started when
    none is idle.
    """

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[Any, tuple[Any, ...], list[Any], threading.Lock]] = (
            queue.SimpleQueue()
        )
        self._lock = threading.Lock()
        self._idle = 0

    def run(self, fn: Any, enter: Any, leave: Any, device: int, *args: Any) -> int:
        """``fn(*args)`` with ``device``'s context current (``enter``/``leave``)."""

        def call() -> int:
            pushed = enter(device)
            try:
                return int(fn(*args))
            finally:
                leave(device, pushed)

        if threading.current_thread() is not threading.main_thread():
            return call()  # signals are only delivered to the main thread
        done = threading.Lock()
        done.acquire()
        box: list[Any] = []
        with self._lock:
            if self._idle:
                self._idle -= 1
            else:
                threading.Thread(target=self._serve, name="accel-cuda-waiter", daemon=True).start()
        self._requests.put((call, (), box, done))
        done.acquire()  # a signal interrupts this (KeyboardInterrupt); the helper goes on
        result = box[0]
        if isinstance(result, BaseException):
            raise result
        return int(result)

    def _serve(self) -> None:
        while True:
            call, args, box, done = self._requests.get()
            try:
                box.append(call(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
                box.append(exc)
            with self._lock:
                self._idle += 1
            done.release()


_waiters = _Waiters()


class CudaBackend(GraphsAndHostFunctions, Sharing, Backend):
    """The CUDA driver API behind the Backend protocol. Build it with :func:`create_backend`.

    >>> backend = create_backend()                 # doctest: +SKIP
    >>> s = backend.stream_create(0, 0)            # doctest: +SKIP
    >>> backend.stream_synchronize(0, s); backend.stream_destroy(0, s)  # doctest: +SKIP
    """

    name = "cuda"
    torch_device_type = "cuda"
    stream_protocol = "__cuda_stream__"
    host_memory_page_locked = True  # cuMemHostAlloc
    torch_integration = TorchIntegration.SHARED_STREAMS

    def __init__(self, driver: Driver, device_count: int, driver_version: int) -> None:
        self._driver = driver
        self._ffi = driver.ffi
        self._fn = driver.fn
        self._count = device_count
        self._driver_version = driver_version
        self._lock = threading.RLock()
        self._tls = threading.local()
        self._contexts: dict[int, Any] = {}
        self._properties: dict[int, DeviceProperties] = {}
        self._granularity: dict[int, int] = {}
        self._init_graphs_and_host_functions()
        self._init_sharing()
        # Every call goes through driver.fn (resolved when the driver was opened); parse
        # every type now, so that no finalizer's call can wait on cffi's locks.
        resolve_everything(self._ffi, _CTYPES)

    # -- plumbing --------------------------------------------------------

    @property
    def driver(self) -> Driver:
        """The bound driver (its path and which versioned symbols were chosen)."""
        return self._driver

    def _error(
        self, call: str, code: int, device: int | None, *, handle: str = "", requested: int = 0, capture: bool = False
    ) -> AccelError:
        """The accel exception for CUresult ``code`` returned by ``call``.

        ``handle`` names the handle argument, so that the driver's complaint about
        it becomes an InvalidHandleError; ``capture`` marks begin/end capture
        calls, where CUDA_ERROR_ILLEGAL_STATE means the stream is (not) capturing.
        """
        drv = self._driver
        where = f"cuda:{device}" if device is not None else "cuda"
        detail = drv.describe(code)
        if code == CUDA_ERROR_OUT_OF_MEMORY:
            return OutOfMemoryError(
                f"{where}: {call} could not allocate {requested} bytes: {detail}. "
                "Free device memory (or empty accel's cache) and retry, or request less",
                requested=requested,
                device=device,
            )
        if handle and code in (CUDA_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_VALUE):
            return InvalidHandleError(
                f"{where}: {call} rejected the {handle}: {detail}. "
                f"It was already destroyed or freed, or does not belong to this device"
            )
        if capture and code == CUDA_ERROR_ILLEGAL_STATE:
            state = "already captures" if call == "cuStreamBeginCapture" else "is not capturing"
            return CaptureError(f"{where}: {call} failed: {detail}. The stream {state}")
        if code in _CAPTURE_ERRORS:
            return CaptureError(
                f"{where}: {call} failed: {detail}. Synchronizing, querying or allocating while a stream "
                "captures, waiting on work recorded outside the capture (unless the event was created with "
                "external=True), and ending a capture with unjoined forked streams all invalidate it"
            )
        if code == CUDA_ERROR_NOT_SUPPORTED:
            return NotSupportedError(f"{where}: {call} is not supported here: {detail}")
        return DriverError("cuda", call, code, drv.error_name(code), drv.error_string(code), device=device)

    def _check(
        self, call: str, code: int, device: int | None, *, handle: str = "", requested: int = 0, capture: bool = False
    ) -> None:
        if code != CUDA_SUCCESS:
            raise self._error(call, code, device, handle=handle, requested=requested, capture=capture)

    def _retain(self, device: int) -> Any:
        """``device``'s primary context, retained on first use (kept for the backend's life)."""
        with self._lock:
            ctx = self._contexts.get(device)
            if ctx is None:
                out = self._ffi.new("CUcontext *")
                self._check("cuDevicePrimaryCtxRetain", self._fn["cuDevicePrimaryCtxRetain"](out, device), device)
                ctx = self._contexts[device] = out[0]
        return ctx

    def _enter(self, device: int) -> bool:
        """Make ``device``'s primary context current on this thread; True if :meth:`_leave` must undo it.

        Every public entry point brackets its driver calls with ``_enter`` and
        ``_leave`` (in ``try``/``finally``), so the thread's context stack is
        the same after the call as before it, also when the call raises:
        torch and CuPy take the current device from the current context.

        When the context is already current (torch's current device, or an
        enclosing call) this costs one ``cuCtxGetCurrent``. Otherwise the
        context is pushed and later popped, which restores "no context" and
        deeper stacks alike; unlike set-and-restore, popping never has to make
        the previous context current again, so it cannot fail on a context
        that another thread destroyed meanwhile.
        """
        ctx = self._contexts.get(device)
        if ctx is None:
            ctx = self._retain(device)
        tls = self._tls
        try:
            current = tls.current
        except AttributeError:
            current = tls.current = self._ffi.new("CUcontext *")
        # Checked inline, not with _check: this runs before every driver call.
        fn = self._fn
        code = fn["cuCtxGetCurrent"](current)
        if code == CUDA_SUCCESS and current[0] == ctx:
            return False
        if code != CUDA_SUCCESS:
            raise self._error("cuCtxGetCurrent", code, device)
        try:
            code = fn["cuCtxPushCurrent"](ctx)
        except BaseException:
            # An exception delivered as the push returned (KeyboardInterrupt
            # from a signal handler) must not leave the context pushed: the
            # caller's finally is not armed yet. ctx was not current before.
            if fn["cuCtxGetCurrent"](current) == CUDA_SUCCESS and current[0] == ctx:
                fn["cuCtxPopCurrent"](self._ffi.NULL)
            raise
        if code != CUDA_SUCCESS:
            raise self._error("cuCtxPushCurrent", code, device)
        return True

    def _leave(self, device: int, pushed: bool) -> None:
        """Undo :meth:`_enter` (pop the context it pushed)."""
        if pushed:
            # NULL, not the thread's buffer: a reentrant call (a finalizer run
            # inside _enter) would otherwise overwrite what _enter compares.
            code = self._fn["cuCtxPopCurrent"](self._ffi.NULL)
            if code != CUDA_SUCCESS:
                raise self._error("cuCtxPopCurrent", code, device)

    def _stream(self, stream: int) -> Any:
        return self._ffi.cast("CUstream", stream)

    def _event(self, event: int) -> Any:
        return self._ffi.cast("CUevent", event)

    def _address(self, cdata: Any) -> int:
        return int(self._ffi.cast("uintptr_t", cdata))

    @contextlib.contextmanager
    def _relaxed_capture_mode(self, device: int) -> Iterator[None]:
        """Let this thread allocate while a stream captures (the allocator grows pools then)."""
        mode = self._ffi.new("int *", CU_STREAM_CAPTURE_MODE_RELAXED)
        exchange = self._fn["cuThreadExchangeStreamCaptureMode"]
        self._check("cuThreadExchangeStreamCaptureMode", exchange(mode), device)
        try:
            yield
        finally:
            exchange(mode)

    def _attribute(self, device: int, attribute: int) -> int:
        out = self._ffi.new("int *")
        self._check("cuDeviceGetAttribute", self._fn["cuDeviceGetAttribute"](out, attribute, device), device)
        return int(out[0])

    # -- devices -----------------------------------------------------------

    def device_count(self) -> int:
        return self._count

    def device_properties(self, device: int) -> DeviceProperties:
        cached = self._properties.get(device)
        if cached is not None:
            return cached
        ffi, fn = self._ffi, self._fn
        name = ffi.new("char[256]")
        self._check("cuDeviceGetName", fn["cuDeviceGetName"](name, 256, device), device)
        total = ffi.new("size_t *")
        self._check("cuDeviceTotalMem", fn["cuDeviceTotalMem"](total, device), device)
        uuid = ffi.new("CUuuid *")
        self._check("cuDeviceGetUuid", fn["cuDeviceGetUuid"](uuid, device), device)
        bus = ffi.new("char[64]")
        self._check("cuDeviceGetPCIBusId", fn["cuDeviceGetPCIBusId"](bus, 64, device), device)
        attrs = {key: self._attribute(device, attr) for key, attr in _ATTRIBUTES.items()}
        extra: dict[str, object] = {
            key: value
            for key, value in attrs.items()
            if key not in ("multi_processor_count", "integrated", "compute_capability_major", "compute_capability_minor")
        }
        for flag in ("virtual_memory_supported", "posix_fd_handles_supported", "memory_pools_supported",
                     "unified_addressing"):
            extra[flag] = bool(extra[flag])
        extra["memory_info_source"] = "cuMemGetInfo_v2 in the device's primary context (device-wide)"
        extra["driver_library"] = self._driver.path
        # Only the entry points whose version was chosen by probing the library.
        extra["driver_symbols"] = ", ".join(sorted(self._driver.probed_symbols()))
        props = DeviceProperties(
            name=ffi.string(name).decode(errors="replace"),
            type="cuda",
            index=device,
            total_memory=int(total[0]),
            uuid=_format_uuid(bytes(ffi.buffer(uuid.bytes, 16))),
            multi_processor_count=attrs["multi_processor_count"],
            driver_version=_version_text(self._driver_version),
            compute_capability=(attrs["compute_capability_major"], attrs["compute_capability_minor"]),
            pci_bus_id=ffi.string(bus).decode(errors="replace"),
            is_integrated=bool(attrs["integrated"]),
            extra=extra,
        )
        self._properties[device] = props
        return props

    def memory_info(self, device: int) -> tuple[int, int]:
        free = self._ffi.new("size_t *")
        total = self._ffi.new("size_t *")
        pushed = self._enter(device)
        try:
            code = self._fn["cuMemGetInfo"](free, total)
        finally:
            self._leave(device, pushed)
        self._check("cuMemGetInfo", code, device)
        return int(free[0]), int(total[0])

    def can_access_peer(self, device: int, peer: int) -> bool:
        if device == peer:
            return True
        out = self._ffi.new("int *")
        self._check("cuDeviceCanAccessPeer", self._fn["cuDeviceCanAccessPeer"](out, device, peer), device)
        return bool(out[0])

    def device_synchronize(self, device: int) -> None:
        pushed = self._enter(device)
        try:
            # Whatever was queued before the synchronize began is over after it,
            # whether or not an event marks it.
            with self._lock:
                entries = self._retiring.pop(device, [])
            try:
                code = _waiters.run(self._fn["cuCtxSynchronize"], self._enter, self._leave, device)
            except BaseException:  # interrupted (KeyboardInterrupt): the next synchronize releases them
                self._park(device, entries)
                raise
            if code != CUDA_SUCCESS:
                self._park(device, entries)
                raise self._error("cuCtxSynchronize", code, device)
            self._release_retired(device, entries)
        finally:
            self._leave(device, pushed)
        self._drop_spent()

    # -- memory ------------------------------------------------------------

    def malloc(self, device: int, nbytes: int) -> int:
        out = self._ffi.new("CUdeviceptr *")
        pushed = self._enter(device)
        try:
            with self._relaxed_capture_mode(device):
                code = self._fn["cuMemAlloc"](out, nbytes)
        finally:
            self._leave(device, pushed)
        self._check("cuMemAlloc", code, device, requested=nbytes)
        return int(out[0])

    def free(self, device: int, ptr: int) -> None:
        pushed = self._enter(device)
        try:
            with self._relaxed_capture_mode(device):
                code = self._fn["cuMemFree"](ptr)
        finally:
            self._leave(device, pushed)
        self._check("cuMemFree", code, device, handle=f"device pointer {ptr:#x}")

    def _host_device(self) -> int:
        """The device whose context host allocations use: any will do, but each costs memory.

        The thread's current context when accel retained it (torch's device),
        else a device accel already works with, else device 0; so a process
        that uses only GPU k never creates a context on GPU 0 for them.
        """
        current = self._ffi.new("CUcontext *")
        if self._fn["cuCtxGetCurrent"](current) == CUDA_SUCCESS and current[0] != self._ffi.NULL:
            with self._lock:
                for device, ctx in self._contexts.items():
                    if ctx == current[0]:
                        return device
        with self._lock:
            return min(self._contexts, default=0)

    def host_malloc(self, nbytes: int) -> int:
        # Page-locked memory is made portable, so any device's context can copy with it.
        out = self._ffi.new("void **")
        device = self._host_device()
        pushed = self._enter(device)
        try:
            with self._relaxed_capture_mode(device):
                code = self._fn["cuMemHostAlloc"](out, nbytes, CU_MEMHOSTALLOC_PORTABLE)
        finally:
            self._leave(device, pushed)
        if code == CUDA_ERROR_OUT_OF_MEMORY:
            raise OutOfMemoryError(
                f"cuda: cuMemHostAlloc could not allocate {nbytes} bytes of page-locked host memory: "
                f"{self._driver.describe(code)}. Free pinned buffers or request less",
                requested=nbytes,
            )
        self._check("cuMemHostAlloc", code, None)
        return self._address(out[0])

    def host_free(self, ptr: int) -> None:
        device = self._host_device()
        pushed = self._enter(device)
        try:
            with self._relaxed_capture_mode(device):
                code = self._fn["cuMemFreeHost"](self._ffi.cast("void *", ptr))
        finally:
            self._leave(device, pushed)
        self._check("cuMemFreeHost", code, None, handle=f"host pointer {ptr:#x}")

    # -- virtual memory ----------------------------------------------------

    def supports_virtual_memory(self, device: int) -> bool:
        return self._driver.has_vmm and bool(self.device_properties(device).extra["virtual_memory_supported"])

    def _require_vmm(self, device: int) -> None:
        if not self.supports_virtual_memory(device):
            why = (
                "the driver does not export the cuMem* virtual memory entry points"
                if not self._driver.has_vmm
                else "the device reports no virtual memory management support"
            )
            raise NotSupportedError(
                f"cuda:{device}: virtual memory (expandable segments) is unavailable: {why}; "
                "use the allocator without expandable_segments"
            )

    def _allocation_prop(self, device: int) -> Any:
        prop = self._ffi.new("CUmemAllocationProp *")
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device
        posix = self.device_properties(device).extra["posix_fd_handles_supported"]
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if posix else CU_MEM_HANDLE_TYPE_NONE
        return prop

    def vm_granularity(self, device: int) -> int:
        cached = self._granularity.get(device)
        if cached is not None:
            return cached
        self._require_vmm(device)
        out = self._ffi.new("size_t *")
        prop = self._allocation_prop(device)
        pushed = self._enter(device)
        try:
            code = self._fn["cuMemGetAllocationGranularity"](out, prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        finally:
            self._leave(device, pushed)
        self._check("cuMemGetAllocationGranularity", code, device)
        granularity = max(int(out[0]), _MIN_VM_GRANULARITY)
        self._granularity[device] = granularity
        return granularity

    def vm_reserve(self, device: int, nbytes: int) -> int:
        granularity = self.vm_granularity(device)
        out = self._ffi.new("CUdeviceptr *")
        pushed = self._enter(device)
        try:
            code = self._fn["cuMemAddressReserve"](out, nbytes, granularity, 0, 0)
        finally:
            self._leave(device, pushed)
        self._check("cuMemAddressReserve", code, device, requested=nbytes)
        return int(out[0])

    def vm_free(self, device: int, addr: int, nbytes: int) -> None:
        self._require_vmm(device)
        pushed = self._enter(device)
        try:
            code = self._fn["cuMemAddressFree"](addr, nbytes)
        finally:
            self._leave(device, pushed)
        self._check("cuMemAddressFree", code, device, handle=f"reservation {addr:#x}+{nbytes}")

    def vm_create(self, device: int, nbytes: int) -> int:
        self.vm_granularity(device)  # raises NotSupportedError without VMM
        out = self._ffi.new("CUmemGenericAllocationHandle *")
        prop = self._allocation_prop(device)
        pushed = self._enter(device)
        try:
            code = self._fn["cuMemCreate"](out, nbytes, prop, 0)
        finally:
            self._leave(device, pushed)
        self._check("cuMemCreate", code, device, requested=nbytes)
        return int(out[0])

    def vm_release(self, device: int, handle: int) -> None:
        self._require_vmm(device)
        pushed = self._enter(device)
        try:
            code = self._fn["cuMemRelease"](handle)
        finally:
            self._leave(device, pushed)
        self._check("cuMemRelease", code, device, handle=f"memory handle {handle:#x}")

    def vm_map(self, device: int, addr: int, nbytes: int, handle: int) -> None:
        self._require_vmm(device)
        access = self._ffi.new("CUmemAccessDesc *")
        access.location.type = CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device
        access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        pushed = self._enter(device)
        try:
            self._check("cuMemMap", self._fn["cuMemMap"](addr, nbytes, 0, handle, 0), device)
            code = self._fn["cuMemSetAccess"](addr, nbytes, access, 1)
            if code != CUDA_SUCCESS:
                self._fn["cuMemUnmap"](addr, nbytes)  # leave the range as it was
                self._check("cuMemSetAccess", code, device)
        finally:
            self._leave(device, pushed)

    def vm_unmap(self, device: int, addr: int, nbytes: int) -> None:
        self._require_vmm(device)
        pushed = self._enter(device)
        try:
            code = self._fn["cuMemUnmap"](addr, nbytes)
        finally:
            self._leave(device, pushed)
        self._check("cuMemUnmap", code, device)

    # -- streams -----------------------------------------------------------

    def default_stream(self, device: int) -> int:
        return 0

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        least = self._ffi.new("int *")
        greatest = self._ffi.new("int *")
        pushed = self._enter(device)
        try:
            code = self._fn["cuCtxGetStreamPriorityRange"](least, greatest)
        finally:
            self._leave(device, pushed)
        self._check("cuCtxGetStreamPriorityRange", code, device)
        return int(least[0]), int(greatest[0])

    def stream_create(self, device: int, priority: int) -> int:
        out = self._ffi.new("CUstream *")
        pushed = self._enter(device)
        try:
            code = self._fn["cuStreamCreateWithPriority"](out, CU_STREAM_NON_BLOCKING, priority)
        finally:
            self._leave(device, pushed)
        self._check("cuStreamCreateWithPriority", code, device)
        return self._address(out[0])

    def stream_destroy(self, device: int, stream: int) -> None:
        if stream in (0, 1, 2):
            raise InvalidHandleError(
                f"cuda:{device}: stream {stream:#x} is a default stream (legacy or per-thread); it cannot be destroyed"
            )
        self._end_capture_of_destroyed_stream(device, stream)
        pushed = self._enter(device)
        try:
            code = self._fn["cuStreamDestroy"](self._stream(stream))
        finally:
            self._leave(device, pushed)
        self._check("cuStreamDestroy", code, device, handle=f"stream {stream:#x}")

    def _wait(self, device: int, query: str, synchronize: str, handle: Any) -> int:
        """``synchronize(handle)``'s result. On the main thread ``query`` is asked first,
        so that only unfinished work costs a hand-over to a waiter thread."""
        if threading.current_thread() is threading.main_thread():
            pushed = self._enter(device)
            try:
                code: int = self._fn[query](handle)
            finally:
                self._leave(device, pushed)
            if code == CUDA_ERROR_NOT_READY:
                return _waiters.run(self._fn[synchronize], self._enter, self._leave, device, handle)
        pushed = self._enter(device)
        try:
            return int(self._fn[synchronize](handle))
        finally:
            self._leave(device, pushed)

    def stream_query(self, device: int, stream: int) -> bool:
        self._drop_spent()
        pushed = self._enter(device)
        try:
            code = self._fn["cuStreamQuery"](self._stream(stream))
        finally:
            self._leave(device, pushed)
        if code == CUDA_ERROR_NOT_READY:
            return False
        self._check("cuStreamQuery", code, device, handle=f"stream {stream:#x}")
        return True

    def stream_synchronize(self, device: int, stream: int) -> None:
        code = self._wait(device, "cuStreamQuery", "cuStreamSynchronize", self._stream(stream))
        self._check("cuStreamSynchronize", code, device, handle=f"stream {stream:#x}")
        self._drop_spent()

    def stream_wait_event(self, device: int, stream: int, event: int) -> None:
        pushed = self._enter(device)
        try:
            code = self._fn["cuStreamWaitEvent"](self._stream(stream), self._event(event), 0)
        finally:
            self._leave(device, pushed)
        self._check("cuStreamWaitEvent", code, device, handle=f"stream {stream:#x} or event {event:#x}")

    # -- events ------------------------------------------------------------
    # The _create/_record/_query/_destroy_event helpers expect the device's
    # context to be current already (the backend calls them inside an entry point).

    def _create_event(self, device: int, flags: int) -> int:
        out = self._ffi.new("CUevent *")
        self._check("cuEventCreate", self._fn["cuEventCreate"](out, flags), device)
        return self._address(out[0])

    def _record_event(self, device: int, event: int, stream: int) -> None:
        code = self._fn["cuEventRecord"](self._event(event), self._stream(stream))
        self._check("cuEventRecord", code, device, handle=f"event {event:#x} or stream {stream:#x}")

    def _query_event(self, device: int, event: int) -> bool:
        code = self._fn["cuEventQuery"](self._event(event))
        if code == CUDA_ERROR_NOT_READY:
            return False
        self._check("cuEventQuery", code, device, handle=f"event {event:#x}")
        return True

    def _destroy_event(self, device: int, event: int) -> None:
        code = self._fn["cuEventDestroy"](self._event(event))
        self._check("cuEventDestroy", code, device, handle=f"event {event:#x}")

    def event_create(self, device: int, *, timing: bool, blocking: bool, interprocess: bool) -> int:
        if interprocess and timing:
            raise NotSupportedError(
                f"cuda:{device}: an interprocess CUDA event cannot measure time; create it with timing disabled"
            )
        flags = 0 if timing else CU_EVENT_DISABLE_TIMING
        if blocking:
            flags |= CU_EVENT_BLOCKING_SYNC
        if interprocess:
            flags |= CU_EVENT_INTERPROCESS
        pushed = self._enter(device)
        try:
            return self._create_event(device, flags)
        finally:
            self._leave(device, pushed)

    def event_destroy(self, device: int, event: int) -> None:
        pushed = self._enter(device)
        try:
            self._destroy_event(device, event)
        finally:
            self._leave(device, pushed)

    def event_record(self, device: int, event: int, stream: int) -> None:
        pushed = self._enter(device)
        try:
            self._record_event(device, event, stream)
        finally:
            self._leave(device, pushed)

    def event_query(self, device: int, event: int) -> bool:
        self._drop_spent()
        pushed = self._enter(device)
        try:
            return self._query_event(device, event)
        finally:
            self._leave(device, pushed)

    def event_synchronize(self, device: int, event: int) -> None:
        code = self._wait(device, "cuEventQuery", "cuEventSynchronize", self._event(event))
        self._check("cuEventSynchronize", code, device, handle=f"event {event:#x}")
        self._drop_spent()

    def event_elapsed_ms(self, device: int, start: int, end: int) -> float:
        out = self._ffi.new("float *")
        pushed = self._enter(device)
        try:
            code = self._fn["cuEventElapsedTime"](out, self._event(start), self._event(end))
        finally:
            self._leave(device, pushed)
        if code == CUDA_ERROR_INVALID_HANDLE:
            # The driver gives this one code for three different mistakes.
            raise InvalidHandleError(
                f"cuda:{device}: cuEventElapsedTime rejected events {start:#x} and {end:#x}: "
                f"{self._driver.describe(code)}. Both must exist, have timing enabled and have been recorded"
            )
        if code == CUDA_ERROR_NOT_READY:
            raise DriverError(
                "cuda", "cuEventElapsedTime", code, self._driver.error_name(code), self._driver.error_string(code),
                device=device, remedy="synchronize both events before asking for the time between them",
            )
        self._check("cuEventElapsedTime", code, device)
        return float(out[0])

    # -- stream work -------------------------------------------------------

    def memcpy_async(self, device: int, dst: int, src: int, nbytes: int, stream: int) -> None:
        pushed = self._enter(device)
        try:
            code = self._fn["cuMemcpyAsync"](dst, src, nbytes, self._stream(stream))
        finally:
            self._leave(device, pushed)
        if code == CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
            raise CaptureError(
                f"cuda:{device}: cuMemcpyAsync of {nbytes} bytes {src:#x} -> {dst:#x} cannot be captured: "
                f"{self._driver.describe(code)}. A captured copy may not read or write pageable host memory "
                "(CUDA stages such copies when they run, which a graph cannot replay); copy through "
                "page-locked memory from accel.memory.allocate_host instead. The capture is now invalidated"
            )
        self._check("cuMemcpyAsync", code, device, handle=f"stream {stream:#x}" if code == CUDA_ERROR_INVALID_HANDLE else "")

    def memset_async(self, device: int, dst: int, value: int, nbytes: int, stream: int) -> None:
        pushed = self._enter(device)
        try:
            code = self._fn["cuMemsetD8Async"](dst, value, nbytes, self._stream(stream))
        finally:
            self._leave(device, pushed)
        self._check("cuMemsetD8Async", code, device, handle=f"stream {stream:#x}" if code == CUDA_ERROR_INVALID_HANDLE else "")


def create_backend() -> CudaBackend:
    """Open the driver, initialize it and count devices; BackendUnavailableError otherwise."""
    driver = open_driver()
    fn = driver.fn
    code = fn["cuInit"](0)
    if code != CUDA_SUCCESS:
        raise BackendUnavailableError(
            "cuda",
            f"cuInit failed: {driver.describe(code)}",
            remedy="Check that nvidia-smi lists a GPU and that CUDA_VISIBLE_DEVICES does not hide it",
        )
    count = driver.ffi.new("int *")
    code = fn["cuDeviceGetCount"](count)
    if code != CUDA_SUCCESS:
        raise BackendUnavailableError("cuda", f"cuDeviceGetCount failed: {driver.describe(code)}")
    if count[0] == 0:
        raise BackendUnavailableError("cuda", "the CUDA driver initialized but reports no devices")
    version = driver.ffi.new("int *")
    code = fn["cuDriverGetVersion"](version)
    if code != CUDA_SUCCESS:
        raise BackendUnavailableError("cuda", f"cuDriverGetVersion failed: {driver.describe(code)}")
    return CudaBackend(driver, int(count[0]), int(version[0]))
