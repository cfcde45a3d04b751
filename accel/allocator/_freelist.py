"""A pool's free blocks of one stream, ordered by ``(size, ptr)``: best fit in O(log n).

A plain sorted list costs O(n) per insertion or removal (a memmove of the
whole list), and a cache with 100,000 holes made every allocate+free pair
several times slower. Here the keys live in sorted buckets of at most
``2 * LOAD`` entries, with the last key of each bucket in ``maxes``: a search
is two bisections, an update a bisection and a memmove of one bucket. Keys are
one int, ``size << 64 | ptr``, which orders exactly as ``(size, ptr)`` and
compares faster than a tuple.

>>> from types import SimpleNamespace as B
>>> free = FreeList()
>>> for size, ptr in ((4096, 0x2000), (512, 0x1000), (4096, 0x1000)):
...     free.add(B(size=size, ptr=ptr))
>>> hex(free.best_fit(1024).ptr), len(free)
('0x1000', 3)
>>> [(s, hex(p)) for s, p, _ in free]
[(512, '0x1000'), (4096, '0x1000'), (4096, '0x2000')]
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from accel.allocator._blocks import Block

__all__ = ["FreeList"]

LOAD = 256  # a bucket is split in two when it grows past 2 * LOAD keys
_SHIFT = 64  # ptr bits in a key: every address fits
_ABOVE_ALL = 1 << 128  # above every key


class FreeList:
    """Free blocks keyed by ``(size, ptr)``, which is unique among free blocks.

    A block's ``size`` and ``ptr`` must not change while it is on the list:
    take it off first. Iterating or indexing gives ``(size, ptr, block)``
    tuples in order (the layout of the sorted lists this replaced).
    """

    __slots__ = ("_keys", "_blocks", "_maxes", "_len")

    def __init__(self) -> None:
        self._keys: list[list[int]] = []  # sorted buckets of keys
        self._blocks: list[list[Block]] = []  # the blocks, bucket by bucket, in key order
        self._maxes: list[int] = []  # the last key of each bucket
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def add(self, block: Block) -> None:
        key = block.size << _SHIFT | block.ptr
        self._len += 1
        maxes = self._maxes
        k = bisect_left(maxes, key)
        if k == len(maxes):
            if not maxes:
                self._keys.append([key])
                self._blocks.append([block])
                maxes.append(key)
                return
            k -= 1
            keys = self._keys[k]
            keys.append(key)
            self._blocks[k].append(block)
            maxes[k] = key
        else:
            keys = self._keys[k]
            i = bisect_left(keys, key)
            keys.insert(i, key)
            self._blocks[k].insert(i, block)
        if len(keys) > 2 * LOAD:
            blocks = self._blocks[k]
            self._keys.insert(k + 1, keys[LOAD:])
            self._blocks.insert(k + 1, blocks[LOAD:])
            del keys[LOAD:], blocks[LOAD:]
            maxes.insert(k, keys[-1])

    def remove(self, block: Block) -> None:
        """Take ``block`` off the list (ValueError when it is not on it)."""
        key = block.size << _SHIFT | block.ptr
        maxes = self._maxes
        k = bisect_left(maxes, key)
        if k == len(maxes):
            raise ValueError(f"{block!r} is not on this free list")
        keys = self._keys[k]
        i = bisect_left(keys, key)
        if keys[i] != key:
            raise ValueError(f"{block!r} is not on this free list")
        self._len -= 1
        if len(keys) == 1:
            del self._keys[k], self._blocks[k], maxes[k]
            return
        del keys[i], self._blocks[k][i]
        if i == len(keys):
            maxes[k] = keys[-1]

    def replace(self, size: int, ptr: int, block: Block) -> None:
        """Take the block listed as ``(size, ptr)`` off the list and put ``block`` on it
        under its current size and address: in place when the new key sorts into the
        same slot, as when a free block gives way to its rest after a split, or grows
        by a merge."""
        key = size << _SHIFT | ptr
        new_key = block.size << _SHIFT | block.ptr
        maxes = self._maxes
        k = bisect_left(maxes, key)
        buckets = self._keys
        if k < len(buckets):
            keys = buckets[k]
            i = bisect_left(keys, key)
            if keys[i] == key:
                # In place when the new key still sorts between its neighbours; only
                # the side it moved towards needs a look (a split shrinks the key,
                # a merge grows it).
                if new_key < key:
                    fits = (keys[i - 1] if i else (maxes[k - 1] if k else -1)) < new_key
                else:
                    fits = i + 1 < len(keys) and new_key < keys[i + 1] or (
                        i + 1 == len(keys) and (k + 1 == len(buckets) or new_key < buckets[k + 1][0])
                    )
                if fits:
                    keys[i] = new_key
                    self._blocks[k][i] = block
                    if maxes[k] == key:
                        maxes[k] = new_key
                    return
                last = len(keys) - 1
                self._len -= 1
                if last == 0:
                    del buckets[k], self._blocks[k], maxes[k]
                else:
                    del keys[i], self._blocks[k][i]
                    if i == last:
                        maxes[k] = keys[-1]
                self.add(block)
                return
        raise ValueError(f"no block of {size} bytes at {ptr:#x} is on this free list")

    def best_fit(self, size: int) -> Block | None:
        """The block with the smallest ``(size, ptr)`` of at least ``size`` bytes, left on
        the list; None when every block is smaller."""
        key = size << _SHIFT
        maxes = self._maxes
        k = bisect_left(maxes, key)
        if k == len(maxes):
            return None
        return self._blocks[k][bisect_left(self._keys[k], key)]

    def at_least(self, size: int) -> Iterator[Block]:
        """The blocks of at least ``size`` bytes, smallest first (do not change the list
        while iterating)."""
        key = size << _SHIFT
        k = bisect_left(self._maxes, key)
        for j in range(k, len(self._keys)):
            blocks = self._blocks[j]
            yield from blocks[bisect_left(self._keys[j], key) :] if j == k else blocks

    def largest(self) -> int:
        """The size of the largest block (0 when empty)."""
        return self._maxes[-1] >> _SHIFT if self._maxes else 0

    def __iter__(self) -> Iterator[tuple[int, int, Block]]:
        for keys, blocks in zip(self._keys, self._blocks):
            for key, block in zip(keys, blocks):
                yield key >> _SHIFT, block.ptr, block

    def __getitem__(self, index: int) -> tuple[int, int, Block]:
        """The ``index``-th ``(size, ptr, block)``: O(number of buckets), for tests and
        diagnostics (the allocator itself never indexes)."""
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("FreeList index out of range")
        for keys, blocks in zip(self._keys, self._blocks):
            if index < len(keys):
                return keys[index] >> _SHIFT, blocks[index].ptr, blocks[index]
            index -= len(keys)
        raise AssertionError("bucket lengths disagree with the block count")

    def __eq__(self, other: object) -> bool:
        if isinstance(other, FreeList):
            return list(self) == list(other)
        if isinstance(other, list):
            return list(self) == other
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"<FreeList {len(self)} blocks>"
