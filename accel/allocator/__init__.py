"""Device memory management: the caching DeviceAllocator, its upstream resources, its
configuration, the per-device registry, buffers and memory pool ids.

Import-cheap: nothing here imports torch or loads a backend.

>>> from accel.allocator import parse
>>> parse("expandable_segments:True").expandable_segments
True
"""

from __future__ import annotations

from accel.allocator._buffer import Buffer, HostBuffer, allocate, allocate_host
from accel.allocator._caching import DeviceAllocator
from accel.allocator._mempool import MemPool, use_mem_pool
from accel.allocator._oom import OutOfMemoryDetails
from accel.allocator._pool_ids import PoolId, graph_pool_handle
from accel.allocator._registry import empty_cache, get_allocator, set_upstream
from accel.allocator._resources import (
    BackendResource,
    LimitingAdaptor,
    LoggingAdaptor,
    MemoryResource,
    ResourceAdaptor,
    ResourceCounts,
    StatisticsAdaptor,
)
from accel.allocator.config import (
    ACCEL_BACKEND_VARIABLES,
    ACCEL_VARIABLE,
    PYTORCH_VARIABLES,
    AllocatorConfig,
    AllocatorConfigWarning,
    ChangeListener,
    ConfigStringError,
    EnvironmentReport,
    KeySpec,
    add_change_listener,
    add_change_observer,
    config_for_backend,
    get_config,
    keys,
    parse,
    read_environment,
    reload_from_environment,
    remove_change_listener,
    set_settings,
)

# The public names (docs/api.md lists exactly these). The machinery behind them (the
# per-runtime registry, blocks, pool-id checks, the buffer exports' installation,
# snapshots' assembly) is imported from its own module by the layers that use it.
__all__ = [
    "Buffer",
    "DeviceAllocator",
    "HostBuffer",
    "MemPool",
    "PoolId",
    "allocate",
    "allocate_host",
    "empty_cache",
    "get_allocator",
    "graph_pool_handle",
    "set_upstream",
    "use_mem_pool",
    "BackendResource",
    "LimitingAdaptor",
    "LoggingAdaptor",
    "MemoryResource",
    "OutOfMemoryDetails",
    "ResourceAdaptor",
    "ResourceCounts",
    "StatisticsAdaptor",
    "ACCEL_BACKEND_VARIABLES",
    "ACCEL_VARIABLE",
    "PYTORCH_VARIABLES",
    "AllocatorConfig",
    "AllocatorConfigWarning",
    "ChangeListener",
    "ConfigStringError",
    "EnvironmentReport",
    "KeySpec",
    "add_change_listener",
    "add_change_observer",
    "config_for_backend",
    "get_config",
    "keys",
    "parse",
    "read_environment",
    "reload_from_environment",
    "remove_change_listener",
    "set_settings",
]
