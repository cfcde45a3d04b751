"""How long exported memory lives: at interpreter exit, after a refused
export, after ``Buffer.free()``, and when the buffer's stream was closed.

Whatever can crash runs in a subprocess with a timeout.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import accel
from accel._interop import _dlpack
from accel._runtime import activate
from tests.conftest import backend_skip_reason

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run(code: str, backend: str = "cpu") -> subprocess.CompletedProcess[str]:
    """Run ``code`` with ``backend`` selected, or, for "auto", as a user with no
    accel settings and no drivers does (backend probing imports other modules,
    so the interpreter tears down in another order)."""
    # The debug allocator fills freed memory, so that reading a freed
    # deleter or name crashes at once instead of by chance.
    env = dict(os.environ, PYTHONPATH=ROOT, PYTHONMALLOC="debug")
    if backend == "auto":
        env = {k: v for k, v in env.items() if not k.startswith(("ACCEL_", "ZE_"))}
    else:
        env["ACCEL_BACKEND"] = backend
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-c", code],
        env=env, capture_output=True, text=True, timeout=120, cwd=ROOT,
    )


def _backends(*names: str) -> list[object]:
    return [
        pytest.param(name, marks=pytest.mark.skipif(bool(backend_skip_reason(name)), reason=str(backend_skip_reason(name))))
        for name in names
    ]


# What is still held at exit, and where: a module global of __main__ (torn
# down with __main__), an attribute of builtins (torn down after every
# module, accel's included) and a reference cycle (left to the final
# collection), so that no module teardown order is assumed.
_HOLDERS = {
    "main": "held = {x}",
    "builtins": "import builtins; builtins.accel_held = {x}",
    "cycle": "cycle = [{x}]; cycle.append(cycle); del cycle",
}

_EXPORTS = {
    "numpy": ("import numpy as np; buf = accel.memory.allocate(16)", "np.from_dlpack(buf)"),
    "torch": ("import torch; buf = accel.memory.allocate(16)", "torch.from_dlpack(buf)"),
    "as_tensor": ("buf = accel.memory.allocate(16)", "accel.as_tensor(buf)"),
    "empty": ("", "accel.empty((4, 4))"),
    "empty_zero": ("", "accel.empty((0, 16))"),
    "capsule": ("buf = accel.memory.allocate(16)", "buf.__dlpack__()"),
    "versioned_capsule": ("buf = accel.memory.allocate(16)", "buf.__dlpack__(max_version=(1, 0))"),
    "from_dlpack": ("import torch", "accel.from_dlpack(torch.zeros(4))"),
    "from_dlpack_of_accel": ("buf = accel.memory.allocate(16)", "accel.from_dlpack(buf)"),
    "torch_of_numpy": ("import numpy as np, torch; buf = accel.memory.allocate(16)", "torch.from_dlpack(np.from_dlpack(buf))"),
}


@pytest.mark.parametrize("selection", ["auto", "cpu"])
@pytest.mark.parametrize("holder", sorted(_HOLDERS))
def test_exit_with_live_exports(holder, selection):
    # Every kind of export in one process per holder (a process costs a torch import).
    lines = ["import accel"]
    for name, (setup, expr) in sorted(_EXPORTS.items()):
        lines += [f"# {name}", setup, _HOLDERS[holder].format(x=expr).replace("held", f"held_{name}")]
    result = _run("\n".join(lines) + "\nbuf = None\n", selection)
    assert result.returncode == 0, f"held by {holder}: exit {result.returncode}\n{result.stderr}"
    assert "Exception ignored" not in result.stderr, result.stderr


def test_views_outlive_the_teardown_of_accels_modules():
    """The worst teardown order made explicit: accel's interop modules lose
    their globals (as interpreter shutdown does to every module) while
    consumers still hold exports, and the consumers let go afterwards."""
    lines = ["import accel, gc, sys"]
    for name, (setup, expr) in sorted(_EXPORTS.items()):
        lines += [setup, f"held_{name} = {expr}"]
    lines += [
        "buf = None",
        "for module in ('accel._interop._dlpack', 'accel._interop.torch'):",
        "    namespace = vars(sys.modules[module])",
        "    for key in [k for k in namespace if not k.startswith('__')]:",
        "        namespace[key] = None",
        "gc.collect()",
        *[f"del held_{name}" for name in sorted(_EXPORTS)],
        "gc.collect()",
        "print('released')",
    ]
    result = _run("\n".join(lines))
    assert result.returncode == 0 and "released" in result.stdout, f"exit {result.returncode}\n{result.stderr}"
    assert "Exception ignored" not in result.stderr, result.stderr


@pytest.mark.parametrize("selection", ["auto", "cpu"])
def test_a_dropped_zero_element_tensor_exits_cleanly(selection):
    result = _run("import accel; accel.empty((0, 16))", selection)
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""


@pytest.mark.parametrize("backend", _backends("cuda", "xpu"))
def test_exit_with_an_unconsumed_device_capsule(backend):
    result = _run("import accel\nbuf = accel.memory.allocate(16)\nheld = buf.__dlpack__()\n", backend)
    assert result.returncode == 0, result.stderr
    assert "Exception ignored" not in result.stderr, result.stderr


@pytest.mark.parametrize("backend", _backends("cuda", "xpu"))
def test_numpy_refuses_a_device_buffer_cleanly_and_nothing_leaks(backend):
    with activate(backend):
        from accel import memory

        memory.empty_cache()
        before = memory.memory_stats()["allocated_bytes.all.current"]
        for _ in range(100):
            with pytest.raises(RuntimeError, match="Unsupported device"):
                np.from_dlpack(memory.allocate(1 << 20))
        assert _dlpack.live_exports() == 0
        assert memory.memory_stats()["allocated_bytes.all.current"] == before


def _consumers(backend: str) -> dict[str, object]:
    """Ways to hold an export of a buffer on ``backend``."""
    if backend != "cpu":
        # torch (CPU build) and numpy take host memory only; a held capsule is an export too.
        return {"capsule": lambda buf: buf.__dlpack__()}
    return {
        "capsule": lambda buf: buf.__dlpack__(),
        "numpy": np.from_dlpack,
        "torch": torch.from_dlpack,
        "as_tensor": accel.as_tensor,
    }


@pytest.mark.parametrize("backend", _backends("cpu", "cuda", "xpu"))
def test_free_while_exported_waits_for_the_last_view(backend):
    with activate(backend):
        from accel import memory

        for name, consume in _consumers(backend).items():
            memory.empty_cache()
            before = memory.memory_allocated()
            buf = memory.allocate(4096)
            ptr = buf.ptr
            view = consume(buf)
            buf.free()
            assert buf.freed
            with pytest.raises(accel.InvalidHandleError):
                buf.ptr  # noqa: B018
            again = memory.allocate(4096)
            assert again.ptr != ptr, f"{name}: a view aliases new memory"
            again.free()
            assert memory.memory_allocated() > before, f"{name}: the exported block went back while viewed"
            del view
            assert _dlpack.live_exports() == 0
            assert memory.memory_allocated() == before, f"{name}: the block did not go back with its last view"


def test_a_view_keeps_reading_its_own_bytes_after_free():
    buf = accel.memory.allocate(64)
    accel.current_stream().fill(buf, 7)
    view = np.from_dlpack(buf)
    buf.free()
    other = accel.memory.allocate(64)
    accel.current_stream().fill(other, 9)
    accel.synchronize()
    assert (view == 7).all()
    other.free()


@pytest.mark.parametrize("backend", _backends("cpu", "cuda", "xpu"))
def test_export_of_a_buffer_whose_stream_was_closed(backend):
    with activate(backend):
        from accel import memory

        stream = accel.Stream()
        buf = memory.allocate(64, stream=stream)
        stream.launch_host_func(lambda: time.sleep(0.1))
        stream.fill(buf, 3)
        stream.close()
        capsule = buf.__dlpack__()  # the host consumer: the data is ready when this returns
        seen = ctypes.string_at(buf.ptr, 4)  # simulated device memory is host memory
        del capsule
        accel.synchronize()
        assert seen == b"\x03" * 4


@pytest.mark.parametrize("backend", _backends("cuda", "xpu"))
def test_freeing_a_buffer_after_a_refused_export_frees_it_at_once(backend):
    with activate(backend):
        from accel import memory

        memory.empty_cache()
        before = memory.memory_allocated()
        buf = memory.allocate(1 << 20)
        with pytest.raises(RuntimeError, match="Unsupported device"):
            np.from_dlpack(buf)
        buf.free()
        assert memory.memory_allocated() == before


_FAILING_CONSUMER = """
import gc, warnings
import accel, torch
from accel._interop import _dlpack
from accel.allocator import get_allocator
buf = accel.memory.allocate(4096)
capsule = {capsule}
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        torch.from_dlpack(capsule)
    except BaseException as error:
        print("raised", type(error).__name__)
