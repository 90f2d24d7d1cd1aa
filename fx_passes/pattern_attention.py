"""Pattern rules for scaled-dot-product attention -> ctpu::attention(q, k, v, mask, causal, scale).

Forms matched, all on 4-D [B, H, L, D] tensors flattened to [B*H, ...] around the two bmm's:
- the core-ATen decomposition of F.scaled_dot_product_attention (what Hugging Face's "sdpa" attention
  becomes): bmm(q * s, (k^T) * s) [+ mask] -> _softmax -> where(row fully masked, 0, p) -> bmm(p, v),
  in fp32 between an upcast of q/k/v and a downcast of the output for 16-bit models;
- Hugging Face's "eager" attention: bmm(q, k^T) * scale [+ mask] -> [up] _softmax [down] -> bmm(p, v);
  with the guard the op gets safe=True (a row of -inf scores gives 0), without it safe=False (NaN, as
  torch.softmax gives);
- the softmax may also appear decomposed (amax/sub/exp/sum/div);
- k and v may come through repeat_kv (unsqueeze/expand/clone/view: grouped-query attention);
- undecomposed aten.scaled_dot_product_attention / _scaled_dot_product_flash_attention_for_cpu.

Masks: a mask computed from constants only (e.g. the causal mask Hugging Face builds from aranges) is
evaluated at compile time; when it is the causal mask it becomes causal=True and disappears from the
graph. A where(keep, 0, -inf) mask becomes the boolean keep-mask; any other mask stays additive.
"""

from __future__ import annotations

import math
import operator

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.fx import Node

from .graph_utils import dtype, is_call, normalize_dims, number, op_arg, operand_orders, shape
from .matchers import is_upcast, match_softmax, peel_downcast, peel_upcast, scalar_factor, strip_casts
from .ops import causal_keep_mask, ctpu_op
from .rewrite import Rewrite, RewriteContext, why_no_fuse

aten = torch.ops.aten
_VIEWS = (aten.view.default, aten._unsafe_view.default)
_INTEGERS = (torch.int64, torch.int32)


def _unflatten(node: object) -> Node | None:
    """x for view(x, [B*H, M, N]) of a 4-D x [B, H, M, N]."""
    if not is_call(node, *_VIEWS):
        return None
    x = node.args[0]  # type: ignore[union-attr]
    size, flat = shape(x), shape(node)
    if size is None or len(size) != 4 or flat != (size[0] * size[1], size[2], size[3]):
        return None
    return x  # type: ignore[return-value]


def _peel_repeat_kv(node: Node) -> Node:
    """kv for view(clone(expand(unsqueeze(kv, 2), [B, Hkv, n, S, D])), [B, Hkv * n, S, D]), else node."""
    if not is_call(node, *_VIEWS):
        return node
    source = node.args[0]
    if is_call(source, aten.clone.default):
        source = source.args[0]  # type: ignore[union-attr]
    if not is_call(source, aten.expand.default) or not is_call(source.args[0], aten.unsqueeze.default):
        return node
    unsqueeze = source.args[0]
    kv = unsqueeze.args[0]
    size, expanded = shape(kv), shape(source)
    if unsqueeze.args[1] != 2 or size is None or len(size) != 4 or expanded is None:
        return node
    batch, heads, keys, dim = size
    if expanded[:2] != (batch, heads) or expanded[3:] != (keys, dim):
        return node
    if shape(node) != (batch, heads * expanded[2], keys, dim):
        return node
    return kv  # type: ignore[return-value]


def _peel_kv(node: Node) -> Node:
    """Look through the upcasts and repeat_kv in front of k or v (the op upcasts and repeats itself)."""
    while True:
        inner = peel_upcast(_peel_repeat_kv(node))
        if inner is node:
            return node
        node = inner


