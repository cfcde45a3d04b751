"""Packaging beyond what pyproject.toml can say: the benchmarks ship inside the wheel.

``benchmarks/`` stays at the top of the source tree (run as scripts there) and is
installed as the package ``accel._benchmarks``, so ``accel bench`` works from a wheel.
The optional C extension ``accel._speedups`` is built when a compiler is there.
"""

from setuptools import Extension, find_packages, setup

setup(
    packages=[*find_packages(include=["accel", "accel.*"]), "accel._benchmarks"],
    package_dir={"accel._benchmarks": "benchmarks"},
    package_data={"accel": ["py.typed", "_speedups.pyi"], "accel._benchmarks": ["*.md"]},
    # The compiled fast paths (accel/_native.py): optional, so that without a compiler
    # the build goes on and accel stays pure Python.
    ext_modules=[Extension("accel._speedups", ["accel/_speedups.c"], optional=True)],
)
