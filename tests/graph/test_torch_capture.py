"""Host-backend capture of torch ops: bitwise replay of real models, no allocation
on replay, and refusal of what a replay would get wrong."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack  # noqa: E402
from torch.utils._pytree import tree_flatten  # noqa: E402

import accel  # noqa: E402
import accel.memory  # noqa: E402
from accel.graph import Graph, graph, is_capturing  # noqa: E402


def _mlp() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 10))
    return model.eval(), (torch.randn(8, 32),)


def _transformer() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.1, batch_first=True)
    return layer.eval(), (torch.randn(2, 5, 32),)


def _cnn() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 5),
    ).eval()
    with torch.no_grad():  # non-trivial running statistics
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2.0)
    return model, (torch.randn(2, 3, 8, 8),)


def _cnn_channels_last() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    # Channels-last weights, a contiguous input: the CPU convolution returns
    # channels-last, and GELU's vectorized and strided loops round differently.
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.GELU(), nn.MaxPool2d(2), nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(),
        nn.Flatten(), nn.Linear(8 * 4 * 4, 5),
    ).eval()
    return model.to(memory_format=torch.channels_last), (torch.randn(4, 3, 8, 8),)


def _gru_step() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    return nn.GRU(16, 24, batch_first=True).eval(), (torch.randn(3, 1, 16), torch.randn(1, 3, 24))


MODELS: dict[str, Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]]] = {
    "mlp": _mlp, "transformer": _transformer, "cnn_batchnorm": _cnn, "cnn_channels_last": _cnn_channels_last,
    "gru_step": _gru_step,
}


def _allocations() -> int:
    return int(accel.memory.memory_stats()["allocation.all.allocated"])


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest):
    """Bitwise replays at one thread and at two, whatever the machine has: kernels split
    their work by thread, and a replay that reaches another code path than eager (one
    that takes two arguments for one tensor) may round alike on one thread only."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_replay_is_bitwise_eager_and_allocates_nothing(name: str, threads: int) -> None:
    torch.manual_seed(0)
    model, sample = MODELS[name]()
    static = [t.clone() for t in sample]
    with torch.no_grad():
        model(*static)  # warm-up, as before any capture
    g = Graph()
    before = _allocations()
    with graph(g):
        out = model(*static)
    assert _allocations() > before  # the static outputs came from the allocator...
    outs = tree_flatten(out)[0]
    addresses = [t.data_ptr() for t in outs]
    pool_buffers = [(b.ptr, b.ptr + b.nbytes) for b in g.program.buffers]
    assert all(any(lo <= a < hi for lo, hi in pool_buffers) for a in addresses)
    allocated = _allocations()
    for _ in range(3):
        new = [torch.randn_like(t) for t in sample]
        for s, n in zip(static, new):
            s.copy_(n)
        g.replay()
        with torch.no_grad():
            expected = tree_flatten(model(*new))[0]
        assert all(torch.equal(a, b) for a, b in zip(outs, expected))
    assert [t.data_ptr() for t in outs] == addresses
    assert _allocations() == allocated  # ...and replays took nothing more
    assert g.program.fallback_ops == []


def test_attention_without_the_fused_fast_path_replays_bitwise() -> None:
    # The unfused path calls scaled_dot_product_attention, which is tagged as
    # random (dropout) but draws nothing with dropout_p=0 in eval mode.
    torch.manual_seed(0)
    layer, (x,) = _transformer()
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        g = Graph()
        with graph(g):
            y = layer(x)
        new = torch.randn_like(x)
        x.copy_(new)
        g.replay()
        with torch.no_grad():
            assert torch.equal(y, layer(new))
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)
    assert any("scaled_dot_product" in str(r.func) for r in g.program.records)


def test_replay_on_a_created_stream_runs_there() -> None:
    model, (x,) = _mlp()
    g = Graph()
    with graph(g):
        y = model(x)
    new = torch.randn_like(x)
    x.copy_(new)
    s = accel.Stream()
    with s:
        g.replay()
    s.synchronize()
    with torch.no_grad():
        assert torch.equal(y, model(new))


def test_torch_ops_and_stream_copies_replay_in_recorded_order() -> None:
    x, src = torch.zeros(16), torch.full((16,), 3.0)
    g = Graph()
    with graph(g):
        before = x * 2
        accel.current_stream().copy(x.data_ptr(), src.data_ptr(), 64)
        after = x + 1
    assert len(g.program.segments) == 2
    x.fill_(1.0)
    g.replay()
    assert torch.equal(before, torch.full((16,), 2.0))  # read x before the copy
    assert torch.equal(after, torch.full((16,), 4.0))  # and after it


