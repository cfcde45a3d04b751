"""Recording torch CPU ops during a host-backend capture, without running them.

While a :class:`~accel.graph.Graph` captures on the host backend, a
``TorchDispatchMode`` sees every aten op the Python code runs. Like CUDA
stream capture, the capture *records* the program and runs none of it:

- an op that makes new tensors has its output sizes, strides and dtypes
  inferred on fake CPU tensors (torch's meta kernels, told the device; where
  an op has no meta kernel, on scratch copies of its inputs that nothing
  else sees), and gets *static* outputs:
  tensors over memory from the graph's private pool, at fixed addresses,
  zero until the first replay. Replay calls the op's ``out=`` overload into
  them (or, where an op has none, or several results and only torch's
  generated one, runs it and copies each result it defines in);
- an in-place or ``out=`` op is recorded and returns what it would write;
  the write happens at each replay, never at capture. Where it writes a
  tensor made outside the capture (a KV cache), the replay writes that
  tensor's storage, as a CUDA graph writes the memory its kernel was captured
  on, and the program holds the tensor, so its storage lives as long as the
  graph (:class:`Outside`);
- a view op runs (it reads no values, only sizes): its result aliases static
  storage, so it sees each replay's data, and it is not replayed.
- a torch.distributed collective is recorded as a step that runs it and
  waits for it (:mod:`accel.graph._collectives`): each replay communicates once.

Reading a tensor's values during a capture is refused with a
:class:`~accel.CaptureError` naming the op, by construction: the capture has
no values to give. Ops that return a Python value or a data-dependent shape
(``.item()``, ``bool(t)``, ``if t.any():``, ``nonzero``, ``t[mask]``) cannot be
answered on meta tensors; the exports that read memory without an aten op
(``.tolist()``, ``.numpy()``, ``__array__``, ``__dlpack__``, ``print``) are
refused while a capture runs on the thread, and invalidate the capture, as a device
synchronization invalidates a CUDA capture. Random ops and ops that exist
for a host-side effect are refused too. Capture-time memory comes from accel's pool only, so running out of it
raises accel's ``OutOfMemoryError``.

Only the capturing thread's ops are recorded (modes are thread-local), and
autograd is off while capturing: captures are for inference.

Replay is bitwise identical to eager for deterministic ops: the same kernels
run on the same inputs. A segment's ops replay as one generated straight-line
Python function (no loop, arguments bound once); each step calls torch's
Python binding of its op (``torch.addmm(..., out=...)``, ``Tensor.add_``), an
unboxed call, where a probe at the first replay shows the binding reaches the
very overload recorded with the very arguments, and the overload's boxed
``_op`` otherwise. Module and autograd bookkeeping, allocation and the
per-op Python of eager are gone; each op still pays one call from Python.

An op with no ``out=`` kernel of its own (convolution, ``relu``: torch's
generated ``out=`` overloads run the op, then copy) would cost a copy per
replay. Where nothing but the plan can see such an op's static outputs (no
Python reference, view, weak reference or later segment holds them, and the
graph holds no other work, which could read them by address; checked when
the plan is built), the plan keeps its result in a local of the
generated function, as eager does, and the later steps read that: the same
kernel, no copy. Those static outputs are then never written
(:attr:`Record.temporary`).
:mod:`accel.graph._compiled` is the faster, not bitwise, tier.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
import threading
import weakref
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, UnsupportedOperatorException
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from accel._errors import CaptureError, InvalidValueError
from accel.graph import _collectives

if TYPE_CHECKING:
    from accel._runtime import Runtime
    from accel.graph._pool import PoolLease
    from accel.stream import Stream

__all__ = ["Outside", "Program", "Record", "Recorder", "sweep"]

aten = torch.ops.aten

# Ops that exist for what they do on the host, not for a tensor they return:
# replaying them would repeat (or skip) the effect.
_HOST_EFFECT_OPS = frozenset(
    {
        aten._assert_async.default,
        aten._assert_async.msg,
        aten._assert_scalar.default,
        aten._print.default,
        aten.record_stream.default,
        aten.resize_.default,
        aten.set_.source_Storage,
        aten.set_.source_Storage_storage_offset,
        aten.set_.source_Tensor,
        aten.set_.default,
    }
)


@dataclass
class Record:
    """One op seen during capture. ``kind`` is "out" (replayed into static
    outputs), "fallback" (replayed functionally, result copied in), "mutate"
    (in-place or out= op, replayed as is), "view" (not replayed: it aliases
    static storage) or "alloc" (``empty``: storage reserved, nothing replayed).
    ``temporary``: replays keep the outputs in temporaries that only the
    replay sees, so ``outputs`` stay as the capture left them (unless a
    replay's result has other strides than the capture inferred: it is then
    copied into them, and the later steps read that)."""

    func: Any  # torch OpOverload
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    outputs: list[torch.Tensor]
    kind: str
    temporary: bool = False


@dataclass
class Made:
    """A step that computes new tensors and copies them into static outputs:
    an op replayed without an ``out=`` overload, or through one that torch
    generates as "run the op, then copy". The plan may run the op alone."""

    record: Record
    outputs: dict[int, torch.Tensor]  # return index -> the step's alias of its static output
    out_names: tuple[str, ...] = ()  # the step's out= arguments, which the op alone does not take


_Step = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any], str, "Made | None"]


@dataclass
class Outside:
    """A tensor made outside the capture that the program writes in place (a KV
    cache: ``cache.index_copy_(...)``, ``cache[:, pos].copy_(k)``).

    Replays write its storage, as a CUDA graph's kernel writes the memory it was
    captured on; the program's steps hold the storage (and its records the
    tensor), so it lives as long as the graph, as CUDA's graph keeps its
    memory. Where CUDA would write to an address the tensor no longer uses
    after ``set_``, ``resize_`` or a resize of its storage, a replay refuses
    (:meth:`check`): the writes would be lost to the tensor (or, for a storage
    cut short, overrun it)."""

    tensors: tuple[torch.Tensor, ...]  # the tensor written and the base it is a view of
    storage: int  # the StorageImpl the steps write (untyped_storage()._cdata)
    nbytes: int  # its size at capture
    op: str  # the first op that writes it, for the message

    @staticmethod
    def of(t: torch.Tensor, op: str) -> Outside:
        base = t._base
        storage = t.untyped_storage()
        return Outside((t,) if base is None else (t, base), storage._cdata, storage.nbytes(), op)

    def check(self) -> None:
        """Refuse a replay if the tensor's memory is no longer the storage captured."""
        for t in self.tensors:
            storage = t.untyped_storage()
            if storage._cdata == self.storage and storage.nbytes() >= self.nbytes:
                continue
            moved = "has other storage (set_)" if storage._cdata != self.storage else (
                f"storage was cut from {self.nbytes} to {storage.nbytes()} bytes"
            )
            raise InvalidValueError(
                f"{self.op} writes in place to a tensor of shape {tuple(t.shape)} made outside the capture, "
                f"which {moved} since the capture; the graph writes the storage it was captured on (under "
                "CUDA, the memory at the captured address). Copy new data into the tensor instead of "
                "moving it, or capture the graph again"
            )


