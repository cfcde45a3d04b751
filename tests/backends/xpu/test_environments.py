"""The XPU backend under other environments, one fresh process each.

The Level Zero loader reads its environment once per process and cannot
retry a failed ``zeInit``, so every configuration (no driver, no device,
unsupported features, Sysman, the validation layer) runs in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.backends.xpu.conftest import REPO, require_simulator, run_json, run_python
from tests.fixtures import xpu_driver

PROBE = """
import json
from accel.backends import probe_backend
info = probe_backend("xpu")
print(json.dumps({"available": info.available, "reason": info.reason, "devices": info.device_count}))
"""


def test_no_driver_gives_one_line_with_the_ze_result_name() -> None:
    info = run_json(PROBE, ZE_ENABLE_ALT_DRIVERS="/nonexistent/libze_no_such_driver.so")
    assert not info["available"]
    assert info["reason"].startswith("zeInit failed: ZE_RESULT_ERROR_UNINITIALIZED (0x78000001): ")
    assert "\n" not in info["reason"]


def test_cli_says_why_in_one_line_when_there_is_no_driver() -> None:
    require_simulator()  # the real loader, pointed at a driver that does not exist
    env = {**os.environ, "ACCEL_BACKEND": "xpu", "ZE_ENABLE_ALT_DRIVERS": "/nonexistent/libze_no_such_driver.so"}
    result = subprocess.run(
        [sys.executable, "-m", "accel"], capture_output=True, text=True, env=env, cwd=REPO, timeout=120
    )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "'xpu' is unavailable: zeInit failed: ZE_RESULT_ERROR_UNINITIALIZED" in lines[0]


def test_missing_loader_is_named() -> None:
    info = run_json(PROBE, ACCEL_ZE_LOADER="/nonexistent/libze_loader.so.1")
    assert info["reason"] == (
        "ACCEL_ZE_LOADER=/nonexistent/libze_loader.so.1 not found: point it at libze_loader.so.1, or unset it"
    )


def test_a_library_that_is_not_a_loader_is_unavailable_not_a_crash() -> None:
    info = run_json(PROBE, ACCEL_ZE_LOADER="libc.so.6")
    assert not info["available"]
    assert info["reason"] == "libc.so.6 does not export zeInit: it is not a Level Zero loader (libze_loader.so.1)"


def test_a_driver_without_gpus_is_no_gpu_device() -> None:
    info = run_json(PROBE, ACCEL_SIMZE_DEVICE_COUNT="0")
    assert info["reason"].startswith("no GPU device: 1 Level Zero driver(s) loaded")


def test_a_driver_that_fails_to_initialize_reports_its_code() -> None:
    result = run_python(PROBE, ACCEL_SIMZE_MEMORY="lots")
    assert "invalid ACCEL_SIMZE_MEMORY=lots" in result.stderr  # the simulator's own complaint
    info = __import__("json").loads(result.stdout.strip().splitlines()[-1])
    assert info["reason"] == "zeInit failed: ZE_RESULT_ERROR_INVALID_ARGUMENT (0x78000004): an argument is invalid"


def test_importing_the_backend_loads_no_library() -> None:
    info = run_json(
        "import json, accel.backends.xpu, accel.backends.xpu._backend\n"
        "maps = open('/proc/self/maps').read()\n"
        "print(json.dumps({'loaded': 'libze' in maps}))"
    )
    assert info == {"loaded": False}


UNSUPPORTED = """
import json
import accel
from accel.backends import load_backend
xpu = load_backend("xpu")
out = {"vm": xpu.supports_virtual_memory(0)}
for name, call in [
    ("granularity", lambda: xpu.vm_granularity(0)),
    ("create", lambda: xpu.vm_create(0, 2 << 20)),
]:
    try:
        call()
        out[name] = "ok"
    except accel.NotSupportedError as exc:
        out[name] = str(exc)
s = xpu.default_stream(0)
a, b = (xpu.event_create(0, timing=True, blocking=False, interprocess=False) for _ in range(2))
xpu.event_record(0, a, s)
xpu.event_record(0, b, s)
xpu.stream_synchronize(0, s)
try:
    out["elapsed"] = xpu.event_elapsed_ms(0, a, b)
except accel.NotSupportedError as exc:
    out["elapsed"] = str(exc)
