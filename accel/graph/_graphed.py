"""make_graphed_callables: capture a callable once per input shape, replay after.

For inference: each returned callable keeps static input tensors, copies a
call's arguments into them (only when the caller did not pass the static
tensors themselves), replays the graph and returns the static outputs. A new
shape signature (shapes and dtypes of the arguments) captures a new graph; a
bounded LRU cache of graphs keeps dynamic batch sizes from recapturing
forever, and a warning says when the cache keeps missing.

Replays record no autograd history. Where eager would (grad mode on, and an
argument or a tensor the graph reads requires grad), a call is refused
rather than returning an output that silently carries no gradient.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
import warnings
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import torch
from torch.utils._pytree import tree_flatten, tree_map

from accel._errors import InvalidValueError, NotSupportedError
from accel._native import speedups
from accel._runtime import get_runtime
from accel.backends.base import Backend, TorchIntegration
from accel.graph._graph import Graph, graph
from accel.graph._pool import PoolId, check_pool_id, graph_pool_handle
from accel.graph import _torch_graphs
from accel.graph._compiled import copy_into

__all__ = ["GraphCacheWarning", "GraphedCallable", "make_graphed_callables"]


class GraphCacheWarning(UserWarning):
    """A graphed callable keeps meeting input shapes its graph cache does not hold."""


def _torch_api(backend: Backend) -> _torch_graphs.TorchGraphAPI | None:
    """torch's graph API where the backend declares that torch's graphs share its
    streams and this torch has its devices; None otherwise."""
    if backend.torch_integration is not TorchIntegration.SHARED_STREAMS or backend.torch_device_type is None:
        return None
    return _torch_graphs.torch_graph_api(backend.torch_device_type)


def _name(fn: object) -> str:
    """``fn`` in a message: a module by its class (its repr lists every layer), a function by name."""
    if isinstance(fn, torch.nn.Module):
        return f"{type(fn).__qualname__} module"
    name = getattr(fn, "__qualname__", None)
    return name if isinstance(name, str) else type(fn).__qualname__


Signature = tuple[tuple[tuple[int, ...], torch.dtype], ...]


@dataclass
class _Entry:
    graph: Graph
    device: int
    inputs: list[torch.Tensor]
    output: Any
    # Compiled tier: the CompiledProgram or BackgroundCompile, and the engine's
    # bound replay when the graph is that program alone (called directly).
    compiled: Any = None
    # auto: why the compiled tier refused the program (it replays interpreted).
    refused: str | None = None
    # Tensors the graph reads that may require grad (a module's parameters, a
    # closure's weights): a call in grad mode while one does is refused.
    grad_sources: tuple[torch.Tensor, ...] = ()
    # The whole call (copy in, engine, result) when the graph is that program
    # alone; it returns None on a stream other than the default one.
    call: Callable[[Sequence[torch.Tensor]], Any] | None = None
    # Interpreted tier: the torch program's run when the graph is that program
    # alone; fast() runs only while current_stream(device) is default_stream.
    fast: Callable[[], Any] | None = None
    current_stream: Callable[[int], Any] | None = None
    default_stream: Any = None


# The start of every call of a GraphedCallable is its C base, accel._speedups._CallHead
# (a Python frame there cost a quarter of accel's time per call): the last compiled
# call's bound call (``_hot``, see accel.graph._compiled.bind_call), which checks the
# arguments' shapes and dtypes itself and returns None for others: no key, no lookup,
# no reordering (its entry is the most recent already). It hands every other call to
# ``_call``, the lookup, and what the bound call raises (RuntimeError, of which
# NotImplementedError is one) to ``_refuse``. Not in grad mode: there ``_call`` decides
# whether autograd would record (and refuses).
#
# Only the thread that made the callable (``_owner``) takes the hot path, and it holds
# ``_lock`` for it, as ``_call`` does for the whole call: the bound call writes the
# graph's inputs and outputs, which another thread's call writes too. ``_hot`` is read
# again under the lock (another thread's call may have replaced it, or evicted its
# graph, meanwhile).


class _ThreadMark:
    """Held by its thread only (in ``_marks``), so collected when that thread ends: then
    the callables the thread made have no owner any more. A later thread may get the
    ended thread's ident (idents are reused), and must not be taken for it: it would
    get the static outputs, which any other thread's call overwrites."""

    __slots__ = ("owned",)

    def __init__(self) -> None:
        self.owned: weakref.WeakSet[GraphedCallable] = weakref.WeakSet()

    def __del__(self) -> None:
        for callable_ in list(self.owned):
            callable_._owner = 0  # no thread's ident


