"""accel: one Python API for the runtime of any accelerator.

Devices, memory, streams, events and graphs over NVIDIA GPUs (the CUDA driver
API), Intel GPUs (Level Zero) and the host CPU, with torch.accelerator's names::

    import accel

    dev = accel.current_accelerator()          # Device(type='cpu'|'cuda'|'xpu')
    free, total = accel.get_memory_info()
    s = accel.Stream()
    with s:
        start = accel.Event(enable_timing=True)
        start.record()
    s.synchronize()

Importing accel loads no driver and no torch; the backend is chosen on first
use (``ACCEL_BACKEND=cpu|cuda|xpu``, or the first available of cuda, xpu, cpu).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from accel._device import Device
from accel._errors import (
    AccelError,
    AllocatorConfigError,
    BackendUnavailableError,
    CaptureError,
    DeviceError,
    DriverError,
    HostFunctionError,
    InvalidHandleError,
    InvalidValueError,
    NotSupportedError,
    OutOfMemoryError,
)
from accel._facade import (
    can_device_access_peer,
    current_accelerator,
    current_device_idx,
    current_device_index,
    current_stream,
    default_stream,
    device_count,
    device_index,
    get_device_capability,
    get_device_properties,
    get_memory_info,
    is_available,
    set_device_idx,
    set_device_index,
    set_stream,
    synchronize,
)
from accel import _runtime
from accel.backends.base import DeviceProperties
from accel.stream import Event, ExternalStream, Stream


def _load_interop() -> None:
    # The interop layer gives buffers their exchange formats (DLPack, CUDA Array
    # Interface) when it loads. It imports the allocator, so it is loaded on first
    # need: a buffer's first export, or a name below that lives there.
    from accel import _interop  # noqa: F401


_runtime.install_interop_loader(_load_interop)

__version__ = "0.1.0"

__all__ = [
    "AccelError",
    "AllocatorConfigError",
    "AllocatorConfigWarning",
    "BackendUnavailableError",
    "CaptureError",
    "Device",
    "DeviceError",
    "DeviceProperties",
    "DriverError",
    "Event",
    "Graph",
    "ExternalStream",
    "HostFunctionError",
    "InvalidHandleError",
    "InvalidValueError",
    "NotSupportedError",
    "OutOfMemoryError",
    "Stream",
    "allocator",
    "as_tensor",
    "can_device_access_peer",
    "current_accelerator",
    "current_device_idx",
    "current_device_index",
    "current_stream",
    "default_stream",
    "device_count",
    "device_index",
    "distributed",
    "empty",
    "empty_cache",
    "empty_host_cache",
    "from_dlpack",
    "get_device_capability",
    "get_device_properties",
    "get_memory_info",
    "graph",
    "graph_pool_handle",
    "is_available",
    "is_capturing",
    "max_memory_allocated",
    "max_memory_reserved",
    "memory",
    "memory_allocated",
    "memory_reserved",
    "memory_stats",
    "reset_accumulated_memory_stats",
    "reset_peak_memory_stats",
    "set_device_idx",
    "set_device_index",
    "set_stream",
    "synchronize",
]

if TYPE_CHECKING:
    # What __getattr__ below loads on first use, spelled out for type checkers so
    # that accel.Graph, accel.memory_stats() or accel.empty() have their real types.
    from accel import allocator, backends, distributed, graph, memory, stream
    from accel._interop import from_dlpack
    from accel._interop.torch import as_tensor, empty
    from accel.allocator.config import AllocatorConfigWarning
    from accel.graph import (
        Graph,
        GraphCacheWarning,
        compile_graph,
        graph_pool_handle,
        is_capturing,
        make_graphed_callables,
    )
    from accel.memory import (
        empty_cache,
        empty_host_cache,
        max_memory_allocated,
        max_memory_reserved,
        memory_allocated,
        memory_reserved,
        memory_stats,
        reset_accumulated_memory_stats,
        reset_peak_memory_stats,
    )

# Subpackages and names loaded on first access, so that `import accel` stays cheap.
# Names that need torch (make_graphed_callables, compile_graph, GraphCacheWarning)
# are reachable as attributes but left out of __all__, so `from accel import *`
# never imports torch.
_LAZY_MODULES = ("allocator", "backends", "distributed", "graph", "memory", "stream")
_LAZY_NAMES = {
    "AllocatorConfigWarning": "accel.allocator.config",
    "graph_pool_handle": "accel.graph",
    "as_tensor": "accel._interop.torch",
    "from_dlpack": "accel._interop",
    "Graph": "accel.graph",
    "GraphCacheWarning": "accel.graph",
    "compile_graph": "accel.graph",
    "is_capturing": "accel.graph",
    "make_graphed_callables": "accel.graph",
    "empty": "accel._interop.torch",
    **{
        name: "accel.memory"
        for name in (
            "empty_cache",
            "empty_host_cache",
            "max_memory_allocated",
            "max_memory_reserved",
            "memory_allocated",
            "memory_reserved",
            "memory_stats",
            "reset_accumulated_memory_stats",
            "reset_peak_memory_stats",
        )
    },
}


def __getattr__(name: str) -> Any:
    if name in _LAZY_MODULES:
        return importlib.import_module(f"accel.{name}")
    module = _LAZY_NAMES.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value  # later lookups skip this function (accel.empty is on hot paths)
        return value
    raise AttributeError(f"module 'accel' has no attribute {name!r}")


def __dir__() -> list[str]:
    # The public names (what tab completion and help() offer), not this module's
    # own imports and helpers; the module's dunders stay, as on any module.
    dunders = (name for name in globals() if name.startswith("__") and name.endswith("__"))
    return sorted({*__all__, *_LAZY_MODULES, *_LAZY_NAMES, *dunders})
