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
    extern "Python" int accel_py_upstream_alloc(void *, int, int64_t, uint64_t *);
    extern "Python" void accel_py_upstream_free(void *, int, uint64_t, int64_t);
    extern "Python" int accel_py_vm_reserve(void *, int, int64_t, uint64_t *);
    extern "Python" void accel_py_vm_unreserve(void *, int, uint64_t, int64_t);
    extern "Python" int accel_py_vm_map(void *, int, uint64_t, int64_t);
    extern "Python" void accel_py_vm_unmap(void *, int, uint64_t, int64_t, int);
    extern "Python" int accel_py_vm_idle(void *, int, uint64_t);
    """
)
ffibuilder.set_source(
    "accel.allocator._core",
    '#include "accel_core.h"',
    sources=[str((HERE / "accel_core.c").relative_to(HERE.parent))],
    include_dirs=[str(HERE.relative_to(HERE.parent))],
    # only the core's API, the torch ABI and the module's init are exported
    extra_compile_args=["-O2", "-fvisibility=hidden", "-std=c11", "-D_GNU_SOURCE"],
    libraries=["pthread"],
)
