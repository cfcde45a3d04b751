"""What only a real GPU can tell (docs/verify.md, "Known unknowns"), asked of the driver.

One survey script asks the CUDA driver, through accel's own bindings and
nothing else, the questions the declarations audit could not settle:

- which calls it refuses while a stream captures in global mode (each call
  in a fresh capture, on the capturing thread and, for allocation, on
  another thread);
- its minimum and recommended VMM granularity (accel floors it at 2 MiB);
- the UUID accel prints, to compare with ``nvidia-smi -L`` (``MIG-`` on a MIG
  instance, where accel prints ``GPU-``).

On the simulated driver (every CI run) the answers must be the ones accel
assumes, written down in :data:`ASSUMED_REFUSALS`. On a real GPU (``-m gpu``,
part of ``accel verify``'s real-device step) the driver's answers must equal
them: a difference fails with both lists, which is how the GPU run settles
the question.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from tests.backends.cuda.conftest import run_python
from tests.fixtures.cuda_driver import build_simulator, probe_driver

SURVEY = r"""
import json, threading
from accel.backends.cuda._bindings import open_driver

d = open_driver()
f, ffi = d.fn, d.ffi
assert f["cuInit"](0) == 0
ctx = ffi.new("CUcontext *")
assert f["cuDevicePrimaryCtxRetain"](ctx, 0) == 0
assert f["cuCtxSetCurrent"](ctx[0]) == 0


def new_stream():
    s = ffi.new("CUstream *")
    assert f["cuStreamCreateWithPriority"](s, 1, 0) == 0
    return s[0]


capturing, other = new_stream(), new_stream()
event = ffi.new("CUevent *")
assert f["cuEventCreate"](event, 0) == 0
assert f["cuEventRecord"](event[0], other) == 0 and f["cuStreamSynchronize"](other) == 0
out_ptr, host, free_b, total_b = ffi.new("CUdeviceptr *"), ffi.new("void **"), ffi.new("size_t *"), ffi.new("size_t *")
victim = ffi.new("CUdeviceptr *")


def from_another_thread(call):
    box = []
    worker = threading.Thread(target=lambda: (f["cuCtxSetCurrent"](ctx[0]), box.append(call())))
    worker.start(); worker.join()
    return box[0]


CALLS = {
    "cuMemAlloc": lambda: f["cuMemAlloc"](out_ptr, 1 << 20),
    "cuMemAlloc (another thread)": lambda: from_another_thread(lambda: f["cuMemAlloc"](out_ptr, 1 << 20)),
    "cuMemFree": lambda: f["cuMemFree"](victim[0]),
    "cuMemHostAlloc": lambda: f["cuMemHostAlloc"](host, 4096, 0),
    "cuMemGetInfo": lambda: f["cuMemGetInfo"](free_b, total_b),
    "cuCtxSynchronize": lambda: f["cuCtxSynchronize"](),
    "cuStreamSynchronize (other stream)": lambda: f["cuStreamSynchronize"](other),
    "cuStreamQuery (other stream)": lambda: f["cuStreamQuery"](other),
    "cuEventSynchronize (uncaptured event)": lambda: f["cuEventSynchronize"](event[0]),
    "cuEventQuery (uncaptured event)": lambda: f["cuEventQuery"](event[0]),
}
refusals = {}
for name, call in CALLS.items():
    assert f["cuMemAlloc"](victim, 1 << 20) == 0
    out_ptr[0] = 0
    host[0] = ffi.NULL
    assert f["cuStreamBeginCapture"](capturing, 0) == 0  # CU_STREAM_CAPTURE_MODE_GLOBAL
    code = call()
    graph = ffi.new("CUgraph *")
    end = f["cuStreamEndCapture"](capturing, graph)
    if graph[0] != ffi.NULL:
        f["cuGraphDestroy"](graph[0])
    refusals[name] = {"call": d.error_name(code), "end_capture": d.error_name(end)}
    # Undo what an accepted call did.
    if out_ptr[0]:
        f["cuMemFree"](out_ptr[0])
    if host[0] != ffi.NULL:
        f["cuMemFreeHost"](host[0])
    if name != "cuMemFree" or code != 0:
        f["cuMemFree"](victim[0])

