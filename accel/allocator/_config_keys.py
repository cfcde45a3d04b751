"""The table of allocator configuration keys: one :class:`KeySpec` per key.

Everything the parser, the renderer, the CLI and the documentation say about
a key comes from this table, so they cannot drift apart. The key set, the
defaults and the ranges are PyTorch 2.13's (``c10/core/AllocatorConfig.h``
for the common keys, ``c10/cuda/CUDAAllocatorConfig.h`` for the CUDA ones),
checked against the installed build by ``tests/allocator/test_config_torch.py``.
"""

from __future__ import annotations

import difflib
import re
import sys
from dataclasses import dataclass
from typing import Literal

from accel.backends import BACKEND_NAMES

__all__ = [
    "BACKENDS",
    "KEYS",
    "KEYS_BY_FIELD",
    "KEYS_BY_NAME",
    "MAX_MIB",
    "MAX_U64",
    "MIB",
    "ROUNDUP_SLOTS",
    "KeySpec",
    "ValueProblem",
    "nearest_key",
    "parse_bool",
    "parse_float",
    "parse_uint",
]

MIB = 1 << 20
#: PyTorch keeps sizes in a 64-bit size_t of bytes; larger MiB counts cannot be stored.
MAX_MIB = ((1 << 64) - 1) // MIB
#: Integers PyTorch reads with ``std::stoull`` (the widest value it can hold).
MAX_U64 = (1 << 64) - 1
#: Number of slots of the roundup table (1 MiB .. 64 GiB, one per power of two).
ROUNDUP_SLOTS = 16
#: accel's backends, in the order the CLI lists them.
#: The backends that have a configuration, in alphabetical order (the order messages list them in).
BACKENDS: tuple[str, ...] = tuple(sorted(BACKEND_NAMES))

Kind = Literal["mib", "uint", "float", "bool", "choice", "roundup"]


class ValueProblem(Exception):
    """A value is wrong; the parser turns it into a positioned AllocatorConfigError."""


@dataclass(frozen=True)
class KeySpec:
    """What one configuration key means and accepts."""

    key: str
    """The name written in a configuration string."""
    field: str
    """The :class:`AllocatorConfig` attribute holding its effective value."""
    kind: Kind
    unit: str
    default_text: str
    """The default as a person would write it (sizes in MiB)."""
    range_text: str
    summary: str
    pytorch_set: Literal["common", "cuda", "none"]
    """Which PyTorch parser owns the key (a CPU build of PyTorch only knows "common");
    "none": an accel setting PyTorch does not have (keep it out of ``PYTORCH_ALLOC_CONF``)."""
    used_by_accel: bool
    backends: tuple[str, ...] = BACKENDS
    aliases: tuple[str, ...] = ()
    choices: tuple[str, ...] = ()
    optional: bool = False
    """The value may be unset (None): max_split_size and the pinned limits."""


