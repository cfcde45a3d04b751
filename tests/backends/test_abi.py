"""accel's cffi declarations against the vendors' real headers (CUDA 12 and 13, Level Zero).

accel binds both drivers in cffi ABI mode, so nothing but these tests checks
that a declared prototype, struct layout or constant is NVIDIA's or Intel's:
a mistake copied into the bindings would pass every simulated test and fail on
a real GPU. :mod:`tests.fixtures.abi` describes each name from cffi and from
g++ compiling the real header, and lists the differences. The mutation tests
show that a single wrong declaration is caught.

The CUDA headers come from NVIDIA's wheels (``tests/fixtures/cuda_headers.py``),
Level Zero's from Debian's ``libze-dev``. Results are cached by hash of the
generated probe and the header in ``build/abi/``, so each pair compiles once.
"""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from accel.backends.base import CaptureMode, CaptureStatus
from accel.backends.cuda import _backend as cuda_backend
from accel.backends.cuda import _bindings as cuda_bindings
from accel.backends.xpu import _backend as xpu_backend
from accel.backends.xpu import _bindings as xpu_bindings
from accel.backends.xpu import _cdef as xpu_cdef
from accel.backends.xpu import _library as xpu_library
from tests.fixtures import abi, cuda_driver, cuda_headers

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ is not on PATH")

LEVEL_ZERO_INCLUDE = Path("/usr/include/level_zero")
LEVEL_ZERO_HEADERS = ("ze_api.h", "zes_api.h", "loader/ze_loader.h")

#: Declared by accel but newer than Debian's libze-dev 1.8 headers (APIs 1.6 and 1.15): probed
#: at run time, never assumed, and checked only where a header has them.
LEVEL_ZERO_NEWER_THAN_HEADERS = (
    "zeCommandListHostSynchronize", "zePhysicalMemGetProperties", "ze_physical_mem_properties_t",
)


#: accel's names for the CUdevice_attribute ids it reads (``_ATTRIBUTES``) -> the header's names.
CUDA_ATTRIBUTE_NAMES = {
    "max_threads_per_block": "MAX_THREADS_PER_BLOCK", "warp_size": "WARP_SIZE", "clock_rate_khz": "CLOCK_RATE",
    "multi_processor_count": "MULTIPROCESSOR_COUNT", "integrated": "INTEGRATED", "l2_cache_bytes": "L2_CACHE_SIZE",
    "max_threads_per_multiprocessor": "MAX_THREADS_PER_MULTIPROCESSOR", "async_engine_count": "ASYNC_ENGINE_COUNT",
    "unified_addressing": "UNIFIED_ADDRESSING", "compute_capability_major": "COMPUTE_CAPABILITY_MAJOR",
    "compute_capability_minor": "COMPUTE_CAPABILITY_MINOR",
    "virtual_memory_supported": "VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED",
    "posix_fd_handles_supported": "HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED",
    "memory_pools_supported": "MEMORY_POOLS_SUPPORTED",
}


def cuda_constants() -> dict[str, int]:
    """Every CUDA number accel passes to or compares with the driver, by its header name.

    The backend's ``CU_*``/``CUDA_*`` module constants, the attribute ids it
    reads, the capture modes and statuses it passes through as ints (accel's
    own enums), and the ends of its range of capture error codes.
    """
    constants = {name: value for module in (cuda_backend, cuda_bindings) for name, value in vars(module).items()
                 if re.fullmatch(r"CU(DA)?_[A-Z0-9_]+", name) and type(value) is int}
    constants |= {f"CU_DEVICE_ATTRIBUTE_{CUDA_ATTRIBUTE_NAMES[key]}": value
                  for key, value in cuda_backend._ATTRIBUTES.items()}
    constants |= {f"CU_STREAM_CAPTURE_MODE_{mode.name}": int(mode) for mode in CaptureMode}
    constants |= {f"CU_STREAM_CAPTURE_STATUS_{status.name}": int(status) for status in CaptureStatus}
    constants["CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"] = min(cuda_backend._CAPTURE_ERRORS)
    constants["CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD"] = max(cuda_backend._CAPTURE_ERRORS)
    return constants


def test_every_attribute_id_has_its_header_name() -> None:
    assert set(cuda_backend._ATTRIBUTES) == set(CUDA_ATTRIBUTE_NAMES)


