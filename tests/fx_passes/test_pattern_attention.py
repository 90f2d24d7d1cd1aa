"""Pattern fusion golden tests: scaled-dot-product attention in its decomposed and direct forms."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F
from fx_helpers import GraphVerifier, aten_targets, count, ctpu_node, fuse, run_graph
from torch.fx.experimental.proxy_tensor import make_fx
from transformers.models.llama.modeling_llama import repeat_kv

from fx_passes import run_passes
from fx_passes.graph_utils import ConstantFolder
from fx_passes.ops import causal_keep_mask

DTYPES = [torch.float32, torch.bfloat16]


def qkv(
    dtype: torch.dtype = torch.float32, heads: int = 4, kv_heads: int = 2, length: int = 6, keys: int = 6
) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shapes = (1, heads, length, 8), (1, kv_heads, keys, 8), (1, kv_heads, keys, 8)
    return [torch.randn(*s, generator=g).to(dtype) for s in shapes]


def attention_args(gm):
    node = ctpu_node(gm, "attention")
    return dict(zip(("q", "k", "v", "mask", "causal", "scale", "safe"), node.args, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
def test_sdpa_causal_grouped_query(dtype: torch.dtype) -> None:
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    gm, _ = fuse(fn, *qkv(dtype))
    args = attention_args(gm)
    assert [args[n].op for n in "qkv"] == ["placeholder"] * 3  # no upcast, no repeat_kv left in front
    assert (args["mask"], args["causal"], args["scale"]) == (None, True, pytest.approx(1 / math.sqrt(8)))
    assert not {"aten.bmm.default", "aten._softmax.default", "aten.expand.default"} & aten_targets(gm)


def test_sdpa_with_boolean_mask_keeps_it_as_keep_mask() -> None:
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3)
    q, k, v = qkv(kv_heads=4)
    keep = torch.rand(6, 6) > 0.3
    keep[:, 0] = True
    gm, _ = fuse(fn, q, k, v, keep)
    args = attention_args(gm)
    assert args["mask"].op == "placeholder" and args["mask"].meta["val"].dtype == torch.bool
    assert (args["causal"], args["scale"]) == (False, pytest.approx(0.3))


def test_sdpa_with_additive_mask() -> None:
    fn = lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    q, k, v = qkv(kv_heads=4)
    gm, _ = fuse(fn, q, k, v, torch.randn(1, 1, 6, 6))
    assert attention_args(gm)["mask"].op == "placeholder"


def eager_attention(q, k, v, mask, n_rep: int, to_fp32: bool):
    """Hugging Face's eager_attention_forward (repeat_kv, matmul * scale + mask, softmax, matmul)."""
    k, v = repeat_kv(k, n_rep), repeat_kv(v, n_rep)
    scores = torch.matmul(q, k.transpose(2, 3)) * (q.shape[-1] ** -0.5) + mask
    if to_fp32:
        probs = torch.softmax(scores, -1, dtype=torch.float32).to(q.dtype)
    else:
        probs = torch.softmax(scores, -1)
    return torch.matmul(probs, v).transpose(1, 2).contiguous()


@pytest.mark.parametrize("dtype", DTYPES)
def test_eager_attention_with_constant_causal_mask(dtype: torch.dtype) -> None:
    def fn(q, k, v):
        mask = torch.full((6, 6), float("-inf"), dtype=dtype).triu(1)
        return eager_attention(q, k, v, mask, 2, to_fp32=dtype == torch.bfloat16)

    gm, _ = fuse(fn, *qkv(dtype))
    args = attention_args(gm)
    assert (args["mask"], args["causal"], args["scale"]) == (None, True, pytest.approx(8**-0.5))
    assert args["k"].op == "placeholder"  # repeat_kv is the op's job


def test_constant_mask_that_is_not_causal_stays_a_mask() -> None:
    def fn(q, k, v):
        window = torch.ones(6, 6, dtype=torch.bool).tril().triu(-2)  # sliding window of 3
        mask = torch.zeros(6, 6).masked_fill(~window, float("-inf"))
        return eager_attention(q, k, v, mask, 1, to_fp32=False)

    gm, _ = fuse(fn, *qkv(kv_heads=4))
    args = attention_args(gm)
    assert args["mask"] is not None and not args["causal"]


def test_mask_built_on_a_device_is_folded_on_the_cpu() -> None:
    """A model moved to a device builds its mask there (arange(.., device=...)); the folder evaluates it
    on the CPU, where the rules compare it with their references (a ctpu Llama's causal mask made the
    attention rule fail, and its prefill ran unfused with the masked-row guard on the CPU)."""
    def mask():
        return torch.arange(6, device="meta")[None, :] <= torch.arange(6, device="meta")[:, None]

    gm = make_fx(mask)()
    (out,) = [n for n in gm.graph.nodes if n.op == "output"]
    value = ConstantFolder(gm).value(out.args[0])
    assert value.device.type == "cpu" and (value == causal_keep_mask(6, 6)).all()


