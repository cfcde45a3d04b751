"""accel under torch.distributed: collectives on accel streams and memory.

torch.distributed is the engine (Gloo on the host, NCCL on CUDA, XCCL on
XPU): its process groups, stores, launchers and backends are used as they
are. This package only

- orders collectives on accel streams: :func:`collective` runs a
  torch.distributed call after the work queued on a stream and before the
  work queued after it, and :func:`wait` makes a stream wait for a ``Work``;
- pools their memory: :func:`comm_pool`, on CUDA memory from the
  communication backend's allocator, registered with it;
- exchanges buffers between the ranks of one machine without copies:
  :func:`exchange_buffers`.

A collective called directly on tensors over accel memory
(``dist.all_reduce(accel.as_tensor(buf))``) works too, but does not wait
for the work queued on accel streams: it may read what was there before.
Importing this package imports neither torch nor torch.distributed; the
functions do, on first use. See docs/distributed.md.

>>> import tempfile, torch.distributed as dist, accel, accel.distributed
>>> if not dist.is_initialized():
...     dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
>>> s = accel.Stream()
>>> grads = accel.empty(1024, stream=s).fill_(1.0)
>>> accel.distributed.collective(dist.all_reduce, grads, stream=s).synchronize()
>>> grads[0].item()
1.0
"""

from __future__ import annotations

from accel.distributed._collective import collective, wait
from accel.distributed._memory import comm_pool, exchange_buffers

__all__ = ["collective", "comm_pool", "exchange_buffers", "wait"]
