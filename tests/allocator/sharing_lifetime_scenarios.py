"""Two-process scenarios for tests/allocator/test_sharing_lifetime.py: what freeing an
imported buffer does while the importer's streams still have work queued on it.

Each ``scenario_*`` runs in a fresh exporting interpreter (``python -m
tests.allocator.sharing_lifetime_scenarios NAME``, on the backend ``ACCEL_BACKEND``
names), starts its importer with multiprocessing's spawn start method (which inherits
the exporter's stderr), and prints one JSON line of what it saw.
"""

from __future__ import annotations

import ctypes
import gc
import json
import multiprocessing as mp
import pickle
import sys
import threading
import time
from typing import Any

import accel
from accel.backends._sharing import broker
from tests.allocator.sharing_scenarios import importer_replies

SIZE = 1 << 20
TIMEOUT_S = 60


def _contents(buf: accel.memory.Buffer) -> list[int]:
    """The distinct byte values of exported ``buf``, read in stream order."""
    stream = accel.current_stream(buf.device)
    with accel.memory.allocate_host(buf.nbytes) as staging:
        stream.copy(staging, buf, buf.nbytes)
        stream.synchronize()
        return sorted(set(ctypes.string_at(staging.ptr, buf.nbytes)))


def _holds_end() -> int:
    """The exporter's holds once they ended (or after TIMEOUT_S)."""
    deadline = time.monotonic() + TIMEOUT_S
    while broker().stats()["holds"] and time.monotonic() < deadline:
        time.sleep(0.01)
    return int(broker().stats()["holds"])


def _exported(count: int) -> list[accel.memory.Buffer]:
    bufs = [accel.memory.allocate(SIZE) for _ in range(count)]
    for buf in bufs:
        accel.current_stream().fill(buf, 0, SIZE)
    accel.current_stream().synchronize()
    return bufs


def _memfd_mappings() -> int:
    """Mappings of memory files in this process: every backend maps imported memory so."""
    with open("/proc/self/maps") as maps:
        return sum("memfd:" in line for line in maps)


# -- freed while a closed stream's fill is still queued ---------------------------------


def _open_once_freed(buf: accel.memory.Buffer, gate: threading.Event) -> None:
    while not buf.freed:
        time.sleep(0.001)
    gate.set()


def _free_behind_closed_streams(data: list[bytes], replies: Any) -> None:
    """Two buffers, each written by a fill queued behind a gate on a stream that is then
    closed: the first opened on that stream and freed, the second named to it with
    record_stream and garbage collected. The gates open only once the frees began (the
    first waits for its fill)."""
    own, recorded = accel.Stream(), accel.Stream()
    gates = [threading.Event(), threading.Event()]
    with own:
        first = pickle.loads(data[0])
    second = pickle.loads(data[1])  # on the default stream
    second.record_stream(recorded)
    for stream, buf, gate, value in ((own, first, gates[0], 0x11), (recorded, second, gates[1], 0x22)):
        stream.launch_host_func(lambda gate=gate: gate.wait(TIMEOUT_S))
        stream.fill(buf, value, SIZE)
        stream.close()
    threading.Thread(target=_open_once_freed, args=(first, gates[0])).start()
    first.free()
    del second
    gc.collect()  # the finalizer: it does not wait
    gates[1].set()  # the fills run now, into memory the frees must have left mapped
    accel.synchronize()  # every stream of the device, closed ones included
    replies.put("done")


def scenario_free_behind_closed_streams() -> dict[str, Any]:
    bufs = _exported(2)
    (reply,), exitcode = importer_replies(1, _free_behind_closed_streams, [pickle.dumps(b) for b in bufs])
    return {"reply": reply, "exitcode": exitcode, "holds": _holds_end(), "seen": [_contents(b) for b in bufs]}


# -- freed while a stream it was used on captures a graph ------------------------------


def _free_while_capturing(data: bytes, replies: Any) -> None:
    """A fill queued behind a gate on a stream that then begins a capture; the buffer is
    freed during the capture (no event recorded there orders after the fill, and the
    free cannot wait for the capture's end: this thread ends it)."""
    stream = accel.Stream()
    buf = pickle.loads(data)
    buf.record_stream(stream)
    gate = threading.Event()
    stream.launch_host_func(lambda: gate.wait(TIMEOUT_S))
    stream.fill(buf, 0x55, SIZE)
    graph = accel.Graph()
    with stream:
        graph.capture_begin()
        stream.launch_host_func(lambda: None)
        buf.free()
        graph.capture_end()
    gate.set()
    stream.synchronize()
    replies.put("done")


