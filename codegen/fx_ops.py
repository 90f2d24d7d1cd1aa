"""The per-op table of the FX -> MLIR emitter: one small function per core-ATen (or ctpu::) op, the walk
that emits a graph with it (`emit_module`), and what it refuses (`unsupported_reason`).

Each entry takes the emitter and the node's arguments (FX nodes already replaced by `TValue`s) and returns
the node's value. Composite ops are written as compositions of the emitter's building blocks, so they reach
MLIR as generics that the fusion pass can merge.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from codegen.attention import attention
from codegen.fx_to_mlir import DTYPES, BodyWriter, MlirEmitter, TValue, UnsupportedOp, affine_map
from device_sim.config import SMALL, HardwareConfig

aten = torch.ops.aten
Lowering = Callable[..., Any]
TABLE: dict[Any, Lowering] = {}


def _reg(*targets: Any) -> Callable[[Lowering], Lowering]:
    def deco(fn: Lowering) -> Lowering:
        for t in targets:
            TABLE[t] = fn
        return fn
    return deco


def lowering_of(node: torch.fx.Node) -> Lowering | None:
    fn = TABLE.get(node.target)
    if fn is None and isinstance(node.target, torch._ops.OpOverload) and node.target.namespace == "ctpu":
        fn = CTPU_TABLE.get(node.target.name().split("::")[-1].removesuffix(".default"))
    return fn


def lower_node(e: MlirEmitter, node: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
    fn = lowering_of(node)
    if fn is None:
        raise UnsupportedOp(f"FX node {node.name}: {node.target} has no CTPU lowering")
    args = torch.fx.node.map_arg(node.args, lambda n: env[n])
    kwargs = torch.fx.node.map_arg(node.kwargs, lambda n: env[n])
    try:
        return fn(e, *args, **kwargs)
    except UnsupportedOp as err:
        raise UnsupportedOp(f"FX node {node.name} ({node.target}): {err}") from None


def _norm_dim(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


# ---- elementwise ------------------------------------------------------------------------------------
def _promote(*operands: Any) -> str:
    """torch's result dtype for arithmetic on these operands (int64 is i32 here)."""
    dtypes = {o.dtype for o in operands if isinstance(o, TValue)}
    if "f32" in dtypes:
        return "f32"
    if "bf16" in dtypes:
        return "bf16"
    if any(isinstance(o, float) for o in operands):
        return "f32"
    return "i32" if "i32" in dtypes or any(isinstance(o, int) and not isinstance(o, bool) for o in operands) \
        else "i1"


def _binary(opname: str) -> Lowering:
    def lower(e: MlirEmitter, a: Any, b: Any, alpha: float = 1.0) -> TValue:
        dtype = _promote(a, b)
        if alpha != 1.0 and opname in ("arith.addf", "arith.subf") and dtype in ("f32", "bf16") and \
                isinstance(a, TValue) and isinstance(b, TValue):
            # a + alpha b rounded once, as the CPU computes it (fmadd): SGD's p.add_(g, alpha=-lr) is exact
            scale = alpha if opname == "arith.addf" else -alpha
            return e.elementwise([b, scale, a], lambda v, w: w.op("math.fma", v[0], v[1], v[2]), dtype=dtype)
        if alpha != 1.0:
            b = e.elementwise([b, alpha], lambda v, w: w.op("arith.mulf", v[0], v[1])) if isinstance(b, TValue) \
                else b * alpha
        if opname == "arith.divf" and dtype in ("i32", "i1"):
            dtype = "f32"  # true division
        return e.elementwise([a, b], lambda v, w: w.op(opname, v[0], v[1]), dtype=dtype)
    return lower


for _t, _op in [((aten.add.Tensor, aten.add.Scalar), "arith.addf"), ((aten.sub.Tensor, aten.sub.Scalar), "arith.subf"),
                ((aten.mul.Tensor, aten.mul.Scalar), "arith.mulf"), ((aten.div.Tensor, aten.div.Scalar), "arith.divf"),
                ((aten.maximum.default,), "arith.maximumf"), ((aten.minimum.default,), "arith.minimumf")]:
    _reg(*_t)(_binary(_op))


def _unary(fn: Callable[[str, BodyWriter], str]) -> Lowering:
    def lower(e: MlirEmitter, x: TValue) -> TValue:
        return e.elementwise([x], lambda v, w: fn(v[0], w))
    return lower


def _sigmoid(x: str, w: BodyWriter) -> str:
    one = w.const(1.0)
    return w.op("arith.divf", one, w.op("arith.addf", one, w.op("math.exp", w.op("arith.negf", x))))


def _gelu_tanh(x: str, w: BodyWriter) -> str:
    c = w.const(math.sqrt(2.0 / math.pi))
    inner = w.op("arith.mulf", c, w.op("arith.addf", x, w.op("arith.mulf", w.const(0.044715),
                                                             w.op("arith.mulf", x, w.op("arith.mulf", x, x)))))
    t = w.op("math.tanh", inner)
    return w.op("arith.mulf", w.op("arith.mulf", w.const(0.5), x), w.op("arith.addf", w.const(1.0), t))


_reg(aten.neg.default)(_unary(lambda x, w: w.op("arith.negf", x)))
_reg(aten.exp.default)(_unary(lambda x, w: w.op("math.exp", x)))
_reg(aten.tanh.default)(_unary(lambda x, w: w.op("math.tanh", x)))
_reg(aten.rsqrt.default)(_unary(lambda x, w: w.op("math.rsqrt", x)))
_reg(aten.sqrt.default)(_unary(lambda x, w: w.op("math.sqrt", x)))
_reg(aten.abs.default)(_unary(lambda x, w: w.op("math.absf", x)))
_reg(aten.reciprocal.default)(_unary(lambda x, w: w.op("arith.divf", w.const(1.0), x)))
_reg(aten.relu.default)(_unary(lambda x, w: w.op("arith.maximumf", x, w.const(0.0))))
_reg(aten.sigmoid.default)(_unary(_sigmoid))
_reg(aten.silu.default)(_unary(lambda x, w: w.op("arith.mulf", x, _sigmoid(x, w))))


def _sign(x: str, w: BodyWriter) -> str:
    """1, -1 or 0 as torch (ordered compares: NaN gives 0, -0.0 gives +0.0); integers exactly."""
    zero = w.const(0.0)
    return w.select(w.cmp("ogt", x, zero), w.const(1.0), w.select(w.cmp("olt", x, zero), w.const(-1.0), zero))


@_reg(aten.sign.default, aten.sgn.default)
def _sign_op(e: MlirEmitter, x: TValue) -> TValue:
    if x.dtype == "i1":
        raise UnsupportedOp("sign of a bool tensor")
    return e.elementwise([x], lambda v, w: _sign(v[0], w))


def _gelu_erf(x: str, w: BodyWriter) -> str:
    t = w.op("math.erf", w.op("arith.mulf", x, w.const(1.0 / math.sqrt(2.0))))
    return w.op("arith.mulf", w.op("arith.mulf", w.const(0.5), x), w.op("arith.addf", w.const(1.0), t))


_reg(aten.log.default)(_unary(lambda x, w: w.op("math.log", x)))
_reg(aten.sin.default)(_unary(lambda x, w: w.op("math.sin", x)))
_reg(aten.cos.default)(_unary(lambda x, w: w.op("math.cos", x)))
_reg(aten.erf.default)(_unary(lambda x, w: w.op("math.erf", x)))


@_reg(aten.gelu.default)
def _gelu(e: MlirEmitter, x: TValue, approximate: str = "none") -> TValue:
    return e.elementwise([x], lambda v, w: _gelu_tanh(v[0], w) if approximate == "tanh" else _gelu_erf(v[0], w))


@_reg(aten.clamp.default)
def _clamp(e: MlirEmitter, x: TValue, lo: float | None = None, hi: float | None = None) -> TValue:
    def fn(v: list[str], w: BodyWriter) -> str:
        r = v[0]
        if lo is not None:
            r = w.op("arith.maximumf", r, w.const(float(lo)))
        if hi is not None:
            r = w.op("arith.minimumf", r, w.const(float(hi)))
        return r
    return e.elementwise([x], fn)


@_reg(aten.clamp.Tensor)
def _clamp_tensor(e: MlirEmitter, x: TValue, lo: TValue | None = None, hi: TValue | None = None) -> TValue:
    """clamp with tensor bounds (what clamp_min / clamp_max of a tensor decompose to; AMSGrad's running max):
    NaN in x or a bound gives NaN, as eager; lo > hi gives hi."""
    bounds = [(b, op) for b, op in ((lo, "arith.maximumf"), (hi, "arith.minimumf")) if b is not None]

    def fn(v: list[str], w: BodyWriter) -> str:
        r = v[0]
        for value, (_, op) in zip(v[1:], bounds, strict=True):
            r = w.op(op, r, value)
        return r
    return e.elementwise([x, *(b for b, _ in bounds)], fn, dtype=_promote(x, *(b for b, _ in bounds)))


# ---- comparisons, masks, select (bool tensors are i1: 0 / ~0 lane masks on the CTPU) -------------------
def _compare(pred: str) -> Lowering:
    def lower(e: MlirEmitter, a: Any, b: Any) -> TValue:
        if _promote(a, b) == "bf16":  # eager compares in the tensor's dtype: a Python scalar is rounded to it
            a, b = (t if isinstance(t, TValue) else float(torch.tensor(t, dtype=torch.bfloat16)) for t in (a, b))
        return e.elementwise([a, b], lambda v, w: w.cmp(pred, v[0], v[1]), dtype="i1", result="i1")
    return lower


for _name, _pred in [("eq", "oeq"), ("ne", "une"), ("lt", "olt"), ("le", "ole"), ("gt", "ogt"), ("ge", "oge")]:
    _reg(getattr(aten, _name).Scalar, getattr(aten, _name).Tensor)(_compare(_pred))


@_reg(aten.isnan.default)
def _isnan(e: MlirEmitter, x: TValue) -> TValue:
    return e.elementwise([x], lambda v, w: w.cmp("une", v[0], v[0]), dtype="i1", result="i1")


def _logical(opname: str) -> Lowering:
    def lower(e: MlirEmitter, a: TValue, b: TValue) -> TValue:
        a, b = (_as_bool(e, t) for t in (a, b))
        return e.elementwise([a, b], lambda v, w: w.op(opname, v[0], v[1], dtype="i1"), dtype="i1", result="i1",
                             keep_bool=True)
    return lower


def _as_bool(e: MlirEmitter, x: TValue) -> TValue:
    return x if x.dtype == "i1" else e.elementwise([x], lambda v, w: w.cast(v[0], "f32", "i1"), dtype="i1",
                                                   result="i1")


