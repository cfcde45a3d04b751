"""A hostile user of accel's public API, as a hypothesis state machine.

Rules mix what users do: streams made and closed, events recorded, waited on
and timed, host functions (slow, raising), buffers allocated, filled, copied,
freed and used on other streams, DLPack exports held and released, graph
captures replayed and dropped, ``empty_cache`` and synchronizes, in any order.
Misuse (a closed stream, a freed buffer) must raise an accel error; nothing
else may escape.

After every step the invariants hold: no two live buffers overlap; after a
device synchronize, every live buffer holds exactly the bytes the model says
and ``memory_stats`` counts exactly the live buffers.

Run by tests/test_public_api_stateful.py in a subprocess per backend, with a
timeout, so a crash or a hang fails the test instead of the session::

    ACCEL_BACKEND=cpu python -m tests.public_api_machine 20
"""

from __future__ import annotations

import faulthandler
import os
import sys
import threading
import time

import numpy as np
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, consumes, invariant, precondition, rule, run_state_machine_as_test

import accel

SIZES = st.one_of(st.integers(1, 4096), st.integers(4097, 3 << 20))


class LiveBuffer:
    """A buffer the model tracks: its bytes once every queued fill has run."""

    def __init__(self, buf: accel.memory.Buffer, value: int) -> None:
        self.buf = buf
        self.value = value
        self.writer = buf.stream  # the stream of the last fill: the next one is ordered after it
        self.ptr, self.nbytes = buf.ptr, buf.nbytes


