"""The host backend: the CPU presented as an accelerator, for real.

Memory is real (mmap, memfd), virtual memory is real (reserved address space
with physical chunks mapped in and out), and created streams run their work
on worker threads, so code tested here meets the same asynchrony it meets on
a GPU.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from functools import cache

from accel._errors import BackendUnavailableError, InvalidValueError
from accel._units import parse_size
from accel.backends import _capture
from accel.backends.base import Backend, CaptureMode, CaptureStatus, DeviceProperties, TorchIntegration
from accel.backends.cpu import _libc
from accel.backends.cpu._memory import VM_GRANULARITY, DeviceMemory, HostMemory, machine_memory
from accel.backends.cpu._streams import HostStream, StreamTable

#: Lower numbers mean higher priority, as in CUDA.
PRIORITY_RANGE = (0, -1)

# platform and uuid are imported where used: only device properties need them, and
# selecting the host backend is on every CPU-only process's start-up path.


@cache
def _cpu_model() -> str:
    import platform

    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def _machine_id() -> str:
    import platform

    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                return f.read().strip()
        except OSError:
            continue
    return platform.node()


# Each host device has its own memory and stream tables, built at load: a
# count in the billions would never finish loading.
MAX_CPU_DEVICES = 1024


def _env_device_count() -> int:
    text = os.environ.get("ACCEL_CPU_DEVICES", "1").strip()
    # isascii: str.isdigit() also accepts "²", which int() refuses.
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MAX_CPU_DEVICES:
        raise BackendUnavailableError(
            "cpu",
            f"ACCEL_CPU_DEVICES={text!r} is not an integer from 1 to {MAX_CPU_DEVICES}",
            remedy="set it to the number of host devices to present, e.g. ACCEL_CPU_DEVICES=2",
        )
    return int(text)


def _env_memory_limit() -> int | None:
    text = os.environ.get("ACCEL_CPU_MEMORY_LIMIT", "").strip()
    if not text:
        return None
    try:
        return parse_size(text, name="ACCEL_CPU_MEMORY_LIMIT")
    except ValueError as exc:
        raise BackendUnavailableError("cpu", str(exc)) from None


class CpuBackend(Backend):
    """The host CPU as ``ACCEL_CPU_DEVICES`` devices (default 1)."""

    name = "cpu"
    torch_device_type = "cpu"
    more_devices_hint = "set ACCEL_CPU_DEVICES=N to present N host devices"
    host_memory_page_locked = False  # mmap'ed pages: every page is host memory, none is locked
    torch_integration = TorchIntegration.RECORD_HOST_OPS

    def __init__(self, device_count: int, memory_limit: int | None) -> None:
        self._count = device_count
        self._memory = [DeviceMemory(d, memory_limit) for d in range(device_count)]
        self._host = HostMemory()
        self._streams = StreamTable(device_count)

    # -- devices --------------------------------------------------------------

    def device_count(self) -> int:
        return self._count

    def device_properties(self, device: int) -> DeviceProperties:
        import platform
        import uuid

        _, total = self._memory[device].info()
        _, _, source = machine_memory()
        limit = self._memory[device].limit
        return DeviceProperties(
            name=_cpu_model(),
            type="cpu",
            index=device,
            total_memory=total,
            uuid=str(uuid.uuid5(uuid.NAMESPACE_OID, f"accel-cpu:{_machine_id()}:{device}")),
            multi_processor_count=os.cpu_count() or 1,
            driver_version=f"{platform.system()} {platform.release()}",
            is_integrated=True,
            extra={
                "memory_info_source": "ACCEL_CPU_MEMORY_LIMIT" if limit is not None else source,
                "vm_granularity": VM_GRANULARITY,
                "machine": platform.machine(),
            },
        )

    def memory_info(self, device: int) -> tuple[int, int]:
        return self._memory[device].info()

    def can_access_peer(self, device: int, peer: int) -> bool:
        return True  # every host device shares one address space

    def device_synchronize(self, device: int) -> None:
        self._streams.synchronize_device(device)

    # -- memory -----------------------------------------------------------------

    def malloc(self, device: int, nbytes: int) -> int:
        return self._memory[device].malloc(nbytes)

    def free(self, device: int, ptr: int) -> None:
        self._memory[device].free(ptr)

    def host_malloc(self, nbytes: int) -> int:
        return self._host.malloc(nbytes)

    def host_free(self, ptr: int) -> None:
        self._host.free(ptr)

    def supports_virtual_memory(self, device: int) -> bool:
        return True

    def vm_granularity(self, device: int) -> int:
        return VM_GRANULARITY

    def vm_reserve(self, device: int, nbytes: int) -> int:
        return self._memory[device].reserve(nbytes)

    def vm_free(self, device: int, addr: int, nbytes: int) -> None:
        self._memory[device].release_reservation(addr, nbytes)

    def vm_create(self, device: int, nbytes: int) -> int:
        return self._memory[device].create(nbytes)

    def vm_release(self, device: int, handle: int) -> None:
        self._memory[device].release(handle)

    def vm_map(self, device: int, addr: int, nbytes: int, handle: int) -> None:
        self._memory[device].map(addr, nbytes, handle)

    def vm_unmap(self, device: int, addr: int, nbytes: int) -> None:
        self._memory[device].unmap(addr, nbytes)

    # -- sharing with other processes ------------------------------------------------
    # Memory: ranges of the sealed files behind a buffer (see DeviceMemory.export). Events:
    # a page of shared memory holding the record and completion counts.

    def supports_ipc(self, device: int) -> bool:
        return True

    def ipc_memory_export(self, device: int, ptr: int, nbytes: int) -> tuple[bytes, list[int]]:
        return self._memory[device].export(ptr, nbytes)

    def ipc_memory_import(self, device: int, payload: bytes, fds: list[int], nbytes: int) -> int:
        return self._memory[device].import_(payload, fds, nbytes)

    def ipc_memory_close(self, device: int, ptr: int) -> None:
        self._memory[device].close_import(ptr)

    def ipc_event_export(self, device: int, event: int) -> tuple[bytes, list[int]]:
        return self._streams.export_event(device, event)

    def ipc_event_import(self, device: int, payload: bytes, fds: list[int]) -> int:
        return self._streams.import_event(device, payload, fds)

    # -- streams and events -------------------------------------------------------

    def default_stream(self, device: int) -> int:
        return self._streams.defaults[device].handle

    def stream_priority_range(self, device: int) -> tuple[int, int]:
        return PRIORITY_RANGE

    def stream_create(self, device: int, priority: int) -> int:
        return self._streams.create_stream(device, priority)

    def stream_destroy(self, device: int, stream: int) -> None:
        self._streams.destroy_stream(device, stream)

    def stream_query(self, device: int, stream: int) -> bool:
        return self._streams.query(device, stream)

    def stream_synchronize(self, device: int, stream: int) -> None:
        self._streams.synchronize(device, stream)

    def stream_wait_event(self, device: int, stream: int, event: int) -> None:
        self._streams.wait_event(device, stream, event)

    def event_create(self, device: int, *, timing: bool, blocking: bool, interprocess: bool) -> int:
        # The blocking flag changes nothing on the host: waits always block on a
        # condition variable. Interprocess events keep their state in shared memory.
        return self._streams.create_event(device, timing, interprocess)

    def event_destroy(self, device: int, event: int) -> None:
        self._streams.destroy_event(device, event)

    def event_record(self, device: int, event: int, stream: int) -> None:
        self._streams.record(device, event, stream)

    def event_record_external(self, device: int, event: int, stream: int) -> None:
        self._streams.record(device, event, stream, external=True)

    def stream_wait_event_external(self, device: int, stream: int, event: int) -> None:
        self._streams.wait_event_external(device, stream, event)

    def event_query(self, device: int, event: int) -> bool:
        return self._streams.event_query(device, event)

    def event_synchronize(self, device: int, event: int) -> None:
        self._streams.event_synchronize(device, event)

    def event_elapsed_ms(self, device: int, start: int, end: int) -> float:
        first = self._streams.event(device, start)
        last = self._streams.event(device, end)
        for event in (first, last):
            if not event.timing:
                raise InvalidValueError(
                    f"cpu:{device}: event {event.handle:#x} was created without timing; "
                    "create both events with enable_timing=True"
                )
            if event.record_gen == 0 or not event.is_done():
                raise InvalidValueError(
                    f"cpu:{device}: event {event.handle:#x} has not completed; synchronize it first"
                )
        return (last.timestamp_ns - first.timestamp_ns) / 1e6

    # -- stream work --------------------------------------------------------------

    def memcpy_async(self, device: int, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._streams.stream(device, stream).submit(
            f"copy {nbytes} bytes {src:#x} -> {dst:#x}", lambda: _libc.memmove(dst, src, nbytes)
        )

    def memset_async(self, device: int, dst: int, value: int, nbytes: int, stream: int) -> None:
        self._streams.stream(device, stream).submit(
            f"fill {nbytes} bytes at {dst:#x} with {value:#04x}",
            lambda: _libc.memset(dst, value, nbytes),
        )

    def launch_host_func(self, device: int, stream: int, fn: Callable[[], None]) -> None:
        self._reporting(device, stream).submit(
            lambda: f"host function {getattr(fn, '__qualname__', type(fn).__name__)}", fn
        )

    def _reporting(self, device: int, stream: int) -> HostStream:
        """``stream``, its worker reporting a failure of what it runs in the runtime's
        host errors of the stream (as the xpu backend's worker does), even where no
        launcher() named them: a stream made by the backend and wrapped, not created
        by accel.Stream, dropped its failures. The inline default stream raises them
        at once instead."""
        host = self._streams.stream(device, stream)
        if host.errors is None and not host.inline and self.host_errors is not None:
            host.errors = self.host_errors(device, stream)
        return host

    def host_func_launcher(
        self,
        device: int,
        stream: int,
        errors: collections.deque[tuple[str, BaseException]],
        fallback: Callable[[Callable[[], object]], None],
    ) -> Callable[[Callable[[], object]], None] | None:
        host = self._streams.stream(device, stream)
        return None if host.inline else host.launcher(errors, fallback)

    # -- capture and graphs ---------------------------------------------------------

    def supports_graphs(self, device: int) -> bool:
        return True

    def stream_begin_capture(self, device: int, stream: int, mode: CaptureMode) -> None:
        self._streams.begin_capture(device, stream, mode)

    def stream_end_capture(self, device: int, stream: int) -> int:
        return self._streams.end_capture(device, stream)

    def stream_capture_status(self, device: int, stream: int) -> CaptureStatus:
        return self._streams.capture_status(device, stream)

    def stream_capture_id(self, device: int, stream: int) -> int:
        return _capture.ident(self._streams.stream(device, stream))

    def stream_capture_length(self, device: int, stream: int) -> int | None:
        return _capture.length(self._streams.stream(device, stream))

    def graph_instantiate(self, device: int, graph: int) -> int:
        return self._streams.instantiate(graph)

    def graph_launch(self, device: int, graph_exec: int, stream: int) -> None:
        self._reporting(device, stream)  # a failing node is the launch stream's to report
        self._streams.launch(device, graph_exec, stream)

    def graph_node_count(self, device: int, graph: int) -> int | None:
        return len(self._streams.graph_nodes(graph))

    def graph_destroy(self, device: int, graph: int) -> None:
        self._streams.destroy_graph(graph)

    def graph_exec_destroy(self, device: int, graph_exec: int) -> None:
        self._streams.destroy_exec(graph_exec)

    def graph_debug_dump(self, device: int, graph: int, path: str) -> None:
        nodes = self._streams.graph_nodes(graph)
        with open(path, "w") as f:
            f.write(f"accel host graph {graph:#x} on cpu:{device}: {len(nodes)} nodes, run in order\n")
            for i, node in enumerate(nodes):
                f.write(f"{i:6d}  {node.description}\n")


def load() -> CpuBackend:
    """The host backend, configured from ``ACCEL_CPU_DEVICES`` and ``ACCEL_CPU_MEMORY_LIMIT``."""
    return CpuBackend(_env_device_count(), _env_memory_limit())
