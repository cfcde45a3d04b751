"""Allocator statistics in PyTorch's key scheme.

The five statistics every allocate+free pair changes (``allocation``,
``allocated_bytes``, ``requested_bytes``, ``inactive_split``,
``inactive_split_bytes``) are attributes of one :class:`Counts` per pool kind:
updating a slot attribute costs about half of updating a list slot by a
computed index, and these updates were a fifth of the pair. The other
statistics live in one flat list of ints, where each statistic owns 8 slots::

    base+0 current (small pool)      base+1 current (large pool)
    base+2 peak (small)              base+3 peak (large)
    base+4 total increase (small)    base+5 total increase (large)
    base+6 peak (all pools)          base+7 unused

(the slots of the five statistics above are unused). "freed" is derived
(total increase - current), so a decrease is one subtraction;
``reset_accumulated`` stores offsets instead of touching the counters. The
``all`` pool is the sum of small and large except its peak, which is tracked
on its own.

``active`` and ``active_bytes`` are derived too: active = allocated + pending
(blocks freed by the caller that wait for other streams). Their slots hold the
pending counts, and their peak slots the peaks seen while something was
pending; when nothing is pending, active equals allocated, whose peak already
covers it. So the allocation hot path updates three statistics, not five.
"""

from __future__ import annotations

from collections import OrderedDict

__all__ = ["STAT_NAMES", "Counts", "Stats"]

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
_SUFFIX = {0: "", PEAK: "_peak", TOTAL: "_total"}  # the Counts attribute of a metric


#: The statistics kept as :class:`Counts` attributes, by base.
HOT = {
    ALLOCATION: "allocation",
    ALLOCATED_BYTES: "allocated_bytes",
    REQUESTED_BYTES: "requested_bytes",
    INACTIVE_SPLIT: "inactive_split",
    INACTIVE_SPLIT_BYTES: "inactive_split_bytes",
}


class Every:
    """The peaks of the hot statistics over both pool kinds."""

    __slots__ = (
        "allocation_peak", "allocated_bytes_peak", "requested_bytes_peak", "inactive_split_peak",
        "inactive_split_bytes_peak",
    )  # fmt: skip

    def __init__(self) -> None:
        self.allocation_peak = self.allocated_bytes_peak = self.requested_bytes_peak = 0
        self.inactive_split_peak = self.inactive_split_bytes_peak = 0


class Counts:
    """The hot statistics of one pool kind (0 small, 1 large): per statistic its
    current value, its peak and its total increase. ``other`` is the other kind's
    Counts and ``every`` the peaks over both, for the ``all`` pool's peak."""

    __slots__ = (
        "allocation", "allocation_peak", "allocation_total",
        "allocated_bytes", "allocated_bytes_peak", "allocated_bytes_total",
        "requested_bytes", "requested_bytes_peak", "requested_bytes_total",
        "inactive_split", "inactive_split_peak", "inactive_split_total",
        "inactive_split_bytes", "inactive_split_bytes_peak", "inactive_split_bytes_total",
        "kind", "other", "every",
    )  # fmt: skip

    def __init__(self, kind: int, every: Every) -> None:
        self.allocation = self.allocation_peak = self.allocation_total = 0
        self.allocated_bytes = self.allocated_bytes_peak = self.allocated_bytes_total = 0
        self.requested_bytes = self.requested_bytes_peak = self.requested_bytes_total = 0
        self.inactive_split = self.inactive_split_peak = self.inactive_split_total = 0
        self.inactive_split_bytes = self.inactive_split_bytes_peak = self.inactive_split_bytes_total = 0
        self.kind = kind
        self.other = self  # set to the other kind's Counts by Stats
        self.every = every


# The helpers below raise several statistics at once, written out in full:
# they run on every allocation, and a call per statistic would cost more than
# the arithmetic.


def add_allocation(k: Counts, s: list[int], size: int, nbytes: int) -> None:
    """A block of ``size`` bytes (``nbytes`` asked for) was allocated from pool kind
    ``k``: ``allocation``, ``allocated_bytes`` and ``requested_bytes`` rise, with
    their peaks, and the ``active`` peaks (in ``s``) while blocks are pending."""
    o = k.other
    every = k.every
    c = k.allocation + 1
    k.allocation = c
    k.allocation_total += 1
    if c > k.allocation_peak:
        k.allocation_peak = c
    c += o.allocation
    if c > every.allocation_peak:
        every.allocation_peak = c
    c = k.allocated_bytes + size
    k.allocated_bytes = c
    k.allocated_bytes_total += size
    if c > k.allocated_bytes_peak:
        k.allocated_bytes_peak = c
    c += o.allocated_bytes
    if c > every.allocated_bytes_peak:
        every.allocated_bytes_peak = c
    c = k.requested_bytes + nbytes
    k.requested_bytes = c
    k.requested_bytes_total += nbytes
    if c > k.requested_bytes_peak:
        k.requested_bytes_peak = c
    c += o.requested_bytes
    if c > every.requested_bytes_peak:
        every.requested_bytes_peak = c
    if s[ACTIVE] or s[ACTIVE + 1]:
        # active = allocated + pending: its peak needs a look only while some block is pending
        note_active_peak(k, s)


