"""The XPU backend: the Backend protocol over oneAPI Level Zero.

How the protocol maps onto Level Zero (docs/backends/xpu.md has the long form):

- a stream is an in-order *immediate command list* (asynchronous mode); its
  handle is the ``ze_command_list_handle_t`` address. Level Zero 1.4 lets a
  driver overlap commands of one list unless a barrier separates them, so
  every command is followed by a barrier;
- ``stream_query``/``stream_synchronize`` use *markers*: a barrier that
  signals a pooled event once everything before it completed
  (``zeCommandListHostSynchronize`` is used instead when the loader has it);
- events come from event pools (HOST_VISIBLE, plus KERNEL_TIMESTAMP for
  timing events) through a small allocator; each record takes a fresh pooled
  Level Zero event, so a wait queued before a re-record still waits for the
  record it saw, as in CUDA. Event handles are accel's own ids;
- host functions have no Level Zero equivalent: the stream signals event A
  and waits on event B; a per-stream host thread waits for A, runs the
  function and signals B;
- capture records copies, fills and host functions into a *regular command
  list*, under the fork/join rules of ``accel.backends._capture``; replay
  submits it to the graph's own command queue, fenced between a "start"
  event the stream signals and a "done" event the stream waits on;
- Level Zero events may be referenced by queued commands after their owner
  is gone, so every pooled event is reference-counted ("holds") and goes back
  to its pool only when no owner and no queued command refers to it.

The pooled events are _event_pool.py, the host-function thread
_host_worker.py, and what is kept per stream, event, capture, graph, chunk
and device _records.py.
"""

from __future__ import annotations

import collections
import os
import select
import threading
from collections.abc import Callable
from typing import Any, cast

from accel._errors import (
    AccelError,
    CaptureError,
    InvalidHandleError,
    InvalidValueError,
    NotSupportedError,
    OutOfMemoryError,
)
from accel._units import format_size
from accel.backends import _capture
from accel.backends._cffi import resolve_everything
from accel.backends.base import Backend, CaptureMode, CaptureStatus, DeviceProperties, TorchIntegration
from accel.backends.xpu._bindings import ZeLoader, describe_result
from accel.backends.xpu._event_pool import EventSlot, EventSlots
from accel.backends.xpu._host_worker import HostWorker
from accel.backends.xpu._sharing import Sharing
from accel.backends.xpu._records import (
    CaptureState,
    DeviceState,
    EventState,
    GraphState,
    PhysicalChunk,
    StreamState,
    live,
    new_handle,
)

__all__ = ["XpuBackend"]

#: Lower numbers mean higher priority, as in CUDA: 0 is NORMAL, -1 is PRIORITY_HIGH.
PRIORITY_RANGE = (0, -1)
# Every C type this backend and its bindings name, parsed when the backend is created.
_CTYPES = (
    "size_t *", "uint32_t *", "uint8_t *", "uintptr_t", "void *", "void **", "ze_api_version_t *",
    "ze_bool_t *", "ze_command_list_desc_t *", "ze_command_list_handle_t *", "ze_command_list_handle_t[1]",
    "ze_command_queue_desc_t *", "ze_command_queue_group_properties_t[]", "ze_command_queue_handle_t *",
    "ze_context_desc_t *", "ze_context_handle_t *", "ze_device_compute_properties_t *",
    "ze_device_mem_alloc_desc_t *", "ze_device_memory_properties_t[]", "ze_device_properties_t *",
    "ze_driver_properties_t *", "ze_event_desc_t *", "ze_event_handle_t *", "ze_event_handle_t[1]",
    "ze_event_pool_desc_t *", "ze_event_pool_handle_t *", "ze_host_mem_alloc_desc_t *",
    "ze_kernel_timestamp_result_t *", "ze_physical_mem_desc_t *", "ze_physical_mem_handle_t *",
    "zes_mem_handle_t[]", "zes_mem_properties_t *", "zes_mem_state_t *", "ze_ipc_mem_handle_t *",
    "ze_ipc_event_pool_handle_t *", "ze_external_memory_export_desc_t *", "ze_external_memory_export_fd_t *",
    "ze_external_memory_import_fd_t *", "ze_physical_mem_properties_t *",
)
_MIN_VM_GRANULARITY = 2 << 20
# A marker is added after this many commands without one, so that events held
# by queued commands are given back even by code that never synchronizes.
_MARKER_EVERY = 128
_MALLOC_ALIGNMENT = 512
_NOT_READY = 1  # ZE_RESULT_NOT_READY

# Host waits are cut into slices of this many ns: between two, the interpreter runs
# signal handlers, so Ctrl-C interrupts a synchronize (one wait forever inside the
# driver would hold it off until the work ended).
_WAIT_SLICE_NS = 50_000_000


def _wait(host_synchronize: Any, handle: Any) -> int:
    """``host_synchronize(handle, timeout)`` until it stops answering NOT_READY."""
    while True:
        code: int = host_synchronize(handle, _WAIT_SLICE_NS)
        if code != _NOT_READY:
            return code
_UNSUPPORTED_FEATURE = 0x78000003
_UNSUPPORTED_SIZE = 0x78000009
_OOM_CODES = (0x70000002, 0x70000003)

# -- the backend --------------------------------------------------------------------


