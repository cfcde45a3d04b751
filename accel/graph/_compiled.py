"""The compiled replay tier: the captured torch program, run by the fastest engine that is exact enough.

A capture on the host backend yields a static program: fixed shapes, fixed
input and output tensors. This tier turns the recorded ops into an FX graph,
builds it with every engine installed (:mod:`accel.graph._engines`:
AOTInductor, ONNX Runtime over ONNX that accel emits itself or torch's
exporter writes), checks each one's results against eager on the
capture's inputs, times the ones that agree side by side, and keeps the
fastest. A replay is then one call into that engine, bound to the graph's own
input and output tensors.

Trade-offs, stated where users choose the tier:

- **Not bitwise identical** to eager: engines fuse and reorder float
  arithmetic. An engine is kept only if every output is within ``tolerance``
  of eager (default 1e-4, relative to the output's largest magnitude, at
  least 1), on the capture's inputs; ``CompiledProgram.candidates`` says what
  each engine measured and why one was rejected. The interpreted tier stays
  the exact one.
- **Build time**: a tenth of a second (accel's own ONNX emitter,
  ``onnxruntime-fx``), a second (torch's ONNX exporter, 3 s more for its
  import in a process's first export) to a minute (AOTInductor runs the C++
  compiler, in a process of its own) per graph and engine. Builds are cached
  on disk (``ACCEL_GRAPH_CACHE``, default ``~/.cache/accel/graphs``) under a
  hash of the program, the input layouts, the values of the tensors it bakes
  in, the engine and its version, torch's version, the CPU, torch's intra-op
  thread count and every build setting; a process that captures the same
  model again loads it. :func:`compile_graph` announces a build that cannot
  come from the cache with a :class:`BuildWarning` saying how long the last
  one took. :class:`BackgroundCompile` (``make_graphed_callables(...,
  tier="compiled")``) builds in a thread instead: replays run the
  interpreted tier, then the first engine that agrees with eager, then the
  one chosen.
- **A stable choice**: the engine chosen is kept in the cache
  (``choice-<hash>.json``) for the same program, engines and machine; a
  later run loads it without building or timing the others (delete the file
  to time them again). Ties keep the engine already serving.
- **Weights are baked in**: tensors the program reads that are not inputs
  (parameters, buffers) are compiled in as constants. Change them, and the
  compiled graph does not see it: capture and compile again.
- **Only the named outputs** are kept up to date; intermediate static
  tensors are not written by compiled replays.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import hashlib
import json
import operator
import os
import statistics
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from accel._errors import InvalidValueError, NotSupportedError
from accel._native import speedups
from accel._runtime import check_not_forked
from accel.graph._engines import ENGINES, Engine, Facts, _atomic, kill_builds

if TYPE_CHECKING:
    from accel.graph._graph import Graph
    from accel.graph._torch_capture import Program

__all__ = [
    "BackgroundCompile", "BuildWarning", "CompiledProgram", "bind_call", "cache_dir", "check_memory", "compile_graph",
]

#: Default largest accepted difference from eager, relative to the output's
#: largest magnitude (at least 1).
TOLERANCE = 1e-4


class BuildWarning(UserWarning):
    """The compiled tier is building a program that is not in the disk cache (a stall of seconds)."""


def cache_dir() -> Path:
    """Where compiled graphs are kept: ``$ACCEL_GRAPH_CACHE`` or ``~/.cache/accel/graphs``."""
    configured = os.environ.get("ACCEL_GRAPH_CACHE", "").strip()
    return Path(configured) if configured else Path.home() / ".cache" / "accel" / "graphs"


#: Seconds the last build in this process took (building every engine not cached), or None.
last_build_seconds: float | None = None


@dataclass
class Candidate:
    """What the compiled tier found out about one engine for one program."""

    engine: str
    #: "chosen", "ok" (agreed with eager, slower), "rejected", "failed", "not installed" or "not tried";
    #: while a build runs also "pending", "building" and "serving" (replays run it while the others build).
    status: str
    detail: str = ""
    #: Seconds of one run (its median round), measured in rounds interleaved with the other engines.
    seconds: float | None = None
    #: 25th and 75th percentile of its rounds' seconds per run, and how many rounds.
    spread: tuple[float, float] | None = None
    rounds: int = 0
    max_error: float | None = None
    build_seconds: float | None = None
    cached: bool = False

    def __str__(self) -> str:
        parts = [f"{self.engine}: {self.status}"]
        if self.seconds is not None:
            spread = "" if self.spread is None else f" ({self.spread[0] * 1e6:.1f}-{self.spread[1] * 1e6:.1f})"
            parts.append(f"{self.seconds * 1e6:.1f} us/run{spread} in {self.rounds} rounds")
        if self.max_error is not None:
            parts.append(f"max |error| {self.max_error:.1e}")
        if self.build_seconds is not None:
            parts.append(("loaded in" if self.cached else "built in") + f" {self.build_seconds:.1f} s")
        if self.detail:
            parts.append(self.detail)
        return ", ".join(parts)


class CompiledProgram:
    """A graph's torch program run by one engine, bound to the graph's tensors.

    ``engine`` names the engine chosen, ``candidates`` what every engine
    measured (``str(c)`` for a line each). Calling it runs one replay.
    """

    def __init__(
        self,
        engine: str,
        path: Path,
        key: str,
        replay: Callable[[], Any],
        candidates: list[Candidate],
        *,
        built: bool,
        seconds: float,
        tolerance: float,
    ) -> None:
        self.engine = engine
        self.path = path
        self.key = key
        #: True when this process built the chosen engine's file, False when it came from the cache.
        self.built = built
        #: Seconds spent building, loading, validating and timing every engine.
        self.seconds = seconds
        self.tolerance = tolerance
        self.candidates = candidates
        #: The bound replay: the engine's own call, with nothing of accel's around it where possible.
        self.replay = replay
        #: The engine's runner called directly on the inputs (no copy of results), for comparison.
        self.raw: Callable[[], Any] = getattr(replay, "raw", replay)
        #: Where the engine allows it (AOTInductor), a call on any tensors laid out
        #: like the inputs that returns new outputs: no copy in or out.
        self.direct: Callable[[list[torch.Tensor]], list[torch.Tensor]] | None = getattr(replay, "direct", None)
        #: Raises what a run of the engine raised as an accel error (:meth:`Engine.failed`).
        self.failed: Callable[[Exception], NoReturn] = getattr(replay, "failed", _reraise)

    def __repr__(self) -> str:
        return f"CompiledProgram({self.engine}, {self.path.name})"

    def __call__(self) -> None:
        try:
            self.replay()
        except Exception as exc:  # noqa: BLE001 - the engine's error, as an accel one
            self.failed(exc)

    def report(self) -> str:
        """One line per engine: chosen or not, and why."""
        return "\n".join(str(c) for c in self.candidates)


def bind_call(
    compiled: CompiledProgram,
    inputs: Sequence[torch.Tensor],
    output: Any,
    runtime: Any,
    device: int,
) -> Callable[[Sequence[torch.Tensor]], Any]:
    """A graphed call of ``compiled`` made whole: arguments in, result out, for
    a graph that is the compiled program alone.

    Everything that does not change between calls is looked up here, once.
    A call checks, in this order: the arguments' shapes and dtypes against
    the graph's inputs, the calling thread's current stream on ``device``,
    and whether each tensor can be handed to the engine as it lies (on the
    host, contiguous, not a negated or conjugated view, whose memory holds
    other values than the tensor's; its memory is checked where its address
    changed since the last call, :func:`check_memory`). AOTInductor takes
    such tensors and returns new outputs; ONNX Runtime reads them where they
    lie (see :func:`_taking_call`) and writes the graph's static outputs.
    Other tensors are copied (AOTInductor: into new contiguous host tensors;
    ONNX Runtime: into the bound buffers), as a direct caller of the engine
    does, and torch's copy refuses what it cannot copy. It returns None,
    having done nothing, when the arguments' shapes or dtypes are not the
    graph's, or the current stream is not the default one: the caller then
    looks the graph up by the arguments' signature, or replays it on that
    stream. In a child forked after accel was initialized it refuses the call
    (:func:`accel._runtime.check_not_forked`) rather than run the engine: the
    engines' thread pools (ONNX Runtime's, AOTInductor's OpenMP) have no threads
    there, and a run waited for them forever.
    """
    # runtime.current_stream(device), inlined: the thread's current streams
    # (absent: the default one). A third of the whole overhead otherwise.
    thread = runtime._state
    default = runtime.default_stream(device)
    direct, failed = compiled.direct, compiled.failed
    if direct is not None and all(t.is_contiguous() for t in inputs):
        return _direct_call(direct, inputs, output, thread, device, default, failed)
    replay = compiled.replay
    take = getattr(replay, "take", None)
    if take is not None:
        return _taking_call(take, replay, inputs, output, thread, device, default, failed)
    return _copying_call(replay, inputs, output, thread, device, default, failed)


def _reraise(exc: Exception) -> NoReturn:
    """The ``failed`` of an engine call that raises its errors as they are."""
    raise exc


def _same_signature(args: Sequence[Any], signature: list[tuple[torch.Size, torch.dtype]]) -> bool:
    """Whether ``args`` are tensors of the shapes and dtypes in ``signature``
    (anything else: False, for the caller's lookup to refuse it clearly)."""
    if len(args) != len(signature):
        return False
    try:
        for a, (shape, dtype) in zip(args, signature):
            if a.shape != shape or a.dtype is not dtype:
                return False
    except AttributeError:
        return False
    return True


def _direct_call(
    run: Callable[[list[torch.Tensor]], list[torch.Tensor]],
    inputs: Sequence[torch.Tensor],
    output: Any,
    thread: Any,
    device: int,
    default: Any,
    failed: Callable[[Exception], NoReturn] = _reraise,
) -> Callable[[Sequence[torch.Tensor]], Any]:
    """The graphed call of an engine that takes the caller's tensors and returns
    new outputs (AOTInductor's runner, built for contiguous host inputs). What
    the runner raises goes to ``failed`` (:meth:`Engine.failed`: an accel error).

    The runner reads each tensor's memory at its address as the program's
    layout: a meta or device tensor's address read as host memory crashed,
    a negated view's memory holds -x (the call computed on it), and a tensor
    whose storage was resized to 0 bytes has its offset from 0 for an address
    (SIGSEGV). Those are copied into new contiguous host tensors (torch's
    copy resolves the view, refuses what it cannot read) or refused."""
    signature = [(t.shape, t.dtype) for t in inputs]
    # The conjugate bit only exists on complex tensors: not asked of real ones.
    real = not any(t.is_complex() for t in inputs)

    def fresh(a: torch.Tensor, i: int) -> torch.Tensor:
        check_memory([a], i)
        shape, dtype = signature[i]
        return torch.empty(shape, dtype=dtype, device="cpu").copy_(a)

    if isinstance(output, torch.Tensor) and len(inputs) == 1:
        ((shape, dtype),) = signature
        # The address of the last argument found to have memory behind it; None at first
        # (not 0: a tensor whose storage was freed has its offset from 0 for an address).
        checked: int | None = None

        def direct_one(args: Sequence[torch.Tensor]) -> Any:
            nonlocal checked
            try:
                (a,) = args
                if a.shape != shape or a.dtype is not dtype:
                    return None
            except (ValueError, AttributeError):  # not one tensor: the caller's lookup refuses it
                return None
            if thread.streams.get(device, default) is not default:
                return None
            check_not_forked()
            if a.is_cpu and a.is_contiguous() and not a.is_neg() and (real or not a.is_conj()):
                pointer = a.data_ptr()
                if pointer != checked:
                    check_memory(args)
                    checked = pointer
                given = a
            else:
                given = fresh(a, 0)
            try:
                return run([given])[0]
            except Exception as exc:  # noqa: BLE001 - the runner's error, as an accel one
                failed(exc)

        return _steady(direct_one, inputs, thread, device, default, run, None, None, real, failed)
    spec = tree_flatten(output)[1]
    checked_all: tuple[int, ...] = ()

    def direct_any(args: Sequence[torch.Tensor]) -> Any:
        nonlocal checked_all
        if not _same_signature(args, signature) or thread.streams.get(device, default) is not default:
            return None
        check_not_forked()
        if all(a.is_cpu and a.is_contiguous() and not a.is_neg() and (real or not a.is_conj()) for a in args):
            pointers = tuple([a.data_ptr() for a in args])
            if pointers != checked_all:
                check_memory(args)
                checked_all = pointers
            given = list(args)
        else:
            given = [fresh(a, i) for i, a in enumerate(args)]
        try:
            results = run(given)
        except Exception as exc:  # noqa: BLE001 - as direct_one
            failed(exc)
        return tree_unflatten(results, spec)

    finish = functools.partial(tree_unflatten, treespec=spec)
    return _steady(direct_any, inputs, thread, device, default, run, finish, None, real, failed)


def _copying_call(
    replay: Callable[[], Any],
    inputs: Sequence[torch.Tensor],
    output: Any,
    thread: Any,
    device: int,
    default: Any,
    failed: Callable[[Exception], NoReturn] = _reraise,
) -> Callable[[Sequence[torch.Tensor]], Any]:
    """The graphed call of an engine bound to the graph's input tensors only:
    each argument is copied into its static input (the static input itself
    is not), then the bound replay runs; what it raises goes to ``failed``."""
    signature = [(t.shape, t.dtype) for t in inputs]
    if len(inputs) == 1:
        (static,) = inputs
        ((shape, dtype),) = signature

        def replay_one(args: Sequence[torch.Tensor]) -> Any:
            try:
                (a,) = args
                if a.shape != shape or a.dtype is not dtype:
                    return None
            except (ValueError, AttributeError):
                return None
            if thread.streams.get(device, default) is not default:
                return None
            check_not_forked()
            # Not a comparison of addresses: a negated or transposed view
            # of the static input shares its address and holds other values.
            if a is not static:
                copy_into(static, a)
            try:
                replay()
            except Exception as exc:  # noqa: BLE001 - the engine's error, as an accel one
                failed(exc)
            return output

        return replay_one

    def replay_any(args: Sequence[torch.Tensor]) -> Any:
        if not _same_signature(args, signature) or thread.streams.get(device, default) is not default:
            return None
        check_not_forked()
        for i, (static, a) in enumerate(zip(inputs, args)):
            if a is not static:
                copy_into(static, a, i)
        try:
            replay()
        except Exception as exc:  # noqa: BLE001 - as replay_one
            failed(exc)
        return output

    return replay_any


def _taking_call(
    take: tuple[Callable[[], Any], Callable[[Sequence[torch.Tensor]], None]],
    replay: Callable[[], Any],
    inputs: Sequence[torch.Tensor],
    output: Any,
    thread: Any,
    device: int,
    default: Any,
    failed: Callable[[Exception], NoReturn] = _reraise,
) -> Callable[[Sequence[torch.Tensor]], Any]:
    """The graphed call of an engine that can read the caller's tensors where
    they lie (ONNX Runtime: ``take`` is its call binding's ``(run, point)``).
    What a run raises goes to ``failed`` (:meth:`Engine.failed`), ``busy`` set back.

    The binding stays pointed at the last call's inputs: a call with the same
    tensors again (or new ones the allocator put at the same addresses, as
    it does for a loop's fresh tensor of one size) is the engine's run alone,
    with no copy and no rebinding; others point it at their memory first
    (about 0.6 us, against 0.4 to 1.7 us for copying 256 B to 96 KiB). The
    run reads the memory at that moment, so new values in the same tensor
    are seen. Pointing and running hold a lock: a call on another thread
    must not repoint the binding while a run reads through it, or leave it
    pointing at memory freed before this run reads it (a crash)."""
    run, point = take
    signature = [(t.shape, t.dtype) for t in inputs]
    # Runs of the call binding exclude each other by ``busy``. The steady case, a
    # call that finds the binding on its memory and no run under way, is the C
    # SteadyCall's (with the GIL only): it tests and sets ``busy`` in one step (no
    # call between the two: with the GIL held, no other thread runs and no
    # interrupt lands there) and runs at once, a tenth of the cost of taking the
    # lock (0.02 against 0.2 us quiet, 0.8 us under load, measured in the MLP's
    # call). Every call it hands back here takes the per-graph lock, waits out a
    # run under way and sets ``busy`` itself before pointing the binding, so no
    # run reads through a binding being repointed. A with block rather than
    # acquire() and try: no interrupt can land between taking the lock and the
    # block that gives it back (a lock left held hangs every later call). Without
    # a GIL (free-threaded Python) there is no SteadyCall: every call takes the lock.
    lock = threading.Lock()
    gil = bool(getattr(sys, "_is_gil_enabled", lambda: True)())
    binding = _Binding()
    # The memory a run writes: the graph's outputs, [start, end) each. The binding is
    # never pointed at tensors overlapping them (a call with the last call's result,
    # f(f(x))): the run would write its outputs over the inputs it is reading, and a
    # linear layer's result was off by up to 1.0. Those are copied in, like views.
    spans = [
        (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size())
        for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)
    ]

    def overlaps_outputs(args: Sequence[torch.Tensor]) -> bool:
        for a in args:
            start = a.data_ptr()
            end = start + a.numel() * a.element_size()
            if any(start < stop and begin < end for begin, stop in spans):
                return True
        return False

    if len(inputs) == 1:
        (static,) = inputs
        ((shape, dtype),) = signature

        def take_one(args: Sequence[torch.Tensor]) -> Any:
            try:
                (a,) = args
                if a.shape != shape or a.dtype is not dtype:
                    return None
            except (ValueError, AttributeError):  # not one tensor: the caller's lookup refuses it
                return None
            if thread.streams.get(device, default) is not default:
                return None
            check_not_forked()
            # Read in place: a contiguous host tensor. A meta or device tensor, or a
            # negated view (its memory holds -x: torch's copy resolves it), is
            # copied (or refused) instead.
            if a.is_cpu and a.is_contiguous() and not a.is_neg():
                pointer = a.data_ptr()
                if not overlaps_outputs(args):
                    with lock:
                        while binding.busy:  # a steady call's run on another thread: wait it out
                            time.sleep(0)
                        binding.busy = True  # right after the test (no call between: see above)
                        try:
                            if pointer != binding.taken:
                                check_memory(args)
                                # An interrupt or error while (or right after) pointing must
                                # not leave the binding on memory a later call takes for the
                                # one it was pointed at before.
                                binding.taken = None
                                point(args)
                                binding.taken = pointer
                            run()
                        except Exception as exc:  # noqa: BLE001 - the engine's error, as an accel one
                            failed(exc)
                        finally:
                            binding.busy = False
                    return output
            copy_into(static, a)
            try:
                replay()
            except Exception as exc:  # noqa: BLE001 - as above
                failed(exc)
            return output

        return _steady(take_one, inputs, thread, device, default, run, output, binding, True, failed) if gil else take_one

    def take_any(args: Sequence[torch.Tensor]) -> Any:
        if not _same_signature(args, signature) or thread.streams.get(device, default) is not default:
            return None
        check_not_forked()
        if all(a.is_cpu and a.is_contiguous() and not a.is_neg() for a in args):  # as take_one
            pointers = tuple([a.data_ptr() for a in args])
            if not overlaps_outputs(args):  # as take_one
                with lock:
                    while binding.busy:  # as take_one
                        time.sleep(0)
                    binding.busy = True
                    try:
                        if pointers != binding.taken:
                            check_memory(args)
                            binding.taken = ()  # as take_one: pointing may stop halfway
                            point(args)
                            binding.taken = pointers
                        run()
                    except Exception as exc:  # noqa: BLE001 - as take_one
                        failed(exc)
                    finally:
                        binding.busy = False
                return output
        for i, (static, a) in enumerate(zip(inputs, args)):
            copy_into(static, a, i)
        try:
            replay()
        except Exception as exc:  # noqa: BLE001 - as take_one
            failed(exc)
        return output

    return _steady(take_any, inputs, thread, device, default, run, output, binding, True, failed) if gil else take_any


