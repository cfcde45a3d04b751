"""cffi's locks (accel/backends/_cffi.py): a garbage collection inside a cffi parse must not deadlock.

cffi holds its parser lock and the FFI's lock while pycparser parses (and
allocates). A collection starting there runs the finalizers of unreachable
Streams, Events and Graphs on the same thread; before backends resolved every
symbol and parsed every type when created, the simulated Level Zero backend
hung there forever (the first test, on the old code: killed by its timeout).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import backend_skip_reason

REPO_ROOT = Path(__file__).resolve().parents[2]
VENDOR_BACKENDS = ("cuda", "xpu")

FORCED_COLLECTION = """
import gc, json, sys
import accel
import cffi.cparser

name = sys.argv[1]
accel.current_accelerator()
ffi = __import__(f"accel.backends.{name}._bindings", fromlist=["_get_ffi"])._get_ffi()


class Cycle:
    pass


def make_garbage():
    # Only the cyclic collector can free these, and it runs their finalizers.
    c = Cycle()
    c.me = c
    c.stream = accel.Stream()
    c.event = accel.Event(enable_timing=True)
    c.event.record(c.stream)
    c.graph = accel.Graph()
    with accel.graph(c.graph, stream=accel.Stream()):
        pass
    c.graph.replay()
    accel.synchronize()


gc.disable()
make_garbage()
seen = {"collected": 0, "locks_held": None}
parser = cffi.cparser._get_parser()
plain_parse = parser.parse


def parse_after_a_collection(*args, **kwargs):
    # What any allocation inside pycparser may do: collect garbage, while cffi
    # holds its parser lock and this FFI's lock.
    seen["collected"] += gc.collect()
    seen["locks_held"] = [cffi.cparser.lock.locked(), ffi._lock.locked()]
    return plain_parse(*args, **kwargs)


parser.parse = parse_after_a_collection
ffi.typeof("void *[17]")  # a type nobody has parsed yet
parser.parse = plain_parse
print(json.dumps(seen))
"""


def child_env(name: str) -> dict[str, str]:
    env = dict(os.environ)
    env["ACCEL_BACKEND"] = name
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


@pytest.mark.parametrize("name", VENDOR_BACKENDS)
def test_finalizers_run_by_a_collection_inside_a_cffi_parse_do_not_deadlock(name: str) -> None:
    reason = backend_skip_reason(name)
    if reason:
        pytest.skip(reason)
    try:
        result = subprocess.run(
            [sys.executable, "-c", FORCED_COLLECTION, name],
            capture_output=True, text=True, env=child_env(name), cwd=REPO_ROOT, timeout=60, check=False,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("a Stream/Event/Graph finalizer deadlocked on cffi's lock inside a garbage collection")
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert seen["locks_held"] == [True, True]  # the window was really open
    assert seen["collected"] > 0  # and the garbage was collected inside it


@pytest.mark.parametrize("name", VENDOR_BACKENDS)
def test_no_backend_call_takes_cffi_locks_after_creation(name: str, tmp_path: Path) -> None:
    """The conformance suite, with cffi's locks watched from the backend's creation on."""
    reason = backend_skip_reason(name)
    if reason:
        pytest.skip(reason)
    out = tmp_path / "locks.json"
    env = child_env(name)
    env["ACCEL_TEST_CFFI_LOCKS_OUT"] = str(out)
    env["ACCEL_TEST_BACKENDS"] = name
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.backends.cffi_locks_plugin",
         "tests/conformance"],
        capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300, check=False,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    uses = json.loads(out.read_text())
    assert not uses, f"{len(uses)} backend calls took a cffi lock; the first:\n" + textwrap.shorten(uses[0], 4000)