KEYS: tuple[KeySpec, ...] = (
    KeySpec(
        "large_segment_size_mb", "large_segment_size", "mib", "MiB", "20", "> 10",
        "Segment size cached for requests between 1 and 10 MiB (expandable segments map "
        "2 MiB pages in both pools). Read before every other key of the same string.",
        "common", True,
    ),
    KeySpec(
        "max_split_size_mb", "max_split_size", "mib", "MiB", "unlimited",
        ">= large_segment_size_mb, or -1 for unlimited",
        "Cached blocks larger than this are never split, which limits fragmentation "
        "from large blocks.",
        "common", True, optional=True,
    ),
    KeySpec(
        "max_non_split_rounding_mb", "max_non_split_rounding", "mib", "MiB",
        "= large_segment_size_mb", ">= large_segment_size_mb",
        "A request may take a cached block that is up to this much larger without "
        "splitting it.",
        "common", True,
    ),
    KeySpec(
        "garbage_collection_threshold", "garbage_collection_threshold", "float",
        "fraction", "0.0 (off)", "0.0 < x < 1.0",
        "When a memory limit is set (per_process_memory_fraction) and usage exceeds this "
        "fraction of it, least recently used cached blocks are freed before asking "
        "the driver.",
        "common", True,
    ),
    KeySpec(
        "roundup_power2_divisions", "roundup_power2_divisions", "roundup", "divisions",
        "0 (no rounding)",
        "N (a power of two) or [B:D,...,>:D] with B a power of two in MiB and D 0 or a "
        "power of two",
        "Rounds request sizes up to one of D equal steps between two powers of two; "
        "the list form sets D per size range.",
        "common", True,
    ),
    KeySpec(
        "expandable_segments", "expandable_segments", "bool", "", "False", "True or False",
        "Grow one virtual segment per stream by mapping pages instead of allocating "
        "many fixed segments; needs virtual memory support from the backend.",
        "common", True,
    ),
    KeySpec(
        "expandable_keep_free_mb", "expandable_keep_free", "mib", "MiB", "0", ">= 0",
        "accel only. When an expandable segment must grow, the whole free pages inside the "
        "holes of the allocator's expandable segments are unmapped first (at most as many as "
        "it grows by, so a steady state maps and unmaps nothing) and their physical pages "
        "mapped again where needed; new pages are made only for the rest. This much of the "
        "free pages stays mapped besides. A large value keeps every hole mapped, as PyTorch does.",
        "none", True,
    ),
    KeySpec(
        "pinned_use_background_threads", "pinned_use_background_threads", "bool", "",
        "False", "True or False",
        "The pinned host allocator processes its events on a background thread.",
        "common", False, backends=("cuda", "xpu"),
    ),
    KeySpec(
        "pinned_max_round_threshold_mb", "pinned_max_round_threshold", "mib", "MiB",
        "unset", ">= 0",
        "Pinned host allocations above this size are not rounded up to a power of two.",
        "common", True, backends=("cuda", "xpu"), optional=True,
    ),
    KeySpec(
        "pinned_max_cached_size_mb", "pinned_max_cached_size", "mib", "MiB", "unset",
        ">= 0",
        "Freed pinned host blocks above this size are released instead of cached.",
        "common", True, backends=("cuda", "xpu"), optional=True,
    ),
    KeySpec(
        "per_process_memory_fraction", "per_process_memory_fraction", "float",
        "fraction", "1.0", "0.0 <= x <= 1.0",
        "Cap on the memory this process may reserve, as a fraction of device capacity.",
        "cuda", True,
    ),
    KeySpec(
        "backend", "allocator_backend", "choice", "", "native",
        "native or cudaMallocAsync",
        "PyTorch's choice between its caching allocator and cudaMallocAsync; accel always "
        "uses its own caching allocator.",
        "cuda", False, backends=("cuda",), choices=("native", "cudaMallocAsync"),
    ),
    KeySpec(
        "release_lock_on_cudamalloc", "release_lock_on_cudamalloc", "bool", "", "False",
        "True or False",
        "PyTorch releases its allocator lock around cudaMalloc.",
        "cuda", False, backends=("cuda",), aliases=("release_lock_on_hipmalloc",),
    ),
    KeySpec(
        "pinned_use_cuda_host_register", "pinned_use_cuda_host_register", "bool", "",
        "False", "True or False",
        "PyTorch pins host memory with malloc + cudaHostRegister.",
        "cuda", False, backends=("cuda",), aliases=("pinned_use_hip_host_register",),
    ),
    KeySpec(
        "pinned_num_register_threads", "pinned_num_register_threads", "uint", "threads",
        "1", "a power of two <= 128",
        "Threads PyTorch uses for cudaHostRegister.",
        "cuda", False, backends=("cuda",),
    ),
    KeySpec(
        "pinned_reserve_segment_size_mb", "pinned_reserve_segment_size", "mib", "MiB",
        "0 (none)", "> 0",
        "Pinned memory PyTorch reserves up front for small pinned allocations.",
        "cuda", False, backends=("cuda",),
    ),
    KeySpec(
        "graph_capture_record_stream_reuse", "graph_capture_record_stream_reuse", "bool",
        "", "False", "True or False",
        "PyTorch reuses, during graph capture, freed blocks that were used on several "
        "streams.",
        "cuda", False, backends=("cuda",),
    ),
    KeySpec(
        "pinned_free_catch_all", "pinned_free_catch_all", "bool", "", "False",
        "True or False",
        "PyTorch's pinned host allocator accepts frees of pointers it did not allocate.",
        "cuda", False, backends=("cuda",),
    ),
    KeySpec(
        "throw_on_cudamalloc_oom", "throw_on_cudamalloc_oom", "bool", "", "False",
        "True or False",
        "PyTorch fails early, without calling cudaMalloc, when a request would exceed "
        "the memory fraction.",
        "cuda", False, backends=("cuda",),
    ),
)

