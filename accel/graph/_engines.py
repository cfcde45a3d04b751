"""Engines the compiled tier can run a captured program with.

Each engine builds a file from the program's FX graph (cached on disk by the
caller under a key naming the engine), loads it, and binds the loaded program
to fixed input and output tensors: the bound replay is one call that reads
the inputs and writes the outputs in place, with nothing else around it.

- ``aotinductor``: ``torch._inductor.aoti_compile_and_package`` (inductor's
  C++ code, built by the system compiler; weights frozen in and prepacked).
  Its runner returns new tensors, which the replay copies into the outputs.
- ``aotinductor-cpp-gemm``: the same with inductor's C++ GEMM templates
  forced, for programs with matrix products (they win on small ones).
- ``onnxruntime-fx``: the FX graph written as ONNX by accel's own emitter
  (:mod:`accel.graph._onnx_emit`: no exporter, milliseconds) and run by ONNX
  Runtime as below. The first engine tried: it serves a process's first
  graph within a second where torch's exporter takes 3 s to import. A
  program with an op the emitter does not map fails it, and the exporter's
  ``onnxruntime`` serves first instead.
- ``onnxruntime``: the program exported to ONNX (``torch.onnx.export``,
  dynamo exporter) and run by an ``InferenceSession`` with IO binding over
  the graph's own tensors: ONNX Runtime reads and writes them in place. A
  second binding, for graphed calls, reads the caller's input tensors in
  place and writes the same outputs.
- ``onnxruntime-1thread``: the same file in a session on one intra-op
  thread, competing where torch runs on more than one.

An engine whose Python package is missing reports it by ``version()``
returning None; the compiled tier then uses the others
(``pip install accel[onnx]`` adds ONNX Runtime).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.fx as fx

from accel._errors import AccelError, InvalidValueError, NotSupportedError

__all__ = [
    "ENGINES", "AOTInductor", "AOTInductorCppGemm", "Engine", "Facts", "OnnxRuntime", "OnnxRuntimeEmitted",
    "OnnxRuntimeOneThread", "kill_builds",
]

Replay = Callable[[], Any]


@dataclass(frozen=True)
class Facts:
    """What build settings depend on: the program's size and ops, and the threads."""

    #: Elements the program writes per run (a rough size of its work).
    work: int
    #: Names of the aten ops it runs (``"addmm"``, ``"convolution"``...).
    ops: frozenset[str]
    #: torch's intra-op thread count.
    threads: int

    @property
    def gemms(self) -> bool:
        return bool(self.ops & {"mm", "addmm", "bmm", "baddbmm", "linear", "matmul"})

    @property
    def convolutions(self) -> bool:
        return bool(self.ops & {"convolution", "conv2d", "conv1d", "conv3d", "_convolution"})


