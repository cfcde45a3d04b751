"""The compiled steady path of graphed calls (accel._speedups.SteadyCall) against the
Python call it hands every other case to (accel.graph._compiled's direct and taking
calls, each a whole call: the model the steady path must agree with).

Each case calls a fresh compiled call and a fresh Python call with the same
arguments, on engines that record what they were handed, and requires the same
result, the same error and the same runs: the compiled path either runs the
engine on the caller's tensors exactly where the Python call does, or hands the
call to it. The cases are what a hostile caller passes: views whose memory holds
other values, subclasses, meta, sparse and mkldnn tensors, storage freed under a
tensor, tensors whose data was swapped, other streams, wrong counts.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import pytest

torch = pytest.importorskip("torch")

import accel  # noqa: E402
from accel._native import speedups  # noqa: E402
from accel._runtime import get_runtime  # noqa: E402
from accel.graph import _compiled  # noqa: E402
from tests.fixtures.scripts import ok, run  # noqa: E402


class _Engine:
    """A fake engine recording what each run was handed, relative to the call's own
    arguments (``current``): for a direct engine, each tensor as the index of the
    argument it is (or "copy") with its layout bits and whether its memory is that
    argument's; for a taking one, what its binding was pointed at, the same way."""

    def __init__(self, fail: bool = False) -> None:
        self.seen: list[tuple[Any, ...]] = []
        self.fail = fail
        self.current: Any = ()

    def _which(self, t: Any, i: int) -> tuple[Any, ...]:
        arg = self.current[i] if isinstance(self.current, tuple) and i < len(self.current) else None
        same_memory = isinstance(arg, torch.Tensor) and arg.layout == torch.strided and arg.device.type == "cpu" \
            and arg.data_ptr() == t.data_ptr()
        return (i if t is arg else "copy", t.is_neg(), t.is_conj(), t.is_contiguous(), same_memory)

    def direct(self, tensors: list[Any]) -> list[Any]:
        if self.fail:
            raise RuntimeError("the engine failed")
        self.seen.append(tuple(self._which(t, i) for i, t in enumerate(tensors)))
        return [tensors[0].resolve_neg().resolve_conj().sum(0), "second"]

    def run(self) -> None:
        if self.fail:
            raise RuntimeError("the engine failed")
        self.seen.append(("run",))

    def point(self, args: Any) -> None:
        self.seen.append(("point", *[self._which(a, i) for i, a in enumerate(args)]))


def _calls(kind: str, inputs: list[Any], fail: bool = False) -> tuple[Callable[..., Any], _Engine]:
    engine = _Engine(fail)
    runtime = get_runtime()
    thread, default = runtime._state, runtime.default_stream(0)
    output: Any = torch.zeros(4) if len(inputs) == 1 else (torch.zeros(4), torch.zeros(4))
    if kind == "direct":
        call = _compiled._direct_call(engine.direct, inputs, output, thread, 0, default)
    else:
        call = _compiled._taking_call((engine.run, engine.point), engine.run, inputs, output, thread, 0, default)
    return call, engine


def _outcome(call: Callable[..., Any], args: Any) -> Any:
    try:
        result = call(args)
    except Exception as exc:  # noqa: BLE001 - the type and message are compared
        return ("raised", type(exc), str(exc))
    if isinstance(result, torch.Tensor):
        return ("tensor", result.tolist())
    return ("value", result if not isinstance(result, tuple) else tuple(map(str, result)))


def _same(kind: str, inputs: list[Any], *calls: Any, fail: bool = False) -> list[Any]:
    """Run ``calls`` (argument tuples, in order) on a compiled call and on a Python call;
    both must give the same outcomes and hand their engines the same things."""
    compiled, on_c = _calls(kind, inputs, fail)
    python, on_py = _calls(kind, inputs, fail)
    assert type(compiled).__name__ == "SteadyCall"
    fallback = python.__wrapped__  # type: ignore[attr-defined]
    got, want = [], []
    for args in calls:
        on_c.current = on_py.current = args
        got.append(_outcome(compiled, args))
        want.append(_outcome(fallback, args))
    assert got == want
    assert on_c.seen == on_py.seen
    return got


def _zero_storage() -> Any:
    t = torch.randn(2, 4)
    t.untyped_storage().resize_(0)
    return t


def _swapped() -> Any:
    t = torch.randn(2, 4)
    t.data = torch.randn(3, 4)
    return t


def _offset() -> Any:
    return torch.randn(4, 4)[1:3]


def _inference() -> Any:
    with torch.inference_mode():
        return torch.randn(2, 4)