def scenario_free_while_capturing() -> dict[str, Any]:
    (buf,) = _exported(1)
    (reply,), exitcode = importer_replies(1, _free_while_capturing, pickle.dumps(buf))
    return {"reply": reply, "exitcode": exitcode, "holds": _holds_end(), "seen": _contents(buf)}


# -- garbage collected while a host function's failure waits on its stream ---------------


def _collect_with_a_failure_pending(data: bytes, replies: Any, go: Any) -> None:
    stream = accel.Stream()
    baseline = _memfd_mappings()
    with stream:
        buf = pickle.loads(data)

    def failing() -> None:
        raise ValueError("from the host function")

    stream.launch_host_func(failing)
    stream.fill(buf, 0x33, SIZE)
    del buf
    gc.collect()  # the finalizer: no synchronize, no message, the failure stays with the stream
    replies.put("collected")
    go.get(timeout=TIMEOUT_S)  # the exporter saw the hold end
    mapped = _memfd_mappings() - baseline
    try:
        stream.synchronize()
        raised: list[str] = []
    except accel.HostFunctionError as exc:
        raised = [type(exc.__cause__).__name__, str(exc.__cause__)]
    replies.put({"mapped": mapped, "raised": raised})


def scenario_collect_with_a_failure_pending() -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    replies, go = ctx.Queue(), ctx.Queue()
    (buf,) = _exported(1)
    child = ctx.Process(target=_collect_with_a_failure_pending, args=(pickle.dumps(buf), replies, go))
    child.start()
    collected = replies.get(timeout=TIMEOUT_S)
    holds = _holds_end()  # while the importer lives: its free ended the hold
    go.put("look")
    result = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {"collected": collected, "holds": holds, **result, "seen": _contents(buf), "exitcode": child.exitcode}


# -- the interpreter exits with an imported buffer alive on a stream it created ------------

_kept: list[object] = []


def _exit_holding(data: bytes, replies: Any) -> None:
    stream = accel.Stream()
    with stream:
        buf = pickle.loads(data)
    stream.fill(buf, 0x44, SIZE)
    _kept.extend([stream, buf])  # alive until the interpreter's exit
    replies.put("holding")


def scenario_exit_holding() -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    (buf,) = _exported(1)
    child = ctx.Process(target=_exit_holding, args=(pickle.dumps(buf), replies))
    child.start()
    reply = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {"reply": reply, "exitcode": child.exitcode, "holds": _holds_end(), "seen": _contents(buf)}


# -- one collected buffer whose stream never finishes, another whose stream does ----------


def _one_slow_unmap(data: list[bytes], replies: Any, go: Any) -> None:
    """Two buffers, each filled behind a gate on a stream of its own, garbage collected
    (the unmapping thread waits for their fills): the first gate opens only when the
    exporter says so, the second at once."""
    gates = [threading.Event(), threading.Event()]
    for blob, gate in zip(data, gates):
        stream = accel.Stream()
        with stream:
            buf = pickle.loads(blob)
        stream.launch_host_func(lambda gate=gate: gate.wait(10 * TIMEOUT_S))
        stream.fill(buf, 0x55, SIZE)
        del buf
        gc.collect()  # the finalizer: to the unmapping thread
    gates[1].set()
    replies.put("collected")
    go.get(timeout=TIMEOUT_S)
    gates[0].set()
    accel.synchronize()
    replies.put("done")


def scenario_one_slow_unmap() -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    replies, go = ctx.Queue(), ctx.Queue()
    bufs = _exported(2)
    child = ctx.Process(target=_one_slow_unmap, args=([pickle.dumps(b) for b in bufs], replies, go))
    child.start()
    replies.get(timeout=TIMEOUT_S)
    deadline = time.monotonic() + TIMEOUT_S / 3
    while broker().stats()["holds"] > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    while_one_waits = broker().stats()["holds"]
    go.put("go")
    reply = replies.get(timeout=TIMEOUT_S)
    child.join(TIMEOUT_S)
    return {"while_one_waits": while_one_waits, "reply": reply, "exitcode": child.exitcode, "holds": _holds_end(),
            "seen": [_contents(b) for b in bufs]}


if __name__ == "__main__":
    print(json.dumps(globals()[f"scenario_{sys.argv[1]}"]()), flush=True)
