"""The `ctpu` custom operators: the fused nodes that `fx_passes` forms and the back ends lower.

Each op (schemas in docs/fused_ops.md) has
- a CPU reference written in ATen ops: the eager semantics every back end is checked against, and what a
  fused graph computes when it runs on CPU;
- a fake (meta) implementation giving shape, dtype and a contiguous layout, so graphs holding these ops
  trace under FakeTensor, torch.export and make_fx.

The references mirror what the core-ATen decompositions of the matched patterns compute (for example
SiLU on bf16 upcasts to fp32, applies x * sigmoid(x), and casts back), so a fused graph agrees with the
unfused graph to rounding. Every op returns a new contiguous tensor. The ops are inference-only: no
autograd formula is registered.

The reference is also each op's core-ATen decomposition (`decomposition`): traced with torch's core-ATen
decompositions it is what a back end that does not claim the op lowers, and every back end that claims an
op (codegen's CTPU_TABLE, ptx_kernels' registry) is tested against it on the edge cases (fully masked
rows, -inf scores, NaN, bf16, empty dims: tests/fx_passes/test_fused_op_parity.py).

Importing this module registers the ops once; importing it again (or reloading it) is a no-op.
"""

import math

import torch
import torch.nn.functional as F
from torch import Tensor

NAMESPACE = "ctpu"
LINEAR_ACTIVATIONS = ("none", "relu", "silu", "gelu", "gelu_tanh")
SWIGLU_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


def upcast(t: Tensor) -> Tensor:
    """fp32 copy of a 16-bit float tensor; other dtypes unchanged (fp32 math, as the vector unit does)."""
    return t.float() if t.dtype in _LOW_PRECISION else t


def apply_activation(y: Tensor, act: str) -> Tensor:
    """act(y) for the activation names of ctpu::linear / ctpu::swiglu."""
    if act == "none":
        return y
    if act == "relu":
        return torch.relu(y)
    if act == "silu":
        # Same sequence as the core-ATen decomposition of silu, so fused == unfused bit for bit.
        yf = upcast(y)
        return (yf * torch.sigmoid(yf)).to(y.dtype)
    if act == "gelu":
        return F.gelu(y)
    if act == "gelu_tanh":
        return F.gelu(y, approximate="tanh")
    raise ValueError(f"ctpu: unknown activation {act!r}; expected one of {LINEAR_ACTIVATIONS}")


def causal_keep_mask(length: int, keys: int, device: torch.device | None = None) -> Tensor:
    """[length, keys] bool: query i keeps key j when j <= i + keys - length (aligned bottom-right)."""
    rows = torch.arange(length, device=device)[:, None]
    return torch.arange(keys, device=device)[None, :] <= rows + (keys - length)


# ---------------------------------------------------------------------------------------------------
# CPU references


def rms_norm_ref(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """weight * (x * rsqrt(mean(x^2, -1) + eps)): normalised in fp32, cast to x.dtype, then scaled by
    the weight in the promoted dtype (the Hugging Face Llama order, exact for bf16 models)."""
    xf = upcast(x)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    if weight is not None:
        y = weight * y
    return y.contiguous()


def layer_norm_ref(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    """Layer norm over the last dim, computed in fp32 (weight and bias applied in fp32), cast to x.dtype."""
    xf = upcast(x)
    var, mean = torch.var_mean(xf, -1, correction=0, keepdim=True)
    y = (xf - mean) * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).contiguous()


def softmax_ref(x: Tensor, dim: int) -> Tensor:
    """Max-subtracted softmax along dim, in fp32, cast to x.dtype."""
    return torch.softmax(upcast(x), dim).to(x.dtype).contiguous()


def swiglu_ref(gate: Tensor, up: Tensor, act: str) -> Tensor:
    """act(gate) * up."""
    if act not in SWIGLU_ACTIVATIONS:
        raise ValueError(f"ctpu::swiglu: unknown activation {act!r}; expected one of {SWIGLU_ACTIVATIONS}")
    return (apply_activation(gate, act) * up).contiguous()


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1) over the last dim."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return (x * cos + rotated * sin).contiguous()


