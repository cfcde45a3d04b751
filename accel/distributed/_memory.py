"""Memory for collectives: :func:`comm_pool` and :func:`exchange_buffers`."""

from __future__ import annotations

import os
import pickle
import socket
from typing import TYPE_CHECKING, Any

from accel._device import DeviceLike
from accel._errors import AccelError, InvalidHandleError, InvalidValueError, NotSupportedError, OutOfMemoryError
from accel._runtime import get_runtime
from accel._torch import import_torch
from accel.allocator import Buffer, MemoryResource, MemPool
from accel.backends.base import TorchIntegration
from accel.graph._torch_graphs import torch_device_type

if TYPE_CHECKING:
    import torch

__all__ = ["comm_pool", "exchange_buffers"]


def _process_group(group: Any, call: str) -> Any:
    """``group``, or the default process group; an error when torch.distributed is not set up."""
    dist = import_torch().distributed
    if not dist.is_available():
        raise NotSupportedError(f"{call}: this torch build has no torch.distributed")
    if group is None:
        if not dist.is_initialized():
            raise InvalidValueError(
                f"{call}: torch.distributed has no default process group; call "
                "torch.distributed.init_process_group first, or pass group="
            )
        return dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise InvalidValueError(f"{call}: group={group!r} is not a torch.distributed ProcessGroup")
    return group


def comm_pool(group: Any = None, device: DeviceLike = None) -> MemPool:
    """A memory pool for the buffers of ``group``'s collectives (default: the default
    process group) on ``device`` (default: the current device).

    On CUDA its memory comes from the communication backend's own allocator
    (NCCL's ``ncclMemAlloc``, through torch's ``MemPool(backend.mem_allocator)``)
    and is registered with the backend (``register_mem_pool``), which lets NCCL
    use zero-copy algorithms on it; its buffers cannot be shared with other
    processes. Where the backend has no allocator of its own (the host, Gloo),
    it is a plain :class:`~accel.memory.MemPool`. Create it once per group and
    device, and allocate from it with :func:`~accel.memory.use_mem_pool`.

    >>> import tempfile, torch.distributed as dist, accel, accel.distributed
    >>> if not dist.is_initialized():
    ...     dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    >>> pool = accel.distributed.comm_pool()
    >>> with accel.memory.use_mem_pool(pool):
    ...     grads = accel.empty(1024)
    >>> pool.memory_stats()["allocation.all.current"]
    1
    """
    pg = _process_group(group, "comm_pool")
    runtime = get_runtime()
    index = runtime.index(device)
    backend = runtime.backend
    device_type = backend.torch_device_type
    if (
        backend.torch_integration is TorchIntegration.SHARED_STREAMS
        and device_type is not None
        and torch_device_type(device_type) is not None
    ):
        torch = import_torch()
        comm = pg._get_backend(torch.device(device_type, index))
        if hasattr(comm, "mem_allocator"):
            return MemPool(upstream=_RegisteredPool(torch, device_type, index, comm))
    pool = MemPool()
    pool.allocator(index)  # refuses a device the pool cannot serve now
    return pool


class _RegisteredPool(MemoryResource):
    """Device memory from torch's ``MemPool`` over a communication backend's allocator,
    registered with that backend (not verified on a GPU here: see docs/distributed.md).

    torch registers the segments a pool holds when the pool is registered, and
    refuses a segment registered twice; so after each new allocation the pool is
    registered again from scratch. That is rare: accel's caching allocator
    asks for a new segment only when its cache cannot serve a request."""

    def __init__(self, torch: Any, device_type: str, device: int, comm: Any) -> None:
        self.device = device
        self._torch = torch
        self._module = getattr(torch, device_type)
        self._torch_device = torch.device(device_type, device)
        self._comm = comm
        self._pool = self._module.MemPool(comm.mem_allocator)
        self._registered = False
        self._tensors: dict[int, torch.Tensor] = {}  # address -> the tensor that holds the memory

    def __repr__(self) -> str:
        return f"accel.distributed comm pool over {type(self._comm).__name__}'s allocator on {self._torch_device}"

    def allocate(self, nbytes: int) -> int:
        torch = self._torch
        try:
            with self._module.use_mem_pool(self._pool, device=self._torch_device):
                tensor = torch.empty(nbytes, dtype=torch.uint8, device=self._torch_device)
        except torch.OutOfMemoryError as exc:
            raise OutOfMemoryError(
                f"{self!r}: the communication backend's allocator has no {nbytes} bytes left ({exc})",
                requested=nbytes, device=self.device,
            ) from None
        ptr = int(tensor.data_ptr())
        self._tensors[ptr] = tensor
        if self._registered:
            self._comm.deregister_mem_pool(self._pool)
        self._comm.register_mem_pool(self._pool)
        self._registered = True
        return ptr

    def deallocate(self, ptr: int, nbytes: int) -> None:
        del self._tensors[ptr]  # back to torch's pool, still registered

    def memory_info(self) -> tuple[int, int]:
        free, total = self._module.mem_get_info(self._torch_device)
        return int(free), int(total)


