"""AllocatorConfig: the one place allocator settings are read, checked, explained and applied.

Sources, in order of precedence (later ones override earlier ones key by key):

1. defaults;
2. ``ACCEL_ALLOC_CONF`` (every backend);
3. ``ACCEL_CUDA_ALLOC_CONF`` / ``ACCEL_XPU_ALLOC_CONF`` / ``ACCEL_CPU_ALLOC_CONF``;
4. :func:`set_settings` calls, which change only the keys they name.

When no ``ACCEL_*`` variable is set at all, PyTorch's variables are read
instead, with PyTorch's own precedence: the first of
``PYTORCH_CUDA_ALLOC_CONF``, ``PYTORCH_HIP_ALLOC_CONF``, ``PYTORCH_ALLOC_CONF``
that is set (even to an empty string) is used for every backend.

The environment is read once, lazily, at the first :func:`get_config` /
:func:`config_for_backend` / :func:`set_settings` (like PyTorch, which reads
it at the first allocator use). A variable changed later is ignored, with a
warning saying so; :func:`reload_from_environment` reads it again.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from accel._errors import AllocatorConfigError, DeviceError, warn_at_caller
from accel.allocator._config_keys import (
    BACKENDS,
    KEYS,
    KEYS_BY_FIELD,
    MAX_MIB,
    MAX_U64,
    MIB,
    ROUNDUP_SLOTS,
    KeySpec,
)
from accel.allocator._config_parse import (
    ConfigStringError,
    RoundupList,
    Setting,
    parse_settings,
    roundup_from_list,
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

#: Applies to every backend.
ACCEL_VARIABLE = "ACCEL_ALLOC_CONF"
#: Override ACCEL_ALLOC_CONF key by key for one backend.
ACCEL_BACKEND_VARIABLES: Mapping[str, str] = MappingProxyType(
    {name: f"ACCEL_{name.upper()}_ALLOC_CONF" for name in BACKENDS}
)
#: Read only when no ACCEL_ variable is set; the first one set wins (PyTorch's order).
PYTORCH_VARIABLES: tuple[str, ...] = (
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_HIP_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
)
# PyTorch never reads it, which surprises people: worth a warning.
_PYTORCH_XPU_VARIABLE = "PYTORCH_XPU_ALLOC_CONF"
_WATCHED = (ACCEL_VARIABLE, *ACCEL_BACKEND_VARIABLES.values(), *PYTORCH_VARIABLES, _PYTORCH_XPU_VARIABLE)

DEFAULT = "default"
_SET_SETTINGS = "set_settings()"


class AllocatorConfigWarning(UserWarning):
    """A configuration that works but probably does not do what was meant."""


def _frozen_sources() -> Mapping[str, str]:
    return MappingProxyType({})


@dataclasses.dataclass(frozen=True, kw_only=True)
class AllocatorConfig:
    """Every effective allocator setting of one backend, sizes in bytes.

    Build one with :func:`parse`, get the live one with :func:`get_config`;
    ``str(config)`` is a canonical configuration string that parses back to
    an equal config. ``sources`` (field -> where the value came from) and
    ``warnings`` are not part of equality.

    >>> from accel.allocator import parse
    >>> config = parse("max_split_size_mb:256, expandable_segments:true")
    >>> config.max_split_size, config.expandable_segments
    (268435456, True)
    >>> str(config)
    'max_split_size_mb:256,expandable_segments:True'
    >>> config.sources["max_split_size"], config.sources["large_segment_size"]
    ('parse()', 'default')
    """

    large_segment_size: int = 20 * MIB
    max_split_size: int | None = None
    """None: every cached block may be split."""
    max_non_split_rounding: int = 20 * MIB
    garbage_collection_threshold: float = 0.0
    """0.0: off."""
    roundup_power2_divisions: tuple[int, ...] = (0,) * ROUNDUP_SLOTS
    expandable_segments: bool = False
    expandable_keep_free: int = 0
    """Free bytes of holes the expandable segments keep mapped when one grows."""
    pinned_use_background_threads: bool = False
    pinned_max_round_threshold: int | None = None
    pinned_max_cached_size: int | None = None
    per_process_memory_fraction: float = 1.0
    allocator_backend: str = "native"
    release_lock_on_cudamalloc: bool = False
    pinned_use_cuda_host_register: bool = False
    pinned_num_register_threads: int = 1
    pinned_reserve_segment_size: int = 0
    """0: nothing reserved."""
    graph_capture_record_stream_reuse: bool = False
    pinned_free_catch_all: bool = False
    throw_on_cudamalloc_oom: bool = False
    sources: Mapping[str, str] = dataclasses.field(
        default_factory=_frozen_sources, compare=False, repr=False
    )
    warnings: tuple[str, ...] = dataclasses.field(default=(), compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_fields(self)
        sources = dict(self.sources)
        unknown = set(sources) - set(KEYS_BY_FIELD)
        if unknown:
            raise AllocatorConfigError(
                f"AllocatorConfig.sources names unknown fields {sorted(unknown)}; "
                f"the fields are {', '.join(KEYS_BY_FIELD)}"
            )
        for spec in KEYS:
            if spec.field not in sources:
                differs = getattr(self, spec.field) != _DEFAULT_VALUES[spec.field]
                if spec.field == "max_non_split_rounding":
                    differs = self.max_non_split_rounding != self.large_segment_size
                sources[spec.field] = "AllocatorConfig()" if differs else DEFAULT
        object.__setattr__(self, "sources", MappingProxyType(sources))
        object.__setattr__(self, "warnings", tuple(self.warnings))

    def roundup_divisions(self, size: int) -> int:
        """Divisions for a request of ``size`` bytes (0: no power-of-two rounding).

        The slot is ``clamp(floor(log2 size) - 20, 0, 15)``: every size below
        2 MiB uses slot 0, every size from 32 GiB up uses slot 15.

        >>> from accel.allocator import parse
        >>> parse("roundup_power2_divisions:[64:8,>:2]").roundup_divisions(200 << 20)
        2
        """
        slot = size.bit_length() - 21
        return self.roundup_power2_divisions[0 if slot < 0 else min(slot, ROUNDUP_SLOTS - 1)]

    def __str__(self) -> str:
        parts = []
        for spec in KEYS:
            value = getattr(self, spec.field)
            if spec.field == "max_non_split_rounding":
                if value == self.large_segment_size:
                    continue
            elif value == _DEFAULT_VALUES[spec.field]:
                continue
            parts.append(f"{spec.key}:{_render_value(spec, value)}")
        return ",".join(parts)

    def describe(self, field: str) -> str:
        """The value of ``field`` as a person reads it: ``'256 MiB'``, ``'unlimited'``, ``'True'``."""
        spec = KEYS_BY_FIELD.get(field)
        if spec is None:
            raise AllocatorConfigError(
                f"no allocator setting called '{field}'; the fields are {', '.join(KEYS_BY_FIELD)}"
            )
        value = getattr(self, field)
        if value is None:
            return "unlimited" if field == "max_split_size" else "unset"
        if spec.unit == "MiB":
            return f"{value // MIB} MiB"
        if spec.kind == "roundup" and not any(value):
            return "0 (no rounding)"
        return _render_value(spec, value)


_DEFAULT_VALUES: dict[str, Any] = {
    f.name: (f.default if f.default is not dataclasses.MISSING else None)
    for f in dataclasses.fields(AllocatorConfig)
    if f.name in KEYS_BY_FIELD
}


def _is_pow2(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def _check_fields(config: AllocatorConfig) -> None:
    """Reject a directly built config that no configuration string could produce."""
    problems = []

    def size(field: str, *, minimum: int = 0, optional: bool = False) -> None:
        value = getattr(config, field)
        if value is None and optional:
            return
        if type(value) is not int or value < minimum or value % MIB or value // MIB > MAX_MIB:
            problems.append(f"{field}={value!r} must be a whole number of MiB in bytes, >= {minimum}")

    size("large_segment_size", minimum=11 * MIB)
    size("max_split_size", optional=True)
    size("max_non_split_rounding")
    size("pinned_max_round_threshold", optional=True)
    size("pinned_max_cached_size", optional=True)
    size("pinned_reserve_segment_size")
    size("expandable_keep_free")
    if not problems:
        if config.max_split_size is not None and config.max_split_size < config.large_segment_size:
            problems.append("max_split_size must be >= large_segment_size")
        if config.max_non_split_rounding < config.large_segment_size:
            problems.append("max_non_split_rounding must be >= large_segment_size")
    for field in ("garbage_collection_threshold", "per_process_memory_fraction"):
        value = getattr(config, field)
        if type(value) is not float:
            problems.append(f"{field}={value!r} must be a float")
        elif value and abs(value) < sys.float_info.min:
            problems.append(f"{field}={value!r} is subnormal, which PyTorch cannot read back")
    if type(config.garbage_collection_threshold) is float and not (
        config.garbage_collection_threshold == 0.0 or 0.0 < config.garbage_collection_threshold < 1.0
    ):
        problems.append("garbage_collection_threshold must be 0.0 (off) or in (0.0, 1.0)")
    fraction = config.per_process_memory_fraction
    if type(fraction) is float and not 0.0 <= fraction <= 1.0:
        problems.append("per_process_memory_fraction must be in [0.0, 1.0]")
    table = config.roundup_power2_divisions
    if (
        type(table) is not tuple
        or len(table) != ROUNDUP_SLOTS
        or not all(type(d) is int and 0 <= d <= MAX_U64 and (d == 0 or _is_pow2(d)) for d in table)
    ):
        problems.append(
            f"roundup_power2_divisions must be a tuple of {ROUNDUP_SLOTS} ints, each 0 or a power of two"
        )
    for spec in KEYS:
        value = getattr(config, spec.field)
        if spec.kind == "bool" and type(value) is not bool:
            problems.append(f"{spec.field}={value!r} must be a bool")
        if spec.kind == "choice" and value not in spec.choices:
            problems.append(f"{spec.field}={value!r} must be one of {', '.join(spec.choices)}")
    threads = config.pinned_num_register_threads
    if type(threads) is not int or not _is_pow2(threads) or threads > 128:
        problems.append("pinned_num_register_threads must be a power of two between 1 and 128")
    if problems:
        raise AllocatorConfigError("invalid AllocatorConfig: " + "; ".join(problems))


def _render_value(spec: KeySpec, value: Any) -> str:
    if spec.kind == "bool":
        return "True" if value else "False"
    if spec.kind == "float":
        return repr(value)
    if spec.kind == "choice":
        return str(value)
    if spec.kind == "roundup":
        return _render_roundup(value)
    if spec.unit == "MiB":
        return str(value // MIB)
    return str(value)


def _render_roundup(table: tuple[int, ...]) -> str:
    """The shortest form parse() turns back into ``table``."""
    if len(set(table)) == 1 and table[0]:
        return str(table[0])
    runs: list[tuple[int, int, int]] = []  # (first slot, last slot, divisions)
    for slot, divisions in enumerate(table):
        if runs and runs[-1][2] == divisions:
            runs[-1] = (runs[-1][0], slot, divisions)
        else:
            runs.append((slot, slot, divisions))
    # The first entry also fills every slot below it; '>' fills every slot after
    # the last entry; anything else needs one entry per non-zero slot.
    entries = [(runs[0][1], runs[0][2])]
    tail = runs[-1] if len(runs) > 1 and runs[-1][2] else None
    for first, last, divisions in runs[1 : len(runs) - (1 if tail else 0)]:
        if divisions:
            entries.extend((slot, divisions) for slot in range(first, last + 1))
    text = [f"{1 << slot}:{divisions}" for slot, divisions in entries]
    if tail is not None:
        if entries[-1][0] != tail[0] - 1:
            text.append(f"{1 << (tail[0] - 1)}:0")
        text.append(f">:{tail[2]}")
    return "[" + ",".join(text) + "]"


# --------------------------------------------------------------------------- applying settings


def _derived_warnings(config: AllocatorConfig) -> list[str]:
    """Warnings that follow from the values themselves (recomputed on every change)."""
    found = []
    for spec in KEYS:
        source = config.sources.get(spec.field, DEFAULT)
        if not spec.used_by_accel and source != DEFAULT:
            found.append(
                f"{spec.key} (from {source}) is a PyTorch setting not used by accel: "
                "it is accepted for compatibility and has no effect"
            )
    rounded, cached = config.pinned_max_round_threshold, config.pinned_max_cached_size
    if rounded is not None and cached is not None and rounded > cached:
        found.append(
            f"pinned_max_round_threshold_mb ({rounded // MIB}) > pinned_max_cached_size_mb "
            f"({cached // MIB}): the cache size limit takes precedence, so pinned allocations "
            "above pinned_max_cached_size_mb are never rounded up"
        )
    return found


_AT_LEAST_LARGE = ("max_split_size", "max_non_split_rounding")


def _origin_text(source: str) -> str:
    return "the default" if source == DEFAULT else f"from {source}"


def _apply(
    base: AllocatorConfig,
    settings: list[Setting],
    origin: str,
    text: str,
    events: Iterable[str] = (),
) -> AllocatorConfig:
    """``base`` with ``settings`` (parsed from ``text``) applied; checks cross-key rules."""
    values = {spec.field: getattr(base, spec.field) for spec in KEYS}
    sources = dict(base.sources)
    carried = [w for w in base.warnings if w not in _derived_warnings(base)]
    new_events = list(events)
    where: dict[str, Setting] = {}
    for setting in settings:
        field = setting.spec.field
        value = setting.value
        if isinstance(value, RoundupList):
            earlier = values[field] if field in where else (0,) * ROUNDUP_SLOTS
            value = roundup_from_list(value, earlier)
        if field in where:
            written = f"{setting.written}:{text[setting.value_start:setting.value_end]}"
            outcome = (
                f"the list {written} is applied on top of the earlier value, as PyTorch does"
                if isinstance(setting.value, RoundupList)
                else f"the last value ({written}) wins"
            )
            new_events.append(f"{origin}: {setting.spec.key} is given more than once in '{text}'; {outcome}")
        where[field] = setting
        values[field] = value
        sources[field] = origin
    if "large_segment_size" in where and sources["max_non_split_rounding"] == DEFAULT:
        # PyTorch resets max_non_split_rounding to the large segment size unless it is given.
        values["max_non_split_rounding"] = values["large_segment_size"]
    large = values["large_segment_size"]
    large_origin = "" if "large_segment_size" in where else ", " + _origin_text(sources["large_segment_size"])
    # Like PyTorch (which reads large_segment_size_mb first), every occurrence is
    # checked against the final large segment size, not only the one that wins.
    for setting in settings:
        value = setting.value
        if setting.spec.field in _AT_LEAST_LARGE and isinstance(value, int) and value < large:
            reason = (
                f"{setting.spec.key} ({value // MIB}) must be >= large_segment_size_mb "
                f"({large // MIB}{large_origin})"
            )
            raise ConfigStringError(text, setting.value_start, setting.value_end, reason, origin=origin)
    for field in _AT_LEAST_LARGE:
        value = values[field]
        if value is not None and value < large:
            # Only an earlier source can hold it: this text changed large_segment_size.
            key = KEYS_BY_FIELD[field].key
            culprit = where["large_segment_size"]
            reason = (
                f"large_segment_size_mb ({large // MIB}) would exceed {key} ({value // MIB}, "
                f"{_origin_text(sources[field])}); give {key} a value >= {large // MIB} too"
            )
            raise ConfigStringError(text, culprit.value_start, culprit.value_end, reason, origin=origin)
    config = AllocatorConfig(**values, sources=sources)
    notes = carried + [w for w in new_events if w not in carried]
    notes += [w for w in _derived_warnings(config) if w not in notes]
    return dataclasses.replace(config, sources=config.sources, warnings=tuple(notes))


def parse(text: str, *, origin: str = "parse()", base: AllocatorConfig | None = None) -> AllocatorConfig:
    """Parse a configuration string on top of ``base`` (default: the defaults); pure
    (touches no state).

    Raises :class:`ConfigStringError` (an ``AllocatorConfigError``, hence a
    ``ValueError``) that quotes the string and points at the mistake.
    Warnings are recorded in ``.warnings``, not emitted. ``origin`` names the
    string in messages and in ``sources``.

    >>> from accel.allocator import parse
    >>> parse("garbage_collection_threshold:0.6").garbage_collection_threshold
    0.6
    """
    return _apply(AllocatorConfig() if base is None else base, parse_settings(text, origin), origin, text)


def keys() -> tuple[KeySpec, ...]:
    """Every known key, in canonical order, with its type, default, range and use.

    >>> from accel.allocator import keys
    >>> [spec.key for spec in keys()][:2]
    ['large_segment_size_mb', 'max_split_size_mb']
    """
    return KEYS


# --------------------------------------------------------------------------- the environment


@dataclasses.dataclass(frozen=True)
class EnvironmentReport:
    """What :func:`read_environment` found: the variables, which were used, the configs."""

    variables: Mapping[str, str | None]
    """Every variable accel looks at, None when not set."""
    used: tuple[str, ...]
    """The variables that contributed, in the order they were applied."""
    configs: Mapping[str, AllocatorConfig]
    """One config per backend name."""
    warnings: tuple[str, ...]


def _snapshot(environ: Mapping[str, str]) -> dict[str, str | None]:
    return {name: environ.get(name) for name in _WATCHED}


def read_environment(environ: Mapping[str, str] | None = None) -> EnvironmentReport:
    """Resolve the configuration of every backend from ``environ`` (default ``os.environ``).

    Pure: nothing is stored and nothing is emitted, so it is what ``python -m
    accel config`` uses to explain the environment.

    >>> from accel.allocator import read_environment
    >>> read_environment({"ACCEL_ALLOC_CONF": "max_split_size_mb:64"}).configs["cpu"].max_split_size
    67108864
    """
    variables = _snapshot(os.environ if environ is None else environ)
    notes: list[str] = []
    accel_names = (ACCEL_VARIABLE, *ACCEL_BACKEND_VARIABLES.values())
    accel_set = [name for name in accel_names if variables[name] is not None]
    pytorch_set = [name for name in PYTORCH_VARIABLES if variables[name] is not None]
    layers: dict[str, list[str]] = {}
    if accel_set:
        for backend in BACKENDS:
            names = [ACCEL_VARIABLE, ACCEL_BACKEND_VARIABLES[backend]]
            layers[backend] = [name for name in names if variables[name] is not None]
        if pytorch_set:
            notes.append(
                f"{', '.join(pytorch_set)} ignored by accel because {', '.join(accel_set)} "
                f"{'is' if len(accel_set) == 1 else 'are'} set (ACCEL_ variables take precedence; "
                "PyTorch itself still reads its own variables)"
            )
    elif pytorch_set:
        winner = pytorch_set[0]
        layers = {backend: [winner] for backend in BACKENDS}
        losers = [name for name in pytorch_set[1:] if variables[name] != variables[winner]]
        if losers:
            empty = " although it is empty" if variables[winner] == "" else ""
            notes.append(
                f"{winner} is used{empty} and {', '.join(losers)} ignored: like PyTorch, accel uses "
                f"the first of {', '.join(PYTORCH_VARIABLES)} that is set; unset {winner} to use "
                f"{losers[0]}, or set ACCEL_ALLOC_CONF"
            )
    else:
        layers = {backend: [] for backend in BACKENDS}
    if variables[_PYTORCH_XPU_VARIABLE] is not None:
        notes.append(
            f"{_PYTORCH_XPU_VARIABLE} is read neither by PyTorch nor by accel; use "
            f"{ACCEL_BACKEND_VARIABLES['xpu']} (or ACCEL_ALLOC_CONF) instead"
        )
    parsed = {
        name: parse_settings(variables[name] or "", name)
        for names in layers.values()
        for name in names
    }
    configs = {}
    for backend, names in layers.items():
        config = AllocatorConfig()
        for index, name in enumerate(names):
            config = _apply(config, parsed[name], name, variables[name] or "", notes if index == 0 else ())
        if not names:
            config = dataclasses.replace(config, sources=config.sources, warnings=tuple(notes))
        configs[backend] = config
    used = tuple(name for name in _WATCHED if name in parsed)
    all_warnings = []
    for config in configs.values():
        all_warnings += [w for w in config.warnings if w not in all_warnings]
    return EnvironmentReport(
        MappingProxyType(variables), used, MappingProxyType(configs), tuple(all_warnings)
    )


# --------------------------------------------------------------------------- process state

ChangeListener = Callable[[str, AllocatorConfig, AllocatorConfig], None]


class _State:
    def __init__(self) -> None:
        # Readers take no lock once configs is set: it is replaced, never mutated.
        self.configs: Mapping[str, AllocatorConfig] | None = None
        self.snapshot: dict[str, str | None] = {}
        self.emitted: set[str] = set()
        self.listeners: list[ChangeListener] = []
        self.observers: list[ChangeListener] = []
        self.init_lock = threading.Lock()
        # Serialises changes. Listeners run under it; `notifying` catches a
        # listener that tries to change settings itself.
        self.update_lock = threading.RLock()
        self.notifying = False


_state = _State()


def _emit(configs: Iterable[AllocatorConfig]) -> None:
    for config in configs:
        for message in config.warnings:
            if message not in _state.emitted:
                _state.emitted.add(message)
                warn_at_caller(message, AllocatorConfigWarning)


def _configs() -> Mapping[str, AllocatorConfig]:
    configs = _state.configs
    if configs is not None:
        _check_environment_unchanged()
        return configs
    with _state.init_lock:
        configs = _state.configs
        if configs is None:
            # A failure leaves the state unset, so the next call reports it again.
            report = read_environment()
            configs = report.configs
            _state.snapshot = dict(report.variables)
            _state.configs = configs
            _emit(configs.values())
        return configs


def _check_environment_unchanged() -> None:
    for name, seen in _state.snapshot.items():
        now = os.environ.get(name)
        if now == seen:
            continue
        message = (
            f"{name} changed after accel read the allocator configuration "
            f"(it was {seen!r}, it is now {now!r}); the change is ignored. Set it before the "
            "process starts, or call accel.allocator.set_settings() or reload_from_environment()"
        )
        if message not in _state.emitted:
            _state.emitted.add(message)
            warn_at_caller(message, AllocatorConfigWarning)


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise AllocatorConfigError(
            f"no backend called {name!r}; allocator configurations exist for {', '.join(BACKENDS)}"
        )
    return name


def config_for_backend(name: str) -> AllocatorConfig:
    """The effective configuration of backend ``name`` ("cpu", "cuda" or "xpu").

    Reads the environment on first use; raises ConfigStringError naming the
    variable when it is invalid.

    >>> from accel.allocator import config_for_backend
    >>> config_for_backend("cpu").large_segment_size
    20971520
    """
    return _configs()[_check_backend(name)]


def _backend_of(device: object) -> str:
    if device is None or (isinstance(device, int) and not isinstance(device, bool)):
        from accel._runtime import current_backend_name

        return current_backend_name()
    kind = getattr(device, "type", device)
    if isinstance(kind, str):
        name = kind.partition(":")[0].strip().lower()
        if name in BACKENDS:
            return name
    raise DeviceError(
        f"get_config() cannot tell the backend of {device!r}; pass None, a device index, "
        f"a string such as 'cuda:0', or a device object of type {', '.join(BACKENDS)}"
    )


def get_config(device: object = None) -> AllocatorConfig:
    """The effective configuration for ``device`` (default: the active backend).

    Every device of a backend shares one configuration; ``device`` only selects
    the backend: None or an index means the active one, ``"cuda:1"`` or a
    device object with ``.type`` names one.

    >>> from accel.allocator import get_config
    >>> get_config("cpu").expandable_segments
    False
    """
    return config_for_backend(_backend_of(device))


def add_change_listener(listener: ChangeListener) -> None:
    """Call ``listener(backend, old, new)`` before any change is applied.

    The listener may raise AllocatorConfigError to refuse the change; then
    nothing changes, on any backend, and the error reaches the caller of
    :func:`set_settings`. Listeners run under the update lock and must not
    change settings themselves.
    """
    if not callable(listener):
        raise AllocatorConfigError(f"a change listener must be callable, got {listener!r}")
    with _state.update_lock:
        _state.listeners.append(listener)


def add_change_observer(observer: ChangeListener) -> None:
    """Call ``observer(backend, old, new)`` after a change is applied (it cannot
    refuse it); the live allocators follow settings changes this way."""
    with _state.update_lock:
        _state.observers.append(observer)


def remove_change_listener(listener: ChangeListener) -> None:
    """Stop calling ``listener``; raises AllocatorConfigError if it was not added."""
    with _state.update_lock:
        try:
            _state.listeners.remove(listener)
        except ValueError:
            raise AllocatorConfigError(f"{listener!r} is not a registered change listener") from None


def _commit(new: Mapping[str, AllocatorConfig], *, fresh_warnings: bool = False) -> None:
    """Ask the listeners, then publish ``new`` (called with the update lock held)."""
    if _state.notifying:
        raise AllocatorConfigError(
            "allocator settings cannot be changed from inside a change listener; "
            "a listener may only accept or refuse the change it is shown"
        )
    old = _configs()
    changed = [(backend, config) for backend, config in new.items() if config != old[backend]]
    _state.notifying = True
    try:
        for backend, config in changed:
            for listener in list(_state.listeners):
                listener(backend, old[backend], config)
        _state.configs = MappingProxyType({**old, **new})
        # Only a change every listener accepted reaches the observers.
        for backend, config in changed:
            for observer in list(_state.observers):
                observer(backend, old[backend], config)
    finally:
        _state.notifying = False
    if fresh_warnings:
        _state.emitted.clear()
    _emit(new.values())


def set_settings(text: str, *, backend: str | None = None) -> None:
    """Change, at runtime, only the keys ``text`` names, for ``backend`` (None: every backend).

    Unlike PyTorch, keys not named keep their values. The change is checked
    completely before anything is applied, and every change listener may
    refuse it (for instance switching expandable segments while segments are
    live); a refused or invalid change leaves every backend as it was.

    >>> from accel.allocator import config_for_backend, set_settings
    >>> set_settings("garbage_collection_threshold:0.7", backend="cpu")
    >>> config_for_backend("cpu").sources["garbage_collection_threshold"]
    'set_settings()'
    """
    targets = BACKENDS if backend is None else (_check_backend(backend),)
    settings = parse_settings(text, _SET_SETTINGS)
    _configs()
    with _state.update_lock:
        current = _configs()
        new = {name: _apply(current[name], settings, _SET_SETTINGS, text) for name in targets}
        _commit(new)


def reload_from_environment() -> None:
    """Read the environment again, dropping every set_settings() change.

    Goes through the change listeners like set_settings(); warnings are
    emitted again.
    """
    report = read_environment()
    with _state.update_lock:
        if _state.configs is None:
            _configs()
            return
        _commit(report.configs, fresh_warnings=True)
        _state.snapshot = dict(report.variables)


def _forget_for_tests() -> None:
    """Back to the state of a fresh process (the environment not yet read); keeps listeners."""
    with _state.update_lock, _state.init_lock:
        _state.configs = None
        _state.snapshot = {}
        _state.emitted.clear()
