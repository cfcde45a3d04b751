"""torch's part in a capture is chosen by the capability a backend declares, never by its name."""

from __future__ import annotations

import pathlib
import re

import pytest

import accel
from accel._runtime import activate
from accel.backends.base import TorchIntegration
from accel.graph import _integration

torch = pytest.importorskip("torch")

GRAPH = pathlib.Path(accel.__file__).parent / "graph"


def test_the_graph_layer_never_compares_a_backend_name() -> None:
    offending = [
        f"{path.name}:{i}: {line.strip()}"
        for path in sorted(GRAPH.glob("*.py"))
        for i, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"(runtime|backend)\.name\s*[!=]=|\((self\._)?runtime\.name\)", line)
    ]
    assert offending == []


def test_each_backend_declares_one_integration() -> None:
    from accel.backends.cpu import CpuBackend

    assert CpuBackend.torch_integration is TorchIntegration.RECORD_HOST_OPS
    assert CpuBackend.torch_device_type == "cpu"


def test_the_declared_capability_picks_the_integration(monkeypatch: pytest.MonkeyPatch) -> None:
    with activate("cpu") as runtime:
        # The host backend declaring torch's streams separate: torch's CPU ops are
        # then refused, not recorded, although the backend's name is still "cpu".
        monkeypatch.setattr(runtime.backend, "torch_integration", TorchIntegration.SEPARATE_STREAMS)
        g = accel.Graph()
        with pytest.raises(accel.CaptureError, match="cannot be captured into an accel graph"):
            with accel.graph(g):
                torch.ones(2) + 1  # noqa: B018
        monkeypatch.setattr(runtime.backend, "torch_integration", TorchIntegration.NONE)
        with accel.graph(g):
            y = torch.ones(2) + 1  # not the capture's: runs now, as torch.cuda.graph leaves CPU ops
        assert torch.equal(y, torch.full((2,), 2.0)) and g.program is None
        g.reset()
        monkeypatch.undo()
        with accel.graph(g):
            y = torch.ones(2) + 1
        assert g.program is not None  # recorded, not run
        assert torch.equal(y, torch.zeros(2))


def test_no_integration_without_torch_ops_having_a_part(monkeypatch: pytest.MonkeyPatch) -> None:
    with activate("cpu") as runtime:
        monkeypatch.setattr(runtime.backend, "torch_device_type", None)
        monkeypatch.setattr(runtime.backend, "torch_integration", TorchIntegration.SHARED_STREAMS)
        stream = accel.Stream()
        assert _integration.for_capture(
            runtime, 0, stream, None, keep_graph=False, errors=[], on_refused=lambda: None  # type: ignore[arg-type]
        ) is None