_marks = threading.local()

# Every GraphedCallable alive, for the fork handler (_forked).
_LIVE: weakref.WeakSet[GraphedCallable] = weakref.WeakSet()


def _forked() -> None:
    """In a forked child only the forking thread exists: a callable's lock that another
    thread held at the fork would never be released there (a call would hang instead of
    saying that accel cannot be used after a fork), and a callable another thread made
    has no owner there."""
    me = threading.get_ident()
    for callable_ in list(_LIVE):
        callable_._lock = threading.RLock()
        if callable_._owner != me:
            callable_._owner = 0


os.register_at_fork(after_in_child=_forked)


def _stop_builds(builds: weakref.WeakSet[Any]) -> None:
    """A collected :class:`GraphedCallable`'s builds end at their next step."""
    for build in list(builds):
        build.stop()


class GraphedCallable(speedups._CallHead):
    """A callable replaying captured graphs of ``fn``, one per input-shape signature.

    The returned tensors are the graph's static outputs: the next call
    overwrites them, so clone what must outlive it (as with torch's graphs).
    ``cache_info()`` reports hits, misses and evictions.

    Calls from several threads are serialized: copying the arguments in,
    replaying and handing the outputs out are one critical section per
    callable. torch's make_graphed_callables takes no lock and hands every
    call the same static outputs (detached views), so threads calling it at
    once read each other's inputs and results; CUDA itself requires a graph's
    launches to be serialized by its user. Here the thread that made the
    callable gets the static outputs, and a call from any other thread gets
    its own copy of them, made inside the critical section, so each thread
    reads the result of its own arguments. The making thread's static outputs
    are still overwritten by the next call from any thread.

    >>> import torch, accel
    >>> f = accel.graph.make_graphed_callables(torch.nn.Linear(4, 2).eval(), (torch.randn(3, 4),))
    >>> with torch.inference_mode():
    ...     f(torch.randn(3, 4)).shape
    torch.Size([3, 2])
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        num_warmup_iters: int,
        pool: PoolId,
        cache_size: int,
        tier: str,
        wait: bool = False,
    ) -> None:
        self.fn = fn
        # Calls serialize on it (see the class); re-entrant: a capture runs fn, which
        # may call graphed callables, this one among them on another shape.
        self._lock = threading.RLock()
        self._owner = threading.get_ident()  # who gets the static outputs, while it runs
        mark = getattr(_marks, "mark", None)
        if mark is None:
            mark = _marks.mark = _ThreadMark()
        mark.owned.add(self)
        _LIVE.add(self)
        self._warmup = num_warmup_iters
        self._pool = pool
        self._cache_size = cache_size
        self._tier = tier
        self._wait = wait
        self._cache: OrderedDict[Signature, _Entry] = OrderedDict()
        self.hits = self.misses = self.evictions = 0
        self._warned = False
        # The bound call (see _compiled.bind_call) of the last call that ran a
        # compiled program, tried first by the next; reset by every call that does not.
        self._hot = None
        # Its graphs' background builds, stopped when it is collected: nothing replays
        # those graphs any more, and a build holds its graph's memory until it ends.
        self._builds: weakref.WeakSet[Any] = weakref.WeakSet()
        weakref.finalize(self, _stop_builds, self._builds)
        backend = get_runtime().backend
        self._device_type = backend.torch_device_type or ""
        # Where torch's graphs carry the capture, torch reads the outputs in
        # stream order after the replay; on the host it reads them right away.
        self._torch_api = _torch_api(backend)

    def __repr__(self) -> str:
        return f"GraphedCallable({_name(self.fn)}, {len(self._cache)}/{self._cache_size} graphs)"

    def cache_info(self) -> dict[str, int]:
        """``{"hits", "misses", "evictions", "size", "capacity"}`` of the graph cache."""
        return {
            "hits": self.hits,
            "misses": self.misses,
            "evictions": self.evictions,
            "size": len(self._cache),
            "capacity": self._cache_size,
        }

    def _refuse(self, args: tuple[Any, ...], exc: BaseException) -> NoReturn:
        """Raise torch's or an engine's refusal of ``args`` as accel's (see _bad_call)."""
        refusal = _bad_call(args, self._device_type, exc)
        if refusal is exc:  # raised as it is: ``from exc`` would make it its own cause, losing the engine's
            raise exc
        raise refusal from exc

    def _call(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any:
        """A call that the hot path (_CallHead) did not take, under the lock: look the
        graph up by the arguments' signature, capture it on a miss, replay it, and hand
        a thread other than the owner a copy of the static outputs."""
        with self._lock:
            result, static = self._locked_call(args, kwargs)
            if static and threading.get_ident() != self._owner:
                result = tree_map(torch.Tensor.clone, result)  # before another call overwrites them
            return result

    def _locked_call(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> tuple[Any, bool]:
        """``_call``'s work: the result, and whether it is the graph's static outputs
        (an engine that returns new tensors returns its own)."""
        if kwargs:
            raise InvalidValueError(
                f"graphed {_name(self.fn)} takes tensors as positional arguments only, got keywords "
                f"{sorted(kwargs)}"
            )
        self._hot = None
        key: tuple[tuple[Any, Any], ...]
        try:
            # The lookup: torch.Size hashes and compares like the tuples
            # _signature() stores; anything unusual is validated on the miss.
            if len(args) == 1:
                (a,) = args
                key = ((a.shape, a.dtype),)  # a third of the comprehension's cost
            else:
                key = tuple([(a.shape, a.dtype) for a in args])
        except AttributeError:
            key = _signature(args, "call", self._device_type)
        entry = self._cache.get(key)
        if entry is None:
            entry = self._capture(args, _signature(args, "call", self._device_type))
            if torch.is_grad_enabled():
                self._refuse_autograd(args, entry.grad_sources)
        else:
            if torch.is_grad_enabled():
                self._refuse_autograd(args, entry.grad_sources)
            self.hits += 1
            self._cache.move_to_end(key)
            call = entry.call
            try:
                if call is not None:
                    result = call(args)  # the compiled program alone, without the graph around it
                    if result is not None:
                        self._hot = call
                        if entry.call is not call:  # a background build replaced the engine meanwhile
                            self._hot = None  # (it stores entry.call, then resets _hot: see _capture)
                        return result, result is entry.output
                for i, (static, arg) in enumerate(zip(entry.inputs, args)):
                    # Not a comparison of addresses: a transposed or negated view of
                    # the static input (a graph may return it) shares its address.
                    if arg is not static:
                        copy_into(static, arg, i)
            except (RuntimeError, NotImplementedError) as exc:
                # The key is shapes and dtypes: a sparse or meta tensor shaped like a
                # captured one hits it, and torch's copy (or the engine) refuses it.
                raise _bad_call(args, self._device_type, exc) from exc
        fast = entry.fast
        if fast is not None and entry.current_stream(entry.device) is entry.default_stream:  # type: ignore[misc]
            fast()  # the graph is the torch program alone: run it without the graph around it
            return entry.output, True
        runtime = get_runtime()
        stream = runtime.current_stream(entry.device)
        api = self._torch_api
        if api is None:
            entry.graph.replay()
            # Torch reads the outputs on this host thread right away: wait for the
            # replay when the current stream runs it on a worker. The host
            # backend's default stream replays inline: nothing to wait for.
            if stream is not runtime.default_stream(entry.device):
                stream.synchronize()
            return entry.output, True
        # torch copied the inputs on its current stream and reads the outputs
        # there: order the replay's stream between the two, without host waits.
        torch_current, replay_stream = api.current_stream(entry.device), _torch_graphs.torch_stream(api, stream)
        _torch_graphs.order_after(api, replay_stream, torch_current)
        entry.graph.replay()
        _torch_graphs.order_after(api, torch_current, replay_stream)
        return entry.output, True

    def _refuse_autograd(self, args: Sequence[Any], sources: Sequence[torch.Tensor] = ()) -> None:
        """In grad mode: refuse a call that eager would differentiate, for an argument
        or one of the tensors the graph reads (``sources``) that requires grad (the
        replay's output would carry no gradient, silently)."""
        what = next((f"argument {i}" for i, a in enumerate(args) if a.requires_grad), None)
        if what is None:
            source = next((t for t in sources if t.requires_grad), None)
            if source is None:
                return
            kind = "a parameter" if isinstance(source, torch.nn.Parameter) else "a tensor"
            what = f"{kind} of shape {tuple(source.shape)} that the graph reads"
        raise NotSupportedError(
            f"graphed {_name(self.fn)} is inference-only: its replays record no autograd history, and with "
            f"grad mode on, {what} requires grad, so eager would return a differentiable output where the "
            "replay returns none. Call it under torch.no_grad() or torch.inference_mode() (or turn "
            "requires_grad off on what needs no gradient); train with the eager callable (on CUDA, "
            "torch.cuda.make_graphed_callables also captures the backward pass)"
        )

    def capture(self, *sample_args: torch.Tensor) -> None:
        """Capture the graph for the signature of ``sample_args`` now, if not cached."""
        key = _signature(sample_args, "sample_args", self._device_type)
        if torch.is_grad_enabled():  # sample arguments that require grad ask for training: say so now
            self._refuse_autograd(sample_args)
        with self._lock:
            if key not in self._cache:
                self._capture(sample_args, key)

    def _capture(self, args: Sequence[torch.Tensor], key: Signature) -> _Entry:
        self._hot = None  # the cache changes
        self.misses += 1
        if len(self._cache) >= self._cache_size:
            _, old = self._cache.popitem(last=False)
            stop = getattr(old.compiled, "stop", None)
            if stop is not None:
                stop()  # its build, if still running: nothing replays that graph any more
            old.graph.reset()
            self.evictions += 1
            if self.evictions >= self._cache_size and not self._warned:
                self._warned = True
                warnings.warn(
                    f"graphed {_name(self.fn)} has captured {self.misses} graphs for {self.misses} input "
                    f"signatures and evicted {self.evictions} (cache_size={self._cache_size}): each "
                    "miss captures anew. Raise cache_size, or pad inputs to a few fixed shapes.",
                    GraphCacheWarning,
                    stacklevel=3,
                )
        with torch.inference_mode(False), torch.no_grad():
            # Normal tensors, even when called under inference mode: later
            # calls copy into them, perhaps outside it.
            inputs = [a.detach().clone() for a in args]
        _warm_up(self.fn, inputs, self._warmup)
        g = Graph(pool=self._pool)
        # Inference-only, so no autograd: recording it would bind the model's
        # AccumulateGrad nodes to the capture stream, and a later backward
        # would record its gradients there (torch aborted at exit over that).
        with torch.no_grad(), _compilable(self._tier != "interpreted"), graph(g):
            output = self.fn(*inputs)
            runtime = get_runtime()
            index = runtime.current_index
            nodes = runtime.backend.stream_capture_length(index, runtime.current_stream(index).native_handle)
        if not all(isinstance(t, torch.Tensor) for t in tree_flatten(output)[0]):
            g.reset()
            raise InvalidValueError(
                f"graphed {_name(self.fn)} must return tensors (or tuples, lists, dicts of tensors)"
            )
        if any(t.requires_grad for t in tree_flatten(output)[0]):
            # Autograd turned on inside the callable (torch.enable_grad) recorded the
            # capture's history on the static output: every call would return it,
            # differentiable, with gradients of the capture's inputs, not the call's.
            g.reset()
            raise NotSupportedError(
                f"graphed {_name(self.fn)} returned an output that requires grad from its capture (autograd "
                "turned on inside it, e.g. torch.enable_grad()): replays record no autograd history, so every "
                "call would return the capture's, whose backward fails or differentiates the capture's "
                "inputs. Graph the callable without enabling grad inside it, or train with the eager callable"
            )
        program = g.program
        written = _written_argument(inputs, program)
        if written is not None:
            g.reset()
            raise NotSupportedError(
                f"graphed {_name(self.fn)} writes its argument {written} in place: a call copies its arguments "
                "into the graph's own tensors, so the write would reach those, not the caller's tensor (eager "
                "writes the caller's). Return the new value instead, or keep the tensor outside the arguments "
                "(a closure's tensor made outside the capture is written by each replay, as a KV cache)"
            )
        entry = _Entry(g, get_runtime().current_index, inputs, output)
        entry.grad_sources = _grad_sources(self.fn, program)
        # One node in the whole graph, and it is the torch program: a replay
        # on the default stream (which the host runs inline) may run it alone.
        alone = nodes == 1 and program is not None and len(program.segments) == 1
        if alone:
            entry.current_stream = runtime.current_stream
            entry.default_stream = runtime.default_stream(entry.device)
            entry.fast = _run_alone(g, program.segments[0])  # after the streams: the hot path reads it first
        if self._tier != "interpreted":
            from accel.graph import _compiled

            owner = weakref.ref(self)  # a build's thread must not keep the callable alive

            def ready(compiled: _compiled.CompiledProgram) -> None:
                # Called again by a background build for each engine that replaces the
                # one serving: the new call first, then _hot, which may hold the old one.
                if alone:
                    entry.call = _compiled.bind_call(compiled, inputs, output, runtime, entry.device)
                    graphed = owner()
                    if graphed is not None:
                        graphed._hot = None

            try:
                if self._tier == "compiled" and self._wait:
                    entry.compiled = _compiled.compile_graph(g, inputs=inputs, outputs=tree_flatten(output)[0])
                    ready(entry.compiled)
                else:  # replay the interpreted tier, then each better engine as it is ready
                    entry.compiled = _compiled.BackgroundCompile(
                        g, inputs, tree_flatten(output)[0], on_ready=ready, wait=self._wait,
                        warn=self._tier == "compiled",
                    )
                    self._builds.add(entry.compiled)
            except BaseException as exc:
                # auto: a program the compiled tier cannot take replays interpreted.
                if self._tier == "compiled" or not isinstance(exc, NotSupportedError):
                    g.reset()
                    raise
                entry.refused = str(exc)
        self._cache[key] = entry
        return entry

    def compile_status(self) -> dict[Signature, str]:
        """Per captured signature, how its replays run: "interpreted", "building
        (last build took N s)", "compiled: <engine> (choosing among <engines>)"
        while the other engines build, "compiled: <engine>" once chosen, or
        "interpreted (compile failed: why)"."""
        status = {}
        for key, entry in self._cache.items():
            c = entry.compiled
            if c is None:
                status[key] = "interpreted" if entry.refused is None else f"interpreted (compile failed: {entry.refused})"
            elif hasattr(c, "engine"):
                status[key] = f"compiled: {c.engine}"
            else:
                status[key] = c.status()
        return status

    def wait_compiled(self, timeout: float | None = None) -> bool:
        """Wait until every graph's build has made its final choice (or failed),
        at most ``timeout`` seconds; True if none is running. Replays need not
        wait: they run the interpreted tier, then each engine as it is ready."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for entry in list(self._cache.values()):
            wait = getattr(entry.compiled, "wait", None)
            if wait is not None and not wait(None if deadline is None else max(0.0, deadline - time.monotonic())):
                return False
        return True


def _written_argument(inputs: Sequence[torch.Tensor], program: Any) -> int | None:
    """The index of an argument whose copy the captured program writes in place, if any."""
    if program is None:
        return None
    written = {o.storage for o in program.outside}
    return next((i for i, t in enumerate(inputs) if t.untyped_storage()._cdata in written), None)


def _grad_sources(fn: Callable[..., Any], program: Any) -> tuple[torch.Tensor, ...]:
    """Tensors the captured program reads that require grad (a module's parameters,
    a closure's weights); where the program is not recorded op by op (torch's CUDA
    graphs carry the capture), a module's parameters."""
    if program is None:
        return tuple(fn.parameters()) if isinstance(fn, torch.nn.Module) else ()
    found: dict[int, torch.Tensor] = {}
    for record in program.records:
        for t in tree_flatten((record.args, record.kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.requires_grad:
                found.setdefault(id(t), t)
    return tuple(found.values())


def _run_alone(g: Graph, segment: Any) -> Callable[[], None]:
    """``g.replay()`` for a graph whose only node is the torch program
    ``segment``, on the host default stream: the segment's run without the
    graph and stream calls around it (about 2 us less per call)."""
    errors = g.replay_errors
    run = segment.run

    def replay() -> None:
        if errors:  # an earlier replay's failure on another stream
            g._raise_replay_errors()
        run()
        if errors:
            g._raise_replay_errors()

    return replay


@contextlib.contextmanager
def _compilable(enabled: bool) -> Iterator[None]:
    """For the compiled tier, record attention as its separate ops rather than
    the fused fast-path kernel, which inductor cannot compile or fuse."""
    if not enabled:
        yield
        return
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def _signature(args: Sequence[Any], role: str, device_type: str) -> Signature:
    for i, a in enumerate(args):
        if not isinstance(a, torch.Tensor):
            raise InvalidValueError(f"{role}[{i}] is a {type(a).__name__}; graphed callables take tensors only")
        if a.device.type != device_type:
            raise InvalidValueError(
                f"{role}[{i}] is on {a.device}; on the {device_type} backend graphed callables take "
                f"{device_type} tensors. Move it with .to({device_type!r})"
            )
        if a.layout is not torch.strided:
            raise InvalidValueError(
                f"{role}[{i}] is a {a.layout} tensor; graphed callables take dense (strided) tensors. "
                "Convert it with .to_dense()"
            )
        try:
            a.untyped_storage().data_ptr()
        except RuntimeError:  # torch's refusal was the call's error, naming no argument
            raise InvalidValueError(
                f"{role}[{i}] has no storage of its own (a tensor inside torch.func's vmap or grad, or a "
                "functional wrapper); graphed callables replay on tensors with memory. Call it outside the "
                "transform"
            ) from None
    return tuple((tuple(a.shape), a.dtype) for a in args)


def _bad_call(args: Sequence[Any], device_type: str, error: BaseException) -> BaseException:
    """The InvalidValueError for arguments of a call that failed with ``error``
    on a cached signature, or ``error`` itself where the arguments are fine."""
    try:
        _signature(args, "call", device_type)
    except InvalidValueError as refusal:
        return refusal
    return error


def _warm_up(fn: Callable[..., Any], inputs: Sequence[torch.Tensor], iters: int) -> None:
    """Run ``fn`` a few times before capture, so that lazy initialisation
    (workspaces, first-call caches) does not land in the graph."""
    with torch.no_grad():
        for _ in range(iters):
            fn(*inputs)


def make_graphed_callables(
    callables: Callable[..., Any] | Sequence[Callable[..., Any]],
    sample_args: Sequence[torch.Tensor] | Sequence[Sequence[torch.Tensor]],
    *,
    num_warmup_iters: int = 3,
    pool: PoolId | None = None,
    cache_size: int = 8,
    tier: str = "interpreted",
    wait: bool = False,
) -> Any:
    """Graphed versions of ``callables`` for inference (``torch.cuda.make_graphed_callables``).

    ``callables`` is one callable (then ``sample_args`` is a tuple of
    tensors) or a sequence of them (then one tuple per callable). Each is
    warmed up ``num_warmup_iters`` times and captured on its sample
    arguments; all graphs share one memory pool (``pool``, or a new one).
    A call with a new shape signature captures another graph, keeping at
    most ``cache_size`` per callable (least recently used go first).

    On the host backend, ``tier`` picks how replays run: ``"interpreted"``
    re-runs the recorded aten ops (bitwise identical to eager for
    deterministic ops, always available); ``"compiled"`` runs the captured
    program with the fastest engine installed that agrees with eager
    (AOTInductor, ONNX Runtime; numerically close but not bitwise identical;
    see :func:`accel.graph.compile_graph`). Its builds run in a background
    thread: calls replay the interpreted tier at first, then the first
    engine that agrees with eager (ONNX Runtime: a second or two; from the
    disk cache, a tenth of one), then the fastest once every engine is
    built and timed, or at once the one an earlier run chose.
    ``compile_status()`` says what runs, ``wait_compiled()`` waits for the
    final choice. A program no engine can take is refused at capture
    (``NotSupportedError``); a build that fails later warns
    (``BuildWarning``) and leaves the interpreted tier. ``wait=True`` builds
    in the calling thread instead, before the capture returns, announcing a
    build not in the disk cache with a ``BuildWarning`` and raising if no
    engine agrees. ``"auto"`` is ``"compiled"`` that keeps the interpreted
    tier, without a word, for programs the compiled tier cannot take. Where
    the engine chosen returns new tensors (AOTInductor), a compiled call on
    the default stream passes it the caller's tensors and returns its new
    outputs, without copies. On CUDA, with a
    torch built for it, torch's CUDA graphs carry the capture and replay the
    kernels (the default tier only); a call queues the replay on the current
    stream and orders torch's current stream after it, without waiting on
    the host.

    Unlike torch's, the result is inference-only and modules are not
    modified: a :class:`GraphedCallable` is returned in their place.
    Replays record no autograd history, so where eager would (grad mode on,
    and an argument, or a parameter or other tensor the graph reads,
    requires grad) a call raises :class:`~accel.NotSupportedError` instead
    of returning an output without gradient: call it under
    ``torch.no_grad()`` or ``torch.inference_mode()``, and train with the
    eager callable.

    >>> import torch, accel
    >>> mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()).eval()
    >>> fast = accel.graph.make_graphed_callables(mlp, (torch.randn(2, 8),))
    >>> x = torch.randn(2, 8)
    >>> with torch.no_grad():
    ...     torch.equal(fast(x), mlp(x))
    True
    """
    runtime = get_runtime()
    records_host_ops = runtime.backend.torch_integration is TorchIntegration.RECORD_HOST_OPS
    if not records_host_ops and _torch_api(runtime.backend) is None:
        raise NotSupportedError(
            f"make_graphed_callables on the {runtime.name} backend needs torch's graphs to share accel's "
            f"streams, which this torch cannot do (it has no {runtime.name} devices, or its {runtime.name} "
            "streams are not accel's); use torch's own graphs there (torch.xpu.XPUGraph)"
        )
    single = callable(callables)
    if not single and not isinstance(callables, (tuple, list)):
        raise InvalidValueError(
            f"callables must be a callable or a sequence of callables, got {type(callables).__name__}"
        )
    fns: list[Callable[..., Any]] = [callables] if callable(callables) else list(callables)
    if not fns or not all(callable(f) for f in fns):
        raise InvalidValueError("callables must be a callable or a non-empty sequence of callables")
    if not isinstance(sample_args, (tuple, list)):
        raise InvalidValueError(f"sample_args must be a tuple, got {type(sample_args).__name__}")
    samples = [sample_args] if single else list(sample_args)
    if len(samples) != len(fns):
        raise InvalidValueError(
            f"sample_args has {len(samples)} entries for {len(fns)} callables; pass one tuple per callable"
        )
    if tier not in ("interpreted", "compiled", "auto"):
        raise InvalidValueError(f"tier={tier!r} must be 'interpreted', 'compiled' or 'auto'")
    if tier != "interpreted" and not records_host_ops:
        raise NotSupportedError(
            f"tier={tier!r} compiles host programs; on the {runtime.name} backend torch's graph replays "
            "the captured kernels already: use the default tier"
        )
    if not isinstance(wait, bool):
        raise InvalidValueError(f"wait={wait!r} must be True or False")
    for name, value, low in (("num_warmup_iters", num_warmup_iters, 0), ("cache_size", cache_size, 1)):
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise InvalidValueError(f"{name}={value!r} must be an int >= {low}")
    shared = check_pool_id(pool, where="make_graphed_callables") or graph_pool_handle()
    graphed = []
    for fn, sample in zip(fns, samples):
        if not isinstance(sample, (tuple, list)):
            raise InvalidValueError(
                f"sample_args for {_name(fn)} must be a tuple of tensors, got {type(sample).__name__}"
            )
        g = GraphedCallable(
            fn, num_warmup_iters=num_warmup_iters, pool=shared, cache_size=cache_size, tier=tier, wait=wait
        )
        g.capture(*sample)
        graphed.append(g)
    return graphed[0] if single else tuple(graphed)
