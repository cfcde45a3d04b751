"""Packaging beyond what pyproject.toml can say: the benchmarks ship inside the wheel.

``benchmarks/`` stays at the top of the source tree (run as scripts there) and is
installed as the package ``accel._benchmarks``, so ``accel bench`` works from a wheel.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["accel", "accel.*"]), "accel._benchmarks"],
    package_dir={"accel._benchmarks": "benchmarks"},
    package_data={"accel": ["py.typed"], "accel._benchmarks": ["*.md"]},
)
