"""Out-of-memory reports: PyTorch's information, a fragmentation measure, fitting advice."""

from __future__ import annotations

from dataclasses import dataclass

from accel._errors import OutOfMemoryError
from accel._units import format_size

__all__ = ["OutOfMemoryDetails", "out_of_memory"]


@dataclass(frozen=True)
class OutOfMemoryDetails:
    """The state of a device allocator when a request failed (bytes unless noted).

    Attached to the error as ``details``. ``fragmentation`` is the share of
    cached free memory outside the largest free block: 0 when the free cache
    is one piece (or empty), near 1 when it is scattered.
    """

    device: str
    requested: int
    total: int
    free: int
    allowed: int | None
    fraction: float | None
    allocated: int
    reserved: int
    private_pools: int
    private_reserved: int
    largest_free_block: int
    cached_free: int
    expandable_segments: bool
    capturing: bool
    fraction_refused: bool = False  # the memory fraction, not the device, refused the growth
    refusal: str = ""  # the device's own error when it refused (it may name a cause other than memory)
    # Reserved (and of it, allocated) by dropped MemPools of the device, which the
    # numbers above (this allocator's) leave out.
    dropped_pools: int = 0
    dropped_pools_allocated: int = 0
    # Reserved (and of it, allocated) by the device's live MemPools other than the one
    # allocating, and by its other allocators (the device's own, when a MemPool's ran
    # short): accel's memory too, which the numbers of this allocator leave out.
    mempools: int = 0
    mempools_allocated: int = 0
    others: int = 0
    others_allocated: int = 0

    @property
    def reserved_unallocated(self) -> int:
        return self.reserved - self.allocated

    @property
    def mempools_cached(self) -> int:
        """What the live MemPools cache unallocated (their ``empty_cache()`` gives it back)."""
        return self.mempools - self.mempools_allocated

    @property
    def others_cached(self) -> int:
        """What the device's other allocators cache unallocated (``accel.memory.empty_cache()``)."""
        return self.others - self.others_allocated

    @property
    def fragmentation(self) -> float:
        if self.cached_free == 0:
            return 0.0
        return 1.0 - self.largest_free_block / self.cached_free


def _advice(d: OutOfMemoryDetails) -> str:
    if d.fraction_refused and d.free >= d.requested:
        return (
            f"The per-process memory fraction ({d.fraction:g}) is what stops this request: raise it "
            "with accel.memory.set_per_process_memory_fraction() or per_process_memory_fraction in "
            "ACCEL_ALLOC_CONF."
        )
    tips = []
    if d.capturing:
        tips.append(
            "A graph capture is under way, so the cache was not flushed to make room; allocate "
            "before capturing, or capture a smaller batch."
        )
    if d.private_reserved and d.private_reserved >= d.requested:
        tips.append(
            f"{format_size(d.private_reserved)} is held by graph private pools: delete graphs you "
            "no longer replay, or share one pool between graphs (accel.memory.graph_pool_handle())."
        )
    if d.dropped_pools_allocated and d.dropped_pools_allocated + d.free >= d.requested:
        tips.append(
            f"Buffers of dropped MemPools hold {format_size(d.dropped_pools_allocated)}: free those "
            "you no longer need, and their pools' memory goes back."
        )
    if d.mempools_cached and d.mempools_cached + d.free >= d.requested:
        tips.append(
            f"MemPools of this device cache {format_size(d.mempools_cached)} they do not use: call "
            "empty_cache() on those you can spare (pool.empty_cache()), or drop pools you no longer use."
        )
    if d.others_cached and d.others_cached + d.free >= d.requested:
        tips.append(
            f"The device's allocator caches {format_size(d.others_cached)} outside this MemPool: "
            "call accel.memory.empty_cache()."
        )
    # Fragmentation is the cause when the request would fit in the cached free
    # memory plus what the device still has, had the cache been one piece.
    large_waste = d.reserved_unallocated > 0 and d.reserved_unallocated + d.free >= d.requested
    if large_waste and not d.expandable_segments:
        tips.append(
            "Reserved but unallocated memory is large: set ACCEL_ALLOC_CONF=expandable_segments:True "
            "to avoid fragmentation."
        )
    elif large_waste:
        tips.append(
            "Cached memory is fragmented even with expandable segments: free long-lived buffers "
            "allocated between short-lived ones, or call accel.memory.empty_cache() after large "
            "temporary use."
        )
    if not tips:
        tips.append("Free buffers you no longer need, or allocate less (a smaller batch).")
    return " ".join(tips)


def out_of_memory(d: OutOfMemoryDetails, device: int) -> OutOfMemoryError:
    """The error the caching allocator raises; ``details`` holds the numbers."""
    backend = d.device.partition(":")[0]
    text = (
        f"{backend} out of memory. Tried to allocate {format_size(d.requested)}. Device {d.device} "
        f"has a total capacity of {format_size(d.total)} of which {format_size(d.free)} is free. "
    )
    if d.allowed is not None:
        text += f"{format_size(d.allowed)} allowed; "
    allocated = d.allocated + d.mempools_allocated + d.others_allocated
    unallocated = d.reserved_unallocated + d.mempools_cached + d.others_cached
    text += f"Of the allocated memory {format_size(allocated)} is allocated by accel, "
    if d.private_pools:
        text += f"with {format_size(d.private_pools)} allocated in private pools (graph capture), "
    text += f"and {format_size(unallocated)} is reserved by accel but unallocated. "
    if d.mempools:
        text += (
            f"Of accel's memory, MemPools of this device in use reserve {format_size(d.mempools)} "
            f"({format_size(d.mempools_allocated)} allocated). "
        )
    if d.others:
        text += (
            f"Of accel's memory, the device's allocator outside this MemPool reserves {format_size(d.others)} "
            f"({format_size(d.others_allocated)} allocated). "
        )
    text += (
        f"The largest free cached block is {format_size(d.largest_free_block)}; fragmentation "
        f"{d.fragmentation:.2f}. "
    )
    if d.dropped_pools:
        text += (
            f"Dropped MemPools of this device still reserve {format_size(d.dropped_pools)}, of which "
            f"{format_size(d.dropped_pools_allocated)} is allocated (a dropped pool's memory goes back "
            "once its buffers are freed). "
        )
    if d.refusal:
        text += f"The device said: {d.refusal.rstrip('.')}. "
    text += _advice(d)
    error = OutOfMemoryError(text, requested=d.requested, device=device)
    error.details = d  # type: ignore[attr-defined]
    return error