def _node() -> str:
    """What processes that can open each other's exports share: the machine (its boot)
    and the network namespace, which holds the brokers' abstract socket names."""
    parts = [socket.gethostname()]
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            parts.append(f.read().strip())
        parts.append(str(os.stat("/proc/self/ns/net").st_ino))
    except OSError:
        pass
    return "/".join(parts)


def exchange_buffers(buffer: Buffer, group: Any = None) -> list[Buffer]:
    """Every rank of ``group`` (default: the default process group) gives its
    ``buffer`` and gets every rank's, without copies: entry ``i`` maps rank
    ``i``'s memory (this rank's entry is ``buffer`` itself).

    A collective call: every rank of the group must make it. The ranks must
    run on one machine (pickling a buffer shares its memory with processes
    there, see docs/distributed.md); each entry is opened on this process's
    current stream of the exporter's device. When it returns, every
    rank has opened every buffer, so each may free its own: its memory stays
    until the others free theirs. A rank that cannot export or open fails the
    call on every rank, naming the rank, instead of leaving the others waiting.

    >>> import tempfile, torch.distributed as dist, accel, accel.distributed
    >>> if not dist.is_initialized():
    ...     dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    >>> buf = accel.memory.allocate(4096)
    >>> peers = accel.distributed.exchange_buffers(buf)
    >>> peers[dist.get_rank()] is buf
    True
    """
    if not isinstance(buffer, Buffer):
        raise InvalidValueError(f"exchange_buffers(buffer={buffer!r}): pass an accel.memory.Buffer")
    pg = _process_group(group, "exchange_buffers")
    dist = import_torch().distributed
    rank, size = dist.get_rank(pg), dist.get_world_size(pg)
    if rank < 0:
        raise InvalidValueError("exchange_buffers: this process is not a member of the group")
    own: AccelError | None = None
    try:
        mine: tuple[str, str, bytes] = (_node(), "", pickle.dumps(buffer))
    except AccelError as exc:  # freed, from foreign memory, a backend without IPC
        own = exc
        mine = (_node(), f"{type(exc).__name__}: {exc}", b"")
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, mine, group=pg)
    # Every rank checks the same list, so all of them fail together (none is left in a collective).
    _raise_first(own, [(r, why) for r, (_, why, _) in enumerate(gathered) if why], "export its buffer")
    nodes = {node for node, _, _ in gathered}
    if len(nodes) > 1:
        raise NotSupportedError(
            f"exchange_buffers: the ranks run on {len(nodes)} machines (or network namespaces); accel "
            "shares memory between processes of one machine only. Exchange within a node's group "
            "(torch.distributed.new_subgroups()), or communicate with collectives"
        )
    opened: list[Buffer] = []
    failure = ""
    for r, (_, _, data) in enumerate(gathered):
        if r == rank:
            opened.append(buffer)
            continue
        try:
            opened.append(pickle.loads(data))
        except AccelError as exc:
            own, failure = exc, f"{type(exc).__name__} opening rank {r}'s buffer: {exc}"
            break
    # The second round is also a barrier: no rank returns (and may free its buffer,
    # which it must keep until every importer has opened it) before all have opened.
    status: list[Any] = [None] * size
    dist.all_gather_object(status, failure, group=pg)
    failed = [(r, why) for r, why in enumerate(status) if why]
    if failed:
        for peer in opened:
            if peer is not buffer:
                peer.free()
        _raise_first(own, failed, "open the buffers")
    return opened


def _raise_first(own: AccelError | None, failed: list[tuple[int, str]], what: str) -> None:
    """Raise this rank's own error, or one naming the first rank that failed to do ``what``."""
    if not failed:
        return
    if own is not None:
        raise own
    rank, why = failed[0]
    raise InvalidHandleError(f"exchange_buffers: rank {rank} could not {what} ({why}); no rank got the buffers")
