"""pytest plugin: record every time cffi takes its locks once a backend exists.

Loaded with ``-p tests.backends.cffi_locks_plugin`` in a child pytest run by
tests/backends/test_cffi.py. ``ACCEL_BACKEND`` names the backend; after
collection the plugin loads it, then wraps its FFI's lock and cffi's
process-wide parser lock. At the end it writes the call sites that took either
lock as JSON to ``ACCEL_TEST_CFFI_LOCKS_OUT``.
"""

from __future__ import annotations

import importlib
import json
import os
import traceback
from typing import Any

import cffi.cparser
import pytest

_uses: list[str] = []


class _Watched:
    """A lock that notes where it is taken, then takes the real one."""

    def __init__(self, lock: Any, name: str) -> None:
        self._lock, self._name = lock, name

    def acquire(self, *args: Any, **kwargs: Any) -> bool:
        _uses.append(f"{self._name} taken at:\n" + "".join(traceback.format_stack(limit=12)[:-1]))
        return bool(self._lock.acquire(*args, **kwargs))

    def release(self) -> None:
        self._lock.release()

    def locked(self) -> bool:
        return bool(self._lock.locked())

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def pytest_collection_finish(session: pytest.Session) -> None:
    from accel.backends import load_backend

    name = os.environ["ACCEL_BACKEND"]
    load_backend(name)
    ffi = importlib.import_module(f"accel.backends.{name}._bindings")._get_ffi()
    ffi._lock = _Watched(ffi._lock, f"the {name} FFI's lock")
    cffi.cparser.lock = _Watched(cffi.cparser.lock, "cffi's parser lock")


def pytest_sessionfinish(session: pytest.Session) -> None:
    with open(os.environ["ACCEL_TEST_CFFI_LOCKS_OUT"], "w") as f:
        json.dump(_uses, f)
