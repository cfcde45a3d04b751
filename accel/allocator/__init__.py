"""Device memory management: the caching DeviceAllocator, its upstream resources, and its configuration.

Import-cheap: nothing here imports torch or loads a backend.

>>> from accel.allocator import parse
>>> parse("expandable_segments:True").expandable_segments
True
"""

from __future__ import annotations

from accel.allocator._blocks import Block
from accel.allocator._caching import DeviceAllocator
from accel.allocator._host_cache import HostCachingAllocator
from accel.allocator._oom import OutOfMemoryDetails
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

__all__ = [
    "BackendResource",
    "Block",
    "DeviceAllocator",
    "HostCachingAllocator",
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
