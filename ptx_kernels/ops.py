"""Per-op lowering rules of the fusion generator: FX node -> a few fp32 PTX instructions.

Booleans live in registers as fp32 0.0/1.0, integers (int32/int64: positions, indices) as s64, floats as
fp32; an op's operands are converted to the register form of its result dtype the way torch promotes
(int + float -> float, comparisons of two integers stay integer). bf16 intermediates (convert_element_type
to bf16) are rounded to bf16 where eager PyTorch would round, so parity holds node by node. Targets are
recognised by name, so core-ATen overloads (aten.add.Tensor), torch functions (torch.exp), Python
operators (operator.add) and tensor methods (x.sum) all map onto the same rules.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx
from pyptx import ptx, reg
from pyptx.reg import Reg
from pyptx.types import f32, pred, s64

from ptx_kernels import mathops as m
from ptx_kernels.core import INT_DTYPES, fconst, fimm, round_to_bf16

REDUCTIONS = {"sum", "mean", "amax", "amin"}
REDUCTION_INIT = {"sum": 0.0, "mean": 0.0, "amax": float("-inf"), "amin": float("inf")}
# Ops that move no data inside a fused kernel: the value per element (or per row) is unchanged.
VIEWS = {
    "view",
    "reshape",
    "_unsafe_view",
    "unsqueeze",
    "squeeze",
    "clone",
    "alias",
    "contiguous",
    "expand",
    "detach",
}
_OPERATORS = {
    operator.add: "add",
    operator.sub: "sub",
    operator.mul: "mul",
    operator.truediv: "div",
    operator.neg: "neg",
    operator.pow: "pow",
    operator.gt: "gt",
    operator.lt: "lt",
    operator.ge: "ge",
    operator.le: "le",
    operator.eq: "eq",
    operator.ne: "ne",
    abs: "abs",
}


def op_name(node: torch.fx.Node) -> str:
    """'add' for aten.add.Tensor, torch.add, operator.add and x.add alike."""
    target = node.target
    if node.op == "call_method":
        return str(target)
    if target in _OPERATORS:
        return _OPERATORS[target]
    packet = getattr(target, "overloadpacket", None)
    if packet is not None:
        return packet.__name__
    return getattr(target, "__name__", str(target))


def _kw(node: torch.fx.Node, name: str, position: int, default: object) -> object:
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[position] if len(node.args) > position else default


def is_reduction(node: torch.fx.Node) -> bool:
    return op_name(node) in REDUCTIONS


def reduction_kind(node: torch.fx.Node) -> str:
    return op_name(node)


def _check_reduction(node: torch.fx.Node) -> None:
    src = node.all_input_nodes[0]
    rank = len(src.meta["tensor_meta"].shape)
    dims = _kw(node, "dim", 1, None)
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if [d % rank for d in dims] != [rank - 1]:
        raise NotImplementedError(
            f"FX node {node.name}: {op_name(node)} over dims {dims}; only the last dim "
            "is generated (other reductions need a transpose first)"
        )
    if op_name(node) in ("sum", "mean") and _kw(node, "dtype", 3, None) not in (None, torch.float32):
        raise NotImplementedError(f"FX node {node.name}: {op_name(node)} with dtype= is not generated")


def check(node: torch.fx.Node) -> None:
    """Raise NotImplementedError naming the node when the generator has no rule for it."""
    name = op_name(node)
    if name not in RULES and name not in REDUCTIONS and name not in VIEWS and name not in INDEXING:
        raise NotImplementedError(
            f"FX node {node.name}: op {name!r} ({node.target}) has no PTX lowering rule"
        )
    if name in REDUCTIONS:
        _check_reduction(node)
    if name == "div" and _kw(node, "rounding_mode", 2, None) is not None:
        raise NotImplementedError(f"FX node {node.name}: div with rounding_mode is not generated")
    dtype = node.meta["tensor_meta"].dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.bool, *INT_DTYPES):
        raise NotImplementedError(f"FX node {node.name}: result dtype {dtype} (fp32, bf16, bool, int32/64)")
    if dtype in INT_DTYPES and name not in INT_RULES and name not in VIEWS and name not in INDEXING:
        raise NotImplementedError(f"FX node {node.name}: op {name!r} on integers has no PTX lowering rule")


def finish_value(value: Reg, dtype: torch.dtype) -> Reg:
    """Round a freshly computed fp32 value the way eager would store it in `dtype`."""
    if dtype == torch.bfloat16:
        return round_to_bf16(value)
    if dtype == torch.bool:
        return m.compare("ne", value, fconst(0.0))
    return value


def to_f32(value: Reg) -> Reg:
    if value.dtype != s64:
        return value
    out = m.new()
    ptx.inst.cvt.rn.f32.s64(out, value)
    return out


def to_s64(value: Reg | int | float | bool) -> Reg:
    out = reg.scalar(s64)
    if isinstance(value, (bool, int, float)):
        ptx.inst.mov.s64(out, int(value))
    elif value.dtype == s64:
        return value
    else:  # float or bool (0.0/1.0): truncate toward zero, like a torch cast
        ptx.inst.cvt.rzi.s64.f32(out, value)
    return out


def _is_int(value: object) -> bool:
    return (isinstance(value, Reg) and value.dtype == s64) or (
        isinstance(value, int) and not isinstance(value, bool)
    )


def emit(node: torch.fx.Node, args: list, dtype: torch.dtype) -> Reg:
    """Emit the node's instructions; args are Regs (f32 or s64), Python scalars, or raw Python values."""
    name = op_name(node)
    if name in VIEWS:
        return args[0]
    if dtype in INT_DTYPES:
        if name in CONVERTS:
            return to_s64(args[0])
        ints = [to_s64(a) if isinstance(a, (Reg, bool, int, float)) else a for a in args]
        return INT_RULES[name](node, ints)
    tensors = [a for a in args if isinstance(a, Reg)]
    if name in COMPARISONS and tensors and all(_is_int(a) for a in args[:2]):
        return _int_compare(name, to_s64(args[0]), to_s64(args[1]))
    floats = [
        fconst(float(a)) if isinstance(a, (bool, int, float)) else to_f32(a) if isinstance(a, Reg) else a
        for a in args
    ]
    return finish_value(RULES[name](node, floats), dtype)