def attention_ref(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float, safe: bool = True,
    kv_len: Tensor | None = None,
) -> Tensor:
    """softmax(q @ k^T * scale + mask) @ v in fp32, cast to q.dtype. With bf16 q and v the probabilities
    meet v in bf16, unnormalised: exp(scores - rowmax) rounded to bf16, times v, over the fp32 row sum (a
    flash-style kernel's P @ V; eager's bf16 attention rounds the normalised probabilities instead, the
    same relative error, 2^-9; a kernel tiled over keys rounds exp(scores - running max), equal up to that
    rounding).

    q [B, Hq, L, D], k/v [B, Hkv, S, D] with Hq % Hkv == 0: query head h reads kv head h // (Hq // Hkv)
    (Hugging Face repeat_kv). mask: additive float or boolean keep-mask broadcastable to [B, Hq, L, S].
    causal keeps key j for query i when j <= i + S - L (the last query sees every key).

    safe says which softmax the fused graph had, so the op means exactly what the graph did:
    True: torch._safe_softmax (what F.scaled_dot_product_attention uses): a query row whose scores are all
    -inf (every key masked, as in a left-padded batch) gives zeros; False: torch.softmax (Hugging Face's
    "eager" attention, a hand-written softmax): that row is NaN. NaN scores give NaN rows either way.

    A value row holding inf or NaN reaches every row here through 0 * inf, the rows that mask its key too (as
    eager's math SDPA); a compiled causal attention's query blocks never read the keys after their last
    query (as eager's flash SDPA on the CPU skips those key blocks), so rows before such a key may be finite
    there. The rows that see the key agree.

    kv_len (a 0-d integer tensor, or None): only the first kv_len keys are there; the others (a key dim padded
    to a bucket's size: fx_passes.dynamic) have -inf scores and their values are never read (whatever they
    hold, inf and NaN included). causal still aligns with S, the padded length.
    """
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    length, keys = q.shape[-2], k.shape[-2]
    present = None if kv_len is None else torch.arange(keys, device=q.device) < kv_len
    if present is not None:
        k = torch.where(present[:, None], k, torch.zeros((), dtype=k.dtype))
        v = torch.where(present[:, None], v, torch.zeros((), dtype=v.dtype))
    scores = torch.matmul(upcast(q), upcast(k).transpose(-2, -1)) * scale
    if present is not None:
        scores = scores.masked_fill(~present, -math.inf)
    if causal:
        keep = causal_keep_mask(length, keys, q.device)
        scores = scores.masked_fill(~keep, -math.inf)
    if mask is not None:
        scores = scores.masked_fill(~mask, -math.inf) if mask.dtype == torch.bool else scores + mask
    if q.dtype == v.dtype == torch.bfloat16 and keys > 0:
        top = scores.amax(-1, keepdim=True)
        unnormalised = torch.exp(scores - torch.where(top == -math.inf, 0.0, top))  # all keys masked: 0s
        out = torch.matmul(unnormalised.bfloat16().float(), upcast(v)) / unnormalised.sum(-1, keepdim=True)
        if safe:  # a row with every key masked is 0 / 0 = NaN, as torch.softmax's; safe softmax makes it 0
            out = torch.where(top == -math.inf, 0.0, out)
        return out.to(q.dtype).contiguous()
    probs = torch.softmax(scores, dim=-1)
    if safe and keys > 0:  # no keys: probs is empty and the product 0 anyway
        # torch._safe_softmax tests all(scores == -inf); amax is -inf exactly then (amax propagates NaN).
        probs = torch.where(scores.amax(-1, keepdim=True) == -math.inf, 0.0, probs)
    return torch.matmul(probs, upcast(v)).to(q.dtype).contiguous()