def test_in_place_ops_on_graph_tensors_and_registered_inputs_replay() -> None:
    state, x = torch.zeros(4), torch.ones(4)
    g = Graph()
    g.register_inputs(state)
    with graph(g):
        y = x * 2
        y.add_(1)
        state.add_(y)  # a running accumulator the user asked for
    g.replay()
    g.replay()
    assert torch.equal(y, torch.full((4,), 3.0))
    assert torch.equal(state, torch.full((4,), 6.0))  # two replays: the capture ran nothing


def _assert_clean(g: Graph) -> None:
    assert not is_capturing()
    assert _get_current_dispatch_mode_stack() == []
    with pytest.raises(accel.CaptureError, match="no captured graph"):
        g.replay()
    # The next capture works.
    x = torch.ones(3)
    with graph(g):
        y = x + 1
    x.fill_(5.0)
    g.replay()
    assert torch.equal(y, torch.full((3,), 6.0))
    assert torch.is_grad_enabled()


REFUSED: dict[str, tuple[Callable[[torch.Tensor], object], str]] = {
    "item": (lambda x: x.sum().item(), "_local_scalar_dense.*reads tensor values"),
    "branch": (lambda x: x.sum() > 0 and x, "reads tensor values on the host"),
    "nonzero": (lambda x: torch.nonzero(x), "nonzero.*reads tensor values"),
    "rand": (lambda x: torch.rand(3), "random"),
    "dropout_train": (lambda x: nn.functional.dropout(x, 0.5, training=True), "random"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_unsupported_ops_are_refused_and_leave_no_capture_state(case: str) -> None:
    fn, message = REFUSED[case]
    x = torch.ones(3)
    g = Graph()
    with pytest.raises(accel.CaptureError, match=message):
        with graph(g):
            fn(x)
    _assert_clean(g)


def test_refusal_with_explicit_capture_calls_cleans_up_too() -> None:
    x, g = torch.ones(3), Graph()
    s = accel.Stream()
    with s:
        g.capture_begin()
        y = x * 2
        with pytest.raises(accel.CaptureError, match="random"):
            torch.randn(2)
        with pytest.raises(accel.CaptureError, match="not capturing"):
            g.capture_end()  # nothing left to end
        assert torch.equal(y, torch.zeros(3))  # recorded, never run
    _assert_clean(g)


def test_refused_op_message_names_the_op() -> None:
    g = Graph()
    with pytest.raises(accel.CaptureError, match=r"cannot capture aten\.bernoulli"):
        with graph(g):
            torch.bernoulli(torch.full((3,), 0.5))


def test_debug_dump_lists_the_recorded_ops(tmp_path) -> None:
    model, (x,) = _mlp()
    g = Graph(keep_graph=True)
    with graph(g):
        model(x)
    path = tmp_path / "dump.txt"
    g.debug_dump(str(path))
    text = path.read_text()
    assert "host function" in text and "aten.addmm.default" in text and "torch program" in text


def test_capture_turns_autograd_off_and_restores_it() -> None:
    model, (x,) = _mlp()
    g = Graph()
    with graph(g):
        assert not torch.is_grad_enabled()
        y = model(x)
    assert torch.is_grad_enabled() and not y.requires_grad


GRAD_CONTEXTS: dict[str, Callable[[], object]] = {
    "no_grad": torch.no_grad,
    "enable_grad": torch.enable_grad,
    "set_grad_enabled(False)": lambda: torch.set_grad_enabled(False),
    "inference_mode": torch.inference_mode,
}


@pytest.mark.parametrize("user_grad", [True, False])
@pytest.mark.parametrize("context", sorted(GRAD_CONTEXTS))
def test_a_capture_refused_inside_a_grad_context_restores_the_users_grad_mode(context: str, user_grad: bool) -> None:
    """The refusal drops the capture inside the block; the grad context entered
    there then restores the mode the capture had set (off): the block's exit
    gives the user theirs back (grad mode was left off after such a capture)."""
    x = torch.ones(3)
    with torch.set_grad_enabled(user_grad):
        for capturing in ("graph(g)", "with stream, g"):
            g = Graph()
            with pytest.raises(accel.CaptureError, match="nonzero"), contextlib.ExitStack() as block:
                if capturing == "graph(g)":
                    block.enter_context(graph(g))
                else:
                    block.enter_context(accel.Stream())
                    block.enter_context(g)
                with GRAD_CONTEXTS[context]():
                    torch.nonzero(x)
            assert torch.is_grad_enabled() is user_grad, capturing
            assert _get_current_dispatch_mode_stack() == []


def test_a_refusal_caught_inside_no_grad_gives_the_users_mode_back_when_the_block_exits() -> None:
    x, g = torch.ones(3), Graph()
    with pytest.raises(accel.CaptureError, match="not capturing"):
        with graph(g):
            with torch.no_grad():
                with pytest.raises(accel.CaptureError, match="nonzero"):
                    torch.nonzero(x)
    assert torch.is_grad_enabled()
    _assert_clean(g)


def test_a_capture_reset_from_another_thread_is_dropped_on_the_capturing_thread() -> None:
    """reset() on another thread popped that thread's (empty) dispatch stack: a raw
    RuntimeError there, the capture half dropped (still capturing, its recorder left
    on the capturing thread's stack, grad mode off for good)."""
    x, g = torch.ones(3), Graph()
    errors: list[BaseException] = []

    def reset() -> None:
        try:
            g.reset()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with pytest.raises(accel.CaptureError, match="not capturing"):
        with graph(g):
            x * 2
            t = threading.Thread(target=reset)
            t.start()
            t.join()
            assert not is_capturing()  # the capturing thread's next accel call leaves it
            assert torch.is_grad_enabled() and _get_current_dispatch_mode_stack() == []
            assert torch.equal(x + 1, torch.full((3,), 2.0))  # runs eagerly now
    assert errors == []
    _assert_clean(g)


FORK_DURING_A_CAPTURE = """
import os, torch
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack
from accel.graph import Graph, graph

x, g = torch.ones(3), Graph()
with graph(g):
    y = x * 2
    pid = os.fork()
    if pid == 0:  # the capture is the parent's: torch runs as usual here
        ok = torch.is_grad_enabled() and _get_current_dispatch_mode_stack() == []
        ok = ok and (x + 1).tolist() == [2.0, 2.0, 2.0] and (x + 1).sum().item() == 6.0
        os._exit(0 if ok else 3)
    _, status = os.waitpid(pid, 0)
g.replay()
assert y.tolist() == [2.0, 2.0, 2.0]
print("child exit", os.waitstatus_to_exitcode(status))
"""


def test_a_child_forked_during_a_capture_runs_torch_as_usual() -> None:
    """The child inherited the recorder on its thread: every torch op raised
    AccelError (accel cannot be used in a forked child), .tolist() was refused
    as a capture read, and autograd was off."""
    result = subprocess.run(
        [sys.executable, "-c", FORK_DURING_A_CAPTURE], capture_output=True, text=True,
        env={**os.environ, "ACCEL_BACKEND": "cpu"}, cwd=Path(__file__).resolve().parents[2], timeout=120, check=False,
    )
    assert result.returncode == 0 and result.stdout.strip() == "child exit 0", (result.stdout, result.stderr[-2000:])


def _pool_segments(pool: tuple[int, int]) -> int:
    return sum(1 for s in accel.memory.memory_snapshot() if tuple(s["segment_pool_id"]) == pool)


def test_static_tensors_live_in_the_graph_pool_until_graph_and_tensors_are_gone() -> None:
    x, lin = torch.randn(4, 8), nn.Linear(8, 8)
    g = Graph()
    with graph(g):
        y = lin(x)
    pool = g.pool()
    assert _pool_segments(pool) >= 1
    g.reset()
    accel.memory.empty_cache()
    expected = y.clone()
    assert torch.equal(y, expected) and _pool_segments(pool) >= 1  # y still holds its memory
    del y
    accel.memory.empty_cache()
    assert _pool_segments(pool) == 0


def test_an_op_failing_during_replay_is_raised_by_replay() -> None:
    table, index = torch.arange(4.0), torch.tensor([1])
    g = Graph()
    with graph(g):
        y = torch.index_select(table, 0, index)
    index[0] = 10  # out of range: the kernel fails at replay
    with pytest.raises(accel.HostFunctionError, match=r"aten\.index_select\.out.*index out of range"):
        g.replay()
    s = accel.Stream()  # asynchronous replay: raised by the next replay
    with s:
        g.replay()
    s.synchronize()
    index[0] = 2
    with pytest.raises(accel.HostFunctionError, match="index out of range"):
        g.replay()
    g.replay()  # reported once, then replays go on
    assert torch.equal(y, torch.tensor([2.0]))


def test_a_failing_op_is_named_among_many() -> None:
    table, index = torch.arange(4.0), torch.tensor([1])
    g = Graph()
    with graph(g):
        y = torch.index_select(torch.tanh(table + 1) * 2, 0, index).relu()
    index[0] = 10
    with pytest.raises(accel.HostFunctionError, match=r"failed in aten\.index_select\.out"):
        g.replay()
    index[0] = 3
    g.replay()
    assert torch.equal(y, (torch.tanh(table + 1) * 2)[3:].relu())


def test_zero_element_results_made_in_the_graph_can_be_written_in_place() -> None:
    x = torch.randn(4)
    g = accel.Graph()
    with accel.graph(g):
        z = x[:0] * 2
        z.add_(1)
    g.replay()
    accel.synchronize()
    assert z.numel() == 0


# -- the replay plan (the default tier's executor) ---------------------------------


def _plan_calls(g: Graph) -> list[object]:
    (segment,) = g.program.segments
    plan = segment._plan
    assert plan is not None, "the plan is built at the first replay"
    return [plan.__globals__[f"f{i}"] for i in range(len(segment.steps))]


def test_replay_calls_torch_bindings_where_they_reach_the_recorded_overload() -> None:
    x = torch.randn(2, 8)
    lin = nn.Linear(8, 8).eval()
    g = Graph()
    with graph(g):
        y = torch.softmax(x + torch.tanh(lin(x)), dim=-1)  # addmm, tanh, add, _softmax
        z = torch.ops.aten.add.Scalar(y, 2.0)  # the binding would reach add.out (Tensor) instead
    g.replay()
    calls = _plan_calls(g)
    overloads = [step[3] for step in g.program.segments[0].steps]
    assert overloads == ["aten.addmm.out", "aten.tanh.out", "aten.add.out", "aten._softmax.out", "aten.add.Scalar_out"]
    assert calls[:4] == [torch.addmm, torch.tanh, torch.add, torch._softmax]
    assert calls[4] is torch.ops.aten.add.Scalar_out._op
    with torch.no_grad():
        expected = torch.softmax(x + torch.tanh(lin(x)), dim=-1)
    assert torch.equal(y, expected) and torch.equal(z, expected + 2.0)


def test_several_outputs_and_in_place_methods_take_the_bindings_too() -> None:
    x = torch.randn(1, 3, 8, 8)
    state = torch.ones(1, 3, 4, 4)
    g = Graph()
    g.register_inputs(state)
    with graph(g):
        pooled, _ = torch.nn.functional.max_pool2d_with_indices(x, 2)  # out=(values, indices)
        state.mul_(pooled)  # Tensor.mul_
    before = state.clone()
    g.replay()
    calls = _plan_calls(g)
    assert calls == [torch._C._nn.max_pool2d_with_indices, torch.Tensor.mul_]
    assert torch.equal(state, before * torch.nn.functional.max_pool2d(x, 2))


def test_torch_function_modes_do_not_see_replays() -> None:
    from torch.overrides import TorchFunctionMode

    seen: list[object] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(4)
    g = Graph()
    with graph(g):
        y = torch.tanh(x) + 1
    with Spy():
        g.replay()  # the replay runs the recorded aten ops, not Python-level torch calls
    assert seen == []
    assert torch.equal(y, torch.tanh(x) + 1)


def test_replay_in_place_state_on_registered_inputs_matches_eager_steps() -> None:
    cache, x = torch.zeros(4, 8), torch.randn(4, 8)
    g = Graph()
    g.register_inputs(cache)
    with graph(g):
        cache.mul_(0.5).add_(torch.tanh(x))
    expected = cache.clone()  # whatever the capture itself left there
    for _ in range(3):
        g.replay()
        expected.mul_(0.5).add_(torch.tanh(x))
        assert torch.equal(cache, expected)


# -- writes into tensors made outside the capture (a KV cache) ----------------------

B, T, D = 2, 6, 8


def _decode_step(proj: nn.Module, k_cache: torch.Tensor, v_cache: torch.Tensor) -> Callable[..., torch.Tensor]:
    """One decode step of attention over a KV cache made outside the capture: it
    writes position ``pos`` of both caches in place (two ways) and reads them."""

    def step(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        q, k, v = proj(x).chunk(3, -1)
        k_cache.index_copy_(1, pos, k.unsqueeze(1))
        v_cache[:, :].index_copy_(1, pos, v.unsqueeze(1))  # through a view made in the capture
        scores = (q.unsqueeze(1) @ k_cache.transpose(1, 2)) / D**0.5
        scores = scores.masked_fill(torch.arange(T) > pos, float("-inf"))
        return (scores.softmax(-1) @ v_cache).squeeze(1)

    return step


def _caches() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(B, T, D), torch.zeros(B, T, D)


def test_a_kv_cache_made_outside_the_capture_is_written_by_each_replay_bitwise_as_eager() -> None:
    """CUDA records a kernel writing a tensor made outside the capture; the host
    capture refused it unless the tensor was registered (DeepSpeed's decode
    graph cache then ran eager, silently)."""
    proj = nn.Linear(D, 3 * D).eval()
    k_cache, v_cache = _caches()
    eager_k, eager_v = _caches()
    step, eager = _decode_step(proj, k_cache, v_cache), _decode_step(proj, eager_k, eager_v)
    x, pos = torch.zeros(B, D), torch.zeros(1, dtype=torch.long)
    g = Graph()
    with torch.no_grad(), graph(g):
        out = step(x, pos)
    assert not k_cache.any() and not v_cache.any()  # the capture wrote nothing
    with torch.no_grad():
        for p in range(T):
            x.copy_(torch.randn(B, D))
            pos.fill_(p)
            g.replay()
            expected = eager(x, pos)
            assert torch.equal(out, expected)
            assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)


def test_a_graphed_decode_step_writes_its_kv_cache_like_eager() -> None:
    proj = nn.Linear(D, 3 * D).eval()
    k_cache, v_cache = _caches()
    eager_k, eager_v = _caches()
    graphed = accel.graph.make_graphed_callables(
        _decode_step(proj, k_cache, v_cache), (torch.zeros(B, D), torch.zeros(1, dtype=torch.long)), num_warmup_iters=0
    )
    eager = _decode_step(proj, eager_k, eager_v)
    for p in range(T):
        x, pos = torch.randn(B, D), torch.tensor([p])
        with torch.no_grad():
            assert torch.equal(graphed(x, pos), eager(x, pos))
    assert torch.equal(k_cache, eager_k) and torch.equal(v_cache, eager_v)


def test_a_tensor_made_outside_the_capture_lives_while_the_graph_writes_it() -> None:
    import gc
    import weakref

    cache = torch.zeros(4, 3)
    x = torch.ones(3)
    g = Graph()
    with graph(g):
        cache[1].add_(x)
        total = cache.sum(0)  # read after the write, in the same capture
    alive = weakref.ref(cache)
    del cache
    gc.collect()
    assert alive() is not None  # the graph holds it, as a CUDA graph holds its memory
    for i in range(1, 3):
        torch.ones(4, 3).mul_(7)  # a new tensor of the same size: not at the cache's memory
        g.replay()
        assert torch.equal(total, torch.full((3,), float(i)))
    g.reset()
    gc.collect()
    assert alive() is None  # and lets it go with the graph


MOVES: dict[str, Callable[[torch.Tensor], object]] = {
    "set_": lambda t: t.set_(torch.zeros(4, 3)),
    "storage_freed": lambda t: t.untyped_storage().resize_(0),
    "storage_cut": lambda t: t.untyped_storage().resize_(16),
}


@pytest.mark.parametrize("move", sorted(MOVES))
def test_a_replay_after_a_written_outside_tensor_moved_is_refused(move: str) -> None:
    """A CUDA graph would write the address the tensor had (memory it may no longer
    own); here the writes would be lost to the tensor, or overrun its storage."""
    cache, x = torch.zeros(4, 3), torch.ones(3)
    g = Graph()
    with graph(g):
        cache[1].add_(x)
    g.replay()
    MOVES[move](cache)
    with pytest.raises(accel.HostFunctionError, match=r"InvalidValueError.*aten\.add_.*made outside the capture.*since the capture"):
        g.replay()


def test_a_written_outside_tensor_may_grow_after_the_capture() -> None:
    """Its storage reallocated in place (resize_ to more elements): replays write the
    same elements of the new memory, which the tensor sees."""
    cache, x = torch.zeros(4, 3), torch.ones(3)
    g = Graph()
    with graph(g):
        cache[1].add_(x)
    g.replay()
    cache.resize_(64, 3)
    g.replay()
    assert torch.equal(cache[:2], torch.tensor([[0.0] * 3, [2.0] * 3]))


def test_a_program_writing_an_outside_tensor_stays_interpreted_and_says_why() -> None:
    cache = torch.zeros(4, 3)
    graphed = accel.graph.make_graphed_callables(
        lambda x: cache.add_(x) * 2, (torch.ones(3),), tier="auto", num_warmup_iters=0
    )
    (status,) = graphed.compile_status().values()
    assert status.startswith("interpreted (compile failed:") and "made outside the capture" in status
    graphed(torch.ones(3))
    assert torch.equal(cache, torch.ones(4, 3))


# -- results kept in temporaries (ops without an out= kernel of their own) ---------


def _conv_relu_pool() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2)).eval()
    return model, torch.randn(2, 3, 8, 8)


