"""Packaging beyond what pyproject.toml can say.

The benchmarks ship inside the wheel: ``benchmarks/`` stays at the top of the
source tree (run as scripts there) and is installed as the package
``accel._benchmarks``, so ``accel bench`` works from a wheel.

accel is pure Python and installs without a compiler. ``ACCEL_MYPYC=1 pip install .``
(with mypy in the build environment, e.g. ``pip install --no-build-isolation``
from a venv that has it) compiles the hot modules listed in
``accel/_compiled.py`` with mypyc instead; ``python -m accel info`` says which.
"""

import os
import runpy

from setuptools import find_packages, setup

ext_modules = []
if os.environ.get("ACCEL_MYPYC") == "1":
    from mypyc.build import mypycify  # ships with mypy

    modules = runpy.run_path(os.path.join("accel", "_compiled.py"))["MODULES"]
    ext_modules = mypycify([name.replace(".", "/") + ".py" for name in modules], opt_level="3")

setup(
    packages=[*find_packages(include=["accel", "accel.*"]), "accel._benchmarks"],
    package_dir={"accel._benchmarks": "benchmarks"},
    package_data={"accel": ["py.typed"], "accel._benchmarks": ["*.md"]},
    ext_modules=ext_modules,
)