_reg(aten.logical_and.default)(_logical("arith.andi"))
_reg(aten.logical_or.default)(_logical("arith.ori"))
_reg(aten.logical_xor.default)(_logical("arith.xori"))


def _bitwise(opname: str) -> Lowering:
    """On bools the logical op; on integers the bits (int32: int64 operands were narrowed at the boundary)."""
    logical = _logical(opname)

    def lower(e: MlirEmitter, a: Any, b: Any) -> TValue:
        promoted = _promote(a, b)
        if promoted == "i1":
            return logical(e, a, b if isinstance(b, TValue) else e.fill(float(bool(b)), (), "i1"))
        if promoted != "i32":
            raise UnsupportedOp(f"{opname} of floats")
        return e.elementwise([a, b], lambda v, w: w.op(opname, v[0], v[1], dtype="i32"), dtype="i32")
    return lower


_reg(aten.bitwise_and.Tensor, aten.bitwise_and.Scalar)(_bitwise("arith.andi"))
_reg(aten.bitwise_or.Tensor, aten.bitwise_or.Scalar)(_bitwise("arith.ori"))
_reg(aten.bitwise_xor.Tensor, aten.bitwise_xor.Scalar)(_bitwise("arith.xori"))


@_reg(aten.logical_not.default)
def _logical_not(e: MlirEmitter, x: TValue) -> TValue:
    x = _as_bool(e, x)
    return e.elementwise([x], lambda v, w: w.op("arith.xori", v[0], w.const_int(1, "i1"), dtype="i1"),
                         dtype="i1", result="i1", keep_bool=True)


@_reg(aten.bitwise_not.default)
def _bitwise_not(e: MlirEmitter, x: TValue) -> TValue:
    if x.dtype == "i1":
        return _logical_not(e, x)
    if x.dtype != "i32":
        raise UnsupportedOp(f"bitwise_not of {x.type}")
    return e.elementwise([x], lambda v, w: w.op("arith.xori", v[0], w.const_int(-1), dtype="i32"), dtype="i32")


@_reg(aten.where.self)
def _where(e: MlirEmitter, cond: TValue, a: Any, b: Any) -> TValue:
    """cond is an i1 lane mask (kept as one); bool values are selected as masks too (a bool result, as
    eager's), and with numbers they are 0.0 / 1.0 like every bool operand of arithmetic."""
    promoted = _promote(a, b)
    is_bool = [isinstance(t, TValue) and t.dtype == "i1" for t in (a, b)]
    if promoted == "i1":
        def pick(v: list[str], w: BodyWriter) -> str:
            x, y = (v[k] if isinstance(t, TValue) else w.const_int(int(t), "i1") for k, t in ((1, a), (2, b)))
            return w.select(v[0], x, y, "i1")

        return e.elementwise([_as_bool(e, cond), a, b], pick, dtype="i1", result="i1", keep_bool=True)

    def select(v: list[str], w: BodyWriter) -> str:
        x, y = (w.cast(v[k], "i1", "f32") if is_bool[k - 1] else v[k] for k in (1, 2))
        return w.select(v[0], x, y)

    dtypes = [t.dtype for t in (a, b) if isinstance(t, TValue)]
    # torch's promotion: integers stay integers (nll_loss' where(target != ignore, target, 0) is an index)
    dtype = "bf16" if dtypes and all(d == "bf16" for d in dtypes) else "i32" if promoted == "i32" else "f32"
    return e.elementwise([_as_bool(e, cond), a, b], select, dtype=dtype, keep_bool=True)


# ---- creation: arange, full --------------------------------------------------------------------------
def _creation_dtype(dtype: torch.dtype | None, *values: Any) -> str:
    if dtype is None:
        dtype = torch.float32 if any(isinstance(v, float) for v in values) else torch.int64
    if dtype not in DTYPES:
        raise UnsupportedOp(f"dtype {dtype}")
    return DTYPES[dtype]


@_reg(aten.arange.start_step, aten.arange.start, aten.arange.default)
def _arange(e: MlirEmitter, start: float, end: float | None = None, step: float = 1, dtype: Any = None,
            **_: Any) -> TValue:
    if end is None:
        start, end = 0, start
    out = _creation_dtype(dtype, start, end, step)
    n = max(0, math.ceil((end - start) / step))

    def fn(idx: list[str], w: BodyWriter) -> str:
        if out == "i32" and all(isinstance(v, int) for v in (start, step)):
            r = w.op("arith.muli", idx[0], w.const_int(int(step)), dtype="i32")
            return w.op("arith.addi", r, w.const_int(int(start)), dtype="i32")
        f = w.cast(idx[0], "i32", "f32")
        r = w.op("arith.addf", w.op("arith.mulf", f, w.const(float(step), "f32"), dtype="f32"),
                 w.const(float(start), "f32"), dtype="f32")
        return w.cast(r, "f32", out)

    return e.iota((n,), fn, out)


@_reg(aten.full.default)
def _full(e: MlirEmitter, size: Any, value: float, dtype: Any = None, **_: Any) -> TValue:
    return e.fill(value, tuple(int(s) for s in size), _creation_dtype(dtype, value))


@_reg(aten.full_like.default)
def _full_like(e: MlirEmitter, x: TValue, value: float, dtype: Any = None, **_: Any) -> TValue:
    return e.fill(value, x.shape, x.dtype if dtype is None else _creation_dtype(dtype, value))


# torch.empty's contents are unspecified: zeros are as good as any, and cost a fill. Lowered so that a buffer a
# graph makes and then overwrites (MoE routing's `inv_perm = empty(); inv_perm[perm] = arange`) never crosses
# from the CPU with garbage values (an int64 garbage value outside int32 sends the consumer to the CPU), and a
# buffer read only for its shape (AOT's SiLU backward on ctpu tensors: empty_permuted -> full_like) is dead code.
# The physical layout of empty_permuted / empty_strided is a memory order: values here are logical.
@_reg(aten.empty.memory_format, aten.empty_permuted.default, aten.empty_strided.default)
def _empty(e: MlirEmitter, size: Any, *_layout: Any, dtype: Any = None, **_: Any) -> TValue:
    return e.fill(0, tuple(int(s) for s in size), _creation_dtype(dtype or torch.get_default_dtype(), 0))


@_reg(aten.empty_like.default)
def _empty_like(e: MlirEmitter, x: TValue, dtype: Any = None, **_: Any) -> TValue:
    return e.fill(0, x.shape, x.dtype if dtype is None else _creation_dtype(dtype, 0))


@_reg(aten.new_empty.default)
def _new_empty(e: MlirEmitter, x: TValue, size: Any, dtype: Any = None, **_: Any) -> TValue:
    return e.fill(0, tuple(int(s) for s in size), x.dtype if dtype is None else _creation_dtype(dtype, 0))


@_reg(aten.scalar_tensor.default)
def _scalar_tensor(e: MlirEmitter, value: float, dtype: Any = None, **_: Any) -> TValue:
    return e.fill(value, (), _creation_dtype(dtype if dtype is not None else torch.float32, value))


# ---- gather, cat, select, split -------------------------------------------------------------------------
@_reg(aten.embedding.default)
def _embedding(e: MlirEmitter, weight: TValue, ids: TValue, padding_idx: int = -1, scale_grad: bool = False,
               sparse: bool = False) -> TValue:
    if ids.dtype != "i32" or len(weight.shape) != 2:
        raise UnsupportedOp(f"embedding of a {weight.type} table with {ids.type} indices")
    return e.gather_rows(weight, ids)


@_reg(aten.index.Tensor)
def _index(e: MlirEmitter, x: TValue, indices: Any) -> TValue:
    """x[.., idx, ..] with one integer index tensor at dim d (Falcon's `cos[position_ids]`, an inner dim's
    lookup): a row gather from x viewed as [prod(x.shape[:d+1]), rest], a negative index counted from the end
    as torch does (one outside [-size, size) traps, and the call runs on the CPU, where eager raises)."""
    given = [(d, t) for d, t in enumerate(indices) if t is not None]
    if len(given) != 1 or not isinstance(given[0][1], TValue) or given[0][1].dtype != "i32":
        raise UnsupportedOp("index with other than one integer index tensor")
    d, idx = given[0]
    return _gather_rows_at(e, x, d, idx, wrap=True)


@_reg(aten.index_select.default)
def _index_select(e: MlirEmitter, x: TValue, dim: int, index: TValue) -> TValue:
    """x's slices at `index` along any dim: index.Tensor's row gather; a 0-d index keeps the dim (size 1). No
    wrapping: a negative index traps, and the call runs on the CPU, where eager raises."""
    d = _norm_dim(dim, len(x.shape)) if x.shape else 0
    if not x.shape or index.dtype != "i32" or len(index.shape) > 1:
        raise UnsupportedOp(f"index_select of a {x.type} at a {index.type} along dim {dim}")
    index = index if index.shape else e.reshape(index, (1,))
    return _gather_rows_at(e, x, d, index, wrap=False)


def _gather_rows_at(e: MlirEmitter, x: TValue, d: int, idx: TValue, wrap: bool) -> TValue:
    """out[l.., j.., m.., c] = x[l.., idx[j..], m.., c] (shape x.shape[:d] + idx.shape + x.shape[d+1:]): one row
    gather of x viewed as [rows, last dim] at the row ((l * size + idx[j]) * prod(m) + m) for each (l, j, m)
    (rows of x's last dim, so the table and the result are x and the output with their leading dims merged:
    a gather of whole [m.., c] blocks would reshape them inside its load, which the kernel reader refuses).
    Along the last dim the rows are single elements. An index outside [0, size) (after wrapping a negative
    one when `wrap`) becomes the row -1, which the gather kernel poisons: the launch traps."""
    lead, size, rest = x.shape[:d], x.shape[d], x.shape[d + 1:]
    middle, width = (rest[:-1], rest[-1]) if rest else ((), 1)
    first_middle = len(lead) + len(idx.shape)
    rank = first_middle + len(middle)

    def row(args: list[str], w: BodyWriter) -> str:
        w.dtype = "i32"
        i = _wrapped_index(args[0], size, w) if wrap else args[0]

        def flat(acc: str, n: int, at: str) -> str:  # acc * n + at
            return w.op("arith.addi", w.op("arith.muli", acc, w.const_int(n), dtype="i32"), at, dtype="i32")

        r = w.const_int(0)
        for k, n in enumerate(lead):
            r = flat(r, n, w.index(k))
        r = flat(r, size, i)
        for k, n in enumerate(middle):
            r = flat(r, n, w.index(first_middle + k))
        return w.select(_in_range(i, size, w), r, w.const_int(-1), "i32")

    shape = (*lead, *idx.shape, *middle)
    idx_map = affine_map(rank, [f"d{k}" for k in range(len(lead), first_middle)])
    ids = e.generic([idx], [idx_map, affine_map(rank)], e.empty(shape, "i32"), ["parallel"] * rank, row)
    table = e.reshape(x, (math.prod(lead) * size * math.prod(middle), width))
    return e.reshape(e.gather_rows(table, ids), (*lead, *idx.shape, *rest))


