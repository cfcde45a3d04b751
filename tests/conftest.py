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
- The tests of code that ``accel._speedups`` replaces are marked ``speedups``
  (:data:`SPEEDUPS_TESTS`): README's test command runs the suite compiled, then
  those again in pure Python (``ACCEL_PURE_PYTHON=1 pytest -m speedups``). A
  run's last line says which path it tested.
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


#: For each module that plugs in accel._speedups (accel/_native.py), the tests of what
#: its compiled twin replaces: they run on each path, the differential ones on both at
#: once (and skip without the extension). tests/test_speedups.py checks that every such
#: module is here. Elsewhere the twins run only as they do under any caller: the C
#: steps are the Python ones, and the C hands every case but its fast paths back to them.
SPEEDUPS_TESTS: dict[str, tuple[str, ...]] = {
    # Which path runs, the switch, the build, the stand-ins' names.
    "accel/_native.py": ("tests/test_speedups.py",),
    # The current stream's store (set_current): set_stream, the stream context, threads.
    "accel/_runtime.py": ("tests/test_facade.py", "tests/stream/test_arguments.py"),
    # accel.memory.allocate, Buffer.free and Buffer.__del__ (a MemPool in use is one
    # of the cases the C hands back).
    "accel/allocator/_buffer.py": ("tests/allocator/test_memory.py", "tests/allocator/test_mempool.py"),
    # CoreBlock and CoreSteps, which the pure-Python run loads from the extension too.
    "accel/allocator/_blocks.py": ("tests/allocator/test_core_steps.py",),
    # accel.empty's compiled host case.
    "accel/_interop/torch.py": ("tests/_interop/test_torch.py",),
    # The graphed call's lookup head (_CallHead) and the compiled steady call (SteadyCall).
    "accel/graph/_graphed.py": ("tests/graph/test_graphed.py", "tests/graph/test_steady_call.py"),
    "accel/graph/_compiled.py": ("tests/graph/test_steady_call.py",),
}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    marked = {os.path.join(str(config.rootpath), path) for paths in SPEEDUPS_TESTS.values() for path in paths}
    for item in items:
        if str(item.path) in marked:
            item.add_marker(pytest.mark.speedups)


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


def _path_tested(config: pytest.Config) -> str:
    """Which of accel's paths this run tests, and which tests (the suite runs both
    ways: see tests/test_speedups.py)."""
    from accel._native import speedups

    if speedups is not None:
        path = "the compiled fast paths (accel._speedups)"
    elif os.environ.get("ACCEL_PURE_PYTHON") == "1":
        path = "pure Python (ACCEL_PURE_PYTHON=1)"
    else:
        path = "pure Python (accel._speedups is not built)"
    selected = config.getoption("markexpr", "")
    return f"accel: {path}" + (f", tests marked {selected!r}" if selected else "")


def pytest_report_header(config: pytest.Config) -> str:
    return _path_tested(config)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    # Also under -q, which drops the header: the last lines of a run say what it tested.
    terminalreporter.write_line(_path_tested(config))
