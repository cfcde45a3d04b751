"""torch.distributed collectives in a host-backend capture: recorded, run once per replay.

``dist.all_reduce(t)`` and its kin reach the dispatcher as ``c10d`` ops that
return a ``Work`` and write their tensors without saying so in their schema.
While :mod:`accel.graph._torch_capture` records, such an op is recorded as a
step that runs the collective and waits for its ``Work`` (so the next step
reads its result), and the capture hands the caller a completed ``Work``:
nothing is communicated at capture, and each replay communicates once, as a
collective captured in a CUDA graph does. Every rank must replay its graph as
many times as the others, as it would call the collective eagerly.

Refused, with a :class:`~accel.CaptureError` naming the collective:

- functional collectives (``torch.distributed._functional_collectives``,
  the ``_c10d_functional`` ops), whose result is only complete after a
  separate ``wait_tensor``, which a recorded program cannot tie to it;
- ``recv`` from any source, whose result (which rank sent) is decided by the
  run;
- a collective that writes a tensor made outside the graph that was not
  registered (:meth:`~accel.Graph.register_inputs`), as for any in-place op.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["FUNCTIONAL", "NAMESPACE", "capture_result", "is_collective", "refusal", "replay_step", "written"]

#: The namespace of the ops torch.distributed's in-place collectives dispatch to.
NAMESPACE = "c10d"
#: The namespaces of the functional collectives.
FUNCTIONAL = frozenset({"_c10d_functional", "_c10d_functional_autograd"})

# c10d op -> whether its first argument is what it may write (the rest it reads);
# send and the barriers write nothing.
_WRITES_FIRST = {
    "allreduce_": True,
    "allreduce_coalesced_": True,
    "broadcast_": True,
    "reduce_": True,
    "allgather_": True,
    "_allgather_base_": True,
    "allgather_coalesced_": True,
    "allgather_into_tensor_coalesced_": True,
    "reduce_scatter_": True,
    "_reduce_scatter_base_": True,
    "reduce_scatter_tensor_coalesced_": True,
    "gather_": True,
    "scatter_": True,
    "alltoall_": True,
    "alltoall_base_": True,
    "recv_": True,
    "send": False,
    "barrier": False,
    "monitored_barrier_": False,
}


def _name(func: Any) -> str:
    return str(func._schema.name).split("::")[-1]


def refusal(func: Any) -> str | None:
    """Why the collective ``func`` cannot be captured, or None when it can (``c10d``
    ops that are not collectives, such as ``check_for_nan``, get None too: the
    capture's usual rules apply to them)."""
    if func.namespace in FUNCTIONAL:
        return (
            "it is a functional collective, whose result is complete only after a separate "
            "wait_tensor that a recorded program cannot tie to it. Use torch.distributed's in-place "
            "collectives (dist.all_reduce(t)...) or accel.distributed.collective on the capturing stream"
        )
    if func.namespace == NAMESPACE and _name(func) == "recv_any_source_":
        return (
            "a receive from any source is a collective whose result (which rank sent) is decided by "
            "the run, and a replay could not change what the capture answered. Name the source rank"
        )
    return None


def is_collective(func: Any) -> bool:
    """Whether ``func`` is a ``c10d`` collective this module records."""
    return func.namespace == NAMESPACE and _name(func) in _WRITES_FIRST


def written(func: Any, args: tuple[Any, ...]) -> list[torch.Tensor]:
    """The tensors the collective ``func`` may write (its results, on some ranks or all)."""
    if not args or not _WRITES_FIRST[_name(func)]:
        return []
    return [t for t in tree_flatten(args[0])[0] if isinstance(t, torch.Tensor)]


def replay_step(func: Any) -> Callable[..., None]:
    """What a replay runs for ``func``: the collective, then a wait for its ``Work``,
    bounded by the process group's timeout (a failure is the replay's error)."""
    op = func._op

    def replay(*args: Any, **kwargs: Any) -> None:
        result = op(*args, **kwargs)
        work = result[-1] if isinstance(result, tuple) else result
        if work is not None:
            work.wait()

    replay.__qualname__ = f"replay of {func}"
    return replay


def capture_result(func: Any, args: tuple[Any, ...]) -> Any:
    """What the capture returns for ``func``: its written argument where the op returns
    it, and a completed ``Work`` (``wait()`` returns at once: the replay waits)."""
    values = [_completed_work() if str(r.type).endswith("c10d.Work") else args[0] for r in func._schema.returns]
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _completed_work() -> Any:
    # torch's binding from a Future to a Work (what its multi-threaded test group
    # uses); its type stubs do not list it.
    make: Callable[[Any], Any] = torch._C._distributed_c10d._create_work_from_future  # type: ignore[attr-defined]
    done: torch.futures.Future[None] = torch.futures.Future()
    done.set_result(None)
    return make(done).boxed()