def _match_guard(node: Node) -> tuple[Node, Node, set[Node], Node | None] | None:
    """where(logical_not(any(logical_not(eq(s, -inf)) [& present], -1, True)), full_like(p, 0), p) ->
    (p, s, nodes, kv_len): the decomposition's "a fully masked row gives 0" guard, over the keys that are
    there when a padded key dim is masked (`present`: `_key_limit`)."""
    if not is_call(node, aten.where.self):
        return None
    condition, zeros, probs = node.args
    if not is_call(zeros, aten.full_like.default) or zeros.args[0] is not probs or number(zeros.args[1]) != 0:
        return None
    if not is_call(condition, aten.logical_not.default) or not is_call(condition.args[0], aten.any.dim):
        return None
    any_ = condition.args[0]
    inner, limit, nodes = any_.args[0], None, {node, zeros, condition, any_}
    if is_call(inner, aten.logical_and.default):
        nodes.add(inner)
        for a, b in (inner.args, inner.args[::-1]):
            if is_call(a, aten.logical_not.default) and (limit := _key_limit(b, 1)) is not None \
                    and shape(b)[0] == (shape(a) or (0,))[-1]:
                inner = a
                break
        else:
            return None
    if not is_call(inner, aten.logical_not.default) or not is_call(inner.args[0], aten.eq.Scalar):
        return None
    eq = inner.args[0]
    if number(eq.args[1]) != -math.inf or normalize_dims(any_.args[1], 4) != (3,):
        return None
    return probs, eq.args[0], nodes | {inner, eq}, limit  # type: ignore[return-value]


def _key_limit(condition: object, trailing: int) -> Node | None:
    """n for `arange(S) [viewed [S, 1]] < n` (n a 0-d integer tensor; `trailing` 1s after S): the keys that
    are there when fx_passes.dynamic masks a key dim padded to its bucket."""
    if not is_call(condition, aten.lt.Tensor):
        return None
    iota, n = condition.args
    size = shape(iota)
    if trailing > 1 and is_call(iota, *_VIEWS):
        iota = iota.args[0]
    if not is_call(iota, aten.arange.default) or size is None or len(size) != trailing \
            or any(d != 1 for d in size[1:]):
        return None
    if not isinstance(n, Node) or shape(n) != () or dtype(n) not in _INTEGERS:
        return None
    return n


def _peel_absent(node: Node, ctx: RewriteContext, fill: float, trailing: int) -> tuple[Node, Node] | None:
    """(x, n) for where(`_key_limit` n, x, fill): the masking of a padded key dim."""
    if not is_call(node, aten.where.self):
        return None
    condition, x, other = node.args
    limit = _key_limit(condition, trailing)
    size, keys = shape(x), shape(condition)
    if size is None or keys is None or size[-trailing] != keys[0]:
        return None
    with unset_fake_temporarily():
        if limit is None or _as_float(ctx.constants.value(other)) != fill:
            return None
    return x, limit  # type: ignore[return-value]


def _is_causal(value: torch.Tensor, length: int, keys: int) -> bool:
    """Is `value` (additive float or boolean keep-mask) the causal mask aligned bottom-right?"""
    if value.dim() < 2 or tuple(value.shape[-2:]) != (length, keys):
        return False
    keep = causal_keep_mask(length, keys)
    if value.dtype == torch.bool:
        return bool((value == keep).all())
    if not value.dtype.is_floating_point:
        return False
    # Finite "minus infinity" (finfo.min, as older Hugging Face masks use) masks exactly like -inf.
    masked = value.float() <= torch.finfo(value.dtype).min
    return bool(((value == 0) == keep).all() and (masked == ~keep).all())


def _classify_mask(
    mask: Node | None, ctx: RewriteContext, full: tuple[int, ...]
) -> tuple[Node | None, bool] | None:
    """(mask for ctpu::attention, causal), or None when the mask does not broadcast to [B, H, L, S]."""
    if mask is None:
        return None, False
    size = shape(mask)
    if size is None or not _broadcasts_to(size, full):
        return None
    value = ctx.constants.value(mask)
    with unset_fake_temporarily():  # passes may run inside a tracing context's fake mode
        causal = isinstance(value, torch.Tensor) and _is_causal(value, full[2], full[3])
    if causal:
        return None, True
    if is_call(mask, aten.where.self):
        condition, on, off = mask.args
        if dtype(condition) == torch.bool and shape(condition) == size:
            on_value, off_value = ctx.constants.value(on), ctx.constants.value(off)
            with unset_fake_temporarily():
                keep_mask = _as_float(on_value) == 0.0 and _as_float(off_value) == -math.inf
            if keep_mask:
                return condition, False  # type: ignore[return-value]
    return mask, False


def _broadcasts_to(size: tuple[int, ...], full: tuple[int, ...]) -> bool:
    try:
        return torch.broadcast_shapes(size, full) == full
    except RuntimeError:
        return False