def _checked_index(e: MlirEmitter, idx: TValue, size: int, wrap: bool) -> TValue:
    """idx (a negative index counted from the end when `wrap`), read back through a row gather of arange(size):
    the values are unchanged, but one outside [0, size) makes the launch trap (the gather kernel's check), so
    the ops indexing with the result never see an index out of range. The checked ids are a buffer of their
    own: fused into a consumer with more dims (index_put's accumulate reads them at every output element),
    the gather would run once per consumer element (15k instructions for 9 ids into 7 x 20)."""
    def wrapped(args: list[str], w: BodyWriter) -> str:
        w.dtype = "i32"
        return _wrapped_index(args[0], size, w) if wrap else args[0]

    rank = len(idx.shape)
    ids = e.generic([idx], [affine_map(rank), affine_map(rank)], e.empty(idx.shape, "i32"), ["parallel"] * rank,
                    wrapped)
    positions = e.iota((size, 1), lambda i, w: i[0], "i32")
    return e.fusion_barrier(e.reshape(e.gather_rows(positions, ids), idx.shape))


@_reg(aten.index_put.default)
def _index_put(e: MlirEmitter, x: TValue, indices: Any, values: Any, accumulate: bool = False) -> TValue:
    """x[:, .., idx, ...] = values with one 1-D index tensor at dim d (index_copy, a KV cache update): the
    rows at the T runtime positions, as one scatter into x's rows (its dims up to d merged), a negative
    position counted from the end as torch does; the kernel traps on a position outside [0, S) (the launch
    fails, as eager raises)."""
    given = [(d, t) for d, t in enumerate(indices) if t is not None]
    if len(given) != 1 or not isinstance(given[0][1], TValue):
        raise UnsupportedOp(f"index_put with {len(given)} index tensors (one, x[.., idx, ..] = v, is supported)")
    d, idx = given[0]
    if idx.dtype != "i32" or not idx.shape or (len(idx.shape) != 1 and d != 0):
        raise UnsupportedOp(f"index_put with a {idx.type} index at dim {d} (an integer tensor, 1-D unless at "
                            "dim 0)")
    if not isinstance(values, TValue) or values.dtype != x.dtype:
        raise UnsupportedOp(f"index_put of {getattr(values, 'type', values)} values into a {x.type}")
    lead, size, rest = x.shape[:d], x.shape[d], x.shape[d + 1:]
    n_rows = math.prod(idx.shape)
    target = (*lead, *idx.shape, *rest)
    if values.shape != target:
        try:
            torch.broadcast_shapes(values.shape, target)
        except RuntimeError:
            raise UnsupportedOp(f"index_put of {values.type} values into rows {list(target)}") from None
        values = _broadcast_to(e, values, target)
    if len(idx.shape) != 1:  # x[ids] with ids [B, L] (the embedding's backward): the rows in row-major order
        idx, values = e.reshape(idx, (n_rows,)), e.reshape(values, (n_rows, *rest))
    if accumulate:
        return _index_put_accumulate(e, x, d, idx, values)
    # one index per updated row: its row of x viewed [prod(lead) * size, *rest], (i_0, .., i_{d-1}) * size +
    # position, or -1 (which traps) for a position outside [0, size), which would name another row of the view.
    # The indices are lane-dense: rows of (i_0, .., position) took a vmem row each (a 1B prefill's KV update,
    # 16,384 rows: 47,325 cycles), and one component makes an address by one multiply (`isel_gather`)
    rank = d + 1
    lead_strides = [math.prod(lead[k + 1:]) * size for k in range(d)]

    def body(args: list[str], w: BodyWriter) -> str:
        w.dtype = "i32"
        position = _wrapped_index(args[0], size, w)
        row = position
        for k in range(d):
            row = w.op("arith.addi", row, w.op("arith.muli", w.index(k), w.const_int(lead_strides[k]),
                                                dtype="i32"), dtype="i32")
        return w.select(_in_range(position, size, w), row, w.const_int(-1), "i32")

    rows = e.generic([idx], [affine_map(rank, [f"d{d}"]), affine_map(rank)], e.empty((*lead, n_rows), "i32"),
                     ["parallel"] * rank, body)
    n = math.prod(lead) * n_rows
    out = e.scatter_rows(e.merge_leading(x, d + 1), e.reshape(rows, (n, 1)), e.reshape(values, (n, *rest)))
    return e.split_leading(out, x.shape)


def _broadcast_to(e: MlirEmitter, x: TValue, shape: tuple[int, ...]) -> TValue:
    """x expanded to `shape` by a copy (bits kept: no conversion through f32)."""
    lead = len(shape) - len(x.shape)
    return e.copy_map(x, shape, ["0" if s == 1 and shape[lead + i] != 1 else f"d{lead + i}"
                                 for i, s in enumerate(x.shape)])


@_reg(aten.copy_.default)
def _copy_(e: MlirEmitter, dst: TValue, src: Any, non_blocking: bool = False) -> TValue:
    """An input mutation (AOT autograd's trailing `copy_(input, new value)`): the new value is written
    into the input's own buffer, in place (the caller's tensor sees it; the runtime copies it back when
    the input was staged), and is the copy_'s value."""
    if dst not in e.arguments:
        raise UnsupportedOp("copy_ into a value that is not a graph input")
    index = e.arguments.index(dst)
    if any(i == index for i, _ in e.mutations):
        raise UnsupportedOp(f"input {index} is mutated twice")
    if not isinstance(src, TValue):
        src = e.fill(float(src), dst.shape, dst.dtype)
    if src.dtype != dst.dtype:
        src = e.elementwise([src], lambda v, w: v[0], dtype=dst.dtype, shape=src.shape)
    if src.shape != dst.shape:
        try:
            torch.broadcast_shapes(src.shape, dst.shape)
        except RuntimeError:
            raise UnsupportedOp(f"copy_ of a {src.type} into a {dst.type}") from None
        src = _broadcast_to(e, src, dst.shape)
    if src.name in e.split_from:
        merged, dims = e.split_from[src.name]
        out = e.split_leading(e.materialize(merged, e.merge_leading(dst, dims)), dst.shape)
    else:
        out = e.materialize(src, dst)
    e.mutations.append((index, out))
    return out


@_reg(aten.cat.default)
def _cat(e: MlirEmitter, tensors: Any, dim: int = 0) -> TValue:
    tensors = [t for t in tensors if isinstance(t, TValue)]
    # empty parts add nothing; when all are empty, concat of them is an empty result of the cat's shape
    parts = [t for t in tensors if math.prod(t.shape) > 0] or tensors
    if len(parts) == 1:
        return parts[0]
    return e.concat(parts, _norm_dim(dim, len(parts[0].shape)))


@_reg(aten.select.int)
def _select(e: MlirEmitter, x: TValue, dim: int, index: int) -> TValue:
    d = _norm_dim(dim, len(x.shape))
    index = index + x.shape[d] if index < 0 else index
    s = e.extract_slice(x, d, index, index + 1)
    return e.reshape(s, (*x.shape[:d], *x.shape[d + 1:]))


@_reg(aten.split.Tensor)
def _split(e: MlirEmitter, x: TValue, size: int, dim: int = 0) -> list[TValue]:
    d = _norm_dim(dim, len(x.shape))
    return [_slice(e, x, d, i, min(i + size, x.shape[d])) for i in range(0, x.shape[d], size)]


@_reg(aten.split_with_sizes.default)
def _split_with_sizes(e: MlirEmitter, x: TValue, sizes: Any, dim: int = 0) -> list[TValue]:
    d = _norm_dim(dim, len(x.shape))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [_slice(e, x, d, s, s + n) for s, n in zip(starts, sizes, strict=True)]


@_reg(aten.slice_scatter.default)
def _slice_scatter(e: MlirEmitter, x: TValue, src: TValue, dim: int = 0, start: Any = None, end: Any = None,
                   step: int = 1) -> TValue:
    """x with x[.., start:end, ..] = src (the backward of a slice): src inserted into x."""
    d = _norm_dim(dim, len(x.shape))
    size = x.shape[d]
    start = 0 if start is None else max(0, start + size if start < 0 else start)
    if step != 1:
        raise UnsupportedOp("slice_scatter with step != 1")
    if src.dtype != x.dtype:
        src = e.elementwise([src], lambda v, w: v[0], dtype=x.dtype)
    if src.shape == x.shape:
        return src
    return e.insert_slice(x, src, [start if i == d else 0 for i in range(len(x.shape))])