del capsule
buf.free()
gc.collect()
print("warned", [str(w.message) for w in caught])
print("exports", _dlpack.live_exports(), "allocated", get_allocator().stats()["allocated_bytes.all.current"])
"""


@pytest.mark.parametrize(
    ("backend", "capsule"),
    [
        # The user's own export of a CUDA buffer, read by a CPU-only torch.
        pytest.param("cuda", "buf.__dlpack__()", id="cuda", marks=_backends("cuda")[0].marks),
        # The same consumer failure with host memory exported as CUDA's.
        pytest.param(
            "cpu",
            "_dlpack.make_capsule(buf._export_lease(), buf.ptr, (_dlpack.DLDeviceType.kDLCUDA, 0), 1, 8, (4096,), False)",
            id="host-as-cuda",
        ),
    ],
)
def test_a_consumer_that_fails_with_its_error_set_still_releases_the_export(backend, capsule):
    # torch calls the deleter with its error still set: the deleter's first call
    # raised SystemError, so the export was never released and the buffer's
    # memory never went back to the cache.
    if torch.cuda.is_available():
        pytest.skip("this torch reads CUDA capsules")
    result = _run(_FAILING_CONSUMER.format(capsule=capsule), backend)
    assert result.returncode == 0, result.stderr
    assert "exports 0 allocated 0" in result.stdout, result.stdout + result.stderr
    assert "Torch not compiled with CUDA enabled" in result.stdout  # the consumer's own error, in the warning