class PublicApiMachine(RuleBasedStateMachine):
    streams = Bundle("streams")
    buffers = Bundle("buffers")
    events = Bundle("events")

    def __init__(self) -> None:
        super().__init__()
        accel.synchronize()
        accel.memory.empty_cache()
        self.base_allocations = accel.memory.memory_stats()["allocation.all.current"]
        self.live: list[LiveBuffer] = []
        self.closed: list[accel.Stream] = []
        self.exports: list[tuple[LiveBuffer, object]] = []
        self.graphs: list[tuple[accel.Graph, LiveBuffer, int]] = []
        self.gates: list[threading.Event] = []
        self.exported_frees: list[LiveBuffer] = []

    # -- streams and events ------------------------------------------------------------

    def _is_closed(self, stream: accel.Stream) -> bool:
        # By identity: streams compare equal by handle, and a driver may give a new
        # stream the handle of a closed one (the simulated CUDA driver reuses addresses).
        return any(stream is closed for closed in self.closed)

    @rule(target=streams, priority=st.sampled_from([0, -1]))
    def make_stream(self, priority: int) -> accel.Stream:
        return accel.Stream(priority=priority)

    @rule(target=streams)
    def current(self) -> accel.Stream:
        return accel.current_stream()

    @rule(stream=consumes(streams))
    def close_stream(self, stream: accel.Stream) -> None:
        stream.close()  # queued work still completes
        if stream == accel.current_stream():
            stream.synchronize()  # the default stream ignores close(): it stays usable
            return
        self.closed.append(stream)

    @rule(stream=streams)
    def wait_for_stream(self, stream: accel.Stream) -> None:
        """Waiting on a stream works whether or not it was closed (for its work queued before the close)."""
        self._open_gates()  # the default stream waits inline on the host
        accel.current_stream().wait_stream(stream)
        stream.record_event().synchronize()

    @rule(target=events, stream=streams, timing=st.booleans())
    def record_event(self, stream: accel.Stream, timing: bool) -> accel.Event:
        event = accel.Event(enable_timing=timing)
        self._guarded(event.record, stream)
        return event

    @rule(event=events, stream=streams)
    def wait_event(self, event: accel.Event, stream: accel.Stream) -> None:
        self._guarded(stream.wait_event, event)

    @rule(a=events, b=events)
    def elapsed(self, a: accel.Event, b: accel.Event) -> None:
        try:
            a.synchronize()
            b.synchronize()
            assert isinstance(a.elapsed_time(b), float)
        except accel.AccelError:
            pass  # not timing events, not recorded, or on other devices: refused clearly

    @rule(stream=streams, slow=st.booleans())
    def host_function(self, stream: accel.Stream, slow: bool) -> None:
        self._guarded(stream.launch_host_func, (lambda: time.sleep(0.002)) if slow else (lambda: None))

    @rule(stream=streams)
    def gate(self, stream: accel.Stream) -> None:
        """Hold the stream until the next synchronize opens every gate: real asynchrony."""
        if stream == accel.current_stream():
            return  # the default stream runs host functions inline: the caller would wait
        opened = threading.Event()
        if self._guarded(stream.launch_host_func, lambda: opened.wait(5)):
            self.gates.append(opened)

    @rule(stream=streams)
    def failing_host_function(self, stream: accel.Stream) -> None:
        """A host function that raises: its stream's next synchronize reports it, once."""

        def boom() -> None:
            raise RuntimeError("boom")

        if self._is_closed(stream):
            return
        self._open_gates()  # the synchronize below must not wait for a gate
        stream.launch_host_func(boom)
        try:
            stream.synchronize()
        except accel.HostFunctionError as exc:
            assert "boom" in str(exc)
        else:
            raise AssertionError("a failing host function was not reported by synchronize()")
        stream.synchronize()  # reported once

    # -- memory ----------------------------------------------------------------------

    @rule(target=buffers, nbytes=SIZES, stream=streams, value=st.integers(0, 255))
    def allocate(self, nbytes: int, stream: accel.Stream, value: int) -> LiveBuffer:
        if self._is_closed(stream):
            try:
                accel.memory.allocate(nbytes, stream=stream)
            except accel.AccelError:
                pass
            else:
                raise AssertionError("allocate on a closed stream was accepted")
            buf = accel.memory.allocate(nbytes)
            stream = accel.current_stream()
        else:
            buf = accel.memory.allocate(nbytes, stream=stream)
        stream.fill(buf, value)
        live = LiveBuffer(buf, value)
        self.live.append(live)
        return live

    @rule(live=buffers, stream=streams, value=st.integers(0, 255))
    def fill_on_other_stream(self, live: LiveBuffer, stream: accel.Stream, value: int) -> None:
        if live.buf.freed:
            return
        # The buffer's stream must see the new bytes before it reuses the memory.
        if self._is_closed(stream):
            try:
                stream.fill(live.buf, value)
            except accel.AccelError:
                return
            raise AssertionError("fill on a closed stream was accepted")
        # After the last fill too: two fills on streams that each waited only for the
        # buffer's own stream land in either order (the model expected the later call).
        stream.wait_stream(live.buf.stream)
        stream.wait_stream(live.writer)
        stream.fill(live.buf, value)
        live.buf.record_stream(stream)
        live.value, live.writer = value, stream

    @rule(live=consumes(buffers))
    def free(self, live: LiveBuffer) -> None:
        if any(holder is live for holder, _ in self.exports) or any(b is live for _, b, _ in self.graphs):
            self.live.remove(live) if live in self.live else None
            if not any(b is live for _, b, _ in self.graphs):
                self.exported_frees.append(live)  # freed once its exports are released
            return  # still used by an export or a graph: dropped from the model, freed with them
        live.buf.free()
        live.buf.free()  # a second free does nothing
        if live in self.live:
            self.live.remove(live)
        try:
            _ = live.buf.ptr
        except accel.InvalidHandleError:
            pass
        else:
            raise AssertionError("a freed buffer still gave its pointer")

    @rule(live=buffers)
    def export(self, live: LiveBuffer) -> None:
        """A DLPack export held by a consumer (numpy on the host; device memory is refused cleanly)."""
        if live.buf.freed:
            return
        try:
            view = np.from_dlpack(live.buf)
        except (accel.AccelError, BufferError, TypeError, RuntimeError, ValueError) as exc:
            assert accel.current_accelerator().type != "cpu", f"host export failed: {exc!r}"
            return
        self.exports.append((live, view))

    @rule()
    def release_exports(self) -> None:
        self.exports.clear()
        for live in self.exported_frees:
            live.buf.free()
        self.exported_frees.clear()

    # -- graphs --------------------------------------------------------------------

    @rule(value=st.integers(0, 255), nbytes=SIZES)
    def capture(self, value: int, nbytes: int) -> None:
        target = LiveBuffer(accel.memory.allocate(nbytes), 0)
        accel.current_stream().fill(target.buf, 0)
        g = accel.Graph()
        with accel.graph(g):
            accel.current_stream().fill(target.buf, value)
        self.live.append(target)
        self.graphs.append((g, target, value))

    @precondition(lambda self: bool(self.graphs))
    @rule(data=st.data())
    def replay(self, data: st.DataObject) -> None:
        g, target, value = data.draw(st.sampled_from(self.graphs))
        accel.current_stream().wait_stream(target.writer)  # after a fill on another stream
        g.replay()
        target.value, target.writer = value, accel.current_stream()

    @precondition(lambda self: bool(self.graphs))
    @rule(data=st.data())
    def drop_graph(self, data: st.DataObject) -> None:
        entry = data.draw(st.sampled_from(self.graphs))
        self.graphs.remove(entry)
        accel.synchronize()  # its replays must be done before its target may be freed
        g, target, _ = entry
        # A graph holds the memory its captured work writes until it is reset or
        # collected (hypothesis keeps its draws alive: reset it).
        g.reset()
        if target in self.live:
            self.live.remove(target)
        target.buf.free()

    # -- whole-device operations ------------------------------------------------------

    @rule()
    def empty_cache(self) -> None:
        accel.memory.empty_cache()

    @rule()
    def synchronize(self) -> None:
        self._synchronize_all()
        for live in self.live:
            if live.buf.freed:
                continue
            seen = np.empty(live.nbytes, dtype=np.uint8)
            accel.current_stream().copy(seen, live.buf)
            accel.current_stream().synchronize()
            assert (seen == live.value).all(), (
                f"buffer {live.ptr:#x}+{live.nbytes} holds {np.unique(seen)[:4]}, expected {live.value}"
            )
        held = sum(1 for live in self.live if not live.buf.freed)
        exported = {id(live) for live, _ in self.exports if live not in self.live}
        allocations = accel.memory.memory_stats()["allocation.all.current"] - self.base_allocations
        assert allocations >= held, (allocations, held)
        if not exported and not self.graphs:
            assert allocations == held, f"memory_stats counts {allocations} allocations, the model {held}"

    @invariant()
    def live_buffers_do_not_overlap(self) -> None:
        spans = sorted((live.ptr, live.ptr + live.nbytes) for live in self.live if not live.buf.freed)
        for (_, end), (start, _) in zip(spans, spans[1:]):
            assert end <= start, f"live buffers overlap at {start:#x}"

    def teardown(self) -> None:
        for gate in self.gates:
            gate.set()
        self.release_exports()
        for g, _, _ in self.graphs:
            g.reset()  # its hold on the buffers it writes ends now, not when hypothesis drops it
        self.graphs.clear()
        try:
            self._synchronize_all()
        finally:
            for live in self.live:
                live.buf.free()

    # -- helpers ------------------------------------------------------------------------

    def _open_gates(self) -> None:
        for gate in self.gates:
            gate.set()
        self.gates.clear()

    def _synchronize_all(self) -> None:
        self._open_gates()
        accel.synchronize()

    def _guarded(self, call, *args) -> bool:  # type: ignore[no-untyped-def]
        """Run ``call``; misuse of a closed stream or event must be an accel error."""
        try:
            call(*args)
        except accel.AccelError:
            return False
        return True


def main(examples: int) -> None:
    # A hang prints every thread's stack and ends the run before the caller's timeout.
    hang_s = float(os.environ.get("ACCEL_MACHINE_HANG_S", "0"))
    if hang_s:
        faulthandler.dump_traceback_later(hang_s, exit=True)
    run_state_machine_as_test(
        PublicApiMachine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=30,
            deadline=None,
            suppress_health_check=list(HealthCheck),
            database=None,
            # Shrinking a failure replays it hundreds of times, past the test's timeout: the
            # failing sequence is reported as found unless ACCEL_MACHINE_SHRINK=1.
            phases=list(Phase) if os.environ.get("ACCEL_MACHINE_SHRINK") else [Phase.generate],
            # ACCEL_MACHINE_VERBOSE=1 prints every step as it runs: the sequence that led
            # to a crash, which hypothesis cannot shrink since the process is gone.
            verbosity=Verbosity.debug if os.environ.get("ACCEL_MACHINE_VERBOSE") else Verbosity.normal,
        ),
    )
    print(f"ok: {examples} runs on {accel.current_accelerator()}")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
