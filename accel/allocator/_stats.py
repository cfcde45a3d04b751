"""Allocator statistics in PyTorch's key scheme, kept in one flat list of ints.

The allocator's hot path updates plain list slots (no objects, no dicts).
Each statistic owns 8 slots::

    base+0 current (small pool)      base+1 current (large pool)
    base+2 peak (small)              base+3 peak (large)
    base+4 total increase (small)    base+5 total increase (large)
    base+6 peak (all pools)          base+7 unused

"freed" is derived (total increase - current), so a decrease is one
subtraction; ``reset_accumulated`` stores offsets instead of touching the
counters. The ``all`` pool is the sum of small and large except its peak,
which is tracked on its own.

``active`` and ``active_bytes`` are derived too: active = allocated + pending
(blocks freed by the caller that wait for other streams). Their slots hold the
pending counts, and their peak slots the peaks seen while something was
pending; when nothing is pending, active equals allocated, whose peak already
covers it. So the allocation hot path updates three statistics, not five.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["STAT_NAMES", "Stats"]

#: PyTorch's StatArrays, in its order (the key is ``allocation``, not ``allocated``).
STAT_NAMES = (
    "allocation",
    "segment",
    "active",
    "inactive_split",
    "allocated_bytes",
    "reserved_bytes",
    "active_bytes",
    "inactive_split_bytes",
    "requested_bytes",
)
ALLOCATION, SEGMENT, ACTIVE, INACTIVE_SPLIT, ALLOCATED_BYTES, RESERVED_BYTES = (0, 8, 16, 24, 32, 40)
ACTIVE_BYTES, INACTIVE_SPLIT_BYTES, REQUESTED_BYTES = (48, 56, 64)
#: Oversize stats have no pool dimension; they use the small-pool slots.
OVERSIZE_ALLOCATIONS, OVERSIZE_SEGMENTS = (72, 80)
_ARRAYS = 88
NUM_ALLOC_RETRIES, NUM_OOMS, NUM_SYNC_ALL_STREAMS, NUM_DEVICE_ALLOC, NUM_DEVICE_FREE = range(88, 93)
SLOTS = 93
_SCALARS = {
    "num_alloc_retries": NUM_ALLOC_RETRIES,
    "num_ooms": NUM_OOMS,
    "num_sync_all_streams": NUM_SYNC_ALL_STREAMS,
    "num_device_alloc": NUM_DEVICE_ALLOC,
    "num_device_free": NUM_DEVICE_FREE,
}
_POOLS = ("all", "small_pool", "large_pool")


def inc(s: list[int], base: int, pool: int, n: int) -> None:
    """Increase a statistic of ``pool`` (0 small, 1 large) by ``n``."""
    i = base + pool
    c = s[i] + n
    s[i] = c
    s[i + 4] += n
    if c > s[i + 2]:
        s[i + 2] = c
    c += s[base + 1 - pool]
    if c > s[base + 6]:
        s[base + 6] = c


#: Offsets of a statistic's slots from its base (see the layout above).
PEAK, TOTAL, PEAK_ALL = 2, 4, 6


# The two helpers below raise several statistics at once, written out in full:
# they run on every allocation, and a call per statistic would cost more than
# the arithmetic.


def add_allocation(s: list[int], kind: int, size: int, nbytes: int) -> None:
    """A block of ``size`` bytes (``nbytes`` asked for) was allocated from pool ``kind``
    (0 small, 1 large): ``allocation``, ``allocated_bytes`` and ``requested_bytes``
    rise, with their peaks, and the ``active`` peaks while blocks are pending."""
    other = 1 - kind
    i = ALLOCATION + kind
    c = s[i] + 1
    s[i] = c
    s[i + TOTAL] += 1
    if c > s[i + PEAK]:
        s[i + PEAK] = c
    c += s[ALLOCATION + other]
    if c > s[ALLOCATION + PEAK_ALL]:
        s[ALLOCATION + PEAK_ALL] = c
    i = ALLOCATED_BYTES + kind
    c = s[i] + size
    s[i] = c
    s[i + TOTAL] += size
    if c > s[i + PEAK]:
        s[i + PEAK] = c
    c += s[ALLOCATED_BYTES + other]
    if c > s[ALLOCATED_BYTES + PEAK_ALL]:
        s[ALLOCATED_BYTES + PEAK_ALL] = c
    i = REQUESTED_BYTES + kind
    c = s[i] + nbytes
    s[i] = c
    s[i + TOTAL] += nbytes
    if c > s[i + PEAK]:
        s[i + PEAK] = c
    c += s[REQUESTED_BYTES + other]
    if c > s[REQUESTED_BYTES + PEAK_ALL]:
        s[REQUESTED_BYTES + PEAK_ALL] = c
    if s[ACTIVE] or s[ACTIVE + 1]:
        # active = allocated + pending: its peak needs a look only while some block is pending
        note_active_peak(s, kind)


def add_inactive_split(s: list[int], kind: int, size: int) -> None:
    """A free block of ``size`` bytes of pool ``kind`` now sits in a split segment:
    ``inactive_split`` and ``inactive_split_bytes`` rise."""
    other = 1 - kind
    i = INACTIVE_SPLIT + kind
    c = s[i] + 1
    s[i] = c
    s[i + TOTAL] += 1
    if c > s[i + PEAK]:
        s[i + PEAK] = c
    c += s[INACTIVE_SPLIT + other]
    if c > s[INACTIVE_SPLIT + PEAK_ALL]:
        s[INACTIVE_SPLIT + PEAK_ALL] = c
    i = INACTIVE_SPLIT_BYTES + kind
    c = s[i] + size
    s[i] = c
    s[i + TOTAL] += size
    if c > s[i + PEAK]:
        s[i + PEAK] = c
    c += s[INACTIVE_SPLIT_BYTES + other]
    if c > s[INACTIVE_SPLIT_BYTES + PEAK_ALL]:
        s[INACTIVE_SPLIT_BYTES + PEAK_ALL] = c


def drop_allocation(s: list[int], kind: int, size: int) -> None:
    """The caller freed a block of ``size`` bytes of pool ``kind`` (requested bytes
    fall when the memory is free for reuse: :func:`drop_requested`)."""
    s[ALLOCATION + kind] -= 1
    s[ALLOCATED_BYTES + kind] -= size


def add_pending(s: list[int], kind: int, size: int) -> None:
    """A freed block waits for other streams: still active, no longer allocated."""
    s[ACTIVE + kind] += 1
    s[ACTIVE_BYTES + kind] += size


def drop_pending(s: list[int], kind: int, size: int) -> None:
    s[ACTIVE + kind] -= 1
    s[ACTIVE_BYTES + kind] -= size


def drop_requested(s: list[int], kind: int, nbytes: int) -> None:
    s[REQUESTED_BYTES + kind] -= nbytes


def drop_inactive_split(s: list[int], kind: int, size: int) -> None:
    s[INACTIVE_SPLIT + kind] -= 1
    s[INACTIVE_SPLIT_BYTES + kind] -= size


_DERIVED = {16: 0, 48: 32}  # active -> allocation, active_bytes -> allocated_bytes


def note_active_peak(s: list[int], kind: int) -> None:
    """After an allocation while blocks are pending: raise the active peaks."""
    other = 1 - kind
    for base, of in ((16, 0), (48, 32)):
        mine = s[of + kind] + s[base + kind]
        if mine > s[base + 2 + kind]:
            s[base + 2 + kind] = mine
        every = mine + s[of + other] + s[base + other]
        if every > s[base + 6]:
            s[base + 6] = every


class Stats:
    """The counters of one device allocator (the caller holds its lock)."""

    __slots__ = ("s", "_offsets")

    def __init__(self) -> None:
        self.s = [0] * SLOTS
        # total-increase and freed values at the last reset_accumulated, per (base, pool)
        self._offsets = [0] * SLOTS

    def current(self, base: int, pool: int | None = None) -> int:
        if pool is None:
            return self.current(base, 0) + self.current(base, 1)
        s = self.s
        of = _DERIVED.get(base)
        return s[base + pool] if of is None else s[of + pool] + s[base + pool]

    def _peak(self, base: int, pool: int) -> int:
        s = self.s
        of = _DERIVED.get(base)
        return s[base + 2 + pool] if of is None else max(s[base + 2 + pool], s[of + 2 + pool])

    def _total(self, base: int, pool: int) -> int:
        return self.s[_DERIVED.get(base, base) + 4 + pool]

    def reset_peak(self) -> None:
        s = self.s
        for base in range(0, _ARRAYS, 8):
            s[base + 2], s[base + 3] = self.current(base, 0), self.current(base, 1)
            s[base + 6] = self.current(base)

    def reset_accumulated(self) -> None:
        off = self._offsets
        for base in range(0, _ARRAYS, 8):
            for pool in (0, 1):
                total = self._total(base, pool)
                off[base + 4 + pool] = total  # allocated restarts at 0
                off[base + pool] = total - self.current(base, pool)  # freed restarts at 0
        for index in _SCALARS.values():
            self.s[index] = 0

    def _metrics(self, base: int, pool: int) -> tuple[int, int, int, int]:
        off = self._offsets
        current = self.current(base, pool)
        total = self._total(base, pool)
        allocated = total - off[base + 4 + pool]
        freed = total - current - off[base + pool]
        return current, self._peak(base, pool), allocated, freed

    def _peak_all(self, base: int) -> int:
        of = _DERIVED.get(base)
        return self.s[base + 6] if of is None else max(self.s[base + 6], self.s[of + 6])

    def as_dict(self, max_split_size: int) -> OrderedDict[str, int]:
        """Flat ``<stat>.<pool>.<metric>`` keys plus the scalars, sorted like
        ``torch.accelerator.memory_stats``."""
        out: dict[str, int] = {}
        for k, name in enumerate(STAT_NAMES):
            base = 8 * k
            small = self._metrics(base, 0)
            large = self._metrics(base, 1)
            every = (small[0] + large[0], self._peak_all(base), small[2] + large[2], small[3] + large[3])
            for pool, values in zip(_POOLS, (every, small, large)):
                for metric, value in zip(("current", "peak", "allocated", "freed"), values):
                    out[f"{name}.{pool}.{metric}"] = value
        for name, base in (("oversize_allocations", OVERSIZE_ALLOCATIONS), ("oversize_segments", OVERSIZE_SEGMENTS)):
            for metric, value in zip(("current", "peak", "allocated", "freed"), self._metrics(base, 0)):
                out[f"{name}.{metric}"] = value
        for name, index in _SCALARS.items():
            out[name] = self.s[index]
        out["max_split_size"] = max_split_size
        return OrderedDict(sorted(out.items()))