print(json.dumps(out))
"""


def test_features_the_driver_lacks_are_not_supported() -> None:
    out = run_json(UNSUPPORTED, ACCEL_SIMZE_UNSUPPORTED="zeVirtualMemQueryPageSize,zeEventQueryKernelTimestamp")
    assert out["vm"] is False
    assert out["granularity"] == "the xpu backend does not support virtual memory"
    assert out["elapsed"].startswith("zeEventQueryKernelTimestamp is not supported by the Level Zero driver on xpu:0")
    assert "ZE_RESULT_ERROR_UNSUPPORTED_FEATURE" in out["elapsed"]


def test_a_missing_physical_memory_call_is_not_supported() -> None:
    out = run_json(UNSUPPORTED, ACCEL_SIMZE_UNSUPPORTED="zePhysicalMemCreate")
    assert out["vm"] is True and out["granularity"] == "ok"
    assert out["create"].startswith("zePhysicalMemCreate is not supported by the Level Zero driver on xpu:0")


SMALL = """
import json
import accel
from accel.backends import load_backend
xpu = load_backend("xpu")
out = {"info": xpu.memory_info(0), "source": xpu.device_properties(0).extra["memory_info_source"]}
keep = xpu.malloc(0, 5 << 20)
out["after_malloc"] = xpu.memory_info(0)
for name, call in [("malloc", lambda: xpu.malloc(0, 4 << 20)), ("vm_create", lambda: xpu.vm_create(0, 4 << 20))]:
    try:
        call()
        out[name] = "ok"
    except accel.OutOfMemoryError as exc:
        out[name] = [str(exc), exc.requested, exc.device]
xpu.free(0, keep)
out["after_free"] = xpu.memory_info(0)
print(json.dumps(out))
"""


def test_a_small_budget_runs_out_of_memory_for_malloc_and_physical_chunks() -> None:
    out = run_json(SMALL, ACCEL_SIMZE_MEMORY="8MiB")
    mib = 1 << 20
    assert out["info"] == [8 * mib, 8 * mib] and out["after_malloc"] == [3 * mib, 8 * mib]
    assert "ZE_RESULT_ERROR_OUT_OF_DEVICE_MEMORY" in out["malloc"][0] and out["malloc"][1:] == [4 * mib, 0]
    assert "zePhysicalMemCreate" in out["vm_create"][0] and out["vm_create"][1:] == [4 * mib, 0]
    assert out["after_free"] == [8 * mib, 8 * mib]


def test_sysman_is_the_memory_source_when_the_driver_enables_it() -> None:
    out = run_json(SMALL, ACCEL_SIMZE_MEMORY="8MiB", ZES_ENABLE_SYSMAN="1")
    assert out["source"] == "sysman"
    assert out["after_malloc"] == [3 << 20, 8 << 20]  # the driver's count, not accel's


def test_conformance_passes_under_the_validation_layer() -> None:
    """The loader's validation layer checks every call's parameters and handles."""
    require_simulator()
    env = {
        **os.environ,
        "ZE_ENABLE_VALIDATION_LAYER": "1",
        "ZE_ENABLE_PARAMETER_VALIDATION": "1",
        "ZE_ENABLE_HANDLE_LIFETIME": "1",
        "ZE_ENABLE_THREADING_VALIDATION": "1",
    }
    layer = run_json(
        "import json\nfrom accel.backends import load_backend\nload_backend('xpu')\n"
        "print(json.dumps({'layer': 'libze_validation_layer' in open('/proc/self/maps').read()}))",
        ZE_ENABLE_VALIDATION_LAYER="1",
        ZE_ENABLE_PARAMETER_VALIDATION="1",
    )
    assert layer == {"layer": True}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/conformance", str(REPO / "tests/backends/xpu/test_backend.py")],
        capture_output=True, text=True, env={**env, "ACCEL_TEST_BACKENDS": "xpu"}, cwd=REPO, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert " passed" in result.stdout and "failed" not in result.stdout


def test_protocol_conformance_passes_through_the_loader_intercept_path() -> None:
    """With ZE_ENABLE_LOADER_INTERCEPT=1 the loader wraps every handle (as with several drivers)."""
    require_simulator()
    env = {**os.environ, "ZE_ENABLE_LOADER_INTERCEPT": "1", "ACCEL_TEST_BACKENDS": "xpu"}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/conformance/test_protocol.py"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


SHARE_EXPANDABLE = """
import json, pickle
import accel
buf = accel.memory.allocate(1 << 20)
try:
    pickle.dumps(buf)
    out = {"shared": "ok"}
except accel.NotSupportedError as exc:
    out = {"shared": str(exc)}
