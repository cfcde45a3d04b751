"""Loading the CUDA backend: no driver, no device, failing cuInit, missing and versioned symbols.

A driver is loaded once per process, so each case runs in a fresh interpreter
against a simulated driver built for it (some with entry points removed).
"""

from __future__ import annotations

import ctypes.util

import pytest

from tests.backends.cuda.conftest import run_json, run_python
from tests.fixtures.cuda_driver import build_simulator

PROBE = """
import json
from accel.backends import probe_backend
info = probe_backend("cuda")
print(json.dumps({"available": info.available, "reason": info.reason, "devices": info.device_count,
                  "driver": info.driver_version}))
"""


def probe(**env: str) -> dict:
    return run_json(PROBE, env)


def sim_env(hide: tuple[str, ...] = (), **extra: str) -> dict[str, str]:
    return {"ACCEL_CUDA_DRIVER": str(build_simulator(hide)), **extra}


def test_import_loads_no_library() -> None:
    result = run_json(
        """
        import json, accel.backends.cuda, sys
        maps = open("/proc/self/maps").read()
        print(json.dumps({"libcuda": "libcuda" in maps, "bindings": "accel.backends.cuda._bindings" in sys.modules}))
        """,
        sim_env(),
    )
    assert result == {"libcuda": False, "bindings": False}


def test_explicit_driver_path_missing() -> None:
    info = probe(ACCEL_CUDA_DRIVER="/nonexistent/libcuda.so.1")
    assert not info["available"]
    assert info["reason"].startswith("cannot load the CUDA driver library ACCEL_CUDA_DRIVER=/nonexistent/libcuda.so.1")
    assert "\n" not in info["reason"]


@pytest.mark.skipif(ctypes.util.find_library("cuda") is not None, reason="this machine has a libcuda")
def test_no_system_driver_says_where_it_looked() -> None:
    info = probe()
    assert not info["available"]
    assert "libcuda.so.1" in info["reason"] and "LD_LIBRARY_PATH" in info["reason"]
    assert "\n" not in info["reason"]


def test_no_device_is_cuinit_no_device() -> None:
    info = probe(**sim_env(ACCEL_SIMCUDA_DEVICE_COUNT="0"))
    assert info == {
        "available": False,
        "reason": "cuInit failed: CUDA_ERROR_NO_DEVICE (100): no CUDA-capable device is detected",
        "devices": 0,
        "driver": "",
    }


def test_cuinit_failure_names_code_and_string() -> None:
    info = probe(**sim_env(ACCEL_SIMCUDA_FAIL="cuInit=999"))
    assert info["reason"] == "cuInit failed: CUDA_ERROR_UNKNOWN (999): unknown error"


def test_error_code_the_driver_cannot_name() -> None:
    info = probe(**sim_env(ACCEL_SIMCUDA_FAIL="cuInit=12345"))
    assert info["reason"] == "cuInit failed: CUDA_ERROR_UNRECOGNIZED_12345 (12345)"


def test_bad_simulator_configuration_is_refused_by_cuinit() -> None:
    result = run_python(PROBE, sim_env(ACCEL_SIMCUDA_TOTAL_MEM="lots"))
    assert '"available": false' in result.stdout
    assert "CUDA_ERROR_INVALID_VALUE (1)" in result.stdout
    assert "ACCEL_SIMCUDA_TOTAL_MEM=lots is not a size" in result.stderr


def test_missing_required_symbol_is_named() -> None:
    info = probe(**sim_env(hide=("cuStreamCreateWithPriority",)))
    assert not info["available"]
    assert "does not export cuStreamCreateWithPriority" in info["reason"]


@pytest.mark.parametrize("symbol", ["cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2"])
def test_context_push_and_pop_are_required(symbol: str) -> None:
    # Every entry point restores the thread's context with them; no CUDA 12 or 13 driver lacks them.
    info = probe(**sim_env(hide=(symbol,)))
    assert not info["available"]
    assert f"does not export {symbol}" in info["reason"]


