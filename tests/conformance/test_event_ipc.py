"""Event.ipc_handle() / Event.from_ipc_handle(), as torch.cuda.Event's, on every backend.

The importers are spawned processes (what multiprocessing's spawn start method
gives torch code too); their functions live at module level so that the
children can import them. This module imports no torch: the children load fast.
"""

from __future__ import annotations

import multiprocessing as mp
import threading
from typing import Any

import pytest

import accel

TIMEOUT_S = 60


def _report(replies: Any, fn: Any) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - the test reads it
        replies.put(("error", type(exc).__name__, str(exc)))


def _open_and_wait(device: str, handle: bytes, replies: Any) -> None:
    def run() -> None:
        event = accel.Event.from_ipc_handle(device, handle)
        replies.put(("opened", str(event.device), event.query()))
        event.synchronize()  # returns once the exporter's record completed
        stream = accel.Stream()
        event.wait(stream)
        stream.synchronize()
        try:
            event.ipc_handle()
        except accel.NotSupportedError as exc:
            replies.put(("synchronized", event.query(), str(exc)))

    _report(replies, run)


def _export_and_exit(replies: Any) -> None:
    def run() -> None:
        event = accel.Event(interprocess=True)
        event.record()
        replies.put(("handle", event.ipc_handle()))

    _report(replies, run)


def _spawn(monkeypatch: pytest.MonkeyPatch, runtime: Any, target: Any, *args: Any) -> tuple[Any, Any]:
    monkeypatch.setenv("ACCEL_BACKEND", runtime.name)  # the backend this test activated
    ctx = mp.get_context("spawn")
    replies = ctx.Queue()
    child = ctx.Process(target=target, args=(*args, replies), daemon=True)
    child.start()
    return child, replies


def _end(child: Any) -> int | None:
    child.join(TIMEOUT_S)
    if child.is_alive():
        child.kill()
        child.join()
    return child.exitcode  # type: ignore[no-any-return]


def test_an_event_opened_from_its_ipc_handle_in_another_process_is_the_same_event(runtime, monkeypatch) -> None:
    stream = accel.Stream()
    gate = threading.Event()
    stream.launch_host_func(lambda: gate.wait(TIMEOUT_S))  # holds the record back
    event = accel.Event(interprocess=True)
    event.record(stream)
    handle = event.ipc_handle()
    assert isinstance(handle, bytes) and event.ipc_handle() == handle  # one export
    child, replies = _spawn(monkeypatch, runtime, _open_and_wait, str(event.device), handle)
    try:
        assert replies.get(timeout=TIMEOUT_S) == ("opened", str(event.device), False)
        gate.set()
        kind, done, refusal = replies.get(timeout=TIMEOUT_S)
        assert (kind, done) == ("synchronized", True)
        assert "pickle the event in the process that created it" in refusal  # an opened event is not re-exported
    finally:
        gate.set()
        assert _end(child) == 0


def test_a_handle_whose_exporter_exited_is_a_clear_error(runtime, monkeypatch) -> None:
    child, replies = _spawn(monkeypatch, runtime, _export_and_exit)
    try:
        kind, handle = replies.get(timeout=TIMEOUT_S)
    finally:
        assert _end(child) == 0
    assert kind == "handle", handle
    with pytest.raises(accel.InvalidHandleError, match="has exited"):
        accel.Event.from_ipc_handle(None, handle)


def test_ipc_handles_refuse_what_they_cannot_open(runtime) -> None:
    with pytest.raises(accel.InvalidValueError, match="interprocess=True"):
        accel.Event().ipc_handle()
    event = accel.Event(interprocess=True)
    event.record()
    handle = event.ipc_handle()
    with pytest.raises(accel.InvalidHandleError, match="this very process"):
        accel.Event.from_ipc_handle(None, handle)
    with pytest.raises(accel.DeviceError):  # another device (or one out of range)
        accel.Event.from_ipc_handle(1, handle)
    forged = [b"", bytes(64), b"accel-event-ipc-1:{", handle.replace(b'"pid":', b'"pid":"x","was":', 1), handle[:-1],
              b"accel-event-ipc-1:" + b"[" * 100_000]  # RecursionError escaped json.loads
    for damaged in forged:  # torch's 64-byte cudaIpcEventHandle_t among them
        with pytest.raises(accel.InvalidHandleError, match="not an accel event IPC handle"):
            accel.Event.from_ipc_handle(None, damaged)
    with pytest.raises(accel.InvalidValueError, match="is not an IPC handle"):
        accel.Event.from_ipc_handle(None, handle.decode())
    event.close()
    with pytest.raises(accel.InvalidHandleError, match="was closed"):
        event.ipc_handle()
