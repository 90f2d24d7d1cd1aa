"""Per-op lowering rules of the fusion generator: FX node -> a few fp32 PTX instructions.

Booleans live in registers as fp32 0.0/1.0; bf16 intermediates (convert_element_type to bf16) are rounded
to bf16 where eager PyTorch would round, so parity holds node by node. Targets are recognised by name, so
core-ATen overloads (aten.add.Tensor), torch functions (torch.exp), Python operators (operator.add) and
tensor methods (x.sum) all map onto the same rules.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.fx
from pyptx import ptx
from pyptx.reg import Reg

from ptx_kernels import mathops as m
from ptx_kernels.core import fconst, fimm, round_to_bf16

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
    if name not in RULES and name not in REDUCTIONS and name not in VIEWS:
        raise NotImplementedError(
            f"FX node {node.name}: op {name!r} ({node.target}) has no PTX lowering rule"
        )
    if name in REDUCTIONS:
        _check_reduction(node)
    if name == "div" and _kw(node, "rounding_mode", 2, None) is not None:
        raise NotImplementedError(f"FX node {node.name}: div with rounding_mode is not generated")
    dtype = node.meta["tensor_meta"].dtype
    if dtype not in (torch.float32, torch.bfloat16, torch.bool):
        raise NotImplementedError(f"FX node {node.name}: result dtype {dtype} (fp32, bf16, bool only)")


def finish_value(value: Reg, dtype: torch.dtype) -> Reg:
    """Round a freshly computed fp32 value the way eager would store it in `dtype`."""
    if dtype == torch.bfloat16:
        return round_to_bf16(value)
    if dtype == torch.bool:
        return m.compare("ne", value, fconst(0.0))
    return value


def emit(node: torch.fx.Node, args: list, dtype: torch.dtype) -> Reg:
    """Emit the node's instructions; args are Regs (tensors and scalar literals) or raw Python values."""
    name = op_name(node)
    if name in VIEWS:
        return args[0]
    return finish_value(RULES[name](node, args), dtype)


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
    "convert_element_type": _convert,
    "_to_copy": _convert,
    "to": _convert,
    "type_as": _convert,
    "float": _convert,
    "bfloat16": _convert,
}

__all__ = ["REDUCTIONS", "RULES", "VIEWS", "check", "emit", "is_reduction", "op_name"]
