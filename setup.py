"""Packaging beyond what pyproject.toml can say: the benchmarks ship inside the wheel.

``benchmarks/`` stays at the top of the source tree (run as scripts there) and is
installed as the package ``accel._benchmarks``, so ``accel bench`` works from a wheel.
Both native parts are always built, so an install needs a C compiler: the compiled hot
paths ``accel._speedups`` and the allocator's native core ``accel.allocator._core``
(csrc/, cffi API mode).
"""

import zlib
from pathlib import Path

# cffi_modules needs cffi in the build environment (pyproject's build-system requires);
# without it setuptools only warns of an unknown option and builds no allocator core.
import cffi  # noqa: F401

from setuptools import Extension, find_packages, setup

SPEEDUPS = "accel/_speedups.c"
# The source's CRC-32, compiled into the extension and checked by accel/_native.py against
# the _speedups.c installed beside it: a build from another version of the source (an old
# .so left in build/ or in the tree) is refused at import.
SOURCE_CRC32 = f"{zlib.crc32((Path(__file__).resolve().parent / SPEEDUPS).read_bytes()):08x}"

setup(
    packages=[*find_packages(include=["accel", "accel.*"]), "accel._benchmarks"],
    package_dir={"accel._benchmarks": "benchmarks"},
    package_data={"accel": ["py.typed", "_speedups.pyi", "_speedups.c"], "accel._benchmarks": ["*.md"]},
    # The allocator's native core and torch's pluggable-allocator ABI (csrc/accel_core.c).
    cffi_modules=["csrc/build_core.py:ffibuilder"],
    # The compiled hot paths (accel/_native.py): not optional, so that without a compiler
    # the build stops with setuptools' error naming it, as the core's does.
    ext_modules=[
        Extension(
            "accel._speedups",
            [SPEEDUPS],
            define_macros=[("ACCEL_SPEEDUPS_SOURCE_CRC32", f'"{SOURCE_CRC32}"')],
        )
    ],
)
