"""Host physical memory (accel/backends/cpu/_memory.py): file descriptors and page release.

Each allocation and each 2 MiB chunk of expandable segments is an anonymous
file of its own: the soft limit on open files rises to the hard limit when it
is reached, and freed memory goes back to the system at once.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import accel
from accel.backends.cpu import CpuBackend
from accel.backends.cpu._memory import VM_GRANULARITY

REPO_ROOT = Path(__file__).resolve().parents[3]
G = VM_GRANULARITY

# Lower the soft descriptor limit to 64 before accel opens anything (the hard limit stays).
LOW_LIMIT = """
import resource
resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
"""


def run_json(code: str, **env: str) -> Any:
    """Run ``code`` in a fresh host-backend interpreter; return its last printed JSON line."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("ACCEL_")}
    clean.update({"ACCEL_BACKEND": "cpu", **env})
    result = subprocess.run(
        [sys.executable, "-c", LOW_LIMIT + textwrap.dedent(code)],
        capture_output=True, text=True, env=clean, cwd=REPO_ROOT, timeout=120, check=False,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def physical_files() -> int:
    """How many of accel's memory files this process has open."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(FileNotFoundError):  # the listing's own descriptor, closed by now
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:accel-host-physical")
    return count


def test_expandable_segments_raise_the_soft_descriptor_limit_when_they_reach_it() -> None:
    result = run_json(
        """
        import json, os, resource
        import accel

        first = accel.memory.allocate(2 << 20)  # well under the limit: it stays as it was
        before = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        buffers = [accel.memory.allocate(2 << 20) for _ in range(300)]  # 300 chunks, limit 64
        reserved = accel.memory.memory_stats()["reserved_bytes.all.current"]
        print(json.dumps({"reserved": reserved, "fds": len(os.listdir("/proc/self/fd")), "before": before,
                          "limits": resource.getrlimit(resource.RLIMIT_NOFILE)}))
        """,
        ACCEL_ALLOC_CONF="expandable_segments:True",
    )
    assert result["reserved"] == 301 * (2 << 20)
    assert result["fds"] > 301  # a file per chunk
    assert result["before"] == 64
    soft, hard = result["limits"]
    assert soft == hard


def test_running_out_of_descriptors_at_the_hard_limit_is_an_explained_out_of_memory_error() -> None:
    result = run_json(
        """
        import json, os, resource
        import accel
        from accel.backends.cpu import CpuBackend
        from accel.backends.cpu._memory import machine_memory

        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))  # no raising the soft limit past it
        backend = CpuBackend(1, None)
        accel.memory.memory_stats()  # load what accel imports lazily (each import opens files)
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        seen = {"source": machine_memory()[2]}
        for name, call in [("vm_create", lambda: backend.vm_create(0, 2 << 20)),
                           ("malloc", lambda: backend.free(0, backend.malloc(0, 4096))),
                           ("allocate", lambda: accel.memory.allocate(4096))]:
            try:
                call()
                seen[name] = "no error"
            except Exception as exc:
                seen[name] = [type(exc).__name__, str(exc)]
        seen["retries"] = accel.memory.memory_stats()["num_alloc_retries"]
        print(json.dumps(seen))
        """,
        ACCEL_ALLOC_CONF="expandable_segments:True",
    )
    # Reading the machine's memory needs no descriptor.
    assert result["source"].startswith("sysinfo")
    # Device memory, plain or physical for expandable segments, needs a file each.
    for name in ("vm_create", "malloc", "allocate"):
        kind, message = result[name]
        assert kind == "OutOfMemoryError", (name, kind, message)
        assert "no free file descriptor" in message and "ulimit -n" in message, message
        assert "the limit is 64" in message and "hard limit" in message, message
    assert result["retries"] == 1  # the caching allocator flushed its cache and tried again


def test_a_full_descriptor_table_under_a_raisable_limit_is_no_error() -> None:
    result = run_json(
        """
        import json, os, resource
        from accel.backends.cpu import CpuBackend

        backend = CpuBackend(1, None)
        held = []
        try:
            while True:
                held.append(os.open("/dev/null", os.O_RDONLY))
        except OSError:
            pass
        ptr = backend.malloc(0, 4096)
        backend.free(0, ptr)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        print(json.dumps({"open": len(held), "raised": soft == hard}))
        """,
    )
    assert result["open"] > 32 and result["raised"]


def test_released_chunks_give_their_pages_back() -> None:
    backend = CpuBackend(1, None)
    baseline = physical_files()
    base = backend.vm_reserve(0, 3 * G)
    chunks = [backend.vm_create(0, G) for _ in range(3)]
    for i, chunk in enumerate(chunks):
        backend.vm_map(0, base + i * G, G, chunk)
    ctypes.memset(base, 0x11, 3 * G)
    assert physical_files() == baseline + 3
    # Released while mapped: the pages stay (as with cuMemRelease) until the range is unmapped.
    backend.vm_release(0, chunks[1])
    assert ctypes.string_at(base + G, 4) == b"\x11" * 4
    # Another descriptor of the file (a forked child's, an importer's) does not keep its pages.
    other = os.dup(backend._memory[0]._physical[chunks[1]].fd)
    try:
        assert os.fstat(other).st_blocks * 512 == G
        backend.vm_unmap(0, base + G, G)
        assert os.fstat(other).st_blocks == 0
    finally:
        os.close(other)
    assert physical_files() == baseline + 2
    # The next chunk starts as fresh pages.
    again = backend.vm_create(0, G)
    backend.vm_map(0, base + G, G, again)
    assert ctypes.string_at(base + G, 4) == b"\0" * 4
    backend.vm_unmap(0, base, 3 * G)
    for chunk in (chunks[0], again, chunks[2]):
        backend.vm_release(0, chunk)
    assert physical_files() == baseline
    backend.vm_free(0, base, 3 * G)


def test_freed_allocations_give_their_pages_back_and_their_file_closes() -> None:
    backend = CpuBackend(1, None)
    baseline = physical_files()
    ptr = backend.malloc(0, G)
    ctypes.memset(ptr, 0x22, G)
    assert physical_files() == baseline + 1
    other = os.dup(backend._memory[0]._files[ptr][0])  # as a forked child inherits it
    try:
        backend.free(0, ptr)
        assert os.fstat(other).st_blocks == 0
    finally:
        os.close(other)
    assert physical_files() == baseline


def test_a_released_handle_is_refused_even_while_still_mapped() -> None:
    backend = CpuBackend(1, None)
    base = backend.vm_reserve(0, 2 * G)
    chunk = backend.vm_create(0, G)
    backend.vm_map(0, base, G, chunk)
    backend.vm_release(0, chunk)
    try:
        for call in (lambda: backend.vm_map(0, base + G, G, chunk), lambda: backend.vm_release(0, chunk)):
            try:
                call()
            except accel.InvalidHandleError as exc:
                assert "not a live physical memory handle" in str(exc)
            else:
                raise AssertionError("a released handle was accepted")
    finally:
        backend.vm_unmap(0, base, G)
        backend.vm_free(0, base, 2 * G)


def test_a_forked_child_never_frees_or_reuses_the_parents_physical_memory() -> None:
    result = run_json(
        """
        import ctypes, json, os
        from accel.backends.cpu import CpuBackend

        G = 2 << 20
        backend = CpuBackend(1, None)
        base = backend.vm_reserve(0, 2 * G)
        ours = backend.vm_create(0, G)
        backend.vm_map(0, base, G, ours)
        ctypes.memset(base, 0xAA, G)
        plain = backend.malloc(0, G)
        ctypes.memset(plain, 0xCC, G)
        pid = os.fork()
        if pid == 0:  # the child lets go of the inherited memory and makes some of its own
            code = 1
            try:
                backend.free(0, plain)
                backend.vm_unmap(0, base, G)
                backend.vm_release(0, ours)
                theirs = backend.vm_create(0, G)
                backend.vm_map(0, base + G, G, theirs)
                ctypes.memset(base + G, 0xBB, G)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        second = backend.vm_create(0, G)  # must not be the range the child used
        backend.vm_map(0, base + G, G, second)
        print(json.dumps({
            "child": os.waitstatus_to_exitcode(status),
            "ours_intact": ctypes.string_at(base, 4) == b"\\xaa" * 4 and ctypes.string_at(base + G - 4, 4) == b"\\xaa" * 4,
            "plain_intact": ctypes.string_at(plain, 4) == b"\\xcc" * 4 and ctypes.string_at(plain + G - 4, 4) == b"\\xcc" * 4,
            "second_fresh": ctypes.string_at(base + G, 4) == b"\\0" * 4,
        }))
        """,
    )
    # Before: the child's release truncated the shared file under the parent's chunk,
    # and its new chunk took the range the parent then handed out again.
    assert result == {"child": 0, "ours_intact": True, "plain_intact": True, "second_fresh": True}


def test_an_interrupted_system_call_gives_its_charge_back(monkeypatch) -> None:
    # Ctrl-C inside the allocation's or the physical chunk's system call: the bytes
    # charged against the capacity go back, or each interrupt shrinks the device.
    from accel.backends.cpu import _libc

    memory = CpuBackend(1, None)._memory[0]

    def interrupted(*args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(_libc, "memfd", interrupted)
    for allocate in (memory.malloc, memory.create):
        with contextlib.suppress(KeyboardInterrupt):
            allocate(G)
        assert memory._held == 0
