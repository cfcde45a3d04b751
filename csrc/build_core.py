"""cffi (API mode) build of ``accel.allocator._core``: the native allocator core of
csrc/accel_core.c and its Python binding, in one shared library that also exports
torch's pluggable-allocator C ABI (``accel_torch_alloc`` / ``accel_torch_free``).

setup.py builds it (``cffi_modules``): ``python setup.py build_ext --inplace``.
The core includes no Python.h: only cffi's generated wrapper touches Python, and the
upstream callbacks (``extern "Python"``: segments, and expandable segments' virtual
memory) take the GIL themselves.
"""

from __future__ import annotations

import re
from pathlib import Path

import cffi

HERE = Path(__file__).resolve().parent
HEADER = HERE / "accel_core.h"

ffibuilder = cffi.FFI()
# the header minus its #include lines (cffi knows stdint's and ssize_t)
ffibuilder.cdef(re.sub(r"^#include .*$", "", HEADER.read_text(), flags=re.M))
ffibuilder.cdef(
    """
    typedef struct { uint64_t value; int32_t rc; int32_t stage; uint64_t job; } accel_py_call;
    extern "Python" void accel_py_upstream_alloc(void *, int, int64_t, accel_py_call *);
    extern "Python" void accel_py_upstream_free(void *, int, uint64_t, int64_t, accel_py_call *);
    extern "Python" void accel_py_vm_reserve(void *, int, int64_t, accel_py_call *);
    extern "Python" void accel_py_vm_unreserve(void *, int, uint64_t, int64_t, accel_py_call *);
    extern "Python" void accel_py_vm_map(void *, int, uint64_t, int64_t, accel_py_call *);
    extern "Python" void accel_py_vm_unmap(void *, int, uint64_t, int64_t, int, accel_py_call *);
    extern "Python" int accel_py_vm_idle(void *, int, uint64_t);
    int accel_py_alloc(void *, int, int64_t, uint64_t *);
    void accel_py_free(void *, int, uint64_t, int64_t);
    int accel_py_reserve(void *, int, int64_t, uint64_t *);
    void accel_py_unreserve(void *, int, uint64_t, int64_t);
    int accel_py_map(void *, int, uint64_t, int64_t);
    void accel_py_unmap(void *, int, uint64_t, int64_t, int);
    """
)
# The core's upstream is these C functions, each over its Python callback: an exception
# that leaves a Python callback (an interrupt, which a signal may raise at any line,
# its first included) ends it early, so each is called again, on the same call record,
# until it says the call is done (stage 2). The callback does the upstream's side once
# (accel/allocator/_native_core.py), so nothing is asked or given back twice or lost.
SHIMS = """
typedef struct { uint64_t value; int32_t rc; int32_t stage; uint64_t job; } accel_py_call;
#define ACCEL_PY_CALL(invoke) accel_py_call call = {0, 0, 0, 0}; while (call.stage < 2) invoke
static void accel_py_upstream_alloc(void *, int, int64_t, accel_py_call *);
static void accel_py_upstream_free(void *, int, uint64_t, int64_t, accel_py_call *);
static void accel_py_vm_reserve(void *, int, int64_t, accel_py_call *);
static void accel_py_vm_unreserve(void *, int, uint64_t, int64_t, accel_py_call *);
static void accel_py_vm_map(void *, int, uint64_t, int64_t, accel_py_call *);
static void accel_py_vm_unmap(void *, int, uint64_t, int64_t, int, accel_py_call *);
static int accel_py_alloc(void *ctx, int device, int64_t size, uint64_t *ptr) {
    ACCEL_PY_CALL(accel_py_upstream_alloc(ctx, device, size, &call));
    *ptr = call.value;
    return call.rc;
}
static void accel_py_free(void *ctx, int device, uint64_t ptr, int64_t size) {
    ACCEL_PY_CALL(accel_py_upstream_free(ctx, device, ptr, size, &call));
}
static int accel_py_reserve(void *ctx, int device, int64_t size, uint64_t *va) {
    ACCEL_PY_CALL(accel_py_vm_reserve(ctx, device, size, &call));
    *va = call.value;
    return call.rc;
}
static void accel_py_unreserve(void *ctx, int device, uint64_t va, int64_t size) {
    ACCEL_PY_CALL(accel_py_vm_unreserve(ctx, device, va, size, &call));
}
static int accel_py_map(void *ctx, int device, uint64_t va, int64_t nbytes) {
    ACCEL_PY_CALL(accel_py_vm_map(ctx, device, va, nbytes, &call));
    return call.rc;
}
static void accel_py_unmap(void *ctx, int device, uint64_t va, int64_t nbytes, int wait) {
    ACCEL_PY_CALL(accel_py_vm_unmap(ctx, device, va, nbytes, wait, &call));
}
"""
ffibuilder.set_source(
    "accel.allocator._core",
    '#include "accel_core.h"\n' + SHIMS,
    sources=[str((HERE / "accel_core.c").relative_to(HERE.parent))],
    include_dirs=[str(HERE.relative_to(HERE.parent))],
    # only the core's API, the torch ABI and the module's init are exported
    extra_compile_args=["-O2", "-fvisibility=hidden", "-std=c11", "-D_GNU_SOURCE"],
    libraries=["pthread"],
)
