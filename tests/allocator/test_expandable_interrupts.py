"""An interrupt (Ctrl-C) at any backend call of an expandable segment's unmapping,
mapping or give-back leaves the books whole: no block called mapped over a page
that was unmapped, no physical page lost but the one whose release was itself
interrupted, and everything goes back at the end."""

from __future__ import annotations

import pytest

from accel.allocator._caching import DeviceAllocator
from accel.stream._stream import Stream
from tests.allocator.interrupts import Held, interrupt_each_backend_call

MiB = 1 << 20


def _scenario(a: DeviceAllocator, streams: list[Stream], held: Held) -> None:
    s0, s1, _ = streams
    malloc, free = held.malloc, held.free
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
    # a release interrupted before it ran loses its page; nothing else is lost (and
    # check_invariants: no block called mapped over a page that is not, nor a page
    # mapped that no block covers)
    interrupt_each_backend_call(
        f"expandable_segments:True,expandable_keep_free_mb:{keep}", _scenario, streams=3,
        losable={"vm_release": 2 * MiB}, min_calls=50,
    )