def test_missing_versioned_symbol_lists_the_candidates() -> None:
    info = probe(**sim_env(hide=("cuEventElapsedTime", "cuEventElapsedTime_v2")))
    assert "does not export cuEventElapsedTime_v2 or cuEventElapsedTime" in info["reason"]


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ({"ACCEL_CUDA_DRIVER": "/nonexistent/libcuda.so.1"}, "cannot load the CUDA driver library"),
        ({"ACCEL_SIMCUDA_DEVICE_COUNT": "0"}, "cuInit failed: CUDA_ERROR_NO_DEVICE (100)"),
    ],
)
def test_cli_says_why_in_one_line(env: dict[str, str], reason: str) -> None:
    full = {**sim_env(), **env, "ACCEL_BACKEND": "cuda"}
    result = run_python("import sys; from accel._cli import main; sys.exit(main([]))", full)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr.count("\n") == 1, result.stderr
    assert "accel backend 'cuda' is unavailable: " + reason in result.stderr
    assert run_python("import accel; print(accel.is_available())", full).stdout.strip() == "False"


def test_available_with_devices_and_version() -> None:
    info = probe(**sim_env(ACCEL_SIMCUDA_DEVICE_COUNT="3", ACCEL_SIMCUDA_DRIVER_VERSION="13010"))
    assert info == {"available": True, "reason": "", "devices": 3, "driver": "13.1"}


SYMBOLS_AND_CAPTURE = """
import json
from accel.backends.base import CaptureMode
from accel.backends.cuda import load
b = load()
s = b.stream_create(0, 0)
start = b.event_create(0, timing=True, blocking=False, interprocess=False)
end = b.event_create(0, timing=True, blocking=False, interprocess=False)
buf = b.host_malloc(64)
b.stream_begin_capture(0, s, CaptureMode.THREAD_LOCAL)
calls = []
b.launch_host_func(0, s, lambda: calls.append(1))
b.memset_async(0, buf, 5, 64, s)
graph = b.stream_end_capture(0, s)
exe = b.graph_instantiate(0, graph)
b.event_record(0, start, s)
b.graph_launch(0, exe, s)
b.graph_launch(0, exe, s)
b.event_record(0, end, s)
b.stream_synchronize(0, s)
import ctypes
props = b.device_properties(0)
print(json.dumps({
    "symbols": {k: b.driver.symbols[k] for k in ("cuStreamGetCaptureInfo", "cuEventElapsedTime", "cuDeviceGetUuid")},
    "calls": len(calls), "byte": ctypes.string_at(buf, 1)[0], "elapsed_ok": b.event_elapsed_ms(0, start, end) >= 0,
    "uuid": props.uuid,
}))
"""


def test_newest_symbol_versions_are_preferred() -> None:
    result = run_json(SYMBOLS_AND_CAPTURE, sim_env())
    assert result["symbols"] == {
        "cuStreamGetCaptureInfo": "cuStreamGetCaptureInfo_v3",
        "cuEventElapsedTime": "cuEventElapsedTime_v2",
        "cuDeviceGetUuid": "cuDeviceGetUuid_v2",
    }
    assert result["calls"] == 2 and result["byte"] == 5 and result["elapsed_ok"]


def test_cuda12_driver_symbols_fall_back() -> None:
    # What a 12.2 driver (535) exports: no _v3 capture info, no _v2 elapsed time.
    hidden = ("cuStreamGetCaptureInfo_v3", "cuEventElapsedTime_v2", "cuDeviceGetUuid_v2")
    result = run_json(SYMBOLS_AND_CAPTURE, sim_env(hide=hidden))
    assert result["symbols"] == {
        "cuStreamGetCaptureInfo": "cuStreamGetCaptureInfo_v2",
        "cuEventElapsedTime": "cuEventElapsedTime",
        "cuDeviceGetUuid": "cuDeviceGetUuid",
    }
    assert result["calls"] == 2 and result["byte"] == 5 and result["elapsed_ok"]
    assert result["uuid"].startswith("GPU-5a1c0da0-")


def test_cuda13_driver_without_old_symbols() -> None:
    # What a CUDA 13 header no longer declares; the backend must not need them.
    hidden = ("cuStreamGetCaptureInfo_v2", "cuEventElapsedTime", "cuDeviceGetUuid")
    result = run_json(SYMBOLS_AND_CAPTURE, sim_env(hide=hidden, ACCEL_SIMCUDA_DRIVER_VERSION="13000"))
    assert result["calls"] == 2 and result["byte"] == 5


