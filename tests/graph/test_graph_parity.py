"""accel.Graph as torch.accelerator.Graph (torch 2.13): the same methods with the
same signatures, the same settable attributes, and what they do, on every backend."""

from __future__ import annotations

import inspect

import pytest

import accel
from accel._runtime import activate
from accel.backends.base import CaptureMode

torch = pytest.importorskip("torch")

from tests.test_torch_parity import signature_problems  # noqa: E402 - needs torch

#: torch.accelerator.Graph's public methods (its docs list them).
METHODS = ("capture_begin", "capture_end", "debug_dump", "enable_debug_mode", "instantiate", "pool", "replay", "reset")


@pytest.fixture
def rt(backend):
    with activate(backend.name) as runtime:
        yield runtime


def test_every_method_of_torch_s_graph_is_here_with_a_compatible_signature() -> None:
    theirs = torch.accelerator.Graph
    public = {name for name, _ in inspect.getmembers(theirs, callable) if not name.startswith("_")}
    assert public == set(METHODS), "torch.accelerator.Graph changed: compare it again"
    for name in (*METHODS, "__init__", "__enter__"):  # __exit__ takes what `with` passes
        ours = getattr(accel.Graph, name)
        assert not signature_problems(inspect.signature(getattr(theirs, name)), inspect.signature(ours)), name


def _capture(g: accel.Graph, stream: accel.Stream, nbytes: int = 64) -> accel.memory.Buffer:
    """torch's way: enter a created stream, then the graph; the buffer is the graph's pool's."""
    with stream, g:
        buf = accel.memory.allocate(nbytes)
        accel.current_stream().fill(buf, 1)
    return buf


def test_graph_pool_set_before_a_capture_is_the_pool_it_allocates_from(rt) -> None:
    first, second = accel.graph_pool_handle(), accel.graph_pool_handle()
    g = accel.Graph(pool=first)
    assert g.graph_pool == first
    stream = accel.Stream()
    kept = _capture(g, stream)
    assert g.pool() == first
    # torch.accelerator.Graph.reset: "Set graph_pool or capture_error_mode beforehand
    # to use different settings on the next capture."
    g.reset()
    g.graph_pool = second
    kept_too = _capture(g, stream)
    assert g.pool() == second and g.graph_pool == second
    g.replay()
    accel.synchronize()
    del kept, kept_too
    with pytest.raises(accel.InvalidValueError, match="Graph.graph_pool"):
        g.graph_pool = "pool"  # type: ignore[assignment]


def test_capture_error_mode_set_before_a_capture_is_the_mode_it_captures_with(rt, monkeypatch) -> None:
    modes: list[CaptureMode] = []
    begin = rt.backend.stream_begin_capture

    def spy(device: int, stream: int, mode: CaptureMode) -> None:
        modes.append(mode)
        begin(device, stream, mode)

    monkeypatch.setattr(rt.backend, "stream_begin_capture", spy)
    g = accel.Graph(capture_error_mode="relaxed")
    stream = accel.Stream()
    _capture(g, stream)
    g.reset()
    g.capture_error_mode = "thread_local"
    _capture(g, stream)
    assert modes == [CaptureMode.RELAXED, CaptureMode.THREAD_LOCAL] and g.capture_error_mode == "thread_local"
    with pytest.raises(accel.InvalidValueError, match="unknown capture_error_mode 'lenient'"):
        g.capture_error_mode = "lenient"
    assert g.capture_error_mode == "thread_local"


def test_debug_mode_keeps_the_graph_for_a_dump_and_explicit_instantiation(rt, tmp_path) -> None:
    g = accel.Graph()
    g.enable_debug_mode()
    _capture(g, accel.Stream())
    path = tmp_path / "graph.dot"
    g.debug_dump(str(path))
    assert path.read_text().strip()
    g.instantiate()  # as torch's keep_graph: the raw graph is kept, instantiated on demand
    g.replay()
    accel.synchronize()


def test_entering_a_graph_gives_cached_page_locked_memory_back_as_torch(rt) -> None:
    # torch.accelerator.Graph.__enter__ calls empty_cache() and empty_host_cache().
    accel.memory.allocate_host(1 << 16).free()
    held = accel.memory.host_memory_stats()["allocated_bytes.current"]
    assert held >= 1 << 16
    with accel.Stream(), accel.Graph():
        accel.current_stream().launch_host_func(lambda: None)
    assert accel.memory.host_memory_stats()["allocated_bytes.current"] == held - (1 << 16)
