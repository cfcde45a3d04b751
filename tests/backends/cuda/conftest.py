"""Fixtures for the CUDA backend's own tests.

``cuda`` is the backend this session loaded (the simulator unless
``ACCEL_TEST_CUDA=real``); ``sim`` additionally needs the simulator, for tests
that inject driver failures or count the driver's live objects.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cffi
import pytest

from tests.conftest import backend_skip_reason
from tests.fixtures import cuda_driver, cuda_headers

REPO_ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(autouse=True)
def _simulator_header() -> None:
    """Tests here build the simulator, which needs NVIDIA's cuda.h: skip without it (fail in CI)."""
    try:
        cuda_headers.cuda_header(cuda_driver.DEFAULT_HEADER_MAJOR)
    except cuda_headers.HeaderUnavailable as exc:
        if cuda_headers.headers_required():
            raise
        pytest.skip(f"NVIDIA's cuda.h is unavailable: {exc}")


@pytest.fixture
def cuda() -> Any:
    """The loaded CUDA backend (simulated or real)."""
    from accel.backends import load_backend

    reason = backend_skip_reason("cuda")
    if reason:
        pytest.skip(reason)
    return load_backend("cuda")


@pytest.fixture
def stream(cuda: Any) -> Iterator[int]:
    """A created stream on device 0, synchronized and destroyed after the test."""
    s = cuda.stream_create(0, 0)
    yield s
    cuda.stream_synchronize(0, s)
    cuda.stream_destroy(0, s)


def captured_host_function(cuda: Any, stream: int, fn: Any) -> tuple[int, int]:
    """A graph recording ``fn`` as a host function on device 0, and an executable graph of it."""
    from accel.backends.base import CaptureMode

    cuda.stream_begin_capture(0, stream, CaptureMode.GLOBAL)
    cuda.launch_host_func(0, stream, fn)
    graph = cuda.stream_end_capture(0, stream)
    return graph, cuda.graph_instantiate(0, graph)


class SimControl:
    """The simulator's test-only entry points, on the library this process loaded."""

    def __init__(self, path: str) -> None:
        self._ffi = cffi.FFI()
        self._ffi.cdef("int simcuda_set_failure(const char *name, int code); long simcuda_live_objects(const char *kind);")
        # dlopen of the same path returns the already-loaded library, so state is shared.
        self._lib = self._ffi.dlopen(path)
        self._failures: set[str] = set()

    def fail(self, entry_point: str, code: int) -> None:
        """Make ``entry_point`` return ``code`` until the test ends."""
        assert self._lib.simcuda_set_failure(entry_point.encode(), code) == 0
        self._failures.add(entry_point)

    def clear(self) -> None:
        for name in self._failures:
            self._lib.simcuda_set_failure(name.encode(), 0)
        self._failures.clear()

    def live(self, kind: str) -> int:
        count = int(self._lib.simcuda_live_objects(kind.encode()))
        assert count >= 0, f"unknown simulator object kind {kind!r}"
        return count


@pytest.fixture
def sim(cuda: Any) -> Iterator[SimControl]:
    """Failure injection and object counts; skips unless the session runs the simulator."""
    if cuda_driver.cuda_mode() != "sim":
        pytest.skip("needs the simulated CUDA driver (ACCEL_TEST_CUDA=sim)")
    control = SimControl(os.environ["ACCEL_CUDA_DRIVER"])
    yield control
    control.clear()


def run_python(code: str, env: dict[str, str] | None = None, *, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter (a driver loads once per process).

    The environment is this one minus every ACCEL_* variable, plus ``env``.
    """
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    clean.update(env or {})
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        env=clean,
        cwd=REPO_ROOT,
        timeout=timeout,
        check=False,
    )


@functools.lru_cache(maxsize=1)
def _system_driver() -> dict[str, object]:
    return cuda_driver.probe_driver(None)


def run_on_real_gpu(code: str, *, timeout: float = 300) -> None:
    """Run ``code`` in a fresh interpreter on the system's CUDA driver; it prints OK,
    or ``SKIP: why`` (then the test skips). Skips without a real GPU."""
    probe = _system_driver()
    if not probe["available"]:
        pytest.skip(f"no real CUDA GPU: {probe['reason']}")
    result = run_python(code, {"ACCEL_TEST_CUDA": "real", "ACCEL_BACKEND": "cuda"}, timeout=timeout)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-4000:]
    if result.stdout.startswith("SKIP: "):
        pytest.skip(result.stdout.strip()[len("SKIP: "):])
    assert result.stdout.strip().endswith("OK"), result.stdout[-2000:]


def run_json(code: str, env: dict[str, str] | None = None) -> Any:
    """Run ``code`` (which prints one JSON line last) and return the parsed value."""
    result = run_python(code, env)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])