COMPARISONS = {"gt", "lt", "ge", "le", "eq", "ne"}
CONVERTS = {"convert_element_type", "_to_copy", "to", "type_as", "float", "bfloat16", "long", "int"}
# Ops that read their operands at other positions than the output element (generator.py lowers them).
INDEXING = {"permute", "transpose", "t", "slice", "select", "cat", "embedding", "arange", "full",
            "scalar_tensor", "zeros", "ones", "new_zeros", "new_ones", "full_like", "zeros_like", "ones_like"}


def _int_compare(name: str, a: Reg, b: Reg) -> Reg:
    p = reg.scalar(pred)
    getattr(ptx.inst.setp, name).s64(p, a, b)
    out = m.new()
    ptx.inst.selp.f32(out, fimm(1.0), fimm(0.0), p)
    return out


def _int_binary(op: str) -> Callable[[torch.fx.Node, list], Reg]:
    def rule(node: torch.fx.Node, args: list) -> Reg:
        out = reg.scalar(s64)
        b = args[1]
        alpha = node.kwargs.get("alpha", 1)
        if op in ("add", "sub") and alpha != 1:
            scaled = reg.scalar(s64)
            ptx.inst.mul.lo.s64(scaled, b, int(alpha))
            b = scaled
        if op == "mul":
            ptx.inst.mul.lo.s64(out, args[0], b)
        else:
            getattr(ptx.inst, op).s64(out, args[0], b)
        return out

    return rule


def _int_unary(op: str) -> Callable[[torch.fx.Node, list], Reg]:
    def rule(node: torch.fx.Node, args: list) -> Reg:
        out = reg.scalar(s64)
        getattr(ptx.inst, op).s64(out, args[0])
        return out

    return rule


def _int_where(node: torch.fx.Node, args: list) -> Reg:
    cond = reg.scalar(pred)
    ptx.inst.setp.ne.s64(cond, args[0], 0)
    out = reg.scalar(s64)
    ptx.inst.selp.s64(out, args[1], args[2], cond)
    return out


INT_RULES: dict[str, Callable[[torch.fx.Node, list], Reg]] = {
    "add": _int_binary("add"),
    "sub": _int_binary("sub"),
    "mul": _int_binary("mul"),
    "maximum": _int_binary("max"),
    "minimum": _int_binary("min"),
    "neg": _int_unary("neg"),
    "abs": _int_unary("abs"),
    "where": _int_where,
    **{c: lambda n, a: a[0] for c in CONVERTS},
}


def _logical(op: str) -> Callable[[torch.fx.Node, list], Reg]:
    """and/or/xor of 0/1 values (bool tensors): on the predicates, back to 0.0/1.0."""

    def rule(node: torch.fx.Node, args: list) -> Reg:
        pa = reg.scalar(pred)
        ptx.inst.setp.neu.f32(pa, args[0], fimm(0.0))
        pb = reg.scalar(pred)
        ptx.inst.setp.neu.f32(pb, args[1], fimm(0.0))
        getattr(ptx.inst, f"{op}_" if op in ("and", "or") else op).pred(pa, pa, pb)
        out = reg.scalar(f32)
        ptx.inst.selp.f32(out, fimm(1.0), fimm(0.0), pa)
        return out

    return rule


def _logical_not(node: torch.fx.Node, args: list) -> Reg:
    return m.compare("eq", args[0], fimm(0.0))


def _clamp(node: torch.fx.Node, args: list) -> Reg:
    lo = _kw(node, "min", 1, None)
    hi = _kw(node, "max", 2, None)
    out = args[0]
    if lo is not None:
        out = m.binary("max", out, args[1] if isinstance(lo, torch.fx.Node) else fimm(float(lo)))
    if hi is not None:
        out = m.binary("min", out, args[2] if isinstance(hi, torch.fx.Node) else fimm(float(hi)))
    return out