class _Binding:
    """Where a taking call's binding points (``taken``: an address for one input,
    a tuple of them for more; None or (): not pointed yet), and whether a run of it
    is under way (``busy``). Shared by the Python call and its compiled steady path."""

    __slots__ = ("taken", "busy")

    def __init__(self) -> None:
        self.taken: Any = None
        self.busy = False


def _steady(
    call: Callable[[Sequence[torch.Tensor]], Any],
    inputs: Sequence[torch.Tensor],
    thread: Any,
    device: int,
    default: Any,
    run: Callable[..., Any],
    finish: Any,
    binding: _Binding | None,
    real: bool,
    failed: Callable[[Exception], NoReturn],
) -> Callable[[Sequence[torch.Tensor]], Any]:
    """``call`` behind its steady path in C (``SteadyCall``: a direct engine's
    ``run(list)`` with ``finish`` None for ``result[0]``, else ``finish(result)``;
    a taking engine's ``run()`` on ``binding``, returning ``finish``), which
    hands every other call to ``call``.
    What its run raises goes to ``failed``, as in ``call``.
    The steady path's checks in Python cost about 1 us a call, the engine's
    runner 2 to 4 us on the small MLP of the benchmark."""
    return speedups.SteadyCall(call, list(inputs), thread, device, default, run, finish, binding, real, failed)


