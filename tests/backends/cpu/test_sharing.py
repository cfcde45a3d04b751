"""Host memory and events shared with other processes (accel/backends/cpu/_memory.py, _streams.py).

What crosses to another process is sealed files: an importer refuses a file
that its exporter could shrink under the importer's mapping (the next access
there is SIGBUS). The two-process scenarios on every backend are in
tests/allocator/test_sharing.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import accel
from accel.backends.cpu import CpuBackend, _libc

REPO_ROOT = Path(__file__).resolve().parents[3]
PAGE = _libc.PAGE


def unsealed_file(nbytes: int) -> int:
    """An anonymous file of ``nbytes`` that its maker can still shrink."""
    fd = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    return fd


def test_an_importer_refuses_memory_that_is_not_sealed_against_shrinking() -> None:
    # It mapped whatever file came: its exporter could then shrink it, and the importer's
    # next access to the buffer was SIGBUS.
    backend = CpuBackend(1, None)
    payload = json.dumps({"lead": 0, "pieces": [[0, 0, 4 * PAGE]]}).encode()
    with pytest.raises(accel.InvalidHandleError, match=r"not memory sealed against shrinking \(F_SEAL_SHRINK\)"):
        backend.ipc_memory_import(0, payload, [unsealed_file(4 * PAGE)], 4 * PAGE)
    # The same description of a sealed file of that size is mapped.
    ptr = backend.ipc_memory_import(0, payload, [_libc.memfd(4 * PAGE)], 4 * PAGE)
    backend.ipc_memory_close(0, ptr)


def test_an_importer_refuses_an_event_page_that_is_not_sealed_against_shrinking() -> None:
    backend = CpuBackend(1, None)
    exporter = str(os.getppid()).encode()  # a live process
    with pytest.raises(accel.InvalidHandleError, match="not sealed against shrinking"):
        backend.ipc_event_import(0, exporter, [unsealed_file(PAGE)])
    backend.event_destroy(0, backend.ipc_event_import(0, exporter, [_libc.shared_page()]))


def test_what_accel_shares_cannot_be_resized_or_sealed_further() -> None:
    for fd in (_libc.memfd(4 * PAGE), _libc.shared_page()):
        try:
            size = os.fstat(fd).st_size
            for attempt in (lambda: os.ftruncate(fd, 0), lambda: os.ftruncate(fd, 2 * size),
                            lambda: os.posix_fallocate(fd, 0, 2 * size),
                            lambda: fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)):
                with pytest.raises(PermissionError):
                    attempt()
            assert os.fstat(fd).st_size == size
        finally:
            os.close(fd)


WAIT_PAST_SELECTS_RANGE = """
import json, os, resource, threading
from accel.backends.cpu import CpuBackend

soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
held = [os.open("/dev/null", os.O_RDONLY)]
while held[-1] < 1100:  # every descriptor below 1100 taken: the wait's pidfd gets a larger one
    held.append(os.open("/dev/null", os.O_RDONLY))
backend = CpuBackend(1, None)
handle = backend.event_create(0, timing=False, blocking=False, interprocess=True)
event = backend._streams.event(0, handle)
# Recorded by another live process (the test's), whose completion this one polls for.
event.next_gen()
event._counts[2] = os.getppid()
threading.Timer(0.2, event.complete, (1,)).start()
try:
    event.wait(1)
    print(json.dumps("waited"))
except Exception as exc:
    print(json.dumps([type(exc).__name__, str(exc)]))
"""


def test_waiting_for_another_processs_record_works_with_descriptors_past_1023() -> None:
    # The wait asked select() whether the recorder had exited: ValueError for a
    # descriptor past 1023, which a process gets once accel raised the soft limit.
    import resource

    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("the hard limit on open files is below 1200")
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(WAIT_PAST_SELECTS_RANGE)], capture_output=True, text=True,
        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1]) == "waited"


EXPORT_WITH_A_FULL_TABLE = """
import json, os, pickle, resource, sys
import accel

objects = {"buffer": accel.memory.allocate(4096), "event": accel.Event(interprocess=True)}
objects["event"].record()
pickle.dumps(accel.memory.allocate(4096))  # the broker's own descriptors
soft = len(os.listdir("/proc/self/fd")) + 8
resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
held = []
try:
    while True:
        held.append(os.open("/dev/null", os.O_RDONLY))
except OSError:
    pass
pickle.dumps(objects[sys.argv[1]])  # its export needs a descriptor
print(json.dumps({"soft": soft, "limits": resource.getrlimit(resource.RLIMIT_NOFILE)}))
"""


@pytest.mark.parametrize("kind", ["buffer", "event"])
def test_an_export_with_a_full_descriptor_table_raises_the_soft_limit(kind: str) -> None:
    # Only new memory raised the limit: an event's export failed with EMFILE.
    result = subprocess.run(
        [sys.executable, "-c", EXPORT_WITH_A_FULL_TABLE, kind], capture_output=True, text=True, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "ACCEL_BACKEND": "cpu"}, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    reported = json.loads(result.stdout.strip().splitlines()[-1])
    soft, hard = reported["limits"]
    assert soft == hard > reported["soft"]
