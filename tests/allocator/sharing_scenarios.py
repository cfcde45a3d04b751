"""Two-process scenarios for tests/allocator/test_sharing.py.

Each ``scenario_*`` runs in a fresh exporting interpreter (``python -m
tests.allocator.sharing_scenarios NAME``, on the backend ``ACCEL_BACKEND``
names) and starts importers with multiprocessing's spawn start method; it
prints one JSON line of what it saw. Importer functions live at module level
so that spawned children can import them.
"""

from __future__ import annotations

import ctypes
import json
import multiprocessing as mp
import os
import pickle
import sys
import time
from collections.abc import Callable
from typing import Any

import accel
from accel.backends._sharing import broker

SIZE = 1 << 20
TIMEOUT_S = 60


def host_bytes(buf: accel.memory.Buffer, nbytes: int = 16) -> bytes:
    """The first ``nbytes`` of device buffer ``buf``, copied to the host in stream order."""
    stream = accel.current_stream(buf.device)
    with accel.memory.allocate_host(nbytes) as staging:
        stream.copy(staging, buf, nbytes)
        stream.synchronize()
        return ctypes.string_at(staging.ptr, nbytes)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def allocated() -> int:
    return int(accel.memory.memory_stats()["allocated_bytes.all.current"])


def filled(value: int) -> accel.memory.Buffer:
    """A new buffer of SIZE bytes of ``value``, the fill done before it returns."""
    buf = accel.memory.allocate(SIZE)
    accel.current_stream().fill(buf, value, SIZE)
    accel.current_stream().synchronize()
    return buf


def start_importer(target: Callable[[Any, Any], None]) -> tuple[Any, Any, Any]:
    """A spawned importer running ``target(queue, replies)``: the process, ``queue``
    (what the exporter sends) and ``replies`` (what the importer answers)."""
    ctx = mp.get_context("spawn")
    queue, replies = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=target, args=(queue, replies))
    child.start()
    return child, queue, replies


def importer_replies(count: int, target: Callable[..., None], *args: Any) -> tuple[list[Any], int | None]:
    """Run ``target(*args, replies)`` in a spawned importer and take up to ``count``
    replies, one at a time: where none comes (the importer crashed, or failed: its
    stderr says why) ``["no answer"]`` is the last. The replies and its exit code."""
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, replies))
    child.start()
    results: list[Any] = []
    for _ in range(count):
        try:
            results.append(replies.get(timeout=TIMEOUT_S))
        except Exception:  # noqa: BLE001 - the child died or failed: the rest is missing
            results.append(["no answer"])
            break
    child.join(TIMEOUT_S)
    return results, child.exitcode