def _as_float(value: object) -> float | None:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return float(value)
    return number(value)


def attention_rule(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """The decomposed attention forms (module docstring) -> ctpu::attention."""
    out, down = peel_downcast(node)
    if not is_call(out, *_VIEWS) or not is_call(out.args[0], aten.bmm.default):
        return None
    pv = out.args[0]
    nodes = {out, pv, *pv.args} | ({node} if down is not None else set())  # type: ignore[misc]
    # a key dim padded to a bucket (fx_passes.dynamic): p and v masked where the keys are not there
    p_arg, v_arg, limits = pv.args[0], pv.args[1], []  # type: ignore[union-attr]
    for side, fill, trailing in (("p", 0.0, 1), ("v", 0.0, 2)):
        peeled = _peel_absent(p_arg if side == "p" else v_arg, ctx, fill, trailing)
        if peeled is not None:
            limits.append(peeled[1])
            if side == "p":
                p_arg = peeled[0]
            else:
                v_arg = peeled[0]
            nodes.add(peeled[0])
    probs, v = _unflatten(p_arg), _unflatten(v_arg)
    if probs is None or v is None:
        return None
    if is_call(probs, aten.clone.default):  # dropout(p=0) of eval mode
        nodes.add(probs)
        probs = probs.args[0]  # type: ignore[assignment]
    inner, p_down = peel_downcast(probs)  # type: ignore[arg-type]
    if p_down is not None:
        nodes.add(probs)  # type: ignore[arg-type]
    guard = _match_guard(inner)
    if guard is not None:
        inner, guarded_scores, guard_nodes, guard_limit = guard
        nodes |= guard_nodes
        if guard_limit is not None:
            limits.append(guard_limit)
    softmax = match_softmax(inner)
    if softmax is None:
        return why_no_fuse("attention", node, "the probabilities are not a softmax")
    if softmax.dim % 4 != 3:
        return why_no_fuse("attention", node, "softmax over dim %d, not over the keys", softmax.dim % 4)
    nodes |= softmax.nodes
    scores = softmax.input
    peeled = _peel_absent(scores, ctx, -math.inf, 1)
    if peeled is not None:
        nodes.add(scores)
        scores, limit = peeled
        limits.append(limit)
    if guard is not None and guarded_scores is not scores:
        return why_no_fuse("attention", node, "the fully-masked-row guard reads other scores")
    expected = 4 if guard is not None and limits else 3
    if limits and (len(limits) != expected or any(n is not limits[0] for n in limits)):
        return why_no_fuse("attention", node, "a padded key dim masked in some places only")
    kv_len = limits[0] if limits else None
    if is_upcast(scores):  # softmax(..., dtype=float32) of a 16-bit model
        nodes.add(scores)
        scores = scores.args[0]  # type: ignore[assignment]
    # The guard makes it torch._safe_softmax (a row of -inf scores gives 0); without it the row is NaN.
    return _match_scores(node, ctx, scores, v, down, nodes, safe=guard is not None, kv_len=kv_len)


def _match_scores(
    node: Node, ctx: RewriteContext, scores: Node, v: Node, down: torch.dtype | None, nodes: set[Node],
    safe: bool, kv_len: Node | None = None,
) -> Rewrite | None:
    """scores = [mask +] [c *] view(bmm(view([a *] q), view([b *] permute(k, [0, 1, 3, 2]))))."""
    mask = None
    if is_call(scores, aten.add.Tensor) and not scores.kwargs:
        for s, m in operand_orders(scores):
            if isinstance(m, Node) and (_is_qk(s) or _is_qk((scalar_factor(s) or (None,))[0])):
                nodes.add(scores)
                scores, mask = s, m
                break
        else:
            return why_no_fuse("attention", node, "scores %s are not q @ k^T [+ mask]", scores.name)
    scale = 1.0
    factor = scalar_factor(scores)
    if factor is not None:
        nodes.add(scores)
        scores, scale = factor
    if not _is_qk(scores):
        return why_no_fuse("attention", node, "scores %s are not q @ k^T", scores.name)
    qk = scores.args[0]
    q, kt = _unflatten(qk.args[0]), _unflatten(qk.args[1])  # type: ignore[union-attr]
    if q is None or kt is None:
        return why_no_fuse("attention", node, "q @ k^T operands are not [B*H, ...] views of 4-D tensors")
    nodes |= {scores, qk, *qk.args}  # type: ignore[misc]
    for side in ("q", "k"):
        operand = q if side == "q" else kt
        factor = scalar_factor(operand)
        if factor is not None:
            nodes.add(operand)
            scale *= factor[1]
            if side == "q":
                q = factor[0]
            else:
                kt = factor[0]
    if not is_call(kt, aten.permute.default) or list(kt.args[1]) != [0, 1, 3, 2]:
        return why_no_fuse("attention", node, "the right operand of q @ k^T is not k transposed")
    nodes.add(kt)
    k = kt.args[0]
    factor = scalar_factor(k)
    if factor is not None:
        nodes.add(k)  # type: ignore[arg-type]
        k, c = factor
        scale *= c
    query = strip_casts(q, down)
    if query is None:
        return why_no_fuse("attention", node, "output cast to %s but q was not upcast from it", down)
    return _build(node, ctx, nodes, query, _peel_kv(k), _peel_kv(v), mask, scale, safe,  # type: ignore[arg-type]
                  kv_len=kv_len)


def _is_qk(node: object) -> bool:
    return is_call(node, *_VIEWS) and is_call(node.args[0], aten.bmm.default)  # type: ignore[union-attr]


def _build(
    node: Node,
    ctx: RewriteContext,
    nodes: set[Node],
    q: Node,
    k: Node,
    v: Node,
    mask: Node | None,
    scale: float,
    safe: bool,
    causal: bool = False,
    kv_len: Node | None = None,
) -> Rewrite | None:
    """Check shapes, classify the mask and make the Rewrite."""
    sq, sk, sv = shape(q), shape(k), shape(v)
    if sq is None or sk is None or sv is None or not len(sq) == len(sk) == len(sv) == 4:
        return why_no_fuse("attention", node, "q, k, v are not 4-D")
    batch, heads, length, dim = sq
    if sk[0] != batch or sv[:3] != sk[:3] or sk[3] != dim or heads % sk[1]:
        return why_no_fuse("attention", node, "q %s, k %s, v %s do not fit [B, H, L, D]", sq, sk, sv)
    classified = _classify_mask(mask, ctx, (batch, heads, length, sk[2]))
    if classified is None:
        return why_no_fuse("attention", node, "mask %s does not broadcast to the scores", shape(mask))
    mask, mask_is_causal = classified
    if causal and mask is not None:
        return why_no_fuse("attention", node, "both a mask and is_causal")
    args = (q, k, v, mask, causal or mask_is_causal, scale, safe) + ((kv_len,) if kv_len is not None else ())
    return Rewrite("attention", node, nodes, ctpu_op("attention"), args)


def sdpa_rule(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """aten.scaled_dot_product_attention and getitem(_scaled_dot_product_flash_attention_for_cpu, 0)."""
    if is_call(node, aten.scaled_dot_product_attention.default):
        sdpa, nodes = node, {node}
    elif is_call(node, operator.getitem) and is_call(
        node.args[0], aten._scaled_dot_product_flash_attention_for_cpu.default
    ):
        if node.args[1] != 0:
            return None
        sdpa, nodes = node.args[0], {node, node.args[0]}  # type: ignore[assignment]
    else:
        return None
    q, k, v = sdpa.args[:3]  # type: ignore[union-attr]
    if number(op_arg(sdpa, "dropout_p")):  # type: ignore[arg-type]
        return why_no_fuse("attention", node, "dropout_p != 0")
    size_q, size_k = shape(q), shape(k)
    if size_q is None or size_k is None or len(size_q) != 4:
        return why_no_fuse("attention", node, "q is not 4-D")
    causal = bool(op_arg(sdpa, "is_causal"))  # type: ignore[arg-type]
    if causal and size_q[2] != size_k[2]:
        return why_no_fuse("attention", node, "sdpa's causal mask is top-left aligned and L != S")
    scale = op_arg(sdpa, "scale")  # type: ignore[arg-type]
    scale = 1.0 / math.sqrt(size_q[3]) if scale is None else float(scale)
    mask = op_arg(sdpa, "attn_mask")  # type: ignore[arg-type]
    # SDPA's math is torch._safe_softmax: a fully masked row gives 0.
    return _build(node, ctx, nodes, q, k, v, mask, scale, True, causal)  # type: ignore[arg-type]
