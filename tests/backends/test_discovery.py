"""Backend discovery (accel/backends/__init__.py): what a failed load leaves behind.

Each case runs in a fresh interpreter, because a backend loads (or fails) once
per process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]

# The CUDA backend asked for by name, with a driver path that does not exist:
# every lookup fails with the same BackendUnavailableError.
NO_DRIVER = {"ACCEL_BACKEND": "cuda", "ACCEL_CUDA_DRIVER": "/nonexistent/libcuda.so.1"}


def run_json(code: str, env: dict[str, str]) -> Any:
    """Run ``code`` in a fresh interpreter (no inherited ACCEL_*); return its last printed JSON line."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    clean.update(env)
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True, text=True, env=clean, cwd=REPO_ROOT, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_failed_first_call_frees_the_callers_locals() -> None:
    result = run_json(
        """
        import gc, json, weakref
        import accel

        class Big:  # stands for a 256 MiB array the caller holds
            pass

        def caller():
            big = Big()
            ref = weakref.ref(big)
            available = accel.is_available()
            return ref, available

        ref, available = caller()
        gc.collect()
        print(json.dumps({"available": available, "freed": ref() is None}))
        """,
        NO_DRIVER,
    )
    assert result == {"available": False, "freed": True}


def test_repeated_lookups_do_not_grow_memory() -> None:
    result = run_json(
        """
        import json, tracemalloc
        import accel

        for _ in range(1000):
            accel.is_available()
        tracemalloc.start()
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(20000):
            accel.is_available()
        print(json.dumps({"grown": tracemalloc.get_traced_memory()[0] - before}))
        """,
        NO_DRIVER,
    )
    # Re-raising one stored exception added a traceback entry per call (~1.1 KiB).
    assert result["grown"] < 64 * 1024


def test_later_lookups_raise_the_same_error_afresh() -> None:
    result = run_json(
        """
        import json, traceback
        from accel import BackendUnavailableError
        from accel.backends import load_backend

        seen = []
        for _ in range(3):
            try:
                load_backend("cuda")
            except BackendUnavailableError as exc:
                seen.append([type(exc).__name__, exc.backend, exc.reason, exc.remedy, str(exc),
                             len(traceback.extract_tb(exc.__traceback__))])
        print(json.dumps(seen))
        """,
        NO_DRIVER,
    )
    first, second, third = result
    assert first[:5] == second[:5] == third[:5]
    assert first[2].startswith("cannot load the CUDA driver library ACCEL_CUDA_DRIVER=/nonexistent")
    assert first[3].startswith("Install the NVIDIA driver")
    assert second[5] == third[5]  # the traceback does not grow from one lookup to the next


STARTUP = """
import json, sys
import accel
imported = [m for m in ("cffi", "pycparser", "torch", "numpy") if m in sys.modules]
device = accel.current_accelerator()
print(json.dumps({"at_import": imported, "device": str(device),
                  "after": [m for m in ("cffi", "pycparser", "torch", "numpy") if m in sys.modules]}))
"""


def no_gpu_env(**extra: str) -> dict[str, str]:
    """No backend asked for; the Level Zero simulator (set up by tests/conftest.py) hidden."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCEL_", "ZE_"))}
    return {**env, **extra}


def run_startup(env: dict[str, str]) -> Any:
    result = subprocess.run(
        [sys.executable, "-c", STARTUP], capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_selecting_the_host_backend_without_driver_libraries_imports_no_cffi() -> None:
    env = no_gpu_env(ACCEL_CUDA_DRIVER="/nonexistent/libcuda.so.1", ACCEL_ZE_LOADER="/nonexistent/libze_loader.so.1")
    assert run_startup(env) == {"at_import": [], "device": "cpu", "after": []}


def test_a_level_zero_loader_without_a_gpu_driver_costs_no_declarations() -> None:
    # The loader (where installed) finds no driver: zeInit fails before cffi is imported.
    env = no_gpu_env(ACCEL_CUDA_DRIVER="/nonexistent/libcuda.so.1", ZE_ENABLE_ALT_DRIVERS="/nonexistent/libze_none.so")
    assert run_startup(env) == {"at_import": [], "device": "cpu", "after": []}