@dataclass
class Segment:
    """Recorded ops that run back to back: one host-function node of the graph."""

    steps: list[_Step] = field(default_factory=list)
    errors: list[tuple[str, BaseException]] = field(default_factory=list)
    # The program's records, to tell which static outputs something outside the plan holds.
    records: list[Record] = field(default_factory=list, repr=False)
    # The program's tensors made outside the capture that it writes, checked before each run.
    outside: list[Outside] = field(default_factory=list, repr=False)
    stream: int = 0
    position: int | None = None  # capture length right after this segment's node
    runner: Callable[[], None] | None = None  # replaces the op loop (compiled tier)
    # Whether the graph holds nothing but the program's segments (set when the
    # capture ends): other work, a stream copy or a host function, may read a
    # static output by its address, which no reference count shows.
    alone: bool = False
    # The steps as one generated function (built at the first replay, when
    # no more steps can come), and its code object, to name a failing step.
    _plan: Callable[[], None] | None = field(default=None, repr=False)
    _plan_code: Any = field(default=None, repr=False)
    _plan_names: list[str] = field(default_factory=list, repr=False)  # what each line of the plan runs

    def run(self) -> None:
        # Static outputs are normal tensors, so inference mode may write into
        # them; it also turns autograd off, which out= overloads require.
        # Torch function modes and subclasses are off: the plan calls torch's
        # Python bindings, which would hand them the recorded aten ops.
        guard = torch._C._InferenceMode(True)
        guard.__enter__()
        no_function_modes = torch._C.DisableTorchFunction()
        no_function_modes.__enter__()
        try:
            for written in self.outside:
                written.check()
            if self.runner is not None:
                self.runner()
                return
            plan = self._plan
            if plan is None:
                plan = self._plan = self._build_plan()
            plan()
        except BaseException as exc:  # noqa: BLE001 - raised by Graph.replay / the stream
            self.errors.append((self._where(exc), exc))
        finally:
            no_function_modes.__exit__(None, None, None)
            guard.__exit__(None, None, None)

    def _build_plan(self) -> Callable[[], None]:
        """The steps as straight-line Python: each a call of the fastest entry
        that reaches the recorded overload (see :func:`_fast_entry`), its
        arguments bound once as globals of the generated function, no loop;
        results that only the plan sees held in its locals (:func:`_temporaries`)."""
        calls = [_fast_entry(*step[:3]) for step in self.steps]
        kept = _temporaries(self.steps, calls, self.records) if self.alone else {}
        names = [step[3] for step in self.steps]
        targets: dict[int, list[str]] = {}  # step -> the locals it returns into
        local: dict[int, str] = {}  # id of an alias of a temporary's static output -> its local
        env: dict[str, Any] = {}
        checks: dict[int, str] = {}  # step -> the statements that check its temporaries' layout
        for i, aliases in kept.items():
            made = self.steps[i][4]
            assert made is not None
            returns = len(made.record.func._schema.returns)
            targets[i] = [f"t{i}"] if returns == 1 else [f"t{i}_{k}" for k in range(returns)]
            local.update((id(alias), targets[i][k]) for k, same in aliases.items() for alias in same)
            # The later steps were recorded on the strides the capture inferred (on meta
            # tensors), which a kernel may not give (a convolution with channels-last
            # weights returns channels-last where its meta kernel says contiguous), and an
            # out= kernel handed an input of other strides may compute garbage (batch
            # norm's). A temporary of other strides goes into its static output, as
            # without the temporary, and the later steps read that.
            for k, produced in made.outputs.items():
                t = targets[i][k]
                env[f"e{i}_{k}"], env[f"s{i}_{k}"] = produced.stride(), produced
                undefined = f"{t} is None or " if returns > 1 else ""  # a result the op may leave undefined
                checks[i] = checks.get(i, "") + f"; {t} = {t} if {undefined}{t}.stride() == e{i}_{k} else s{i}_{k}.copy_({t})"
            _, args, kwargs = self.steps[i][:3]
            kwargs = {name: value for name, value in kwargs.items() if name not in made.out_names}
            _overloads[made.record.func._op] = made.record.func
            calls[i] = _fast_entry(made.record.func._op, args, kwargs)
            names[i] = f"{made.record.func}"  # the op that runs, not its out= overload
            made.record.temporary = True
        lines = []
        last: dict[str, int] = {}  # a local -> the line that reads it last
        for i, (fn, args, kwargs) in enumerate(calls):
            env[f"f{i}"] = fn
            call, read = [], []
            bound = [(f"a{i}_{j}", "", value) for j, value in enumerate(args)]
            bound += [(f"k{i}_{j}", f"{key}=", value) for j, (key, value) in enumerate(kwargs.items())]
            for slot, keyword, value in bound:
                name = local.get(id(value))
                if name is None:  # a global of the plan, bound once
                    name = slot
                    env[name] = value
                else:  # a temporary of an earlier step
                    read.append(name)
                call.append(keyword + name)
            into = targets.get(i, [])
            last.update((name, i) for name in (*into, *read))
            lines.append(f"{', '.join(into)}{' = ' if into else ''}f{i}({', '.join(call)}){checks.get(i, '')}")
        # Each temporary goes as soon as it is read for the last time, as in eager.
        for name, i in last.items():
            lines[i] += f"; del {name}"
        lines = ["def replay():", *(f"    {line}" for line in lines), "    return None"]  # step i on line i + 2
        exec(compile("\n".join(lines), "<accel replay>", "exec"), env)  # noqa: S102 - generated above
        # Out of its own globals: a cycle there would leave the static
        # outputs to the cyclic collector, whose finalizers may then run
        # inside the allocator's locked sections.
        plan = env.pop("replay")
        self._plan_code = plan.__code__
        self._plan_names = names
        return plan  # type: ignore[no-any-return]

    def _where(self, exc: BaseException) -> str:
        if self.runner is not None:
            return "the compiled program"
        tb = exc.__traceback__
        # The plan's frame says which step was running by its line.
        while tb is not None and tb.tb_frame.f_code is not self._plan_code:
            tb = tb.tb_next
        if tb is not None and 0 <= tb.tb_lineno - 2 < len(self._plan_names):
            return self._plan_names[tb.tb_lineno - 2]
        return "a recorded torch op"


