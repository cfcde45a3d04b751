"""torch.distributed collectives in a host-backend capture (accel/graph/_collectives.py), on a
one-rank Gloo group in this process; tests/distributed replays them across two ranks."""

from __future__ import annotations

import datetime
from collections.abc import Iterator
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
dist = pytest.importorskip("torch.distributed")

import accel  # noqa: E402
from accel.graph import Graph, graph  # noqa: E402


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("this process already has a default process group")
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group(
        "gloo", init_method=f"file://{Path(store)}", rank=0, world_size=1, timeout=datetime.timedelta(seconds=20)
    )
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_a_collective_is_recorded_and_runs_at_each_replay_not_at_capture(one_rank: None) -> None:
    # It was refused with "it reads tensor values on the host", which it does not.
    x, out = torch.ones(4), torch.zeros(4)
    g = Graph()
    with graph(g, stream=accel.Stream()):
        g.register_inputs(x, out)
        dist.all_gather([out], x)
        work = dist.all_reduce(x, async_op=True)
        dist.barrier()
    # The capture answers a completed Work: each replay waits for the real one.
    assert work.is_completed() and work.wait()
    assert out.tolist() == [0.0] * 4  # nothing communicated at capture
    for value in (5.0, 7.0):
        x.fill_(value)
        g.replay()
        accel.synchronize()
        assert out.tolist() == [value] * 4  # gathered what the input held at this replay
    kinds = [line.split()[1:3] for line in g.program.describe().splitlines()[1:]]
    assert ["mutate", "c10d.allgather_.default"] in kinds
    assert ["mutate", "c10d.allreduce_.default"] in kinds and ["mutate", "c10d.barrier.default"] in kinds


def test_a_collective_writing_a_tensor_made_outside_the_graph_is_recorded_as_cuda_records_it(one_rank: None) -> None:
    # Like any in-place op on a tensor the capture did not make (a KV cache), a
    # collective writing one is recorded, and each replay writes it again.
    x, y = torch.ones(4), torch.ones(4)
    g = Graph()
    with graph(g, stream=accel.Stream()):
        g.register_inputs(y)
        dist.all_reduce(x)
        x.add_(y)  # proves the replay writes x after the collective, in order
    assert [o.op for o in g.program.outside] == ["c10d.allreduce_.default"]  # one entry per tensor
    assert x.tolist() == [1.0] * 4  # nothing ran at capture
    g.replay()
    accel.synchronize()
    assert x.tolist() == [2.0] * 4


def test_collectives_a_replay_cannot_redo_are_refused_naming_them(one_rank: None) -> None:
    from torch.distributed import _functional_collectives as funcol

    x = torch.ones(4)
    with pytest.raises(accel.CaptureError, match=r"_c10d_functional.all_reduce.*functional collective.*wait_tensor"):
        with graph(Graph(), stream=accel.Stream()) as g:
            g.register_inputs(x)
            funcol.all_reduce(x, "sum", dist.group.WORLD)
    with pytest.raises(accel.CaptureError, match=r"recv_any_source_.*decided by the run"):
        with graph(Graph(), stream=accel.Stream()) as g:
            g.register_inputs(x)
            dist.recv(x)


def test_the_compiled_tier_refuses_a_graph_that_communicates(one_rank: None) -> None:
    from accel.graph import compile_graph

    x = torch.ones(4)
    g = Graph()
    with graph(g, stream=accel.Stream()):
        g.register_inputs(x)
        y = x * 2
        dist.all_reduce(y)
        z = y + 1
    with pytest.raises(accel.NotSupportedError, match=r"communicates \(c10d.allreduce_.default\).*interpreted tier"):
        compile_graph(g, inputs=[x], outputs=[z])