def check_memory(args: Sequence[torch.Tensor], first: int = 0) -> None:
    """Refuse a tensor with no memory behind it (its storage resized to 0 bytes,
    as sharded training frees parameters): its address is its offset from 0, and
    an engine reading it there, or torch copying from it, crashes. Likewise one
    whose storage was resized to fewer bytes than its elements reach: torch
    keeps its shape, and the engine (or torch's copy) read past the end of the
    new allocation (garbage results; past the heap's end, a crash). Checked
    before a copy, and where ONNX Runtime's binding is pointed at new memory
    (a call reading the same memory again does not pay for it). ``first``: the
    index of ``args[0]`` among the call's arguments, for the message."""
    for i, a in enumerate(args, first):
        count = a.numel()
        if not count:
            continue
        storage = a.untyped_storage()
        if not storage.data_ptr():
            raise InvalidValueError(
                f"call[{i}] has no memory behind it (its storage was resized to 0 bytes); "
                "pass a tensor whose storage holds its elements"
            )
        # One past the last element it reaches (strides are never negative); the sum
        # costs 0.9 us, so not for a contiguous tensor, which reaches its count.
        end = a.storage_offset() + (
            count if a.is_contiguous() else 1 + sum([(n - 1) * s for n, s in zip(a.shape, a.stride())])
        )
        if end * a.element_size() > storage.nbytes():
            raise InvalidValueError(
                f"call[{i}] reaches {end * a.element_size()} bytes into its storage, which holds "
                f"{storage.nbytes()} (it was resized smaller); pass a tensor whose storage holds its elements"
            )