@_reg(aten.constant_pad_nd.default)
def _constant_pad_nd(e: MlirEmitter, x: TValue, pad: Any, value: float = 0.0) -> TValue:
    """x inside a fill of `value` (pad: (before, after) pairs from the last dim backwards)."""
    pad = [int(p) for p in pad]
    if any(p < 0 for p in pad):
        raise UnsupportedOp("constant_pad_nd with a negative pad (a crop)")
    rank = len(x.shape)
    before, shape = [0] * rank, list(x.shape)
    for k in range(len(pad) // 2):
        d = rank - 1 - k
        before[d] = pad[2 * k]
        shape[d] += pad[2 * k] + pad[2 * k + 1]
    return e.insert_slice(e.fill(float(value), tuple(shape), x.dtype), x, before)


@_reg(aten.gather.default)
def _gather(e: MlirEmitter, x: TValue, dim: int, index: TValue, sparse_grad: bool = False) -> TValue:
    """out[i] = x[i with i_dim = index[i]]: a row gather of x viewed as [numel, 1] at the flat position of
    each element (exact bits, any dtype). An index outside [0, size) (negative ones too, as eager) traps,
    and the call runs on the CPU, where eager raises."""
    rank = len(x.shape)
    d = _norm_dim(dim, rank)
    if index.dtype != "i32" or len(index.shape) != rank \
            or any(index.shape[k] > x.shape[k] for k in range(rank) if k != d):
        raise UnsupportedOp(f"gather of a {x.type} along dim {d} with a {index.type} index")
    size = x.shape[d]
    strides = [math.prod(x.shape[k + 1:]) for k in range(rank)]

    def position(a: list[str], w: BodyWriter) -> str:
        w.dtype = "i32"
        flat = w.op("arith.muli", a[0], w.const_int(strides[d]), dtype="i32")
        for k in range(rank):
            if k != d:
                flat = w.op("arith.addi", flat, w.op("arith.muli", w.index(k), w.const_int(strides[k]), dtype="i32"),
                            dtype="i32")
        return w.select(_in_range(a[0], size, w), flat, w.const_int(-1), "i32")

    pos = e.generic([index], [affine_map(rank), affine_map(rank)], e.empty(index.shape, "i32"),
                    ["parallel"] * rank, position)
    return e.reshape(e.gather_rows(e.reshape(x, (math.prod(x.shape), 1)), pos), index.shape)


def _wrapped_index(i: str, size: int, w: BodyWriter) -> str:
    """An i32 index with a negative one counted from the end, as torch's x[-1] (i + size when i < 0)."""
    return w.select(w.cmp("slt", i, w.const_int(0), "i32"), w.op("arith.addi", i, w.const_int(size), dtype="i32"),
                    i, "i32")


def _in_range(i: str, size: int, w: BodyWriter) -> str:
    """i1: 0 <= i < size for an i32 index."""
    return w.op("arith.andi", w.cmp("sge", i, w.const_int(0), "i32"), w.cmp("slt", i, w.const_int(size), "i32"),
                dtype="i1")


@_reg(aten.scatter.value)
def _scatter_value(e: MlirEmitter, x: TValue, dim: int, index: TValue, value: float) -> TValue:
    """x with x[i with i_dim = index[i]] = value, for an index of size 1 along dim and x's size elsewhere
    (the backward of nll_loss): one select per element. An index outside [0, size) traps (`_checked_index`),
    and the call runs on the CPU, where eager raises."""
    return _scatter_one_per_slice(e, x, dim, index, float(value))


@_reg(aten.scatter.src)
def _scatter_src(e: MlirEmitter, x: TValue, dim: int, index: TValue, src: TValue) -> TValue:
    """x with x[i with i_dim = index[i]] = src[i], for an index of size 1 along dim and x's size elsewhere, src
    of the index's shape (the backward of max.dim, kthvalue, median: one position per slice, so no two writes
    meet): one select per element. Float x and src."""
    if x.dtype not in ("f32", "bf16") or src.dtype not in ("f32", "bf16") or src.shape != index.shape:
        raise UnsupportedOp(f"scatter of a {src.type} into a {x.type} with a {index.type} index")
    return _scatter_one_per_slice(e, x, dim, index, src)


def _scatter_one_per_slice(e: MlirEmitter, x: TValue, dim: int, index: TValue, src: TValue | float) -> TValue:
    """out[o] = (o_dim == index[o; dim=0]) ? src (a value, or src[o; dim=0]) : x[o]."""
    rank = len(x.shape)
    d = _norm_dim(dim, rank)
    if index.dtype != "i32" or len(index.shape) != rank or index.shape[d] != 1 \
            or any(index.shape[k] != x.shape[k] for k in range(rank) if k != d):
        raise UnsupportedOp(f"scatter into a {x.type} with a {index.type} index (size 1 along dim {d} is supported)")
    index = _checked_index(e, index, x.shape[d], wrap=False)
    at_slice = affine_map(rank, ["0" if k == d else f"d{k}" for k in range(rank)])
    operands, maps = [x, index], [affine_map(rank), at_slice]
    if isinstance(src, TValue):
        operands.append(src)
        maps.append(at_slice)

    def body(a: list[str], w: BodyWriter) -> str:
        w.dtype = "f32"
        hit = w.cmp("eq", w.index(d), a[1], "i32")
        new = w.cast(a[2], src.dtype, "f32") if isinstance(src, TValue) else w.const(src)
        return w.cast(w.select(hit, new, w.cast(a[0], x.dtype, "f32")), "f32", x.dtype)

    return e.generic(operands, [*maps, affine_map(rank)], e.empty(x.shape, x.dtype), ["parallel"] * rank, body)


@_reg(aten.scatter_add.default)
def _scatter_add(e: MlirEmitter, x: TValue, dim: int, index: TValue, src: TValue) -> TValue:
    """x with src[p] added at p with p_dim = index[p] (gather's backward), duplicates summed: out[o] = x[o] +
    sum over k < index.shape[dim] of (index[o; dim=k] == o_dim ? src[o; dim=k] : -0.0), one reduction generic
    whose output starts as x (as index_put's accumulate). For an index of x's size off dim (src at least as
    large); float x and src. An index outside [0, size) traps (`_checked_index`), and the call runs on the
    CPU, where eager raises."""
    rank = len(x.shape)
    d = _norm_dim(dim, rank) if rank else 0
    if not rank or x.dtype not in ("f32", "bf16") or src.dtype not in ("f32", "bf16") or index.dtype != "i32" \
            or len(index.shape) != rank or len(src.shape) != rank \
            or any(index.shape[k] != x.shape[k] for k in range(rank) if k != d) \
            or any(src.shape[k] < index.shape[k] for k in range(rank)):
        raise UnsupportedOp(f"scatter_add into a {x.type} with a {index.type} index (x's size off dim {d} is "
                            "supported)")
    for k in range(rank):  # src's leading part of the index's shape
        src = e.extract_slice(src, k, 0, index.shape[k]) if src.shape[k] != index.shape[k] else src
    index = _checked_index(e, index, x.shape[d], wrap=False)
    at_k = [f"d{rank}" if k == d else f"d{k}" for k in range(rank)]  # x's dims, then k
    return _accumulate_where_hit(e, x, d, src, at_k, index, at_k)


def _accumulate_where_hit(e: MlirEmitter, x: TValue, d: int, updates: TValue, updates_map: list[str],
                          index: TValue, index_map: list[str]) -> TValue:
    """out[o] = x[o] + sum over n of (index[..n..] == o_d ? updates[..n..] : -0.0): one reduction generic over
    x's dims and n (iteration dim rank), whose output starts as x; the maps place updates and index in it."""
    rank = len(x.shape)
    maps = [affine_map(rank + 1, updates_map), affine_map(rank + 1, index_map),
            affine_map(rank + 1, [f"d{k}" for k in range(rank)])]
    init = e.elementwise([x], lambda v, w: v[0], dtype="f32") if x.dtype != "f32" else x

    def body(a: list[str], w: BodyWriter) -> str:
        w.dtype = "f32"
        hit = w.cmp("eq", w.index(d), a[1], "i32")
        # a miss adds -0.0, the identity of + (x + 0.0 would turn a -0 of x into +0)
        return w.op("arith.addf", w.select(hit, w.cast(a[0], updates.dtype, "f32"), w.const(-0.0)), a[2])

    out = e.generic([updates, index], maps, init, ["parallel"] * rank + ["reduction"], body)
    return e.elementwise([out], lambda v, w: v[0], dtype=x.dtype) if x.dtype != "f32" else out


def _index_put_accumulate(e: MlirEmitter, x: TValue, d: int, idx: TValue, values: TValue) -> TValue:
    """x[.., idx, ..] += values with duplicates summed (embedding's backward): out[.., v, ..] = x + sum over n
    of (idx[n] == v ? values[.., n, ..] : 0), one reduction generic whose output starts as x, exact in the
    sense that every update is added once. Costs x.numel() * n; a negative index counts from the end; an
    index outside [-size, size) traps (`_checked_index`), and the call runs on the CPU, where eager raises."""
    rank = len(x.shape)
    idx = _checked_index(e, idx, x.shape[d], wrap=True)
    vals_map = [f"d{rank}" if k == d else f"d{k}" for k in range(rank)]  # x's dims, then n
    return _accumulate_where_hit(e, x, d, values, vals_map, idx, [f"d{rank}"])


@_reg(aten.pow.Tensor_Scalar)
def _pow(e: MlirEmitter, x: TValue, p: float) -> TValue:
    if p in (2, 3, 4):
        return e.elementwise([x], lambda v, w: _product([v[0]] * int(p), w))
    if p == -1:
        return e.elementwise([x], lambda v, w: w.op("arith.divf", w.const(1.0), v[0]))
    if p == 0.5:
        return e.elementwise([x], lambda v, w: w.op("math.sqrt", v[0]))
    if p == -0.5:
        return e.elementwise([x], lambda v, w: w.op("math.rsqrt", v[0]))
    if p == 1:
        return x
    return _pow_general(e, x, float(p))


POW_BITS = 8  # integer exponents |y| < 2^8 by squaring: 2 ** -104 exact (exp(y log 2) is ~70 ulp off)


@_reg(aten.pow.Tensor_Tensor, aten.pow.Scalar)
def _pow_general(e: MlirEmitter, x: Any, y: Any) -> TValue:
    """x ** y elementwise (BLOOM's ALiBi slopes: base ** arange), torch's (C99's) special values exactly:
    a small integer exponent (|y| <= 255: x ** 0 = 1 for any x, a negative base's sign, ±0 and ±inf bases)
    by squaring, exact where the result is representable; otherwise exp(y log|x|) (a few ulp times
    |y log x|), with a finite negative base and a non-integer y NaN, (-x) ** odd = -(x ** odd), 1 ** y = 1
    and (-1) ** ±inf = 1."""
    dtype = _promote(x, y)
    if dtype not in ("f32", "bf16"):
        raise UnsupportedOp(f"pow of {dtype} values (integer pow)")

    def body(v: list[str], w: BodyWriter) -> str:
        b, n = v
        one, inf = w.const(1.0), w.const(math.inf)
        ab, an = w.op("math.absf", b), w.op("math.absf", n)
        big = w.cmp("oge", an, w.const(2.0**24))  # every float this large is an even integer (inf included)
        ni = w.cast(n, "f32", "i32")
        integral = w.op("arith.ori", big, w.cmp("oeq", w.cast(ni, "i32", "f32"), n), dtype="i1")
        odd = w.op("arith.andi", w.cmp("eq", w.op("arith.andi", ni, w.const_int(1), dtype="i32"), w.const_int(1),
                                       "i32"), w.op("arith.xori", big, w.const_int(1, "i1"), dtype="i1"), dtype="i1")
        odd = w.op("arith.andi", odd, integral, dtype="i1")  # 1.5 truncates to 1: not odd
        # by squaring: (1/x) ** |y| for y < 0 (no spurious overflow of x ** |y|; 1/±0 = ±inf keeps the sign)
        inv = w.op("arith.divf", one, b)
        base = w.select(w.cmp("olt", n, w.const(0.0)), inv, b)
        bits = w.cast(w.op("math.absf", n), "f32", "i32")
        p, sq = one, base
        for k in range(POW_BITS):
            hit = w.cmp("ne", w.op("arith.andi", bits, w.const_int(1 << k), dtype="i32"), w.const_int(0), "i32")
            p = w.select(hit, w.op("arith.mulf", p, sq), p)
            if k < POW_BITS - 1:
                sq = w.op("arith.mulf", sq, sq)
        small = w.op("arith.andi", integral, w.cmp("ole", an, w.const(2.0**POW_BITS - 1)), dtype="i1")
        # exp(y log|x|): the sign of a negative base (or -0) with an odd y; NaN for a finite negative base and
        # a non-integer y; |x| = 1 cases whose y log|x| would be 0 * inf
        r = w.op("math.exp", w.op("arith.mulf", n, w.op("math.log", ab)))
        negative = w.op("arith.ori", w.cmp("olt", b, w.const(0.0)), w.cmp("olt", inv, w.const(0.0)), dtype="i1")
        r = w.select(w.op("arith.andi", negative, odd, dtype="i1"), w.op("arith.negf", r), r)
        finite_neg = w.op("arith.andi", w.cmp("olt", b, w.const(0.0)), w.cmp("one", ab, inf), dtype="i1")
        nan = w.op("arith.andi", finite_neg, w.op("arith.xori", integral, w.const_int(1, "i1"), dtype="i1"),
                   dtype="i1")
        r = w.select(nan, w.const(math.nan), r)
        unit = w.op("arith.ori", w.cmp("oeq", b, one), w.op("arith.andi", w.cmp("oeq", ab, one),
                                                          w.cmp("oeq", an, inf), dtype="i1"), dtype="i1")
        r = w.select(unit, one, r)
        return w.select(small, p, r)

    return e.elementwise([x, y], body, dtype=dtype)


@_reg(aten._to_copy.default, aten.clone.default, aten.alias.default, aten.lift_fresh_copy.default)
def _copy(e: MlirEmitter, x: TValue, dtype: torch.dtype | None = None, **_: Any) -> TValue:
    if dtype is None or DTYPES.get(dtype) == x.dtype:
        return x
    if dtype not in DTYPES:
        raise UnsupportedOp(f"conversion to {dtype}")
    return e.elementwise([x], lambda v, w: v[0], dtype=DTYPES[dtype])  # bool arrives as 0.0 / 1.0


@_reg(torch.ops.prims.convert_element_type.default)  # what `dynamic=True` traces some casts to
def _convert_element_type(e: MlirEmitter, x: TValue, dtype: torch.dtype) -> TValue:
    return _copy(e, x, dtype)


# ---- reductions -------------------------------------------------------------------------------------
def _last_dim_only(x: TValue, dims: Any) -> None:
    dims = [dims] if isinstance(dims, int) else list(dims or range(len(x.shape)))
    if [_norm_dim(d, len(x.shape)) for d in dims] != [len(x.shape) - 1]:
        raise UnsupportedOp(f"reduction over dims {dims} of a rank-{len(x.shape)} tensor (only the last dim)")


def _reduced_dims(x: TValue, dims: Any) -> list[int]:
    """The dims a reduction's `dim` argument names (None or []: all of them, as torch reads it)."""
    rank = len(x.shape)
    dims = [dims] if isinstance(dims, int) else list(dims or range(rank))
    return sorted({_norm_dim(d, rank) for d in dims})


def _reduce(e: MlirEmitter, x: TValue, dims: Any, kind: str, keepdim: bool) -> TValue:
    """sum / max over any set of dims (the backward of a broadcast sums over batch dims)."""
    if not x.shape:
        return x
    reduced = _reduced_dims(x, dims)
    if any(x.shape[d] == 0 for d in reduced) and kind == "max":
        raise UnsupportedOp(f"max over an empty dim of a {x.type}")
    return e.reduce(x, reduced, kind, keepdim)


@_reg(aten.sum.dim_IntList)
def _sum(e: MlirEmitter, x: TValue, dims: Any, keepdim: bool = False, dtype: Any = None) -> TValue:
    """Accumulated in f32, converted to the result dtype: the input's, i32 for integers and bools (int64 in
    torch), or `dtype`. Bools count exactly (to 2^24 elements); integers are summed exactly by limbs."""
    target = _creation_dtype(dtype) if dtype is not None else "i32" if x.dtype in ("i1", "i32") else x.dtype
    if x.dtype == "i32" and target == "i32" and x.shape:
        count = math.prod(x.shape[d] for d in _reduced_dims(x, dims))
        return _by_limbs(e, x, count, lambda limb: _reduce(e, limb, dims, "sum", keepdim))
    out = _reduce(e, x, dims, "sum", keepdim)
    return e.elementwise([out], lambda v, w: v[0], dtype=target) if target != out.dtype else out


LIMB_BITS = (11, 11, 10)  # an i32 as three limbs: sums of up to 2^24 / 2^11 terms of each are exact in f32
MAX_LIMB_TERMS = 2 ** (24 - 11)


def _by_limbs(e: MlirEmitter, x: TValue, terms: int, total: Callable[[TValue], TValue]) -> TValue:
    """An exact integer sum (`total`: a sum of at most `terms` elements of its input, in f32) of i32 x: x
    split into limbs of 11, 11 and 10 bits (the top one signed), each limb's sum exact in f32, recombined in
    integer arithmetic (i32: it wraps above 2^31, where torch's int64 would not). Through f32 alone an
    integer above 2^24 lost its low bits."""
    if terms > MAX_LIMB_TERMS:
        raise UnsupportedOp(f"an integer sum of {terms} terms (exact up to {MAX_LIMB_TERMS})")
    acc = None
    shift = 0
    for k, bits in enumerate(LIMB_BITS):
        def limb(v: list[str], w: BodyWriter, shift: int = shift, bits: int = bits,
                 top: bool = k == len(LIMB_BITS) - 1) -> str:
            r = w.op("arith.shrsi", v[0], w.const_int(shift), dtype="i32") if shift else v[0]
            return r if top else w.op("arith.andi", r, w.const_int((1 << bits) - 1), dtype="i32")
        part = total(e.elementwise([x], limb, dtype="i32"))  # f32, exact
        scaled = e.elementwise([part], lambda v, w: v[0], dtype="i32")
        if shift:
            scaled = e.elementwise([scaled, 1 << shift], lambda v, w: w.op("arith.mulf", v[0], v[1]), dtype="i32")
        acc = scaled if acc is None else e.elementwise([acc, scaled], lambda v, w: w.op("arith.addf", v[0], v[1]),
                                                       dtype="i32")
        shift += bits
    assert acc is not None
    return acc


@_reg(aten.amax.default)
def _amax(e: MlirEmitter, x: TValue, dims: Any = (), keepdim: bool = False) -> TValue:
    out = _reduce(e, x, dims, "max", keepdim)
    return e.elementwise([out], lambda v, w: v[0], dtype=x.dtype) if x.dtype != out.dtype else out


@_reg(aten.max.dim)
def _max_dim(e: MlirEmitter, x: TValue, dim: int, keepdim: bool = False) -> tuple[TValue, TValue]:
    """(the maximum along dim, the index of its first occurrence), as torch: a NaN is the maximum and the
    first NaN's index the index. The index is size - 1 - max over k of (x[k] == max or x[k] is NaN ? size - 1
    - k : -1), a second f32 max-reduction (exact for sizes below 2^24)."""
    rank = len(x.shape)
    if not rank or x.dtype not in ("f32", "bf16"):
        raise UnsupportedOp(f"max along a dim of a {x.type}")
    d = _norm_dim(dim, rank)
    size = x.shape[d]
    top = _amax(e, x, [d], True)

    def reversed_hit(v: list[str], w: BodyWriter) -> str:
        hit = w.op("arith.ori", w.cmp("oeq", v[0], v[1]), w.cmp("une", v[0], v[0]), dtype="i1")
        k = w.cast(w.index(d), "i32", "f32")
        return w.select(hit, w.op("arith.subf", w.const(float(size - 1)), k), w.const(-1.0))

    last = _reduce(e, e.elementwise([x, top], reversed_hit, dtype="f32"), [d], "max", keepdim)
    index = e.elementwise([last], lambda v, w: w.op("arith.subf", w.const(float(size - 1)), v[0]), dtype="i32")
    return (top if keepdim else e.reshape(top, index.shape)), index


@_reg(aten.amin.default)
def _amin(e: MlirEmitter, x: TValue, dims: Any = (), keepdim: bool = False) -> TValue:
    """-amax(-x): negation is exact and keeps NaN, so the minimum and its NaN propagation are amax's."""
    if x.dtype not in ("f32", "bf16"):
        raise UnsupportedOp(f"amin of a {x.type}")
    neg = e.elementwise([x], lambda v, w: w.op("arith.negf", v[0]))
    return e.elementwise([_amax(e, neg, dims, keepdim)], lambda v, w: w.op("arith.negf", v[0]))


@_reg(aten.mean.default)
def _mean_all(e: MlirEmitter, x: TValue, dtype: Any = None) -> TValue:
    return _mean(e, x, None, False, dtype)


@_reg(aten.mean.dim)
def _mean(e: MlirEmitter, x: TValue, dims: Any, keepdim: bool = False, dtype: Any = None) -> TValue:
    if (dtype is not None and DTYPES.get(dtype) != "f32") or x.dtype not in ("f32", "bf16"):
        raise UnsupportedOp(f"mean of a {x.type} to {dtype}")
    count = math.prod(x.shape[d] for d in _reduced_dims(x, dims)) if x.shape else 1
    s = _reduce(e, x, dims, "sum", keepdim)
    return e.elementwise([s, float(count)], lambda v, w: w.op("arith.divf", v[0], v[1]), dtype=x.dtype)


@_reg(aten.any.dim, aten.any.dims, aten.any.default)
def _any(e: MlirEmitter, x: TValue, dims: Any = None, keepdim: bool = False) -> TValue:
    """Is any element nonzero (NaN is, -0 is not, as in torch) over trailing dims (all when None; [] none):
    0.0 / 1.0 flags, max-reduced one innermost dim at a time (the vector unit reduces only the innermost;
    a collapse into one dim folds back into a reduction over several), then > 0."""
    rank = len(x.shape)
    dims = range(rank) if dims is None else [dims] if isinstance(dims, int) else dims
    reduced = sorted({_norm_dim(d, rank) for d in dims})
    if reduced != list(range(rank - len(reduced), rank)):
        raise UnsupportedOp(f"any over dims {list(dims)} of a rank-{rank} tensor (only trailing dims)")
    if not reduced:  # x != 0
        return e.elementwise([x], lambda v, w: w.cast(v[0], "f32", "i1"), dtype="i1", result="i1")
    if not math.prod(x.shape):
        raise UnsupportedOp(f"any of an empty {x.type}")
    flags = e.elementwise([x], lambda v, w: w.cast(v[0], "f32", "i1"), dtype="f32", result="i1")
    for _ in reduced:
        flags = e.reduce_last(flags, "max", False)
    found = e.elementwise([flags], lambda v, w: w.cmp("ogt", v[0], w.const(0.0)), dtype="i1", result="i1")
    return e.reshape(found, (*found.shape, *[1] * len(reduced))) if keepdim else found


# A row whose sum of squares overflows fp32 is summed again scaled by SQ_SCALE: its largest |x| is at least
# 2^64 / sqrt(n), so the scaled squares neither overflow (n < 2^32) nor lose what matters to underflow.
SQ_SCALE = 2.0**-80
SQ_UNSCALE = 2.0**80  # applied twice: 2^160 is not an fp32 value


def _row_mean(e: MlirEmitter, x: TValue) -> TValue:
    """mean over the last dim (keepdim) that cannot overflow, refined once. The estimate m = sum(x 2^-p)
    (2^p / n), with 2^p >= n, is off by an ulp or two (2^p / n rounds unless n is a power of two), which a
    row of equal values turns into nonzero deviations: var 1.5e27 for a row of 3e20 (eager: 0), inf for a
    row of 3e38, a layer norm of +-1 instead of 0. The correction sum(x 2^-p - m 2^-p) (2^p / n) sums
    residuals that are exact near the mean (Sterbenz), so such a row's mean is its value and its
    deviations are 0; a row whose correction is not finite (inf or NaN in it) keeps m."""
    n = x.shape[-1]
    p = 2.0 ** math.ceil(math.log2(max(n, 1)))
    scaled = e.elementwise([x], lambda v, w: w.op("arith.mulf", v[0], w.const(1.0 / p)), dtype="f32")
    m = e.elementwise([e.reduce_last(scaled, "sum", True)], lambda v, w: w.op("arith.mulf", v[0], w.const(p / n)),
                      dtype="f32")
    residuals = e.elementwise([x, m], lambda v, w: w.op("arith.subf", w.op("arith.mulf", v[0], w.const(1.0 / p)),
                                                        w.op("arith.mulf", v[1], w.const(1.0 / p))), dtype="f32")

    def refine(v: list[str], w: BodyWriter) -> str:
        finite = w.cmp("olt", w.op("math.absf", v[1]), w.const(math.inf))
        return w.select(finite, w.op("arith.addf", v[0], w.op("arith.mulf", v[1], w.const(p / n))), v[0])

    return e.elementwise([m, e.reduce_last(residuals, "sum", True)], refine, dtype="f32")


Deviation = Callable[[list[str], BodyWriter, float], str]


def _deviation(centered: bool) -> Deviation:
    """(x - mean) scale from the body values [x, mean] (or x scale from [x]), as x scale - mean scale: finite
    even where x - mean overflows."""
    def dev(v: list[str], w: BodyWriter, scale: float) -> str:
        xv = v[0] if scale == 1.0 else w.op("arith.mulf", v[0], w.const(scale))
        if not centered:
            return xv
        m = v[1] if scale == 1.0 else w.op("arith.mulf", v[1], w.const(scale))
        return w.op("arith.subf", xv, m)
    return dev


def _sum_squares(e: MlirEmitter, ops: list[TValue], dev: Deviation) -> TValue:
    """sum(dev^2) over the last dim (keepdim). Each term is max(d d, 0) (the same value, NaN included): a
    reduction of the product of two values computed from two operands reads as a contraction to the
    kernel reader, which would run it on the MXU as a 1 x K x 1 matmul per row."""
    def term(v: list[str], w: BodyWriter) -> str:
        d = dev(v, w, 1.0)
        sq = _square(d, w)
        return w.op("arith.maximumf", sq, w.const(0.0)) if len(ops) > 1 else sq
    return e.reduce_last(e.elementwise(ops, term, dtype="f32"), "sum", True)


def _flagged_sum_squares(e: MlirEmitter, ops: list[TValue], ss: TValue, dev: Deviation) -> TValue:
    """One statistic per row (keepdim), Q: `ss` (= sum(dev(1)^2)) again where that is finite, else
    -sum(dev(SQ_SCALE)^2). Q < 0 flags the scaled sum, so a consumer reads one column, not two; the terms
    of the plain rows are ss's (same order, same bits)."""
    def term(v: list[str], w: BodyWriter) -> str:
        scaled = w.op("arith.negf", _square(dev(v[:-1], w, SQ_SCALE), w))
        return w.select(w.cmp("uge", v[-1], w.const(math.inf)), scaled, _square(dev(v[:-1], w, 1.0), w))
    return e.reduce_last(e.elementwise([*ops, ss], term, dtype="f32"), "sum", True)


def _row_sum_squares(e: MlirEmitter, x: TValue, mean: TValue | None) -> TValue:
    """Q (_flagged_sum_squares) of x - mean (mean None: of x)."""
    ops = [x] if mean is None else [x, mean]
    dev = _deviation(mean is not None)
    return _flagged_sum_squares(e, ops, _sum_squares(e, ops, dev), dev)


def _scaled(q: str, w: BodyWriter) -> str:
    """i1: the statistic is a scaled sum (Q < 0)."""
    return w.cmp("olt", q, w.const(0.0))


@_reg(aten.var.correction)
def _var(e: MlirEmitter, x: TValue, dims: Any = None, correction: float | None = None,
         keepdim: bool = False) -> TValue:
    """Stable at extreme magnitudes: the mean cannot overflow (_row_mean), and a row whose sum of squared
    deviations overflows takes its scaled sum (the variance itself may still be finite)."""
    _last_dim_only(x, dims)
    n = x.shape[-1]
    denom = float(max(n - (1 if correction is None else correction), 0))

    def var(v: list[str], w: BodyWriter) -> str:
        scaled = w.op("arith.divf", w.op("arith.negf", v[0]), w.const(denom))
        for _ in range(2):
            scaled = w.op("arith.mulf", scaled, w.const(SQ_UNSCALE))
        return w.select(_scaled(v[0], w), scaled, w.op("arith.divf", v[0], w.const(denom)))

    out = e.elementwise([_row_sum_squares(e, x, _row_mean(e, x))], var, dtype=x.dtype)
    return out if keepdim else e.reshape(out, x.shape[:-1])


def _square(x: str, w: BodyWriter) -> str:
    return w.op("arith.mulf", x, x)


@_reg(aten._softmax.default)
def _softmax(e: MlirEmitter, x: TValue, dim: int, half_to_float: bool = False) -> TValue:
    if not x.shape:
        raise UnsupportedOp("softmax of a 0-d tensor")
    return _softmax_over(e, x, _norm_dim(dim, len(x.shape)), safe=False)


@_reg(aten._log_softmax.default)
def _log_softmax(e: MlirEmitter, x: TValue, dim: int, half_to_float: bool = False) -> TValue:
    """x - max - log(sum(exp(x - max))) over `dim` (any: a reduction over it): a -inf entry stays -inf, a row
    of -inf only is NaN (as in torch); the largest entry's term is exp(0) = 1, so the log's argument is >= 1."""
    if not x.shape:
        raise UnsupportedOp("log_softmax of a 0-d tensor")
    d = _norm_dim(dim, len(x.shape))
    m = e.reduce(x, [d], "max", True)
    shifted = e.elementwise([x, m], lambda v, w: w.op("arith.subf", v[0], v[1]), dtype="f32")
    s = e.reduce(e.elementwise([shifted], lambda v, w: w.op("math.exp", v[0]), dtype="f32"), [d], "sum", True)
    return e.elementwise([shifted, s], lambda v, w: w.op("arith.subf", v[0], w.op("math.log", v[1])), dtype=x.dtype)


@_reg(aten._log_softmax_backward_data.default)
def _log_softmax_backward(e: MlirEmitter, grad: TValue, out: TValue, dim: int, input_dtype: Any) -> TValue:
    """grad - exp(out) * sum(grad) over dim (any dim: a reduction over it)."""
    d = _norm_dim(dim, len(out.shape))
    total = e.reduce(grad, [d], "sum", True)
    return e.elementwise([grad, out, total], lambda v, w: w.op(
        "arith.subf", v[0], w.op("arith.mulf", w.op("math.exp", v[1]), v[2])), dtype=_creation_dtype(input_dtype))


def _softmax_over(e: MlirEmitter, x: TValue, d: int, safe: bool) -> TValue:
    """Max-subtracted softmax over dim `d` (the last, or any: a reduction over it). A row of -inf only is NaN
    (-inf - -inf), as torch.softmax gives; with `safe` it is 0, as torch._safe_softmax (SDPA) gives. The row
    max is -inf exactly for such a row: vmax.f propagates NaN, so a row holding a NaN stays NaN, as in torch."""
    m = e.reduce(x, [d], "max", True)
    ex = e.elementwise([x, m], lambda v, w: w.op("math.exp", w.op("arith.subf", v[0], v[1])), dtype="f32")
    s = e.reduce(ex, [d], "sum", True)
    if not safe:
        return e.elementwise([ex, s], lambda v, w: w.op("arith.divf", v[0], v[1]), dtype=x.dtype)
    return e.elementwise([ex, s, m], lambda v, w: w.select(w.cmp("oeq", v[2], w.const(-math.inf)), w.const(0.0),
                                                           w.op("arith.divf", v[0], v[1])), dtype=x.dtype)


def _layer_norm(e: MlirEmitter, x: TValue, weight: TValue | None, bias: TValue | None, eps: float) -> TValue:
    return _layer_norm_with_stats(e, x, weight, bias, eps)[0]


def _layer_norm_with_stats(e: MlirEmitter, x: TValue, weight: TValue | None, bias: TValue | None,
                           eps: float) -> tuple[TValue, TValue, TValue]:
    """(y, mean, rstd), the statistics [.., 1] as native_layer_norm returns them for its backward (unused
    ones are dead code). y = (x - mean) rsqrt(var + eps) [* w] [+ b], stable at extreme magnitudes: the
    mean cannot overflow, and a row whose sum of squared deviations overflows is normalised from its
    deviations scaled by SQ_SCALE, x SQ_SCALE - mean SQ_SCALE (layer norm is scale invariant; eps SQ_SCALE^2
    underflows to 0 there).

    The deviations are one tensor, read by the flagged sum of squares and by the output (two consumers:
    not fused into either), so the output kernel reads one column (Q), as wide rows need."""
    n = float(x.shape[-1])
    mean = _row_mean(e, x)
    centered = _deviation(True)
    ss = _sum_squares(e, [x, mean], centered)
    dev = e.elementwise([x, mean, ss], lambda v, w: w.select(w.cmp("uge", v[2], w.const(math.inf)),
                                                             centered(v, w, SQ_SCALE), centered(v, w, 1.0)),
                        dtype="f32")
    q = _flagged_sum_squares(e, [dev], ss, lambda v, w, scale: v[0])  # dev is scaled already where it must be

    def normalise(v: list[str], w: BodyWriter) -> str:
        d, q = v
        ms = w.select(_scaled(q, w), w.op("arith.divf", w.op("arith.negf", q), w.const(n)),
                      w.op("arith.addf", w.op("arith.divf", q, w.const(n)), w.const(eps)))
        return w.op("arith.mulf", d, w.op("math.rsqrt", ms))

    y = e.elementwise([dev, q], normalise, dtype="f32")
    if weight is not None:
        y = e.elementwise([y, weight], lambda v, w: w.op("arith.mulf", v[0], v[1]), dtype="f32")
    if bias is not None:
        y = e.elementwise([y, bias], lambda v, w: w.op("arith.addf", v[0], v[1]), dtype="f32")

    def rstd(v: list[str], w: BodyWriter) -> str:  # a scaled row's variance is -Q / (n SQ_SCALE^2)
        scaled = w.op("arith.mulf", w.op("math.rsqrt", w.op("arith.divf", w.op("arith.negf", v[0]), w.const(n))),
                      w.const(SQ_SCALE))
        return w.select(_scaled(v[0], w), scaled, w.op("math.rsqrt", w.op("arith.addf", w.op(
            "arith.divf", v[0], w.const(n)), w.const(eps))))

    stats = [mean, e.elementwise([q], rstd, dtype="f32")]
    return tuple(e.elementwise([t], lambda v, w: v[0], dtype=x.dtype) if x.dtype != "f32" else t  # type: ignore
                 for t in (y, *stats))


@_reg(aten.native_layer_norm.default)
def _native_layer_norm(e: MlirEmitter, x: TValue, shape: Any, weight: Any, bias: Any, eps: float) -> tuple:
    if len(shape) != 1:
        raise UnsupportedOp("layer norm over more than the last dim")
    return _layer_norm_with_stats(e, x, weight, bias, eps)


def _rms_norm(e: MlirEmitter, x: TValue, weight: TValue | None, eps: float) -> TValue:
    """x rsqrt(mean(x^2) + eps) [* w]; a row whose sum of squares overflows is normalised from x SQ_SCALE
    (eps SQ_SCALE^2 underflows to 0 there). Over many rows of several vmem rows each the rsqrt is computed
    once a row, not once an element (two rsqrt sequences an element held a 2048-token prefill's norm at ~53
    bundles a vreg), behind a copy that keeps fusion from folding it back into the elementwise pass; a
    decode step's few rows keep it inline (a generic more in its norm chain cost more than it saved:
    `RMS_FACTOR_MIN_ROWS`). In a dynamic-shape bucket the factor's generic, as the others, computes only
    the valid rows (`compiler.bound_padded_rows`)."""
    n = float(x.shape[-1])
    q = _row_sum_squares(e, x, None)
    if math.prod(x.shape[:-1]) < RMS_FACTOR_MIN_ROWS or x.shape[-1] <= e.config.lanes:
        return _rms_norm_inline(e, x, q, weight, eps)

    def factor(v: list[str], w: BodyWriter) -> str:
        plain = w.op("math.rsqrt", w.op("arith.addf", w.op("arith.divf", v[0], w.const(n)), w.const(eps)))
        scaled = w.op("math.rsqrt", w.op("arith.divf", w.op("arith.negf", v[0]), w.const(n)))
        return w.select(_scaled(v[0], w), scaled, plain)

    def normalise(v: list[str], w: BodyWriter) -> str:
        xv, q, r = v[:3]
        from_x = w.select(_scaled(q, w), w.op("arith.mulf", xv, w.const(SQ_SCALE)), xv)
        return _product([w.op("arith.mulf", from_x, r), *v[3:]], w)

    r = e.fusion_barrier(e.elementwise([q], factor, dtype="f32"))
    ops = [x, q, r] + ([weight] if weight is not None else [])
    return e.elementwise(ops, normalise, dtype=x.dtype)


# rows from which an RMS norm computes its factor once a row (`_rms_norm`): a prefill's; not a decode step's
# one row a sequence (+44 cycles a step at 1024 positions with the factor's generic)
RMS_FACTOR_MIN_ROWS = 8


def _rms_norm_inline(e: MlirEmitter, x: TValue, q: TValue, weight: TValue | None, eps: float) -> TValue:
    """`_rms_norm` with the factor computed in the elementwise pass (the same bits)."""
    n = float(x.shape[-1])

    def normalise(v: list[str], w: BodyWriter) -> str:
        xv, q = v[:2]
        plain = w.op("arith.mulf", xv,
                     w.op("math.rsqrt", w.op("arith.addf", w.op("arith.divf", q, w.const(n)), w.const(eps))))
        scaled = w.op("arith.mulf", w.op("arith.mulf", xv, w.const(SQ_SCALE)),
                      w.op("math.rsqrt", w.op("arith.divf", w.op("arith.negf", q), w.const(n))))
        return _product([w.select(_scaled(q, w), scaled, plain), *v[2:]], w)

    return e.elementwise([x, q] + ([weight] if weight is not None else []), normalise, dtype=x.dtype)


def _product(v: list[str], w: BodyWriter) -> str:
    r = v[0]
    for x in v[1:]:
        r = w.op("arith.mulf", r, x)
    return r


# ---- matmul -----------------------------------------------------------------------------------------
@_reg(aten.mm.default, aten.bmm.default)
def _mm(e: MlirEmitter, a: TValue, b: TValue) -> TValue:
    return e.matmul(a, b, a.dtype)


@_reg(aten.addmm.default)
def _addmm(e: MlirEmitter, bias: TValue, a: TValue, b: TValue, beta: float = 1.0, alpha: float = 1.0) -> TValue:
    if beta != 1.0 or alpha != 1.0:
        raise UnsupportedOp("addmm with beta/alpha != 1")
    m = e.matmul(a, b, "f32")
    return e.elementwise([m, bias], lambda v, w: w.op("arith.addf", v[0], v[1]), dtype=a.dtype)


# ---- views ------------------------------------------------------------------------------------------
@_reg(aten.view.default, aten._unsafe_view.default, aten.reshape.default)
def _view(e: MlirEmitter, x: TValue, shape: Any) -> TValue:
    shape = list(shape)
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        shape[shape.index(-1)] = math.prod(x.shape) // known
    return e.reshape(x, tuple(shape))


@_reg(aten.unsqueeze.default)
def _unsqueeze(e: MlirEmitter, x: TValue, dim: int) -> TValue:
    d = _norm_dim(dim, len(x.shape) + 1)
    return e.reshape(x, (*x.shape[:d], 1, *x.shape[d:]))


@_reg(aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default)
def _squeeze(e: MlirEmitter, x: TValue, dims: Any = None) -> TValue:
    rank = len(x.shape)
    if dims is None:
        dims = range(rank)
    dims = {_norm_dim(d, rank) for d in ([dims] if isinstance(dims, int) else dims)}
    return e.reshape(x, tuple(s for i, s in enumerate(x.shape) if not (i in dims and s == 1)))


@_reg(aten.permute.default)
def _permute(e: MlirEmitter, x: TValue, perm: Any) -> TValue:
    perm = [_norm_dim(p, len(x.shape)) for p in perm]
    if perm == list(range(len(perm))):
        return x
    inverse = [perm.index(i) for i in range(len(perm))]
    return e.copy_map(x, tuple(x.shape[p] for p in perm), [f"d{inverse[i]}" for i in range(len(perm))])


@_reg(aten.transpose.int)
def _transpose(e: MlirEmitter, x: TValue, d0: int, d1: int) -> TValue:
    perm = list(range(len(x.shape)))
    a, b = _norm_dim(d0, len(perm)), _norm_dim(d1, len(perm))
    perm[a], perm[b] = perm[b], perm[a]
    return _permute(e, x, perm)


@_reg(aten.t.default)
def _t(e: MlirEmitter, x: TValue) -> TValue:
    return x if len(x.shape) < 2 else _permute(e, x, [1, 0])


@_reg(aten.expand.default)
def _expand(e: MlirEmitter, x: TValue, shape: Any) -> TValue:
    shape = tuple(int(s) for s in shape)
    shape = tuple(x.shape[i - (len(shape) - len(x.shape))] if s == -1 else s for i, s in enumerate(shape))
    if shape == x.shape:
        return x
    lead = len(shape) - len(x.shape)
    results = ["0" if (s == 1 and shape[lead + i] != 1) else f"d{lead + i}" for i, s in enumerate(x.shape)]
    return e.copy_map(x, shape, results)


@_reg(aten.slice.Tensor)
def _slice(e: MlirEmitter, x: TValue, dim: int = 0, start: Any = None, end: Any = None, step: int = 1) -> TValue:
    d = _norm_dim(dim, len(x.shape))
    size = x.shape[d]
    start = 0 if start is None else max(0, start + size if start < 0 else start)
    end = size if end is None else min(size, end + size if end < 0 else end)
    if end <= start:
        raise UnsupportedOp("an empty slice")
    if start == 0 and end == size and step == 1:
        return x
    return e.extract_slice(x, d, start, end, step)


@_reg(aten.repeat.default)
def _repeat(e: MlirEmitter, x: TValue, repeats: Any) -> TValue:
    """x tiled `repeats` times per dim: a broadcasting copy into [r0, s0, r1, s1, ..], then a free reshape."""
    repeats = [int(r) for r in repeats]
    sizes = (1,) * (len(repeats) - len(x.shape)) + x.shape
    x = e.reshape(x, sizes)
    tiled = e.copy_map(x, tuple(v for r, s in zip(repeats, sizes, strict=True) for v in (r, s)),
                       [f"d{2 * i + 1}" for i in range(len(sizes))])
    return e.reshape(tiled, tuple(r * s for r, s in zip(repeats, sizes, strict=True)))


@_reg(aten.cumsum.default)
def _cumsum(e: MlirEmitter, x: TValue, dim: int, dtype: Any = None) -> TValue:
    """Inclusive prefix sum along any dim d: out[.., j, ..] = sum over k <= j of x[.., k, ..], a reduction
    generic over (x's dims, k) reading x with k in place of d, the terms k > j selected away (f32 accumulation:
    integers exact below 2^24, and through limbs above; float sums in the reduction's pairwise order, not
    eager's sequential one). Quadratic in the length: meant for position ids, masks and their backward."""
    rank = len(x.shape)
    if not rank:
        raise UnsupportedOp("cumsum of a 0-d tensor")
    d = _norm_dim(dim, rank)
    out_dtype = _creation_dtype(dtype) if dtype is not None else x.dtype if x.dtype in ("f32", "bf16") else "i32"
    if x.dtype == "i32" and out_dtype == "i32":
        return _by_limbs(e, x, x.shape[d], lambda limb: _cumsum(e, limb, d, torch.float32))
    init = e.fill(0.0, x.shape, "f32")
    if d != rank - 1:  # a row gather (flip, index_select) fused in here would read its row at k, not at the
        x = e.fusion_barrier(x)  # innermost loop index: a load the kernel reader refuses

    def body(args: list[str], w: BodyWriter) -> str:
        keep = w.cmp("sle", w.index(rank), w.index(d), "i32")  # k <= j
        term = w.select(keep, w.cast(args[0], x.dtype, "f32"), w.const(0.0, "f32"))
        return w.op("arith.addf", term, args[1], dtype="f32")

    at_k = [f"d{rank}" if i == d else f"d{i}" for i in range(rank)]
    maps = [affine_map(rank + 1, at_k), affine_map(rank + 1, [f"d{i}" for i in range(rank)])]
    sums = e.generic([x], maps, init, ["parallel"] * rank + ["reduction"], body)
    return sums if out_dtype == "f32" else e.elementwise([sums], lambda v, w: v[0], dtype=out_dtype)


@_reg(aten.flip.default)
def _flip(e: MlirEmitter, x: TValue, dims: Any) -> TValue:
    """x reversed along `dims` (cumsum's backward flips, sums, flips back): per dim a row gather at the
    positions size - 1 - i (`_gather_rows_at`, exact bits of any dtype); an indexing map d -> size - 1 - d is
    one the kernel reader refuses."""
    for d in sorted({_norm_dim(int(k), len(x.shape)) for k in dims}):
        size = x.shape[d]
        reversed_positions = e.iota((size,), lambda i, w, n=size: w.op("arith.subi", w.const_int(n - 1), i[0],
                                                                         dtype="i32"), "i32")
        x = _gather_rows_at(e, x, d, reversed_positions, wrap=False)
    return x


# ---- ctpu fused ops (docs/fused_ops.md), by their decomposition -------------------------------------
ACTIVATIONS: dict[str, Callable[[str, BodyWriter], str]] = {
    "none": lambda x, w: x,
    "relu": lambda x, w: w.op("arith.maximumf", x, w.const(0.0)),
    "silu": lambda x, w: w.op("arith.mulf", x, _sigmoid(x, w)),
    "gelu": _gelu_erf,
    "gelu_tanh": _gelu_tanh,
}


def _activation(act: str) -> Callable[[str, BodyWriter], str]:
    if act not in ACTIVATIONS:
        raise UnsupportedOp(f"activation {act!r}")
    return ACTIVATIONS[act]


def _linear(e: MlirEmitter, x: TValue, w: TValue, bias: TValue | None, act: str,
            residual: TValue | None) -> TValue:
    """act(x @ w + bias) + residual: one matmul (fp32 accumulation) and one fused epilogue generic."""
    k, n = w.shape
    lead = x.shape[:-1]
    m = e.matmul(e.reshape(x, (math.prod(lead), k)), w, "f32")
    m = e.reshape(m, (*lead, n))
    fn = _activation(act)
    ops: list[TValue] = [m] + [t for t in (bias, residual) if t is not None]
    out_dtype = x.dtype if x.dtype == w.dtype else "f32"

    def epilogue(v: list[str], wr: BodyWriter) -> str:
        y = wr.op("arith.addf", v[0], v[1]) if bias is not None else v[0]
        y = fn(y, wr)
        return wr.op("arith.addf", y, v[-1]) if residual is not None else y

    if bias is None and residual is None and act == "none" and out_dtype == "f32":
        return m
    return e.elementwise(ops, epilogue, dtype=out_dtype)


def _swiglu(e: MlirEmitter, gate: TValue, up: TValue, act: str) -> TValue:
    fn = _activation(act)
    return e.elementwise([gate, up], lambda v, w: w.op("arith.mulf", fn(v[0], w), v[1]))


def _rope(e: MlirEmitter, x: TValue, cos: TValue, sin: TValue) -> TValue:
    """x * cos + cat(-x2, x1) * sin over the last dim."""
    d = len(x.shape) - 1
    half = x.shape[-1] // 2
    x1, x2 = e.extract_slice(x, d, 0, half), e.extract_slice(x, d, half, x.shape[-1])
    rotated = e.concat([e.elementwise([x2], lambda v, w: w.op("arith.negf", v[0])), x1], d)
    return e.elementwise([x, cos, rotated, sin], lambda v, w: w.op(
        "arith.addf", w.op("arith.mulf", v[0], v[1]), w.op("arith.mulf", v[2], v[3])))


# Looked up by name when a node calls a ctpu:: op: the ops are registered by fx_passes (a layer above
# codegen), so codegen does not import them.
CTPU_TABLE: dict[str, Lowering] = {
    "rms_norm": lambda e, x, weight, eps: _rms_norm(e, x, weight, eps),
    "layer_norm": lambda e, x, weight, bias, eps: _layer_norm(e, x, weight, bias, eps),
    "softmax": lambda e, x, dim: _softmax(e, x, dim),
    "linear": _linear,
    "swiglu": _swiglu,
    "rope": _rope,
    "attention": attention,
}


# ---- the graph walk ---------------------------------------------------------------------------------
def emit_module(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor],
                config: HardwareConfig = SMALL) -> tuple[str, list[TValue], list[TValue]]:
    """Returns (module text, argument values, result values) for the graph, built for `config`."""
    e = MlirEmitter(config)
    env: dict[torch.fx.Node, object] = {}
    args = e.arguments
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, example in zip(placeholders, example_inputs, strict=True):
        v = TValue(f"%arg{len(args)}", tuple(example.shape), _input_dtype(node.name, example.dtype, example.dim()))
        args.append(v)
        env[node] = v
    results: list[TValue] = []
    for node in gm.graph.nodes:
        if node.op in ("call_function",):
            if node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]  # type: ignore[index]
                continue
            first = len(e.lines)
            env[node] = lower_node(e, node, env)
            _locate(e.lines, first, node)
        elif node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            for o in outs:
                v = env[o]
                if not isinstance(v, TValue):
                    raise UnsupportedOp(f"output {o}: not a tensor")
                results.append(v)
        elif node.op != "placeholder":
            raise UnsupportedOp(f"FX node {node.name}: op kind {node.op} (call_module: lower FusedGroup "
                                f"submodules by inlining them first)")
    # the mutated inputs' new values are returned after the outputs: bufferized, each is its input's buffer
    return e.module(args, [*results, *(v for _, v in e.mutations)]), args, results