class _Reached(Exception):
    """Raised by :class:`_Probe` in place of running the op a binding reached."""

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().__init__(func)
        self.call = (func, args, kwargs)


class _Probe(TorchDispatchMode):
    """Stops the first aten op that reaches Python dispatch, without running it."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise _Reached(func, tuple(args), dict(kwargs or {}))


# torch's Python bindings of aten ops (C functions that parse arguments
# against the op's signatures and call the dispatcher unboxed): about half
# the cost of an OpOverload's boxed call. Methods take ``self`` first.
_BINDINGS = ("_VariableFunctions", "_nn", "_linalg", "_special", "_fft", "TensorBase")

_Call = tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]


def _fast_entry(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> _Call:
    """How a replay calls ``fn(*args, **kwargs)`` (an OpOverload's ``_op``, or a
    replay function) fastest: torch's Python binding of the same name where
    that provably reaches the same overload with the same arguments. Called
    once under a dispatch mode that stops the op before it runs, it must
    arrive there as ``fn`` would: same overload, same arguments, so the same
    kernel, and the replay stays bitwise equal. Otherwise ``fn`` itself."""
    overload = _overloads.get(fn)
    if overload is None:
        return fn, args, kwargs
    name = overload._schema.name.split("::")[-1]
    outs = [a.name for a in overload._schema.arguments if a.is_out]
    forms = [kwargs]
    if len(outs) > 1 and all(o in kwargs for o in outs):
        # The bindings take several outputs as one tuple, out=(...).
        grouped = {k: v for k, v in kwargs.items() if k not in outs}
        grouped["out"] = tuple(kwargs[o] for o in outs)
        forms = [grouped]
    for module in _BINDINGS:
        binding = getattr(getattr(torch._C, module), name, None)
        if binding is None:
            continue
        for form in forms:
            try:
                with _Probe():
                    binding(*args, **form)
            except _Reached as reached:
                if _same_call(reached.call, (overload, args, kwargs)):
                    return binding, args, form
            except Exception:  # noqa: BLE001, S112 - the binding does not take these arguments
                continue
    return fn, args, kwargs


def _same_call(seen: tuple[Any, tuple[Any, ...], dict[str, Any]], want: tuple[Any, tuple[Any, ...], dict[str, Any]]) -> bool:
    if seen[0] is not want[0] or seen[2].keys() != want[2].keys() or len(seen[1]) != len(want[1]):
        return False
    pairs = [*zip(seen[1], want[1]), *((seen[2][k], want[2][k]) for k in want[2])]
    return all(_same_value(a, b) for a, b in pairs)


def _same_value(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return a is b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


# OpOverload by its ``_op``, for the overloads replays call.
_overloads: dict[Any, Any] = {}


@dataclass
class Program:
    """The torch ops a capture recorded, in order, and how they replay."""

    records: list[Record] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    inputs: list[torch.Tensor] = field(default_factory=list)  # registered inputs
    outside: list[Outside] = field(default_factory=list)  # tensors made outside the capture that it writes
    buffers: list[Any] = field(default_factory=list)  # the pool buffers behind static outputs
    static_bytes: int = 0
    compiled: Any = None  # the CompiledProgram replays run, if compile_graph was called

    def mark_alone(self) -> None:
        """The graph holds nothing but this program's segments: no other node
        reads a static output by its address, so replays may keep results in
        temporaries (:func:`_temporaries` checks the rest)."""
        for segment in self.segments:
            segment.alone = True

    @property
    def fallback_ops(self) -> list[str]:
        """Ops replayed without an ``out=`` overload (they allocate a temporary)."""
        return [str(r.func) for r in self.records if r.kind == "fallback"]

    def describe(self) -> str:
        """The program as text, one op per line (for :meth:`Graph.debug_dump`)."""
        lines = [
            f"torch program: {len(self.records)} ops in {len(self.segments)} segment(s), "
            f"{self.static_bytes} bytes of static outputs in the graph's pool"
        ]
        lines.extend(
            f"        writes in place a tensor of shape {tuple(o.tensors[0].shape)} made outside the capture ({o.op})"
            for o in self.outside
        )
        for i, r in enumerate(self.records):
            shapes = ", ".join(f"{tuple(t.shape)}:{str(t.dtype).removeprefix('torch.')}" for t in r.outputs)
            kept = "  (kept in a temporary by replays)" if r.temporary else ""
            lines.append(f"{i:6d}  {r.kind:8s} {r.func}  -> {shapes}{kept}")
        return "\n".join(lines) + "\n"


@functools.cache
def _out_overload(func: Any) -> tuple[Any, tuple[str, ...]] | None:
    """The ``out=`` overload of a functional op, and its out argument names."""
    schema = func._schema
    want = [(a.name, str(a.type)) for a in schema.arguments]
    packet = func.overloadpacket
    for name in packet.overloads():
        candidate = getattr(packet, name)
        cs = candidate._schema
        outs = [a for a in cs.arguments if a.is_out]
        if not outs or len(outs) != len(schema.returns):
            continue
        if [(a.name, str(a.type)) for a in cs.arguments if not a.is_out] == want:
            return candidate, tuple(a.name for a in outs)
    return None


def _capture_position(runtime: Runtime, device: int, stream: int) -> int | None:
    """How many nodes the capture ``stream`` belongs to holds.

    Consecutive torch ops share one graph node (so the compiled tier can take
    them whole) only while no other stream work was recorded in between.
    Where the backend cannot tell (None), every op gets its own node, which is
    correct, only slower.
    """
    return runtime.backend.stream_capture_length(device, stream)


def _storage_ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


# Ops whose output values are undefined: their static output is reserved at
# capture and nothing is replayed.
_ALLOC_OPS = frozenset(
    {
        aten.empty.memory_format,
        aten.empty_strided.default,
        aten.empty_like.default,
        aten.new_empty.default,
        aten.new_empty_strided.default,
    }
)

# Recorders whose capture was dropped where they could not leave their
# thread's dispatch stack: inside an op (a mode cannot leave the stack from its
# own __torch_dispatch__: torch has stashed it there), from another thread
# (the stack, the grad mode and ``_current`` are per thread), or under another
# mode. They turn inert and leave at the capturing thread's next accel call,
# see sweep().
_stale: list[Recorder] = []
_stale_lock = threading.Lock()


def sweep() -> None:
    """Take inert recorders of dropped captures off this thread's dispatch stack,
    and give the thread back the grad mode it had where nothing restored it yet."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    while _stale:
        top = _get_current_dispatch_mode()
        with _stale_lock:
            stale = next((r for r in _stale if r is top), None)
            if stale is None:
                return
            _stale.remove(stale)
        stale.__exit__(None, None, None)
        stale._left_on_thread()


