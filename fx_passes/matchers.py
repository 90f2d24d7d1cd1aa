"""Matchers shared by the pattern rules: dtype casts, activations, softmax, scalar scales.

Each returns None for "not this shape of graph"; none of them edits the graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.fx import Node

from .graph_utils import dtype, is_call, normalize_dims, number, op_arg, operand_orders, shape

aten = torch.ops.aten
LOW_PRECISION = (torch.float16, torch.bfloat16)


def cast_dtype(node: object) -> torch.dtype | None:
    """Target dtype of an `_to_copy` that only converts the dtype (same device, strided), else None."""
    if not is_call(node, aten._to_copy.default):
        return None
    assert isinstance(node, Node)
    if op_arg(node, "pin_memory") or op_arg(node, "layout") not in (None, torch.strided):
        return None
    source = node.args[0]
    device = op_arg(node, "device")
    source_val = source.meta.get("val") if isinstance(source, Node) else None
    if device is not None and (source_val is None or torch.device(device) != source_val.device):
        return None
    return op_arg(node, "dtype")


def is_upcast(node: object) -> bool:
    """`_to_copy` from a 16-bit float to fp32 (the "compute in fp32" idiom of decompositions)."""
    return cast_dtype(node) == torch.float32 and dtype(node.args[0]) in LOW_PRECISION  # type: ignore[union-attr]


def peel_upcast(node: Node) -> Node:
    """The 16-bit input of an upcast, or node itself."""
    return node.args[0] if is_upcast(node) else node  # type: ignore[return-value]


def peel_downcast(node: Node) -> tuple[Node, torch.dtype | None]:
    """(inner, dtype) when node casts an fp32 value down to a 16-bit float; else (node, None)."""
    target = cast_dtype(node)
    if target in LOW_PRECISION and dtype(node.args[0]) == torch.float32:
        return node.args[0], target  # type: ignore[return-value]
    return node, None


def strip_casts(x: Node, down: torch.dtype | None) -> Node | None:
    """The input a fused op should take when the pattern computed on `x` and then cast to `down`.

    With a downcast the pattern must have upcast exactly that dtype on entry (x = upcast(x16), x16 of
    dtype `down`): the fused op then takes x16 and computes in fp32 itself. Without a downcast the op
    takes x as it is. None when the casts do not pair up.
    """
    if down is None:
        return x
    if is_upcast(x) and dtype(x.args[0]) == down:
        return x.args[0]  # type: ignore[return-value]
    return None


class Activation(NamedTuple):
    name: str  # an activation name of ctpu::linear / ctpu::swiglu
    input: Node
    nodes: set[Node]


def match_activation(node: object) -> Activation | None:
    """relu, gelu (erf or tanh), silu: aten.silu or its decomposition x * sigmoid(x), which on 16-bit
    floats is wrapped in an upcast to fp32 and a downcast back."""
    if not isinstance(node, Node):
        return None
    if is_call(node, aten.relu.default):
        return Activation("relu", node.args[0], {node})  # type: ignore[arg-type]
    if is_call(node, aten.gelu.default):
        approximate = op_arg(node, "approximate")
        name = {"none": "gelu", "tanh": "gelu_tanh"}.get(approximate)
        return Activation(name, node.args[0], {node}) if name else None  # type: ignore[arg-type]
    if is_call(node, aten.silu.default):
        return Activation("silu", node.args[0], {node})  # type: ignore[arg-type]
    inner, down = peel_downcast(node)
    if not is_call(inner, aten.mul.Tensor):
        return None
    for a, b in operand_orders(inner):
        if is_call(b, aten.sigmoid.default) and b.args[0] is a:
            x = strip_casts(a, down)
            if x is None:
                return None
            # The upcast belongs to the activation: an epilogue must take it over with its input.
            nodes = {inner, b} | ({node, a} if down else set())
            return Activation("silu", x, nodes)
    return None


class Softmax(NamedTuple):
    input: Node
    dim: int
    nodes: set[Node]


def match_softmax(node: object) -> Softmax | None:
    """aten._softmax(x, dim, False), or its decomposition
    div(exp(sub(x, amax(x, [dim], True))), sum(exp(...), [dim], True))."""
    if is_call(node, aten._softmax.default):
        assert isinstance(node, Node)
        if node.args[2]:
            return None  # half_to_float changes the dtype; not in ctpu::softmax
        return Softmax(node.args[0], int(node.args[1]), {node})  # type: ignore[arg-type]
    if not is_call(node, aten.div.Tensor):
        return None
    assert isinstance(node, Node)
    exp, total = node.args
    if not is_call(exp, aten.exp.default) or not is_call(total, aten.sum.dim_IntList):
        return None
    if total.args[0] is not exp or not _keepdim(total):  # type: ignore[union-attr]
        return None
    sub = exp.args[0]  # type: ignore[union-attr]
    if not is_call(sub, aten.sub.Tensor) or not is_call(sub.args[1], aten.amax.default):  # type: ignore[union-attr]
        return None
    x, amax = sub.args  # type: ignore[union-attr]
    if amax.args[0] is not x or not _keepdim(amax):  # type: ignore[union-attr]
        return None
    ndim = len(shape(x) or ())
    dims = normalize_dims(total.args[1], ndim), normalize_dims(amax.args[1], ndim)  # type: ignore[union-attr]
    if dims[0] is None or dims[0] != dims[1] or len(dims[0]) != 1:
        return None
    return Softmax(x, dims[0][0], {node, exp, total, sub, amax})  # type: ignore[arg-type]


def _keepdim(node: Node) -> bool:
    return bool(node.args[2]) if len(node.args) > 2 else bool(node.kwargs.get("keepdim", False))


def scalar_factor(node: object) -> tuple[Node, float] | None:
    """(x, c) for x * c or x / c (as x * 1/c) with a Python number c."""
    if not is_call(node, aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar):
        return None
    assert isinstance(node, Node)
    if node.kwargs:
        return None
    for a, b in operand_orders(node):
        c = number(b)
        if c is None or not isinstance(a, Node):
            continue
        if is_call(node, aten.div.Tensor, aten.div.Scalar):
            if a is not node.args[0] or c == 0.0:
                return None
            c = 1.0 / c
        return a, c
    return None
