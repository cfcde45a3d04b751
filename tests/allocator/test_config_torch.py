"""Differential tests against PyTorch's own allocator-config parser.

Strings go through ``torch._C._accelerator_setAllocatorSettings`` (it works on
a CPU build). PyTorch's Python API only returns the raw string back, so the
effective values are read from c10's own accessors
(``AcceleratorAllocatorConfig::max_split_size()`` and friends, inline in the
header torch ships) through a tiny C++ shim compiled against the installed
torch. Without a compiler the test still compares accept/reject decisions.

A CPU build of PyTorch only knows the common keys (it skips the CUDA keys), so
only those are compared here; the CUDA keys' rules are checked against the
installed ``CUDAAllocatorConfig.h`` key list and the unit tests.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from accel.allocator import ConfigStringError, keys, parse
from accel.allocator._config_keys import MAX_MIB

torch = pytest.importorskip("torch")

MIB = 1 << 20
SIZE_MAX = (1 << 64) - 1
UNLIMITED = MAX_MIB * MIB  # PyTorch clamps MiB counts here; anything above is "unlimited" too
set_torch: Callable[[str], None] = torch._C._accelerator_setAllocatorSettings
COMMON = [spec for spec in keys() if spec.pytorch_set == "common"]
# Keys PyTorch does not reset on each call: put them back to their defaults before a case.
RESET = "large_segment_size_mb:20,expandable_segments:False,pinned_use_background_threads:False"

SHIM = r"""
#include <c10/core/AllocatorConfig.h>
#include <cstring>
using C = c10::CachingAllocator::AcceleratorAllocatorConfig;
extern "C" {
size_t accel_large() { return C::large_segment_size(); }
size_t accel_max_split() { return C::max_split_size(); }
size_t accel_non_split() { return C::max_non_split_rounding_size(); }
double accel_gc() { return C::garbage_collection_threshold(); }
int accel_expandable() { return C::use_expandable_segments(); }
int accel_background() { return C::pinned_use_background_threads(); }
size_t accel_round_threshold() { return C::pinned_max_round_threshold(); }
size_t accel_cached_size() { return C::pinned_max_cached_size(); }
size_t accel_division(size_t slot) { return C::roundup_power2_divisions()[slot]; }
size_t accel_slots() { return C::roundup_power2_divisions().size(); }
size_t accel_keys(char* buffer, size_t size) {
  std::string joined;
  for (const auto& key : C::getKeys()) { joined += key; joined += ','; }
  std::strncpy(buffer, joined.c_str(), size);
  return joined.size();
}
}
"""


def _torch_dir() -> Path:
    return Path(torch.__file__).parent


@pytest.fixture(scope="module")
def shim(tmp_path_factory: pytest.TempPathFactory) -> ctypes.CDLL | None:
    """c10's accessors, or None when no C++ compiler or torch headers are available."""
    compiler = shutil.which("g++") or shutil.which("c++")
    include = _torch_dir() / "include"
    if not compiler or not (include / "c10/core/AllocatorConfig.h").exists():
        return None
    folder = tmp_path_factory.mktemp("c10shim")
    (folder / "shim.cpp").write_text(SHIM)
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    lib = _torch_dir() / "lib"
    subprocess.run(
        [compiler, "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
         f"-I{include}", str(folder / "shim.cpp"), f"-L{lib}", "-lc10", f"-Wl,-rpath,{lib}",
         "-o", str(folder / "shim.so")],
        check=True, capture_output=True, timeout=120,
    )
    library = ctypes.CDLL(str(folder / "shim.so"))
    for name in ("accel_large", "accel_max_split", "accel_non_split", "accel_round_threshold",
                 "accel_cached_size", "accel_slots"):
        getattr(library, name).restype = ctypes.c_size_t
    library.accel_gc.restype = ctypes.c_double
    library.accel_division.restype = ctypes.c_size_t
    library.accel_division.argtypes = [ctypes.c_size_t]
    library.accel_keys.restype = ctypes.c_size_t
    library.accel_keys.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    return library