def padded_keep(length: int = 6) -> torch.Tensor:
    """Causal keep-mask of a left-padded row: keys 0..2 are padding, so queries 0..2 see no key."""
    keep = torch.ones(length, length, dtype=torch.bool).tril()
    keep[:, :3] = False
    return keep


@pytest.mark.parametrize(
    "form,safe",
    [("sdpa bool", True), ("sdpa -inf", True), ("eager -inf", False), ("eager finfo.min", False)],
)
def test_fully_masked_rows_keep_the_graphs_softmax(form: str, safe: bool) -> None:
    """SDPA zeroes a row whose keys are all masked (torch._safe_softmax), a plain softmax makes it NaN,
    a finfo.min mask makes it the mean of v: the op says which (safe) and the fused graph gives eager's
    value (fuse checks it, NaN for NaN)."""
    keep = padded_keep()
    additive = torch.zeros(6, 6).masked_fill(~keep, -math.inf)
    finfo_min = torch.zeros(6, 6).masked_fill(~keep, torch.finfo(torch.float32).min)
    fns = {
        "sdpa bool": lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=keep),
        "sdpa -inf": lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
        "eager -inf": lambda q, k, v, m: eager_attention(q, k, v, m, 1, to_fp32=False),
        "eager finfo.min": lambda q, k, v, m: eager_attention(q, k, v, finfo_min, 1, to_fp32=False),
    }
    q, k, v = qkv(kv_heads=4)
    gm, _ = fuse(fns[form], q, k, v, additive)
    assert attention_args(gm)["safe"] is safe
    out = fns[form](q, k, v, additive)
    row = out[0, :, 0] if form.startswith("sdpa") else out[0, 0]  # eager_attention returns [B, L, H, D]
    if form == "eager finfo.min":
        torch.testing.assert_close(row, v[0].mean(1))
    else:
        assert (row == 0).all() if safe else row.isnan().all()


def test_sdpa_without_mask_zeroes_rows_of_minus_inf_scores() -> None:
    """No mask, yet q = -inf makes every score of a row -inf: eager SDPA gives 0 there, and so must the
    decomposition and the fused op."""
    q, k, v = qkv(kv_heads=4)
    q[0, 1, 2] = torch.tensor([-math.inf] + [0.0] * 7)
    k[0, 1, :, 0] = 1.0
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v)
    gm, _ = fuse(fn, q, k, v)
    assert attention_args(gm)["safe"] is True
    assert (fn(q, k, v)[0, 1, 2] == 0).all()


def test_softmax_over_queries_is_not_attention(caplog: pytest.LogCaptureFixture) -> None:
    def fn(q, k, v):
        return torch.matmul(torch.softmax(torch.matmul(q, k.transpose(2, 3)), -2), v)

    with caplog.at_level(logging.DEBUG, logger="ctpu.fusion"):
        gm, _ = fuse(fn, *qkv(kv_heads=4))
    assert count(gm, "attention") == 0 and count(gm, "softmax") == 1
    assert "softmax over dim 2, not over the keys" in caplog.text


def test_dropout_in_training_is_not_attention() -> None:
    def fn(q, k, v):
        probs = F.dropout(torch.softmax(torch.matmul(q, k.transpose(2, 3)), -1), p=0.5, training=True)
        return torch.matmul(probs, v)

    gm, _ = fuse(lambda q, k, v: fn(q, k, v) * 0, *qkv(kv_heads=4))  # * 0: the random bits do not matter
    assert count(gm, "attention") == 0


@pytest.mark.parametrize("pre_dispatch", [False, True])
def test_undecomposed_sdpa(pre_dispatch: bool) -> None:
    """make_fx leaves _scaled_dot_product_flash_attention_for_cpu, or (pre-dispatch) the sdpa op itself."""
    q, k, v = qkv(kv_heads=4)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    gm = make_fx(fn, pre_dispatch=pre_dispatch)(q, k, v)
    verifier = GraphVerifier([q, k, v], run_graph(gm, [q, k, v]))
    _, report = run_passes(gm, [q, k, v], strict=True, verify=verifier)
    assert count(gm, "attention") == 1 and attention_args(gm)["causal"]
    assert report.fallback_ops == []
    torch.testing.assert_close(run_graph(gm, [q, k, v])[0], fn(q, k, v))


def test_undecomposed_top_left_causal_with_fewer_queries_logs_why(caplog: pytest.LogCaptureFixture) -> None:
    q, k, v = qkv(kv_heads=4, length=3)
    gm = make_fx(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True))(q, k, v)
    with caplog.at_level(logging.DEBUG, logger="ctpu.fusion"):
        run_passes(gm, [q, k, v], strict=True)
    assert count(gm, "attention") == 0
    assert "sdpa's causal mask is top-left aligned and L != S" in caplog.text
