"""ONNX emitted from the compiled tier's FX graph by accel itself, without torch's exporter.

torch's ONNX exporter costs about 3 s once a process on the 2-core VM before
its first export (importing ``torch.onnx``'s dynamo exporter and onnxscript,
building its op table), then ``torch.export`` and the export itself: a
process's first graph waited 3.8-4.4 s for its first compiled engine. The
recorded programs are plain aten ops with static shapes, so most map to ONNX
(opset :data:`OPSET`) one by one: :func:`emit` writes them with
``onnx.helper`` in milliseconds (``import onnx``: 0.05 s).

A program with an op or an argument the table does not map is refused
(:class:`~accel.NotSupportedError` naming it): the exporter's engine
(``onnxruntime``) builds it instead. What is emitted is validated against
eager like every engine's result, so a mapping that is wrong for some
arguments is rejected, never served. :data:`EMITTER_VERSION` is part of the
engine's cache key: change what any mapping emits, and raise it.

Shapes and dtypes come from one eager run of the graph on the trial inputs
(the capture fixes them). In-place ops are emitted as their out-of-place
forms, the written tensor then naming the new value. A later read of another
tensor whose memory the write reached (a view of the written tensor, made
before the write) is refused: which elements of it changed is what the
emitter does not model. Views of one tensor that share no element (the
chunks of a GRU's gates) are told apart exactly, from their strides.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from accel._errors import NotSupportedError

__all__ = ["EMITTER_VERSION", "OPSET", "emit", "mapped_ops"]

#: Raise it whenever what any mapping emits changes: it is part of the
#: ``onnxruntime-fx`` engine's cache key, so files the old emitter wrote never load.
EMITTER_VERSION = 2
#: The ONNX opset emitted (the one the exporter's engine uses).
OPSET = 18
# ONNX's IR version for opset 18.
_IR_VERSION = 8

aten = torch.ops.aten


@dataclass(frozen=True)
class _Meta:
    """One tensor as the eager run left it: what the emitter needs of it."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int
    stride: tuple[int, ...]
    storage: int  # the storage's address while the run held it (0: none)

    @property
    def rank(self) -> int:
        return len(self.shape)