def _temporary(g: Graph) -> list[str]:
    return [str(r.func) for r in g.program.records if r.temporary]


def _plan_source(g: Graph) -> str:
    (segment,) = g.program.segments
    assert segment._plan is not None
    return repr([segment._plan.__globals__[f"f{i}"] for i in range(len(segment.steps))])


def test_results_only_the_plan_reads_stay_in_temporaries_bitwise() -> None:
    # convolution and relu have no out= kernel of their own (torch's generated
    # one runs the op, then copies): the plan runs the op and passes its result on.
    model, x = _conv_relu_pool()
    g = Graph()
    with graph(g):
        y = model(x)
    new = torch.randn_like(x)
    x.copy_(new)
    g.replay()
    assert _temporary(g) == ["aten.convolution.default", "aten.relu.default"]
    assert "convolution.out" not in _plan_source(g) and "relu.out" not in _plan_source(g)
    assert "(kept in a temporary by replays)" in g.program.describe()
    with torch.inference_mode():
        assert torch.equal(y, model(new))


def test_static_outputs_have_the_strides_the_cpu_kernel_gives() -> None:
    # With channels-last weights the CPU convolution returns channels-last, where the
    # meta kernel (no device: it answers for CUDA) says contiguous; the later ops then
    # replayed on another layout than eager (GELU: 3e-8 off) or, through batch norm's
    # out= kernel, computed garbage (max error 2.9, before temporaries were checked).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)).eval()
    model = model.to(memory_format=torch.channels_last)
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 3, 8, 8)
    g = Graph()
    with graph(g):
        conv = model[0](x)
        y = model[1](conv)
    with torch.inference_mode():
        assert conv.stride() == model[0](x).stride() == (512, 1, 64, 8)
        assert y.stride() == model(x).stride()
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        g.replay()
        with torch.inference_mode():
            assert torch.equal(y, model(x))