KEYS_BY_NAME: dict[str, KeySpec] = {}
for _spec in KEYS:
    for _name in (_spec.key, *_spec.aliases):
        KEYS_BY_NAME[_name] = _spec
KEYS_BY_FIELD: dict[str, KeySpec] = {spec.field: spec for spec in KEYS}

_UINT = re.compile(r"[0-9]+")
# Plain decimal numbers only: std::stod would also take "inf", "nan", hex floats
# and trailing garbage, none of which is a sensible setting.
_FLOAT = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")
_TRUE = ("True", "true", "1")
_FALSE = ("False", "false", "0")


def parse_uint(text: str, *, maximum: int = MAX_U64) -> int:
    """A plain decimal integer in 0..maximum."""
    if not _UINT.fullmatch(text):
        hint = ""
        if text.startswith("-"):
            hint = " (negative numbers are not allowed)"
        raise ValueProblem(f"expected a non-negative integer, got '{text}'{hint}")
    digits = text.lstrip("0") or "0"  # leading zeros are fine, as in PyTorch (std::stoull)
    # Compared by length first: int() of thousands of digits is refused by
    # Python's int_max_str_digits limit, and no such number is in range anyway.
    if len(digits) > len(str(maximum)) or int(digits) > maximum:
        shown = digits if len(digits) <= 40 else f"a {len(digits)}-digit number"
        raise ValueProblem(f"{shown} is out of range (the largest allowed is {maximum})")
    return int(digits)


def parse_float(text: str) -> float:
    """A plain decimal number such as 0.8 or 5e-1."""
    if not _FLOAT.fullmatch(text):
        raise ValueProblem(f"expected a decimal number such as 0.8, got '{text}'")
    value = float(text)
    mantissa = re.split("[eE]", text)[0]
    # std::stod (PyTorch) refuses results below the smallest normal double.
    if abs(value) < sys.float_info.min and any(ch in "123456789" for ch in mantissa):
        raise ValueProblem(f"{text} is out of range: too small to represent as a normal double")
    return value


def parse_bool(text: str) -> bool:
    """True/False/true/false/1/0."""
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ValueProblem(f"expected True or False (or true/false/1/0), got '{text}'")


def nearest_key(word: str) -> str | None:
    """The known key closest to ``word``, if one is close enough to suggest."""
    lowered = word.lower()
    if lowered in KEYS_BY_NAME:
        return KEYS_BY_NAME[lowered].key
    names = list(KEYS_BY_NAME)
    # A prefix is the usual slip (max_split_size for max_split_size_mb).
    prefixed = [name for name in names if name.startswith(lowered) and len(lowered) >= 6]
    if len(prefixed) == 1:
        return KEYS_BY_NAME[prefixed[0]].key
    match = difflib.get_close_matches(lowered, names, n=1, cutoff=0.75)
    return KEYS_BY_NAME[match[0]].key if match else None