def add_inactive_split(k: Counts, size: int) -> None:
    """A free block of ``size`` bytes of pool kind ``k`` now sits in a split segment:
    ``inactive_split`` and ``inactive_split_bytes`` rise."""
    c = k.inactive_split + 1
    k.inactive_split = c
    k.inactive_split_total += 1
    if c > k.inactive_split_peak:
        k.inactive_split_peak = c
    c += k.other.inactive_split
    if c > k.every.inactive_split_peak:
        k.every.inactive_split_peak = c
    c = k.inactive_split_bytes + size
    k.inactive_split_bytes = c
    k.inactive_split_bytes_total += size
    if c > k.inactive_split_bytes_peak:
        k.inactive_split_bytes_peak = c
    c += k.other.inactive_split_bytes
    if c > k.every.inactive_split_bytes_peak:
        k.every.inactive_split_bytes_peak = c


def drop_allocation(k: Counts, size: int) -> None:
    """The caller freed a block of ``size`` bytes of pool kind ``k`` (requested bytes
    fall when the memory is free for reuse)."""
    k.allocation -= 1
    k.allocated_bytes -= size


def add_pending(s: list[int], kind: int, size: int) -> None:
    """A freed block waits for other streams: still active, no longer allocated."""
    s[ACTIVE + kind] += 1
    s[ACTIVE_BYTES + kind] += size


def drop_pending(s: list[int], kind: int, size: int) -> None:
    s[ACTIVE + kind] -= 1
    s[ACTIVE_BYTES + kind] -= size


def drop_inactive_split(k: Counts, size: int) -> None:
    k.inactive_split -= 1
    k.inactive_split_bytes -= size


_DERIVED = {16: 0, 48: 32}  # active -> allocation, active_bytes -> allocated_bytes


def note_active_peak(k: Counts, s: list[int]) -> None:
    """After an allocation while blocks are pending: raise the active peaks."""
    kind = k.kind
    o = k.other
    for base, mine, theirs in (
        (ACTIVE, k.allocation, o.allocation),
        (ACTIVE_BYTES, k.allocated_bytes, o.allocated_bytes),
    ):
        mine += s[base + kind]
        if mine > s[base + 2 + kind]:
            s[base + 2 + kind] = mine
        every = mine + theirs + s[base + 1 - kind]
        if every > s[base + 6]:
            s[base + 6] = every


class Stats:
    """The counters of one device allocator (the caller holds its lock)."""

    __slots__ = ("s", "kinds", "every", "_offsets")

    def __init__(self) -> None:
        self.s = [0] * SLOTS
        self.every = Every()
        small, large = self.kinds = (Counts(0, self.every), Counts(1, self.every))
        small.other, large.other = large, small
        # total-increase and freed values at the last reset_accumulated, per (base, pool)
        self._offsets = [0] * SLOTS

    def _raw(self, base: int, pool: int, metric: int) -> int:
        """Slot ``base + metric + pool`` (metric 0 current, PEAK or TOTAL), wherever it is kept."""
        name = HOT.get(base)
        if name is None:
            return self.s[base + metric + pool]
        return getattr(self.kinds[pool], name + _SUFFIX[metric])  # type: ignore[no-any-return]

    def current(self, base: int, pool: int | None = None) -> int:
        if pool is None:
            return self.current(base, 0) + self.current(base, 1)
        of = _DERIVED.get(base)
        return self._raw(base, pool, 0) if of is None else self._raw(of, pool, 0) + self.s[base + pool]

    def _peak(self, base: int, pool: int) -> int:
        of = _DERIVED.get(base)
        peak = self._raw(base, pool, PEAK)
        return peak if of is None else max(peak, self._raw(of, pool, PEAK))

    def _total(self, base: int, pool: int) -> int:
        return self._raw(_DERIVED.get(base, base), pool, TOTAL)

    def _raw_peak_all(self, base: int) -> int:
        name = HOT.get(base)
        if name is None:
            return self.s[base + PEAK_ALL]
        return getattr(self.every, name + "_peak")  # type: ignore[no-any-return]

    def reset_peak(self) -> None:
        s = self.s
        for base in range(0, _ARRAYS, 8):
            name = HOT.get(base)
            if name is None:
                s[base + 2], s[base + 3] = self.current(base, 0), self.current(base, 1)
                s[base + 6] = self.current(base)
            else:
                for pool in (0, 1):
                    setattr(self.kinds[pool], name + "_peak", self.current(base, pool))
                setattr(self.every, name + "_peak", self.current(base))

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
        peak = self._raw_peak_all(base)
        return peak if of is None else max(peak, self._raw_peak_all(of))

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