def _describe(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return _Meta(tuple(value.shape), value.dtype, int(value.storage_offset()), tuple(value.stride()),
                     value.untyped_storage().data_ptr())
    if isinstance(value, (tuple, list)):
        return tuple(_describe(v) for v in value)
    return None


class _Missing:
    """An output the emitter does not produce (batch norm's saved statistics...):
    reading it refuses the program."""

    def __init__(self, what: str) -> None:
        self.what = what


class _Recorder(fx.Interpreter):
    """Runs the graph eagerly once, noting each node's tensors (:class:`_Meta`) and,
    for each tensor, the node whose memory it is a view of (its root): an output
    sharing a storage with an argument while both are alive is a view of it."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.metas: dict[fx.Node, Any] = {}
        self.roots: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        result = super().run_node(n)
        meta = self.metas[n] = _describe(result)
        if n.op == "call_function" and n.target is operator.getitem:
            source = self.roots.get(n.args[0])  # type: ignore[arg-type]
            index = n.args[1]
            self.roots[n] = source[index] if isinstance(source, tuple) and isinstance(index, int) else n
            return result
        owners: dict[int, Any] = {}
        for a in n.all_input_nodes:
            for m, root in zip(_flat(self.metas.get(a)), _flat(self.roots.get(a))):
                if isinstance(m, _Meta) and m.storage:
                    owners.setdefault(m.storage, root)
        if isinstance(meta, tuple):
            self.roots[n] = tuple(
                owners.get(m.storage, (n, i)) if isinstance(m, _Meta) and m.storage else (n, i)
                for i, m in enumerate(meta)
            )
        elif isinstance(meta, _Meta):
            self.roots[n] = owners.get(meta.storage, n) if meta.storage else n
        return result


def _flat(value: Any) -> list[Any]:
    return list(value) if isinstance(value, tuple) else [value]


def _overlap(a: _Meta, b: _Meta) -> bool:
    """Whether two views of one storage share an element."""
    if not math.prod(a.shape) or not math.prod(b.shape):
        return False
    if a.dtype.itemsize != b.dtype.itemsize:
        return True  # views of another dtype: assume the worst
    ends = [m.offset + 1 + sum((n - 1) * s for n, s in zip(m.shape, m.stride)) for m in (a, b)]
    if ends[0] <= b.offset or ends[1] <= a.offset:
        return False
    marks = torch.zeros(max(ends), dtype=torch.bool)
    marks.as_strided(a.shape, a.stride, a.offset).fill_(True)
    return bool(marks.as_strided(b.shape, b.stride, b.offset).any())


_ONNX_TYPES: dict[torch.dtype, int] = {}


def _onnx_type(dtype: torch.dtype) -> int:
    from onnx import TensorProto

    if not _ONNX_TYPES:
        _ONNX_TYPES.update({
            torch.float32: TensorProto.FLOAT, torch.float64: TensorProto.DOUBLE,
            torch.float16: TensorProto.FLOAT16, torch.bfloat16: TensorProto.BFLOAT16,
            torch.int64: TensorProto.INT64, torch.int32: TensorProto.INT32, torch.int16: TensorProto.INT16,
            torch.int8: TensorProto.INT8, torch.uint8: TensorProto.UINT8, torch.bool: TensorProto.BOOL,
        })
    kind = _ONNX_TYPES.get(dtype)
    if kind is None:
        raise NotSupportedError(f"accel's ONNX emitter has no type for {dtype} tensors")
    return kind


class _Emitter:
    """The ONNX graph being written: nodes, initializers, and each FX node's current value."""

    def __init__(self, recorder: _Recorder) -> None:
        self.metas = recorder.metas
        self.roots = recorder.roots
        self.nodes: list[Any] = []
        self.initializers: dict[str, Any] = {}
        self.values: dict[fx.Node, Any] = {}
        # The nodes emitted so far by their root (what an in-place write checks: a
        # scan of every node made emitting thousands of in-place ops quadratic).
        self.by_root: dict[Any, list[fx.Node]] = {}
        # Each node's tensor now: an in-place op changes its written tensor's meta.
        self.current: dict[fx.Node, Any] = dict(self.metas)
        # Nodes whose memory an in-place op wrote after they were made, by what wrote it.
        self.stale: dict[fx.Node, str] = {}
        self.names = 0

    def keep(self, node: fx.Node, value: Any) -> None:
        """``node``'s first ONNX value (or values, or what is missing)."""
        self.values[node] = value
        self.by_root.setdefault(self.roots.get(node), []).append(node)

    def fresh(self, hint: str) -> str:
        self.names += 1
        return f"{hint}_{self.names}"

    def op(self, kind: str, inputs: Sequence[str], **attrs: Any) -> str:
        """Append one ONNX node of one output; its output's name."""
        from onnx import helper

        out = self.fresh(kind.lower())
        self.nodes.append(helper.make_node(kind, list(inputs), [out], **attrs))
        return out

    def ops(self, kind: str, inputs: Sequence[str], count: int, **attrs: Any) -> list[str]:
        """Append one ONNX node of ``count`` outputs; their names."""
        from onnx import helper

        outs = [self.fresh(kind.lower()) for _ in range(count)]
        self.nodes.append(helper.make_node(kind, list(inputs), outs, **attrs))
        return outs

    def const(self, value: torch.Tensor, hint: str = "const") -> str:
        from onnx import helper

        name = self.fresh(hint)
        t = value.detach().contiguous()
        self.initializers[name] = helper.make_tensor(
            name, _onnx_type(t.dtype), list(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes(), raw=True
        )
        return name

    def ints(self, values: Sequence[int]) -> str:
        return self.const(torch.tensor(list(values), dtype=torch.int64))

    def scalar(self, value: Any, dtype: torch.dtype) -> str:
        return self.const(torch.tensor(value, dtype=dtype))

    def meta(self, node: Any) -> _Meta:
        m = self.current.get(node)
        if not isinstance(m, _Meta):
            raise NotSupportedError(f"accel's ONNX emitter expected a tensor for {node}")
        return m

    def value(self, node: Any) -> str:
        """The ONNX name of an argument's current value (a tensor node)."""
        if not isinstance(node, fx.Node):
            raise NotSupportedError(f"accel's ONNX emitter expected a tensor argument, got {type(node).__name__}")
        if node in self.stale:
            raise NotSupportedError(
                f"accel's ONNX emitter does not follow {node.name} after {self.stale[node]} wrote its memory "
                "through another view"
            )
        v = self.values.get(node)
        if isinstance(v, _Missing):
            raise NotSupportedError(f"accel's ONNX emitter does not emit {v.what}")
        if not isinstance(v, str):
            raise NotSupportedError(f"accel's ONNX emitter has no tensor for {node.name}")
        return v

    def cast(self, node: Any, dtype: torch.dtype) -> str:
        """The argument as ``dtype`` (a Python number: a constant of it)."""
        if not isinstance(node, fx.Node):
            if isinstance(node, (bool, int, float)):
                return self.scalar(node, dtype)
            raise NotSupportedError(f"accel's ONNX emitter takes no {type(node).__name__} operand")
        name = self.value(node)
        if self.meta(node).dtype != dtype:
            name = self.op("Cast", [name], to=_onnx_type(dtype))
        return name

    def wrote(self, target: fx.Node, op: fx.Node) -> None:
        """``op`` wrote ``target``'s memory in place: other views of it made before are stale."""
        root = self.roots.get(target)
        if isinstance(root, fx.Node) and root.op in ("placeholder", "get_attr"):
            raise NotSupportedError(
                f"{op.target} writes in place to an input or a constant of the program; accel's ONNX emitter "
                "emits pure programs only"
            )
        written = self.meta(target)
        fresh = []  # a stale node stays stale: later writes need not look at it again
        for other in self.by_root.get(root, ()):  # those emitted so far: those made later read the new values
            if other in self.stale:
                continue
            if other is not target and other is not op:
                m = self.current.get(other)
                if isinstance(m, _Meta) and _overlap(m, written):
                    self.stale[other] = str(op.target)
                    continue
            fresh.append(other)
        self.by_root[root] = fresh


Emit = Callable[[_Emitter, fx.Node, dict[str, Any]], Any]
_TABLE: dict[Any, Emit] = {}
# In-place ops: the argument they write (the first) names their result afterwards.
_INPLACE: set[Any] = set()
# In-place ops that change the written tensor's shape or strides, not its memory.
_RESHAPING: set[Any] = set()


def _maps(*ops: Any, inplace: Sequence[Any] = (), reshaping: Sequence[Any] = ()) -> Callable[[Emit], Emit]:
    def register(fn: Emit) -> Emit:
        for op in (*ops, *inplace, *reshaping):
            _TABLE[op] = fn
        _INPLACE.update(inplace)
        _INPLACE.update(reshaping)
        _RESHAPING.update(reshaping)
        return fn

    return register


def mapped_ops() -> list[str]:
    """The aten ops (overloads) the emitter maps, by name."""
    return sorted(str(op) for op in _TABLE)


def _args(n: fx.Node) -> dict[str, Any]:
    """``n``'s arguments by their schema's names, defaults filled in."""
    schema = n.target._schema  # type: ignore[union-attr]
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(n.args):
            bound[arg.name] = n.args[i]
        elif arg.name in n.kwargs:
            bound[arg.name] = n.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
    return bound


def _dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


def _out(e: _Emitter, n: fx.Node) -> _Meta:
    m = e.metas.get(n)
    if not isinstance(m, _Meta):
        raise NotSupportedError(f"accel's ONNX emitter expected {n.target} to return a tensor")
    return m


def _reshape(e: _Emitter, x: str, shape: tuple[int, ...], now: tuple[int, ...]) -> str:
    if shape == now:
        return x
    return e.op("Reshape", [x, e.ints(shape)], allowzero=1)


# -- elementwise --------------------------------------------------------------------

_UNARY = {
    aten.relu: "Relu", aten.tanh: "Tanh", aten.sigmoid: "Sigmoid", aten.exp: "Exp", aten.log: "Log",
    aten.sqrt: "Sqrt", aten.neg: "Neg", aten.abs: "Abs", aten.erf: "Erf", aten.reciprocal: "Reciprocal",
}
_UNARY_INPLACE = {
    aten.relu_: "Relu", aten.tanh_: "Tanh", aten.sigmoid_: "Sigmoid", aten.exp_: "Exp", aten.neg_: "Neg",
    aten.sqrt_: "Sqrt", aten.abs_: "Abs",
}
_UNARY_KIND: dict[Any, str] = {p.default: k for p, k in {**_UNARY, **_UNARY_INPLACE}.items()}


@_maps(*[p.default for p in _UNARY], inplace=[p.default for p in _UNARY_INPLACE])
def _unary(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    return e.op(_UNARY_KIND[n.target], [e.cast(a["self"], _out(e, n).dtype)])


@_maps(aten.rsqrt.default)
def _rsqrt(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    return e.op("Reciprocal", [e.op("Sqrt", [e.cast(a["self"], _out(e, n).dtype)])])


@_maps(aten.silu.default, inplace=[aten.silu_.default])
def _silu(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    x = e.cast(a["self"], _out(e, n).dtype)
    return e.op("Mul", [x, e.op("Sigmoid", [x])])


@_maps(aten.gelu.default, inplace=[aten.gelu_.default])
def _gelu(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    dtype = _out(e, n).dtype
    x = e.cast(a["self"], dtype)
    half = e.op("Mul", [x, e.scalar(0.5, dtype)])
    if a.get("approximate", "none") == "tanh":
        cube = e.op("Mul", [e.op("Mul", [x, x]), x])
        inner = e.op("Add", [x, e.op("Mul", [cube, e.scalar(0.044715, dtype)])])
        t = e.op("Tanh", [e.op("Mul", [inner, e.scalar(math.sqrt(2 / math.pi), dtype)])])
    elif a.get("approximate", "none") == "none":
        t = e.op("Erf", [e.op("Mul", [x, e.scalar(1 / math.sqrt(2), dtype)])])
    else:
        raise NotSupportedError(f"accel's ONNX emitter maps no gelu approximate={a['approximate']!r}")
    return e.op("Mul", [half, e.op("Add", [t, e.scalar(1.0, dtype)])])


@_maps(aten.hardtanh.default, aten.clamp.default, inplace=[aten.hardtanh_.default, aten.clamp_.default])
def _clip(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    dtype = _out(e, n).dtype
    low, high = (a["min_val"], a["max_val"]) if "min_val" in a else (a.get("min"), a.get("max"))
    if isinstance(low, fx.Node) or isinstance(high, fx.Node):
        raise NotSupportedError("accel's ONNX emitter maps clamp with number bounds only")
    if dtype.is_floating_point:
        # A bound Clip is not given is the type's largest finite value in ONNX
        # Runtime: clamp(min=0) of inf would be 3.4e38, not inf.
        low = -math.inf if low is None else low
        high = math.inf if high is None else high
    return e.op("Clip", [e.cast(a["self"], dtype), "" if low is None else e.scalar(low, dtype),
                         "" if high is None else e.scalar(high, dtype)])


@_maps(aten.leaky_relu.default, inplace=[aten.leaky_relu_.default])
def _leaky_relu(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    return e.op("LeakyRelu", [e.cast(a["self"], _out(e, n).dtype)], alpha=float(a["negative_slope"]))


_BINARY = {"add": "Add", "sub": "Sub", "mul": "Mul", "div": "Div"}


@_maps(
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar,
    inplace=[aten.add_.Tensor, aten.add_.Scalar, aten.sub_.Tensor, aten.sub_.Scalar, aten.mul_.Tensor,
             aten.mul_.Scalar, aten.div_.Tensor, aten.div_.Scalar],
)
def _binary(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    dtype = _out(e, n).dtype
    name = n.target._schema.name.split("::")[1].rstrip("_")  # type: ignore[union-attr]
    if name == "div" and not dtype.is_floating_point:
        raise NotSupportedError("accel's ONNX emitter maps true division to a float result only")
    other = e.cast(a["other"], dtype)
    alpha = a.get("alpha", 1)
    if alpha != 1:
        other = e.op("Mul", [other, e.scalar(alpha, dtype)])
    return e.op(_BINARY[name], [e.cast(a["self"], dtype), other])


@_maps(aten.rsub.Tensor, aten.rsub.Scalar)
def _rsub(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    dtype = _out(e, n).dtype
    x = e.cast(a["self"], dtype)
    if a.get("alpha", 1) != 1:
        x = e.op("Mul", [x, e.scalar(a["alpha"], dtype)])
    return e.op("Sub", [e.cast(a["other"], dtype), x])


@_maps(aten.pow.Tensor_Scalar, aten.pow.Tensor_Tensor)
def _pow(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    dtype = _out(e, n).dtype
    if not dtype.is_floating_point and isinstance(a["exponent"], fx.Node):
        # An integer to a negative power: torch's is 0 (1 or -1 for a base of 1 or
        # -1), ONNX Runtime's 0 ** -1 is the type's lowest value.
        raise NotSupportedError("accel's ONNX emitter maps no aten.pow.Tensor_Tensor of integers")
    return e.op("Pow", [e.cast(a["self"], dtype), e.cast(a["exponent"], dtype)])


@_maps(aten.maximum.default, aten.minimum.default)
def _extreme(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    dtype = _out(e, n).dtype
    kind = "Max" if n.target is aten.maximum.default else "Min"
    return e.op(kind, [e.cast(a["self"], dtype), e.cast(a["other"], dtype)])


@_maps(aten.where.self)
def _where(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    dtype = _out(e, n).dtype
    return e.op("Where", [e.cast(a["condition"], torch.bool), e.cast(a["self"], dtype), e.cast(a["other"], dtype)])


# -- matrix products ----------------------------------------------------------------

@_maps(aten.addmm.default)
def _addmm(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    dtype = _out(e, n).dtype
    if not dtype.is_floating_point:
        raise NotSupportedError("accel's ONNX emitter maps addmm on floats only")
    if a.get("alpha", 1) == 0:
        # torch's addmm then drops the product, NaN and inf in its factors with it
        # (its baddbmm does not); Gemm multiplies them by 0: refused, not emulated.
        raise NotSupportedError("accel's ONNX emitter maps no aten.addmm.default with alpha=0")
    inputs = [e.value(a["mat1"]), e.value(a["mat2"])]
    if a.get("beta", 1) != 0:
        inputs.append(e.value(a["self"]))
    return e.op("Gemm", inputs, alpha=float(a.get("alpha", 1)), beta=float(a.get("beta", 1)))


@_maps(aten.mm.default, aten.bmm.default)
def _matmul(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    return e.op("MatMul", [e.value(a["self"]), e.value(a["mat2"])])


@_maps(aten.baddbmm.default)
def _baddbmm(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    dtype = _out(e, n).dtype
    product = e.op("MatMul", [e.value(a["batch1"]), e.value(a["batch2"])])
    if a.get("alpha", 1) != 1:
        product = e.op("Mul", [product, e.scalar(a["alpha"], dtype)])
    if a.get("beta", 1) == 0:
        return product
    base = e.value(a["self"])
    if a.get("beta", 1) != 1:
        base = e.op("Mul", [base, e.scalar(a["beta"], dtype)])
    return e.op("Add", [product, base])


# -- shapes and views ---------------------------------------------------------------

@_maps(
    aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default, aten.squeeze.default,
    aten.squeeze.dim, aten.squeeze.dims, aten.alias.default, aten.detach.default, aten.clone.default,
    aten.expand.default,
    reshaping=[aten.unsqueeze_.default, aten.squeeze_.dim],
)
def _view(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    source = a["self"]
    shape = _out(e, n).shape
    if n.target is aten.expand.default:
        return e.op("Expand", [e.value(source), e.ints(shape)])
    return _reshape(e, e.value(source), shape, e.meta(source).shape)


@_maps(aten.t.default, aten.transpose.int, aten.permute.default,
       reshaping=[aten.t_.default, aten.transpose_.default])
def _transpose(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    source = a["self"]
    rank = e.meta(source).rank
    perm = list(range(rank))
    if n.target in (aten.t.default, aten.t_.default):
        perm.reverse()
    elif n.target is aten.permute.default:
        perm = [_dim(d, rank) for d in a["dims"]]
    else:
        d0, d1 = _dim(a["dim0"], rank), _dim(a["dim1"], rank)
        perm[d0], perm[d1] = perm[d1], perm[d0]
    if perm == list(range(rank)):
        return e.value(source)
    return e.op("Transpose", [e.value(source)], perm=perm)


@_maps(aten.select.int)
def _select(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    m = e.meta(a["self"])
    dim = _dim(a["dim"], m.rank)
    index = a["index"] + m.shape[dim] if a["index"] < 0 else a["index"]
    return e.op("Gather", [e.value(a["self"]), e.const(torch.tensor(index, dtype=torch.int64))], axis=dim)


@_maps(aten.slice.Tensor)
def _slice(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    m = e.meta(a["self"])
    dim = _dim(a.get("dim", 0), m.rank)
    start, end, step = slice(a.get("start"), a.get("end"), a.get("step", 1)).indices(m.shape[dim])
    end = max(end, start)
    return e.op("Slice", [e.value(a["self"]), e.ints([start]), e.ints([end]), e.ints([dim]), e.ints([step])])


@_maps(aten.split.Tensor, aten.unsafe_split.Tensor, aten.split_with_sizes.default,
       aten.unsafe_split_with_sizes.default, aten.unbind.int)
def _split(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> tuple[str, ...]:
    m = e.meta(a["self"])
    dim = _dim(a.get("dim", 0), m.rank)
    pieces = e.metas.get(n)
    if not isinstance(pieces, tuple) or not pieces:
        raise NotSupportedError(f"accel's ONNX emitter expected {n.target} to return tensors")
    if n.target is aten.unbind.int:
        outs = e.ops("Split", [e.value(a["self"]), e.ints([1] * len(pieces))], len(pieces), axis=dim)
        return tuple(e.op("Squeeze", [o, e.ints([dim])]) for o in outs)
    sizes = [p.shape[dim] for p in pieces]
    return tuple(e.ops("Split", [e.value(a["self"]), e.ints(sizes)], len(pieces), axis=dim))


@_maps(aten.cat.default, aten.stack.default)
def _cat(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    out = _out(e, n)
    dim = _dim(a.get("dim", 0), out.rank)
    parts = []
    for t in a["tensors"]:
        if n.target is aten.cat.default and e.meta(t).shape == (0,) and out.rank != 1:
            continue  # cat skips empty 1-d tensors (legacy)
        x = e.cast(t, out.dtype)
        parts.append(e.op("Unsqueeze", [x, e.ints([dim])]) if n.target is aten.stack.default else x)
    return e.op("Concat", parts, axis=dim)


@_maps(aten.zeros.default, aten.ones.default, aten.full.default, aten.scalar_tensor.default)
def _filled(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    out = _out(e, n)
    value = a.get("fill_value", a.get("s", 1 if n.target is aten.ones.default else 0))
    return e.const(torch.full(out.shape, value, dtype=out.dtype))


@_maps(aten._to_copy.default)
def _to_copy(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    if a.get("device") not in (None, torch.device("cpu")):
        raise NotSupportedError("accel's ONNX emitter maps _to_copy on the host only")
    return e.cast(a["self"], _out(e, n).dtype)


# -- reductions, normalization, pooling ----------------------------------------------

_REDUCE: dict[Any, str] = {aten.mean.dim: "ReduceMean", aten.sum.dim_IntList: "ReduceSum", aten.amax.default: "ReduceMax"}


@_maps(*_REDUCE)
def _reduce(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    m = e.meta(a["self"])
    out = _out(e, n)
    dims = a.get("dim")
    axes = list(range(m.rank)) if not dims else [_dim(d, m.rank) for d in dims]
    x = e.cast(a["self"], out.dtype)
    return e.op(_REDUCE[n.target], [x, e.ints(axes)], keepdims=int(bool(a.get("keepdim", False))))


@_maps(aten._softmax.default, aten._log_softmax.default)
def _softmax(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    if a.get("half_to_float"):
        raise NotSupportedError("accel's ONNX emitter maps no half-to-float softmax")
    m = e.meta(a["self"])
    kind = "LogSoftmax" if "log" in n.target._schema.name else "Softmax"  # type: ignore[union-attr]
    return e.op(kind, [e.cast(a["self"], _out(e, n).dtype)], axis=_dim(a["dim"], max(m.rank, 1)))


@_maps(aten.native_layer_norm.default)
def _layer_norm(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> tuple[Any, ...]:
    m = e.meta(a["input"])
    normalized = list(a["normalized_shape"])
    scale = (e.value(a["weight"]) if a.get("weight") is not None
             else e.const(torch.ones(normalized, dtype=m.dtype)))
    inputs = [e.value(a["input"]), scale] + ([e.value(a["bias"])] if a.get("bias") is not None else [])
    y = e.op("LayerNormalization", inputs, axis=-len(normalized), epsilon=float(a["eps"]))
    return y, _Missing("layer norm's mean"), _Missing("layer norm's rstd")


@_maps(aten.native_batch_norm.default)
def _batch_norm(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> tuple[Any, ...]:
    if a.get("training", False):
        raise NotSupportedError("accel's ONNX emitter maps batch norm in inference (eval) mode only")
    if a.get("running_mean") is None or a.get("running_var") is None:
        raise NotSupportedError("accel's ONNX emitter maps batch norm with running statistics only")
    m = e.meta(a["input"])
    channels = [m.shape[1]]
    scale = e.value(a["weight"]) if a.get("weight") is not None else e.const(torch.ones(channels, dtype=m.dtype))
    bias = e.value(a["bias"]) if a.get("bias") is not None else e.const(torch.zeros(channels, dtype=m.dtype))
    y = e.op("BatchNormalization",
             [e.value(a["input"]), scale, bias, e.value(a["running_mean"]), e.value(a["running_var"])],
             epsilon=float(a["eps"]))
    return y, _Missing("batch norm's saved mean"), _Missing("batch norm's saved inverse deviation")


@_maps(aten.convolution.default)
def _convolution(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    if a["transposed"]:
        raise NotSupportedError("accel's ONNX emitter maps no transposed convolution")
    spatial = e.meta(a["input"]).rank - 2
    padding = _spread(a["padding"], spatial)
    inputs = [e.value(a["input"]), e.value(a["weight"])] + ([e.value(a["bias"])] if a.get("bias") is not None else [])
    return e.op("Conv", inputs, strides=_spread(a["stride"], spatial), pads=padding + padding,
                dilations=_spread(a["dilation"], spatial), group=int(a["groups"]))


def _spread(values: Any, spatial: int) -> list[int]:
    """A pooling or convolution argument given as one number for every spatial dim, or one each."""
    listed = [int(values)] if isinstance(values, int) else [int(v) for v in values]
    return listed * spatial if len(listed) == 1 else listed


@_maps(aten.max_pool2d_with_indices.default)
def _max_pool(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> tuple[Any, ...]:
    kernel = _spread(a["kernel_size"], 2)
    stride = _spread(a["stride"], 2) if a.get("stride") else kernel
    padding = _spread(a.get("padding", 0), 2)
    window = {"kernel_shape": kernel, "strides": stride, "pads": padding + padding,
              "dilations": _spread(a.get("dilation", 1), 2), "ceil_mode": int(bool(a.get("ceil_mode", False)))}
    x = e.value(a["self"])
    y = e.op("MaxPool", [x], **window)
    # ONNX Runtime's MaxPool skips NaN and starts from the type's lowest finite
    # value: torch's max of a window holding NaN is NaN, of one all -inf is -inf.
    dtype = e.meta(a["self"]).dtype

    # The marks in float (ONNX Runtime's IsInf takes no half types; a half's
    # NaN and infinities stay what they are as a float).
    probe = x if dtype in (torch.float32, torch.float64) else e.op("Cast", [x], to=_onnx_type(torch.float32))

    def anywhere(mark: str) -> str:  # whether a window holds an element marked (a boolean tensor)
        found = e.op("MaxPool", [e.op("Cast", [mark], to=_onnx_type(torch.float32))], **window)
        return e.op("Cast", [found], to=_onnx_type(torch.bool))

    above = anywhere(e.op("Not", [e.op("IsInf", [probe], detect_negative=1, detect_positive=0)]))
    y = e.op("Where", [above, y, e.scalar(-math.inf, dtype)])
    y = e.op("Where", [anywhere(e.op("IsNaN", [probe])), e.scalar(math.nan, dtype), y])
    return y, _Missing("max pooling's indices")


@_maps(aten.avg_pool2d.default)
def _avg_pool(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    if a.get("divisor_override") is not None:
        raise NotSupportedError("accel's ONNX emitter maps no avg_pool2d divisor_override")
    kernel = _spread(a["kernel_size"], 2)
    stride = _spread(a["stride"], 2) if a.get("stride") else kernel
    padding = _spread(a.get("padding", 0), 2)
    return e.op("AveragePool", [e.value(a["self"])], kernel_shape=kernel, strides=stride, pads=padding + padding,
                ceil_mode=int(bool(a.get("ceil_mode", False))),
                count_include_pad=int(bool(a.get("count_include_pad", True))))


@_maps(aten.embedding.default)
def _embedding(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> str:
    # torch refuses a negative index; ONNX's Gather counts it from the end, a
    # row of the table served silently. Out of range, it fails as torch does.
    rows, kind = e.meta(a["weight"]).shape[0], e.meta(a["indices"]).dtype
    indices = e.value(a["indices"])
    negative = e.op("Less", [indices, e.scalar(0, kind)])
    indices = e.op("Where", [negative, e.scalar(rows, kind), indices])
    return e.op("Gather", [e.value(a["weight"]), indices], axis=0)


@_maps(aten._scaled_dot_product_flash_attention_for_cpu.default)
def _attention(e: _Emitter, n: fx.Node, a: dict[str, Any]) -> tuple[Any, ...]:
    if a.get("dropout_p", 0.0) != 0.0:
        raise NotSupportedError("accel's ONNX emitter maps attention without dropout only")
    q, k = e.meta(a["query"]), e.meta(a["key"])
    dtype = q.dtype
    scale = a.get("scale")
    scale = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    perm = list(range(k.rank))
    perm[-1], perm[-2] = perm[-2], perm[-1]
    scores = e.op("MatMul", [e.value(a["query"]), e.op("Transpose", [e.value(a["key"])], perm=perm)])
    scores = e.op("Mul", [scores, e.scalar(scale, dtype)])
    if a.get("is_causal", False):
        allowed = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = e.op("Add", [scores, e.const(torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed,
                                                                                               float("-inf")))])
    if a.get("attn_mask") is not None:  # additive: torch turns a boolean mask into one before this op
        scores = e.op("Add", [scores, e.cast(a["attn_mask"], dtype)])
    weights = e.op("Softmax", [scores], axis=-1)
    if a.get("is_causal", False) or a.get("attn_mask") is not None:
        # A query whose every key is masked attends to nothing in torch (zeros);
        # Softmax of a row all -inf is NaN. A NaN score still makes NaN (its max is NaN).
        peak = e.op("ReduceMax", [scores, e.ints([-1])], keepdims=1)
        masked = e.op("Equal", [peak, e.scalar(-math.inf, dtype)])
        weights = e.op("Where", [masked, e.scalar(0.0, dtype), weights])
    y = e.op("MatMul", [weights, e.value(a["value"])])
    return y, _Missing("attention's logsumexp")


# -- the graph ----------------------------------------------------------------------

def emit(gm: fx.GraphModule, inputs: Sequence[torch.Tensor]) -> bytes:
    """``gm`` (the compiled tier's FX graph) as a serialized ONNX model whose inputs
    are ``input_<i>`` and outputs ``gm``'s, in order. Refused
    (:class:`~accel.NotSupportedError` naming the op) where an op or an argument
    is not in the table; ``inputs`` are run through ``gm`` once, eagerly, for
    shapes and views."""
    from onnx import helper

    recorder = _Recorder(gm)
    with torch.inference_mode(False), torch.no_grad():
        recorder.run(*[t.detach().clone() for t in inputs])
    e = _Emitter(recorder)
    graph_inputs = []
    outputs: list[Any] = []
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            m = e.meta(n)
            e.keep(n, n.name)
            graph_inputs.append(helper.make_tensor_value_info(n.name, _onnx_type(m.dtype), list(m.shape)))
        elif n.op == "get_attr":
            e.keep(n, e.const(getattr(gm, n.target), n.name))
        elif n.op == "output":
            outputs = list(n.args[0]) if isinstance(n.args[0], (tuple, list)) else [n.args[0]]
        elif n.target is operator.getitem:
            source, index = n.args
            value = e.values.get(source)
            if source in e.stale:
                e.stale[n] = e.stale[source]
            e.keep(n, value[index] if isinstance(value, tuple) else _Missing(f"{source} item {index}"))
        elif n.op == "call_function":
            _call(e, n)
        else:
            raise NotSupportedError(f"accel's ONNX emitter takes no {n.op} node")
    graph_outputs = []
    finals = []
    for i, node in enumerate(outputs):
        m = e.meta(node)
        name = f"output_{i}"
        e.nodes.append(helper.make_node("Identity", [e.value(node)], [name]))
        finals.append(name)
        graph_outputs.append(helper.make_tensor_value_info(name, _onnx_type(m.dtype), list(m.shape)))
    nodes, initializers = _needed(e, finals)
    graph = helper.make_graph(nodes, "accel", graph_inputs, graph_outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="accel",
                              ir_version=_IR_VERSION)
    if model.ByteSize() > (1 << 31) - (1 << 20):
        raise NotSupportedError("the program's constants exceed ONNX's 2 GiB protobuf limit for accel's emitter")
    return bytes(model.SerializeToString())


def _call(e: _Emitter, n: fx.Node) -> None:
    schema = getattr(n.target, "_schema", None)
    if schema is not None and not n.users and not schema.is_mutable:
        return  # its result is never read (an allocation torch made on the side)
    fn = _TABLE.get(n.target)
    if fn is None:
        raise NotSupportedError(f"accel's ONNX emitter maps no {n.target}")
    if n in e.stale:
        raise NotSupportedError(f"accel's ONNX emitter does not follow {n.name} after {e.stale[n]} wrote it")
    result = fn(e, n, _args(n))
    e.keep(n, result)
    if n.target in _INPLACE:
        target = n.args[0]
        assert isinstance(target, fx.Node)
        if n.target not in _RESHAPING:
            e.wrote(target, n)
        # The written tensor now holds the result, laid out as the op left it.
        e.values[target] = result
        e.current[target] = e.metas[n]


def _needed(e: _Emitter, outputs: list[str]) -> tuple[list[Any], list[Any]]:
    """The nodes and initializers ``outputs`` depend on, in order (the rest: views
    and allocations nothing reads, which ONNX Runtime would warn about)."""
    wanted = set(outputs)
    kept = []
    for node in reversed(e.nodes):
        if wanted.intersection(node.output):
            kept.append(node)
            wanted.update(i for i in node.input if i)
    kept.reverse()
    return kept, [t for name, t in e.initializers.items() if name in wanted]