class XpuBackend(Sharing, Backend):
    """Level Zero GPU devices of one driver, one context.

    >>> from accel.backends import load_backend
    >>> xpu = load_backend("xpu")  # doctest: +SKIP
    >>> xpu.device_properties(0).extra["memory_info_source"]  # doctest: +SKIP
    "device properties minus accel's own allocations"
    """

    name = "xpu"
    torch_device_type = "xpu"
    torch_integration = TorchIntegration.SEPARATE_STREAMS
    host_memory_page_locked = True  # zeMemAllocHost: host USM, pinned for the device's copies

    def __init__(self, ze: ZeLoader, driver: object, devices: list[object], *, loader_version: str) -> None:
        self._ze = ze
        ffi, lib = ze.ffi, ze.lib
        # The loader resolved its symbols when opened; parse every type now, so that
        # no finalizer's call can wait on cffi's locks.
        resolve_everything(ffi, _CTYPES)
        # Reentrant: the finalizers of accel Streams and Events destroy them
        # through this backend, and a garbage collection can run them inside
        # its locked sections (which allocate), on the same thread.
        self._lock = threading.RLock()
        desc = ffi.new("ze_context_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_CONTEXT_DESC})
        context = ffi.new("ze_context_handle_t *")
        ze.check("zeContextCreate", lib.zeContextCreate(driver, desc, context))
        self._context = context[0]
        self._slots = EventSlots(ze, self._context)
        self._init_sharing()
        self._host_synchronize = ze.has("zeCommandListHostSynchronize")
        self._host_allocations: dict[int, int] = {}
        self._streams: dict[int, StreamState] = {}
        self._retired: list[tuple[StreamState, EventSlot | None]] = []
        # Destroyed streams whose lock was taken when they were destroyed (a
        # collected accel.Stream's finalizer can run inside a section holding
        # it, on the same thread): retired by the next reap.
        self._dying: list[StreamState] = []
        # Graphs let go of while a replay still ran (Level Zero forbids destroying
        # the list meanwhile): destroyed by the first reap that sees the replay over.
        self._dying_graphs: list[GraphState] = []
        # One reap at a time: a reap that does not wait takes both lists and puts
        # back what still runs, and a waiting one (device synchronize) that ran
        # meanwhile found them empty and returned before that work completed (a
        # closed stream's failed host function then went unreported). Reentrant:
        # a finalizer run inside a reap, on its thread, destroys another stream.
        self._reap_lock = threading.RLock()
        self._events: dict[int, EventState] = {}
        self._graphs: dict[int, GraphState] = {}
        self._execs: dict[int, GraphState] = {}
        self._vm_supported: dict[int, bool] = {}
        api = ffi.new("ze_api_version_t *")
        ze.check("zeDriverGetApiVersion", lib.zeDriverGetApiVersion(driver, api))
        self._api_version = (api[0] >> 16, api[0] & 0xFFFF)
        dprops = ffi.new("ze_driver_properties_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DRIVER_PROPERTIES})
        ze.check("zeDriverGetProperties", lib.zeDriverGetProperties(driver, dprops))
        self._driver_version = str(dprops.driverVersion)
        self._loader_version = loader_version
        self._devices = [self._describe(i, d) for i, d in enumerate(devices)]
        self._defaults = [self._new_stream(d.index, 0, is_default=True) for d in self._devices]

    # -- helpers ----------------------------------------------------------------------

    def _check(self, call: str, code: int, device: int | None = None) -> None:
        self._ze.check(call, code, device=device)

    def _addr(self, cdata: object) -> int:
        return int(self._ze.ffi.cast("uintptr_t", cdata))

    def _describe(self, index: int, cdata: object) -> DeviceState:
        ze, ffi, lib = self._ze, self._ze.ffi, self._ze.lib
        # The 1.2 form reports the timer in cycles per second instead of whole
        # nanoseconds, which loses precision on 19.2 MHz timers.
        modern = self._api_version >= (1, 2)
        stype = lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES_1_2 if modern else lib.ZE_STRUCTURE_TYPE_DEVICE_PROPERTIES
        props = ffi.new("ze_device_properties_t *", {"stype": stype})
        ze.check("zeDeviceGetProperties", lib.zeDeviceGetProperties(cdata, props), device=index)
        ns_per_tick = 1e9 / props.timerResolution if modern else float(props.timerResolution)
        compute = ffi.new("ze_device_compute_properties_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_COMPUTE_PROPERTIES})
        ze.check("zeDeviceGetComputeProperties", lib.zeDeviceGetComputeProperties(cdata, compute), device=index)
        count = ffi.new("uint32_t *", 0)
        ze.check("zeDeviceGetMemoryProperties", lib.zeDeviceGetMemoryProperties(cdata, count, ffi.NULL), device=index)
        mems = ffi.new("ze_device_memory_properties_t[]", count[0])
        for i in range(count[0]):
            mems[i].stype = lib.ZE_STRUCTURE_TYPE_DEVICE_MEMORY_PROPERTIES
        ze.check("zeDeviceGetMemoryProperties", lib.zeDeviceGetMemoryProperties(cdata, count, mems), device=index)
        total = sum(mems[i].totalSize for i in range(count[0]))
        ordinal = self._compute_ordinal(index, cdata)
        modules = self._sysman_modules(cdata)
        source = "device properties minus accel's own allocations"
        if modules:
            source = "sysman"
            total = sum(self._sysman_state(m, index)[1] for m in modules)
        bits = props.kernelTimestampValidBits or 64
        uuid = bytes(ffi.buffer(props.uuid.id, 16)).hex()
        extra = {
            "memory_info_source": source,
            "vendor_id": f"{props.vendorId:#06x}",
            "device_id": f"{props.deviceId:#06x}",
            "core_clock_mhz": props.coreClockRate,
            "max_mem_alloc_size": props.maxMemAllocSize,
            "eu_count": props.numSlices * props.numSubslicesPerSlice * props.numEUsPerSubslice,
            "threads_per_eu": props.numThreadsPerEU,
            "max_work_group_size": compute.maxTotalGroupSize,
            "timer_ns_per_tick": ns_per_tick,
            "kernel_timestamp_valid_bits": bits,
            "api_version": "%d.%d" % self._api_version,
            "loader_version": self._loader_version,
            "loader_has_zeCommandListHostSynchronize": self._host_synchronize,
        }
        properties = DeviceProperties(
            name=ffi.string(props.name).decode(errors="replace"),
            type="xpu",
            index=index,
            total_memory=total,
            uuid=f"{uuid[:8]}-{uuid[8:12]}-{uuid[12:16]}-{uuid[16:20]}-{uuid[20:]}",
            multi_processor_count=max(1, props.numSlices * props.numSubslicesPerSlice),
            driver_version=self._driver_version,
            is_integrated=bool(props.flags & lib.ZE_DEVICE_PROPERTY_FLAG_INTEGRATED),
            extra=extra,
        )
        return DeviceState(index, cdata, properties, ordinal, ns_per_tick, (1 << bits) - 1, modules)

    def _compute_ordinal(self, index: int, cdata: object) -> int:
        ze, ffi, lib = self._ze, self._ze.ffi, self._ze.lib
        count = ffi.new("uint32_t *", 0)
        call = "zeDeviceGetCommandQueueGroupProperties"
        ze.check(call, lib.zeDeviceGetCommandQueueGroupProperties(cdata, count, ffi.NULL), device=index)
        groups = ffi.new("ze_command_queue_group_properties_t[]", count[0])
        for i in range(count[0]):
            groups[i].stype = lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_GROUP_PROPERTIES
        ze.check(call, lib.zeDeviceGetCommandQueueGroupProperties(cdata, count, groups), device=index)
        for i in range(count[0]):
            if groups[i].flags & lib.ZE_COMMAND_QUEUE_GROUP_PROPERTY_FLAG_COMPUTE:
                return i
        raise NotSupportedError(f"xpu:{index} has no compute command queue group")

    def _sysman_modules(self, cdata: object) -> list[object]:
        """Sysman memory modules, or [] when Sysman is off (drivers need ZES_ENABLE_SYSMAN=1 at init)."""
        ffi, lib = self._ze.ffi, self._ze.lib
        count = ffi.new("uint32_t *", 0)
        if lib.zesDeviceEnumMemoryModules(cdata, count, ffi.NULL) != 0 or count[0] == 0:
            return []
        handles = ffi.new("zes_mem_handle_t[]", count[0])
        if lib.zesDeviceEnumMemoryModules(cdata, count, handles) != 0:
            return []
        modules = []
        for i in range(count[0]):
            props = ffi.new("zes_mem_properties_t *", {"stype": lib.ZES_STRUCTURE_TYPE_MEM_PROPERTIES})
            if lib.zesMemoryGetProperties(handles[i], props) == 0 and props.location == lib.ZES_MEM_LOC_DEVICE:
                modules.append(handles[i])
        return modules

    def _sysman_state(self, module: object, device: int) -> tuple[int, int]:
        state = self._ze.ffi.new("zes_mem_state_t *", {"stype": self._ze.lib.ZES_STRUCTURE_TYPE_MEM_STATE})
        self._check("zesMemoryGetState", self._ze.lib.zesMemoryGetState(module, state), device)
        return state.free, state.size

    def _stream(self, device: int, handle: int) -> StreamState:
        return live(self._streams, handle, device, "stream")

    @staticmethod
    def _check_open(s: StreamState) -> None:
        """Under ``s.lock``: refuse a stream destroyed (by another thread) since it was looked up;
        its command list may be gone, and a host function queued after its worker ended would
        wait forever."""
        if s.retired:
            raise InvalidHandleError(f"xpu:{s.device}: stream {s.handle:#x} was destroyed while this call was under way")

    def _event(self, device: int, handle: int, *, any_device: bool = False) -> EventState:
        return live(self._events, handle, device, "event", any_device=any_device)

    # -- command appending (caller holds stream.lock) ------------------------------------

    def _barrier(self, stream: StreamState, cdata: object, signal: EventSlot | None = None) -> None:
        ffi, lib = self._ze.ffi, self._ze.lib
        event = signal.cdata if signal is not None else ffi.NULL
        self._check("zeCommandListAppendBarrier", lib.zeCommandListAppendBarrier(cdata, event, 0, ffi.NULL), stream.device)

    def _wait(self, stream: StreamState, cdata: object, slot: EventSlot) -> None:
        events = self._ze.ffi.new("ze_event_handle_t[1]", [slot.cdata])
        lib = self._ze.lib
        self._check("zeCommandListAppendWaitOnEvents", lib.zeCommandListAppendWaitOnEvents(cdata, 1, events), stream.device)

    def _reset(self, stream: StreamState, cdata: object, slot: EventSlot) -> None:
        lib = self._ze.lib
        self._check("zeCommandListAppendEventReset", lib.zeCommandListAppendEventReset(cdata, slot.cdata), stream.device)

    def _defer(self, stream: StreamState, fn: Callable[[], object]) -> None:
        """Run ``fn`` once the stream has passed everything counted by ``_appended`` so far
        (what it returns is dropped: a closure may exist only to keep memory alive)."""
        stream.deferred.append((stream.seq, fn))

    def _hold_until_passed(self, stream: StreamState, slot: EventSlot) -> None:
        """Keep ``slot`` out of the pool until the stream passed the command just counted."""
        self._slots.hold(slot)
        self._defer(stream, lambda: self._slots.drop(slot))

    def _keep_until_passed(self, stream: StreamState, memory: object) -> None:
        """Keep ``memory`` alive (a queued command points at it) until the stream passed it."""
        self._defer(stream, lambda: memory)

    def _appended(self, stream: StreamState) -> None:
        stream.seq += 1
        if stream.seq - stream.marked >= _MARKER_EVERY:
            self._mark(stream)
            self._reap(stream)

    def _appended_marker(self, stream: StreamState, slot: EventSlot) -> None:
        """Count a barrier just appended that signals ``slot``, and keep it as a marker:
        it completes once everything before it ran, so a query after the event
        completed finds the stream idle instead of appending a barrier of its own
        (which the device has not reached yet)."""
        self._slots.hold(slot)  # dropped by _reap
        stream.seq += 1
        stream.markers.append((stream.seq, slot))
        stream.marked = stream.seq
        if len(stream.markers) >= _MARKER_EVERY:  # recorded often, never synchronized
            self._reap(stream)

    def _mark(self, stream: StreamState) -> None:
        slot = self._slots.acquire(False)
        try:
            self._barrier(stream, stream.cdata, slot)
        except BaseException:
            self._slots.drop(slot)
            raise
        stream.markers.append((stream.seq, slot))
        stream.marked = stream.seq

    def _reap(self, stream: StreamState) -> None:
        """Give back what completed markers prove the device no longer needs."""
        lib = self._ze.lib
        while stream.markers:
            seq, slot = stream.markers[0]
            code = lib.zeEventQueryStatus(slot.cdata)
            if code == _NOT_READY:
                break
            self._check("zeEventQueryStatus", code, stream.device)
            stream.markers.popleft()
            stream.done = max(stream.done, seq)
            self._slots.drop(slot)
        self._run_deferred(stream, stream.done)

    def _run_deferred(self, stream: StreamState, upto: int) -> None:
        ready = [fn for seq, fn in stream.deferred if seq <= upto]
        stream.deferred = [(seq, fn) for seq, fn in stream.deferred if seq > upto]
        for fn in ready:
            fn()

    def _worker(self, stream: StreamState) -> HostWorker:
        if stream.worker is None:
            stream.worker = HostWorker(self, f"accel-xpu-host-{stream.handle:#x}")
        return stream.worker

    # -- devices ------------------------------------------------------------------------

    def device_count(self) -> int:
        return len(self._devices)

    def device_properties(self, device: int) -> DeviceProperties:
        return self._devices[device].properties

    def memory_info(self, device: int) -> tuple[int, int]:
        dev = self._devices[device]
        if dev.sysman_modules:
            states = [self._sysman_state(m, device) for m in dev.sysman_modules]
            return sum(s[0] for s in states), sum(s[1] for s in states)
        total = dev.properties.total_memory
        with dev.lock:
            return max(0, total - dev.held), total

    def can_access_peer(self, device: int, peer: int) -> bool:
        if device == peer:
            return True
        value = self._ze.ffi.new("ze_bool_t *")
        lib = self._ze.lib
        self._check(
            "zeDeviceCanAccessPeer",
            lib.zeDeviceCanAccessPeer(self._devices[device].cdata, self._devices[peer].cdata, value),
            device,
        )
        return bool(value[0])

    def device_synchronize(self, device: int) -> None:
        streams = [s for s in list(self._streams.values()) if s.device == device]
        _capture.refuse_device_synchronize(device, streams)
        for stream in streams:
            if stream.handle in self._streams:
                self._synchronize(stream)
        self._reap_retired(wait=True)

    # -- memory -------------------------------------------------------------------------

    def malloc(self, device: int, nbytes: int) -> int:
        if nbytes <= 0:
            raise InvalidValueError(f"xpu:{device}: cannot allocate {nbytes} bytes; ask for at least 1 byte")
        ffi, lib = self._ze.ffi, self._ze.lib
        dev = self._devices[device]
        desc = ffi.new("ze_device_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_DEVICE_MEM_ALLOC_DESC})
        out = ffi.new("void **")
        code = lib.zeMemAllocDevice(self._context, desc, nbytes, _MALLOC_ALIGNMENT, dev.cdata, out)
        if code in _OOM_CODES or code == _UNSUPPORTED_SIZE:
            what = f"allocate {format_size(nbytes)}"
            if code == _UNSUPPORTED_SIZE:
                largest = cast(int, dev.properties.extra["max_mem_alloc_size"])  # set by _describe
                what += f" (the largest single allocation is {format_size(largest)})"
            raise self._out_of_memory(device, "zeMemAllocDevice", what, nbytes, code)
        self._check("zeMemAllocDevice", code, device)
        ptr = self._addr(out[0])
        with dev.lock:
            dev.allocations[ptr] = nbytes
            dev.held += nbytes
        return ptr

    def _out_of_memory(self, device: int, call: str, what: str, nbytes: int, code: int) -> OutOfMemoryError:
        free, total = self.memory_info(device)
        return OutOfMemoryError(
            f"xpu:{device} is out of memory: {call} could not {what}; {format_size(free)} of "
            f"{format_size(total)} free ({describe_result(code)}). Free memory or release accel's "
            "cached blocks and retry.",
            requested=nbytes,
            device=device,
        )

    def free(self, device: int, ptr: int) -> None:
        dev = self._devices[device]
        with dev.lock:
            nbytes = dev.allocations.pop(ptr, None)
        if nbytes is None:
            raise InvalidHandleError(
                f"xpu:{device}: pointer {ptr:#x} was not returned by malloc on this device, or was already freed"
            )
        self._check("zeMemFree", self._ze.lib.zeMemFree(self._context, self._ze.ffi.cast("void *", ptr)), device)
        with dev.lock:
            dev.held -= nbytes

    def host_malloc(self, nbytes: int) -> int:
        if nbytes <= 0:
            raise InvalidValueError(f"xpu: cannot allocate {nbytes} bytes of host memory; ask for at least 1 byte")
        ffi, lib = self._ze.ffi, self._ze.lib
        desc = ffi.new("ze_host_mem_alloc_desc_t *", {"stype": lib.ZE_STRUCTURE_TYPE_HOST_MEM_ALLOC_DESC})
        out = ffi.new("void **")
        code = lib.zeMemAllocHost(self._context, desc, nbytes, _MALLOC_ALIGNMENT, out)
        self._ze.check("zeMemAllocHost", code, requested=nbytes)
        ptr = self._addr(out[0])
        with self._lock:
            self._host_allocations[ptr] = nbytes
        return ptr

    def host_free(self, ptr: int) -> None:
        with self._lock:
            known = self._host_allocations.pop(ptr, None) is not None
        if not known:
            raise InvalidHandleError(f"xpu: pointer {ptr:#x} was not returned by host_malloc, or was already freed")
        self._check("zeMemFree", self._ze.lib.zeMemFree(self._context, self._ze.ffi.cast("void *", ptr)))

    # -- virtual memory ---------------------------------------------------------------------

    def supports_virtual_memory(self, device: int) -> bool:
        return self._vm_page(device) is not None

    def _vm_page(self, device: int) -> int | None:
        dev = self._devices[device]
        if device not in self._vm_supported:
            ffi, lib = self._ze.ffi, self._ze.lib
            size = ffi.new("size_t *")
            code = lib.zeVirtualMemQueryPageSize(self._context, dev.cdata, _MIN_VM_GRANULARITY, size)
            if code == 0:
                dev.vm_page = max(size[0], _MIN_VM_GRANULARITY)
            elif code != _UNSUPPORTED_FEATURE:
                self._check("zeVirtualMemQueryPageSize", code, device)
            self._vm_supported[device] = code == 0
        return dev.vm_page

    def _require_vm(self, device: int) -> DeviceState:
        if self._vm_page(device) is None:
            raise self._unsupported("virtual memory")
        return self._devices[device]

    def _require_multiple(self, device: int, what: str, value: int) -> None:
        granularity = self._devices[device].vm_page or 1
        if value <= 0 or value % granularity:
            raise InvalidValueError(
                f"xpu:{device}: {what} {value:#x} is not a positive multiple of the granularity "
                f"{granularity:#x}; round it with vm_granularity()"
            )

    def vm_granularity(self, device: int) -> int:
        return self._require_vm(device).vm_page or _MIN_VM_GRANULARITY

    def vm_reserve(self, device: int, nbytes: int) -> int:
        dev = self._require_vm(device)
        self._require_multiple(device, "size", nbytes)
        ffi, lib = self._ze.ffi, self._ze.lib
        out = ffi.new("void **")
        # A non-null start hint: the loader's validation layer rejects NULL there
        # (the 1.4 header does not mark it optional); drivers treat it as a hint.
        with dev.lock:
            hint = dev.next_hint or (dev.vm_page or _MIN_VM_GRANULARITY)
        code = lib.zeVirtualMemReserve(self._context, ffi.cast("void *", hint), nbytes, out)
        self._ze.check("zeVirtualMemReserve", code, device=device, requested=nbytes)
        addr = self._addr(out[0])
        with dev.lock:
            dev.reservations[addr] = nbytes
            dev.next_hint = addr + nbytes
        return addr

    def vm_free(self, device: int, addr: int, nbytes: int) -> None:
        dev = self._require_vm(device)
        with dev.lock:
            if dev.reservations.get(addr) != nbytes:
                raise InvalidHandleError(
                    f"xpu:{device}: no reservation of {nbytes:#x} bytes at {addr:#x}; pass the address "
                    "and size vm_reserve used"
                )
            if any(addr <= a < addr + nbytes for a in dev.mappings):
                raise InvalidValueError(f"xpu:{device}: the reservation at {addr:#x} is still mapped; unmap it first")
            del dev.reservations[addr]
        lib = self._ze.lib
        self._check("zeVirtualMemFree", lib.zeVirtualMemFree(self._context, self._ze.ffi.cast("void *", addr), nbytes), device)

    def vm_create(self, device: int, nbytes: int) -> int:
        dev = self._require_vm(device)
        self._require_multiple(device, "size", nbytes)
        ffi, lib = self._ze.ffi, self._ze.lib
        export = self._exportable_chunk_desc(device)  # kept alive through the calls that read it
        desc = ffi.new("ze_physical_mem_desc_t *", {
            "stype": lib.ZE_STRUCTURE_TYPE_PHYSICAL_MEM_DESC, "pNext": export, "size": nbytes,
        })
        out = ffi.new("ze_physical_mem_handle_t *")
        code = lib.zePhysicalMemCreate(self._context, dev.cdata, desc, out)
        if code != 0 and code not in _OOM_CODES and export != ffi.NULL:
            # Refused as exportable, perhaps: what a plain chunk answers tells.
            refused, desc.pNext = code, ffi.NULL
            code = lib.zePhysicalMemCreate(self._context, dev.cdata, desc, out)
            if code == 0:
                self._refuse_export(device, refused)
        if code in _OOM_CODES:
            what = f"create a {format_size(nbytes)} chunk"
            raise self._out_of_memory(device, "zePhysicalMemCreate", what, nbytes, code)
        self._check("zePhysicalMemCreate", code, device)
        handle = self._addr(out[0])
        with dev.lock:
            dev.physical[handle] = PhysicalChunk(out[0], nbytes)
            dev.held += nbytes
        return handle

    def _live_chunk(self, dev: DeviceState, handle: int) -> PhysicalChunk:
        """The chunk ``handle`` of ``dev``, unless released (caller holds dev.lock)."""
        chunk = dev.physical.get(handle)
        if chunk is None or chunk.released:
            raise InvalidHandleError(f"xpu:{dev.index}: physical chunk {handle:#x} is not live (already released?)")
        return chunk

    def _destroy_physical(self, dev: DeviceState, handle: int) -> None:
        """Destroy a released, unmapped chunk (caller removed it from dev.physical)."""
        chunk = dev.physical.pop(handle)
        dev.held -= chunk.size
        self._check("zePhysicalMemDestroy", self._ze.lib.zePhysicalMemDestroy(self._context, chunk.cdata), dev.index)

    def vm_release(self, device: int, handle: int) -> None:
        dev = self._require_vm(device)
        with dev.lock:
            chunk = self._live_chunk(dev, handle)
            chunk.released = True
            if chunk.maps == 0:
                self._destroy_physical(dev, handle)

    def vm_map(self, device: int, addr: int, nbytes: int, handle: int) -> None:
        dev = self._require_vm(device)
        ffi, lib = self._ze.ffi, self._ze.lib
        with dev.lock:
            chunk = self._live_chunk(dev, handle)
            if nbytes != chunk.size:
                raise InvalidValueError(
                    f"xpu:{device}: map the whole chunk: it has {chunk.size:#x} bytes, not {nbytes:#x}"
                )
            if not any(base <= addr and addr + nbytes <= base + size for base, size in dev.reservations.items()):
                raise InvalidValueError(
                    f"xpu:{device}: [{addr:#x}, {addr + nbytes:#x}) is not inside a reservation from vm_reserve"
                )
            code = lib.zeVirtualMemMap(
                self._context, ffi.cast("void *", addr), nbytes, chunk.cdata, 0,
                lib.ZE_MEMORY_ACCESS_ATTRIBUTE_READWRITE,
            )
            self._check("zeVirtualMemMap", code, device)
            chunk.maps += 1
            dev.mappings[addr] = (nbytes, handle)

    def vm_unmap(self, device: int, addr: int, nbytes: int) -> None:
        dev = self._require_vm(device)
        ffi, lib = self._ze.ffi, self._ze.lib
        with dev.lock:
            inside = sorted(a for a in dev.mappings if addr <= a < addr + nbytes)
            if not inside:
                raise InvalidValueError(f"xpu:{device}: nothing is mapped in [{addr:#x}, {addr + nbytes:#x})")
            # One call per mapping: Level Zero unmaps what one zeVirtualMemMap mapped.
            for start in inside:
                size, handle = dev.mappings.pop(start)
                code = lib.zeVirtualMemUnmap(self._context, ffi.cast("void *", start), size)
                self._check("zeVirtualMemUnmap", code, device)
                chunk = dev.physical[handle]
                chunk.maps -= 1
                if chunk.maps == 0 and chunk.released:
                    self._destroy_physical(dev, handle)

    # -- streams ---------------------------------------------------------------------------

    def _new_stream(self, device: int, priority: int, *, is_default: bool = False) -> StreamState:
        ffi, lib = self._ze.ffi, self._ze.lib
        dev = self._devices[device]
        desc = ffi.new("ze_command_queue_desc_t *", {
            "stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
            "ordinal": dev.ordinal,
            "mode": lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS,
            "priority": lib.ZE_COMMAND_QUEUE_PRIORITY_PRIORITY_HIGH if priority < 0 else lib.ZE_COMMAND_QUEUE_PRIORITY_NORMAL,
        })
        out = ffi.new("ze_command_list_handle_t *")
        self._check("zeCommandListCreateImmediate", lib.zeCommandListCreateImmediate(self._context, dev.cdata, desc, out), device)
        stream = StreamState(device, out[0], self._addr(out[0]), priority, is_default)
        with self._lock:
            self._streams[stream.handle] = stream
        return stream

    def default_stream(self, device: int) -> int:
        return self._defaults[device].handle

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        return PRIORITY_RANGE

    def stream_create(self, device: int, priority: int) -> int:
        self._reap_retired(wait=False)
        return self._new_stream(device, priority).handle

    def stream_destroy(self, device: int, stream: int) -> None:
        s = self._stream(device, stream)
        if s.is_default:
            raise InvalidHandleError(f"xpu:{device}: the default stream cannot be destroyed")
        abandoned = _capture.abandon(s)
        if abandoned is not None:
            assert isinstance(abandoned, CaptureState)  # s, an xpu stream, began it
            self._discard_capture(abandoned)
        with self._lock:
            del self._streams[stream]
            self._dying.append(s)
        self._reap_retired(wait=False)

    def _retire(self, s: StreamState, *, wait: bool) -> bool:
        """Move a destroyed stream to the retired list; False when its lock is
        taken and ``wait`` is False (it stays dying)."""
        if not s.lock.acquire(blocking=wait):
            return False
        try:
            s.retired = True
            if s.seq > s.marked:
                self._mark(s)
            marker = s.markers[-1][1] if s.markers else None
            if marker is not None:
                self._slots.hold(marker)
            if s.worker is not None:
                s.worker.put(None)  # ends after the host functions already queued
        finally:
            s.lock.release()
        # Queued work still completes; the list goes once its last marker is reached.
        with self._lock:
            self._retired.append((s, marker))
        return True

    def _reap_retired(self, *, wait: bool) -> None:
        # Not waiting: another reap is running, and what it leaves the next one takes.
        if not self._reap_lock.acquire(blocking=wait):
            return
        try:
            self._reap_retired_locked(wait=wait)
        finally:
            self._reap_lock.release()

    def _reap_retired_locked(self, *, wait: bool) -> None:
        with self._lock:
            dying, self._dying = self._dying, []
        still_dying = [s for s in dying if not self._retire(s, wait=wait)]
        if still_dying:
            with self._lock:
                self._dying.extend(still_dying)
        with self._lock:
            retired, self._retired = self._retired, []
        keep = []
        lib = self._ze.lib
        for stream, marker in retired:
            if marker is not None:
                if wait:
                    self._check("zeEventHostSynchronize", _wait(lib.zeEventHostSynchronize, marker.cdata))
                elif lib.zeEventQueryStatus(marker.cdata) == _NOT_READY:
                    keep.append((stream, marker))
                    continue
            with stream.lock:
                self._run_deferred(stream, stream.seq)
                for _, slot in stream.markers:
                    self._slots.drop(slot)
                stream.markers.clear()
            self._slots.drop(marker)
            self._check("zeCommandListDestroy", lib.zeCommandListDestroy(stream.cdata), stream.device)
        if keep:
            with self._lock:
                self._retired.extend(keep)
        if self._dying_graphs:
            self._reap_graphs(wait=wait)

    def _reap_graphs(self, *, wait: bool) -> None:
        """Destroy the graphs whose last replay ended (with ``wait``: wait for it, in
        slices that Ctrl-C interrupts). Each leaves the list only once destroyed."""
        lib = self._ze.lib
        with self._lock:
            graphs = list(self._dying_graphs)
        for g in graphs:
            assert g.last_launch is not None
            if wait:
                self._check("zeEventHostSynchronize", _wait(lib.zeEventHostSynchronize, g.last_launch.cdata), g.device)
            elif lib.zeEventQueryStatus(g.last_launch.cdata) == _NOT_READY:
                continue
            with self._lock:
                if g not in self._dying_graphs:
                    continue  # destroyed by another thread's reap
                self._dying_graphs.remove(g)
            self._destroy_graph(g)

    def stream_query(self, device: int, stream: int) -> bool:
        s = self._stream(device, stream)
        _capture.refuse_while_capturing(s, "querying a stream")
        with s.lock:
            self._check_open(s)
            if s.seq > s.marked:
                self._mark(s)
            self._reap(s)
            return not s.markers

    def stream_synchronize(self, device: int, stream: int) -> None:
        s = self._stream(device, stream)
        _capture.refuse_while_capturing(s, "synchronizing a stream")
        self._synchronize(s)
        if s.failures:
            raise s.failures.popleft()

    def _synchronize(self, s: StreamState) -> None:
        if not self._synchronize_open(s):
            # Destroyed by another thread since it was looked up: its work is
            # waited for with the other retired streams, not on its command list.
            self._reap_retired(wait=True)

    def _synchronize_open(self, s: StreamState) -> bool:
        """Wait for ``s``'s work; False, without waiting, when ``s`` was retired."""
        lib = self._ze.lib
        if self._host_synchronize:
            with s.lock:
                if s.retired:
                    return False
                code = _wait(lib.zeCommandListHostSynchronize, s.cdata)
                if code != _UNSUPPORTED_FEATURE:
                    self._check("zeCommandListHostSynchronize", code, s.device)
                    s.done = s.seq
                    self._reap(s)
                    return True
            self._host_synchronize = False  # exported by the loader, not implemented by the driver
        with s.lock:
            if s.retired:
                return False
            if s.seq > s.marked:
                self._mark(s)
            if not s.markers:
                return True
            slot = s.markers[-1][1]
            self._slots.hold(slot)
        try:
            self._check("zeEventHostSynchronize", _wait(lib.zeEventHostSynchronize, slot.cdata), s.device)
        finally:
            self._slots.drop(slot)
        with s.lock:
            self._reap(s)
        return True

    def stream_wait_event(self, device: int, stream: int, event: int) -> None:
        s = self._stream(device, stream)
        # One context spans the driver's devices, so any device may wait on any event.
        e = self._event(device, event, any_device=True)
        if _capture.wait_event(s, e.captured, e.handle):
            return
        self._wait_for_last_record(s, e)

    def _wait_for_last_record(self, s: StreamState, e: EventState, own: list[EventSlot] | None = None) -> None:
        """Order ``s`` after ``e``'s last record; nothing when it is one that a record command
        in ``own`` (a graph's list) signals, which that list's own order already covers."""
        slot = self._slots.hold_current(e)  # not recycled by a concurrent re-record before the wait is queued
        if slot is None:
            return  # never recorded: a no-op, as in CUDA
        if own is not None and any(slot is mine for mine in own):
            self._slots.drop(slot)
            return
        if e.exporter >= 0:
            self._wait_imported_on(s, e, slot)
            return
        try:
            with s.lock:
                self._check_open(s)
                self._wait(s, s.cdata, slot)
                self._barrier(s, s.cdata)
                self._appended(s)
                self._hold_until_passed(s, slot)
        finally:
            self._slots.drop(slot)

    # -- events ----------------------------------------------------------------------------

    def event_create(self, device: int, *, timing: bool, blocking: bool, interprocess: bool) -> int:
        # ``blocking`` changes nothing: zeEventHostSynchronize always blocks the thread.
        handle = new_handle()
        if interprocess:
            if timing:
                raise NotSupportedError(
                    f"xpu:{device}: an interprocess event cannot measure time (as in CUDA); "
                    "create it with enable_timing=False"
                )
            state = EventState(device, handle, False, slot=self._slots.create_ipc(), ipc=True)
        else:
            state = EventState(device, handle, timing)
        with self._lock:
            self._events[handle] = state
        return handle

    def event_destroy(self, device: int, event: int) -> None:
        e = self._event(device, event)
        with self._lock:
            del self._events[event]
        self._slots.set_current(e, None)
        if e.exporter >= 0:
            os.close(e.exporter)

    def event_record(self, device: int, event: int, stream: int) -> None:
        e = self._event(device, event)
        s = self._stream(device, stream)
        capture = s.capture
        if capture is not None:
            # Inside a capture a record is only a position: the captured work is one
            # in-order command list, so waits on it need no Level Zero event.
            e.captured = capture.mark(s)
            return
        if e.ipc:
            self._record_ipc(s, e)
            return
        slot = self._slots.acquire(e.timing)
        try:
            with s.lock:
                self._check_open(s)
                self._barrier(s, s.cdata, slot)
                self._appended_marker(s, slot)
        except BaseException:
            self._slots.drop(slot)
            raise
        self._slots.set_current(e, slot)
        e.captured = None

    def event_record_external(self, device: int, event: int, stream: int) -> None:
        s = self._stream(device, stream)
        capture = s.xpu_capture()
        if capture is None:
            self.event_record(device, event, stream)
            return
        e = self._event(device, event)
        slot = self._slots.acquire(e.timing)

        def append(cdata: object) -> None:
            self._reset(s, cdata, slot)  # signalled by the previous replay
            self._barrier(s, cdata, slot)

        with capture.lock:
            try:
                self._record_node(s, f"record event {e.handle:#x}", append)
            except BaseException:
                self._slots.drop(slot)
                raise
            capture.signals.append(slot)
        # Complete until a replay resets it: waiting on the event before the first
        # replay returns, as waiting on an event CUDA has not recorded yet does.
        self._check("zeEventHostSignal", self._ze.lib.zeEventHostSignal(slot.cdata), device)
        # The event reads the slot each replay signals; the graph keeps its own hold.
        self._slots.hold(slot)
        self._slots.set_current(e, slot)
        e.captured = None

    def stream_wait_event_external(self, device: int, stream: int, event: int) -> None:
        s = self._stream(device, stream)
        e = self._event(device, event, any_device=True)
        capture = s.xpu_capture()
        if capture is None:
            self.stream_wait_event(device, stream, event)
            return
        # A recorded command list waits on fixed Level Zero events, and each record
        # gives the event a new one: the slot to wait for is known only at launch.
        # So each launch makes its stream wait for it before the replay starts
        # (graph_launch), which orders the whole replay after the record, not only
        # the commands after this node.
        with capture.lock:
            if capture.invalid_reason:
                return  # the capture will fail at its end; recording more is pointless
            capture.add(s, f"wait event {e.handle:#x} (before the replay, as of each launch)")
            capture.waits.append(e)

    def _record_ipc(self, s: StreamState, e: EventState) -> None:
        """Re-arm an interprocess event's one Level Zero event: reset now (so that it reads
        as pending from the record on, as in CUDA), signalled when the stream gets there."""
        slot = e.slot
        assert slot is not None
        self._slots.hold(slot)
        try:
            with s.lock:
                self._check("zeEventHostReset", self._ze.lib.zeEventHostReset(slot.cdata), s.device)
                self._barrier(s, s.cdata, slot)
                self._appended(s)
                self._hold_until_passed(s, slot)
        finally:
            self._slots.drop(slot)
        e.captured = None

    def event_query(self, device: int, event: int) -> bool:
        e = self._event(device, event)
        _capture.refuse_captured_event(e.captured, e.device, e.handle, "querying")
        slot = self._slots.hold_current(e)
        if slot is None:
            return True
        try:
            code = self._ze.lib.zeEventQueryStatus(slot.cdata)
        finally:
            self._slots.drop(slot)
        if code == _NOT_READY:
            return False
        self._check("zeEventQueryStatus", code, device)
        return True

    def event_synchronize(self, device: int, event: int) -> None:
        e = self._event(device, event)
        _capture.refuse_captured_event(e.captured, e.device, e.handle, "synchronizing")
        slot = self._slots.hold_current(e)  # a concurrent re-record or destroy must not recycle it meanwhile
        if slot is None:
            return
        try:
            if e.exporter < 0:
                code = _wait(self._ze.lib.zeEventHostSynchronize, slot.cdata)
            else:
                code = self._wait_imported(e, slot, e.exporter)
            self._check("zeEventHostSynchronize", code, device)
        finally:
            self._slots.drop(slot)

    def _wait_imported_on(self, s: StreamState, e: EventState, slot: EventSlot) -> None:
        """Order ``s`` after an event opened from another process (``slot`` held, and
        dropped here). Not a device-side wait: if the exporter exited before it
        signalled, nothing ever would, and the stream would wait forever. A host
        function waits instead, watching the exporter (its own duplicate of the
        pidfd: the event may be destroyed first); an exit ends it, later work
        runs, and the stream's next synchronize raises the error."""
        try:
            pidfd = os.dup(e.exporter)
        except BaseException:
            self._slots.drop(slot)
            raise

        def wait_for_the_exporter() -> None:
            try:
                self._check("zeEventHostSynchronize", self._wait_imported(e, slot, pidfd), s.device)
            except AccelError as exc:
                s.failures.append(exc)  # the stream's next synchronize raises it
            finally:
                self._slots.drop(slot)
                os.close(pidfd)

        try:
            self.launch_host_func(s.device, s.handle, wait_for_the_exporter)
        except BaseException:
            self._slots.drop(slot)
            os.close(pidfd)
            raise

    def _wait_imported(self, e: EventState, slot: EventSlot, pidfd: int) -> int:
        """Wait for an event opened from another process in slices, checking that the
        exporter (``pidfd``) still lives: once it exited, nothing will ever signal the event."""
        exited = select.poll()  # not select(): it refuses descriptors past 1023, and accel may raise the limit
        exited.register(pidfd, select.POLLIN)
        while True:
            code = int(self._ze.lib.zeEventHostSynchronize(slot.cdata, _WAIT_SLICE_NS))
            if code != _NOT_READY:
                return code
            # Between slices: Ctrl-C is seen, and a dead exporter ends the wait.
            if exited.poll(0):
                code = int(self._ze.lib.zeEventQueryStatus(slot.cdata))
                if code != _NOT_READY:
                    return code
                raise InvalidHandleError(
                    f"xpu:{e.device}: the process that exported event {e.handle:#x} exited before the "
                    "work it recorded completed"
                )

    def event_elapsed_ms(self, device: int, start: int, end: int) -> float:
        first, last = self._event(device, start), self._event(device, end)
        stamps = []
        for e in (first, last):
            if not e.timing:
                raise InvalidValueError(
                    f"xpu:{device}: event {e.handle:#x} was created without timing; "
                    "create both events with enable_timing=True"
                )
            slot = self._slots.hold_current(e)  # read from the record it saw, not a recycled one
            if slot is None:
                raise InvalidValueError(f"xpu:{device}: event {e.handle:#x} was never recorded; record it first")
            result = self._ze.ffi.new("ze_kernel_timestamp_result_t *")
            try:
                code = self._ze.lib.zeEventQueryKernelTimestamp(slot.cdata, result)
            finally:
                self._slots.drop(slot)
            if code == _NOT_READY:
                raise InvalidValueError(
                    f"xpu:{device}: event {e.handle:#x} has not completed; synchronize it first"
                )
            self._check("zeEventQueryKernelTimestamp", code, device)
            stamps.append(getattr(result, "global").kernelEnd)  # "global" is a Python keyword
        dev = self._devices[device]
        # Kernel timestamps wrap at their valid bits; the masked difference is
        # right as long as the interval is shorter than one wrap.
        ticks = (stamps[1] - stamps[0]) & dev.timestamp_mask
        if stamps[1] < stamps[0] and ticks > dev.timestamp_mask // 2:
            ticks = -((stamps[0] - stamps[1]) & dev.timestamp_mask)
        milliseconds: float = ticks * dev.ns_per_tick / 1e6
        return milliseconds

    # -- stream work ---------------------------------------------------------------------

    def _record_node(self, s: StreamState, description: str, append: Callable[[object], None]) -> None:
        """Append one captured command (plus its ordering barrier) to the capture's list."""
        capture = s.xpu_capture()
        assert capture is not None
        with capture.lock:
            if capture.invalid_reason:
                return  # the capture will fail at its end; recording more is pointless
            append(capture.cdata)
            self._barrier(s, capture.cdata)
            capture.add(s, description)

    def memcpy_async(self, device: int, dst: int, src: int, nbytes: int, stream: int) -> None:
        s = self._stream(device, stream)
        if nbytes < 0:
            raise InvalidValueError(f"xpu:{device}: cannot copy {nbytes} bytes")
        if nbytes == 0:
            return
        ffi, lib = self._ze.ffi, self._ze.lib

        def append(cdata: object) -> None:
            code = lib.zeCommandListAppendMemoryCopy(
                cdata, ffi.cast("void *", dst), ffi.cast("void *", src), nbytes, ffi.NULL, 0, ffi.NULL
            )
            self._check("zeCommandListAppendMemoryCopy", code, device)

        if s.capture is not None:
            self._record_node(s, f"copy {nbytes} bytes {src:#x} -> {dst:#x}", append)
            return
        with s.lock:
            self._check_open(s)
            append(s.cdata)
            self._barrier(s, s.cdata)
            self._appended(s)

    def memset_async(self, device: int, dst: int, value: int, nbytes: int, stream: int) -> None:
        s = self._stream(device, stream)
        if not 0 <= value <= 255:
            raise InvalidValueError(f"xpu:{device}: fill value {value} is not a byte (0..255)")
        if nbytes < 0:
            raise InvalidValueError(f"xpu:{device}: cannot fill {nbytes} bytes")
        if nbytes == 0:
            return
        ffi, lib = self._ze.ffi, self._ze.lib
        # The specification does not say when a driver reads the pattern, so it
        # lives until the fill has run (or as long as the captured graph).
        pattern = ffi.new("uint8_t *", value)

        def append(cdata: object) -> None:
            code = lib.zeCommandListAppendMemoryFill(
                cdata, ffi.cast("void *", dst), pattern, 1, nbytes, ffi.NULL, 0, ffi.NULL
            )
            self._check("zeCommandListAppendMemoryFill", code, device)

        capture = s.xpu_capture()
        if capture is not None:
            self._record_node(s, f"fill {nbytes} bytes at {dst:#x} with {value:#04x}", append)
            capture.keep.append(pattern)
            return
        with s.lock:
            self._check_open(s)
            append(s.cdata)
            self._barrier(s, s.cdata)
            self._appended(s)
            self._keep_until_passed(s, pattern)

    def _errors_of(self, device: int, stream: int) -> collections.deque[tuple[str, BaseException]] | None:
        """Where the worker reports a failure of what it runs for ``stream``: taken
        now, while the stream lives (a destroyed stream's queue is the runtime's to keep)."""
        host_errors = self.host_errors
        return None if host_errors is None else host_errors(device, stream)

    def launch_host_func(self, device: int, stream: int, fn: Callable[[], None]) -> None:
        s = self._stream(device, stream)
        reached, release = self._slots.acquire(False), self._slots.acquire(False)
        name = getattr(fn, "__qualname__", type(fn).__name__)
        capture = s.xpu_capture()
        if capture is not None:

            def append(cdata: object) -> None:
                self._barrier(s, cdata, reached)
                self._wait(s, cdata, release)
                self._reset(s, cdata, release)  # ready for the next replay

            # One hold of the lock for the command and its host node: replay serves
            # host nodes in list order, and forked streams record from other threads.
            with capture.lock:
                try:
                    self._record_node(s, f"host function {name}", append)
                except BaseException:
                    self._slots.drop(reached)
                    self._slots.drop(release)
                    raise
                capture.host_nodes.append((reached, release, fn))
            return
        try:
            errors = self._errors_of(device, stream)  # before the stream's lock: it may take the runtime's
            with s.lock:
                self._check_open(s)
                self._barrier(s, s.cdata, reached)
                self._wait(s, s.cdata, release)
                self._barrier(s, s.cdata)
                self._appended(s)
                self._hold_until_passed(s, release)
                self._worker(s).put((reached, release, fn, True, errors))
        except BaseException:
            self._slots.drop(reached)
            self._slots.drop(release)
            raise

    # -- capture and graphs -------------------------------------------------------------------

    def supports_graphs(self, device: int) -> bool:
        return True

    def stream_begin_capture(self, device: int, stream: int, mode: CaptureMode) -> None:
        s = self._stream(device, stream)
        _capture.check_begin("xpu", s)
        ffi, lib = self._ze.ffi, self._ze.lib
        dev = self._devices[device]
        desc = ffi.new("ze_command_list_desc_t *", {
            "stype": lib.ZE_STRUCTURE_TYPE_COMMAND_LIST_DESC, "commandQueueGroupOrdinal": dev.ordinal,
        })
        out = ffi.new("ze_command_list_handle_t *")
        self._check("zeCommandListCreate", lib.zeCommandListCreate(self._context, dev.cdata, desc, out), device)
        start, done = self._slots.acquire(False), self._slots.acquire(False)
        capture = CaptureState(s, mode, out[0], start, done)
        try:
            # Each replay waits until its stream reaches it, then re-arms the start event.
            self._wait(s, out[0], start)
            self._reset(s, out[0], start)
        except BaseException:
            self._discard_capture(capture)
            raise
        s.capture = capture

    def _discard_capture(self, capture: CaptureState) -> None:
        self._check("zeCommandListDestroy", self._ze.lib.zeCommandListDestroy(capture.cdata), capture.origin.device)
        for slot in (capture.start, capture.done):
            self._slots.drop(slot)
        for reached, release, _ in capture.host_nodes:
            self._slots.drop(reached)
            self._slots.drop(release)
        for slot in capture.signals:
            self._slots.drop(slot)

    def stream_capture_status(self, device: int, stream: int) -> CaptureStatus:
        return _capture.status(self._stream(device, stream))

    def stream_capture_id(self, device: int, stream: int) -> int:
        return _capture.ident(self._stream(device, stream))

    def stream_capture_length(self, device: int, stream: int) -> int | None:
        return _capture.length(self._stream(device, stream))

    def stream_end_capture(self, device: int, stream: int) -> int:
        s = self._stream(device, stream)
        capture = s.xpu_capture()
        lib = self._ze.lib
        try:
            _capture.end_capture("xpu", s)
            assert capture is not None  # end_capture refuses a stream that is not capturing
            self._barrier(s, capture.cdata, capture.done)
            self._check("zeCommandListClose", lib.zeCommandListClose(capture.cdata), device)
        except BaseException:
            if capture is not None and not capture.active:
                # Over without giving a graph (invalidated, a fork not joined back, or the
                # list failed to close): nothing will replay the list.
                self._discard_capture(capture)
            raise
        graph = GraphState(
            device, self._addr(capture.cdata), capture.cdata, capture.start, capture.done,
            list(capture.nodes), list(capture.host_nodes), capture.keep, signals=list(capture.signals),
            waits=list(capture.waits),
        )
        with self._lock:
            self._graphs[graph.handle] = graph
        return graph.handle

    def _graph(self, device: int, handle: int) -> GraphState:
        return live(self._graphs, handle, device, "graph")

    def graph_instantiate(self, device: int, graph: int) -> int:
        g = self._graph(device, graph)
        # A closed regular command list is already executable: instances share it.
        handle = new_handle()
        with self._lock:
            g.owners += 1
            self._execs[handle] = g
        return handle

    def graph_launch(self, device: int, graph_exec: int, stream: int) -> None:
        g = live(self._execs, graph_exec, device, "executable graph")
        s = self._stream(device, stream)
        if s.capture is not None:
            raise CaptureError(f"xpu:{device}: launching a graph inside a capture is not supported")
        ffi, lib = self._ze.ffi, self._ze.lib
        for e in g.waits:
            self._wait_for_last_record(s, e, own=g.signals)
        # Its host nodes' failures: the launch's stream reports them, as on the host.
        errors = self._errors_of(device, stream) if g.host_nodes else None
        with g.lock, s.lock:
            self._check_open(s)
            queue = self._graph_queue(g)
            consumed = self._slots.acquire(False)
            previous = g.last_launch
            try:
                if previous is not None:
                    # Replays share the list's start/done events: the previous replay
                    # must be consumed, on whichever stream ran it, before this one starts.
                    self._wait(s, s.cdata, previous)
                self._barrier(s, s.cdata, g.start)
                # The replay's event records count from its launch on, as CUDA issues
                # them at cuGraphLaunch: a query, synchronize or wait after the launch
                # sees this replay's record pending, not the last replay's done.
                for slot in g.signals:
                    self._check("zeEventHostReset", lib.zeEventHostReset(slot.cdata), device)
                lists = ffi.new("ze_command_list_handle_t[1]", [g.cdata])
                code = lib.zeCommandQueueExecuteCommandLists(queue, 1, lists, ffi.NULL)
                if code != lib.ZE_RESULT_SUCCESS:
                    for slot in g.signals:  # nothing will signal them: complete, as before the launch
                        lib.zeEventHostSignal(slot.cdata)
                self._check("zeCommandQueueExecuteCommandLists", code, device)
                self._wait(s, s.cdata, g.done)
                self._reset(s, s.cdata, g.done)
                self._barrier(s, s.cdata, consumed)
                self._appended(s)
                if previous is not None:
                    self._hold_until_passed(s, previous)
            except BaseException:
                self._slots.drop(consumed)
                raise
            g.last_launch = consumed
            self._slots.drop(previous)
            if g.host_nodes:
                if g.worker is None:
                    g.worker = HostWorker(self, f"accel-xpu-graph-{g.handle:#x}")
                for reached, release, fn in g.host_nodes:
                    g.worker.put((reached, release, fn, False, errors))

    def _graph_queue(self, g: GraphState) -> object:
        """The graph's command queue, made on its first replay."""
        if g.queue is None:
            ffi, lib = self._ze.ffi, self._ze.lib
            dev = self._devices[g.device]
            desc = ffi.new("ze_command_queue_desc_t *", {
                "stype": lib.ZE_STRUCTURE_TYPE_COMMAND_QUEUE_DESC,
                "ordinal": dev.ordinal,
                "mode": lib.ZE_COMMAND_QUEUE_MODE_ASYNCHRONOUS,
            })
            out = ffi.new("ze_command_queue_handle_t *")
            self._check("zeCommandQueueCreate", lib.zeCommandQueueCreate(self._context, dev.cdata, desc, out), g.device)
            g.queue = out[0]
        return g.queue

    def _release_graph(self, g: GraphState) -> None:
        with self._lock:
            g.owners -= 1
            last = g.owners == 0
        if not last:
            return
        lib = self._ze.lib
        if g.last_launch is not None and lib.zeEventQueryStatus(g.last_launch.cdata) == _NOT_READY:
            # The list is still replaying, and Level Zero forbids destroying it meanwhile.
            # No wait here: the replay may never end (a host function of it blocked), or
            # this may be the thread that runs its host functions (a replay resetting its
            # own graph). The next reap destroys it (device_synchronize waits for it).
            with self._lock:
                self._dying_graphs.append(g)
            return
        self._destroy_graph(g)

    def _destroy_graph(self, g: GraphState) -> None:
        """Destroy graph ``g``, no owner left and no replay of it running."""
        lib = self._ze.lib
        if g.last_launch is not None:
            self._slots.drop(g.last_launch)
        if g.worker is not None:
            g.worker.put(None)
        if g.queue is not None:
            self._check("zeCommandQueueDestroy", lib.zeCommandQueueDestroy(g.queue), g.device)
        self._check("zeCommandListDestroy", lib.zeCommandListDestroy(g.cdata), g.device)
        for slot in (g.start, g.done):
            self._slots.drop(slot)
        for reached, release, _ in g.host_nodes:
            self._slots.drop(reached)
            self._slots.drop(release)
        for slot in g.signals:
            self._slots.drop(slot)

    def graph_node_count(self, device: int, graph: int) -> int | None:
        return len(self._graph(device, graph).nodes)

    def graph_destroy(self, device: int, graph: int) -> None:
        g = self._graph(device, graph)
        with self._lock:
            del self._graphs[graph]
        self._release_graph(g)

    def graph_exec_destroy(self, device: int, graph_exec: int) -> None:
        with self._lock:
            g = live(self._execs, graph_exec, device, "executable graph")
            del self._execs[graph_exec]
        self._release_graph(g)

    def graph_debug_dump(self, device: int, graph: int, path: str) -> None:
        g = self._graph(device, graph)
        with open(path, "w") as f:
            f.write(
                f"accel xpu graph {graph:#x} on xpu:{device}: a Level Zero regular command list, "
                f"{len(g.nodes)} commands run in order\n"
            )
            for i, node in enumerate(g.nodes):
                f.write(f"{i:6d}  {node}\n")
