"""Collectives ordered on accel streams: :func:`collective` and :func:`wait`.

torch.distributed runs the collective; this module only decides *where in a
stream's order* it runs, by what the backend declares
(:attr:`Backend.torch_integration <accel.backends.base.Backend.torch_integration>`),
never by its name:

- the host (``RECORD_HOST_OPS``): the call is queued on the stream as host
  work, so it runs after the work queued there before it and before the work
  queued after it; it fails as a host function does
  (:class:`~accel.HostFunctionError` at the stream's next ``synchronize``);
- shared streams (CUDA, when torch has the devices): the call runs at once
  inside the torch view of the stream (``torch.cuda.stream``), where NCCL
  orders its kernels after the stream's earlier work and the stream's later
  work after them;
- separate streams (XPU: torch's streams are SYCL queues, accel's Level Zero
  command lists), or a torch without the backend's devices: the host waits
  for the stream, runs the call, waits for it and for torch's device, then
  returns: correct, not overlapped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from accel._errors import CaptureError, InvalidValueError
from accel._torch import import_torch
from accel.backends.base import TorchIntegration
from accel.graph._torch_graphs import torch_device_type, torch_graph_api, torch_stream
from accel.stream import Event, Stream, as_stream

__all__ = ["collective", "wait"]


def collective(fn: Callable[..., object], *args: Any, stream: Stream | None = None, **kwargs: Any) -> Event:
    """Run ``fn(*args, **kwargs)``, a torch.distributed call, in ``stream``'s order
    (default: the current stream); an event recorded after it.

    The call reads and writes its tensors after the work queued on ``stream``
    before it, and the work queued after it sees its results. A ``Work`` it
    returns (``async_op=True``, ``batch_isend_irecv``) is waited for inside,
    so the event completes with the communication. Every rank must issue its
    collectives in the same order, as with torch.distributed: on the host,
    collectives of one group queued on two streams (or queued on one and
    called directly on another thread) start in whichever order the streams
    reach them, which may differ between ranks; keep a group's collectives on
    one stream, or order the streams with events.

    On the host the call is queued (the default stream runs it at once); an
    exception it raises is re-raised as :class:`~accel.HostFunctionError` by
    the stream's next :meth:`~accel.Stream.synchronize`, and a peer that
    never answers fails it after the process group's timeout. In a capture
    on the host the call is recorded and runs once per replay. On CUDA it
    runs inside the torch view of ``stream``; on XPU the host waits for the
    stream, then for the collective (see docs/distributed.md).

    >>> import tempfile, torch.distributed as dist, accel, accel.distributed
    >>> if not dist.is_initialized():
    ...     dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    >>> s = accel.Stream()
    >>> t = accel.empty(4, dtype="int32", stream=s)
    >>> s.fill(t.data_ptr(), 1, 16)                   # queued on s
    >>> done = accel.distributed.collective(dist.all_reduce, t, stream=s)
    >>> s.synchronize(); t.tolist()                   # the all_reduce read the fill
    [16843009, 16843009, 16843009, 16843009]
    """
    if not callable(fn):
        raise InvalidValueError(f"collective(fn={fn!r}): pass the torch.distributed function to run, e.g. dist.all_reduce")
    target = as_stream(stream)
    name = f"accel.distributed.collective({getattr(fn, '__qualname__', None) or repr(fn)})"

    def call() -> None:
        _wait_for(fn(*args, **kwargs))

    call.__qualname__ = name
    _run_ordered(target, call, "run a collective")
    event = Event()
    event.record(target)
    return event


def wait(work: Any, stream: Stream | None = None) -> None:
    """Make later work on ``stream`` (default: the current stream) wait for a
    torch.distributed ``Work`` (what ``dist.all_reduce(t, async_op=True)`` returns).

    On the host the wait is queued on the stream (it fails, as a host
    function, after the process group's timeout when a peer never answers);
    on CUDA, ``work.wait()`` runs under the torch view of ``stream``, which
    makes the stream wait for NCCL's; elsewhere the host waits.

    >>> import tempfile, torch.distributed as dist, accel, accel.distributed
    >>> if not dist.is_initialized():
    ...     dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    >>> s = accel.Stream()
    >>> t = accel.empty(4, stream=s).fill_(2.0)
    >>> work = dist.all_reduce(t, async_op=True)
    >>> accel.distributed.wait(work, stream=s)       # s's later work runs after the all_reduce
    >>> s.synchronize(); t.tolist()
    [2.0, 2.0, 2.0, 2.0]
    """
    dist = import_torch().distributed
    if not isinstance(work, dist.Work):
        raise InvalidValueError(
            f"wait(work={work!r}): pass the torch.distributed Work a call with async_op=True returned"
        )
    target = as_stream(stream)

    def wait_for_work() -> None:
        work.wait()

    wait_for_work.__qualname__ = "accel.distributed.wait(Work)"
    _run_ordered(target, wait_for_work, "wait for a collective")


def _run_ordered(stream: Stream, call: Callable[[], None], what: str) -> None:
    """Run ``call`` after the work queued on ``stream`` so far and before the work
    queued after it, as the backend's relation to torch's streams allows."""
    backend = stream._runtime.backend
    if backend.torch_integration is TorchIntegration.RECORD_HOST_OPS:
        stream.launch_host_func(call)
        return
    device_type = backend.torch_device_type
    if backend.torch_integration is TorchIntegration.SHARED_STREAMS and device_type is not None:
        import_torch()  # torch_graph_api looks at an imported torch only
        api = torch_graph_api(device_type)
        if api is not None:
            with api.use_stream(torch_stream(api, stream)):
                call()
            return
    if stream.is_capturing():
        raise CaptureError(
            f"cannot {what} inside a capture on {stream!r}: torch's streams for the {backend.name} backend "
            "are not accel's, so the collective would run once now and be missing from every replay. "
            "Run collectives outside the capture, between replays"
        )
    _blocking(stream, call)


def _blocking(stream: Stream, call: Callable[[], None]) -> None:
    """Run ``call`` after ``stream``'s work and before its later work, by waiting on the
    host: for the stream first, then for the call and torch's work on the device."""
    stream.synchronize()
    call()
    device_type = stream._runtime.backend.torch_device_type
    if device_type is not None and torch_device_type(device_type) is not None:
        getattr(import_torch(), device_type).synchronize(stream.device_index)


def _wait_for(result: object) -> None:
    """Wait for the ``Work`` (or list of them) a torch.distributed call returned."""
    dist = import_torch().distributed
    works = result if isinstance(result, (list, tuple)) else [result]
    for work in works:
        if isinstance(work, dist.Work):
            work.wait()