def test_a_temporary_with_other_strides_than_the_capture_inferred_is_copied_into_its_output() -> None:
    # torch's fake kernel of channel_shuffle says contiguous where the CPU kernel keeps
    # a channels-last input's layout; batch norm's out= kernel, handed that as its input
    # and a contiguous output, computes garbage (max error 5.6) if the temporary goes on.
    torch.manual_seed(0)
    model = nn.Sequential(nn.ChannelShuffle(2), nn.BatchNorm2d(8)).eval()
    with torch.no_grad():
        model[1].running_mean.uniform_(-1, 1)
        model[1].running_var.uniform_(0.5, 2.0)
    x = torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last)
    g = Graph()
    with graph(g):
        y = model(x)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        g.replay()
        with torch.inference_mode():
            assert torch.equal(y, model(x))
    assert _temporary(g) == ["aten.channel_shuffle.default"]


def test_each_temporary_is_freed_after_its_last_read() -> None:
    # As in eager: a deep network keeps one or two activations alive, not all.
    import dis

    model, x = _conv_relu_pool()
    g = Graph()
    with graph(g):
        y = model(x)
    g.replay()
    (segment,) = g.program.segments
    assert segment._plan is not None
    ops = [(i.opname, i.argval) for i in dis.get_instructions(segment._plan)]
    stored = {name for op, name in ops if op == "STORE_FAST"}
    assert stored == {"t0", "t1"} and stored == {name for op, name in ops if op == "DELETE_FAST"}
    # t0 (the convolution's) goes once relu has read it, before the pooling runs.
    assert ops.index(("STORE_FAST", "t1")) < ops.index(("DELETE_FAST", "t0")) < ops.index(("LOAD_GLOBAL", "f2"))
    with torch.inference_mode():
        assert torch.equal(y, model(x))


