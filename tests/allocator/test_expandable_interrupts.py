"""An interrupt (Ctrl-C) at any backend call of an expandable segment's unmapping,
mapping or give-back leaves the books whole: no block called mapped over a page
that was unmapped, no physical page lost but the one whose release was itself
interrupted, and everything goes back at the end."""

from __future__ import annotations

import threading

import pytest

from accel._runtime import Runtime
from accel.allocator._blocks import ALLOCATED
from accel.allocator._caching import DeviceAllocator
from accel.allocator.config import parse
from accel.backends.cpu import CpuBackend
from accel.stream._stream import Stream
from tests.allocator.test_caching import check_invariants

MiB = 1 << 20


class _Interrupts:
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

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            thread = threading.current_thread()
            if self.armed and (thread is threading.main_thread() or thread.name == "accel-upstream"):
                self.calls += 1
                if self.calls == self.at:
                    self.fired = name
                    raise KeyboardInterrupt(name)
            return fn(*args, **kwargs)

        return call


def _scenario(a: DeviceAllocator, streams: list[Stream], live: list) -> None:
    s0, s1, _ = streams

    def malloc(n, s):
        live.append(a.malloc(n, s))
        return live[-1]

    def free(b):
        live.remove(b)
        a.free(b)

    x, y, z = malloc(8 * MiB, s0), malloc(8 * MiB, s0), malloc(3000, s0)
    a.record_stream(y, s1)
    free(y)
    free(z)
    w = malloc(20 * MiB, s0)  # grows, giving back y's pages first
    free(x)
    a.empty_cache()  # unmaps x's pages
    u = malloc(9 * MiB, s0)
    free(w)
    free(u)
    a.empty_cache()  # unmaps everything: the reservation goes back


@pytest.mark.parametrize("keep", [0, 2])
def test_an_interrupt_at_any_backend_call_leaves_the_expandable_books_whole(keep: int) -> None:
    at = 1
    while True:
        backend = CpuBackend(1, None)
        runtime = Runtime(backend)
        streams = [runtime.default_stream(0)] + [
            Stream._wrap(runtime, 0, backend.stream_create(0, 0), owned=True) for _ in range(2)
        ]
        a = DeviceAllocator(backend, 0, parse(f"expandable_segments:True,expandable_keep_free_mb:{keep}"))
        interrupts = _Interrupts(backend, at)
        live: list = []
        interrupts.armed = True
        try:
            _scenario(a, streams, live)
        except KeyboardInterrupt:
            pass
        interrupts.armed = False
        where = f"interrupted at call {at} ({interrupts.fired})"
        # (check_invariants: no block called mapped over a page that is not, and no
        # page mapped that no block covers)
        check_invariants(a)
        # Later allocations work; everything goes back.
        live.append(a.malloc(30 * MiB, streams[0]))
        check_invariants(a)
        for b in live:
            if b.state == ALLOCATED:  # a free the interrupt cut short may have retired it
                a.free(b)
        for s in streams:
            s.synchronize()
        a.empty_cache()
        check_invariants(a)
        assert a.stats()["reserved_bytes.all.current"] == 0, where
        # A release interrupted before it ran loses its page; nothing else is lost.
        lost = backend._memory[0]._held
        assert lost <= (2 * MiB if interrupts.fired == "vm_release" else 0), where
        for s in streams[1:]:
            s.close()
        if interrupts.fired is None:
            break
        at += 1
    assert at > 50  # the scenario made that many backend calls, each interrupted in turn