def _parameter() -> Any:
    return torch.nn.Parameter(torch.randn(2, 4), requires_grad=False)


CASES: dict[str, Callable[[], Any]] = {
    "plain": lambda: torch.randn(2, 4),
    "at an offset in its storage": _offset,
    "an inference tensor": _inference,
    "a negated view": lambda: torch.randn(2, 4)._neg_view(),
    "transposed": lambda: torch.randn(4, 2).t(),
    "a Parameter": _parameter,
    "another shape": lambda: torch.randn(3, 4),
    "another dtype": lambda: torch.randn(2, 4, dtype=torch.float64),
    "a meta tensor": lambda: torch.empty(2, 4, device="meta"),
    "sparse": lambda: torch.randn(2, 4).to_sparse(),
    "mkldnn": lambda: torch.randn(2, 4).to_mkldnn(),
    "its storage freed": _zero_storage,
    "its data swapped for another shape": _swapped,
    "not a tensor": lambda: [[0.0] * 4] * 2,
}


@pytest.mark.parametrize("kind", ["direct", "taking"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_compiled_call_does_what_the_python_call_does(kind: str, case: str) -> None:
    arg = CASES[case]()
    again = torch.randn(2, 4)
    # the argument, the same again (steady for a taking engine now), then a plain one
    _same(kind, [torch.zeros(2, 4)], (arg,), (arg,), (again,), (arg,))


@pytest.mark.parametrize("kind", ["direct", "taking"])
def test_calls_with_the_wrong_count_or_not_a_tuple_do_what_the_python_call_does(kind: str) -> None:
    x = torch.randn(2, 4)
    _same(kind, [torch.zeros(2, 4)], (x, x), (), [x], (x,), [x], x)


@pytest.mark.parametrize("kind", ["direct", "taking"])
def test_several_inputs_one_of_them_moved_or_negated(kind: str) -> None:
    a, b = torch.randn(2, 4), torch.randn(3)
    _same(kind, [torch.zeros(2, 4), torch.zeros(3)], (a, b), (a, b), (a, torch.randn(3)), (a, b._neg_view()), (b, a))


@pytest.mark.parametrize("kind", ["direct", "taking"])
def test_complex_inputs_are_asked_for_their_conjugate_bit(kind: str) -> None:
    z = torch.randn(2, 4, dtype=torch.complex64)
    got = _same(kind, [torch.zeros(2, 4, dtype=torch.complex64)], (z,), (z.conj(),), (z,), (z.conj().imag,))
    assert got[3][0] == "value" and got[3][1] is None  # float32: another signature


@pytest.mark.parametrize("kind", ["direct", "taking"])
def test_an_engine_error_is_the_python_calls_error(kind: str) -> None:
    x = torch.randn(2, 4)
    _same(kind, [torch.zeros(2, 4)], (x,), (x,), fail=True)


@pytest.mark.parametrize("kind", ["direct", "taking"])
def test_on_another_stream_the_call_steps_aside(kind: str) -> None:
    x = torch.randn(2, 4)
    with accel.Stream():
        got = _same(kind, [torch.zeros(2, 4)], (x,), (x,))
    assert got == [("value", None)] * 2
    _same(kind, [torch.zeros(2, 4)], (x,))


@pytest.mark.parametrize("kind", ["direct", "taking"])
def test_a_stream_made_current_after_steady_calls_is_seen_by_the_next_call(kind: str) -> None:
    # The compiled call remembers that the default stream was current on this thread
    # until any thread's current stream changes: each change below must be seen.
    x = torch.randn(2, 4)
    compiled, engine = _calls(kind, [torch.zeros(2, 4)])
    runtime = get_runtime()

    def replays_here() -> bool:
        engine.current = (x,)
        return compiled((x,)) is not None

    assert replays_here() and replays_here()
    side = accel.Stream()
    with side:
        assert not replays_here()
    assert replays_here()
    runtime.set_current_stream(side)
    try:
        assert not replays_here()
    finally:
        runtime.set_current_stream(runtime.default_stream(0))
    assert replays_here()
    # Another thread on its own stream, and back here on the default one.
    seen: list[bool] = []

    def elsewhere() -> None:
        with accel.Stream():
            seen.append(replays_here())
        seen.append(replays_here())

    worker = threading.Thread(target=elsewhere)
    worker.start()
    worker.join()
    assert seen == [False, True] and replays_here()


@pytest.mark.parametrize("kind", ["direct", "taking"])
def test_a_call_made_while_the_current_stream_changes_sees_what_the_python_call_sees(kind: str) -> None:
    # A call made from a profile or trace hook (a signal handler runs at the same points)
    # while this thread's current stream changes. The runtime stored the new stream, then
    # read stream.device_index (a property: Python code) and only then told the compiled
    # call: a call made in between took the default stream for current, remembered from
    # the calls before, and ran the engine where the Python call steps aside.
    x = torch.randn(2, 4)
    compiled, engine = _calls(kind, [torch.zeros(2, 4)])
    runtime = get_runtime()
    changes = {code.__code__ for code in (runtime.set_current_stream.__func__, runtime.push_stream.__func__,
                                          runtime.pop_stream.__func__)}  # type: ignore[attr-defined]
    disagreed: list[Any] = []
    asked = [0]

    def compare(frame: Any, event: str) -> None:
        if frame.f_code in changes or (frame.f_back is not None and frame.f_back.f_code in changes):
            asked[0] += 1
            engine.current = (x,)
            got, want = compiled((x,)) is None, compiled.__wrapped__((x,)) is None  # type: ignore[attr-defined]
            if got != want:
                disagreed.append((frame.f_code.co_name, frame.f_lineno, event, got, want))

    def profile(frame: Any, event: str, arg: Any) -> None:
        compare(frame, event)

    def trace(frame: Any, event: str, arg: Any) -> Any:
        compare(frame, event)
        return trace if frame.f_code in changes else None

    side = accel.Stream()
    for hook, before in ((sys.setprofile, sys.getprofile()), (sys.settrace, sys.gettrace())):
        assert compiled((x,)) is not None and compiled((x,)) is not None  # the default one remembered
        hook(profile if hook is sys.setprofile else trace)
        try:
            runtime.set_current_stream(side)
            runtime.set_current_stream(runtime.default_stream(0))
            with side:
                pass
        finally:
            hook(before)  # a coverage tracer's, where one runs
    assert asked[0] > 10 and not disagreed, disagreed


@pytest.mark.parametrize("kind", ["direct", "taking"])
def test_a_stream_change_interrupted_part_way_leaves_calls_agreeing(kind: str) -> None:
    # A KeyboardInterrupt (here raised from a profile hook, as a signal handler would be
    # run) at each point of set_current_stream in turn. Raised after the runtime stored
    # the new stream and before it told the compiled call, the compiled call ran the
    # engine on the default stream at every later call on this thread, until some thread
    # changed its stream again, where the Python call steps aside.
    x = torch.randn(2, 4)
    compiled, engine = _calls(kind, [torch.zeros(2, 4)])
    runtime = get_runtime()
    default, side = runtime.default_stream(0), accel.Stream()
    code = runtime.set_current_stream.__func__.__code__  # type: ignore[attr-defined]
    disagreed: list[Any] = []
    for stop in range(1, 12):
        events = [0]

        def hook(frame: Any, event: str, arg: Any, events: list[int] = events, stop: int = stop) -> None:
            if frame.f_code is code or (frame.f_back is not None and frame.f_back.f_code is code):
                events[0] += 1
                if events[0] == stop:
                    raise KeyboardInterrupt

        engine.current = (x,)
        assert compiled((x,)) is not None  # the default stream remembered on this thread
        before = sys.getprofile()
        sys.setprofile(hook)
        try:
            runtime.set_current_stream(side)
        except KeyboardInterrupt:
            pass
        finally:
            sys.setprofile(before)
        engine.current = (x,)
        got, want = compiled((x,)) is None, compiled.__wrapped__((x,)) is None  # type: ignore[attr-defined]
        if got != want:
            disagreed.append((stop, got, want))
        runtime.set_current_stream(default)
    assert not disagreed, disagreed


def test_a_direct_call_keeps_no_argument_alive_and_reentrant_calls_get_their_own_list() -> None:
    # The compiled call reuses the list it hands the engine where nothing else holds it.
    # A call made while a run runs (a hook, another thread) once wrote into a new list's
    # empty slots as into the reused one's: SIGSEGV. In a subprocess for that reason.
    result = run("cpu", """
        import weakref
        import torch
        from accel._runtime import get_runtime
        from accel.graph import _compiled

        handed, inner = [], []  # ids: keeping the lists would keep the tensors

        def engine(tensors):
            handed.append(id(tensors))
            if len(handed) == 2:
                inner.append(call((torch.full((2, 4), 3.0),)))
            return [tensors[0].sum(0)]

        runtime = get_runtime()
        call = _compiled._direct_call(engine, [torch.zeros(2, 4)], torch.zeros(4), runtime._state, 0,
                                      runtime.default_stream(0))
        assert type(call).__name__ == "SteadyCall"
        x = torch.ones(2, 4)
        probe = weakref.ref(x)
        assert torch.equal(call((x,)), torch.full((4,), 2.0))
        del x
        assert probe() is None  # the list handed to the engine let it go
        assert torch.equal(call((torch.full((2, 4), 2.0),)), torch.full((4,), 4.0))
        assert torch.equal(inner[0], torch.full((4,), 6.0))
        assert handed[2] != handed[1] and handed[0] == handed[1]  # reused, but not while it runs
        print("agreed")
    """, timeout=120)
    ok(result, "agreed")


def test_an_engine_that_empties_or_grows_the_list_it_was_handed_is_handed_the_python_calls_lists() -> None:
    # The compiled call kept the list it handed the engine for the next call and reset
    # its n slots to None after the run: a list the engine emptied was written past its
    # end (SIGSEGV), one it grew was handed to the next run with the extra items. In a
    # subprocess for that reason.
    result = run("cpu", """
        import torch
        from accel._runtime import get_runtime
        from accel.graph import _compiled

        runtime = get_runtime()
        for change in ("clear", "append", "pop"):
            seen = {}
            for which in ("compiled", "python"):
                lengths = seen[which] = []

                def engine(tensors):
                    lengths.append(len(tensors))
                    out = [tensors[0].sum(0)]
                    if change == "clear":
                        tensors.clear()
                    elif change == "append":
                        tensors.append(torch.zeros(1))
                    else:
                        tensors.pop()
                    return out

                call = _compiled._direct_call(engine, [torch.zeros(2, 4)], torch.zeros(4), runtime._state, 0,
                                              runtime.default_stream(0))
                if which == "python":
                    call = call.__wrapped__
                for k in range(3):
                    assert torch.equal(call((torch.full((2, 4), float(k)),)), torch.full((4,), 2.0 * k))
            assert seen["compiled"] == seen["python"] == [1, 1, 1], (change, seen)
        print("agreed")
    """, timeout=120)
    ok(result, "agreed")


def test_an_engine_that_kept_the_list_it_was_handed_and_let_it_go_leaves_no_argument_alive() -> None:
    # An engine holding on to its last list (a recorder, a cache of the last inputs): the
    # compiled call's kept list was that list, reset only where the engine held none, so
    # once the engine let it go the SteadyCall alone kept the tensor of that call alive.
    import weakref

    kept: list[Any] = []

    def engine(tensors: list[Any]) -> list[Any]:
        kept[:] = [tensors]
        return [tensors[0].sum(0)]

    runtime = get_runtime()
    compiled = _compiled._direct_call(engine, [torch.zeros(2, 4)], torch.zeros(4), runtime._state, 0,
                                      runtime.default_stream(0))
    for call in (compiled, compiled.__wrapped__):  # type: ignore[attr-defined]
        x = torch.ones(2, 4)
        probe = weakref.ref(x)
        call((x,))
        del x
        call((torch.ones(2, 4),))
        kept.clear()
        assert probe() is None, call


def test_a_graphed_callable_head_counts_hits_and_refuses() -> None:
    # The head (C): hot call first, hits counted, an engine's RuntimeError refused as
    # accel's, anything else to _call.
    class _Probe(speedups._CallHead):  # type: ignore[misc,name-defined]
        def __init__(self, hot: Any) -> None:
            self._hot, self.hits, self.slow = hot, 0, []
            self._lock, self._owner = threading.RLock(), threading.get_ident()

        def _call(self, args: Any, kwargs: Any) -> Any:
            self.slow.append((args, kwargs))
            return "slow"

        def _refuse(self, args: Any, exc: BaseException) -> Any:
            raise accel.InvalidValueError(f"refused {args!r}") from exc

    def hot(args: Any) -> Any:
        if args == ("boom",):
            raise NotImplementedError("engine says no")
        if args == ("other",):
            raise ValueError("not refused")
        return None if args == ("miss",) else ("hot", args)

    probe = _Probe(hot)
    with torch.enable_grad():  # _call decides whether autograd would record: not the hot call
        assert probe(1) == "slow" and probe.hits == 0 and probe.slow.pop() == ((1,), None)
    with torch.no_grad():
        assert probe(1) == ("hot", (1,)) and probe.hits == 1
        assert probe("miss") == "slow" and probe.hits == 1
        assert probe(1, k=2) == "slow" and probe.slow[-1] == ((1,), {"k": 2})
        with pytest.raises(accel.InvalidValueError, match="refused") as info:
            probe("boom")
        assert isinstance(info.value.__cause__, NotImplementedError)
        with pytest.raises(ValueError, match="not refused"):
            probe("other")
        # Another thread than the owner's: the lookup, which serializes and copies its outputs.
        elsewhere: list[Any] = []
        thread = threading.Thread(target=lambda: torch.no_grad()(lambda: elsewhere.append(probe(1)))())
        thread.start()
        thread.join()
        assert elsewhere == ["slow"] and probe.hits == 1
        probe._hot = None
        assert probe(1) == "slow" and probe.slow[-1] == ((1,), None)
    bare = _Probe(hot)  # C: without a lock (a subclass that set none), no hot call, not a crash
    del bare._lock
    for lock in ("unset", None):
        if lock is None:
            bare._lock = None
        with torch.no_grad():
            assert bare(1) == "slow" and bare.hits == 0


def test_a_call_made_while_another_checks_memory_does_not_pass_for_checked() -> None:
    # A call made while a direct call's check_memory runs (another thread, or here a
    # profile hook on this one) with a tensor whose storage was freed: refused. The
    # compiled path read every call's addresses into the SteadyCall's own array, so the
    # first call then recorded the refused tensor's address (0) as checked, and the next
    # call with that tensor went to the runner unchecked (SIGSEGV reading address 0).
    result = run("cpu", """
        import sys, torch
        import accel
        import tests.graph.test_steady_call as t
        from accel.graph import _compiled

        compiled, _ = t._calls("direct", [torch.zeros(2, 4)])
        for call in (compiled, compiled.__wrapped__):
            freed = torch.randn(2, 4)
            freed.untyped_storage().resize_(0)
            inner = []

            def hook(frame, event, arg):
                if event == "call" and frame.f_code is _compiled.check_memory.__code__ and not inner:
                    inner.append(t._outcome(call, (freed,))[0])

            sys.setprofile(hook)
            try:
                call((torch.randn(2, 4),))
            finally:
                sys.setprofile(None)
            assert inner == ["raised"], inner
            try:
                call((freed,))
            except accel.InvalidValueError as exc:
                assert "no memory behind it" in str(exc)
            else:
                raise AssertionError("the freed tensor was run")
        print("agreed")
    """, timeout=60)
    ok(result, "agreed")


def _first_call_on_a_new_thread(which: str, x: Any, y: Any) -> list[Any]:
    """What a taking call's engine was handed for a call with ``y``, then a call with ``x``
    on a new thread during which (from a profile hook, as the thread state's __init__
    returns) a call with ``y`` again is made; ``which``: the compiled or the Python call."""
    from accel._runtime import _ThreadState

    call, engine = _calls("taking", [torch.zeros(2, 4)])
    if which == "python":
        call = call.__wrapped__  # type: ignore[attr-defined]
    engine.current = (y,)
    call((y,))
    inner: list[Any] = []

    def hook(frame: Any, event: str, arg: Any) -> None:
        if event == "return" and frame.f_code is _ThreadState.__init__.__code__ and not inner:
            engine.current = (y,)
            inner.append(_outcome(call, (y,)))
            engine.current = (x,)

    def body() -> None:
        sys.setprofile(hook)
        try:
            engine.current = (x,)
            inner.append(_outcome(call, (x,)))
        finally:
            sys.setprofile(None)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert len(inner) == 2
    return engine.seen


def test_a_call_made_while_another_reads_its_threads_state_runs_on_its_own_memory() -> None:
    # A taking call on a new thread runs the thread state's __init__ (Python) on its
    # first read of the current streams; a call made then with the tensor the binding
    # points at wrote that tensor's address over the first call's in the compiled path,
    # which then ran the binding on the other tensor's memory: the result of ``y`` for
    # a call with ``x``, no repointing.
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    seen = _first_call_on_a_new_thread("compiled", x, y)
    assert seen == _first_call_on_a_new_thread("python", x, y)
    assert seen[-2:] == [("point", (0, False, False, True, True)), ("run",)]


@pytest.mark.parametrize("kind", ["direct", "taking"])
def test_calls_with_more_inputs_than_the_stack_array_holds(kind: str) -> None:
    # Up to 8 addresses are read into an array on the C stack, more into one allocated
    # per call: both paths agree with the Python call (moved, negated, the same again).
    args = tuple(torch.randn(3) for _ in range(10))
    moved = (*args[:9], torch.randn(3))
    negated = (*args[:9], args[9]._neg_view())
    _same(kind, [torch.zeros(3) for _ in range(10)], args, args, moved, moved, negated, args)
