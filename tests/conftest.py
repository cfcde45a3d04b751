"""Session set-up shared by every test.

- Facade tests run on the host backend: ``ACCEL_BACKEND=cpu`` unless the
  caller already chose one, with two host devices (``ACCEL_CPU_DEVICES=2``).
- Simulated drivers are prepared before any backend loads, because vendor
  loaders read their environment once per process (Level Zero cannot retry a
  failed ``zeInit``). Each ``tests/fixtures/<backend>_driver.py`` defines
  ``prepare_environment() -> str | None``: it builds its simulator with gcc if
  needed, points the backend at it through environment variables, and returns
  None, or a reason the backend cannot be tested here.
- The ``backend`` fixture runs a test once per backend (the conformance
  suite): cpu always, cuda and xpu where their driver (simulated or real) is
  prepared. ``ACCEL_TEST_BACKENDS=cuda`` (a comma list) keeps only those
  backends' cases and prepares no other driver: ``accel verify`` selects a
  backend this way, by parameter, where ``-k cuda`` would also match (or miss)
  test names that merely contain the word.
- A run's last line names the compiled extension it tested (``accel._speedups``,
  part of every build: the suite runs once).
"""

from __future__ import annotations

import importlib
import os

import pytest

os.environ.setdefault("ACCEL_BACKEND", "cpu")
# Two host devices, so that multi-device paths (guards, per-device state) run everywhere.
os.environ.setdefault("ACCEL_CPU_DEVICES", "2")

ALL_BACKENDS = ("cpu", "cuda", "xpu")


def _selected_backends() -> tuple[str, ...]:
    chosen = os.environ.get("ACCEL_TEST_BACKENDS", "").strip()
    if not chosen:
        return ALL_BACKENDS
    names = tuple(dict.fromkeys(n.strip() for n in chosen.split(",") if n.strip()))
    unknown = [n for n in names if n not in ALL_BACKENDS]
    if unknown or not names:
        raise pytest.UsageError(
            f"ACCEL_TEST_BACKENDS={chosen!r} names no backend or unknown ones ({', '.join(unknown)}); "
            f"use a comma list of {', '.join(ALL_BACKENDS)}, or unset it to test all"
        )
    return names


CONFORMANCE_BACKENDS = _selected_backends()

_skip_reasons: dict[str, str] = {}


def _prepare(name: str) -> None:
    if name == "cpu":
        return
    try:
        module = importlib.import_module(f"tests.fixtures.{name}_driver")
    except ModuleNotFoundError:
        _skip_reasons[name] = f"no {name} driver fixture yet"
        return
    reason = module.prepare_environment()
    if reason:
        _skip_reasons[name] = reason


for _name in CONFORMANCE_BACKENDS:
    _prepare(_name)


def backend_skip_reason(name: str) -> str | None:
    """Why ``name`` cannot be tested in this session, or None if it can."""
    if name not in CONFORMANCE_BACKENDS:
        return f"{name} is not among ACCEL_TEST_BACKENDS={os.environ.get('ACCEL_TEST_BACKENDS')}"
    return _skip_reasons.get(name)


@pytest.fixture(params=CONFORMANCE_BACKENDS)
def backend(request: pytest.FixtureRequest):
    """A loaded Backend, once per backend that can be tested here."""
    from accel.backends import load_backend

    name = request.param
    reason = backend_skip_reason(name)
    if reason:
        pytest.skip(reason)
    # A prepared driver that does not load is a failure, not a skip.
    return load_backend(name)


def _path_tested() -> str:
    """The compiled hot paths this run tested (accel/_native.py)."""
    from accel._native import speedups

    return f"accel: compiled hot paths {speedups.__file__}"


def pytest_report_header(config: pytest.Config) -> str:
    return _path_tested()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    # Also under -q, which drops the header: the last line of a run says what it tested.
    terminalreporter.write_line(_path_tested())
