"""Pattern fusion golden tests: RMSNorm, LayerNorm, softmax (fp32 and bf16, positive and negative)."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from fx_helpers import GraphVerifier, aten_targets, count, ctpu_node, fuse, run_graph
from torch._decomp import get_decompositions
from torch.fx.experimental.proxy_tensor import make_fx
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from fx_passes import run_passes

aten = torch.ops.aten
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("dtype", DTYPES)
def test_hugging_face_llama_rms_norm(dtype: torch.dtype) -> None:
    norm = LlamaRMSNorm(16, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    gm, report = fuse(norm, torch.randn(2, 3, 16, dtype=dtype))
    assert count(gm, "rms_norm") == 1 and report.fusions["rms_norm"] == 1
    assert not {"aten.rsqrt.default", "aten.mean.dim", "aten._to_copy.default"} & aten_targets(gm)
    x, weight, eps = ctpu_node(gm, "rms_norm").args
    assert (x.op, weight.op, eps) == ("placeholder", "placeholder", 1e-5)


def test_rms_norm_without_weight_and_with_x_times_x() -> None:
    gm, _ = fuse(lambda x: x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6), torch.randn(4, 8))
    assert ctpu_node(gm, "rms_norm").args[1] is None


def test_rms_norm_over_another_dim_does_not_fuse() -> None:
    gm, _ = fuse(lambda x: x * torch.rsqrt(x.pow(2).mean(0, keepdim=True) + 1e-6), torch.randn(4, 8))
    assert count(gm, "rms_norm") == 0


def test_rms_norm_with_a_non_vector_weight_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    def fn(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))

    with caplog.at_level(logging.DEBUG, logger="ctpu.fusion"):
        gm, _ = fuse(fn, torch.randn(4, 8), torch.randn(4, 8))
    # The normalisation itself still fuses, without the weight.
    assert ctpu_node(gm, "rms_norm").args[1] is None
    assert "no rms_norm at mul_1: weight (4, 8) is not [D] for x (4, 8)" in caplog.text


def test_rms_norm_cast_to_another_dtype_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    def fn(x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).half()

    with caplog.at_level(logging.DEBUG, logger="ctpu.fusion"):
        gm, _ = fuse(fn, torch.randn(4, 8, dtype=torch.bfloat16))
    assert "cast to torch.float16 of a value not upcast from torch.float16" in caplog.text
    # Fused without the final cast: rms_norm of the fp32 value.
    assert ctpu_node(gm, "rms_norm").meta["val"].dtype == torch.float32


@pytest.mark.parametrize("dtype", DTYPES)
def test_layer_norm_module(dtype: torch.dtype) -> None:
    norm = torch.nn.LayerNorm(16).to(dtype)
    gm, _ = fuse(norm, torch.randn(2, 3, 16, dtype=dtype))
    assert count(gm, "layer_norm") == 1 and "aten.native_layer_norm.default" not in aten_targets(gm)


def test_layer_norm_without_affine() -> None:
    gm, _ = fuse(lambda x: F.layer_norm(x, (16,)), torch.randn(3, 16))
    assert ctpu_node(gm, "layer_norm").args[1:3] == (None, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("affine", [True, False])
def test_decomposed_layer_norm(dtype: torch.dtype, affine: bool) -> None:
    decompositions = get_decompositions([aten.native_layer_norm])
    w, b = (torch.randn(16, dtype=dtype), torch.randn(16, dtype=dtype)) if affine else (None, None)
    x = torch.randn(2, 3, 16, dtype=dtype)
    gm = make_fx(lambda x: F.layer_norm(x, (16,), w, b), decomposition_table=decompositions)(x)
    assert "aten.var_mean.correction" in aten_targets(gm)
    verifier = GraphVerifier([x], run_graph(gm, [x]))
    run_passes(gm, [x], strict=True, verify=verifier)
    assert count(gm, "layer_norm") == 1 and "aten.var_mean.correction" not in aten_targets(gm)


def test_layer_norm_over_two_dims_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.DEBUG, logger="ctpu.fusion"):
        gm, _ = fuse(lambda x: F.layer_norm(x, (4, 16)), torch.randn(2, 4, 16))
    assert count(gm, "layer_norm") == 0
    assert "normalises over [4, 16], not the last dim" in caplog.text


@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax(dtype: torch.dtype) -> None:
    gm, _ = fuse(lambda x: torch.softmax(x, 1), torch.randn(2, 5, 3, dtype=dtype))
    assert ctpu_node(gm, "softmax").args[1] == 1


def test_softmax_in_fp32_of_a_bf16_tensor_takes_the_bf16_input() -> None:
    fn = lambda x: torch.softmax(x, -1, dtype=torch.float32).to(x.dtype)
    gm, _ = fuse(fn, torch.randn(4, 8, dtype=torch.bfloat16))
    assert ctpu_node(gm, "softmax").args[0].op == "placeholder"
    assert "aten._to_copy.default" not in aten_targets(gm)


def test_decomposed_softmax() -> None:
    def fn(x):
        e = torch.exp(x - x.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    gm, _ = fuse(fn, torch.randn(4, 8))
    assert count(gm, "softmax") == 1 and "aten.exp.default" not in aten_targets(gm)


def test_softmax_like_with_mismatched_dims_does_not_fuse() -> None:
    def fn(x):
        e = torch.exp(x - x.amax(0, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    gm, _ = fuse(fn, torch.randn(4, 8))
    assert count(gm, "softmax") == 0


def test_log_softmax_does_not_fuse() -> None:
    gm, _ = fuse(lambda x: torch.log_softmax(x, -1), torch.randn(4, 8))
    assert count(gm, "softmax") == 0