def _pow(node: torch.fx.Node, args: list) -> Reg:
    exponent = node.args[1]
    base = args[0]
    if isinstance(exponent, torch.fx.Node):
        return m.exp(m.binary("mul", args[1], m.log(base)))
    e = float(exponent)
    if e == 0.5:
        return m.sqrt(base)
    if e == -0.5:
        return m.rsqrt(base)
    if e.is_integer() and abs(e) <= 8:
        # Square-and-multiply keeps x^2 exact-as-eager (eager computes x*x for integer powers too).
        result, power, n = None, base, int(abs(e))
        while n:
            if n & 1:
                result = power if result is None else m.binary("mul", result, power)
            n >>= 1
            if n:
                power = m.binary("mul", power, power)
        result = result if result is not None else fconst(1.0)
        return m.div(fimm(1.0), result) if e < 0 else result
    # x^e = 2^(e * log2 x) for x > 0, as torch returns NaN for negative bases with fractional exponents.
    lg = m.new()
    ptx.inst.lg2.approx.f32(lg, base)
    scaled = m.binary("mul", lg, fimm(e))
    out = m.new()
    ptx.inst.ex2.approx.f32(out, scaled)
    return out


def _add_sub(op: str) -> Callable[[torch.fx.Node, list], Reg]:
    def rule(node: torch.fx.Node, args: list) -> Reg:
        alpha = node.kwargs.get("alpha", 1)
        b = args[1] if alpha == 1 else m.binary("mul", args[1], fimm(float(alpha)))
        return m.binary(op, args[0], b)

    return rule


def _convert(node: torch.fx.Node, args: list) -> Reg:
    # The rounding itself happens in finish_value from the node's result dtype.
    return args[0]


def _gelu(node: torch.fx.Node, args: list) -> Reg:
    approx = node.kwargs.get("approximate", "none")
    return m.gelu_tanh(args[0]) if approx == "tanh" else m.gelu(args[0])


def _nan_minmax(op: str) -> Callable[[torch.fx.Node, list], Reg]:
    def rule(node: torch.fx.Node, args: list) -> Reg:
        out = m.new()
        # torch.maximum/minimum propagate NaN; plain max.f32 would return the other operand.
        getattr(ptx.inst, op).NaN.f32(out, args[0], args[1])
        return out

    return rule


RULES: dict[str, Callable[[torch.fx.Node, list], Reg]] = {
    "add": _add_sub("add"),
    "sub": _add_sub("sub"),
    "rsub": lambda n, a: m.binary("sub", a[1], a[0]),
    "mul": lambda n, a: m.binary("mul", a[0], a[1]),
    "div": lambda n, a: m.div(a[0], a[1]),
    "true_divide": lambda n, a: m.div(a[0], a[1]),
    "reciprocal": lambda n, a: m.div(fimm(1.0), a[0]),
    "neg": lambda n, a: m.neg(a[0]),
    "abs": lambda n, a: m.abs_(a[0]),
    "exp": lambda n, a: m.exp(a[0]),
    "log": lambda n, a: m.log(a[0]),
    "tanh": lambda n, a: m.tanh(a[0]),
    "sigmoid": lambda n, a: m.sigmoid(a[0]),
    "relu": lambda n, a: m.relu(a[0]),
    "silu": lambda n, a: m.silu(a[0]),
    "gelu": _gelu,
    "erf": lambda n, a: m.erf(a[0]),
    "rsqrt": lambda n, a: m.rsqrt(a[0]),
    "sqrt": lambda n, a: m.sqrt(a[0]),
    "pow": _pow,
    "square": lambda n, a: m.binary("mul", a[0], a[0]),
    "maximum": _nan_minmax("max"),
    "minimum": _nan_minmax("min"),
    "where": lambda n, a: m.select(a[0], a[1], a[2]),
    "gt": lambda n, a: m.compare("gt", a[0], a[1]),
    "lt": lambda n, a: m.compare("lt", a[0], a[1]),
    "ge": lambda n, a: m.compare("ge", a[0], a[1]),
    "le": lambda n, a: m.compare("le", a[0], a[1]),
    "eq": lambda n, a: m.compare("eq", a[0], a[1]),
    "ne": lambda n, a: m.compare("ne", a[0], a[1]),
    "cos": lambda n, a: m.cos(a[0]),
    "sin": lambda n, a: m.sin(a[0]),
    "logical_and": _logical("and"),
    "logical_or": _logical("or"),
    "logical_xor": _logical("xor"),
    "bitwise_and": _logical("and"),
    "bitwise_or": _logical("or"),
    "bitwise_xor": _logical("xor"),
    "logical_not": _logical_not,
    "bitwise_not": _logical_not,
    "clamp": _clamp,
    "clamp_min": lambda n, a: m.binary("max", a[0], a[1]),
    "clamp_max": lambda n, a: m.binary("min", a[0], a[1]),
    **{c: _convert for c in ("convert_element_type", "_to_copy", "to", "type_as", "float", "bfloat16")},
}

__all__ = ["INDEXING", "INT_RULES", "REDUCTIONS", "RULES", "VIEWS", "check", "emit", "is_reduction", "op_name"]
