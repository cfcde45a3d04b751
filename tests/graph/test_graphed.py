"""make_graphed_callables: static-input copies, one graph per shape signature, LRU cache."""

from __future__ import annotations

import warnings
from collections.abc import Iterator

import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

import accel  # noqa: E402
from accel.graph import GraphCacheWarning, make_graphed_callables  # noqa: E402
from tests.graph.test_graph import run_script_on  # noqa: E402


@pytest.fixture(autouse=True)
def _inference() -> Iterator[None]:
    """Graphed callables are for inference: these calls run with autograd off (one
    autograd would record is refused, see test_a_call_autograd_would_record_is_refused)."""
    with torch.no_grad():
        yield


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval()


def test_graphed_module_matches_eager_bitwise_and_returns_static_outputs() -> None:
    model = _mlp()
    fast = make_graphed_callables(model, (torch.randn(2, 8),))
    x1, x2 = torch.randn(2, 8), torch.randn(2, 8)
    y1 = fast(x1)
    with torch.no_grad():
        assert torch.equal(y1, model(x1))
    y2 = fast(x2)
    assert y2 is y1  # the static output, overwritten by the next call
    with torch.no_grad():
        assert torch.equal(y2, model(x2))
    assert fast.cache_info() == {"hits": 2, "misses": 1, "evictions": 0, "size": 1, "capacity": 8}


def test_inputs_are_copied_only_when_they_are_not_the_static_ones() -> None:
    copies: list[int] = []
    fast = make_graphed_callables(lambda x: x * 2, (torch.ones(3),))
    (entry,) = fast._cache.values()
    static = entry.inputs[0]
    original_copy = torch.Tensor.copy_

    def counting_copy(self, src, *a, **k):  # type: ignore[no-untyped-def]
        copies.append(1)
        return original_copy(self, src, *a, **k)

    torch.Tensor.copy_ = counting_copy  # type: ignore[method-assign]
    try:
        static.fill_(4.0)
        out = fast(static)
        assert copies == [] and torch.equal(out, torch.full((3,), 8.0))
        fast(torch.ones(3))
        assert copies == [1]
    finally:
        torch.Tensor.copy_ = original_copy  # type: ignore[method-assign]


def test_several_callables_share_one_pool() -> None:
    f, g = make_graphed_callables((lambda x: x + 1, lambda x: x * 3), ((torch.ones(2),), (torch.ones(4),)))
    assert torch.equal(f(torch.zeros(2)), torch.ones(2))
    assert torch.equal(g(torch.full((4,), 2.0)), torch.full((4,), 6.0))
    pools = {e.graph.pool() for c in (f, g) for e in c._cache.values()}
    assert len(pools) == 1 and next(iter(pools))[0] == 0


def test_each_shape_signature_gets_a_graph_and_the_lru_cache_is_bounded() -> None:
    model = _mlp()
    fast = make_graphed_callables(model, (torch.randn(1, 8),), cache_size=2)
    for batch in (1, 2, 1, 3):  # 3 evicts 2 (1 was used more recently)
        x = torch.randn(batch, 8)
        with torch.no_grad():
            assert torch.equal(fast(x), model(x))
    info = fast.cache_info()
    assert (info["misses"], info["hits"], info["evictions"], info["size"]) == (3, 2, 1, 2)
    assert set(fast._cache) == {(((1, 8), torch.float32),), (((3, 8), torch.float32),)}


