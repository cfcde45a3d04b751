"""Backend discovery.

Each backend is a subpackage ``accel.backends.<name>`` exposing
``load() -> Backend``, which raises :class:`~accel.BackendUnavailableError`
with the reason when the backend cannot be used here. Nothing is imported or
loaded until asked for, so ``import accel`` stays cheap.

Selection: ``ACCEL_BACKEND=cpu|cuda|xpu`` names one (and fails loudly when it
is unavailable); otherwise the first available of cuda, xpu, cpu is used.
"""

from __future__ import annotations

import importlib
import os
import threading

from accel._errors import AccelError, BackendUnavailableError
from accel.backends.base import Backend, BackendInfo

__all__ = ["BACKEND_NAMES", "initialized_backend_names", "load_backend", "probe_backend", "select_backend"]

#: Discovery priority: real accelerators first, the host backend last.
BACKEND_NAMES: tuple[str, ...] = ("cuda", "xpu", "cpu")

_lock = threading.Lock()
_loaded: dict[str, Backend] = {}
# Why a backend failed to load: the error's type and its words, never the exception
# itself, whose traceback reaches the first caller's frames (and every local in them)
# and would grow by a frame on each re-raise.
_failed: dict[str, tuple[type[BackendUnavailableError], str, str]] = {}
# Backends whose load is under way (in a forked child: the parent's, interrupted by the fork).
_loading: set[str] = set()


def _after_fork_in_child() -> None:
    global _lock
    # A parent thread loading a backend at the fork held the lock: it would stay held.
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def initialized_backend_names() -> set[str]:
    """Backends loaded or being loaded in this process (in a forked child: in the parent)."""
    return set(_loaded) | _loading


def load_backend(name: str) -> Backend:
    """Load (once) and return the backend called ``name``.

    >>> from accel.backends import load_backend
    >>> load_backend("cpu").name
    'cpu'
    """
    if name not in BACKEND_NAMES:
        raise BackendUnavailableError(
            name,
            "no such backend",
            remedy=f"choose one of {', '.join(BACKEND_NAMES)}",
        )
    with _lock:
        if name in _loaded:
            return _loaded[name]
        failed = _failed.get(name)
        if failed is not None:
            # Drivers such as the Level Zero loader cannot retry a failed init
            # in the same process, so the first failure is the answer.
            kind, reason, remedy = failed
            raise kind(name, reason, remedy=remedy)
        _loading.add(name)
        try:
            try:
                module = importlib.import_module(f"accel.backends.{name}")
            except ModuleNotFoundError as exc:
                if exc.name != f"accel.backends.{name}":
                    raise  # the backend exists but something it imports is missing
                raise BackendUnavailableError(name, "this installation of accel has no such backend") from None
            backend: Backend = module.load()
        except BackendUnavailableError as exc:
            _failed[name] = (type(exc), exc.reason, exc.remedy)
            raise
        finally:
            _loading.discard(name)
        _loaded[name] = backend
        return backend


def probe_backend(name: str) -> BackendInfo:
    """Whether backend ``name`` is usable here, and if not, why; never raises."""
    try:
        backend = load_backend(name)
        count = backend.device_count()
        driver = backend.device_properties(0).driver_version if count else ""
    except BackendUnavailableError as exc:
        return BackendInfo(name, False, exc.reason)
    except AccelError as exc:
        return BackendInfo(name, False, str(exc))
    return BackendInfo(name, True, "", count, driver)


def select_backend() -> Backend:
    """The backend this process uses: ``ACCEL_BACKEND`` or the first available."""
    requested = os.environ.get("ACCEL_BACKEND", "").strip().lower()
    if requested:
        return load_backend(requested)
    reasons = []
    for name in BACKEND_NAMES:
        try:
            return load_backend(name)
        except BackendUnavailableError as exc:
            reasons.append(f"{name}: {exc.reason}")
    raise BackendUnavailableError("any", "; ".join(reasons))


def _forget_for_tests() -> None:
    """Drop cached backends (tests that build fresh simulated drivers)."""
    with _lock:
        _loaded.clear()
        _failed.clear()