class Engine:
    """How one engine builds, loads and binds a program (see the module docstring)."""

    name = ""
    #: The name its built file is cached under: engines that differ only in
    #: how they load a file (session options) share it. Empty: ``name``.
    artifact = ""
    suffix = ""
    #: What to install when the engine is missing.
    install = ""
    #: Whether a run returns new output tensors (allocated at every call)
    #: rather than writing the ones it was bound to: the compiled tier keeps
    #: an engine that does not where two are timed alike.
    allocates_outputs = False

    def version(self) -> str | None:
        """The engine's version, or None when it is not installed."""
        raise NotImplementedError

    def applies(self, facts: Facts) -> bool:
        """Whether to try this engine on a program at all."""
        return True

    def settings(self, facts: Facts) -> dict[str, Any]:
        """Every setting that changes what :meth:`build` makes (part of the cache key)."""
        raise NotImplementedError

    def build(self, gm: fx.GraphModule, inputs: list[torch.Tensor], path: Path, settings: dict[str, Any]) -> None:
        """Build ``gm`` for ``inputs`` into the file ``path``."""
        raise NotImplementedError

    def load(self, path: Path, threads: int) -> Any:
        """The built program at ``path``, ready to bind."""
        raise NotImplementedError

    def bind(self, loaded: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> Replay:
        """A call that runs ``loaded`` on ``inputs`` and leaves the results in ``outputs``.

        Its ``raw`` attribute, where it has one, is the engine's own call
        alone (without copying results out), to measure accel's overhead by;
        its ``direct`` attribute, where it has one, takes any tensors laid out
        like the inputs and returns new outputs; its ``failed`` attribute is
        :meth:`failed`, which callers of those calls hand what they raise."""
        raise NotImplementedError

    def failed(self, exc: Exception) -> NoReturn:
        """Raise ``exc``, an error a run of this engine raised, as an accel error
        (:class:`~accel.InvalidValueError`, ``exc`` chained) naming the engine.

        The engine ran the program on inputs of these shapes and dtypes when it
        was chosen: a run that fails later fails on the values of its inputs
        (ONNX Runtime's Gather, or inductor's index check, on an embedding index
        out of range), where eager torch raises too. The run leaves nothing
        behind: the next call with good inputs works. An accel error is raised
        as it is. Only the failing call pays for this (callers catch around the
        engine's own call: free in Python 3.11 until it raises)."""
        if isinstance(exc, AccelError):
            raise exc
        text = str(exc).strip()
        # ONNX Runtime prefixes "[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : "; its own type
        # name says as much. Its last line is the reason (the node and the bad index).
        reason = text.splitlines()[-1][:300] if text else "no message"
        raise InvalidValueError(
            f"the compiled program's engine {self.name!r} failed on this call's inputs "
            f"({type(exc).__module__}.{type(exc).__name__}: {reason}). It ran these shapes and dtypes when it "
            "was chosen, so the values are the likely cause (an index out of range, as for an embedding), "
            "and eager torch would have raised on them too. The graph stays usable with other inputs; to "
            "see torch's own error, call the function eagerly or graph it with tier='interpreted'"
        ) from exc


@contextlib.contextmanager
def _atomic(path: Path) -> Iterator[str]:
    """A temporary file beside ``path`` that becomes ``path`` when the block ends
    without error: a concurrent build of the same key is harmless."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=path.suffix, dir=path.parent)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


# Builds run on background threads (the compiled tier serves a first engine while
# others build), and the tools they call change process-wide state while they run:
# torch.export replaces builtins.max, builtins.min and math.pow, inductor patches its
# global config, the ONNX exporter sets a module flag. Two such builds at once left
# each other's state behind when they ended out of order. One build per tool at a
# time, then; an ONNX export need not wait for a C++ compile of another graph.
_EXPORTING = threading.Lock()
_INDUCTOR = threading.Lock()
_ONNX = threading.Lock()


def _export(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> Any:
    with _EXPORTING, torch.inference_mode(False), torch.no_grad():
        return torch.export.export(gm, tuple(t.detach() for t in inputs), strict=False)


#: Below this many elements written per run, generated code runs on one
#: thread: starting OpenMP's team costs more than microsecond-sized work
#: gains (tiny MLP with 2 threads: 7.6 µs on one thread, 16.7 µs with OpenMP).
PARALLEL_MIN_ELEMENTS = 1 << 16


class AOTInductor(Engine):
    """torch's AOTInductor: inductor's generated C++ over the frozen program."""

    name = "aotinductor"
    suffix = ".pt2"
    allocates_outputs = True
    install = "a C++ compiler (g++) for inductor"

    def version(self) -> str | None:
        import shutil

        # inductor builds with the system's C++ compiler.
        return torch.__version__ if shutil.which(os.environ.get("CXX", "g++")) else None

    def settings(self, facts: Facts) -> dict[str, Any]:
        # Weights are constants of the program: fold them in (freezing).
        # Prepacking them for oneDNN pays off for convolutions; for small
        # linear layers oneDNN's per-call cost dominates (tiny MLP: 90 us per
        # run prepacked, 10 us with BLAS addmm). Small intermediates live on
        # the C stack rather than torch's allocator.
        return {
            "freezing": True,
            "cpp.weight_prepack": facts.convolutions,
            "aot_inductor.allow_stack_allocation": True,
            "cpp.threads": 1 if facts.work < PARALLEL_MIN_ELEMENTS else facts.threads,
        }

    def build(self, gm: fx.GraphModule, inputs: list[torch.Tensor], path: Path, settings: dict[str, Any]) -> None:
        # In a process of its own (see _build_in_child): inductor's code generation
        # holds the GIL for seconds and patches its global config, and its C++
        # compiler runs for tens of seconds, which interpreter exit cannot wait for.
        with _INDUCTOR:
            exported = _export(gm, inputs)
            with tempfile.TemporaryDirectory(prefix="accel-aoti-") as scratch:
                program = os.path.join(scratch, "program.pt2")
                torch.export.save(exported, program)
                with _atomic(path) as tmp:
                    _build_in_child(_AOTI_BUILD, program, tmp, json.dumps(settings), str(torch.get_num_threads()))

    def load(self, path: Path, threads: int) -> Any:
        import torch._inductor

        # The loader's run() takes and returns flat tensor lists; the
        # package's __call__ adds pytree handling a fixed program does not need.
        return torch._inductor.aoti_load_package(str(path)).loader.run

    def bind(self, loaded: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> Replay:
        run = loaded
        if len(outputs) == 1:
            (out,) = outputs
            copy = out.copy_

            def replay_one() -> None:
                try:
                    result = run(inputs)
                except Exception as exc:  # noqa: BLE001 - the runner's error, as an accel one
                    self.failed(exc)
                copy(result[0])

            replay_one.raw = functools.partial(run, inputs)  # type: ignore[attr-defined]
            replay_one.direct = run  # type: ignore[attr-defined]
            replay_one.failed = self.failed  # type: ignore[attr-defined]
            return replay_one

        def replay() -> None:
            try:
                results = run(inputs)
            except Exception as exc:  # noqa: BLE001 - as replay_one
                self.failed(exc)
            for static, value in zip(outputs, results):
                static.copy_(value)

        replay.raw = functools.partial(run, inputs)  # type: ignore[attr-defined]
        replay.direct = run  # type: ignore[attr-defined]
        replay.failed = self.failed  # type: ignore[attr-defined]
        return replay


# AOTInductor's build, in a new interpreter: argv is the saved ExportedProgram, the
# package to write, inductor's settings (JSON), torch's threads, and the parent's sys.path.
_AOTI_BUILD = """
import json, sys
sys.path[:0] = json.loads(sys.argv[5])
import torch, torch._inductor
torch.set_num_threads(int(sys.argv[4]))
exported = torch.export.load(sys.argv[1])
with torch.no_grad():
    torch._inductor.aoti_compile_and_package(exported, package_path=sys.argv[2], inductor_configs=json.loads(sys.argv[3]))
"""

# Build processes running, by the thread waiting for each; killed by kill_builds().
_CHILDREN: dict[subprocess.Popen[str], int] = {}
_CHILDREN_LOCK = threading.Lock()


def _build_in_child(code: str, *args: str) -> None:
    """Run ``code`` with ``args`` (then this process's sys.path, as JSON) in a new
    interpreter; raise its error, if it fails, as a RuntimeError naming its last line.

    A build in a thread of this process could not be stopped: at interpreter exit
    a thread that is still in torch's code is ended there by the interpreter,
    inside a torch call, and that aborted the process ("terminate called without
    an active exception"). A child is killed with the compilers it started
    (:func:`kill_builds`), its thread waiting for it in no torch code."""
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args, json.dumps(sys.path)],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        start_new_session=True,  # its own process group: the C++ compilers it runs go with it
    )
    with _CHILDREN_LOCK:
        _CHILDREN[proc] = threading.get_ident()
    try:
        _, err = proc.communicate()
    except BaseException:  # interrupted: not left compiling
        _kill(proc)
        raise
    finally:
        with _CHILDREN_LOCK:
            _CHILDREN.pop(proc, None)
    if proc.returncode != 0:
        lines = [line for line in err.splitlines() if line.strip()]
        last = lines[-1].strip() if lines else f"it was killed by signal {-proc.returncode}"
        raise RuntimeError(f"the build process exited with {proc.returncode}: {last}")


def _kill(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def kill_builds(thread: int | None = None) -> None:
    """Kill the build processes that the thread ``thread`` (an ident; None: every
    thread) waits for: its wait ends, and the build fails."""
    with _CHILDREN_LOCK:
        children = [proc for proc, waiter in _CHILDREN.items() if thread is None or waiter == thread]
    for proc in children:
        _kill(proc)


def _forked() -> None:
    """A forked child has none of its parent's build threads or processes: it must
    not kill the parent's builds at its exit, nor wait for a lock a build held."""
    global _CHILDREN_LOCK, _EXPORTING, _INDUCTOR, _ONNX
    _CHILDREN.clear()
    _CHILDREN_LOCK, _EXPORTING, _INDUCTOR, _ONNX = (threading.Lock() for _ in range(4))


os.register_at_fork(after_in_child=_forked)


class AOTInductorCppGemm(AOTInductor):
    """AOTInductor with inductor's C++ GEMM micro-kernel templates for every GEMM
    they can take. They win at batch 1 (tiny MLP: 1.7 us per run against 10 us
    with BLAS) and lose elsewhere (attention block at batch 8: 0.78x eager
    against 1.25x), so they compete as an engine of their own, timed side by
    side, rather than by inductor's autotuning, which on a busy machine picks
    by noise."""

    name = "aotinductor-cpp-gemm"

    def applies(self, facts: Facts) -> bool:
        return facts.gemms

    def settings(self, facts: Facts) -> dict[str, Any]:
        return {
            **super().settings(facts),
            "cpp.weight_prepack": True,  # the templates take prepacked weights
            "max_autotune": True,
            "max_autotune_gemm_backends": "CPP",
            "autotune_fallback_to_aten": True,
            "autotune_num_choices_displayed": 0,
            "max_autotune_report_choices_stats": False,
        }


_ORT_TYPES = {
    torch.float32: "float32",
    torch.float64: "float64",
    torch.float16: "float16",
    torch.int64: "int64",
    torch.int32: "int32",
    torch.int8: "int8",
    torch.uint8: "uint8",
    torch.bool: "bool",
}


@functools.lru_cache(maxsize=None)
def _onnx_registry(opset: int) -> Any:
    """The ONNX exporter's table of aten ops and their ONNX functions, made once a process.

    ``torch.onnx.export`` makes it anew at every call: 1.1-1.7 s on the 2-core
    VM (it parses the source of some 500 functions), of a 2 s export of the
    benchmark's MLP; the table is only read by an export."""
    from torch.onnx._internal.exporter import _registration

    return _registration.ONNXRegistry.from_torchlib(opset_version=opset)


def _onnx_export(exported: Any, inputs: list[torch.Tensor], opset: int, optimize: bool) -> Any:
    """``torch.onnx.export(exported, inputs, dynamo=True, ...)``, with the op table
    made once a process (:func:`_onnx_registry`) where the exporter takes one
    (torch 2.5 and later have ``_core.export(..., registry=)``, which the public
    call calls with a new table)."""
    try:
        from torch.onnx._internal.exporter import _core, _registration

        usable = hasattr(_registration, "ONNXRegistry") and hasattr(_core, "export")
    except ImportError:  # pragma: no cover - another torch layout
        usable = False
    if not usable:  # pragma: no cover - another torch layout
        return torch.onnx.export(
            exported, tuple(inputs), dynamo=True, opset_version=opset, optimize=optimize, verbose=False
        )
    return _core.export(
        exported, tuple(inputs), None, registry=_onnx_registry(opset), optimize=optimize,
        opset_version=opset, verbose=False,
    )


class OnnxRuntime(Engine):
    """ONNX Runtime over the program exported to ONNX, with IO binding."""

    name = "onnxruntime"
    suffix = ".onnx"
    install = "pip install accel[onnx]"

    def version(self) -> str | None:
        for module in ("onnxruntime", "onnx", "onnxscript"):
            try:
                if importlib.util.find_spec(module) is None:
                    return None
            except (ImportError, ValueError):  # a module set to None in sys.modules, or broken
                return None
        import onnxruntime

        return str(onnxruntime.__version__)

    def settings(self, facts: Facts) -> dict[str, Any]:
        # Threads are a session option (load), not part of the built file.
        return {"opset": 18, "optimize": True}

    def build(self, gm: fx.GraphModule, inputs: list[torch.Tensor], path: Path, settings: dict[str, Any]) -> None:
        import logging

        exporter = logging.getLogger("torch.onnx")
        with _ONNX:
            exported = _export(gm, inputs)
            level = exporter.level
            exporter.setLevel(logging.ERROR)  # it logs about optional packages (torchvision) it does not need
            try:
                with torch.inference_mode(False), torch.no_grad():
                    onnx_program = _onnx_export(exported, inputs, settings["opset"], settings["optimize"])
            finally:
                exporter.setLevel(level)
        if onnx_program is None:  # pragma: no cover - only without dynamo=True
            raise NotSupportedError("torch.onnx.export returned no program")
        with _atomic(path) as tmp:
            onnx_program.save(tmp)

    def load(self, path: Path, threads: int) -> Any:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = self.session_threads(threads)
        options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def bind(self, loaded: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor]) -> Replay:
        import numpy as np

        session = loaded
        binding = session.io_binding()
        # The exporter names inputs after the FX placeholders (input_<i>) and
        # drops inputs the program does not read.
        by_name = {f"input_{i}": t for i, t in enumerate(inputs)}
        for arg in session.get_inputs():
            t = by_name.get(arg.name)
            if t is None:
                raise NotSupportedError(f"the ONNX program has an input {arg.name!r} the capture does not")
            self._bind(binding.bind_input, arg.name, t, np)
        names = [o.name for o in session.get_outputs()]
        if len(names) != len(outputs):
            raise NotSupportedError(f"the ONNX program has {len(names)} outputs for {len(outputs)} tensors")
        for name, t in zip(names, outputs):
            self._bind(binding.bind_output, name, t, np)
        # The binding holds raw pointers into the session and the tensors:
        # both must outlive it (a session freed first crashes the binding's
        # destructor), whatever order the replay's references are dropped in.
        binding._accel_keep = (session, inputs, outputs)
        # No Python frame between a replay and ONNX Runtime: the session's
        # compiled method, as the public run_with_iobinding calls it after
        # checks for WebGPU graph capture, which a CPU session never does
        # (they cost about 0.5 us a call). The public call where that changed.
        native, native_binding = getattr(session, "_sess", None), getattr(binding, "_iobinding", None)
        if native is not None and native_binding is not None and hasattr(native, "run_with_iobinding"):
            replay = functools.partial(native.run_with_iobinding, native_binding, None)
        else:  # pragma: no cover - another onnxruntime layout
            replay = functools.partial(session.run_with_iobinding, binding)
        replay.keep = binding  # type: ignore[attr-defined]
        replay.failed = self.failed  # type: ignore[attr-defined]
        if replay.func is not session.run_with_iobinding:
            replay.take = self._taking(session, native, inputs, outputs, np)  # type: ignore[attr-defined]
        return replay

    def _taking(
        self, session: Any, native: Any, inputs: list[torch.Tensor], outputs: list[torch.Tensor], np: Any
    ) -> tuple[Callable[[], Any], Callable[[Any], None]]:
        """A second binding for runs on the caller's own input tensors
        (contiguous host tensors laid out like ``inputs``), results in
        ``outputs``: ``(run, point)``, where ``point(args)`` points its inputs
        at the caller's memory (about 0.6 us, whatever the size) and ``run()``
        runs it. A caller that passes the same memory again runs it without
        pointing it anew: no copy, no rebinding. The replay's binding keeps
        the graph's buffers, so a replay of the graph never reads the
        caller's memory. The caller must not run it after the memory it was
        last pointed at is freed (:func:`accel.graph._compiled.bind_call`
        points it at every call's tensors first, under a lock)."""
        from onnxruntime.capi.onnxruntime_inference_collection import OrtDevice

        binding = session.io_binding()
        for name, t in zip([o.name for o in session.get_outputs()], outputs):
            self._bind(binding.bind_output, name, t, np)
        binding._accel_keep = (session, outputs)
        cpu = OrtDevice.make("cpu", 0)._get_c_device()
        bound = binding._iobinding
        bind_input = bound.bind_input
        wanted = {arg.name for arg in session.get_inputs()}
        slots = [(i, f"input_{i}", np.dtype(_ORT_TYPES[t.dtype]), list(t.shape)) for i, t in enumerate(inputs)
                 if f"input_{i}" in wanted]

        def point(args: Any) -> None:
            for i, name, kind, shape in slots:
                bind_input(name, cpu, kind, shape, args[i].data_ptr())

        run = functools.partial(native.run_with_iobinding, bound, None)
        run.keep = binding  # type: ignore[attr-defined]
        return run, point

    def session_threads(self, threads: int) -> int:
        """The session's intra-op threads for a process running torch on ``threads``."""
        return threads

    @staticmethod
    def _bind(bind: Callable[..., None], name: str, t: torch.Tensor, np: Any) -> None:
        kind = _ORT_TYPES.get(t.dtype)
        if kind is None:
            raise NotSupportedError(f"ONNX Runtime binding takes no {t.dtype} tensors")
        if not t.is_contiguous():
            raise NotSupportedError(f"ONNX Runtime binds contiguous tensors only ({name} has strides {t.stride()})")
        bind(name, "cpu", 0, np.dtype(kind), list(t.shape), t.data_ptr())


class OnnxRuntimeOneThread(OnnxRuntime):
    """ONNX Runtime's session on one intra-op thread, where torch runs on more:
    for small programs, waking the session's thread pool costs more than the
    work it shares. It loads the same file as ``onnxruntime`` and competes
    with it, timed side by side, so that each program gets whichever is faster."""

    name = "onnxruntime-1thread"
    artifact = "onnxruntime"

    def applies(self, facts: Facts) -> bool:
        return facts.threads > 1

    def session_threads(self, threads: int) -> int:
        return 1


@functools.lru_cache(maxsize=None)
def _distribution_version(name: str) -> str:
    """An installed distribution's version, looked up once a process (the lookup
    reads package metadata: 2-18 ms, in the capturing thread at every capture)."""
    return importlib.metadata.version(name)


class OnnxRuntimeEmitted(OnnxRuntime):
    """ONNX Runtime over ONNX that accel emits from the FX graph itself
    (:func:`accel.graph._onnx_emit.emit`), without torch's exporter: no
    ``torch.export``, no onnxscript, no op table (about 3 s once a process on
    the 2-core VM). It needs ``onnx`` and ``onnxruntime`` only. Its cache key
    holds the emitter's version, so a changed emitter never loads files an
    older one wrote."""

    name = "onnxruntime-fx"

    def version(self) -> str | None:
        for module in ("onnxruntime", "onnx"):
            try:
                if importlib.util.find_spec(module) is None:
                    return None
            except (ImportError, ValueError):  # as OnnxRuntime.version
                return None
        import onnxruntime

        return f"{onnxruntime.__version__} onnx {_distribution_version('onnx')}"

    def settings(self, facts: Facts) -> dict[str, Any]:
        from accel.graph import _onnx_emit

        return {"opset": _onnx_emit.OPSET, "emitter": _onnx_emit.EMITTER_VERSION}

    def build(self, gm: fx.GraphModule, inputs: list[torch.Tensor], path: Path, settings: dict[str, Any]) -> None:
        from accel.graph import _onnx_emit

        model = _onnx_emit.emit(gm, inputs)
        with _atomic(path) as tmp:
            Path(tmp).write_bytes(model)
        with _atomic(self._digest_path(path)) as tmp:
            Path(tmp).write_text(hashlib.sha256(model).hexdigest())

    def load(self, path: Path, threads: int) -> Any:
        # Validation runs the trial inputs only: a damaged file that still loads
        # (a flipped byte in an embedding row the trial never reads) would serve
        # wrong values to later inputs. Checked against the digest written
        # beside it, it fails here instead and is emitted anew.
        try:
            expected = self._digest_path(path).read_text().strip()
        except OSError:
            expected = ""
        if hashlib.sha256(path.read_bytes()).hexdigest() != expected:
            raise NotSupportedError(f"{path} does not match the digest written beside it when it was emitted")
        return super().load(path, threads)

    @staticmethod
    def _digest_path(path: Path) -> Path:
        return path.with_name(path.name + ".sha256")


#: Engines the compiled tier tries, by name, in the order a first build tries them
#: (the emitted ONNX first: it is ready in a fraction of a second).
ENGINES: dict[str, Engine] = {
    e.name: e for e in (
        OnnxRuntimeEmitted(), OnnxRuntime(), OnnxRuntimeOneThread(), AOTInductor(), AOTInductorCppGemm(),
    )
}
