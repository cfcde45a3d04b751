"""Real-GPU checks, selected with ``python -m pytest -m gpu``.

Each test runs in a fresh interpreter against the system's CUDA driver
(``ACCEL_TEST_CUDA=real``), whatever driver this session uses, and skips
when that driver sees no device. Nothing here was run on a GPU by the
author of this file; see docs/backends/cuda.md.
"""

from __future__ import annotations

import functools

import pytest

from tests.backends.cuda.conftest import REPO_ROOT, run_python
from tests.fixtures.cuda_driver import probe_driver

pytestmark = pytest.mark.gpu

REAL = {"ACCEL_TEST_CUDA": "real"}


@functools.lru_cache(maxsize=1)
def _system_driver() -> dict[str, object]:
    return probe_driver(None)


@pytest.fixture(autouse=True)
def _needs_gpu() -> None:
    probe = _system_driver()
    if not probe["available"]:
        pytest.skip(f"no real CUDA GPU: {probe['reason']}")


def _pytest(*args: str, backends: str | None = None) -> None:
    code = f"import sys, pytest; sys.exit(pytest.main({list(args)!r}))"
    result = run_python(code, {**REAL, "ACCEL_TEST_BACKENDS": backends} if backends else REAL, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_conformance_suite_on_the_gpu() -> None:
    _pytest("-q", "-p", "no:cacheprovider", str(REPO_ROOT / "tests" / "conformance"), backends="cuda")


def test_cuda_backend_suite_on_the_gpu() -> None:
    # test_errors' simulator-only tests skip themselves there; the misuse tests run.
    suite = REPO_ROOT / "tests" / "backends" / "cuda"
    _pytest("-q", "-p", "no:cacheprovider", *(str(suite / name) for name in
            ("test_semantics.py", "test_errors.py", "test_context.py", "test_capture_races.py")))


def test_device_properties_are_real() -> None:
    result = run_python(
        """
        from accel.backends.cuda import load
        props = load().device_properties(0)
        assert "simulated" not in props.name, props.name
        assert props.total_memory > 1 << 30 and props.multi_processor_count > 1
        print(props.name, props.compute_capability, props.driver_version, props.uuid)
        """,
        REAL,
    )
    assert result.returncode == 0, result.stderr


TORCH_INTEROP = """
import sys
import torch
if not torch.cuda.is_available():
    print("SKIP: torch has no CUDA here (" + str(torch.version.cuda) + ")")
    sys.exit(0)
from accel.backends.cuda import load
b = load()
torch.cuda.init()

# accel stream -> torch: torch queues work on accel's CUstream.
s = b.stream_create(0, 0)
ext = torch.cuda.ExternalStream(s)
assert ext.cuda_stream == s
x = torch.zeros(1 << 20, device="cuda")
with torch.cuda.stream(ext):
    x.add_(3)
b.stream_synchronize(0, s)
assert float(x.sum()) == 3 * (1 << 20)

# torch stream -> accel: accel queues a copy and a host function on torch's stream.
ts = torch.cuda.Stream()
y = torch.empty(1 << 20, device="cuda")
ran = []
b.memcpy_async(0, y.data_ptr(), x.data_ptr(), x.numel() * 4, ts.cuda_stream)
b.launch_host_func(0, ts.cuda_stream, lambda: ran.append(True))
ts.synchronize()
assert ran == [True] and torch.equal(x, y)

# The same through the facade, as users write it.
import accel
assert accel.current_accelerator().type == "cuda"
a = accel.Stream()
t = torch.cuda.ExternalStream(a.native_handle)
with torch.cuda.stream(t):
    x.mul_(2)
a.synchronize()
assert float(x.sum()) == 6 * (1 << 20)
wrapped = accel.ExternalStream(ts.cuda_stream)
assert wrapped.native_handle == ts.cuda_stream and wrapped.__cuda_stream__() == (0, ts.cuda_stream)
wrapped.synchronize()

# Both use the device's primary context, so pointers cross too.
ptr = b.malloc(0, 4096)
b.memset_async(0, ptr, 1, 4096, 0)
b.device_synchronize(0)
b.free(0, ptr)
b.stream_destroy(0, s)
print("OK")
"""


def test_torch_interop_both_ways() -> None:
    result = run_python(TORCH_INTEROP, {**REAL, "ACCEL_BACKEND": "cuda"}, timeout=300)
    assert result.returncode == 0, result.stderr
    if result.stdout.startswith("SKIP: "):
        pytest.skip(result.stdout.strip()[len("SKIP: "):])
    assert result.stdout.strip().endswith("OK")


TORCH_CURRENT_DEVICE = """
import sys, threading
import torch
if not torch.cuda.is_available():
    print("SKIP: torch has no CUDA here (" + str(torch.version.cuda) + ")")
    sys.exit(0)
from accel.backends.base import CaptureMode, CaptureStatus
from accel.backends.cuda import load
b = load()
count = torch.cuda.device_count()
host = b.host_malloc(64)
fn, ffi = b.driver.fn, b.driver.ffi

def current_context():
    ctx = ffi.new("CUcontext *")
    fn["cuCtxGetCurrent"](ctx)
    return int(ffi.cast("uintptr_t", ctx[0]))

def tour(device):
    s = b.stream_create(device, 0)
    p = b.malloc(device, 64)
    b.memset_async(device, p, 1, 64, s)
    b.memcpy_async(device, host, p, 64, s)
    b.stream_synchronize(device, s)
    b.memory_info(device)
    b.free(device, p)
    b.stream_destroy(device, s)

# torch's current device stays what torch set, whichever device accel works on.
for current in range(min(count, 2)):
    torch.cuda.set_device(current)
    torch.empty(1, device="cuda")
    for device in range(count):
        tour(device)
        assert torch.cuda.current_device() == current, (device, current, torch.cuda.current_device())
    # Host memory uses the context torch has current (accel retained it): no switch.
    torch_context, seen, real_alloc = current_context(), [], fn["cuMemHostAlloc"]
    fn["cuMemHostAlloc"] = lambda *args: (seen.append(current_context()), real_alloc(*args))[1]
    b.host_free(b.host_malloc(64))
    fn["cuMemHostAlloc"] = real_alloc
    assert seen == [torch_context], (seen, torch_context)
    assert torch.cuda.current_device() == current
    assert torch.empty(1, device="cuda").device.index == current

# A thread that never touched CUDA has no current context, before and after;
# the push and pop around calls during a global capture leave the capture valid.
out = []
def fresh():
    ctx = ffi.new("CUcontext *")
    fn["cuCtxGetCurrent"](ctx); before = ctx[0] == ffi.NULL
    tour(0)
    s = b.stream_create(0, 0)
    p = b.malloc(0, 64)
    b.stream_begin_capture(0, s, CaptureMode.GLOBAL)
    b.memset_async(0, p, 2, 64, s)
    status = b.stream_capture_status(0, s)
    g = b.stream_end_capture(0, s)
    b.graph_destroy(0, g)
    b.free(0, p)
    b.stream_destroy(0, s)
    fn["cuCtxGetCurrent"](ctx); after = ctx[0] == ffi.NULL
    out.append((before, after, status))
t = threading.Thread(target=fresh)
t.start(); t.join()
assert out == [(True, True, CaptureStatus.ACTIVE)], out
b.host_free(host)
print(f"OK ({count} devices)")
"""


def test_torch_current_device_is_left_alone() -> None:
    result = run_python(TORCH_CURRENT_DEVICE, REAL, timeout=300)
    assert result.returncode == 0, result.stderr
    if result.stdout.startswith("SKIP: "):
        pytest.skip(result.stdout.strip()[len("SKIP: "):])
    assert "OK" in result.stdout