def test_an_intermediate_the_user_holds_is_written_by_each_replay() -> None:
    # As under CUDA: a tensor made in the capture and kept by the user is
    # the graph's memory, and each replay writes it.
    model, x = _conv_relu_pool()
    g = Graph()
    with graph(g):
        h = model[0](x)
        y = model[2](model[1](h))
    x.copy_(torch.randn_like(x))
    g.replay()
    assert _temporary(g) == ["aten.relu.default"]
    with torch.inference_mode():
        assert torch.equal(h, model[0](x)) and torch.equal(y, model(x))


def test_an_intermediate_held_by_a_view_a_weak_reference_or_a_hook_is_written() -> None:
    model, x = _conv_relu_pool()
    seen: dict[str, torch.Tensor] = {}
    hook = model[0].register_forward_hook(lambda mod, args, out: seen.__setitem__("conv", out))
    try:
        f = accel.graph.make_graphed_callables(model, (x,))
    finally:
        hook.remove()
    g = Graph()
    with graph(g):
        h = model[0](x)
        flat = h.view(-1)  # a view kept by the user
        r = model[1](h)
        weak = __import__("weakref").ref(r)  # the only reference left to relu's result
        y = model[2](r)
    del h, r
    new = torch.randn_like(x)
    x.copy_(new)
    g.replay()
    with torch.no_grad():  # graphed calls are inference-only
        out = f(new)
    assert _temporary(g) == [] and weak() is not None
    (entry,) = f._cache.values()
    assert [str(r.func) for r in entry.graph.program.records if r.temporary] == ["aten.relu.default"]
    with torch.inference_mode():
        conv = model[0](new)
        assert torch.equal(flat, conv.view(-1)) and torch.equal(weak(), torch.relu(conv))
        assert torch.equal(y, model(new)) and torch.equal(out, model(new))
        assert torch.equal(seen["conv"], conv)  # the hook's tensor, written by the graphed call


