"""accel's allocator under torch: torch's pluggable-allocator C ABI over the native core.

The core's shared library (csrc/accel_core.c) exports
``void* accel_torch_alloc(ssize_t size, int device, void* stream)`` and
``void accel_torch_free(void* ptr, ssize_t size, int device, void* stream)``, the
functions ``torch.cuda.memory.CUDAPluggableAllocator`` and
``torch.xpu.memory.XPUPluggableAllocator`` call. They serve each device from the
native core of that device's caching allocator, so what torch allocates through
them is in accel's ``memory_stats``, snapshots and out-of-memory reports. They take
no GIL on a cache hit; a miss asks the allocator's upstream through a callback that
takes the GIL itself.
"""

from __future__ import annotations

from typing import Any

from accel._errors import NotSupportedError
from accel._runtime import get_runtime
from accel._torch import import_torch
from accel.allocator._native_core import NativeCore, core_module, library_path
from accel.allocator._registry import registry

__all__ = ["torch_allocator", "torch_allocator_spec"]

ALLOC_FN = "accel_torch_alloc"
FREE_FN = "accel_torch_free"

# The cores registered with the C ABI, by device; cores replaced later (another
# runtime's) stay alive too: torch may still hold memory of theirs.
_registered: dict[int, NativeCore] = {}
_replaced: list[NativeCore] = []


def torch_allocator_spec() -> tuple[str, str, str]:
    """``(path, alloc_fn_name, free_fn_name)``: a shared library exporting torch's
    pluggable-allocator C ABI over accel's caching allocator of the current backend,
    for every device of it.

    >>> import accel
    >>> path, alloc, free = accel.allocator.torch_allocator_spec()
    >>> alloc, free
    ('accel_torch_alloc', 'accel_torch_free')
    """
    runtime = get_runtime()
    found = registry(runtime)
    lib = core_module().lib
    count = runtime.device_count()
    if count > lib.ACCEL_CORE_MAX_DEVICES:
        raise NotSupportedError(
            f"the {runtime.name} backend has {count} devices; torch's allocator ABI over accel serves the "
            f"first {lib.ACCEL_CORE_MAX_DEVICES} only"
        )
    for index in range(count):
        core = found.allocator(index).native_core()
        if _registered.get(index) is not core:
            lib.accel_core_register_torch(index, core._core)
            old = _registered.get(index)
            if old is not None:
                _replaced.append(old)
            _registered[index] = core
    return library_path(), ALLOC_FN, FREE_FN


def torch_allocator() -> Any:
    """torch's pluggable allocator built from :func:`torch_allocator_spec`:
    ``torch.cuda.memory.CUDAPluggableAllocator`` on CUDA,
    ``torch.xpu.memory.XPUPluggableAllocator`` on XPU. Hand it to
    ``torch.cuda.memory.change_current_allocator`` or ``torch.cuda.MemPool``.

    Raises :class:`~accel.NotSupportedError` on the host backend (torch has no
    pluggable allocator for CPU tensors) and when torch was built without the backend.

    >>> import accel
    >>> accel.allocator.torch_allocator()  # doctest: +SKIP
    <torch.cuda.memory.CUDAPluggableAllocator object at 0x...>
    """
    name = get_runtime().name
    if name not in ("cuda", "xpu"):
        raise NotSupportedError(
            f"torch has no pluggable allocator for {name} tensors (only CUDAPluggableAllocator and "
            "XPUPluggableAllocator exist), so accel cannot serve them; "
            "accel.allocator.torch_allocator_spec() still gives the C ABI, for code that calls it itself"
        )
    torch = import_torch()
    path, alloc, free = torch_allocator_spec()
    try:
        if name == "cuda":
            return torch.cuda.memory.CUDAPluggableAllocator(path, alloc, free)
        return torch.xpu.memory.XPUPluggableAllocator(path, alloc, free)
    except (AttributeError, RuntimeError) as exc:
        raise NotSupportedError(
            f"this torch ({torch.__version__}) cannot take a pluggable {name} allocator: {exc}; install a "
            f"torch built with {name.upper()} support"
        ) from exc