OPTIONAL_FEATURES = """
import json, tempfile, os
from accel._errors import NotSupportedError
from accel.backends.base import CaptureMode, CaptureStatus
from accel.backends.cuda import load
b = load()
out = {"vmm": b.supports_virtual_memory(0), "graphs": b.supports_graphs(0)}
s = b.stream_create(0, 0)
for name, call in [
    ("granularity", lambda: b.vm_granularity(0)),
    ("reserve", lambda: b.vm_reserve(0, 2 << 20)),
    ("begin", lambda: b.stream_begin_capture(0, s, CaptureMode.GLOBAL)),
]:
    try:
        call()
        out[name] = "ok"
    except NotSupportedError as exc:
        out[name] = str(exc)
out["status"] = int(b.stream_capture_status(0, s))
if out["graphs"]:
    g = b.stream_end_capture(0, s)  # the capture begun above
    try:
        b.graph_debug_dump(0, g, os.path.join(tempfile.mkdtemp(), "g.dot"))
        out["dump"] = "ok"
    except NotSupportedError as exc:
        out["dump"] = str(exc)
    b.graph_destroy(0, g)
print(json.dumps(out))
"""


def test_driver_without_vmm_symbols_disables_vmm_only() -> None:
    out = run_json(OPTIONAL_FEATURES, sim_env(hide=("cuMemCreate",)))
    assert out["vmm"] is False and out["graphs"] is True
    assert "does not export the cuMem* virtual memory entry points" in out["granularity"]
    assert "expandable_segments" in out["reserve"]
    assert out["begin"] == "ok"


def test_device_without_vmm_support() -> None:
    out = run_json(OPTIONAL_FEATURES, sim_env(ACCEL_SIMCUDA_VMM="0"))
    assert out["vmm"] is False
    assert "device reports no virtual memory management support" in out["granularity"]


def test_driver_without_capture_symbols_disables_graphs_only() -> None:
    out = run_json(OPTIONAL_FEATURES, sim_env(hide=("cuStreamBeginCapture_v2",)))
    assert out["vmm"] is True and out["graphs"] is False
    assert "lacks the stream capture / graph entry points" in out["begin"]
    assert out["status"] == 0


def test_driver_without_dot_printer() -> None:
    out = run_json(OPTIONAL_FEATURES, sim_env(hide=("cuGraphDebugDotPrint",)))
    assert "does not export cuGraphDebugDotPrint" in out["dump"]
    assert run_json(OPTIONAL_FEATURES, sim_env())["dump"] == "ok"


MULTI_DEVICE = """
import json, threading
from accel.backends.cuda import load
b = load()
p0 = b.malloc(0, 8 << 20)
p1 = b.malloc(1, 4 << 20)
info = [b.memory_info(0), b.memory_info(1)]
s1 = b.stream_create(1, 0)
b.memset_async(1, p1, 1, 16, s1)
b.stream_synchronize(1, s1)
# A thread that only ever touched device 1 must get device 1's context.
seen = []
t = threading.Thread(target=lambda: seen.append(b.memory_info(1)))
t.start(); t.join()
b.free(0, p0); b.free(1, p1); b.stream_destroy(1, s1)
print(json.dumps({"count": b.device_count(), "info": info, "thread": seen[0],
                  "names": [b.device_properties(i).pci_bus_id for i in range(2)],
                  "peer": [b.can_access_peer(0, 1), b.can_access_peer(1, 1)]}))
"""


def test_two_devices_have_separate_contexts_and_memory() -> None:
    out = run_json(MULTI_DEVICE, sim_env(ACCEL_SIMCUDA_DEVICE_COUNT="2", ACCEL_SIMCUDA_TOTAL_MEM="64MiB"))
    total = 64 << 20
    assert out["count"] == 2
    assert out["info"] == [[total - (8 << 20), total], [total - (4 << 20), total]]
    assert out["thread"] == [total - (4 << 20), total]
    assert out["names"] == ["0000:10:00.0", "0000:11:00.0"]
    assert out["peer"] == [True, True]
