"""The compiled replay tier: the captured torch program, compiled ahead of time.

A capture on the host backend yields a static program: fixed shapes, fixed
input and output tensors. Re-dispatching each recorded op from Python costs
about what eager costs (a couple of microseconds of dispatcher per op), so
the interpreted tier saves allocations but little time. This tier turns the
recorded ops into an FX graph, exports it and compiles it with AOTInductor;
a replay then runs one compiled function and copies its results into the
graph's static outputs.

Trade-offs, stated where users choose the tier:

- **Not bitwise identical** to eager: inductor fuses and reorders float
  arithmetic. Results agree to float rounding (the tests use
  ``torch.testing.assert_close``). The interpreted tier stays the exact one.
- **Build time**: a few seconds to a minute per graph. Builds are cached on
  disk (``ACCEL_GRAPH_CACHE``, default ``~/.cache/accel/graphs``) under a
  hash of the program, the input layouts, the values of the tensors it bakes
  in, and the torch version, so a process that captures the same model again
  loads it in milliseconds.
- **Weights are baked in**: tensors the program reads that are not inputs
  (parameters, buffers) are compiled in as constants. Change them, and the
  compiled graph does not see it: capture and compile again.
- **Only the named outputs** are kept up to date; intermediate static
  tensors are not written by compiled replays.
"""

from __future__ import annotations

import hashlib
import operator
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_map

from accel._errors import InvalidValueError, NotSupportedError

if TYPE_CHECKING:
    from accel.graph._graph import Graph
    from accel.graph._torch_capture import Program

__all__ = ["CompiledProgram", "cache_dir", "compile_graph"]


def cache_dir() -> Path:
    """Where compiled graphs are kept: ``$ACCEL_GRAPH_CACHE`` or ``~/.cache/accel/graphs``."""
    configured = os.environ.get("ACCEL_GRAPH_CACHE", "").strip()
    return Path(configured) if configured else Path.home() / ".cache" / "accel" / "graphs"


class CompiledProgram:
    """A graph's torch program compiled by AOTInductor, run in place of its op loop."""

    def __init__(
        self,
        path: Path,
        key: str,
        inputs: list[torch.Tensor],
        outputs: list[torch.Tensor],
        *,
        built: bool,
        seconds: float,
    ) -> None:
        self.path = path
        self.key = key
        #: True when this process built the package, False when it came from the cache.
        self.built = built
        #: Seconds spent building (or loading) the package.
        self.seconds = seconds
        self._inputs = inputs
        self._outputs = outputs
        import torch._inductor

        model = torch._inductor.aoti_load_package(str(path))
        # The loader's run() takes and returns flat tensor lists; the
        # package's __call__ adds pytree handling this fixed program does not need.
        self._run = model.loader.run

    def __repr__(self) -> str:
        return f"CompiledProgram({self.path.name}, {len(self._inputs)} inputs, {len(self._outputs)} outputs)"

    def __call__(self) -> None:
        for static, value in zip(self._outputs, self._run(self._inputs)):
            static.copy_(value)


