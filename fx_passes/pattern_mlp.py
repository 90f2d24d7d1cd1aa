"""Pattern rules for the MLP side: SwiGLU / GeGLU, RoPE, and matmul epilogues into ctpu::linear.

Forms matched:
- swiglu: act(gate) * up (either operand order), act = silu (aten.silu or x * sigmoid(x), in fp32 for
  16-bit inputs), gelu, gelu_tanh; gate, up and the result of one shape.
- rope: x * cos + cat(-x[..., D/2:], x[..., :D/2], -1) * sin (Hugging Face rotate_half; operand orders
  free); the result has x's shape.
- linear: [+ residual] act([+ bias] mm(x2, w) | addmm(bias, x2, w)), where x2 may be a flattening view
  of x [..., K] that the view after the mm restores. bias is [N]; the residual has the output's shape.
  bmm(x, expand(w)) with one w [K, N] for every batch is a linear too; a bmm with a batched right
  operand is not (ctpu::linear takes w [K, N]).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.fx import Node

from .graph_utils import is_call, number, op_arg, operand_orders, shape
from .matchers import match_activation
from .ops import LINEAR_ACTIVATIONS, SWIGLU_ACTIVATIONS, ctpu_op
from .rewrite import Rewrite, RewriteContext, why_no_fuse

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default)


def swiglu_rule(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """act(gate) * up -> ctpu::swiglu(gate, up, act)."""
    if not is_call(node, aten.mul.Tensor):
        return None
    for a, up in operand_orders(node):
        act = match_activation(a)
        if act is None or act.name not in SWIGLU_ACTIVATIONS or not isinstance(up, Node):
            continue
        if shape(act.input) != shape(up) or shape(up) != shape(node):
            why_no_fuse("swiglu", node, "gate %s and up %s differ in shape", shape(act.input), shape(up))
            continue
        return Rewrite("swiglu", node, {node} | act.nodes, ctpu_op("swiglu"), (act.input, up, act.name))
    return None


def _rotate_half_of(node: object) -> tuple[Node, set[Node]] | None:
    """cat([neg(x[..., h:]), x[..., :h]], -1) with h = D / 2 -> (x, nodes)."""
    if not is_call(node, aten.cat.default):
        return None
    assert isinstance(node, Node)
    tensors = node.args[0]
    if len(tensors) != 2 or not is_call(tensors[0], aten.neg.default):  # type: ignore[arg-type, index]
        return None
    neg, first = tensors  # type: ignore[misc]
    second = neg.args[0]
    if not is_call(first, aten.slice.Tensor) or not is_call(second, aten.slice.Tensor):
        return None
    x = first.args[0]
    size = shape(x)
    if second.args[0] is not x or not size or size[-1] % 2:
        return None
    last, half = len(size) - 1, size[-1] // 2
    for piece in (first, second):
        if op_arg(piece, "dim") % len(size) != last or op_arg(piece, "step") != 1:
            return None
    if op_arg(node, "dim") % len(size) != last:
        return None
    if op_arg(first, "start") not in (None, 0) or op_arg(first, "end") != half:
        return None
    end = op_arg(second, "end")
    if op_arg(second, "start") != half or (end is not None and end < size[-1]):
        return None
    return x, {node, neg, first, second}


def rope_rule(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """x * cos + rotate_half(x) * sin -> ctpu::rope(x, cos, sin)."""
    if not is_call(node, aten.add.Tensor) or node.kwargs:
        return None
    for x_cos, rot_sin in operand_orders(node):
        if not is_call(x_cos, aten.mul.Tensor) or not is_call(rot_sin, aten.mul.Tensor):
            continue
        for rotated, sin in operand_orders(rot_sin):
            half = _rotate_half_of(rotated)
            if half is None or not isinstance(sin, Node):
                continue
            x, nodes = half
            for a, cos in operand_orders(x_cos):
                if a is not x or not isinstance(cos, Node):
                    continue
                if shape(node) != shape(x):
                    return why_no_fuse("rope", node, "cos/sin broadcast x %s to %s", shape(x), shape(node))
                nodes |= {node, x_cos, rot_sin}
                return Rewrite("rope", node, nodes, ctpu_op("rope"), (x, cos, sin))
    return None


class _MatMul(NamedTuple):
    x: Node
    w: Node
    bias: Node | None
    nodes: set[Node]


def _broadcast_weight(node: object) -> Node | None:
    """w [K, N] for expand(w, [B, K, N]) or expand(unsqueeze(w, 0), [B, K, N]): one matrix for all batches."""
    if not is_call(node, aten.expand.default):
        return None
    source = node.args[0]  # type: ignore[union-attr]
    if is_call(source, aten.unsqueeze.default) and source.args[1] == 0:  # type: ignore[union-attr]
        source = source.args[0]  # type: ignore[union-attr]
    return source if len(shape(source) or ()) == 2 else None  # type: ignore[return-value]


def _match_matmul(node: object) -> _MatMul | None:
    """mm(x2, w) or addmm(bias, x2, w), optionally viewed back from [M, N] to x's [..., N]; or
    bmm(x, w broadcast over the batch)."""
    if not isinstance(node, Node):
        return None
    restore = None
    if is_call(node, *_VIEWS):
        restore, node = node, node.args[0]
    if is_call(node, aten.bmm.default):
        x, w = node.args[0], _broadcast_weight(node.args[1])
        if w is None:
            return why_no_fuse("linear", node, "bmm's right operand is batched; ctpu::linear takes w [K, N]")
        return _MatMul(x, w, None, {node}) if restore is None else None  # type: ignore[arg-type]
    if is_call(node, aten.mm.default):
        (x, w), bias = node.args, None
    elif is_call(node, aten.addmm.default):
        bias, x, w = node.args[:3]
        if number(op_arg(node, "beta")) != 1.0 or number(op_arg(node, "alpha")) != 1.0:
            return why_no_fuse("linear", node, "addmm with alpha/beta != 1")
        if shape(bias) != (shape(w) or (0,))[-1:]:
            return why_no_fuse("linear", node, "addmm bias %s is not [N]", shape(bias))
    else:
        return None
    nodes = {node}
    if restore is not None:
        # mm's left operand must flatten some x [..., K] whose leading dims the view restores.
        if not is_call(x, *_VIEWS):
            return None
        x = x.args[0]  # type: ignore[union-attr]
        if (shape(x) or ())[:-1] != (shape(restore) or ())[:-1]:
            return None
        nodes.add(restore)
    return _MatMul(x, w, bias, nodes)  # type: ignore[arg-type]


class _Linear(NamedTuple):
    matmul: _MatMul
    act: str
    bias: Node | None
    nodes: set[Node]


def _match_epilogue(node: object) -> _Linear | None:
    """act([+ bias] matmul), act possibly none."""
    act = match_activation(node)
    if act is not None and act.name in LINEAR_ACTIVATIONS:
        name, current, nodes = act.name, act.input, set(act.nodes)
    else:
        name, current, nodes = "none", node, set()
    matmul = _match_matmul(current)
    if matmul is not None:
        return _Linear(matmul, name, matmul.bias, nodes | matmul.nodes)
    if not is_call(current, aten.add.Tensor) or current.kwargs:  # type: ignore[union-attr]
        return None
    for a, bias in operand_orders(current):  # type: ignore[arg-type]
        matmul = _match_matmul(a)
        if matmul is None or matmul.bias is not None or not isinstance(bias, Node):
            continue
        if shape(bias) != (shape(matmul.w) or (0,))[-1:]:
            continue
        return _Linear(matmul, name, bias, nodes | matmul.nodes | {current})  # type: ignore[arg-type]
    return None


def linear_rule(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """mm/addmm with bias, activation and residual epilogues -> ctpu::linear(x, w, bias, act, residual)."""
    linear = _match_epilogue(node)
    residual = None
    if linear is None and is_call(node, aten.add.Tensor) and not node.kwargs:
        for a, other in operand_orders(node):
            linear = _match_epilogue(a)
            if linear is not None and isinstance(other, Node) and shape(other) == shape(node):
                residual = other
                linear.nodes.add(node)
                break
            linear = None
    if linear is None:
        return None
    args = (linear.matmul.x, linear.matmul.w, linear.bias, linear.act, residual)
    return Rewrite("linear", node, linear.nodes, ctpu_op("linear"), args)
