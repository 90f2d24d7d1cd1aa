"""The ctpu custom operators: references against independent formulas, fake vs real metadata,
torch.library.opcheck, tracing with make_fx and torch.export, idempotent registration."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

import fx_passes.ops
from fx_passes.ops import OP_NAMES, ctpu_op

ctpu = torch.ops.ctpu


def sample_args(name: str, dtype: torch.dtype = torch.float32) -> tuple:
    """Representative arguments of each op (non-contiguous w for linear, grouped-query attention)."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)
    return {
        "rms_norm": (r(2, 3, 8), r(8), 1e-6),
        "layer_norm": (r(2, 3, 8), r(8), r(8), 1e-5),
        "softmax": (r(2, 3, 8), -1),
        "swiglu": (r(2, 3, 8), r(2, 3, 8), "silu"),
        "rope": (r(1, 2, 5, 8), r(1, 1, 5, 8), r(1, 1, 5, 8)),
        "attention": (r(1, 4, 5, 8), r(1, 2, 6, 8), r(1, 2, 6, 8), None, True, 0.3),
        "linear": (r(2, 3, 8), r(4, 8).t(), r(4), "gelu", r(2, 3, 4)),
    }[name]


@pytest.mark.parametrize("name", OP_NAMES)
def test_opcheck(name: str) -> None:
    """Schema, fake tensor, and AOT dispatch consistency as torch.library checks them."""
    torch.library.opcheck(ctpu_op(name), sample_args(name))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", OP_NAMES)
def test_fake_matches_real(name: str, dtype: torch.dtype) -> None:
    args = sample_args(name, dtype)
    real = ctpu_op(name)(*args)
    mode = FakeTensorMode()
    fake_args = tuple(mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args)
    with mode:
        fake = ctpu_op(name)(*fake_args)
    assert (fake.shape, fake.dtype, fake.stride()) == (real.shape, real.dtype, real.stride())
    assert real.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hugging_face_llama_rms_norm(dtype: torch.dtype) -> None:
    norm = LlamaRMSNorm(8, eps=1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(8))
    x = torch.randn(2, 3, 8).to(dtype)
    with torch.no_grad():
        expected = norm(x)
    torch.testing.assert_close(ctpu.rms_norm(x, norm.weight, 1e-6), expected, atol=0, rtol=0)
    torch.testing.assert_close(ctpu.rms_norm(x, None, 1e-6), expected / norm.weight, atol=2e-2, rtol=2e-2)


def test_layer_norm_and_softmax_references() -> None:
    x, w, b = torch.randn(2, 3, 8), torch.randn(8), torch.randn(8)
    torch.testing.assert_close(ctpu.layer_norm(x, w, b, 1e-5), F.layer_norm(x, (8,), w, b, 1e-5))
    torch.testing.assert_close(ctpu.layer_norm(x, None, None, 1e-5), F.layer_norm(x, (8,), eps=1e-5))
    torch.testing.assert_close(ctpu.softmax(x, 1), torch.softmax(x, 1))
    x16 = x.bfloat16()
    expected = torch.softmax(x16.float(), -1).bfloat16()
    torch.testing.assert_close(ctpu.softmax(x16, -1), expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    ("act", "reference"),
    [("silu", F.silu), ("gelu", F.gelu), ("gelu_tanh", lambda t: F.gelu(t, approximate="tanh"))],
)
def test_swiglu_reference(act: str, reference) -> None:
    gate, up = torch.randn(4, 16), torch.randn(4, 16)
    torch.testing.assert_close(ctpu.swiglu(gate, up, act), reference(gate) * up)


def test_swiglu_and_linear_reject_unknown_activation() -> None:
    with pytest.raises(ValueError, match="unknown activation"):
        ctpu.swiglu(torch.randn(2), torch.randn(2), "relu")
    with pytest.raises(ValueError, match="unknown activation"):
        ctpu.linear(torch.randn(2, 3), torch.randn(3, 4), None, "tanh", None)


