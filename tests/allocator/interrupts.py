"""An interrupt (Ctrl-C) at each backend call of a scenario in turn, for
tests/allocator/test_core_interrupts.py (the native core's plain segments) and
test_expandable_interrupts.py (expandable segments)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from accel._runtime import Runtime
from accel.allocator._blocks import ALLOCATED
from accel.allocator._caching import DeviceAllocator
from accel.allocator.config import parse
from accel.backends.cpu import CpuBackend
from accel.stream._stream import Stream
from tests.allocator.test_caching import check_invariants

MiB = 1 << 20



class Held:
    """The blocks a scenario holds, allocated and freed through it: what an interrupt
    left allocated is freed at the end."""

    def __init__(self, allocator: DeviceAllocator) -> None:
        self.allocator = allocator
        self.blocks: list[Any] = []

    def malloc(self, nbytes: int, stream: Stream) -> Any:
        self.blocks.append(self.allocator.malloc(nbytes, stream))
        return self.blocks[-1]

    def free(self, block: Any) -> None:
        self.blocks.remove(block)
        self.allocator.free(block)


Scenario = Callable[[DeviceAllocator, list[Stream], Held], None]


class Interrupts:
    """Raises KeyboardInterrupt at the ``at``-th public backend call of the main
    thread (or of the thread that runs its upstream calls: see
    accel/allocator/_native_core.py's _run_once), before the call runs; records the
    call's name."""

    def __init__(self, backend: CpuBackend, at: int) -> None:
        self.calls = 0
        self.at = at
        self.fired: str | None = None
        self.armed = False
        for name in dir(type(backend)):
            fn = getattr(backend, name)
            if not name.startswith("_") and callable(fn):
                setattr(backend, name, self._wrap(name, fn))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            thread = threading.current_thread()
            if self.armed and (thread is threading.main_thread() or thread.name == "accel-upstream"):
                self.calls += 1
                if self.calls == self.at:
                    self.fired = name
                    raise KeyboardInterrupt(name)
            return fn(*args, **kwargs)

        return call


def interrupt_each_backend_call(
    config: str,
    scenario: Scenario,
    *,
    streams: int,
    losable: dict[str, int],
    min_calls: int,
    check: Callable[[DeviceAllocator], None] = lambda a: None,
) -> None:
    """Run ``scenario(allocator, streams, held)`` (``held``: what it allocates by) once
    per backend call it makes, interrupted at that call: the interrupt reaches the
    caller, the books stay whole (check_invariants and ``check``), later allocations
    work, everything goes back at the end, and no memory is lost but up to
    ``losable[call]`` bytes when ``call`` (a give-back) was the one interrupted."""
    at = 1
    while True:
        backend = CpuBackend(1, None)
        runtime = Runtime(backend)
        # before the allocator: its core waits for the device through the wrapped call
        interrupts = Interrupts(backend, at)
        made = [runtime.default_stream(0)] + [
            Stream._wrap(runtime, 0, backend.stream_create(0, 0), owned=True) for _ in range(streams - 1)
        ]
        a = DeviceAllocator(backend, 0, parse(config))
        held = Held(a)
        interrupts.armed = True
        raised = None
        try:
            scenario(a, made, held)
        except KeyboardInterrupt as exc:
            raised = exc
        interrupts.armed = False
        where = f"interrupted at call {at} ({interrupts.fired})"
        if interrupts.fired is not None:
            assert raised is not None, f"{where}: the interrupt was swallowed"
        check_invariants(a)
        check(a)
        held.malloc(30 * MiB, made[0])
        check(a)
        for b in held.blocks:
            if b.state == ALLOCATED:  # a free the interrupt cut short may have retired it
                a.free(b)
        for s in made:
            s.synchronize()
        try:
            a.empty_cache()
        except KeyboardInterrupt:
            pass  # an interrupted give-back is raised by the next empty_cache
        a.empty_cache()
        check_invariants(a)
        assert a.stats()["reserved_bytes.all.current"] == 0, where
        assert a.stats()["active_bytes.all.current"] == 0, where
        lost = backend._memory[0]._held
        assert lost <= losable.get(interrupts.fired or "", 0), f"{where}: {lost} bytes lost"
        for s in made[1:]:
            s.close()
        if interrupts.fired is None:
            break
        at += 1
    assert at > min_calls  # the scenario made that many backend calls, each interrupted in turn
