"""Pattern fusion golden tests: SwiGLU/GeGLU, RoPE, and matmul epilogues into ctpu::linear."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
import transformers
from fx_helpers import aten_targets, count, ctpu_node, fuse
from transformers.models.llama.modeling_llama import LlamaMLP, apply_rotary_pos_emb

DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("act", "fn"),
    [
        ("silu", lambda g, u: F.silu(g) * u),
        ("gelu", lambda g, u: u * F.gelu(g)),
        ("gelu_tanh", lambda g, u: F.gelu(g, approximate="tanh") * u),
    ],
)
def test_swiglu(act: str, fn, dtype: torch.dtype) -> None:
    gm, _ = fuse(fn, torch.randn(4, 16, dtype=dtype), torch.randn(4, 16, dtype=dtype))
    gate, up, name = ctpu_node(gm, "swiglu").args
    assert (gate.name, up.name, name) == ("arg0_1", "arg1_1", act)
    assert not {"aten.sigmoid.default", "aten.gelu.default", "aten.mul.Tensor"} & aten_targets(gm)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hugging_face_llama_mlp(dtype: torch.dtype) -> None:
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32, num_attention_heads=2)
    mlp = LlamaMLP(config).to(dtype)
    gm, _ = fuse(mlp, torch.randn(2, 3, 16, dtype=dtype))
    assert (count(gm, "swiglu"), count(gm, "linear")) == (1, 3)


def test_sigmoid_gate_is_not_swiglu() -> None:
    gm, _ = fuse(lambda g, u: torch.sigmoid(g) * u, torch.randn(4, 16), torch.randn(4, 16))
    assert count(gm, "swiglu") == 0


def test_broadcast_up_is_not_swiglu(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="ctpu.fusion"):
        gm, _ = fuse(lambda g, u: F.silu(g) * u, torch.randn(4, 16), torch.randn(16))
    assert count(gm, "swiglu") == 0
    assert "gate (4, 16) and up (16,) differ in shape" in caplog.text


@pytest.mark.parametrize("dtype", DTYPES)
def test_hugging_face_rope(dtype: torch.dtype) -> None:
    def fn(q, k, cos, sin):
        return apply_rotary_pos_emb(q, k, cos, sin)

    args = [torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 6, 8), torch.randn(1, 6, 8)]
    gm, _ = fuse(fn, *[a.to(dtype) for a in args])
    assert count(gm, "rope") == 2
    assert not {"aten.neg.default", "aten.cat.default", "aten.slice.Tensor"} & aten_targets(gm)


def test_rotation_the_other_way_is_not_rope() -> None:
    def fn(x, cos, sin):
        rotated = torch.cat((x[..., 4:], -x[..., :4]), dim=-1)
        return x * cos + rotated * sin

    gm, _ = fuse(fn, torch.randn(2, 6, 8), torch.randn(6, 8), torch.randn(6, 8))
    assert count(gm, "rope") == 0


def test_rope_that_broadcasts_x_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    def fn(x, cos, sin):
        return x * cos + torch.cat((-x[..., 4:], x[..., :4]), dim=-1) * sin

    with caplog.at_level(logging.DEBUG, logger="ctpu.fusion"):
        gm, _ = fuse(fn, torch.randn(6, 8), torch.randn(2, 6, 8), torch.randn(2, 6, 8))
    assert count(gm, "rope") == 0
    assert "cos/sin broadcast x (6, 8) to (2, 6, 8)" in caplog.text


@pytest.mark.parametrize(
    ("act", "fn"),
    [
        ("relu", torch.relu),
        ("gelu", F.gelu),
        ("gelu_tanh", lambda y: F.gelu(y, approximate="tanh")),
        ("silu", F.silu),
    ],
)
def test_linear_bias_activation_residual(act: str, fn) -> None:
    layer = torch.nn.Linear(16, 8)
    gm, _ = fuse(lambda x, r: fn(layer(x)) + r, torch.randn(2, 3, 16), torch.randn(2, 3, 8))
    x, w, bias, name, residual = ctpu_node(gm, "linear").args
    assert (x.meta["val"].shape, w.meta["val"].shape, name) == ((2, 3, 16), (16, 8), act)
    assert bias is not None and residual is not None
    assert not {"aten.mm.default", "aten.addmm.default", "aten.add.Tensor"} & aten_targets(gm)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_2d_addmm_and_bf16_silu(dtype: torch.dtype) -> None:
    layer = torch.nn.Linear(16, 8).to(dtype)
    gm, _ = fuse(lambda x: F.silu(layer(x)), torch.randn(4, 16, dtype=dtype))
    assert ctpu_node(gm, "linear").args[3] == "silu"
    assert "aten._to_copy.default" not in aten_targets(gm)


def test_broadcast_addend_is_neither_bias_nor_residual() -> None:
    gm, _ = fuse(lambda x, w, r: x @ w + r, torch.randn(4, 16), torch.randn(16, 8), torch.randn(1, 8))
    _, _, bias, _, residual = ctpu_node(gm, "linear").args
    assert (bias, residual) == (None, None) and "aten.add.Tensor" in aten_targets(gm)


def test_bmm_with_a_broadcast_weight_is_a_linear() -> None:
    gm, _ = fuse(lambda x, w: torch.relu(torch.matmul(x, w[None])), torch.randn(2, 4, 8), torch.randn(8, 3))
    x, w, _, act, _ = ctpu_node(gm, "linear").args
    assert (x.op, w.op, act) == ("placeholder", "placeholder", "relu")


def test_bmm_is_not_a_linear(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="ctpu.fusion"):
        gm, _ = fuse(lambda a, b: torch.relu(torch.bmm(a, b)), torch.randn(2, 4, 8), torch.randn(2, 8, 3))
    assert count(gm, "linear") == 0 and "aten.bmm.default" in aten_targets(gm)
    assert "bmm's right operand is batched; ctpu::linear takes w [K, N]" in caplog.text