def _locate(lines: list[str], first: int, node: torch.fx.Node) -> None:
    """Give the top-level ops of `lines[first:]` (what `node` emitted) the MLIR location
    `loc("node name"("module path"))`: upstream passes keep it (a fused generic keeps its consumer's), so each
    kernel can name the FX node and nn.Module it came from (the profiler's spans). An op with a region takes
    its location after the region's closing line."""
    where = f'"{_loc_text(node.name)}"'
    module = module_path(node)
    if module:
        where += f'("{_loc_text(module)}")'
    depth = 0
    for i in range(first, len(lines)):
        line = lines[i]
        if line.startswith("}"):
            depth -= 1
        if depth == 0 and not line.endswith("{"):
            lines[i] = f"{line} loc({where})"
        if line.endswith("{"):
            depth += 1


def module_path(node: torch.fx.Node) -> str:
    """The nn.Module a node came from, as a dotted path ("model.layers.0.mlp.up_proj"), from dynamo's
    `nn_module_stack`; "" when unknown (a graph traced without dynamo)."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return ""
    path = str(list(stack.values())[-1][0])
    return _ROOT.sub(lambda m: "" if m.group(1) in ("self", "fn") else m.group(1), path).removeprefix(".")


# dynamo's name of the module's root: L['self'] (a compiled module), L['fn'] (a module called through the
# compiled wrapper); a module passed in by another name keeps it (L['model'].layers.0 -> model.layers.0)
_ROOT = re.compile(r"^[LG]\['([^']*)'\]")


def _loc_text(text: str) -> str:
    return text.replace("\\", "/").replace('"', "'")


def unsupported_reason(node: torch.fx.Node) -> str | None:
    """Why the CTPU code generator cannot lower this compute node (None: it can), decided by the same
    table and argument checks `emit_module` runs: the node is emitted alone, its inputs standing for
    themselves. The partitioner asks this, so placement and lowering never disagree."""
    if node.op != "call_function":
        return f"op kind {node.op}"
    if node.target is operator.getitem:
        return None
    if lowering_of(node) is None:
        return f"{node.target} has no CTPU lowering"
    if _float64(node) or (any(_float64(n) for n in node.all_input_nodes) and not _cast(node)):
        return "float64 arithmetic (the CTPU computes in float32)"
    e = MlirEmitter()
    try:
        env = {n: _standin(e, n) for n in node.all_input_nodes}
        e.arguments.extend(v for n, v in env.items() if n.op == "placeholder" and isinstance(v, TValue))
        lower_node(e, node, env)
    except UnsupportedOp as err:
        return str(err)
    except Exception as err:  # an argument the lowering did not expect: it cannot lower it either
        return f"{node.target}: {type(err).__name__}: {err}"
    return None


def _float64(node: torch.fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype == torch.float64


def _cast(node: torch.fx.Node) -> bool:
    """A cast to a float dtype of the CTPU: of a float64 0-d input (dynamo's `dynamic=True` passes a model's
    float attributes, eps, as such), the one use of float64 that rounds the same when the input is narrowed
    to float32 at the launch."""
    return node.target in (aten._to_copy.default, torch.ops.prims.convert_element_type.default) \
        and not _float64(node) and DTYPES.get(node.meta["val"].dtype) in ("f32", "bf16") \
        and all(n.meta["val"].dim() == 0 for n in node.all_input_nodes if _float64(n))


def _input_dtype(name: str, dtype: torch.dtype, dims: int) -> str:
    """The CTPU dtype of a graph input: a float64 0-d input is narrowed to float32 at the launch (read only
    by casts to float32 or bf16: `unsupported_reason`)."""
    if dtype == torch.float64 and dims == 0:
        return "f32"
    if dtype not in DTYPES:
        raise UnsupportedOp(f"input {name}: dtype {dtype} (supported: {', '.join(map(str, DTYPES))})")
    return DTYPES[dtype]


def _standin(e: MlirEmitter, node: torch.fx.Node) -> object:
    """The emitter's value for an input node, from its fake value (tensors, tuples of them, scalars)."""
    def one(val: object) -> object:
        if isinstance(val, torch.Tensor):
            return TValue(e.fresh(), tuple(int(s) for s in val.shape), _input_dtype(node.name, val.dtype, val.dim()))
        return val
    value = node.meta.get("val")
    if isinstance(value, (tuple, list)):
        return [one(v) for v in value]
    if value is None:
        raise UnsupportedOp(f"input {node.name} has no example value")
    return one(value)