def test_rope_is_hugging_face_apply_rotary_pos_emb() -> None:
    q, k = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8)
    cos, sin = torch.randn(1, 5, 8), torch.randn(1, 5, 8)
    q_ref, k_ref = apply_rotary_pos_emb(q, k, cos, sin)
    torch.testing.assert_close(ctpu.rope(q, cos[:, None], sin[:, None]), q_ref)
    torch.testing.assert_close(ctpu.rope(k, cos[:, None], sin[:, None]), k_ref)


def test_attention_matches_sdpa_grouped_query_causal() -> None:
    q, k, v = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8), torch.randn(2, 2, 6, 8)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(ctpu.attention(q, k, v, None, True, 1 / math.sqrt(8)), expected)


def test_attention_masks_and_bottom_right_causal() -> None:
    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    keep = torch.ones(3, 5, dtype=torch.bool).tril(2)  # the last query sees every key
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, scale=0.5)
    torch.testing.assert_close(ctpu.attention(q, k, v, None, True, 0.5), expected)
    torch.testing.assert_close(ctpu.attention(q, k, v, keep, False, 0.5), expected)
    additive = torch.zeros(3, 5).masked_fill(~keep, -math.inf)
    torch.testing.assert_close(ctpu.attention(q, k, v, additive, False, 0.5), expected)


def test_attention_fully_masked_row_gives_zeros() -> None:
    q, k, v = torch.randn(1, 1, 3, 4), torch.randn(1, 1, 2, 4), torch.randn(1, 1, 2, 4)
    out = ctpu.attention(q, k, v, None, True, 1.0)  # L > S: query 0 sees no key
    assert torch.equal(out[0, 0, 0], torch.zeros(4))
    assert torch.isfinite(out).all()


def test_linear_reference() -> None:
    x, w, b, res = torch.randn(2, 3, 8), torch.randn(4, 8), torch.randn(4), torch.randn(2, 3, 4)
    torch.testing.assert_close(ctpu.linear(x, w.t(), b, "relu", res), torch.relu(F.linear(x, w, b)) + res)
    torch.testing.assert_close(ctpu.linear(x, w.t(), None, "silu", None), F.silu(F.linear(x, w)))


def test_ops_survive_make_fx_and_export() -> None:
    class Block(torch.nn.Module):
        def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
            y = ctpu.linear(ctpu.rms_norm(x, None, 1e-6), w, None, "none", None)
            return ctpu.softmax(y, -1)

    x, w = torch.randn(2, 8), torch.randn(8, 4)
    expected = Block()(x, w)
    traced = make_fx(Block(), tracing_mode="fake")(x, w)
    targets = [str(n.target) for n in traced.graph.nodes if n.op == "call_function"]
    assert targets == ["ctpu.rms_norm.default", "ctpu.linear.default", "ctpu.softmax.default"]
    exported = torch.export.export(Block(), (x, w))
    assert "ctpu.linear.default" in {str(n.target) for n in exported.graph.nodes}
    torch.testing.assert_close(exported.module()(x, w), expected)


def test_registration_is_idempotent() -> None:
    schema = str(ctpu_op("rms_norm")._schema)
    importlib.reload(fx_passes.ops)  # a second definition of ctpu::rms_norm would raise here
    importlib.reload(fx_passes.ops)
    assert str(ctpu_op("rms_norm")._schema) == schema
    x = torch.randn(2, 8)
    torch.testing.assert_close(ctpu.rms_norm(x, None, 1e-6), fx_passes.ops.rms_norm_ref(x, None, 1e-6))


def test_linear_reference_with_empty_dims() -> None:
    x, w, bias = torch.randn(3, 0), torch.randn(0, 4), torch.randn(4)
    torch.testing.assert_close(torch.ops.ctpu.linear(x, w, bias, "none", None), bias.expand(3, 4))
    assert torch.ops.ctpu.linear(torch.randn(0, 5), torch.randn(5, 4), None, "relu", None).shape == (0, 4)
