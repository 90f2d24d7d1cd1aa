"""The decomposition table the ctpu backend hands AOT autograd: the graphs fx_passes expects.

`decomposition_table()` is torch's `core_aten_decompositions()` with one rule replaced:
`_scaled_dot_product_flash_attention_for_cpu` (what `F.scaled_dot_product_attention` calls on the CPU),
and one added: its backward, `_scaled_dot_product_flash_attention_for_cpu_backward`, as matmuls and row
ops from the saved logsumexp, so a training step's backward graph runs on the CTPU (torch has no rule).

Why: AOT autograd applies decompositions *below* autograd. Autograd records the op's own derivative,
`_scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, logsumexp, ...)`, and the
forward op is then decomposed; whatever the decomposition returns is what the backward reads. torch's rule
(written for export, where nothing is differentiated; Inductor excludes it) returns the attention
probabilities [B, H, L, S] where the op returns the logsumexp [B, H, L], so the backward silently computed
wrong gradients from them. A decomposition applied below autograd must return every output the op's
contract names; the rule here does: (out, logsumexp).

The forward ops are those of torch's rule (ATen's math composite: `q * s`, `k^T * s`, bmm, `+ mask`,
softmax, bmm), which pattern fusion turns into ctpu::attention; the logsumexp is computed from the same
scores and is dead code (eliminated) where nothing differentiates it. The softmax is `_safe_softmax`'s
(a fully masked row gives 0) with every mask and without one: a -inf in q or k masks a whole row as well.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .foreach import foreach_decompositions
from .routing import routing_decompositions

aten = torch.ops.aten


def decomposition_table() -> dict[Any, Callable[..., Any]]:
    """core_aten_decompositions() with the SDPA-for-CPU rule that keeps the op's outputs (module docstring),
    the `_foreach_*` ops as one op per tensor (foreach.py) and an MoE's routing ops in static shapes
    (routing.py)."""
    from torch._decomp import core_aten_decompositions

    table = dict(core_aten_decompositions())
    table[aten._scaled_dot_product_flash_attention_for_cpu.default] = sdpa_flash_for_cpu
    table[aten._scaled_dot_product_flash_attention_for_cpu_backward.default] = sdpa_flash_for_cpu_backward
    table[aten.pow.Scalar] = pow_scalar_base
    table.update(foreach_decompositions())  # a compiled optimizer step's list ops, one op per tensor
    table.update(routing_decompositions())  # an MoE router's ops and grouped matmul, in static shapes
    return table


def sdpa_flash_for_cpu(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor]:
    """(out [B, H, L, E] in the op's layout, logsumexp [B, H, L] in the accumulation dtype).

    The math is ATen's `_scaled_dot_product_attention_math` (the sqrt of the scale on each of q and k^T,
    a causal mask as an additive -inf mask, k and v repeated for grouped-query attention, a softmax that
    gives 0 on a fully masked row). The logsumexp of such a row is stored as 0, not -inf, as the CPU
    kernel does: the backward recomputes the probabilities as exp(scores - logsumexp), NaN from -inf.
    """
    torch._check(query.is_floating_point(), lambda: f"query must be a float tensor, got {query.dtype}")
    torch._check(query.dim() == 4 and key.dim() == 4 and value.dim() == 4,
                 lambda: f"q, k, v must be 4-D, got {query.dim()}, {key.dim()}, {value.dim()}")
    torch._check(dropout_p == 0.0, lambda: f"dropout probability must be zero, got {dropout_p}")
    torch._check(query.shape[3] == value.shape[3] and key.shape[3] == value.shape[3],
                 lambda: "q, k, v should have the same head size")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    factor = math.sqrt(abs(scale))
    q = query * (-factor if scale < 0 else factor)
    if is_causal:
        torch._check(attn_mask is None, lambda: "_scaled_dot_product_attention: explicit attn_mask and is_causal")
        keep = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        attn_mask = _additive_mask(keep, query.dtype)
    elif attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = _additive_mask(attn_mask, query.dtype)
    groups = query.shape[1] // key.shape[1]
    if groups != 1:
        key, value = key.repeat_interleave(groups, -3), value.repeat_interleave(groups, -3)
    scores = torch.matmul(q, key.transpose(-2, -1) * factor)
    if attn_mask is not None:
        scores = scores + attn_mask
    probs = torch._safe_softmax(scores, -1)  # a row of -inf scores gives 0, from a mask or from q / k
    out = torch.matmul(probs, value)
    # The layout torch's rule gives the output ([L, B, H, E] in memory, see its comment), so that the
    # graphs after it (views of the output) are what they were.
    out = out.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3)
    acc = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    lse = torch.logsumexp(scores.to(acc), -1)
    lse = torch.where(lse == -math.inf, 0.0, lse)
    return out, lse


def sdpa_flash_for_cpu_backward(
    grad_out: Tensor,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    out: Tensor,
    logsumexp: Tensor,
    dropout_p: float,
    is_causal: bool,
    *,
    attn_mask: Tensor | None = None,
    scale: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(grad_query, grad_key, grad_value) from the saved logsumexp, as the CPU kernel computes them, in ops the
    CTPU lowers (matmuls, elementwise, row sums): the probabilities recomputed as exp(scores - logsumexp)
    from the scores the forward rule computes (0 on a fully masked row, whose logsumexp is stored as 0),
    dS = P (dP - rowsum(dO out)), dq = dS k scale, dk = dS^T q scale, dv = P^T dO; grouped-query heads sum
    their kv gradients over the query heads that read them."""
    torch._check(dropout_p == 0.0, lambda: f"dropout probability must be zero, got {dropout_p}")
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    factor = math.sqrt(abs(scale))
    acc = torch.float32 if query.dtype in (torch.float16, torch.bfloat16) else query.dtype
    q, k, v, d_out, o = (t.to(acc) for t in (query, key, value, grad_out, out))
    if is_causal:
        keep = torch.ones(query.shape[-2], key.shape[-2], dtype=torch.bool, device=query.device).tril()
        attn_mask = _additive_mask(keep, acc)
    elif attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = _additive_mask(attn_mask, acc)
    groups = query.shape[1] // key.shape[1]
    if groups != 1:
        k, v = k.repeat_interleave(groups, -3), v.repeat_interleave(groups, -3)
    scores = torch.matmul(q * (-factor if scale < 0 else factor), k.transpose(-2, -1) * factor)
    if attn_mask is not None:
        scores = scores + attn_mask
    probs = torch.exp(scores - logsumexp.to(acc).unsqueeze(-1))
    grad_v = torch.matmul(probs.transpose(-2, -1), d_out)
    grad_probs = torch.matmul(d_out, v.transpose(-2, -1))
    grad_scores = probs * (grad_probs - (d_out * o).sum(-1, keepdim=True))
    grad_q = torch.matmul(grad_scores, k) * scale
    grad_k = torch.matmul(grad_scores.transpose(-2, -1), q) * scale
    if groups != 1:
        b, h, s, e = key.shape
        grad_k = grad_k.view(b, h, groups, s, e).sum(2)
        grad_v = grad_v.view(b, h, groups, s, value.shape[-1]).sum(2)
    return grad_q.to(query.dtype), grad_k.to(key.dtype), grad_v.to(value.dtype)