def _torch_values(lib: ctypes.CDLL) -> dict[str, Any]:
    return {
        "large_segment_size": lib.accel_large(),
        "max_split_size": lib.accel_max_split(),
        "max_non_split_rounding": lib.accel_non_split(),
        "garbage_collection_threshold": lib.accel_gc(),
        "roundup_power2_divisions": tuple(lib.accel_division(i) for i in range(lib.accel_slots())),
        "expandable_segments": bool(lib.accel_expandable()),
        "pinned_use_background_threads": bool(lib.accel_background()),
        "pinned_max_round_threshold": lib.accel_round_threshold(),
        "pinned_max_cached_size": lib.accel_cached_size(),
    }


def _normalise(field: str, value: Any) -> Any:
    if field in ("max_split_size", "pinned_max_round_threshold", "pinned_max_cached_size"):
        return "unlimited" if value is None or value >= UNLIMITED else value
    return value


# --------------------------------------------------------------------------- strings in PyTorch's grammar

def _mib(low: int, high: int) -> st.SearchStrategy[str]:
    return st.integers(low, high).map(str)


def _roundup_list(draw: st.DrawFn) -> str:
    boundaries = sorted(draw(st.sets(st.sampled_from([1 << i for i in range(17)] + [3, 100, 96]), max_size=6)))
    divisions = st.sampled_from(["0", "1", "2", "4", "8", "16", "3", "6"])
    entries = [f"{b}:{draw(divisions)}" for b in boundaries]
    if draw(st.booleans()):
        entries.append(f">:{draw(divisions)}")
    return "[" + ",".join(entries) + "]"


VALUES: dict[str, Callable[[st.DrawFn], str]] = {
    "large_segment_size_mb": lambda d: d(_mib(0, 100)),
    "max_split_size_mb": lambda d: d(_mib(0, 200) | st.just("-1")),
    "max_non_split_rounding_mb": lambda d: d(_mib(0, 200)),
    "garbage_collection_threshold": lambda d: d(
        st.sampled_from(["0", "0.0", "1", "1.0", "1.5", "-0.1", "1e-3", "0.999", "5E-1"])
        | st.floats(0, 1.2, allow_nan=False).map(repr)
    ),
    "roundup_power2_divisions": lambda d: d(st.sampled_from(["1", "2", "4", "8", "0", "3", "12"]))
    if d(st.booleans()) else _roundup_list(d),
    "expandable_segments": lambda d: d(st.sampled_from(["True", "False"])),
    "pinned_use_background_threads": lambda d: d(st.sampled_from(["True", "False"])),
    "pinned_max_round_threshold_mb": lambda d: d(_mib(0, 2048)),
    "pinned_max_cached_size_mb": lambda d: d(_mib(0, 2048)),
}


@st.composite
def pytorch_strings(draw: st.DrawFn) -> str:
    chosen = draw(st.lists(st.sampled_from(sorted(VALUES)), min_size=0, max_size=5))
    space = st.sampled_from(["", "", " "])
    parts = [f"{name}{draw(space)}:{draw(space)}{VALUES[name](draw)}" for name in chosen]
    return ",".join(parts) + draw(st.sampled_from(["", ","]))


def _run_torch(text: str) -> BaseException | None:
    set_torch(RESET)
    try:
        set_torch(text)
    except (ValueError, IndexError, RuntimeError) as exc:
        return exc
    return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pytorch_strings())