def wait_released(timeout: float = TIMEOUT_S) -> None:
    """Wait until no importer holds an export and nothing is allocated, or ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while (broker().stats()["holds"] or allocated()) and time.monotonic() < deadline:
        time.sleep(0.01)


# -- a buffer and an event through a Queue; each process writes, the other reads --


def _reader(queue: Any, replies: Any) -> None:
    buf, event = queue.get(timeout=TIMEOUT_S)
    stream = accel.Stream(buf.device)
    event.wait(stream)  # orders the copy below after the exporter's fill
    with accel.memory.allocate_host(16) as staging:
        stream.copy(staging, buf, 16)
        stream.synchronize()
        seen = ctypes.string_at(staging.ptr, 16)
    replies.put({"seen": seen.hex(), "is_buffer": isinstance(buf, accel.memory.Buffer), "nbytes": buf.nbytes})
    accel.current_stream(buf.device).fill(buf, 0x22, 16)
    accel.current_stream(buf.device).synchronize()
    buf.free()
    replies.put("written")


def scenario_queue() -> dict[str, Any]:
    child, queue, replies = start_importer(_reader)
    stream = accel.Stream()
    buf = accel.memory.allocate(SIZE, stream=stream)
    stream.fill(buf, 0, SIZE)
    stream.synchronize()
    event = accel.Event(interprocess=True)
    gate = mp.get_context("spawn").Event()  # holds this stream back until the importer has queued its wait
    stream.launch_host_func(lambda: gate.wait(TIMEOUT_S))
    stream.fill(buf, 0x11, SIZE)
    event.record(stream)
    queue.put((buf, event))
    time.sleep(0.5)  # the importer opens both and queues its wait while the fill is held back
    gate.set()
    reply = replies.get(timeout=TIMEOUT_S)
    written = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {**reply, "written": written, "after": host_bytes(buf).hex(), "exitcode": child.exitcode}


# -- the importer records the event; the exporter's work waits for it ------------------


def _recorder(queue: Any, replies: Any) -> None:
    buf, event = queue.get(timeout=TIMEOUT_S)
    stream = accel.Stream(buf.device)
    stream.launch_host_func(lambda: time.sleep(0.5))  # the exporter queues its wait meanwhile
    stream.fill(buf, 0x44, 16)
    event.record(stream)
    replies.put("recorded")
    stream.synchronize()
    queue.get(timeout=TIMEOUT_S)  # the exporter read the buffer
    buf.free()


def scenario_importer_records() -> dict[str, Any]:
    child, queue, replies = start_importer(_recorder)
    buf = accel.memory.allocate(SIZE)
    accel.current_stream().fill(buf, 0, SIZE)
    event = accel.Event(interprocess=True)
    event.record()
    event.synchronize()
    queue.put((buf, event))
    recorded = replies.get(timeout=TIMEOUT_S)
    stream = accel.Stream()
    event.wait(stream)  # orders the copy below after the importer's fill
    with accel.memory.allocate_host(16) as staging:
        stream.copy(staging, buf, 16)
        stream.synchronize()
        seen = ctypes.string_at(staging.ptr, 16)
    event.synchronize()
    queue.put("read")
    child.join(TIMEOUT_S)
    return {"recorded": recorded, "seen": seen.hex(), "done": event.query(), "exitcode": child.exitcode}


# -- the importer is killed while it holds the buffer ---------------------------------


def _holder(queue: Any, replies: Any) -> None:
    queue.get(timeout=TIMEOUT_S)  # the warm-up
    buf = queue.get(timeout=TIMEOUT_S)
    replies.put(host_bytes(buf).hex())
    queue.get(timeout=TIMEOUT_S)  # the exporter freed its buffer and allocated and filled another
    replies.put(host_bytes(buf).hex())
    time.sleep(3600)  # killed here, still holding the buffer


def scenario_kill_importer() -> dict[str, Any]:
    child, queue, replies = start_importer(_holder)
    # Not leaks: the queue's feeder thread and pipe, the broker's socket and
    # selector, the device's memory file (created on first allocation).
    queue.put("warm-up")
    broker()
    accel.memory.allocate(SIZE).free()
    baseline_fds = open_fds()
    buf = filled(0x33)
    queue.put(buf)
    seen = replies.get(timeout=TIMEOUT_S)
    held = broker().stats()
    ptr = buf.ptr
    buf.free()  # the importer still maps it: the block must not be reused
    accel.memory.empty_cache()  # nor its memory given back (expandable segments: unmapped)
    again = filled(0x55)
    reused_while_held = again.ptr == ptr
    allocated_while_held = allocated()
    queue.put("look again")
    seen_again = replies.get(timeout=TIMEOUT_S)  # the importer's view of what it holds
    again.free()
    child.kill()
    child.join(TIMEOUT_S)
    wait_released()
    after = broker().stats()
    return {
        "seen": seen,
        "seen_again": seen_again,
        "held": held,
        "reused_while_held": reused_while_held,
        "allocated_while_held": allocated_while_held,
        "after": after,
        "allocated_after": allocated(),
        "fds_leaked": open_fds() - baseline_fds,
    }


# -- the importer frees its buffer: the hold ends -------------------------------------


def _releaser(buf: accel.memory.Buffer, replies: Any) -> None:
    buf.free()
    replies.put("freed")


def scenario_importer_frees() -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    buf = accel.memory.allocate(SIZE)
    child = ctx.Process(target=_releaser, args=(buf, replies))
    child.start()
    replies.get(timeout=TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    while broker().stats()["holds"] and time.monotonic() < deadline:
        time.sleep(0.01)
    holds = broker().stats()["holds"]
    child.join(TIMEOUT_S)
    buf.free()
    return {"holds": holds, "allocated_after": allocated(), "exitcode": child.exitcode}


# -- opening an export after the exporter let go of it -----------------------------


def _opener(data: bytes, replies: Any) -> None:
    try:
        pickle.loads(data)
        replies.put("opened")
    except accel.AccelError as exc:
        replies.put([type(exc).__name__, str(exc)])


def scenario_freed_before_open() -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    buf = accel.memory.allocate(SIZE)
    data = pickle.dumps(buf)
    buf.free()
    child = ctx.Process(target=_opener, args=(data, replies))
    child.start()
    result = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {"result": result, "exports": broker().stats()["exports"]}


def scenario_importer_on_the_default_loader() -> dict[str, Any]:
    """The exporter's loader (ACCEL_ZE_LOADER) exports physical memory; its importer uses the
    default loader (Debian's 1.8.12, with the simulated driver), which cannot import it."""
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    buf = accel.memory.allocate(SIZE)
    data = pickle.dumps(buf)
    newer = os.environ.pop("ACCEL_ZE_LOADER")  # spawn passes os.environ as it is at start
    try:
        child = ctx.Process(target=_opener, args=(data, replies))
        child.start()
    finally:
        os.environ["ACCEL_ZE_LOADER"] = newer
    result = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S
    while broker().stats()["holds"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return {"result": result, "exitcode": child.exitcode, "holds": broker().stats()["holds"]}


def scenario_print_pickle() -> dict[str, Any]:
    """Print a pickled buffer and event and the address of their broker, then exit:
    their exporter is gone once read."""
    buf = accel.memory.allocate(SIZE)
    event = accel.Event(interprocess=True)
    event.record()
    return {"buffer": pickle.dumps(buf).hex(), "event": pickle.dumps(event).hex(), "address": broker().address.hex()}


def scenario_open_pickles() -> dict[str, Any]:
    """Open the pickles given on stdin (from scenario_print_pickle, whose process has exited)."""
    given = json.loads(sys.stdin.read())
    out = {}
    for name in ("buffer", "event"):
        try:
            pickle.loads(bytes.fromhex(given[name]))
            out[name] = "opened"
        except accel.AccelError as exc:
            out[name] = [type(exc).__name__, str(exc)]
    return out


# -- pickles that lie, and pickling again --


def _open_claiming(ticket_args: Any, nbytes: int, replies: Any) -> None:
    from accel.allocator._sharing import open_buffer

    ticket, backend_name, device, uuid, _ = ticket_args
    try:
        buf = open_buffer(ticket, backend_name, device, uuid, nbytes)
        replies.put(["opened", buf.nbytes])
    except accel.AccelError as exc:
        replies.put([type(exc).__name__, str(exc)])


def scenario_forged_size() -> dict[str, Any]:
    """A pickle whose size claims more than the export: the importer must not map past it."""
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    buf = accel.memory.allocate(SIZE)
    _, args = buf.__reduce__()
    child = ctx.Process(target=_open_claiming, args=(args, 1 << 40, replies))
    child.start()
    result = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {"result": result, "exitcode": child.exitcode, "holds": broker().stats()["holds"]}


def _open_and_report(data: bytes, replies: Any) -> None:
    buf, event = pickle.loads(data)
    event.synchronize()
    replies.put(host_bytes(buf, 4).hex())


def scenario_repickle() -> dict[str, Any]:
    """Pickling one buffer and one event many times keeps one export of each."""
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    buf = accel.memory.allocate(SIZE)
    accel.current_stream().fill(buf, 0x44, SIZE)
    event = accel.Event(interprocess=True)
    event.record()
    pickle.dumps((buf, event))
    before = open_fds()
    for _ in range(50):
        data = pickle.dumps((buf, event))
    grown = open_fds() - before
    child = ctx.Process(target=_open_and_report, args=(data, replies))
    child.start()
    seen = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {"fds_grown": grown, "exports": broker().stats()["exports"], "seen": seen, "exitcode": child.exitcode}


def _open_swapped(swapped: list[Any], replies: Any) -> None:
    out = []
    for fn, args in swapped:
        try:
            fn(*args)
            out.append(["opened", ""])
        except accel.AccelError as exc:
            out.append([type(exc).__name__, str(exc)])
    replies.put(out)


def scenario_swapped_tickets() -> dict[str, Any]:
    """A buffer's pickle naming an event's export, and an event's naming a buffer's."""
    from accel.allocator._sharing import open_buffer
    from accel.stream._event import _open_event

    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    buf = accel.memory.allocate(SIZE)
    event = accel.Event(interprocess=True)
    event.record()
    _, buffer_args = buf.__reduce__()
    _, event_args = event.__reduce__()
    swapped = [(open_buffer, (event_args[0], *buffer_args[1:])), (_open_event, (buffer_args[0], *event_args[1:]))]
    child = ctx.Process(target=_open_swapped, args=(swapped, replies))
    child.start()
    result = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {"result": result, "exitcode": child.exitcode, "holds": broker().stats()["holds"]}


def scenario_short_description() -> dict[str, Any]:
    """A broker of the same user that answers a buffer's ticket with a description
    too short to hold the exported size."""
    from accel.backends._sharing import export_origin

    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    backend = accel.current_accelerator().type
    uuid = accel.get_device_properties(0).uuid
    kept = object()

    def target() -> object:
        return kept

    ticket = broker().offer("buffer", export_origin(backend, 0, uuid), b"xx", [], target, hold=True)
    child = ctx.Process(target=_open_claiming, args=((ticket, backend, 0, uuid, None), 2, replies))
    child.start()
    result = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {"result": result, "exitcode": child.exitcode, "holds": broker().stats()["holds"]}


def scenario_forged_device() -> dict[str, Any]:
    """A buffer's and an event's pickle made on device 0, edited to claim device 1
    (with device 1's UUID, so that the importer's own device check passes)."""
    from accel.allocator._sharing import open_buffer
    from accel.stream._event import _open_event

    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    buf = accel.memory.allocate(SIZE, device=0)
    event = accel.Event(interprocess=True)
    event.record(accel.current_stream(0))
    _, (ticket, backend_name, _, _, nbytes) = buf.__reduce__()
    _, (event_ticket, *_) = event.__reduce__()
    other = accel.get_device_properties(1).uuid
    forged = [
        (open_buffer, (ticket, backend_name, 1, other, nbytes)),
        (_open_event, (event_ticket, backend_name, 1, other)),
    ]
    child = ctx.Process(target=_open_swapped, args=(forged, replies))
    child.start()
    result = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {"result": result, "exitcode": child.exitcode, "holds": broker().stats()["holds"]}


def scenario_fd_limit() -> dict[str, Any]:
    """Export distinct buffers and events until the descriptor table is full."""
    import resource

    kept = [accel.memory.allocate(4096), accel.Event(interprocess=True)]
    kept[1].record()
    pickle.dumps(kept)  # the broker and the backend's first-use descriptors
    limit = open_fds() + 16
    # The hard limit too: the host backend raises a full soft limit to the hard one.
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    failure = None
    try:
        for _ in range(64):
            buf, event = accel.memory.allocate(4096), accel.Event(interprocess=True)
            event.record()
            kept += [buf, event]
            pickle.dumps((buf, event))
    except Exception as exc:  # noqa: BLE001 - what escapes is what the test checks
        failure = [type(exc).__module__, type(exc).__name__, str(exc)]
    return {"failure": failure}



def unsealed(fd: int) -> int:
    """A copy of file ``fd`` (closed) that its maker could still shrink under an importer."""
    size = os.fstat(fd).st_size
    copy = os.memfd_create("unsealed", os.MFD_CLOEXEC)
    os.ftruncate(copy, size)
    os.pwrite(copy, os.pread(fd, size, 0), 0)
    os.close(fd)
    return copy


def pipe() -> int:
    """The read end of a pipe whose write end is closed: a descriptor that is not memory."""
    read_end, write_end = os.pipe()
    os.close(write_end)
    return read_end


def _open_each(opens: list[Any], replies: Any) -> None:
    """Open each forged export, read the whole buffer it claims, free it; report one by one
    (a crash shows as the first missing reply)."""
    from accel.allocator._sharing import open_buffer

    for args in opens:
        before = open_fds()
        try:
            buf = open_buffer(*args)
            with accel.memory.allocate_host(buf.nbytes) as staging:
                accel.current_stream().copy(staging, buf, buf.nbytes)
                accel.current_stream().synchronize()
                seen = set(ctypes.string_at(staging.ptr, buf.nbytes))
            buf.free()
            result = ["opened", sorted(seen)]
        except Exception as exc:  # noqa: BLE001 - what escapes is what the test checks
            result = [type(exc).__module__, type(exc).__name__, str(exc)]
        replies.put([*result, open_fds() - before])


def scenario_forged_descriptions() -> dict[str, Any]:
    """A broker of the same user answering with damaged descriptions of a real buffer's
    memory: each field of the backend's description edited, descriptors that are not
    the memory (a pipe) or missing, a size larger than described."""
    import struct

    from accel._runtime import get_runtime
    from accel.backends._sharing import export_origin

    backend = get_runtime().backend
    uuid = backend.device_properties(0).uuid
    stream = accel.current_stream()
    buf = accel.memory.allocate(SIZE)
    stream.fill(buf, 0x55, SIZE)
    stream.synchronize()
    payload, fds = backend.ipc_memory_export(0, buf.ptr, SIZE)
    for fd in fds:
        os.close(fd)
    layout = json.loads(payload)
    def real() -> tuple[bytes, list[int]]:
        return backend.ipc_memory_export(0, buf.ptr, SIZE)

    forged: dict[str, Any] = {
        "not json": lambda: (b"not json", real()[1]),
        "a list": lambda: (b"[1, 2]", real()[1]),
        "nested past the recursion limit": lambda: (b"[" * 100_000, real()[1]),  # RecursionError escaped
        "no descriptors": lambda: (real()[0], []),
        "no descriptors, no chunks": lambda: (json.dumps({**layout, "sizes": [], "pieces": []}).encode(), []),
        "pipes": lambda: (lambda p, f: (p, [pipe() for _ in f] or [pipe()]))(*real()),
        "an extra descriptor": lambda: (lambda p, f: (p, [*f, pipe()]))(*real()),
        "unsealed copies": lambda: (lambda p, f: (p, [unsealed(fd) for fd in f]))(*real()),
        "larger than described": "larger",
    }
    for key, value in layout.items():
        if isinstance(value, int):
            for name, edited in (("huge", 1 << 40), ("negative", -4096), ("text", "x"), ("true", True)):
                forged[f"{key} {name}"] = (key, edited)
        elif isinstance(value, list):
            forged[f"{key} empty"] = (key, [])
            forged[f"{key} twice"] = (key, value + value)
            forged[f"{key} nested"] = (key, [value])
            if key == "pieces":  # the host backend's (file, offset, length) ranges
                forged["pieces past the file"] = (key, [[0, 1 << 40, value[0][2]]])
                forged["pieces of a missing file"] = (key, [[7, 0, value[0][2]]])
                forged["pieces unaligned"] = (key, [[0, 1, value[0][2]]])
            else:
                forged[f"{key} halved"] = (key, [n // 2 for n in value])
    kept = object()
    opens, names = [], []
    for name, how in forged.items():
        claimed = SIZE
        if how == "larger":
            (description, descriptors), claimed = real(), 4 * SIZE
        elif isinstance(how, tuple):
            description, descriptors = json.dumps({**layout, how[0]: how[1]}).encode(), real()[1]
        else:
            description, descriptors = how()
        ticket = broker().offer(
            "buffer", export_origin(backend.name, 0, uuid), struct.pack("!Q", claimed) + description,
            descriptors, lambda: kept, hold=True,
        )
        opens.append((ticket, backend.name, 0, uuid, claimed))
        names.append(name)
    results, exitcode = importer_replies(len(names), _open_each, opens)
    return {"results": dict(zip(names, results)), "exitcode": exitcode, "holds": broker().stats()["holds"]}



# -- what the descriptors an importer is handed reach -------------------------------------

SECRET_BEFORE, SECRET_AFTER = 0xA5, 0x5A


def _handed(kind: str, args: Any) -> list[int]:
    """The descriptors an export of ``kind`` hands over, taken as any process of the user
    could take them (the pickle's ticket; no accel backend call); the hold is let go."""
    from accel.backends._sharing import export_origin, open_export

    ticket, name, device, uuid = args[:4]
    _, fds, held = open_export(ticket, kind, export_origin(name, device, uuid), f"the test's {kind}")
    held.release()
    return fds


def _reach(args: Any, replies: Any) -> None:
    import mmap

    sizes, secrets = [], []
    for fd in _handed("buffer", args):
        size = os.fstat(fd).st_size
        sizes.append(size)
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ) as whole:
            secrets += [hex(b) for b in (SECRET_BEFORE, SECRET_AFTER) if whole.find(bytes([b])) >= 0]
        os.close(fd)
    replies.put({"sizes": sizes, "secrets": secrets})


def scenario_reach() -> dict[str, Any]:
    """A 4 KiB buffer exported between allocations made before and after its export: the
    importer maps whole every file it is handed, looking for the others' bytes."""
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    stream = accel.current_stream()
    before = [accel.memory.allocate(4 << 20) for _ in range(2)]
    for buf in before:
        stream.fill(buf, SECRET_BEFORE, buf.nbytes)
    small = accel.memory.allocate(4096)
    stream.fill(small, 0x11, small.nbytes)
    _, args = small.__reduce__()  # the export
    after = [accel.memory.allocate(4 << 20) for _ in range(2)]
    for buf in after:
        stream.fill(buf, SECRET_AFTER, buf.nbytes)
    stream.synchronize()
    child = ctx.Process(target=_reach, args=(args, replies))
    child.start()
    result = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {**result, "exitcode": child.exitcode}


def _resize(exports: list[Any], replies: Any) -> None:
    """Try to grow (ftruncate, fallocate) then shrink to nothing every descriptor handed over."""
    import errno

    outcomes = []
    for kind, args in exports:
        for fd in _handed(kind, args):
            size = os.fstat(fd).st_size
            for name, attempt in (("ftruncate up", lambda: os.ftruncate(fd, size + (1 << 20))),
                                  ("fallocate up", lambda: os.posix_fallocate(fd, size, 1 << 20)),
                                  ("ftruncate to 0", lambda: os.ftruncate(fd, 0))):
                try:
                    attempt()
                    outcome = "done"
                except OSError as exc:
                    outcome = errno.errorcode.get(exc.errno or 0, str(exc))
                outcomes.append([kind, name, outcome])
            os.close(fd)
    replies.put(outcomes)


def scenario_importer_resizes() -> dict[str, Any]:
    """An importer resizes what it was handed of a buffer and an event; then the exporter
    writes the whole buffer and records the event (SIGBUS here if the files shrank)."""
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    stream = accel.current_stream()
    buf = accel.memory.allocate(SIZE)
    stream.fill(buf, 0x11, SIZE)
    event = accel.Event(interprocess=True)
    event.record(stream)
    stream.synchronize()
    exports = [("buffer", buf.__reduce__()[1]), ("event", event.__reduce__()[1])]
    child = ctx.Process(target=_resize, args=(exports, replies))
    child.start()
    outcomes = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    stream.fill(buf, 0x22, SIZE)
    event.record(stream)
    event.synchronize()
    with accel.memory.allocate_host(SIZE) as staging:
        stream.copy(staging, buf, SIZE)
        stream.synchronize()
        seen = sorted(set(ctypes.string_at(staging.ptr, SIZE)))
    return {"outcomes": outcomes, "seen": seen, "exitcode": child.exitcode}


LARGE = 600 << 20  # with expandable segments, some 300 chunks: one descriptor each


def _read_ends(args: Any, replies: Any) -> None:
    """Open a buffer and send back its first and last 16 bytes."""
    from accel.allocator._sharing import open_buffer

    buf = open_buffer(*args)
    stream = accel.current_stream(buf.device)
    with accel.memory.allocate_host(16) as staging:
        stream.copy(staging, buf.ptr + buf.nbytes - 16, 16)
        stream.synchronize()
        last = ctypes.string_at(staging.ptr, 16)
    replies.put([host_bytes(buf).hex(), last.hex()])
    buf.free()


def scenario_large_buffer() -> dict[str, Any]:
    """A 600 MiB buffer: with expandable segments more descriptors than one message carries."""
    stream = accel.current_stream()
    buf = accel.memory.allocate(LARGE)
    stream.fill(buf, 0x11, 16)
    stream.fill(buf.ptr + LARGE - 16, 0x22, 16)
    stream.synchronize()
    (ends,), exitcode = importer_replies(1, _read_ends, buf.__reduce__()[1])
    return {"ends": ends, "exitcode": exitcode}


def _maps(memfd: bool = False) -> int:
    """This process's mappings (only those of memory files, where every backend maps
    imported memory, with ``memfd``)."""
    with open("/proc/self/maps", "rb") as maps:
        return sum(not memfd or b"memfd:" in line for line in maps)


def _open_with_few_mappings_left(args: Any, replies: Any) -> None:
    """Use up this process's mappings (vm.max_map_count) but a few, then open a buffer of
    many chunks: what it raises, and the mappings and descriptors left after."""
    from accel.allocator._sharing import open_buffer

    accel.current_stream().synchronize()  # the backend and its threads are up
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    with open("/proc/sys/vm/max_map_count") as limit_file:
        limit = int(limit_file.read())
    pages = limit - _maps() - 80  # room for 80 more: fewer than the buffer's chunks and what runs beside
    base = libc.mmap(None, pages * 4096, 3, 0x22 | 0x4000, -1, 0)  # read-write, private anonymous, no reserve
    for page in range(1, pages, 2):  # every other page read-only: a mapping each
        libc.mprotect(base + page * 4096, 4096, 1)
    before = [_maps(memfd=True), open_fds()]
    try:
        open_buffer(*args)
        outcome = ["opened"]
    except Exception as exc:  # noqa: BLE001 - what escapes is what the test checks
        outcome = [type(exc).__name__, str(exc)]
    after = [_maps(memfd=True), open_fds()]
    libc.munmap(base, pages * 4096)
    replies.put([*outcome, before, after])


def scenario_few_mappings_left() -> dict[str, Any]:
    """A 600 MiB buffer (some 300 chunks with expandable segments) opened by a process
    with 80 mappings left."""
    buf = accel.memory.allocate(LARGE)
    (result,), exitcode = importer_replies(1, _open_with_few_mappings_left, buf.__reduce__()[1])
    return {"result": result, "exitcode": exitcode, "holds": broker().stats()["holds"]}


def _drop_resource_capabilities() -> None:
    """Drop CAP_SYS_ADMIN and CAP_SYS_RESOURCE from this process: root keeps its uid (and
    its files) but, like any user, has its descriptors in flight counted against its
    open-file limit (the kernel exempts those capabilities)."""
    libc = ctypes.CDLL(None, use_errno=True)
    header = (ctypes.c_uint32 * 2)(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3, this process
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable; twice (64 bits)
    if libc.capget(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capget")
    for bit in (21, 24):  # CAP_SYS_ADMIN, CAP_SYS_RESOURCE
        data[0] &= ~(1 << bit)
        data[1] &= ~(1 << bit)
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset")


def scenario_in_flight_under_a_low_limit() -> dict[str, Any]:
    """A 600 MiB buffer (some 300 chunks with expandable segments) exported under an
    open-file limit of 1024, answered to four connections that read only once all four
    were answered (importers slower than the broker): how many descriptors each got."""
    import resource
    import socket

    from accel.backends import _sharing

    _drop_resource_capabilities()  # capabilities are per thread: before the broker's starts
    buf = accel.memory.allocate(LARGE)
    ticket = buf.__reduce__()[1][0]
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))
    conns = []
    for _ in range(4):
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.settimeout(TIMEOUT_S)
        conn.connect(ticket.address)
        conn.sendall(ticket.token.encode())
        conns.append(conn)
    time.sleep(1)  # the broker answers all four before any reads
    got: list[Any] = []
    for conn in conns:
        fds: list[int] = []
        try:
            _sharing._receive_answer(conn, fds, ticket, "it")
            got.append(len(fds))
        except accel.AccelError as exc:
            got.append(str(exc))
        for fd in fds:
            os.close(fd)
        conn.close()
    return {"got": got, "fds": ticket.fds}


def _pickle_again(data: bytes, replies: Any) -> None:
    event = pickle.loads(data)
    try:
        pickle.dumps(event)
        replies.put(["pickled"])
    except Exception as exc:  # noqa: BLE001 - what escapes is what the test checks
        replies.put([type(exc).__module__, type(exc).__name__, str(exc)])


def scenario_opened_event_pickled_again() -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    event = accel.Event(interprocess=True)
    event.record()
    child = ctx.Process(target=_pickle_again, args=(pickle.dumps(event), replies))
    child.start()
    result = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {"result": result, "exitcode": child.exitcode, "pid": os.getpid()}



def _open_events(opens: list[Any], replies: Any) -> None:
    from accel.stream._event import _open_event

    for args in opens:
        before = open_fds()
        try:
            event = _open_event(*args)
            event.synchronize()
            event.close()
            result = ["opened"]
        except Exception as exc:  # noqa: BLE001 - what escapes is what the test checks
            result = [type(exc).__module__, type(exc).__name__, str(exc)]
        replies.put([*result, open_fds() - before])


def scenario_forged_event_descriptions() -> dict[str, Any]:
    """A broker of the same user answering an event's ticket with a damaged description."""
    from accel._runtime import get_runtime
    from accel.backends._sharing import export_origin

    backend = get_runtime().backend
    uuid = backend.device_properties(0).uuid
    event = accel.Event(interprocess=True)
    event.record()
    handle = event._ensure(0)

    def real() -> tuple[bytes, list[int]]:
        return backend.ipc_event_export(0, handle)
    forged = {
        "empty": lambda: (b"", real()[1]),
        "garbage": lambda: (b"garbage!" * 3, real()[1]),
        "no descriptors": lambda: (real()[0], []),
        "a pipe": lambda: (lambda p, f: (p, [pipe() for _ in f] or [pipe()]))(*real()),
        "an extra descriptor": lambda: (lambda p, f: (p, [*f, pipe()]))(*real()),
        "an unsealed copy": lambda: (lambda p, f: (p, [unsealed(fd) for fd in f]))(*real()),
        "zeros": lambda: (bytes(len(real()[0])), real()[1]),
    }
    if len(real()[0]) > 8:  # a binary handle (the host backend's is the exporter's pid in digits)
        forged["truncated"] = lambda: (real()[0][:5], real()[1])
    opens, names = [], []
    for name, how in forged.items():
        description, descriptors = how()
        ticket = broker().offer("event", export_origin(backend.name, 0, uuid), description, descriptors,
                                lambda: event, hold=False)
        opens.append((ticket, backend.name, 0, uuid))
        names.append(name)
    results, exitcode = importer_replies(len(names), _open_events, opens)
    return {"results": dict(zip(names, results)), "exitcode": exitcode}



def _misbehaving_broker(mode: str, replies: Any) -> None:
    """Answer every connection with descriptors and a header, then stall: ``huge``
    announces a 4 GiB answer, ``stall`` a 100-byte one it never finishes."""
    import socket
    import struct

    address = f"\0accel-test-stall-{os.getpid()}".encode()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(4)
    replies.put(address)
    kept = []
    while True:
        conn, _ = listener.accept()
        conn.recv(32)
        read_end, write_end = os.pipe()
        length = 0xFFFFFFF0 if mode == "huge" else 100
        socket.send_fds(conn, [struct.pack("!cII", b"K", length, 1) + b"abc"], [read_end])
        os.close(read_end)
        os.close(write_end)
        kept.append(conn)


def scenario_stalled_answers() -> dict[str, Any]:
    """Open a buffer from a process that sends part of an answer and stops."""
    import accel.backends._sharing as sharing
    from accel._runtime import get_runtime
    from accel.allocator._sharing import open_buffer

    sharing._ANSWER_TIMEOUT_S = 2.0
    ctx = mp.get_context("spawn")
    backend = get_runtime().backend
    uuid = backend.device_properties(0).uuid
    results = {}
    for mode in ("huge", "stall"):
        replies = ctx.Queue()
        server = ctx.Process(target=_misbehaving_broker, args=(mode, replies), daemon=True)
        server.start()
        address = replies.get(timeout=TIMEOUT_S)
        before = open_fds()
        try:
            open_buffer(sharing.ExportTicket(address, "ab" * 16, server.pid, 1), backend.name, 0, uuid, 4096)
            results[mode] = ["opened"]
        except Exception as exc:  # noqa: BLE001 - what escapes is what the test checks
            results[mode] = [type(exc).__module__, type(exc).__name__, str(exc), open_fds() - before]
        server.kill()
        server.join(TIMEOUT_S)
    return results



def _record_behind_a_gate(replies: Any) -> None:
    """Export an event recorded behind work that never ends, then wait to be killed."""
    import threading

    stream = accel.Stream()
    event = accel.Event(interprocess=True)
    gate = threading.Event()
    stream.launch_host_func(lambda: gate.wait(10 * TIMEOUT_S))
    event.record(stream)
    replies.put(pickle.dumps(event))
    time.sleep(10 * TIMEOUT_S)


def scenario_exporter_dies_while_a_stream_waits() -> dict[str, Any]:
    """Open an event whose record never completes, kill its exporter, queue a wait
    for it on a stream and synchronize the stream (in a thread, to see a hang)."""
    import signal
    import threading

    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    exporter = ctx.Process(target=_record_behind_a_gate, args=(replies,))
    exporter.start()
    event = pickle.loads(replies.get(timeout=TIMEOUT_S))
    os.kill(exporter.pid, signal.SIGKILL)
    exporter.join(TIMEOUT_S)
    outcome: list[Any] = ["hung"]

    def wait() -> None:
        stream = accel.Stream()
        try:
            event.wait(stream)
            stream.synchronize()
            outcome[:] = ["passed"]
        except Exception as exc:  # noqa: BLE001 - what escapes is what the test checks
            outcome[:] = [type(exc).__module__, type(exc).__name__, str(exc)]

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(10)
    print(json.dumps({"outcome": outcome}), flush=True)
    os._exit(0)  # a hung waiter holds the stream: do not wait for it at exit


# -- after the exporter exits: a process that took its address --------------------------

SQUATTER_BYTE = 0xEE


def _squat(address: bytes, user: int, replies: Any) -> None:
    """Bind the address of an exporter that has exited (as ``user``) and answer every
    connection as an accel broker would, with a buffer of this process's own."""
    import socket
    import struct

    from accel._runtime import get_runtime
    from accel.backends._sharing import _HEADER, _label, export_origin

    backend = get_runtime().backend
    buf = accel.memory.allocate(SIZE)
    accel.current_stream().fill(buf, SQUATTER_BYTE, SIZE)
    accel.current_stream().synchronize()
    payload, fds = backend.ipc_memory_export(0, buf.ptr, SIZE)
    origin = export_origin(backend.name, 0, backend.device_properties(0).uuid)
    body = _label("buffer") + _label(origin) + struct.pack("!Q", SIZE) + payload
    if user != os.geteuid():
        os.setgid(user)
        os.setuid(user)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(4)
    replies.put("listening")
    kept = []
    while True:
        conn, _ = listener.accept()
        conn.settimeout(10)
        try:
            if conn.recv(32):  # empty: the importer hung up without asking
                replies.put("asked")
            socket.send_fds(conn, [_HEADER.pack(b"K", len(body), len(fds)) + body], fds)
        except OSError:
            pass
        kept.append(conn)


def scenario_squatted() -> dict[str, Any]:
    """Open a buffer (pickled by scenario_print_pickle, whose process has exited) while
    another process listens at its exporter's address (as the user stdin names)."""
    import queue

    given = json.loads(sys.stdin.read())
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    user = os.geteuid() if given["user"] is None else given["user"]
    squatter = ctx.Process(target=_squat, args=(bytes.fromhex(given["address"]), user, replies), daemon=True)
    squatter.start()
    assert replies.get(timeout=TIMEOUT_S) == "listening"
    try:
        result = ["opened", host_bytes(pickle.loads(bytes.fromhex(given["buffer"]))).hex()]
    except accel.AccelError as exc:
        result = [type(exc).__name__, str(exc)]
    try:
        asked = replies.get(timeout=5) == "asked"  # put before it answered, if it was asked
    except queue.Empty:
        asked = False
    squatter.kill()
    squatter.join(TIMEOUT_S)
    return {"result": result, "squatter": squatter.pid, "asked": asked}


# -- fork: helpers of either end ------------------------------------------------------


def _forking_holder(queue: Any, replies: Any) -> None:
    """Open the buffer, fork a helper that lives until told, then free the buffer."""
    buf = queue.get(timeout=TIMEOUT_S)
    told, tell = os.pipe()
    helper = os.fork()
    if helper == 0:
        os.close(tell)
        os.read(told, 1)
        os._exit(0)
    os.close(told)
    replies.put(host_bytes(buf).hex())
    buf.free()
    replies.put("freed")
    queue.get(timeout=TIMEOUT_S)  # the exporter has looked
    os.close(tell)
    os.waitpid(helper, 0)


def scenario_importer_forks_a_helper() -> dict[str, Any]:
    """Both ends free the buffer while a helper the importer forked lives on: the
    exporter's memory must go back to its cache all the same."""
    child, queue, replies = start_importer(_forking_holder)
    buf = filled(0x66)
    queue.put(buf)
    seen = replies.get(timeout=TIMEOUT_S)
    replies.get(timeout=TIMEOUT_S)
    buf.free()
    wait_released(TIMEOUT_S / 2)
    result = {"seen": seen, "holds": broker().stats()["holds"], "allocated": allocated()}
    queue.put("looked")
    child.join(TIMEOUT_S)
    return {**result, "exitcode": child.exitcode}


def _holder_until_told(queue: Any, replies: Any) -> None:
    buf = queue.get(timeout=TIMEOUT_S)
    replies.put(host_bytes(buf).hex())
    queue.get(timeout=TIMEOUT_S)  # the exporter forked and allocated again
    replies.put(host_bytes(buf).hex())
    buf.free()
    replies.put("freed")


def scenario_exporter_forks_while_an_importer_holds() -> dict[str, Any]:
    """The exporter frees its buffer (the importer's hold alone keeps the memory) and
    forks a child that exits at once: the child's copy of the hold closes, and what it
    held must stay held in the exporter, without a word on the child's stderr."""
    import tempfile

    child, queue, replies = start_importer(_holder_until_told)
    buf = filled(0x77)
    queue.put(buf)
    seen = replies.get(timeout=TIMEOUT_S)
    ptr = buf.ptr
    buf.free()
    with tempfile.TemporaryFile() as err:
        saved = os.dup(2)
        os.dup2(err.fileno(), 2)  # what the fork handlers print in the helper
        helper = os.fork()
        if helper == 0:
            os._exit(0)
        os.dup2(saved, 2)
        os.close(saved)
        _, status = os.waitpid(helper, 0)
        err.seek(0)
        helper_stderr = err.read().decode(errors="replace")
    holds = broker().stats()["holds"]
    again = filled(0x55)
    queue.put("look again")
    seen_again = replies.get(timeout=TIMEOUT_S)
    replies.get(timeout=TIMEOUT_S)
    reused = again.ptr == ptr
    again.free()
    child.join(TIMEOUT_S)
    wait_released()
    return {
        "seen": seen, "seen_again": seen_again, "reused_while_held": reused, "holds_after_fork": holds,
        "helper_status": os.waitstatus_to_exitcode(status), "helper_stderr": helper_stderr,
        "after": broker().stats(), "allocated_after": allocated(), "exitcode": child.exitcode,
    }


def scenario_fork_a_helper_then_exit() -> dict[str, Any]:
    """Print a pickled buffer and event, fork a helper that outlives this process (its pid
    printed too), and exit."""
    buf = accel.memory.allocate(SIZE)
    event = accel.Event(interprocess=True)
    event.record()
    pickles = {"buffer": pickle.dumps(buf).hex(), "event": pickle.dumps(event).hex()}
    helper = os.fork()
    if helper == 0:
        quiet = os.open(os.devnull, os.O_RDWR)
        for stdio in (0, 1, 2):  # the test reads this process's output to its end
            os.dup2(quiet, stdio)
        time.sleep(10 * TIMEOUT_S)
        os._exit(0)
    return {**pickles, "helper": helper}


def scenario_forked_child_pickles_again() -> dict[str, Any]:
    """Pickle a buffer (its export remembered for its lease), fork, and pickle it again in
    the child: what the child raises, and whether it still knew the parent's export."""
    from accel.allocator import _sharing

    buf = accel.memory.allocate(SIZE)
    pickle.dumps(buf)
    read, write = os.pipe()
    child = os.fork()
    if child == 0:
        try:
            pickle.dumps(buf)
            outcome = ["pickled"]
        except Exception as exc:  # noqa: BLE001 - what escapes is what the test checks
            outcome = [type(exc).__name__, str(exc)]
        os.write(write, json.dumps([*outcome, len(_sharing._tickets), len(_sharing._exported)]).encode())
        os._exit(0)
    os.close(write)
    _, status = os.waitpid(child, 0)
    with os.fdopen(read) as reply:
        return {"child": json.loads(reply.read()), "status": status}


def scenario_open_pickles_impatiently() -> dict[str, Any]:
    """scenario_open_pickles, waiting 5 s for an answer instead of 60 (what a failure costs)."""
    import accel.backends._sharing as sharing

    sharing._ANSWER_TIMEOUT_S = 5.0
    return scenario_open_pickles()


# -- close-on-exec: programs either end starts inherit none of accel's descriptors -------


def inherited_by_a_program() -> list[str]:
    """What a program started with ``close_fds=False`` has past stdio: ``"fd target"``
    (the descriptor listing opens is closed by the time it is read)."""
    import subprocess

    code = (
        "import os\n"
        "for fd in os.listdir('/proc/self/fd'):\n"
        "    try:\n"
        "        print(fd, os.readlink(f'/proc/self/fd/{fd}'))\n"
        "    except OSError:\n"
        "        pass\n"
    )
    result = subprocess.run(
        [sys.executable, "-I", "-c", code], capture_output=True, text=True, close_fds=False, timeout=TIMEOUT_S, check=True
    )
    return [line for line in result.stdout.splitlines() if int(line.split()[0]) > 2]


def open_and_start_a_program() -> None:
    """The importer of scenario_programs_inherit_nothing: opens the buffer and the event
    of the pickles on stdin, and takes the buffer's descriptors as any process could;
    prints what a program it starts inherits, and holds until stdin says."""
    given = json.loads(sys.stdin.readline())
    kept = [pickle.loads(bytes.fromhex(given["buffer"])), pickle.loads(bytes.fromhex(given["event"]))]
    kept.append(_handed("buffer", pickle.loads(bytes.fromhex(given["args"]))))
    print(json.dumps(inherited_by_a_program()), flush=True)
    sys.stdin.readline()


def scenario_programs_inherit_nothing() -> dict[str, Any]:
    """This process (it started with stdio only) exports a buffer and an event to an
    importer (likewise); each starts a program while the importer holds both."""
    import subprocess

    buf = accel.memory.allocate(SIZE)
    event = accel.Event(interprocess=True)
    event.record()
    given = {"buffer": pickle.dumps(buf).hex(), "event": pickle.dumps(event).hex(),
             "args": pickle.dumps(buf.__reduce__()[1]).hex()}
    importer = subprocess.Popen(
        [sys.executable, "-c", "from tests.allocator.sharing_scenarios import open_and_start_a_program as f; f()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )
    assert importer.stdin is not None and importer.stdout is not None
    importer.stdin.write(json.dumps(given) + "\n")
    importer.stdin.flush()
    imported = json.loads(importer.stdout.readline())
    exported = inherited_by_a_program()
    holds = broker().stats()["holds"]
    importer.communicate("\n", timeout=TIMEOUT_S)
    return {"importer": imported, "exporter": exported, "holds": holds, "exitcode": importer.returncode}


if __name__ == "__main__":
    print(json.dumps(globals()[f"scenario_{sys.argv[1]}"]()))