def pow_scalar_base(base: float | bool, exponent: Tensor) -> Tensor:
    """`base ** exponent` (fp32, fp64) for a base in (0, 1] (Adam's bias corrections `beta ** step`) as
    exp(exponent * log(base)): 1 at exponent 0, NaN for NaN, 0 / inf for an infinite exponent, as pow; within
    a few ulp elsewhere (the relative error grows with |exponent * log(base)| * 2^-24); 1 ** x = 1. Other bases
    are left to the op (NotImplemented), whose lowering takes small integer exponents by squaring: 0 and
    negative bases (signs), and bases > 1, whose integer powers are exact (2 ** 10 = 1024; exp(10 log 2) is
    1024.0001). For a base near 1 squaring would be the less accurate (its error doubles every square)."""
    if isinstance(base, bool) or not isinstance(base, int | float) or not 0 < base <= 1:
        return NotImplemented  # type: ignore[return-value]
    dtype = exponent.dtype if exponent.is_floating_point() else torch.get_default_dtype()
    if dtype not in (torch.float32, torch.float64):
        return NotImplemented  # type: ignore[return-value]
    # pow reads the base in the result's dtype: 0.999 in fp32 is 0.99900001, which makes 1.3e-5 at step 1000
    rounded = struct.unpack("f", struct.pack("f", base))[0] if dtype == torch.float32 else float(base)
    if rounded == 1.0:  # 1 ** x is 1 for every x, NaN and infinities included (exp(inf * 0) would be NaN)
        return torch.full_like(exponent, 1.0, dtype=dtype)
    return torch.exp(exponent.to(dtype) * math.log(rounded))


def _additive_mask(keep: Tensor, dtype: torch.dtype) -> Tensor:
    """0 where `keep`, -inf elsewhere (ATen's convert_boolean_attn_mask)."""
    zero = torch.zeros((), dtype=dtype, device=keep.device)
    return torch.where(keep, zero, torch.full((), -math.inf, dtype=dtype, device=keep.device))
