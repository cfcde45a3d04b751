"""Allocator configuration (and, with the caching allocator, device memory management).

Import-cheap: nothing here imports torch or loads a backend.

>>> from accel.allocator import parse
>>> parse("expandable_segments:True").expandable_segments
True
"""

from __future__ import annotations

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
    "config_for_backend",
    "get_config",
    "keys",
    "parse",
    "read_environment",
    "reload_from_environment",
    "remove_change_listener",
    "set_settings",
]
