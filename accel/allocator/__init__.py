"""Device memory management: the caching DeviceAllocator, its upstream resources, its
configuration, the per-device registry, buffers and memory pool ids.

Import-cheap: nothing here imports torch or loads a backend.

>>> from accel.allocator import parse
>>> parse("expandable_segments:True").expandable_segments
True
"""

from __future__ import annotations

from accel.allocator._blocks import Block
from accel.allocator._buffer import Buffer, BufferExports, HostBuffer, allocate, allocate_host, install_exports
from accel.allocator._caching import DeviceAllocator
from accel.allocator._host_cache import HostCachingAllocator
from accel.allocator._mempool import MemPool, current_allocator, use_mem_pool
from accel.allocator._oom import OutOfMemoryDetails
from accel.allocator._pool_ids import PoolId, check_pool_id, graph_pool_handle, new_private_pool_id
from accel.allocator._registry import (
    AllocatorRegistry,
    allocators,
    empty_cache,
    get_allocator,
    registry,
    set_upstream,
)
from accel.allocator._resources import (
    BackendResource,
    LimitingAdaptor,
    LoggingAdaptor,
    MemoryResource,
    ResourceAdaptor,
    ResourceCounts,
    StatisticsAdaptor,
)
from accel.allocator._snapshot import dump_snapshot, full_snapshot, summary
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

__all__ = [
    "AllocatorRegistry",
    "BackendResource",
    "Block",
    "Buffer",
    "BufferExports",
    "DeviceAllocator",
    "HostBuffer",
    "HostCachingAllocator",
    "MemPool",
    "PoolId",
    "allocate",
    "allocate_host",
    "allocators",
    "check_pool_id",
    "current_allocator",
    "dump_snapshot",
    "empty_cache",
    "full_snapshot",
    "get_allocator",
    "graph_pool_handle",
    "install_exports",
    "new_private_pool_id",
    "registry",
    "set_upstream",
    "summary",
    "use_mem_pool",
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