def test_an_intermediate_whose_storage_object_is_held_is_written() -> None:
    x = torch.randn(8)
    g = Graph()
    with graph(g):
        h = torch.relu(x)
        storage = h.untyped_storage()  # reads the memory as well as h would
        y = h + 1
    del h
    x.copy_(torch.randn_like(x))
    g.replay()
    assert _temporary(g) == []
    assert torch.equal(torch.empty(0).set_(storage, 0, (8,), (1,)), torch.relu(x))
    assert torch.equal(y, torch.relu(x) + 1)


def test_an_intermediate_read_in_place_or_inside_a_list() -> None:
    x = torch.randn(4, 6)
    g = Graph()

    def capture() -> tuple[torch.Tensor, ...]:
        a = torch.relu(x)
        a.mul_(2)  # written in place: the temporary takes the write
        first = a + 1
        b = torch.relu(x + 1)
        joined = torch.cat([b, b])  # inside a list: b keeps its static output
        return first, joined

    with graph(g):
        first, joined = capture()
    x.copy_(torch.randn_like(x))
    g.replay()
    assert _temporary(g) == ["aten.relu.default"]  # a's
    assert torch.equal(first, torch.relu(x) * 2 + 1)
    assert torch.equal(joined, torch.cat([torch.relu(x + 1)] * 2))


