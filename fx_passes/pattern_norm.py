"""Pattern rules for row-wise normalisations: RMSNorm, LayerNorm, softmax.

Forms matched (on the normalised core-ATen graph; `up`/`down` are the optional fp32 upcast of a 16-bit
input and the cast back that bf16/fp16 models put around the math):
- rms_norm: [w *] down(up(x) * rsqrt(mean(up(x)^2, [-1], keepdim) + eps))   (Hugging Face LlamaRMSNorm;
  x^2 as pow(x, 2) or x * x)
- layer_norm: getitem(native_layer_norm(x, [D], w, b, eps), 0), or its decomposition
  down([+ b] [* w] (up(x) - mean) * rsqrt(var + eps)) with var, mean = var_mean(up(x), [-1], correction=0)
- softmax: down(_softmax(up(x), dim)), or the decomposition exp(x - amax) / sum(exp(x - amax))
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Node

from .graph_utils import is_call, normalize_dims, number, op_arg, operand_orders, shape
from .matchers import match_softmax, peel_downcast, strip_casts
from .ops import ctpu_op
from .rewrite import Rewrite, RewriteContext, why_no_fuse

aten = torch.ops.aten


def _last_dim_only(node: Node, dims: object, ndim: int) -> bool:
    keepdim = op_arg(node, "keepdim")
    return bool(keepdim) and normalize_dims(dims, ndim) == (ndim - 1,)


def _eps_add(node: object) -> tuple[Node, float] | None:
    """(v, eps) for v + eps with a Python number eps."""
    if not is_call(node, aten.add.Tensor, aten.add.Scalar) or node.kwargs:  # type: ignore[union-attr]
        return None
    value, eps = node.args  # type: ignore[union-attr]
    eps = number(eps)
    return (value, eps) if eps is not None and isinstance(value, Node) else None


def _is_square_of(node: object, x: Node) -> bool:
    if is_call(node, aten.pow.Tensor_Scalar):
        return node.args[0] is x and number(node.args[1]) == 2.0  # type: ignore[union-attr]
    return is_call(node, aten.mul.Tensor) and node.args[0] is x and node.args[1] is x  # type: ignore[union-attr]


def _rms_core(node: Node) -> tuple[Node, float, set[Node]] | None:
    """x * rsqrt(mean(x^2, [-1], keepdim=True) + eps) -> (x, eps, nodes)."""
    if not is_call(node, aten.mul.Tensor):
        return None
    for x, rsqrt in operand_orders(node):
        if not isinstance(x, Node) or not is_call(rsqrt, aten.rsqrt.default):
            continue
        add = _eps_add(rsqrt.args[0])
        if add is None or not is_call(add[0], aten.mean.dim):
            continue
        mean, eps = add
        ndim = len(shape(x) or ())
        if not _last_dim_only(mean, mean.args[1], ndim) or not _is_square_of(mean.args[0], x):
            continue
        return x, eps, {node, rsqrt, rsqrt.args[0], mean, mean.args[0]}  # type: ignore[arg-type]
    return None


def rms_norm_rule(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """[weight *] RMS normalisation over the last dim -> ctpu::rms_norm(x, weight, eps)."""
    candidates: list[tuple[Node, Node | None]] = []
    if is_call(node, aten.mul.Tensor):
        candidates = [(a, w) for a, w in operand_orders(node) if isinstance(a, Node) and isinstance(w, Node)]
    candidates.append((node, None))
    for normed, weight in candidates:
        inner, down = peel_downcast(normed)
        core = _rms_core(inner)
        if core is None:
            continue
        xf, eps, nodes = core
        x = strip_casts(xf, down)
        if x is None:
            return why_no_fuse("rms_norm", node, "cast to %s of a value not upcast from %s", down, down)
        if down is not None:
            nodes.add(normed)
        if weight is not None:
            if shape(weight) != (shape(x) or (0,))[-1:]:
                why_no_fuse("rms_norm", node, "weight %s is not [D] for x %s", shape(weight), shape(x))
                continue
            nodes.add(node)
        return Rewrite("rms_norm", node, nodes, ctpu_op("rms_norm"), (x, weight, eps))
    return None


def _ln_core(node: Node) -> tuple[Node, float, set[Node]] | None:
    """(x - mean) * rsqrt(var + eps), var, mean = var_mean(x, [-1], correction=0, keepdim=True)."""
    if not is_call(node, aten.mul.Tensor):
        return None
    for centred, rsqrt in operand_orders(node):
        if not is_call(centred, aten.sub.Tensor) or not is_call(rsqrt, aten.rsqrt.default):
            continue
        add = _eps_add(rsqrt.args[0])
        if add is None:
            continue
        var, eps = add
        x, mean = centred.args
        if not (is_call(var, operator.getitem) and is_call(mean, operator.getitem)):
            continue
        stats = var.args[0]
        if var.args[1] != 0 or mean.args[1] != 1 or mean.args[0] is not stats:
            continue
        if not is_call(stats, aten.var_mean.correction) or stats.args[0] is not x:
            continue
        ndim = len(shape(x) or ())
        biased = number(op_arg(stats, "correction")) == 0.0
        if not biased or not _last_dim_only(stats, op_arg(stats, "dim"), ndim):
            continue
        return x, eps, {node, centred, rsqrt, rsqrt.args[0], var, mean, stats}  # type: ignore[arg-type]
    return None


def _affine_forms(node: Node) -> list[tuple[Node, Node | None, Node | None, set[Node]]]:
    """(core, weight, bias, affine nodes) for core, core * w, core + b, core * w + b."""
    forms: list[tuple[Node, Node | None, Node | None, set[Node]]] = [(node, None, None, set())]
    if is_call(node, aten.mul.Tensor):
        forms += [(a, w, None, {node}) for a, w in operand_orders(node) if isinstance(w, Node)]
    if is_call(node, aten.add.Tensor) and not node.kwargs:
        for a, b in operand_orders(node):
            if not isinstance(a, Node) or not isinstance(b, Node):
                continue
            forms.append((a, None, b, {node}))
            if is_call(a, aten.mul.Tensor):
                forms += [(c, w, b, {node, a}) for c, w in operand_orders(a) if isinstance(w, Node)]
    return forms


def layer_norm_rule(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """native_layer_norm over the last dim, or its decomposition -> ctpu::layer_norm(x, w, b, eps)."""
    if is_call(node, operator.getitem) and is_call(node.args[0], aten.native_layer_norm.default):
        layer_norm = node.args[0]
        x, normalized_shape, weight, bias, eps = layer_norm.args  # type: ignore[union-attr]
        if node.args[1] != 0:
            return None
        if list(normalized_shape) != list((shape(x) or (0,))[-1:]):  # type: ignore[call-overload]
            return why_no_fuse("layer_norm", node, "normalises over %s, not the last dim", normalized_shape)
        return Rewrite("layer_norm", node, {node, layer_norm}, ctpu_op("layer_norm"), (x, weight, bias, eps))
    inner, down = peel_downcast(node)
    for core_node, weight, bias, affine in _affine_forms(inner):
        core = _ln_core(core_node)
        if core is None:
            continue
        xf, eps, nodes = core
        x = strip_casts(xf, down)
        if x is None:
            return why_no_fuse("layer_norm", node, "cast to %s of a value not upcast from %s", down, down)
        size = (shape(x) or (0,))[-1:]
        if any(p is not None and shape(p) != size for p in (weight, bias)):
            why_no_fuse("layer_norm", node, "weight/bias are not [D] for x %s", shape(x))
            continue
        nodes |= affine | ({node} if down is not None else set())
        return Rewrite("layer_norm", node, nodes, ctpu_op("layer_norm"), (x, weight, bias, eps))
    return None


def softmax_rule(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """_softmax or its decomposition (with optional fp32 up/down casts) -> ctpu::softmax(x, dim)."""
    inner, down = peel_downcast(node)
    softmax = match_softmax(inner)
    if softmax is None:
        if is_call(inner, aten._softmax.default):
            why_no_fuse("softmax", node, "half_to_float=True changes the dtype")
        return None
    x = strip_casts(softmax.input, down)
    if x is None:
        return why_no_fuse("softmax", node, "cast to %s of a value not upcast from %s", down, down)
    nodes = softmax.nodes | ({node} if down is not None else set())
    return Rewrite("softmax", node, nodes, ctpu_op("softmax"), (x, softmax.dim))
