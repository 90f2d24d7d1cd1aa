"""The per-op table of the FX -> MLIR emitter: one small function per core-ATen (or ctpu::) op.

Each entry takes the emitter and the node's arguments (FX nodes already replaced by `TValue`s) and returns
the node's value. Composite ops are written as compositions of the emitter's building blocks, so they reach
MLIR as generics that the fusion pass can merge.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
import torch.fx

from codegen.fx_to_mlir import DTYPES, BodyWriter, MlirEmitter, TValue, UnsupportedOp

aten = torch.ops.aten
Lowering = Callable[..., Any]
TABLE: dict[Any, Lowering] = {}


def _reg(*targets: Any) -> Callable[[Lowering], Lowering]:
    def deco(fn: Lowering) -> Lowering:
        for t in targets:
            TABLE[t] = fn
        return fn
    return deco


def lower_node(e: MlirEmitter, node: torch.fx.Node, env: dict[torch.fx.Node, Any]) -> Any:
    fn = TABLE.get(node.target)
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
def _binary(opname: str) -> Lowering:
    def lower(e: MlirEmitter, a: Any, b: Any, alpha: float = 1.0) -> TValue:
        if alpha != 1.0:
            b = e.elementwise([b, alpha], lambda v, w: w.op("arith.mulf", v[0], v[1])) if isinstance(b, TValue) \
                else b * alpha
        return e.elementwise([a, b], lambda v, w: w.op(opname, v[0], v[1]))
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


@_reg(aten.gelu.default)
def _gelu(e: MlirEmitter, x: TValue, approximate: str = "none") -> TValue:
    if approximate != "tanh":
        raise UnsupportedOp("gelu with approximate='none' (erf) is not implemented; use approximate='tanh'")
    return e.elementwise([x], lambda v, w: _gelu_tanh(v[0], w))


@_reg(aten.pow.Tensor_Scalar)
def _pow(e: MlirEmitter, x: TValue, p: float) -> TValue:
    if p == 2:
        return e.elementwise([x], lambda v, w: w.op("arith.mulf", v[0], v[0]))
    if p == 0.5:
        return e.elementwise([x], lambda v, w: w.op("math.sqrt", v[0]))
    if p == -0.5:
        return e.elementwise([x], lambda v, w: w.op("math.rsqrt", v[0]))
    if p == 1:
        return x
    raise UnsupportedOp(f"pow with exponent {p}")


@_reg(aten._to_copy.default, aten.clone.default, aten.alias.default)
def _copy(e: MlirEmitter, x: TValue, dtype: torch.dtype | None = None, **_: Any) -> TValue:
    if dtype is None or DTYPES.get(dtype) == x.dtype:
        return x
    if dtype not in DTYPES:
        raise UnsupportedOp(f"conversion to {dtype}")
    return e.elementwise([x], lambda v, w: v[0], dtype=DTYPES[dtype])


# ---- reductions -------------------------------------------------------------------------------------
def _last_dim_only(x: TValue, dims: Any) -> None:
    dims = [dims] if isinstance(dims, int) else list(dims or range(len(x.shape)))
    if [_norm_dim(d, len(x.shape)) for d in dims] != [len(x.shape) - 1]:
        raise UnsupportedOp(f"reduction over dims {dims} of a rank-{len(x.shape)} tensor (only the last dim)")


@_reg(aten.sum.dim_IntList)
def _sum(e: MlirEmitter, x: TValue, dims: Any, keepdim: bool = False, dtype: Any = None) -> TValue:
    _last_dim_only(x, dims)
    return e.reduce_last(x, "sum", keepdim)


@_reg(aten.amax.default)
def _amax(e: MlirEmitter, x: TValue, dims: Any = (), keepdim: bool = False) -> TValue:
    _last_dim_only(x, dims)
    return e.reduce_last(x, "max", keepdim)


@_reg(aten.mean.dim)
def _mean(e: MlirEmitter, x: TValue, dims: Any, keepdim: bool = False, dtype: Any = None) -> TValue:
    _last_dim_only(x, dims)
    s = e.reduce_last(x, "sum", keepdim)
    return e.elementwise([s, float(x.shape[-1])], lambda v, w: w.op("arith.divf", v[0], v[1]))


@_reg(aten._softmax.default)
def _softmax(e: MlirEmitter, x: TValue, dim: int, half_to_float: bool = False) -> TValue:
    if _norm_dim(dim, len(x.shape)) != len(x.shape) - 1:
        raise UnsupportedOp("softmax over a dim other than the last")
    m = e.reduce_last(x, "max", True)
    ex = e.elementwise([x, m], lambda v, w: w.op("math.exp", w.op("arith.subf", v[0], v[1])), dtype="f32")
    s = e.reduce_last(ex, "sum", True)
    return e.elementwise([ex, s], lambda v, w: w.op("arith.divf", v[0], v[1]), dtype=x.dtype)


def _layer_norm(e: MlirEmitter, x: TValue, weight: TValue | None, bias: TValue | None, eps: float) -> TValue:
    n = float(x.shape[-1])
    mean = e.elementwise([e.reduce_last(x, "sum", True), n], lambda v, w: w.op("arith.divf", v[0], v[1]))
    xc = e.elementwise([x, mean], lambda v, w: w.op("arith.subf", v[0], v[1]), dtype="f32")
    var = e.elementwise([e.reduce_last(e.elementwise([xc], lambda v, w: w.op("arith.mulf", v[0], v[0])), "sum", True),
                         n], lambda v, w: w.op("arith.divf", v[0], v[1]))
    rstd = e.elementwise([var, eps], lambda v, w: w.op("math.rsqrt", w.op("arith.addf", v[0], v[1])))
    y = e.elementwise([xc, rstd], lambda v, w: w.op("arith.mulf", v[0], v[1]), dtype="f32")
    if weight is not None:
        y = e.elementwise([y, weight], lambda v, w: w.op("arith.mulf", v[0], v[1]), dtype="f32")
    if bias is not None:
        y = e.elementwise([y, bias], lambda v, w: w.op("arith.addf", v[0], v[1]), dtype="f32")
    return e.elementwise([y], lambda v, w: v[0], dtype=x.dtype) if x.dtype != "f32" else y


@_reg(aten.native_layer_norm.default)
def _native_layer_norm(e: MlirEmitter, x: TValue, shape: Any, weight: Any, bias: Any, eps: float) -> tuple:
    if len(shape) != 1:
        raise UnsupportedOp("layer norm over more than the last dim")
    return (_layer_norm(e, x, weight, bias, eps), None, None)


def _rms_norm(e: MlirEmitter, x: TValue, weight: TValue | None, eps: float) -> TValue:
    sq = e.elementwise([x], lambda v, w: w.op("arith.mulf", v[0], v[0]), dtype="f32")
    ms = e.elementwise([e.reduce_last(sq, "sum", True), float(x.shape[-1])],
                       lambda v, w: w.op("arith.divf", v[0], v[1]))
    rstd = e.elementwise([ms, eps], lambda v, w: w.op("math.rsqrt", w.op("arith.addf", v[0], v[1])))
    ops = [x, rstd] + ([weight] if weight is not None else [])
    return e.elementwise(ops, lambda v, w: _product(v, w), dtype=x.dtype)


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
    if step != 1:
        raise UnsupportedOp("slice with step != 1")
    if start == 0 and end == size:
        return x
    shape = (*x.shape[:d], end - start, *x.shape[d + 1:])
    out = TValue(e.fresh(), shape, x.dtype)
    offs = ", ".join(str(start if i == d else 0) for i in range(len(shape)))
    sizes = ", ".join(str(s) for s in shape)
    ones = ", ".join("1" for _ in shape)
    e.lines.append(f"{out.name} = tensor.extract_slice {x.name}[{offs}] [{sizes}] [{ones}] : {x.type} to {out.type}")
    return out


# ---- ctpu fused ops (docs/fused_ops.md), by their decomposition -------------------------------------
def _register_ctpu_ops() -> None:
    ns = getattr(torch.ops, "ctpu", None)
    if ns is None:
        return
    table = {
        "rms_norm": lambda e, x, weight, eps: _rms_norm(e, x, weight, eps),
        "layer_norm": lambda e, x, weight, bias, eps: _layer_norm(e, x, weight, bias, eps),
        "softmax": lambda e, x, dim: _softmax(e, x, dim),
    }
    for name, fn in table.items():
        try:
            op = getattr(ns, name)
        except (AttributeError, RuntimeError):
            continue
        TABLE[op.default] = fn


_register_ctpu_ops()