def test_an_intermediate_read_by_a_later_segment_is_written() -> None:
    x, src = torch.randn(4, 6), torch.randn(4, 6)
    dst = torch.zeros(4, 6)
    g = Graph()
    g.register_inputs(dst)

    def capture() -> torch.Tensor:
        c = torch.relu(x - 1)
        accel.current_stream().copy(dst.data_ptr(), src.data_ptr(), dst.nbytes)  # a new segment
        return c * 3  # c is read by the second segment

    with graph(g):
        third = capture()
    assert len(g.program.segments) == 2
    x.copy_(torch.randn_like(x))
    g.replay()
    # The copy between the segments is other work in the graph, which could read
    # any static output by its address: no temporaries at all.
    assert _temporary(g) == []
    assert torch.equal(third, torch.relu(x - 1) * 3) and torch.equal(dst, src)


def test_a_graph_output_without_an_out_kernel_is_written() -> None:
    x = torch.randn(8)
    g = Graph()
    with graph(g):
        y = torch.relu(x)
    x.copy_(torch.randn_like(x))
    g.replay()
    assert _temporary(g) == [] and torch.equal(y, torch.relu(x))


def test_references_counts_what_holds_an_object_besides_the_call() -> None:
    from accel.graph._torch_capture import _references

    holder = [torch.empty(1)]
    assert _references(holder, 0) == 1
    kept = holder[0]
    assert _references(holder, 0) == 2
    del kept



def test_an_intermediate_whose_storage_is_weakly_referenced_is_written() -> None:
    # A storage keeps its Python object while its memory lives: the weak
    # reference reaches the memory after the tensor is gone.
    import weakref

    x = torch.randn(8)
    g = Graph()
    with graph(g):
        h = torch.relu(x)
        weak = weakref.ref(h.untyped_storage())
        y = h + 1
    del h
    x.copy_(torch.randn_like(x))
    g.replay()
    storage = weak()
    assert storage is not None and _temporary(g) == []
    assert torch.equal(torch.empty(0).set_(storage, 0, (8,), (1,)), torch.relu(x))
    assert torch.equal(y, torch.relu(x) + 1)


def test_an_intermediate_other_stream_work_reads_by_address_is_written() -> None:
    # As under CUDA: a copy node captured from an intermediate's address reads
    # what each replay wrote there, though no Python reference is left to it.
    x, dst = torch.randn(8), torch.zeros(8)
    g = Graph()
    g.register_inputs(dst)

    def capture() -> torch.Tensor:
        h = torch.relu(x)
        y = h * 2
        accel.current_stream().copy(dst.data_ptr(), h.data_ptr(), h.nbytes)
        return y

    with graph(g):
        y = capture()
    x.copy_(torch.randn_like(x))
    g.replay()
    assert _temporary(g) == []
    assert torch.equal(dst, torch.relu(x)) and torch.equal(y, torch.relu(x) * 2)