def compile_graph(g: Graph, *, inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor]) -> CompiledProgram:
    """Make ``g``'s replays run its torch program compiled by AOTInductor.

    ``inputs`` are the static input tensors new data will be copied into;
    ``outputs`` the tensors the capture returned that you will read. Every
    other tensor the program reads is compiled in as a constant.

    Refused (:class:`~accel.NotSupportedError`) when the capture holds no
    torch program, interleaves torch ops with other stream work, or writes
    to registered inputs: use the interpreted tier (the default) for those.

    >>> import torch, accel
    >>> x = torch.randn(4, 8); lin = torch.nn.Linear(8, 8).eval()
    >>> g = accel.graph.Graph()
    >>> with accel.graph.graph(g):
    ...     y = torch.relu(lin(x))
    >>> _ = accel.graph.compile_graph(g, inputs=[x], outputs=[y])  # doctest: +SKIP
    """
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
    inputs, outputs = list(inputs), list(outputs)
    for role, tensors in (("inputs", inputs), ("outputs", outputs)):
        if not all(isinstance(t, torch.Tensor) for t in tensors):
            raise InvalidValueError(f"compile_graph: {role} must be torch tensors")
    if not outputs:
        raise InvalidValueError("compile_graph: name at least one output tensor to keep up to date")
    gm = _to_fx(program, inputs, outputs)
    key = _cache_key(gm, inputs)
    path = cache_dir() / f"{key}.pt2"
    start = time.perf_counter()
    built = not path.exists()
    if built:
        _build(gm, inputs, path)
    compiled = CompiledProgram(
        path, key, inputs, outputs, built=built, seconds=time.perf_counter() - start
    )
    program.segments[0].runner = compiled
    program.compiled = compiled
    return compiled


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
        node = env.get(id(t))
        if node is None or id(t) in {id(i) for i in inputs}:
            raise InvalidValueError(
                f"compile_graph: an output of shape {tuple(t.shape)} was not produced by the captured program"
            )
        results.append(node)
    graph.output(tuple(results))
    return fx.GraphModule(root, graph)


def _cpu_model() -> str:
    from accel._runtime import get_runtime

    return get_runtime().backend.device_properties(0).name


def _cache_key(gm: fx.GraphModule, inputs: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    h.update(f"torch {torch.__version__} {_cpu_model()} {sorted(INDUCTOR_CONFIGS.items())}\n".encode())
    h.update(gm.code.encode())
    for t in inputs:
        h.update(f"input {tuple(t.shape)} {tuple(t.stride())} {t.dtype}\n".encode())
    for name, buf in gm.named_buffers():
        h.update(f"constant {name} {tuple(buf.shape)} {tuple(buf.stride())} {buf.dtype}\n".encode())
        h.update(buf.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:32]


#: Inductor settings for the build. Weights are constants of the program, so
#: they may be folded and prepacked (freezing). Small GEMMs, which dominate
#: batch-1 inference, run faster as inductor's CPU micro-kernel templates than
#: as BLAS calls (about 1.3x to 2x on the benchmark's MLP and transformer
#: layer); the templates are chosen outright rather than autotuned against
#: BLAS, because autotuning on a busy machine picks by noise. Shapes the
#: templates cannot take fall back to BLAS. Intermediates go on the C stack
#: instead of torch's allocator when they are small (inductor only does so up
#: to 100 KB in all), which batch-1 graphs are: 1.5 us less per transformer-layer call.
INDUCTOR_CONFIGS: dict[str, Any] = {
    "freezing": True,
    "max_autotune": True,
    "max_autotune_gemm_backends": "CPP",
    "autotune_fallback_to_aten": True,
    "autotune_num_choices_displayed": 0,
    "max_autotune_report_choices_stats": False,
    "aot_inductor.allow_stack_allocation": True,
}


def _build(gm: fx.GraphModule, inputs: list[torch.Tensor], path: Path) -> None:
    import torch._inductor
    import torch.export

    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with torch.inference_mode(False), torch.no_grad():
            exported = torch.export.export(gm, tuple(t.detach() for t in inputs), strict=False)
            fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
            os.close(fd)
            try:
                # A copy: inductor adds keys to the dict it is given.
                settings = dict(INDUCTOR_CONFIGS)
                torch._inductor.aoti_compile_and_package(exported, package_path=tmp, inductor_configs=settings)
                os.replace(tmp, path)  # atomic: a concurrent build of the same key is harmless
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
    except Exception as exc:  # noqa: BLE001 - inductor raises many types; say what failed
        raise NotSupportedError(
            f"compiling the captured program with AOTInductor failed ({type(exc).__name__}: {exc}); "
            "keep the interpreted tier for this graph"
        ) from exc