def test_accel_agrees_with_pytorch(shim: ctypes.CDLL | None, text: str) -> None:
    torch_error = _run_torch(text)
    try:
        ours = parse(text)
    except ConfigStringError as exc:
        # Every string of this grammar that accel refuses, PyTorch refuses too.
        assert torch_error is not None, f"accel refused what PyTorch accepts: {text!r}: {exc}"
        return
    assert torch_error is None, f"PyTorch refused what accel accepts: {text!r}: {torch_error}"
    if shim is None:
        return
    theirs = _torch_values(shim)
    named = {spec.field for spec in COMMON if re.search(rf"\b{spec.key}\b", text)}
    for field, value in theirs.items():
        if field.startswith("pinned_max") and field not in named:
            continue  # sticky in PyTorch, and no string can put "unset" back
        assert _normalise(field, getattr(ours, field)) == _normalise(field, value), (field, text)


# Every place accel is deliberately stricter than PyTorch; docs/configuration.md lists the same.
STRICTER = [
    ("foo:1", "unknown key (a CPU build of PyTorch skips it)"),
    (",max_split_size_mb:30", "leading comma (PyTorch then silently skips the key)"),
    ("max_split_size_mb,30", "missing ':'"),
    ("max_split_size_mb:30:expandable_segments:True", "':' where ',' belongs"),
    ("max_split_size_mb:30abc", "trailing characters after a number"),
    ("max_split_size_mb:+30", "a sign on an integer"),
    ("garbage_collection_threshold:0x1p-1", "hexadecimal float"),
    ("garbage_collection_threshold:.5x", "trailing characters after a number"),
    ("max_split_size_mb:-5", "negative integer other than max_split_size_mb:-1"),
    ("pinned_max_cached_size_mb:-1", "negative integer"),
    ("large_segment_size_mb:-1", "negative integer"),
    ("pinned_max_cached_size_mb:17592186044416", "more MiB than 64 bits of bytes hold"),
    ("roundup_power2_divisions:[128:8,64:4]", "roundup boundaries not increasing"),
    ("roundup_power2_divisions:[64:8,>:2,1024:1]", "'>' not last in the list"),
]


@pytest.mark.parametrize(("text", "why"), STRICTER)
def test_deliberately_stricter_than_pytorch(text: str, why: str) -> None:
    assert _run_torch(text) is None, f"PyTorch now rejects {text!r}: drop it from the list and the docs"
    with pytest.raises(ConfigStringError):
        parse(text)


def test_stricter_cases_are_documented() -> None:
    docs = (Path(__file__).parents[2] / "docs" / "configuration.md").read_text()
    for text, _ in STRICTER:
        assert f"`{text}`" in docs, text


def test_booleans_are_more_lenient_than_pytorch() -> None:
    assert isinstance(_run_torch("expandable_segments:true"), ValueError)
    assert parse("expandable_segments:true").expandable_segments is True


def test_common_key_set_matches_pytorch(shim: ctypes.CDLL | None) -> None:
    if shim is None:
        pytest.skip("no C++ compiler or torch headers to read c10's key set")
    buffer = ctypes.create_string_buffer(4096)
    shim.accel_keys(buffer, len(buffer))
    theirs = {key for key in buffer.value.decode().split(",") if key}
    assert theirs == {spec.key for spec in COMMON}


def test_cuda_key_set_matches_the_installed_header() -> None:
    header = _torch_dir() / "include/c10/cuda/CUDAAllocatorConfig.h"
    if not header.exists():
        pytest.skip("this torch ships no CUDAAllocatorConfig.h")
    source = re.sub(r"//[^\n]*", "", header.read_text())
    block = re.search(r"getKeys\(\)\s*\{\s*static std::unordered_set<std::string> keys\{(.*?)\};", source, re.S)
    assert block, "CUDAAllocatorConfig.h changed shape: update this test"
    # Adjacent literals ("release_lock_on_cud" "amalloc") are one string in C++.
    theirs = {"".join(re.findall(r'"([^"]*)"', item)) for item in block.group(1).split(",")}
    theirs.discard("")
    ours = {name for spec in keys() if spec.pytorch_set == "cuda" for name in (spec.key, *spec.aliases)}
    assert theirs == ours