#: Level Zero result codes the XPU backend writes as numbers -> their enumerators.
LEVEL_ZERO_NUMBERS = {
    "_backend._NOT_READY": (xpu_backend._NOT_READY, ("ZE_RESULT_NOT_READY",)),
    "_backend._UNSUPPORTED_FEATURE": (xpu_backend._UNSUPPORTED_FEATURE, ("ZE_RESULT_ERROR_UNSUPPORTED_FEATURE",)),
    "_backend._UNSUPPORTED_SIZE": (xpu_backend._UNSUPPORTED_SIZE, ("ZE_RESULT_ERROR_UNSUPPORTED_SIZE",)),
    "_backend._OOM_CODES": (tuple(sorted(xpu_backend._OOM_CODES)),
                            ("ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY", "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY")),
    "_bindings._OOM": (tuple(sorted(xpu_bindings._OOM)),
                       ("ZE_RESULT_ERROR_OUT_OF_HOST_MEMORY", "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY")),
    "_bindings._INVALID_HANDLE": (xpu_bindings._INVALID_HANDLE, ("ZE_RESULT_ERROR_INVALID_NULL_HANDLE",)),
    "_bindings._UNSUPPORTED": (xpu_bindings._UNSUPPORTED, ("ZE_RESULT_ERROR_UNSUPPORTED_FEATURE",)),
}


def test_level_zero_numbers_written_by_hand_are_the_enumerators() -> None:
    # The cdef's enumerators are checked against the header below, so equal to them is equal to Intel's.
    enumerators = abi.declarations(xpu_cdef.CDEF).constants
    for where, (value, names) in LEVEL_ZERO_NUMBERS.items():
        expected = tuple(enumerators[name] for name in names)
        assert (value if isinstance(value, tuple) else (value,)) == expected, where
    assert set(xpu_library.DESCRIPTIONS) <= set(enumerators)


def cuda_spec(major: int) -> abi.HeaderSpec:
    try:
        header = cuda_headers.cuda_header(major)
    except cuda_headers.HeaderUnavailable as exc:
        if cuda_headers.headers_required():
            raise
        pytest.skip(f"NVIDIA's cuda.h for CUDA {major} is unavailable: {exc}")
    # What NVIDIA's driver build defines: every exported symbol is declared under
    # its own name (cuMemAlloc_v2, cuEventElapsedTime and _v2), as accel binds them.
    return abi.HeaderSpec(f"CUDA {major} ({header.parent.name})", ("cuda.h",), (header,),
                          (str(header.parent),), "#define __CUDA_API_VERSION_INTERNAL 1\n")


def level_zero_spec() -> abi.HeaderSpec:
    files = tuple(LEVEL_ZERO_INCLUDE / name for name in LEVEL_ZERO_HEADERS)
    if not all(path.is_file() for path in files):
        pytest.skip("Level Zero headers not found: install Debian's libze-dev")
    return abi.HeaderSpec("Level Zero (libze-dev)", tuple(f"level_zero/{name}" for name in LEVEL_ZERO_HEADERS), files)


@pytest.mark.parametrize("major", sorted(cuda_headers.CUDA_HEADER_PACKAGES))
def test_cuda_declarations_match_nvidia_header(major: int) -> None:
    found = abi.declarations(cuda_bindings.CDEF, cuda_constants())
    assert len(found.functions) >= 50 and len(found.constants) >= 40  # the whole cdef was read
    assert abi.compare(found, cuda_spec(major)) == []


def test_level_zero_declarations_match_loader_headers() -> None:
    found = abi.declarations(xpu_cdef.CDEF)
    assert len(found.functions) >= 50 and len(found.constants) >= 200
    assert abi.compare(found, level_zero_spec(), absent_ok=LEVEL_ZERO_NEWER_THAN_HEADERS) == []


def _mutate(cdef: str, old: str, new: str) -> str:
    assert cdef.count(old) == 1, f"the mutation target {old!r} is not unique in the cdef"
    return cdef.replace(old, new)


CUDA_MUTATIONS = {
    "parameter size": (
        "CUresult cuMemAlloc_v2(CUdeviceptr *dptr, size_t bytesize);",
        "CUresult cuMemAlloc_v2(CUdeviceptr *dptr, unsigned int bytesize);",
        "cuMemAlloc_v2 parameter 2 is i8 in the header, accel declares i4"),
    "pointee size": (
        "CUresult cuDeviceTotalMem_v2(size_t *bytes, CUdevice dev);",
        "CUresult cuDeviceTotalMem_v2(unsigned int *bytes, CUdevice dev);",
        "cuDeviceTotalMem_v2 parameter 1 is p>i8 in the header, accel declares p>i4"),
    "parameter count": (
        "const CUgraphEdgeData **edgeData_out, size_t *numDependencies_out);",
        "size_t *numDependencies_out);",
        "cuStreamGetCaptureInfo_v3 takes 7 parameters, accel declares 6"),
    "struct field": (
        "unsigned short usage;",
        "unsigned char usage;",
        "CUmemAllocationProp.allocFlags.usage is at offset 26 as i2 in the header, accel has offset 26 as i1"),
    "symbol": (
        "CUresult cuMemFree_v2(CUdeviceptr dptr);",
        "CUresult cuMemFree_v3(CUdeviceptr dptr);",
        "function cuMemFree_v3 is not usable from the header"),
}