def _not_capturing_in_child() -> None:
    """A child forked during a capture is not capturing: the capture is its
    parent's. The forking thread (the child's only one) leaves its recorder, so
    torch ops in the child run as usual, with the grad mode the thread had."""
    recorder = getattr(_current, "recorder", None)
    if recorder is not None and recorder._active:
        recorder._leave_in_child()


os.register_at_fork(after_in_child=_not_capturing_in_child)


# Tensor methods that give a tensor's memory to Python without an aten op.
# (``.item()``, ``bool(t)`` and the like reach the dispatcher as ops that need
# values, and are refused there.)
_MEMORY_EXPORTS = ("tolist", "numpy", "__array__", "__dlpack__", "__repr__", "__format__", "__reduce_ex__")

# The recorder capturing on this thread, if any.
_current = threading.local()
# While any capture runs, torch.Tensor's memory exports are wrapped to refuse
# on a capturing thread. A TorchFunctionMode would see them too, but an active
# function mode changes what models run (nn.MultiheadAttention and the
# transformer layers leave their fused fast path), so eager and replay would differ.
_exports_lock = threading.Lock()
_exports_users = 0
_exports_saved: dict[str, Any] = {}


def _guarded_export(name: str, original: Any) -> Any:
    @functools.wraps(original)
    def guarded(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        recorder = getattr(_current, "recorder", None)
        if recorder is not None and recorder._active:
            error = CaptureError(
                f"cannot capture Tensor.{name}: it reads the tensor's values on the host, and a capture "
                "records the program without running it (the values do not exist yet, and a replay "
                "could not change what was read). Read the values after a replay, outside the capture. "
                "The capture was invalidated"
            )
            recorder.invalidate(error)
            raise error
        return original(self, *args, **kwargs)

    return guarded


def _guard_exports(on: bool) -> None:
    global _exports_users
    with _exports_lock:
        _exports_users += 1 if on else -1
        if on and _exports_users == 1:
            for name in _MEMORY_EXPORTS:
                _exports_saved[name] = torch.Tensor.__dict__.get(name)
                setattr(torch.Tensor, name, _guarded_export(name, getattr(torch.Tensor, name)))
        elif not on and _exports_users == 0:
            for name, saved in _exports_saved.items():
                if saved is None:
                    delattr(torch.Tensor, name)  # inherited from the C base again
                else:
                    setattr(torch.Tensor, name, saved)
            _exports_saved.clear()


class Recorder(TorchDispatchMode):
    """The dispatch mode that records a capture's torch ops (host backend only).

    ``errors`` collects the failures of replays (the graph reports them);
    ``on_refused`` is called when an op is refused, to drop the capture.
    """

    def __init__(
        self,
        runtime: Runtime,
        device: int,
        stream: Stream,
        lease: PoolLease,
        errors: list[tuple[str, BaseException]],
        on_refused: Callable[[], None],
    ) -> None:
        super().__init__()
        self._runtime = runtime
        self._device = device
        self._stream = stream
        self._lease = lease
        self._errors = errors
        self._on_refused = on_refused
        self._program = Program()
        self._owned: set[int] = set()  # storage addresses the graph may write
        self._open: Segment | None = None
        self._active = False
        self._on_stack = False
        self._dispatching = 0
        self._grad_was: bool | None = None
        self._grad_restored = True
        self._thread = 0  # the capturing thread: the stack, grad mode and _current are its
        self._guarded = False
        self._invalid: CaptureError | None = None

    # -- lifetime ------------------------------------------------------------------

    def register_inputs(self, tensors: Sequence[Any]) -> None:
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                raise CaptureError(f"register_inputs expects torch tensors, got {type(t).__name__}")
            # Written like any tensor made outside the capture (checked at replay, see
            # Outside); the compiled tier refuses to write them by name.
            self._program.inputs.append(t)

    def start(self) -> None:
        # Captures record inference: with autograd on, the returned static
        # tensors would carry graph history that replay does not maintain.
        self._thread = threading.get_ident()
        self._grad_was = torch.is_grad_enabled()
        torch.set_grad_enabled(False)
        self._grad_restored = False
        _current.recorder = self
        _guard_exports(True)
        self._guarded = True
        self.__enter__()
        self._on_stack = self._active = True

    def invalidate(self, error: CaptureError) -> None:
        """Fail the capture at its end (a refusal raised where the capture cannot be dropped yet)."""
        if self._invalid is None:
            self._invalid = error

    def stop(self) -> Program:
        """Leave the mode stacks; returns the program recorded.

        Raises the CaptureError that invalidated the capture, if one did.
        """
        self._leave()
        if self._invalid is not None:
            raise CaptureError(f"the capture was invalidated: {self._invalid}") from self._invalid
        return self._program

    def discard(self) -> None:
        """Leave the mode stacks and drop what was recorded (the capture failed)."""
        self._leave()
        self._program = Program()

    def _leave(self) -> None:
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        here = threading.get_ident() == self._thread
        self._active = False
        if self._guarded:
            self._guarded = False
            _guard_exports(False)
        if self._on_stack:
            self._on_stack = False
            if here and not self._dispatching and _get_current_dispatch_mode() is self:
                self.__exit__(None, None, None)
            else:
                with _stale_lock:
                    _stale.append(self)
        if here:
            self._left_on_thread()

    def _leave_in_child(self) -> None:
        """:meth:`_leave` in a child forked on the capturing thread, taking no lock
        (another thread of the parent may have held one at the fork): the memory
        exports stay wrapped there, and refuse nothing without an active recorder."""
        from torch.utils._python_dispatch import _get_current_dispatch_mode

        self._active = self._guarded = False
        if self._on_stack and not self._dispatching and _get_current_dispatch_mode() is self:
            self._on_stack = False
            self.__exit__(None, None, None)
        self._left_on_thread()

    def _left_on_thread(self) -> None:
        """On the capturing thread: what leaving changes in its thread-local state."""
        if getattr(_current, "recorder", None) is self:
            _current.recorder = None
        if not self._grad_restored:
            self.restore_grad_mode()

    def restore_grad_mode(self) -> None:
        """Give the capturing thread the grad mode it had when the capture began.

        Also called when the ``with`` block that captured exits: a capture dropped
        inside it (a refused op) restored it there, and then the exit of a grad
        context entered inside the block (``torch.no_grad()``) set the capture's
        mode again."""
        if self._grad_was is not None and threading.get_ident() == self._thread:
            torch.set_grad_enabled(self._grad_was)
            self._grad_restored = True

    # -- recording -------------------------------------------------------------------

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if not self._active:
            return func(*args, **kwargs)
        self._dispatching += 1
        try:
            return self._record(func, tuple(args), dict(kwargs))
        except CaptureError:
            self._on_refused()  # leaves no capture state behind; the error says why
            raise
        finally:
            self._dispatching -= 1

    def _refuse(self, func: Any, why: str) -> CaptureError:
        return CaptureError(f"cannot capture {func}: {why}. The capture was abandoned.")

    def _refuse_read(self, func: Any) -> CaptureError:
        return self._refuse(
            func,
            "it reads tensor values on the host (a Python value or an output shape depends on the "
            "data), and a capture records the program without running it: there are no values to read, "
            "and a replay with new data could not change what was read. Move data-dependent control "
            "flow out of the captured region",
        )

    def _record(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        tags = func.tags
        if torch.Tag.nondeterministic_seeded in tags and _draws_random(func, args, kwargs):
            raise self._refuse(
                func,
                "it draws random numbers, and accel has no generator policy for replays (each replay "
                "would repeat the capture's draw). Capture in eval mode, or draw outside the graph "
                "into a registered input",
            )
        if torch.Tag.dynamic_output_shape in tags:
            raise self._refuse_read(func)
        if func in _HOST_EFFECT_OPS:
            raise self._refuse(func, "it has an effect on the host (or on storage) that a replay cannot redo")
        flat, _ = tree_flatten((args, kwargs))
        for value in flat:
            if isinstance(value, torch.Tensor) and (value.device.type != "cpu" or value.layout != torch.strided):
                raise self._refuse(
                    func,
                    f"it takes a {value.device.type} {value.layout} tensor; the host backend captures "
                    "dense CPU tensors only",
                )
        stream = self._runtime.current_stream(self._device)
        if not stream.is_capturing():
            raise self._refuse(
                func,
                f"it ran while the current stream {stream!r} is not part of the capture; run "
                "captured torch code on the capturing stream",
            )
        if func.namespace != "aten" and (_collectives.is_collective(func) or _collectives.refusal(func)):
            return self._record_collective(func, args, kwargs)
        schema = func._schema
        if torch.Tag.inplace_view in tags or (
            schema.returns and all(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns)
        ):
            # A view reads sizes, not values: run it, so that it aliases the
            # static storage each replay writes.
            result = func(*args, **kwargs)
            outs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            self._program.records.append(Record(func, args, kwargs, outs, "view"))
            return result
        bound = _bound(schema, args, kwargs)
        written = [
            value
            for arg, value in bound
            if arg.alias_info is not None and arg.alias_info.is_write
            for value in ([value] if isinstance(value, torch.Tensor) else list(value or ()))
            if isinstance(value, torch.Tensor)
        ]
        self._note_writes(func, written)
        if any(not _returns_tensors(r.type) for r in schema.returns) or torch.Tag.data_dependent_output in tags:
            return self._record_host_value(func, args, kwargs)
        inferred, aliases = _infer(func, args, kwargs)
        leaves, spec = tree_flatten(inferred)
        if not any(isinstance(t, torch.Tensor) for t in leaves) and not written:
            raise self._refuse(
                func,
                "it returns no tensor and writes none, so it runs only for a host-side effect, which a "
                "replay cannot reproduce",
            )
        if aliases and not written:
            # Functional by schema, yet a view of an input (_unsafe_view...):
            # run it like a view.
            result = func(*args, **kwargs)
            outs = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            self._program.records.append(Record(func, args, kwargs, outs, "view"))
            return result
        returned = _written_returns(schema, bound)
        new_leaves: list[Any] = []
        statics: list[torch.Tensor] = []
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, torch.Tensor):
                new_leaves.append(leaf)
            elif returned.get(i) is not None:
                new_leaves.append(returned[i])  # what an in-place or out= op returns: its argument
            else:
                static = self._static_like(leaf)
                statics.append(static)
                new_leaves.append(static)
        if not statics:
            _overloads[func._op] = func
            self._add_step(func._op, args, kwargs, f"{func}")
            self._program.records.append(Record(func, args, kwargs, written, "mutate"))
            return tree_unflatten(new_leaves, spec)
        overload = None if written else _out_overload(func)
        if overload is not None and len(schema.returns) > 1 and _copies_out(overload[0]):
            # torch's generated out= overload refuses a result the op leaves
            # undefined though its meta kernel gives a tensor (mkldnn_rnn_layer's
            # workspace in eval, _native_multi_head_attention's weights without
            # need_weights): run the op, copy each result it defines (_copy_into).
            overload = None
        record = Record(func, args, kwargs, statics, "alloc")
        if func in _ALLOC_OPS:
            pass
        elif overload is not None and len(statics) == len(leaves):
            out_func, names = overload
            out_kwargs = dict(kwargs)
            out_kwargs.update(zip(names, statics))
            _overloads[out_func._op] = out_func
            made = Made(record, {}, names) if _copies_out(out_func) else None
            _, step_kwargs = self._add_step(out_func._op, args, out_kwargs, f"{out_func}", made)
            if made is not None:
                made.outputs.update((k, step_kwargs[name]) for k, name in enumerate(names))
            record.kind = "out"
        else:
            fresh = [i for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor) and returned.get(i) is None]
            made = Made(record, dict(zip(fresh, [_snapshot(t) for t in statics])))
            self._add_step(_copy_into(func, made.outputs), args, kwargs, f"{func} (no out= overload)", made)
            record.kind = "fallback"
        self._program.records.append(record)
        return tree_unflatten(new_leaves, spec)

    def _note_writes(self, func: Any, written: list[torch.Tensor]) -> None:
        """Tensors ``func`` writes in place that the capture did not make are outside writes."""
        for t in written:
            if _storage_ptr(t) not in self._owned:
                self._write_outside(func, t)

    def _record_collective(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A torch.distributed collective: a step that runs it and waits for it (see ``_collectives``)."""
        why = _collectives.refusal(func)
        if why is not None:
            raise self._refuse(func, why)
        written = _collectives.written(func, args)
        self._note_writes(func, written)
        self._add_step(_collectives.replay_step(func), args, kwargs, f"{func}")
        self._program.records.append(Record(func, args, kwargs, written, "mutate"))
        return _collectives.capture_result(func, args)

    def _write_outside(self, func: Any, t: torch.Tensor) -> None:
        """``func`` writes in place to ``t``, made outside the capture: recorded as any
        write (each replay writes it, as under CUDA), and checked at each replay to
        be where it was (:class:`Outside`)."""
        self._owned.add(_storage_ptr(t))
        if t.untyped_storage().nbytes():  # no bytes: nothing a replay could write out of place
            self._program.outside.append(Outside.of(t, f"{func}"))

    def _record_host_value(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """An op returning a Python value: answered from sizes alone (``is_same_size``) or refused."""
        try:
            value, _ = _infer(func, args, kwargs, scratch=False)
        except Exception as exc:  # noqa: BLE001 - no meta answer: the op needs values
            raise self._refuse_read(func) from exc
        if any(isinstance(t, torch.Tensor) for t in tree_flatten(value)[0]):
            raise self._refuse_read(func)
        return value

    def _static_like(self, t: torch.Tensor) -> torch.Tensor:
        """A tensor with ``t``'s size, strides and dtype over pool memory, zero until a replay writes it."""
        nbytes = t.untyped_storage().nbytes()
        if isinstance(t, FakeTensor):
            nbytes = _storage_bytes(t)
        with torch.inference_mode(False):
            static = torch.empty((0,), dtype=t.dtype)
            if nbytes:
                buffer = self._lease.allocate(nbytes, self._stream)
                ctypes.memset(buffer.ptr, 0, nbytes)
                memory = (ctypes.c_byte * nbytes).from_address(buffer.ptr)
                # The storage keeps `memory` alive, and `memory` the buffer: it
                # goes back to the pool when both the graph and every returned
                # tensor are gone, through Buffer.__del__, which is safe where
                # a garbage collection runs inside the allocator's locked sections.
                memory.buffer = buffer  # type: ignore[attr-defined]
                base = torch.frombuffer(memory, dtype=torch.uint8)
                static.set_(base.untyped_storage(), t.storage_offset(), t.size(), t.stride())
                self._owned.add(buffer.ptr)
                self._program.buffers.append(buffer)
                self._program.static_bytes += nbytes
            else:
                static = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype)
                # No bytes: writing to it in place touches no memory outside the graph.
                self._owned.add(_storage_ptr(static))
        return static

    def _add_step(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        what: str,
        made: Made | None = None,
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """Append a step to the open segment (or a new one); its arguments as the step binds them."""
        handle = self._stream_handle()
        segment = self._open
        if segment is None or segment.stream != handle or segment.position is None or (
            _capture_position(self._runtime, self._device, handle) != segment.position
        ):
            segment = Segment(
                stream=handle, errors=self._errors, records=self._program.records, outside=self._program.outside
            )
            self._runtime.backend.launch_host_func(self._device, handle, segment.run)
            segment.position = _capture_position(self._runtime, self._device, handle)
            self._program.segments.append(segment)
            self._open = segment
        args, kwargs = _snapshots(args, kwargs)
        segment.steps.append((fn, args, kwargs, what, made))
        return args, kwargs

    def _stream_handle(self) -> int:
        return self._runtime.current_stream(self._device).native_handle


def _returns_tensors(t: Any) -> bool:
    """Whether a schema return type holds tensors only (Tensor, Tensor[], Tensor?)."""
    for wrapper in (torch.OptionalType, torch.ListType, torch.OptionalType):
        if isinstance(t, wrapper):
            t = t.getElementType()
    return isinstance(t, torch.TensorType)


def _storage_bytes(t: torch.Tensor) -> int:
    """Bytes a strided tensor spans from its storage offset 0."""
    if t.numel() == 0:
        return 0
    span = 1 + sum((size - 1) * stride for size, stride in zip(t.size(), t.stride()))
    return int((t.storage_offset() + span) * t.element_size())


def _infer(
    func: Any, args: tuple[Any, ...], kwargs: dict[str, Any], *, scratch: bool = True
) -> tuple[Any, bool]:
    """Run ``func`` on fake CPU stand-ins of its tensors: its outputs' sizes, strides
    and dtypes without reading or writing any value; and whether an output aliases
    an input.

    Fake tensors, not bare meta ones: a meta tensor has no device, and where a
    kernel's layout depends on it, torch's meta kernels give another device's
    (a convolution with channels-last weights: contiguous, where the CPU kernel
    returns channels-last), so the later ops would replay on another layout than
    eager. A fake tensor carries its device, which torch's fake kernels honour.

    Ops that fake tensors cannot run (no meta kernel) run on scratch copies of
    their inputs instead (with ``scratch``): the result is thrown away, nothing
    the program sees is touched.
    """
    mode = _fake_mode()
    fakes: dict[int, torch.Tensor] = {}

    def to_fake(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            f = fakes.get(id(v))
            if f is None:
                f = fakes[id(v)] = torch.empty_strided(v.size(), v.stride(), dtype=v.dtype, device=v.device)
            return f
        return v

    try:
        with mode:
            fake_args, fake_kwargs = tree_map(to_fake, (args, kwargs))
            result = func(*fake_args, **fake_kwargs)
        storages = {f.untyped_storage()._cdata for f in fakes.values()}
        aliases = any(
            isinstance(t, torch.Tensor) and t.untyped_storage()._cdata in storages for t in tree_flatten(result)[0]
        )
        return result, aliases
    except (NotImplementedError, UnsupportedOperatorException):
        if not scratch:
            raise
    copies: dict[int, torch.Tensor] = {}

    def to_copy(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            c = copies.get(id(v))
            if c is None:
                c = copies[id(v)] = v.clone()
            return c
        return v

    copy_args, copy_kwargs = tree_map(to_copy, (args, kwargs))
    result = func(*copy_args, **copy_kwargs)
    storages = {_storage_ptr(c) for c in copies.values()}
    aliases = any(isinstance(t, torch.Tensor) and _storage_ptr(t) in storages for t in tree_flatten(result)[0])
    return result, aliases


_fake = threading.local()


def _fake_mode() -> Any:
    """This thread's mode for :func:`_infer` (one per thread: a mode is not shared)."""
    mode = getattr(_fake, "mode", None)
    if mode is None:
        mode = _fake.mode = FakeTensorMode(allow_fallback_kernels=False)
    return mode


def _written_returns(schema: Any, bound: list[tuple[Any, Any]]) -> dict[int, torch.Tensor]:
    """Returns of an in-place or out= op that are one of its written arguments, by return index."""
    found: dict[int, torch.Tensor] = {}
    for i, ret in enumerate(schema.returns):
        info = ret.alias_info
        if info is None or not info.is_write:
            continue
        for arg, value in bound:
            if arg.alias_info is not None and arg.alias_info.before_set == info.before_set and isinstance(
                value, torch.Tensor
            ):
                found[i] = value
    return found


def _snapshot(value: Any) -> Any:
    """A tensor argument as an alias frozen at its current size and strides.

    In-place view ops (``transpose_``...) change a tensor object's metadata
    after the op that made it was recorded; the replay must see the metadata
    each op saw. 0-dim tensors are kept as they are: they may be wrapped
    Python numbers, whose type-promotion rules an alias would lose.
    """
    if isinstance(value, torch.Tensor) and value.dim() > 0:
        return value.as_strided(value.size(), value.stride(), value.storage_offset())
    return value


def _snapshots(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """:func:`_snapshot` of each argument, one alias per tensor object: a kernel may
    check that two arguments are one tensor (``_native_multi_head_attention``
    projects query, key and value in one matrix product when they are), and
    aliases of one input would take another path than eager, with other rounding."""
    aliases: dict[int, Any] = {}

    def snapshot(value: Any) -> Any:
        if id(value) not in aliases:
            aliases[id(value)] = _snapshot(value)
        return aliases[id(value)]

    return tree_map(snapshot, (args, kwargs))  # type: ignore[no-any-return]


@functools.cache
def _copies_out(out_func: Any) -> bool:
    """Whether an ``out=`` overload has no CPU kernel of its own, only torch's
    generated one, which runs the functional op and copies its result out."""
    name = out_func.name()
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    return not has(name, "CPU") and has(name, "CompositeExplicitAutograd")


@functools.cache
def _returns_plain_tensors(func: Any) -> bool:
    """Whether every return of an op is a Tensor (no list, no optional, no scalar)."""
    return all(str(r.type) == "Tensor" for r in func._schema.returns)


def _copy_into(func: Any, statics: dict[int, torch.Tensor]) -> Callable[..., None]:
    """Replay of an op without an out= overload: run it, copy its new outputs
    (by position among its returned tensors) into the static ones. A result
    the op leaves undefined (None) stays as the capture left it."""

    op, pairs = func._op, tuple(statics.items())
    # A tuple of tensors already: no tree_flatten on each replay (a few microseconds).
    flat = _returns_plain_tensors(func) and len(func._schema.returns) > 1

    def replay(*args: Any, **kwargs: Any) -> None:
        outs = op(*args, **kwargs)
        if not flat:
            outs = tree_flatten(outs)[0]
        for i, static in pairs:
            if outs[i] is not None:
                static.copy_(outs[i])

    replay.__qualname__ = f"replay of {func}"
    return replay


def _temporaries(
    steps: list[_Step], calls: list[_Call], records: list[Record]
) -> dict[int, dict[int, list[torch.Tensor]]]:
    """The steps whose results the plan may keep in locals instead of copying
    them into their static outputs: by step, each output's aliases in later steps.

    A static output qualifies when nothing but this segment's plan can see it:
    no Python reference but the capture's records, no weak reference to it or
    to its storage, and no tensor over its storage but itself, the step's alias
    and the later steps' aliases, each a direct argument (not inside a list),
    over that very storage, with the very sizes, strides and offset the op
    produced. A user's variable, a view made during the capture, the graph's
    outputs or another segment's steps keep the copy; so does any other work in
    the graph (the caller checks :attr:`Segment.alone`).
    """
    held = Counter(
        id(t)
        for r in records
        for t in (*tree_flatten((r.args, r.kwargs))[0], *r.outputs)
        if isinstance(t, torch.Tensor)
    )
    uses: dict[int, list[tuple[int, torch.Tensor | None]]] = {}  # storage -> (step, alias; None inside a list)
    for j, (_, args, kwargs) in enumerate(calls):
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                uses.setdefault(_storage_ptr(value), []).append((j, value))
                continue
            for t in tree_flatten(value)[0]:
                if isinstance(t, torch.Tensor):
                    uses.setdefault(_storage_ptr(t), []).append((j, None))
    kept: dict[int, dict[int, list[torch.Tensor]]] = {}
    for i, step in enumerate(steps):
        made = step[4]
        if made is None or not _returns_plain_tensors(made.record.func):
            continue
        found: dict[int, list[torch.Tensor]] = {}
        for pos, (k, produced) in enumerate(made.outputs.items()):
            if produced is made.record.outputs[pos] or weakref.getweakrefcount(made.record.outputs[pos]):
                break  # a 0-dim output is bound as itself, not an alias
            if _references(made.record.outputs, pos) != held[id(made.record.outputs[pos])]:
                break
            storage = produced.untyped_storage()
            own = storage._cdata  # not `storage` in the generator: a cell would change its refcount
            later = [alias for j, alias in uses.get(_storage_ptr(produced), []) if j != i]
            # At the same address may lie other storages (every zero-size
            # tensor is at 0, DLPack makes a second storage over the memory):
            # their tensors are no aliases, and the use count below misses them.
            if not all(
                alias is not None
                and alias.untyped_storage()._cdata == own
                and _same_layout(alias, produced)
                for alias in later
            ):
                break
            aliases = [alias for alias in later if alias is not None]
            distinct = len({id(produced), *map(id, aliases)})
            # The storage's users: the static output, the aliases and its Python
            # object, which nothing else may hold (it reads the memory too), nor
            # reach by a weak reference (the object lives as long as the memory).
            if torch._C._storage_Use_Count(storage._cdata) != 1 + distinct + 1:
                break
            if sys.getrefcount(storage) != _STORAGE_REFERENCES or weakref.getweakrefcount(storage):
                break
            found[k] = aliases
        else:
            kept[i] = found
    return kept


def _storage_references(t: torch.Tensor) -> int:
    storage = t.untyped_storage()
    return sys.getrefcount(storage)


# What sys.getrefcount says of a tensor's storage object that only a local holds.
_STORAGE_REFERENCES = _storage_references(torch.empty(1))


def _references(holder: list[Any], i: int) -> int:
    """How many references ``holder[i]`` has, not counting this call's."""
    return sys.getrefcount(holder[i]) - 1


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.size() == b.size()
        and a.stride() == b.stride()
        and a.storage_offset() == b.storage_offset()
    )


def _draws_random(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether a seeded op really draws: attention kernels and dropout carry the
    tag, but with a zero dropout probability (eval mode) they draw nothing."""
    given = {arg.name: value for arg, value in _bound(func._schema, args, kwargs)}
    if any(a.name == "dropout_p" for a in func._schema.arguments):
        return bool(given.get("dropout_p", 0.0))
    if func is aten.native_dropout.default:
        return bool(given.get("train")) and bool(given.get("p"))
    return True


def _bound(schema: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[tuple[Any, Any]]:
    """(schema argument, value) pairs for the arguments actually passed."""
    pairs = []
    for i, arg in enumerate(schema.arguments):
        if i < len(args) and not arg.kwarg_only:
            pairs.append((arg, args[i]))
        elif arg.name in kwargs:
            pairs.append((arg, kwargs[arg.name]))
    return pairs