def test_zero_size_results_over_other_storages_at_the_same_address_stay_apart() -> None:
    # Zero-size tensors all have address 0. Five tensors over h's storage that
    # no record holds (.data runs no op) balance the count of the other steps'
    # zero-size tensors: those must not be taken for h's aliases (step 0 read
    # h's temporary before it was made).
    e = torch.randn(0, 4)

    def capture() -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        a = torch.relu(e)
        b = a + 1
        h = torch.relu(e)
        return b, h * 2, [h.data for _ in range(5)]

    g = Graph()
    with graph(g):
        b, y, kept = capture()
    g.replay()
    assert _temporary(g) == []
    assert b.shape == y.shape == (0, 4) and len(kept) == 5


def test_a_failing_temporary_step_is_named_by_the_op_it_ran() -> None:
    # embedding.out is torch's generated "run embedding, copy": the plan runs
    # embedding alone, and that is the op a failure names.
    table, index = torch.randn(10, 4), torch.tensor([1, 2])
    g = Graph()
    with graph(g):
        y = torch.nn.functional.embedding(index, table) * 2
    g.replay()
    assert _temporary(g) == ["aten.embedding.default"]
    index[0] = 50
    with pytest.raises(accel.HostFunctionError, match=r"failed in aten\.embedding\.default: IndexError"):
        g.replay()
    index[0] = 3
    g.replay()
    assert torch.equal(y, table[index] * 2)


def _lstm() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return nn.LSTM(8, 12, num_layers=2, batch_first=True).eval(), (torch.randn(3, 4, 8),)


def _attention_fast_path() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    attention = nn.MultiheadAttention(16, 4, batch_first=True).eval()

    class SelfAttention(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return attention(x, x, x, need_weights=False)[0]

    return SelfAttention(), (torch.randn(2, 5, 16),)


@pytest.mark.parametrize("make", [_lstm, _attention_fast_path], ids=["lstm", "attention_without_weights"])
def test_ops_that_leave_a_result_undefined_replay_bitwise(
    make: Callable[[], tuple[nn.Module, tuple[torch.Tensor, ...]]], threads: int
) -> None:
    # mkldnn_rnn_layer (eval: no workspace) and _native_multi_head_attention
    # (need_weights=False: no weights) return an undefined tensor where their
    # meta kernels give one; torch's generated out= overload then refuses it.
    model, inputs = make()
    g = Graph()
    with graph(g):
        out = model(*inputs)
    for _ in range(2):
        for t in inputs:
            t.copy_(torch.randn_like(t))
        g.replay()
        with torch.inference_mode():
            expected = model(*inputs)
        got, want = tree_flatten(out)[0], tree_flatten(expected)[0]
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))

def test_one_tensor_passed_as_several_arguments_replays_as_one_tensor() -> None:
    # _native_multi_head_attention projects query, key and value in one matrix
    # product when they are one tensor: three aliases of x took the three-product
    # path, which rounds otherwise on two threads.
    model, (x,) = _attention_fast_path()
    g = Graph()
    with graph(g):
        model(x)
    (segment,) = g.program.segments
    ((_, args, _, what, _),) = [step for step in segment.steps if "multi_head" in step[3]]
    assert args[0] is args[1] is args[2]


STATICS_COLLECTED_INSIDE_THE_ALLOCATOR = """
import gc, sys, threading
import torch
import accel
from accel.graph import Graph, graph
x = torch.randn(64)
g = Graph()
with graph(g):
    y = x * 2
allocator = g.program.buffers[0]._allocator
holder = [g, y]
holder.append(holder)  # only a collection frees the graph and its static output
del g, y, holder

def collect_inside_the_allocator():
    with allocator._lock:
        gc.collect()

t = threading.Thread(target=collect_inside_the_allocator, daemon=True)
t.start()
t.join(20)
if t.is_alive():
    print("DEADLOCK", flush=True)
    sys.exit(3)
print("OK")
"""


def test_static_outputs_collected_while_the_allocator_is_locked_do_not_deadlock() -> None:
    """A static output's memory can die in a garbage collection triggered inside
    the allocator's locked sections: giving it back must not wait for that lock.
    In a subprocess: a deadlocked allocator would hang this one."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    result = subprocess.run(
        [sys.executable, "-c", STATICS_COLLECTED_INSIDE_THE_ALLOCATOR], capture_output=True, text=True,
        env={**os.environ, "ACCEL_BACKEND": "cpu"}, cwd=Path(__file__).resolve().parents[2], timeout=120,
        check=False,
    )
    assert "DEADLOCK" not in result.stdout, "a static output's finalizer deadlocked on the allocator's lock"
    assert result.returncode == 0 and result.stdout.strip().endswith("OK"), result.stderr[-2000:]