@pytest.mark.parametrize("mutation", sorted(CUDA_MUTATIONS))
def test_a_single_wrong_cuda_declaration_fails(mutation: str) -> None:
    old, new, expected = CUDA_MUTATIONS[mutation]
    found = abi.declarations(_mutate(cuda_bindings.CDEF, old, new), cuda_constants())
    problems = abi.compare(found, cuda_spec(12))
    assert any(expected in p for p in problems), problems
    # Nothing else is reported, except what the one change moves (later fields, the struct's size).
    assert all(expected in p or "CUmemAllocationProp.allocFlags" in p for p in problems), problems
    assert len(problems) == 1 or mutation == "struct field"


def test_a_single_wrong_cuda_constant_fails() -> None:
    constants = cuda_constants() | {"CU_EVENT_DISABLE_TIMING": 3}
    problems = abi.compare(abi.declarations(cuda_bindings.CDEF, constants), cuda_spec(12))
    assert len(problems) == 1 and "CU_EVENT_DISABLE_TIMING is 2 in the header, accel uses 3" in problems[0], problems


LEVEL_ZERO_MUTATIONS = {
    "enumerator": (" ZE_RESULT_NOT_READY = 1,", " ZE_RESULT_NOT_READY = 2,", "ZE_RESULT_NOT_READY is 1 in the header"),
    "struct field": (" int32_t busWidth;", " int64_t busWidth;", "zes_mem_properties_t.busWidth is at offset"),
}


@pytest.mark.parametrize("mutation", sorted(LEVEL_ZERO_MUTATIONS))
def test_a_single_wrong_level_zero_declaration_fails(mutation: str) -> None:
    old, new, expected = LEVEL_ZERO_MUTATIONS[mutation]
    found = abi.declarations(_mutate(xpu_cdef.CDEF, old, new))
    problems = abi.compare(found, level_zero_spec(), absent_ok=LEVEL_ZERO_NEWER_THAN_HEADERS)
    assert any(expected in p for p in problems), problems
    assert all(expected in p or "zes_mem_properties_t" in p or "p>s56" in p for p in problems), problems


# --- the simulated CUDA driver is NVIDIA's header's, not a copy of accel's ---

SIMCUDA_SOURCE = cuda_driver.SIMCUDA_SOURCE.read_text()


def test_simulator_declares_no_cuda_name_by_hand() -> None:
    code = re.sub(r"/\*.*?\*/|//[^\n]*|\"(?:\\.|[^\"\\])*\"", "", SIMCUDA_SOURCE, flags=re.S)
    assert "#include <cuda.h>" in SIMCUDA_SOURCE
    hand_made = re.findall(r"typedef[^;{]*\bcu[a-z0-9_]*;|typedef[^;]*\}\s*CU\w+;|\bCU\w+\s*=\s*\d"
                           r"|#define\s+CU\w+|\benum\s*\{[^}]*=\s*\d|typedef[^;]*\bCU[A-Za-z_]+\s*;", code, flags=re.I)
    assert hand_made == []
    # Numeric literals are never CUDA codes, attributes or flags: those are spelled by name.
    assert re.findall(r"case\s+\d+\s*:", code) == []


@pytest.mark.parametrize("major", sorted(cuda_headers.CUDA_HEADER_PACKAGES))
def test_simulator_builds_against_each_header_and_exports_what_accel_binds(major: int) -> None:
    cuda_spec(major)  # skips without the header
    library = ctypes.CDLL(str(cuda_driver.build_simulator(header_major=major)))
    tables = (cuda_bindings.REQUIRED_FUNCTIONS, cuda_bindings.VMM_FUNCTIONS, cuda_bindings.GRAPH_FUNCTIONS)
    missing = [symbol for table in tables for candidates in table.values() for symbol in candidates
               if not hasattr(library, symbol)]
    assert missing == []


def test_simulator_prototypes_are_checked_against_the_header(tmp_path: Path) -> None:
    # The simulator includes cuda.h in NVIDIA's internal mode, so a definition whose
    # prototype differs from NVIDIA's does not compile: show it with one wrong parameter.
    header = cuda_spec(12).files[0]
    source = tmp_path / "simcuda.c"
    wrong = "SIM_API CUresult cuMemFree_v2(CUdeviceptr dptr)"
    assert wrong in SIMCUDA_SOURCE
    source.write_text(SIMCUDA_SOURCE.replace(wrong, "SIM_API CUresult cuMemFree_v2(unsigned int dptr)"))
    result = subprocess.run(["gcc", "-std=c11", "-fsyntax-only", f"-I{header.parent}", str(source)],
                            capture_output=True, text=True, check=False)
    assert result.returncode != 0 and "conflicting types for ‘cuMemFree_v2’" in result.stderr.replace("'", "‘")
