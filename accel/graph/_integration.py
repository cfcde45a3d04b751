"""torch's part in a capture: one integration per backend, picked by the
capability the backend declares (:attr:`Backend.torch_integration
<accel.backends.base.Backend.torch_integration>`), never by its name.

- ``RECORD_HOST_OPS`` (the host): :class:`RecordHostOps` records torch's CPU
  ops into the graph without running them (:mod:`accel.graph._torch_capture`);
- ``SHARED_STREAMS`` (CUDA): :class:`TorchGraphCarrier` lets torch's own device
  graph begin, end, instantiate and replay the capture on accel's stream
  (:mod:`accel.graph._torch_graphs`), when torch has the backend's devices;
- ``SEPARATE_STREAMS`` (Level Zero): :class:`RefuseDeviceOps` refuses torch ops
  on the backend's devices, which would run once and be missing from replays.

:class:`accel.Graph` holds the one integration of its capture, or None when
torch is not imported or takes no part.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from accel.backends.base import TorchIntegration

if TYPE_CHECKING:
    from accel._runtime import Runtime
    from accel.graph._pool import PoolId, PoolLease
    from accel.graph._torch_capture import Program
    from accel.graph._torch_graphs import DeviceOpGuard, TorchDeviceGraph
    from accel.stream import Stream

__all__ = ["CaptureIntegration", "RecordHostOps", "RefuseDeviceOps", "TorchGraphCarrier", "for_capture"]


class CaptureIntegration:
    """torch's part in one capture.

    ``carries_graph``: torch's graph begins, ends, instantiates and replays
    the capture (:class:`TorchGraphCarrier`); otherwise the backend does, and
    the integration only takes part while it runs (:meth:`start`, :meth:`stop`).
    """

    carries_graph = False

    def start(self, inputs: Sequence[Any]) -> None:
        """The backend's capture began: take part from now on."""

    def register_inputs(self, tensors: Sequence[Any]) -> None:
        """Tensors made outside the graph that captured ops write (see Graph.register_inputs)."""

    def stop(self) -> Program | None:
        """Stop taking part, before the capture ends; the torch program recorded, if any.

        Raises the CaptureError that invalidated the capture, if one did."""
        return None

    def abort(self) -> None:
        """The capture is dropped: leave nothing of it behind."""

    def block_exited(self) -> None:
        """The ``with`` block that captured has exited (the capture ended, or was
        dropped inside it): restore what the capture changed in the thread's state
        that contexts entered and exited inside the block may have set again."""


class RecordHostOps(CaptureIntegration):
    """torch's CPU ops are the host backend's work: record them (see ``_torch_capture``)."""

    def __init__(
        self,
        runtime: Runtime,
        device: int,
        stream: Stream,
        lease: PoolLease,
        errors: list[tuple[str, BaseException]],
        on_refused: Callable[[], None],
    ) -> None:
        from accel.graph._torch_capture import Recorder

        self._recorder = Recorder(runtime, device, stream, lease, errors, on_refused)

    def start(self, inputs: Sequence[Any]) -> None:
        self._recorder.register_inputs(inputs)
        self._recorder.start()

    def register_inputs(self, tensors: Sequence[Any]) -> None:
        self._recorder.register_inputs(tensors)

    def stop(self) -> Program | None:
        program: Program = self._recorder.stop()
        return program

    def abort(self) -> None:
        self._recorder.discard()

    def block_exited(self) -> None:
        self._recorder.restore_grad_mode()


class RefuseDeviceOps(CaptureIntegration):
    """torch's streams for the backend's devices are not accel's: refuse its ops on them."""

    def __init__(self, device_type: str, backend_name: str) -> None:
        self._device_type = device_type
        self._backend_name = backend_name
        self._guard: DeviceOpGuard | None = None

    def start(self, inputs: Sequence[Any]) -> None:
        from accel.graph._torch_graphs import DeviceOpGuard

        self._guard = DeviceOpGuard(self._device_type, self._backend_name).__enter__()

    def stop(self) -> Program | None:
        self._leave()
        return None

    def abort(self) -> None:
        self._leave()

    def _leave(self) -> None:
        guard, self._guard = self._guard, None
        if guard is not None:
            guard.__exit__(None, None, None)


class TorchGraphCarrier(CaptureIntegration):
    """torch's device graph carries the capture on accel's stream (see ``_torch_graphs``)."""

    carries_graph = True

    def __init__(self, graph: TorchDeviceGraph) -> None:
        self.graph = graph

    def begin(self, pool_id: PoolId, mode: str) -> None:
        """Begin the capture (in place of the backend's stream_begin_capture)."""
        self.graph.begin(pool_id, mode)

    def end(self) -> None:
        """End the capture (in place of the backend's stream_end_capture); torch instantiates it."""
        self.graph.end()

    def abort(self) -> None:
        self.graph.abort()


def for_capture(
    runtime: Runtime,
    device: int,
    stream: Stream,
    lease: PoolLease,
    *,
    keep_graph: bool,
    errors: list[tuple[str, BaseException]],
    on_refused: Callable[[], None],
) -> CaptureIntegration | None:
    """The integration of a capture beginning on ``stream``: by the backend's declared
    capability, and None when torch is not imported (it cannot run ops then) or
    has no part in the backend's captures."""
    if sys.modules.get("torch") is None:
        return None
    backend = runtime.backend
    kind = backend.torch_integration
    if kind is TorchIntegration.RECORD_HOST_OPS:
        return RecordHostOps(runtime, device, stream, lease, errors, on_refused)
    device_type = backend.torch_device_type
    if device_type is None or kind is TorchIntegration.NONE:
        return None
    from accel.graph import _torch_graphs

    if kind is TorchIntegration.SHARED_STREAMS:
        api = _torch_graphs.torch_graph_api(device_type)
        if api is not None:
            return TorchGraphCarrier(_torch_graphs.TorchDeviceGraph(api, runtime, device, stream, keep_graph=keep_graph))
    # SEPARATE_STREAMS, or shared streams whose torch has no graphs over them:
    # torch ops on the devices would run once, outside the graph.
    guarded = _torch_graphs.torch_device_type(device_type)
    return RefuseDeviceOps(guarded, backend.name) if guarded is not None else None
