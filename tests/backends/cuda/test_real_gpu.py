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


def _pytest(*args: str) -> None:
    code = f"import sys, pytest; sys.exit(pytest.main({list(args)!r}))"
    result = run_python(code, REAL, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_conformance_suite_on_the_gpu() -> None:
    _pytest("-q", "-p", "no:cacheprovider", "-k", "cuda", str(REPO_ROOT / "tests" / "conformance"))


def test_cuda_backend_suite_on_the_gpu() -> None:
    # test_errors' simulator-only tests skip themselves there; the misuse tests run.
    suite = REPO_ROOT / "tests" / "backends" / "cuda"
    _pytest("-q", "-p", "no:cacheprovider", str(suite / "test_semantics.py"), str(suite / "test_errors.py"))


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