def copy_into(static: torch.Tensor, a: torch.Tensor, i: int = 0) -> None:
    """``static.copy_(a)`` for the call's argument ``i`` (checked by :func:`check_memory`).
    A view of ``static``'s own memory (transposed, negated: the same address, other
    values) is read into a new tensor first: torch refuses a copy between tensors
    that overlap in part, and skipping the copy because the address matched
    computed on the static input's values instead of the argument's."""
    check_memory([a], i)
    if a.untyped_storage().data_ptr() == static.untyped_storage().data_ptr():
        a = a.clone()
    static.copy_(a)


def _check(g: Graph, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> Program:
    program: Program | None = g.program
    if program is None or not program.records:
        raise NotSupportedError(f"{g!r} recorded no torch ops; there is nothing to compile")
    if not program.segments:
        raise NotSupportedError(f"{g!r} recorded only views and allocations; there is nothing to compile")
    if len(program.segments) != 1:
        raise NotSupportedError(
            f"{g!r} interleaves its torch ops with other stream work ({len(program.segments)} pieces); "
            "the compiled tier needs them in one piece. Keep the interpreted tier for this graph."
        )
    collectives = sorted({str(r.func) for r in program.records if r.func.namespace == "c10d"})
    if collectives:
        raise NotSupportedError(
            f"{g!r} communicates ({', '.join(collectives)}); the compiled tier compiles computation only. "
            "Keep the interpreted tier for this graph (its replays run the collectives)"
        )
    if program.outside:
        first = program.outside[0]
        raise NotSupportedError(
            f"{g!r} writes in place to {len(program.outside)} tensor(s) made outside the capture ({first.op} "
            f"writes one of shape {tuple(first.tensors[0].shape)}, a KV cache perhaps); the compiled tier "
            "bakes the tensors it reads in as constants and replays pure programs only. Keep the "
            "interpreted tier for this graph, or pass the state in and out as inputs and outputs."
        )
    for role, tensors in (("inputs", inputs), ("outputs", outputs)):
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise InvalidValueError(f"compile_graph: {role} must be torch tensors")
    if not outputs:
        raise InvalidValueError("compile_graph: name at least one output tensor to keep up to date")
    return program


def _engines(names: Sequence[str] | None) -> list[Engine]:
    if names is None:
        return list(ENGINES.values())
    if isinstance(names, str) or not names:
        raise InvalidValueError(f"engines={names!r} must be a non-empty list of names from {sorted(ENGINES)}")
    unknown = [n for n in names if n not in ENGINES]
    if unknown:
        raise InvalidValueError(f"unknown engines {unknown}; choose from {sorted(ENGINES)}")
    return [ENGINES[n] for n in names]


def compile_graph(
    g: Graph,
    *,
    inputs: Sequence[torch.Tensor],
    outputs: Sequence[torch.Tensor],
    engines: Sequence[str] | None = None,
    tolerance: float = TOLERANCE,
) -> CompiledProgram:
    """Make ``g``'s replays run its torch program with the fastest engine that matches eager.

    ``inputs`` are the static input tensors new data will be copied into;
    ``outputs`` the tensors the capture returned that you will read. Every
    other tensor the program reads is compiled in as a constant. ``engines``
    limits the engines tried (default: every one installed, of
    ``"onnxruntime-fx"``, ``"onnxruntime"``, ``"onnxruntime-1thread"``, ``"aotinductor"`` and
    ``"aotinductor-cpp-gemm"``); one is kept if all its outputs
    are within ``tolerance`` of eager (relative to the largest magnitude,
    at least 1). The result's ``engine`` and ``report()`` say which was
    chosen and why. The choice is kept in the disk cache: compiling the same
    program again (in this process or another, with the same engines,
    versions and threads) keeps that engine if it still agrees with eager,
    without building or timing the others (delete its ``choice-*.json`` to
    time them again).

    Refused (:class:`~accel.NotSupportedError`) when the capture holds no
    torch program, interleaves torch ops with other stream work, writes to
    registered inputs or to other tensors made outside the capture (a KV
    cache), or no engine is installed, builds it and agrees with eager: use
    the interpreted tier (the default) for those.

    >>> import torch, accel
    >>> x = torch.randn(4, 8); lin = torch.nn.Linear(8, 8).eval()
    >>> g = accel.graph.Graph()
    >>> with accel.graph.graph(g):
    ...     y = torch.relu(lin(x))
    >>> fast = accel.graph.compile_graph(g, inputs=[x], outputs=[y])  # doctest: +SKIP
    >>> fast.engine  # doctest: +SKIP
    'onnxruntime-fx'
    """
    build = _Build(_check(g, inputs, outputs), inputs, outputs, _engines(engines), tolerance)
    build.announce(stacklevel=2)
    chosen = build.run()
    _attach(build.program, chosen, inputs)
    return chosen


def _attach(program: Program, compiled: CompiledProgram, inputs: Sequence[torch.Tensor]) -> None:
    """Make ``compiled`` run the program's replays.

    An engine may read the inputs where they were when it was bound (ONNX
    Runtime's IO binding holds their addresses): a replay after an input's
    memory moved (``resize_`` or ``set_`` on it, its storage resized) is
    refused, where the engine would read freed memory (a crash)."""
    replay = compiled.replay
    bound = [(t, t.data_ptr()) for t in inputs]

    def run() -> None:
        for i, (t, pointer) in enumerate(bound):
            if t.data_ptr() != pointer:
                raise InvalidValueError(
                    f"input {i} of the compiled program moved since compile_graph bound it (it was resized, "
                    "or set_ to other memory): the engine reads the memory it was bound to. Copy new data "
                    "into the static input (t.copy_(new)) instead, or capture and compile again"
                )
        try:
            replay()
        except Exception as exc:  # noqa: BLE001 - the engine's error, as an accel one
            compiled.failed(exc)

    program.segments[0].runner = run
    program.compiled = compiled


class _Stopped(Exception):
    """A background build was told to stop (at interpreter exit)."""


@dataclass
class _Plan:
    """One engine to try on a program: where its file is cached, and how it fared."""

    engine: Engine
    path: Path
    key: str
    settings: dict[str, Any]
    candidate: Candidate


class _Build:
    """One program's build by the compiled tier: what :func:`compile_graph` runs
    in the caller's thread and :class:`BackgroundCompile` in a thread of its own.

    Made in the caller's thread, which it refuses what no engine can take
    (the FX graph, the cache keys, what is installed: milliseconds), then
    :meth:`run`."""

    def __init__(
        self,
        program: Program,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        engines: list[Engine],
        tolerance: float,
    ) -> None:
        if not (isinstance(tolerance, (int, float)) and tolerance >= 0):
            raise InvalidValueError(f"tolerance={tolerance!r} must be a number >= 0")
        self.start = time.perf_counter()
        self.program, self.inputs, self.outputs, self.tolerance = program, list(inputs), list(outputs), tolerance
        self.gm = _to_fx(program, self.inputs, self.outputs)
        # The capture's input values, copied now: a build in the background runs while
        # calls copy their arguments into the graph's inputs. Each engine's trial run
        # reads these, and the reference results are computed from them.
        with torch.inference_mode(False), torch.no_grad():
            self.trial_inputs = [t.detach().clone() for t in self.inputs]
        self.threads = torch.get_num_threads()
        facts = Facts(
            work=sum(t.numel() for r in program.records if r.kind in ("out", "fallback") for t in r.outputs),
            ops=frozenset(r.func.overloadpacket.__name__ for r in program.records),
            threads=self.threads,
        )
        base = _program_key(self.gm, self.inputs)
        self.candidates: list[Candidate] = []
        self.plans: list[_Plan] = []
        for engine in engines:
            if not engine.applies(facts):
                self.candidates.append(Candidate(engine.name, "not tried", "it does not apply to this program"))
                continue
            version = engine.version()
            if version is None:
                self.candidates.append(Candidate(engine.name, "not installed", f"install: {engine.install}"))
                continue
            settings = engine.settings(facts)
            key = _engine_key(base, engine, version, settings, self.threads)
            candidate = Candidate(engine.name, "pending")
            self.candidates.append(candidate)
            self.plans.append(_Plan(engine, cache_dir() / f"{key}{engine.suffix}", key, settings, candidate))
        if not self.plans:
            raise NotSupportedError(
                "no engine of the compiled tier is installed for this program: "
                + "; ".join(str(c) for c in self.candidates)
                + ". Keep the interpreted tier, or install one"
            )
        self.missing = {p.path for p in self.plans if not p.path.exists()}
        # The choice among these engines, kept from the run that made it: the same
        # program, engines, versions, settings, CPU and threads (every plan's key).
        keys = "\n".join(sorted(p.key for p in self.plans))
        self.choice_path = cache_dir() / f"choice-{hashlib.sha256(keys.encode()).hexdigest()[:32]}.json"

    def announce(self, stacklevel: int) -> None:
        """Warn (:class:`BuildWarning`) when an engine's file is not in the disk cache."""
        missing = [p.engine.name for p in self.plans if p.path in self.missing]
        if missing:
            last = "" if last_build_seconds is None else f"; the last build took {last_build_seconds:.1f} s"
            warnings.warn(
                f"building the compiled tier with {', '.join(missing)} (not in the disk cache {cache_dir()}){last}",
                BuildWarning,
                stacklevel=stacklevel + 1,
            )

    def run(
        self, serve: Callable[[CompiledProgram], None] | None = None, stop: Callable[[], bool] | None = None
    ) -> CompiledProgram:
        """The engine to keep, bound to the graph's tensors.

        Engines are built (or loaded from the disk cache: those first) and
        validated one by one; ``serve``, where given, gets the first that
        agrees with eager, bound, at once (a graph replays it while the
        others build). The engine chosen in an earlier run (the choice file)
        is tried first and, if it still agrees with eager, kept without
        building or timing the others. Otherwise every engine that agrees is
        timed (:func:`_time_interleaved`) and :func:`_choose` picks one, the
        engine serving being the incumbent of ties; the choice is written
        for the next run. ``stop()`` true ends the build (:class:`_Stopped`)
        before its next step."""
        global last_build_seconds
        with torch.inference_mode(False), torch.no_grad():
            reference = [t.detach().clone() for t in self.gm(*self.trial_inputs)]
        earlier = _read_choice(self.choice_path)
        # Stable: the choice of an earlier run, then what is in the disk cache
        # (0.1 s to load), then the table's order (the emitted ONNX's build is the fastest).
        plans = sorted(self.plans, key=lambda p: (p.engine.name != earlier, p.path in self.missing))
        loaded: list[tuple[_Plan, Any, Callable[[], Any]]] = []
        served: CompiledProgram | None = None
        for plan in plans:
            if stop is not None and stop():
                raise _Stopped("the build was stopped")
            tried = self._try(plan, reference)
            if tried is None:
                continue
            loaded.append((plan, *tried))
            if plan.engine.name == earlier:
                plan.candidate.status = "chosen"
                plan.candidate.detail = (
                    f"the choice of an earlier run, kept ({self.choice_path.name} in the cache: delete it to "
                    "time the engines again)"
                )
                for other in plans:
                    if other.candidate.status == "pending":
                        other.candidate.status = "not tried"
                        other.candidate.detail = f"an earlier run chose {earlier}"
                return self._bound(plan, tried[0])
            if serve is not None and served is None:
                plan.candidate.status = "serving"
                served = self._bound(plan, tried[0])
                serve(served)
        if self.missing:
            last_build_seconds = time.perf_counter() - self.start
        if stop is not None and stop():
            raise _Stopped("the build was stopped")
        if not loaded:
            raise NotSupportedError(
                "no engine of the compiled tier could run this program and agree with eager: "
                + "; ".join(str(c) for c in self.candidates)
                + ". Keep the interpreted tier for this graph"
            )
        allocates = [plan.engine.allocates_outputs for plan, _, _ in loaded]
        runs = [_as_called(trial, self.trial_inputs) for _, _, trial in loaded]
        samples = _time_interleaved(runs, allocates, stop=stop)
        incumbent = next((i for i, (plan, _, _) in enumerate(loaded) if plan.candidate.status == "serving"), None)
        index, tied = _choose(samples, allocates, incumbent=incumbent)
        for (plan, _, _), times in zip(loaded, samples):
            ordered = sorted(times)
            c = plan.candidate
            c.status = "ok"
            c.seconds = statistics.median(ordered)
            c.spread = (ordered[len(ordered) // 4], ordered[(3 * len(ordered)) // 4])
            c.rounds = len(ordered)
        plan, program_, _ = loaded[index]
        plan.candidate.status = "chosen"
        if len(tied) > 1:
            engine = plan.engine
            plan.candidate.detail = "tied with " + ", ".join(loaded[i][0].engine.name for i in tied if i != index) + (
                "; kept for writing the graph's outputs in place" if not engine.allocates_outputs
                and any(loaded[i][0].engine.allocates_outputs for i in tied)
                else "; kept as the engine already serving" if index == incumbent
                else "; kept for its faster median round"
            )
        _write_choice(self.choice_path, plan.engine.name, self.candidates)
        if served is not None and index == incumbent:
            served.seconds = time.perf_counter() - self.start
            return served
        return self._bound(plan, program_)

    def _try(self, plan: _Plan, reference: list[torch.Tensor]) -> tuple[Any, Callable[[], Any]] | None:
        """Build (or load) ``plan``'s engine and run it once on the trial inputs: the
        loaded program and its trial replay if it agrees with ``reference``, else
        None (its candidate says why)."""
        engine, path, candidate = plan.engine, plan.path, plan.candidate
        t0 = time.perf_counter()
        candidate.cached = path.exists()
        candidate.status = "building"
        # A file from the disk cache that does not load or run (truncated by a full
        # disk, damaged) is removed and built once anew: left there, it would refuse its
        # engine in every later run. One that runs and disagrees is rejected as built.
        for build in [not candidate.cached, True]:
            try:
                if build:
                    engine.build(self.gm, self.trial_inputs, path, plan.settings)
                loaded = engine.load(path, self.threads)
                trial_outputs = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in self.outputs]
                trial = engine.bind(loaded, self.trial_inputs, trial_outputs)
                with torch.inference_mode():
                    trial()
                break
            except Exception as exc:  # noqa: BLE001 - engines raise many types; report which and why
                if not build:
                    candidate.cached = False
                    self.missing.add(path)
                    with contextlib.suppress(OSError):
                        path.unlink()
                    continue
                first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
                candidate.status, candidate.detail = "failed", f"{type(exc).__name__}: {first}"
                return None
            finally:
                candidate.build_seconds = time.perf_counter() - t0
        candidate.max_error = error = _max_error(trial_outputs, reference)
        if error > self.tolerance:
            candidate.status = "rejected"
            candidate.detail = f"differs from eager by more than the tolerance {self.tolerance:g}"
            return None
        candidate.status = "ok"
        return loaded, trial

    def _bound(self, plan: _Plan, loaded: Any) -> CompiledProgram:
        """``loaded`` (``plan``'s engine) bound to the graph's own tensors."""
        return CompiledProgram(
            plan.engine.name, plan.path, plan.key, plan.engine.bind(loaded, self.inputs, self.outputs),
            self.candidates, built=plan.path in self.missing, seconds=time.perf_counter() - self.start,
            tolerance=self.tolerance,
        )


def _read_choice(path: Path) -> str | None:
    """The engine an earlier run chose (:meth:`_Build.run`), or None."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # none yet, or unreadable: choose again
        return None
    engine = data.get("engine") if isinstance(data, dict) else None
    return engine if isinstance(engine, str) else None


def _write_choice(path: Path, engine: str, candidates: list[Candidate]) -> None:
    """Keep the choice of ``engine`` for later runs, with what every engine measured."""
    record = {
        "engine": engine,
        "chosen": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "report": [str(c) for c in candidates],
    }
    try:
        with _atomic(path) as tmp:
            Path(tmp).write_text(json.dumps(record, indent=1) + "\n")
    except OSError:  # a cache it cannot write: the next run chooses again
        pass


def _max_error(outputs: list[torch.Tensor], reference: list[torch.Tensor]) -> float:
    """Largest difference from eager, relative to each output's largest magnitude (at least 1)."""
    worst = 0.0
    for out, ref in zip(outputs, reference):
        if out.shape != ref.shape or out.dtype != ref.dtype:
            return float("inf")
        if not ref.is_floating_point():
            worst = max(worst, 0.0 if torch.equal(out, ref) else float("inf"))
            continue
        if ref.numel() == 0:
            continue
        scale = max(1.0, float(ref.abs().max()))
        diff = float((out.double() - ref.double()).abs().max())
        worst = max(worst, diff / scale if diff == diff else float("inf"))  # NaN: not a match
    return worst


def _as_called(trial: Callable[[], Any], inputs: list[torch.Tensor]) -> Callable[[], Any]:
    """``trial`` as a graphed call runs it: an engine that takes the caller's
    tensors is called on them, one that reads them where they lie (``take``:
    a call passing the same tensors again runs its binding alone) is run on
    its bound ones; the others copy the inputs into their bound buffers
    first, which a call pays for them."""
    direct = getattr(trial, "direct", None)
    if direct is not None:
        return functools.partial(direct, inputs)
    if getattr(trial, "take", None) is not None:
        return trial
    sources = [t.clone() for t in inputs]

    def copy_and_run() -> None:
        for static, source in zip(inputs, sources):
            static.copy_(source)
        trial()

    return copy_and_run


#: Seconds the competition waits before each engine's block where torch runs on more
#: than one thread: the engine timed before leaves worker threads spinning (OpenMP's
#: for AOTInductor, a session's pool for ONNX Runtime) that take the cores from the
#: next one. On 2 cores, ONNX Runtime on two threads then measured 335-500 us a run of
#: the CNN at batch 8 (its loop: 215-265 us) and lost to its one-thread session, which
#: a user's two-thread session beat by 1.27x-1.46x; waiting 15 ms it measured 201 us
#: and was kept (the attention block at batch 8 likewise: 792 -> 554 us). 3 ms was not
#: enough (one choice of two). It counts in the timing's ``limit``.
SETTLE_S = 0.015


def _time_interleaved(
    runs: list[Callable[[], Any]],
    allocates: list[bool],
    *,
    rounds: int = 11,
    most: int = 41,
    budget: float = 2e-3,
    least: int = 20,
    limit: float = 2.0,
    settle: float | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[list[float]]:
    """Each of ``runs``' seconds per run in every round, for :func:`_choose`.

    Runs are timed in rounds that take turns, so that a busy machine slows
    them all alike, and compared round by round (:func:`_choose`). A
    calibration of about ``budget`` seconds each, after one warm-up run,
    says how long a run takes: an engine's first runs are slower (ONNX
    Runtime's memory arena grows, caches fill) and must not decide the
    choice. Each round then times a block of each engine's runs, after
    untimed ones (a tenth of the block, at least one): the first runs after
    another engine's refill the caches it evicted, which a call in a loop
    does not pay (the benchmark measured that refill at 2.5 us a call on
    the attention block at batch 1 and 8 us on the CNN at batch 8, in
    rounds of 100 calls; the first run after a switch took 924 us against
    about 450 us on the attention block at batch 8, 428 us against 240 us
    on the CNN). A block is ``budget`` seconds of runs (at most 400), and at
    least ``least`` runs: a round of a few runs of a large program judged
    it unlike a loop of calls (the attention block at batch 8 on one
    thread: ONNX Runtime 601 us/run, AOTInductor 594 us in rounds of three
    runs, AOTInductor kept; in a loop 445 us and 476 us). Where ``rounds``
    rounds of such blocks would take more than ``limit`` seconds, every
    block is shortened alike to fit (down to one run). After ``rounds``
    rounds, more are run while the choice is a tie, up to ``most`` rounds or
    ``limit`` seconds of timing: a choice made in few rounds on a busy
    machine went to the slower engine (the attention block at batch 8
    chose AOTInductor, 6 % behind ONNX Runtime). Timing thus takes about
    ``rounds`` x ``least`` runs of every engine for a program slower than
    ``budget / least`` a run (0.45 s for the attention block at batch 8 on
    one thread, against 0.1 s in blocks of ``budget``), and up to ``limit``
    plus a round while tied; only a program whose ``rounds`` rounds of two
    runs (one untimed) take longer than ``limit`` takes longer. Where torch
    runs on more than one thread, each block starts ``settle`` seconds
    (default :data:`SETTLE_S`) after the engine before it stopped, so that
    its worker threads are no longer spinning on the cores the next engine
    is timed on. ``stop()`` true ends the timing (:class:`_Stopped`) at the
    next round."""
    with torch.inference_mode():
        seconds = []
        for run in runs:
            run()
            t0 = time.perf_counter()
            calls = 0
            while time.perf_counter() - t0 < budget:
                run()
                calls += 1
            seconds.append(max(time.perf_counter() - t0, 1e-9) / calls)
        counts = [max(least, min(400, int(budget / s))) for s in seconds]
        if settle is None:
            settle = SETTLE_S if torch.get_num_threads() > 1 else 0.0
        # One round's time, untimed runs and waits included; the blocks are shortened
        # alike to fit ``rounds`` rounds in ``limit``.
        running = sum((c + max(1, c // 10)) * s for c, s in zip(counts, seconds))
        waiting = settle * len(runs)
        if (running + waiting) * rounds > limit:
            scale = max(0.0, limit / rounds - waiting) / running
            counts = [max(1, int(c * scale)) for c in counts]
        samples: list[list[float]] = [[] for _ in runs]
        start = time.perf_counter()
        for r in range(most):
            if stop is not None and stop():
                raise _Stopped("the build was stopped")
            for i in [(r + k) % len(runs) for k in range(len(runs))]:  # each round starts with another
                run = runs[i]
                if settle:
                    time.sleep(settle)  # the other engines' pools go idle first (see SETTLE_S)
                for _ in range(max(1, counts[i] // 10)):  # untimed: the first runs after another engine's refill caches
                    run()
                t0 = time.perf_counter()
                for _ in range(counts[i]):
                    run()
                samples[i].append((time.perf_counter() - t0) / counts[i])
            if r + 1 >= rounds and (len(_choose(samples, allocates)[1]) == 1 or time.perf_counter() - start > limit):
                break
    return samples


#: How much faster, in three rounds of four, an engine must be than another
#: to be clearly faster (else they tie). The competition's rounds and a loop
#: of calls disagree by a few %: the attention block at batch 8 on one
#: thread was timed 3 % slower on AOTInductor than ONNX Runtime in the
#: competition and ran 5 % slower in a loop (load 0.5); under more load it
#: was timed 1 % faster and ran 7 % slower. A tie keeps the engine writing
#: outputs in place (ONNX Runtime), whose graphed call ran 0-10 % ahead of
#: a user's own ONNX Runtime session.
MARGIN = 0.05


def _choose(
    samples: list[list[float]], allocates: list[bool], margin: float = MARGIN, incumbent: int | None = None
) -> tuple[int, list[int]]:
    """The engine to keep (an index), and those it is tied with, from each
    engine's seconds per run in the same rounds.

    Engines are compared round by round (the ratio of their times in one
    round, which the load of that moment hits alike) against the one whose
    median round is fastest: an engine is clearly slower when it was slower
    by more than ``margin`` in three rounds out of four or more (the lower
    quartile of its ratios above 1 + ``margin``), tied otherwise. Among
    tied engines, those whose run writes the graph's own outputs are kept
    before those that allocate new outputs at every call (AOTInductor's
    runner), a cost a few rounds sample poorly and that grows with the
    outputs; then the fastest median round. An engine that allocates thus
    replaces ONNX Runtime only when faster by ``margin`` in three rounds of
    four. A single round decides nothing: a lucky one (or an unlucky one)
    is a quarter of no ratio list. Among engines tied and alike in that,
    ``incumbent`` (the engine already serving the graph's replays) is kept
    before the faster median round, which within a tie is noise: a tie
    decided by it may be decided the other way in the next run."""
    medians = [statistics.median(times) for times in samples]
    best = min(range(len(samples)), key=lambda i: medians[i])
    tied = [best]
    for i, times in enumerate(samples):
        if i == best:
            continue
        ratios = sorted(t / b for t, b in zip(times, samples[best]))
        if ratios[len(ratios) // 4] <= 1.0 + margin:
            tied.append(i)
    chosen = min(tied, key=lambda i: (allocates[i], i != incumbent, medians[i]))
    return chosen, sorted(tied)


#: How long interpreter exit waits for background builds to stop. A build stops
#: at its next step: after an engine's build or load, before a round of timing.
#: AOTInductor's builds run in processes of their own, killed at exit, so the
#: longest step left is an ONNX export (1-4 s on the 2-core VM). The wait is
#: needed: the interpreter ends a daemon thread that is still running when it
#: finalizes at the thread's next GIL take, and where that is inside a torch call
#: (which lets the GIL go) the process aborted ("terminate called without an
#: active exception"). A step still running after the wait is left to that.
EXIT_WAIT_S = 5.0

# Background builds under way, stopped at interpreter exit.
_RUNNING: set[BackgroundCompile] = set()
_RUNNING_LOCK = threading.Lock()


class BackgroundCompile:
    """A compiled-tier build running in a thread, serving its graph as it goes.

    Until an engine agrees with eager the graph replays its interpreted tier;
    then the first engine that does serves its replays (the emitted ONNX
    in a tenth of a second, the exporter's in seconds, AOTInductor's C++
    compile in tens of), while
    the others build; then the one chosen among them (see :meth:`_Build.run`).
    ``compiled`` is the program serving now (None: the interpreted tier),
    ``state`` "building", "ready" (the final choice serves) or "failed"
    (``error`` says why; the graph keeps what served before). ``wait()``
    blocks until the final choice, ``wait(first=True)`` until an engine
    serves. With ``wait=True`` the build runs in the caller's thread instead,
    done when this returns. ``warn``: a build that ends with no engine says
    so with a :class:`BuildWarning`.
    """

    def __init__(
        self,
        g: Graph,
        inputs: Sequence[torch.Tensor],
        outputs: Sequence[torch.Tensor],
        *,
        engines: Sequence[str] | None = None,
        tolerance: float = TOLERANCE,
        on_ready: Callable[[CompiledProgram], None] | None = None,
        wait: bool = False,
        warn: bool = False,
    ) -> None:
        self._build: _Build | None = _Build(_check(g, inputs, outputs), inputs, outputs, _engines(engines), tolerance)
        #: What every engine measured, or why it was not kept; filled in as the build goes.
        self.candidates = self._build.candidates
        self._on_ready = on_ready
        self._warn = warn
        self.state = "building"
        self.compiled: CompiledProgram | None = None
        self.error: BaseException | None = None
        #: Seconds from the start of the build to its first engine serving (None: none yet).
        self.first_seconds: float | None = None
        #: Seconds the last build in this process took when this one started (None: the first).
        self.last_build_seconds = last_build_seconds
        self._served = threading.Event()  # an engine serves, or the build ended
        self._done = threading.Event()
        self._stop = threading.Event()
        self._inline = wait
        if wait:
            self._run()
            return
        self._thread = threading.Thread(target=self._run, name="accel-graph-compile", daemon=True)
        with _RUNNING_LOCK:
            _RUNNING.add(self)
        self._thread.start()

    def __repr__(self) -> str:
        return f"BackgroundCompile({self.status()})"

    def status(self) -> str:
        """What the graph's replays run: "building (last build took N s)",
        "compiled: <engine> (choosing among <engines>)" (or "(timing it)",
        the only engine), "compiled: <engine>" or "interpreted (compile
        failed: why)"."""
        compiled = self.compiled
        if compiled is None:
            if self.state == "failed":
                return f"interpreted (compile failed: {self.error})"
            last = "" if self.last_build_seconds is None else f" (last build took {self.last_build_seconds:.1f} s)"
            return f"building{last}"
        if self.state == "building":
            others = [c.engine for c in self.candidates
                      if c.status in ("pending", "building", "ok") and c.engine != compiled.engine]
            if not others:
                return f"compiled: {compiled.engine} (timing it)"
            return f"compiled: {compiled.engine} (choosing among {', '.join([compiled.engine, *others])})"
        return f"compiled: {compiled.engine}"

    def _serve(self, compiled: CompiledProgram) -> None:
        # One attribute store each: a replay running on another thread sees
        # one engine (or the interpreted tier) whole, never a mix.
        assert self._build is not None  # only while the build runs
        _attach(self._build.program, compiled, self._build.inputs)
        self.compiled = compiled
        if self._on_ready is not None:
            self._on_ready(compiled)
        if self.first_seconds is None:
            self.first_seconds = time.perf_counter() - self._build.start
        self._served.set()

    def _run(self) -> None:
        assert self._build is not None
        try:
            # In the caller's thread (wait=True) nothing replays meanwhile: no engine to serve early.
            final = self._build.run(serve=None if self._inline else self._serve, stop=self._stop.is_set)
            if final is not self.compiled:
                self._serve(final)
        except BaseException as exc:  # noqa: BLE001 - kept for the caller; the graph keeps what serves
            # Without its traceback, whose frames hold the build (the FX graph, the
            # trial inputs) and this (a cycle): kept, the graph's memory stayed
            # allocated until a garbage collection.
            self.error = exc.with_traceback(None)
            self.state = "failed" if self.compiled is None else "ready"
            if self._warn and self.compiled is None and not self._stop.is_set():
                warnings.warn_explicit(  # from the build's thread: no user frame to point at
                    f"the compiled tier's build failed; replays stay on the interpreted tier: {exc}",
                    BuildWarning, "accel", 0,
                )
        else:
            self.state = "ready"
        finally:
            # What only the build needed goes: the FX graph, the trial inputs, and
            # on_ready, whose closure holds the graphed callable's entry, which
            # holds this (a cycle that kept the graph's memory until a collection).
            self._build = self._on_ready = None
            with _RUNNING_LOCK:
                _RUNNING.discard(self)
            self._served.set()
            self._done.set()

    def stop(self) -> None:
        """End the build at its next step (after an engine's build or load, before
        a round of timing; an AOTInductor build's process is killed); what serves
        keeps serving."""
        self._stop.set()
        thread = getattr(self, "_thread", None)  # none: it ran in the caller's thread (wait=True), done
        if thread is not None and thread.ident is not None:
            kill_builds(thread.ident)

    def wait(self, timeout: float | None = None, *, first: bool = False) -> bool:
        """Block until the final choice serves (or the build failed), or with
        ``first`` until any engine serves; at most ``timeout`` seconds. True if so."""
        return (self._served if first else self._done).wait(timeout)


class _Exiting(BaseException):
    """Raised in a build's thread at interpreter exit. A BaseException: the
    exporters' own ``except Exception`` fallbacks must not swallow it."""


def _stop_at_exit() -> None:
    """Tell every background build to stop, and wait up to :data:`EXIT_WAIT_S` for them."""
    with _RUNNING_LOCK:
        builds = list(_RUNNING)
    for build in builds:
        build.stop()  # and its C++ compile: its thread then stops at once
        # An export in the thread (ONNX's first takes seconds, more on a busy
        # machine) has no step to stop at: it is interrupted at its next Python
        # bytecode. Left running past the wait, the interpreter ended the thread
        # inside a torch call and the process aborted. What it leaves half done
        # (torch.export's patched builtins) no later code of this process sees.
        ident = build._thread.ident
        if ident is not None and build._thread.is_alive():
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(_Exiting))
    kill_builds()  # any other thread's too (compile_graph on a daemon thread)
    deadline = time.monotonic() + EXIT_WAIT_S
    for build in builds:
        build._thread.join(max(0.0, deadline - time.monotonic()))


def _forked() -> None:
    """In a forked child the builds' threads do not exist: they never end there."""
    global _RUNNING_LOCK
    _RUNNING_LOCK = threading.Lock()  # another thread may have held it at the fork
    builds = list(_RUNNING)
    _RUNNING.clear()
    for build in builds:
        build.error = NotSupportedError("the process forked while the build ran in its parent")
        build.state = "failed" if build.compiled is None else "ready"
        build._served.set()
        build._done.set()


atexit.register(_stop_at_exit)
os.register_at_fork(after_in_child=_forked)


def _to_fx(program: Program, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> fx.GraphModule:
    """The recorded ops as an FX graph: inputs become placeholders, other
    tensors from outside the program become constants (module buffers)."""
    root = torch.nn.Module()
    graph = fx.Graph()
    env: dict[int, fx.Node] = {id(t): graph.placeholder(f"input_{i}") for i, t in enumerate(inputs)}
    input_storages = {t.untyped_storage().data_ptr() for t in inputs}
    registered = {t.untyped_storage().data_ptr() for t in program.inputs}
    constants = 0

    def node_of(value: Any) -> Any:
        nonlocal constants
        if not isinstance(value, torch.Tensor):
            return value
        node = env.get(id(value))
        if node is None:
            if value.untyped_storage().data_ptr() in input_storages:
                raise NotSupportedError(
                    "the program reads a view of an input made outside the capture; pass that view as "
                    "the input, or keep the interpreted tier"
                )
            name = f"constant_{constants}"
            constants += 1
            root.register_buffer(name, value.detach())
            node = env[id(value)] = graph.get_attr(name)
        return node

    for record in program.records:
        if record.kind == "mutate" and any(
            t.untyped_storage().data_ptr() in registered | input_storages for t in record.outputs
        ):
            raise NotSupportedError(
                f"{record.func} writes to an input of the graph; the compiled tier replays pure "
                "programs only. Keep the interpreted tier for this graph."
            )
        args, kwargs = tree_map(node_of, (record.args, record.kwargs))
        node = graph.call_function(record.func, tuple(args), dict(kwargs))
        if record.kind == "mutate":
            continue  # the written tensors keep their nodes, now holding the new values
        returns = record.func._schema.returns
        if len(returns) == 1 and str(returns[0].type) == "Tensor":
            env[id(record.outputs[0])] = node
        else:
            for i, t in enumerate(record.outputs):
                env[id(t)] = graph.call_function(operator.getitem, (node, i))
    results = []
    for t in outputs:
        made = env.get(id(t))
        if made is None or id(t) in {id(i) for i in inputs}:
            raise InvalidValueError(
                f"compile_graph: an output of shape {tuple(t.shape)} was not produced by the captured program"
            )
        results.append(made)
    graph.output(tuple(results))
    return fx.GraphModule(root, graph)


def _cpu_model() -> str:
    from accel._runtime import get_runtime

    return get_runtime().backend.device_properties(0).name


def _program_key(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> str:
    """A hash of what the program computes: its ops, input layouts and baked-in values."""
    h = hashlib.sha256()
    h.update(gm.code.encode())
    for t in inputs:
        h.update(f"input {tuple(t.shape)} {tuple(t.stride())} {t.dtype}\n".encode())
    for name, buf in gm.named_buffers():
        h.update(f"constant {name} {tuple(buf.shape)} {tuple(buf.stride())} {buf.dtype}\n".encode())
        h.update(buf.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _engine_key(base: str, engine: Engine, version: str, settings: dict[str, Any], threads: int) -> str:
    """The cache key of one engine's build: the program, and everything that
    changes the code built for it (a 2-thread process must not load a
    1-thread build, which has no parallel regions)."""
    h = hashlib.sha256(base.encode())
    h.update(
        f"{engine.artifact or engine.name} {version} torch {torch.__version__} {_cpu_model()} threads {threads} "
        f"{sorted(settings.items())}".encode()
    )
    return f"{engine.artifact or engine.name}-{h.hexdigest()[:32]}"


# The compiled steady path of graphed calls (accel/_speedups.c): what it reads of torch
# and of this module.
speedups.install_graphs({
    "Tensor": torch.Tensor, "check_memory": check_memory, "Binding": _Binding,
    # in grad mode a graphed call goes to GraphedCallable._call, which refuses what autograd would record
    "is_grad_enabled": torch.is_grad_enabled,
})