def linear_ref(x: Tensor, w: Tensor, bias: Tensor | None, act: str, residual: Tensor | None) -> Tensor:
    """act(x @ w + bias) + residual for x [..., K] and w [K, N]."""
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])  # not reshape(-1, K): K may be 0
    if bias is not None and bias.dtype == x2.dtype:
        # One rounding of the bias-accumulated product, as the matrix unit's fp32 accumulator gives.
        y = torch.addmm(bias, x2, w)
    else:
        y = torch.mm(x2, w)
        if bias is not None:
            y = y + bias
    y = apply_activation(y.reshape(*x.shape[:-1], w.shape[-1]), act)
    if residual is not None:
        y = y + residual
    return y.contiguous()


# ---------------------------------------------------------------------------------------------------
# Fake implementations: metadata only, contiguous outputs (like the references).


def _promote(*tensors: Tensor | None) -> torch.dtype:
    dtypes = [t.dtype for t in tensors if t is not None]
    result = dtypes[0]
    for dtype in dtypes[1:]:
        result = torch.promote_types(result, dtype)
    return result


def _rms_norm_fake(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    return x.new_empty(x.shape, dtype=_promote(x, weight))


def _layer_norm_fake(x: Tensor, weight: Tensor | None, bias: Tensor | None, eps: float) -> Tensor:
    return x.new_empty(x.shape)


def _softmax_fake(x: Tensor, dim: int) -> Tensor:
    return x.new_empty(x.shape)


def _swiglu_fake(gate: Tensor, up: Tensor, act: str) -> Tensor:
    return gate.new_empty(torch.broadcast_shapes(gate.shape, up.shape), dtype=_promote(gate, up))


def _rope_fake(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    shape = torch.broadcast_shapes(x.shape, cos.shape, sin.shape)
    return x.new_empty(shape, dtype=_promote(x, cos, sin))


def _attention_fake(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, causal: bool, scale: float, safe: bool = True,
    kv_len: Tensor | None = None,
) -> Tensor:
    return q.new_empty((*q.shape[:-1], v.shape[-1]))


def _linear_fake(x: Tensor, w: Tensor, bias: Tensor | None, act: str, residual: Tensor | None) -> Tensor:
    shape = torch.Size((*x.shape[:-1], w.shape[-1]))
    if residual is not None:
        shape = torch.broadcast_shapes(shape, residual.shape)
    return x.new_empty(shape, dtype=_promote(x, w, bias, residual))


_OPS = {
    "rms_norm": (rms_norm_ref, _rms_norm_fake),
    "layer_norm": (layer_norm_ref, _layer_norm_fake),
    "softmax": (softmax_ref, _softmax_fake),
    "swiglu": (swiglu_ref, _swiglu_fake),
    "rope": (rope_ref, _rope_fake),
    "attention": (attention_ref, _attention_fake),
    "linear": (linear_ref, _linear_fake),
}
OP_NAMES = tuple(_OPS)


def _register() -> None:
    for name, (reference, fake) in _OPS.items():
        if hasattr(getattr(torch.ops, NAMESPACE), name):
            continue  # already registered by an earlier import (or a reload) of this module
        op = torch.library.custom_op(f"{NAMESPACE}::{name}", reference, mutates_args=())
        op.register_fake(fake)


_register()


def decomposition(name: str, *args: object) -> torch.fx.GraphModule:
    """The op's core-ATen graph at these arguments: its reference traced with torch's core-ATen
    decompositions (tensor arguments become placeholders, the others are baked in)."""
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    reference = _OPS[name][0]
    tensors = [i for i, a in enumerate(args) if isinstance(a, Tensor)]

    def call(*values: Tensor) -> Tensor:
        full = list(args)
        for i, value in zip(tensors, values, strict=True):
            full[i] = value
        return reference(*full)

    return make_fx(call, decomposition_table=core_aten_decompositions())(*(args[i] for i in tensors))


def ctpu_op(name: str) -> torch._ops.OpOverload:
    """torch.ops.ctpu.<name>.default."""
    return getattr(torch.ops, NAMESPACE).__getattr__(name).default


def is_ctpu_op(target: object) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == NAMESPACE