def test_a_cache_that_keeps_missing_warns_once() -> None:
    fast = make_graphed_callables(lambda x: x + 1, (torch.ones(1),), cache_size=2, num_warmup_iters=0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for n in range(2, 9):
            fast(torch.ones(n))
    relevant = [w for w in caught if issubclass(w.category, GraphCacheWarning)]
    assert len(relevant) == 1
    assert "cache_size=2" in str(relevant[0].message)


def test_warm_up_runs_before_capture() -> None:
    calls: list[int] = []

    def fn(x: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        return x + 1

    make_graphed_callables(fn, (torch.ones(2),), num_warmup_iters=3)
    assert len(calls) == 4  # three warm-up runs, then the capture


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"callables": 3, "sample_args": (torch.ones(1),)}, "callable"),
        ({"callables": (len, len), "sample_args": ((torch.ones(1),),)}, "one tuple per callable"),
        ({"callables": len, "sample_args": (torch.ones(1),), "num_warmup_iters": -1}, "num_warmup_iters"),
        ({"callables": len, "sample_args": (torch.ones(1),), "cache_size": 0}, "cache_size"),
        ({"callables": len, "sample_args": (torch.ones(1),), "tier": "fast"}, "tier"),
        ({"callables": len, "sample_args": (torch.ones(1),), "pool": (3, 3)}, "pool"),
        ({"callables": len, "sample_args": (1.0,)}, "tensors only"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(accel.InvalidValueError, match=message):
        make_graphed_callables(**kwargs)


def test_bad_calls_are_refused() -> None:
    fast = make_graphed_callables(lambda x: x + 1, (torch.ones(2),))
    with pytest.raises(accel.InvalidValueError, match="positional"):
        fast(x=torch.ones(2))
    with pytest.raises(accel.InvalidValueError, match="tensors only"):
        fast([1.0, 2.0])
    with pytest.raises(accel.InvalidValueError, match="must return tensors"):
        make_graphed_callables(lambda x: (x + 1, 3), (torch.ones(2),))


def test_a_call_with_a_sparse_or_meta_tensor_shaped_like_a_captured_one_is_refused() -> None:
    """Same shape and dtype hit the cache; torch's copy into the static input then
    raised its own error (NotImplementedError, RuntimeError)."""
    fast = make_graphed_callables(lambda x: x + 1, (torch.ones(2, 3),))
    with pytest.raises(accel.InvalidValueError, match="on meta"):
        fast(torch.ones(2, 3, device="meta"))
    with pytest.raises(accel.InvalidValueError, match="dense"):
        fast(torch.ones(2, 3).to_sparse())
    with pytest.raises(accel.InvalidValueError, match="dense"):
        make_graphed_callables(lambda x: x + 1, (torch.ones(2, 3).to_sparse(),))
    assert torch.equal(fast(torch.ones(2, 3)), torch.full((2, 3), 2.0))


def test_a_callable_that_cannot_be_captured_raises_capture_error() -> None:
    with pytest.raises(accel.CaptureError, match="reads tensor values"):
        make_graphed_callables(lambda x: x * float(x.sum()), (torch.ones(2),))
    assert not accel.graph.is_capturing()


def test_outputs_carry_no_autograd_graph() -> None:
    """Inference-only: a capture recording autograd would keep the model's
    AccumulateGrad nodes bound to accel's capture stream, and a later eager
    backward records the gradients on that stream (on CUDA torch then aborted
    at interpreter exit, recording an event on a stream gone with its context)."""
    model = _mlp()
    grad_enabled: list[bool] = []

    def forward(x: torch.Tensor) -> torch.Tensor:
        grad_enabled.append(torch.is_grad_enabled())
        return model(x)

    with torch.enable_grad():
        fast = make_graphed_callables(forward, (torch.randn(2, 8),), num_warmup_iters=1)
    out = fast(torch.randn(2, 8))
    assert grad_enabled == [False, False], "warm-up and capture run without autograd"
    assert out.grad_fn is None and not out.requires_grad
    with torch.enable_grad():
        model(torch.randn(2, 8)).sum().backward()  # eager training still works
    assert all(p.grad is not None for p in model.parameters())


def test_a_call_autograd_would_record_is_refused() -> None:
    """A replay records no autograd history: in grad mode, a call whose argument, or a
    parameter or closed-over tensor the graph reads, requires grad gave an output
    without gradient, silently (eager's has one)."""
    model = _mlp()
    weight = torch.randn(8, 3, requires_grad=True)
    with torch.enable_grad():
        fast = make_graphed_callables(model, (torch.randn(2, 8),))
        closure = make_graphed_callables(lambda x: x @ weight, (torch.randn(2, 8),))
        with pytest.raises(accel.NotSupportedError, match=r"inference-only.*a parameter of shape \(16, 8\) that the graph reads requires grad.*torch\.no_grad\(\)"):
            fast(torch.randn(2, 8))
        with pytest.raises(accel.NotSupportedError, match=r"a tensor of shape \(8, 3\) that the graph reads"):
            closure(torch.randn(2, 8))
        model.requires_grad_(False)  # frozen: nothing to differentiate but the argument
        x = torch.randn(2, 8, requires_grad=True)
        with pytest.raises(accel.NotSupportedError, match="argument 0 requires grad"):
            fast(x)
        with pytest.raises(accel.NotSupportedError, match="argument 0 requires grad"):
            make_graphed_callables(model, (x,))  # sample arguments that ask for training
        out = fast(x.detach())  # nothing requires grad: as eager, an output without gradient
        assert not out.requires_grad
        assert torch.equal(out, model(x.detach()))
    model.requires_grad_(True)
    for off in (torch.no_grad, torch.inference_mode):
        with off():
            x = torch.randn(2, 8, requires_grad=True)
            assert torch.equal(fast(x), model(x)) and torch.equal(closure(x), x @ weight)


def test_a_callable_that_enables_grad_inside_is_refused_at_capture() -> None:
    """torch.enable_grad() inside the callable recorded the capture's autograd history
    on the static output: calls under no_grad returned it differentiable, and its
    backward failed (or differentiated the capture's inputs)."""
    weight = nn.Parameter(torch.ones(3))

    def scale(x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            return x * weight

    with pytest.raises(accel.NotSupportedError, match=r"graphed .*scale returned an output that requires grad"):
        make_graphed_callables(scale, (torch.ones(3),), num_warmup_iters=0)


@pytest.mark.parametrize("which", [0, 1])
def test_a_callable_that_writes_an_argument_in_place_is_refused_at_capture(which: int) -> None:
    """A call copies its arguments into the graph's static inputs, so an in-place
    write reached the copy: eager's caller saw its cache written, the graphed
    caller's stayed zero (and the output differed from eager's), silently."""

    def step(x: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        (x, cache)[which].add_(1)
        return x + cache

    with pytest.raises(accel.NotSupportedError, match=rf"graphed .*step writes its argument {which} in place"):
        make_graphed_callables(step, (torch.ones(3), torch.zeros(3)), num_warmup_iters=0)


def test_graphed_under_inference_mode_is_usable_outside_it() -> None:
    model = _mlp()
    with torch.inference_mode():
        fast = make_graphed_callables(model, (torch.randn(2, 8),))
        fast(torch.randn(2, 8))
    x = torch.randn(2, 8)
    with torch.no_grad():
        assert torch.equal(fast(x), model(x))
    with torch.inference_mode():
        assert torch.equal(fast(x), model(x))


def test_outputs_are_ready_when_called_on_a_created_stream() -> None:
    """On a created host stream the replay runs on a worker thread; the call
    must not return the static output before the replay wrote it."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(8)]).eval()
    sample = torch.randn(64, 256)
    with accel.Stream():
        f = make_graphed_callables(model, (sample,))
        for _ in range(4):
            x = torch.randn(64, 256)
            out = f(x).clone()  # read at once, no synchronize
            with torch.inference_mode():
                assert torch.equal(out, model(x))


def test_messages_name_a_module_by_its_class_not_its_repr() -> None:
    model = _mlp()
    fast = make_graphed_callables(model, (torch.randn(1, 8),), cache_size=1, num_warmup_iters=0)
    with pytest.raises(accel.InvalidValueError) as error:
        fast(x=torch.randn(1, 8))
    assert f"graphed {type(model).__qualname__} module takes tensors as positional arguments only" in str(error.value)
    assert "Linear(" not in str(error.value) and "\n" not in str(error.value)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for batch in range(2, 5):
            fast(torch.randn(batch, 8))
    (warning,) = [w for w in caught if issubclass(w.category, GraphCacheWarning)]
    assert str(warning.message).startswith(f"graphed {type(model).__qualname__} module has captured")
    assert "Linear(" not in str(warning.message)
    assert repr(fast) == f"GraphedCallable({type(model).__qualname__} module, 1/1 graphs)"


def _bench_models() -> dict[str, tuple[object, object]]:
    """The models of benchmarks/bench_graph.py, as that benchmark builds them."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_graph.py"
    spec = importlib.util.spec_from_file_location("bench_graph_models", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module._models()  # type: ignore[no-any-return]


@pytest.mark.parametrize("batch", [1, 8])
@pytest.mark.parametrize("name", ["mlp", "transformer", "cnn", "gru_step"])
def test_default_tier_is_bitwise_eager_on_the_benchmark_models(name: str, batch: int) -> None:
    make, shape = _bench_models()[name]
    torch.manual_seed(0)
    model = make().eval()  # type: ignore[operator]
    if name == "cnn":
        with torch.no_grad():  # batch norm in eval with non-trivial running statistics
            for bn in (m for m in model.modules() if isinstance(m, nn.BatchNorm2d)):
                bn.running_mean.uniform_(-1, 1)
                bn.running_var.uniform_(0.5, 2.0)
    fast = make_graphed_callables(model, (torch.randn(*shape(batch)),))  # type: ignore[operator]
    for _ in range(3):
        x = torch.randn(*shape(batch))  # type: ignore[operator]
        y = fast(x)
        with torch.inference_mode():  # as the benchmark's eager runs
            assert torch.equal(y, model(x))
        with torch.no_grad():
            assert torch.equal(y, model(x))


def test_a_replay_failure_is_raised_by_the_call() -> None:
    table = torch.arange(4.0)
    fast = make_graphed_callables(lambda i: torch.index_select(table, 0, i) * 2, (torch.tensor([1]),))
    with pytest.raises(accel.HostFunctionError, match=r"aten\.index_select\.out.*index out of range"):
        fast(torch.tensor([10]))
    assert torch.equal(fast(torch.tensor([3])), torch.tensor([6.0]))  # reported once; calls go on


def test_a_call_with_a_tensor_whose_storage_was_freed_is_refused_not_a_crash() -> None:
    # Same shape and dtype as the captured input, but its storage resized to 0
    # bytes (as sharded training frees parameters): torch's copy into the graph's
    # input read its address, 0 or its offset from 0 (SIGSEGV), so in a subprocess.
    script = """
import torch, accel
from accel.graph import make_graphed_callables
torch.set_grad_enabled(False)
lin = torch.nn.Linear(8, 8).eval()
f = make_graphed_callables(lambda x, y: lin(x + y), (torch.randn(4, 8), torch.randn(4, 8)))
refused = 0
for offset in (0, 1):
    x, y = torch.randn(4, 8), torch.randn(4 + offset, 8)[offset:]
    f(x, y)
    y.untyped_storage().resize_(0)
    try:
        f(x, y)
    except accel.InvalidValueError as exc:
        assert "call[1] has no memory" in str(exc), exc
        refused += 1
assert refused == 2, refused
x = torch.randn(4, 8)
torch.testing.assert_close(f(x, x), lin(x + x).detach())
print("OK")
"""
    run_script_on("cpu", script, timeout=120)


CONCURRENT_CALLS = """
import sys, threading
import torch, accel
from accel.graph import make_graphed_callables
from accel.graph._engines import ENGINES

torch.set_grad_enabled(False)
tier = sys.argv[1]
kw = {}
if tier != "interpreted":  # "compiled:<engine>": that engine alone
    tier, engine = tier.split(":")
    for name in [n for n in ENGINES if n != engine]:
        del ENGINES[name]
    kw = {"tier": tier, "wait": True}
sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).eval()
f = make_graphed_callables(model, (torch.randn(4, 8),), **kw)
inputs = [torch.full((4, 8), float(i)) for i in range(8)]
expected = [model(x) for x in inputs]
start, wrong, errors = threading.Barrier(8), [], []


def work(i):
    start.wait()
    try:
        with torch.no_grad():  # grad mode is per thread
            for _ in range(300):
                out = f(inputs[i])
                if not torch.allclose(out, expected[i], atol=1e-4, rtol=1e-4):
                    wrong.append(i)
                    return
    except BaseException as exc:
        errors.append(repr(exc))


threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
for t in threads:
    t.start()
while any(t.is_alive() for t in threads):  # and the making thread, on the hot path
    f(inputs[0])  # its static outputs: the others' calls overwrite them, so not checked
for t in threads:
    t.join()
assert not errors, errors
assert not wrong, f"threads {sorted(set(wrong))} got another thread's result"
# The making thread still gets the static outputs.
assert f(inputs[1]) is f(inputs[2])
print("OK")
"""


@pytest.mark.parametrize("tier", ["interpreted", "compiled:onnxruntime"])
def test_concurrent_calls_from_threads_each_get_the_result_of_their_own_arguments(tier: str) -> None:
    """8 threads call one graphed callable with distinct inputs: the copy in, the
    replay and the handing out were not one critical section, so threads got each
    other's results (the interpreted tier, and ONNX Runtime, which writes the
    graph's static outputs). In a subprocess: a wrong lock hangs."""
    if tier != "interpreted":
        pytest.importorskip("onnxruntime")
    run_script_on("cpu", CONCURRENT_CALLS, tier, timeout=300)


def test_a_thread_that_gets_the_ended_makers_ident_gets_its_own_outputs() -> None:
    """The maker thread was recognized by its ident, which a later thread may get
    (the C library reuses an ended thread's): that thread got the static outputs,
    which the next call from any thread overwrote under it."""
    import threading

    made: list[tuple[int, object]] = []
    maker = threading.Thread(
        target=lambda: made.append((threading.get_ident(), make_graphed_callables(lambda x: x * 2, (torch.ones(4),))))
    )
    maker.start()
    maker.join()
    ident, f = made[0]
    got: list[tuple[int, torch.Tensor]] = []

    def call() -> None:
        with torch.inference_mode():
            got.append((threading.get_ident(), f(torch.full((4,), 1.0))))  # type: ignore[operator]

    for _ in range(50):  # until a thread gets the maker's ident
        thread = threading.Thread(target=call)
        thread.start()
        thread.join()
        if got[-1][0] == ident:
            break
    else:
        pytest.skip("no thread got the ended maker's ident here")
    with torch.inference_mode():
        f(torch.full((4,), 5.0))  # type: ignore[operator]
    assert got[-1][1].tolist() == [2.0] * 4, "another call overwrote the result of the thread with the maker's ident"


FORK_WHILE_ANOTHER_THREAD_CALLS = """
import os, threading, time
import torch, accel
from accel.graph import make_graphed_callables

torch.set_grad_enabled(False)
inside, go = threading.Event(), threading.Event()


def fn(x):
    if x.shape[0] == 8 and not inside.is_set():  # the capture of a new shape, in the thread
        inside.set()
        go.wait()
    return x * 2


f = make_graphed_callables(fn, (torch.ones(4),))
thread = threading.Thread(target=lambda: torch.no_grad()(f)(torch.ones(8)))
thread.start()
inside.wait()  # the thread holds f's lock
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    try:
        os.write(write, repr(f(torch.ones(4)).tolist()).encode())
    finally:
        os._exit(0)
go.set()
thread.join()
for _ in range(600):
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        break
    time.sleep(0.1)
else:
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    raise SystemExit("the child's call hung on the lock the parent's thread held at the fork")
os.close(write)
assert os.read(read, 100) == b"[2.0, 2.0, 2.0, 2.0]" and status == 0, status
print("OK")
"""


def test_a_forked_child_calls_a_callable_whose_lock_another_thread_held_at_the_fork() -> None:
    """The lock stayed held in the child, by a thread that does not exist there: the
    child's call hung. In a subprocess (the child is killed after a minute)."""
    run_script_on("cpu", FORK_WHILE_ANOTHER_THREAD_CALLS, timeout=180)