accel.current_stream().fill(buf, 1, 1 << 20)
accel.current_stream().synchronize()
print(json.dumps(out))
"""


def physical_export_loader() -> str:
    """The simulator built as a Level Zero 1.15 loader (see tests/fixtures/xpu_driver.py)."""
    require_simulator()
    environment = xpu_driver.physical_export_environment()
    if isinstance(environment, str):
        pytest.skip(environment)
    if "ACCEL_ZE_LOADER" not in environment:
        pytest.skip("ACCEL_SIMZE_UNSUPPORTED needs the simulator")
    return environment["ACCEL_ZE_LOADER"]


def test_a_driver_refusing_exportable_chunks_keeps_expandable_segments_working_unshared() -> None:
    # A loader with zePhysicalMemGetProperties over a driver that cannot export physical
    # memory: chunks are made plain (so expandable allocations still work) and sharing one
    # says why it cannot.
    out = run_json(SHARE_EXPANDABLE, ACCEL_ZE_LOADER=physical_export_loader(), ACCEL_BACKEND="xpu",
                   ACCEL_ALLOC_CONF="expandable_segments:True", ACCEL_SIMZE_UNSUPPORTED="ze_external_memory_export_desc_t")
    assert "the driver refused to create exportable physical memory" in out["shared"], out
    assert "ZE_RESULT_ERROR_UNSUPPORTED_ENUMERATION" in out["shared"] and "without expandable_segments" in out["shared"]


def test_a_driver_without_the_physical_memory_export_is_not_supported() -> None:
    out = run_json(SHARE_EXPANDABLE, ACCEL_ZE_LOADER=physical_export_loader(), ACCEL_BACKEND="xpu",
                   ACCEL_ALLOC_CONF="expandable_segments:True", ACCEL_SIMZE_UNSUPPORTED="zePhysicalMemGetProperties")
    assert out["shared"].startswith("zePhysicalMemGetProperties is not supported by the Level Zero driver on xpu:0"), out



CHUNKS_EXPORTER = """
import ctypes, json, subprocess, sys
import accel
from accel.backends import load_backend
xpu = load_backend("xpu")
s = xpu.default_stream(0)
host = xpu.host_malloc(1)

def read(at):
    xpu.memcpy_async(0, host, at, 1, s)
    xpu.stream_synchronize(0, s)
    return ctypes.string_at(host, 1).decode()

g = xpu.vm_granularity(0)
base = xpu.vm_reserve(0, 3 * g)
chunks = [xpu.vm_create(0, g) for _ in range(3)]
for i in (0, 2) if sys.argv[1] == "hole" else range(3):
    xpu.vm_map(0, base + i * g, g, chunks[i])
if sys.argv[1] == "hole":
    try:
        xpu.ipc_memory_export(0, base, 3 * g)
    except accel.InvalidValueError as exc:
        print(json.dumps({"error": str(exc)}))
    raise SystemExit
for i in range(3):
    xpu.memset_async(0, base + i * g, ord("A") + i, g, s)
xpu.stream_synchronize(0, s)
# From the middle of chunk 0 to the middle of chunk 2: three chunks, half a chunk before the buffer.
payload, fds = xpu.ipc_memory_export(0, base + g // 2, 2 * g)
child = subprocess.run([sys.executable, "-c", IMPORTER, payload.decode(), json.dumps(fds)], pass_fds=fds,
                       capture_output=True, text=True, timeout=60)
assert child.returncode == 0, child.stderr
print(json.dumps({"payload": json.loads(payload), "g": g, "imported": json.loads(child.stdout),
                  "written_there": read(base + 3 * g // 2)}))
"""

CHUNKS_IMPORTER = """
import ctypes, json, os, sys
from accel.backends import load_backend
xpu = load_backend("xpu")
s = xpu.default_stream(0)
host = xpu.host_malloc(1)

def read(at):
    xpu.memcpy_async(0, host, at, 1, s)
    xpu.stream_synchronize(0, s)
    return ctypes.string_at(host, 1).decode()

g = xpu.vm_granularity(0)
read(xpu.malloc(0, 512))  # the first copy's own descriptors (event pools), not the import's
fds = json.loads(sys.argv[2])
before = len(os.listdir("/proc/self/fd"))
ptr = xpu.ipc_memory_import(0, sys.argv[1].encode(), fds, 2 * g)
seen = [read(ptr + at) for at in (0, g // 2 - 1, g // 2, 3 * g // 2 - 1, 3 * g // 2, 2 * g - 1)]
xpu.memset_async(0, ptr + g, ord("Z"), 1, s)
xpu.stream_synchronize(0, s)
xpu.ipc_memory_close(0, ptr)
print(json.dumps({"seen": seen, "fds_left": len(os.listdir("/proc/self/fd")) - (before - len(fds))}))
"""


def test_a_range_over_three_physical_chunks_is_the_same_memory_in_another_process() -> None:
    code = CHUNKS_EXPORTER.replace("IMPORTER", repr(CHUNKS_IMPORTER))
    loader = physical_export_loader()
    result = run_python(f"import sys; sys.argv[1:] = ['range']\n{code}", ACCEL_ZE_LOADER=loader)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    g = out["g"]
    assert out["payload"] == {"kind": "physical", "lead": g // 2, "sizes": [g, g, g]}
    # Each side of each boundary between the chunks, and both ends of the range.
    assert out["imported"]["seen"] == ["A", "A", "B", "B", "C", "C"]
    # The received descriptors were closed on import, the driver's own copies on close.
    assert out["imported"]["fds_left"] == 0
    assert out["written_there"] == "Z"


def test_a_range_with_an_unmapped_hole_is_refused_on_export() -> None:
    result = run_python(f"import sys; sys.argv[1:] = ['hole']\n{CHUNKS_EXPORTER}", ACCEL_ZE_LOADER=physical_export_loader())
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert "is not mapped" in out["error"], out