granularity = {}
if d.has_vmm:
    prop = ffi.new("CUmemAllocationProp *")
    prop.type = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = 1  # CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    size = ffi.new("size_t *")
    for option, label in ((0, "minimum"), (1, "recommended")):
        assert f["cuMemGetAllocationGranularity"](size, prop, option) == 0
        granularity[label] = size[0]

from accel.backends.cuda import load
print(json.dumps({"refusals": refusals, "granularity": granularity, "uuid": load().device_properties(0).uuid}))
"""

_REFUSED = {"call": "CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", "end_capture": "CUDA_ERROR_STREAM_CAPTURE_INVALIDATED"}
_ALLOWED = {"call": "CUDA_SUCCESS", "end_capture": "CUDA_SUCCESS"}

#: What accel (and its simulator) assume the driver answers inside a global-mode capture.
ASSUMED_REFUSALS = {
    "cuMemAlloc": _REFUSED,
    "cuMemAlloc (another thread)": _REFUSED,
    "cuMemFree": _REFUSED,
    "cuMemHostAlloc": _REFUSED,
    "cuMemGetInfo": _ALLOWED,
    "cuCtxSynchronize": _REFUSED,
    "cuStreamSynchronize (other stream)": _REFUSED,
    "cuStreamQuery (other stream)": _REFUSED,
    "cuEventSynchronize (uncaptured event)": _REFUSED,
    "cuEventQuery (uncaptured event)": _REFUSED,
}

#: accel's floor on VMM granularity (accel/backends/cuda/_backend.py).
GRANULARITY_FLOOR = 2 << 20


def survey(driver: str | None) -> dict:
    """The survey's answers from ``driver`` (a path, or None for the system's libcuda)."""
    env = {"ACCEL_CUDA_DRIVER": driver} if driver else {}
    result = run_python(SURVEY, env, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


def _differences(answers: dict) -> list[str]:
    return [f"{name}: assumed {ASSUMED_REFUSALS.get(name)}, driver answered {answer}"
            for name, answer in answers["refusals"].items() if ASSUMED_REFUSALS.get(name) != answer]


def test_the_simulator_answers_what_accel_assumes() -> None:
    answers = survey(str(build_simulator()))
    assert set(answers["refusals"]) == set(ASSUMED_REFUSALS)
    assert _differences(answers) == []
    assert answers["granularity"] == {"minimum": GRANULARITY_FLOOR, "recommended": GRANULARITY_FLOOR}
    assert answers["uuid"].startswith("GPU-")


@pytest.fixture(scope="module")
def real_answers() -> dict:
    probe = probe_driver(None)
    if not probe["available"]:
        pytest.skip(f"no real CUDA GPU: {probe['reason']}")
    return survey(None)


@pytest.mark.gpu
def test_global_capture_refuses_what_accel_assumes(real_answers: dict) -> None:
    assert _differences(real_answers) == []


@pytest.mark.gpu
def test_granularity_floor_is_a_multiple_of_the_driver_minimum(real_answers: dict) -> None:
    granularity = real_answers["granularity"]
    if not granularity:
        pytest.skip("the driver has no virtual memory management")
    # accel reserves and maps in max(recommended, 2 MiB) steps: each must be a multiple of the minimum.
    step = max(granularity["recommended"], GRANULARITY_FLOOR)
    assert step % granularity["minimum"] == 0, granularity


@pytest.mark.gpu
def test_uuid_is_the_one_nvidia_smi_prints(real_answers: dict) -> None:
    smi = shutil.which("nvidia-smi")
    if smi is None:
        pytest.skip("nvidia-smi is not on PATH")
    listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60, check=False).stdout
    # On a MIG instance nvidia-smi lists the slice as MIG-<uuid>; accel prints GPU-<uuid>.
    assert real_answers["uuid"] in listing, (real_answers["uuid"], listing)
