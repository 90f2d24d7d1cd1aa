"""Mixture-of-experts routing on the CTPU (fx_passes/routing.py): sort, topk, histc, integer floor division and
the experts' grouped matmul compile with backend="ctpu" into CTPU programs with no CPU op, and give eager's
results: exactly for the routing (orders, counts, indices), to matmul tolerance for the experts."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch

import torch_tpu_backend.stats as ctpu_stats

NAN, INF = float("nan"), float("inf")


def _on_ctpu(fn: Callable[..., Any], *args: Any, config: str = "small") -> Any:
    """fn compiled for the CTPU and called: every op ran there."""
    torch._dynamo.reset()
    ctpu_stats.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a CPU fallback warns: fail on it
        got = torch.compile(fn, backend="ctpu", options={"cache": False, "config": config})(*args)
    s = ctpu_stats.last()
    assert s.kernels_launched >= 1 and dict(s.fallback_ops) == {}, s.as_dict()
    return got


def _same(got: Any, expected: Any) -> None:
    for g, e in zip(got, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("descending", [False, True])
def test_sort_with_ties_nan_and_signed_zeros(descending: bool) -> None:
    x = torch.randint(-2, 3, (3, 33), generator=torch.Generator().manual_seed(0)).float()
    x.view(-1)[::7], x.view(-1)[3::11], x.view(-1)[5::13], x[1, 4] = NAN, -0.0, -INF, 3.4e38

    def fn(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sort(v, dim=-1, descending=descending, stable=True)

    _same(_on_ctpu(fn, x), fn(x))


def test_the_routing_of_an_moe_layer() -> None:
    """Hugging Face's grouped-mm experts: the slots sorted by expert, each slot's token (a floor division),
    the tokens per expert (histc) and their offsets (cumsum), for 17 tokens, top-2 of 8 experts (ties are
    every expert chosen twice or more: a stable order)."""
    top_k_index = torch.randint(0, 8, (17, 2), generator=torch.Generator().manual_seed(1))

    def route(index: torch.Tensor) -> tuple[torch.Tensor, ...]:
        expert_ids, perm = torch.sort(index.reshape(-1), stable=True)
        counts = torch.histc(expert_ids.float(), bins=8, min=0, max=7)
        return expert_ids, perm, perm // 2, counts, torch.cumsum(counts, dim=0, dtype=torch.int32)

    _same(_on_ctpu(route, top_k_index), route(top_k_index))


def test_router_topk_of_softmax() -> None:
    logits = torch.randn(17, 8, generator=torch.Generator().manual_seed(2))

    def router(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weights, index = torch.topk(torch.softmax(x, -1), 2, dim=-1)
        lowest = torch.topk(x, 3, dim=-1, largest=False)
        return weights / weights.sum(-1, keepdim=True), index, *lowest

    got, expected = _on_ctpu(router, logits), router(logits)
    torch.testing.assert_close(got[0], expected[0])  # the softmax: a few ulp
    _same(got[1:], expected[1:])


def test_histc_counts_values_on_bin_boundaries() -> None:
    edges = torch.linspace(-1.0, 1.0, 11)
    x = torch.cat([edges, torch.nextafter(edges, edges + 1), torch.nextafter(edges, edges - 1),
                   torch.tensor([NAN, INF, -INF, -0.0, 0.0, 1.5, -1.5])]).reshape(5, -1)
    fn = lambda v: torch.histc(v, bins=10, min=-1.0, max=1.0)
    _same([_on_ctpu(fn, x)], [fn(x)])


@pytest.mark.parametrize("rounding_mode", ["floor", "trunc"])
def test_integer_division_by_a_constant(rounding_mode: str) -> None:
    """Exact over int32: the corrections are integer ops on the CTPU (through f32 only to 2^24)."""
    a = torch.cat([torch.arange(-20, 20), torch.tensor([2**24, -(2**24), 2**24 - 1, -(2**24) + 3, 1_000_001,
                                                        2**24 + 1, 2**31 - 1, -(2**31) + 1, 987_654_321])])
    fn = lambda v: (torch.div(v, 3, rounding_mode=rounding_mode), torch.div(v, -7, rounding_mode=rounding_mode))
    _same(_on_ctpu(fn, a), fn(a))


def test_grouped_matmul_fp32_and_bf16() -> None:
    import transformers.integrations.moe  # noqa: F401  registers transformers::grouped_mm_fallback

    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(18, 16, generator=g), torch.randn(8, 16, 24, generator=g)
    offs = torch.tensor([2, 2, 7, 9, 9, 13, 18, 18], dtype=torch.int32)  # empty groups
    hf = lambda a, b, o: torch.ops.transformers.grouped_mm_fallback(a, b, o)
    torch.testing.assert_close(_on_ctpu(hf, x, w, offs), hf(x, w, offs), rtol=1e-5, atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    ours = lambda a, b, o: torch._grouped_mm(a, b, offs=o)
    torch.testing.assert_close(_on_ctpu(ours, xb, wb, offs), ours(xb, wb, offs), rtol=0, atol=0)


def test_a_mixtral_moe_block_at_model_shape_on_large() -> None:
    """Hidden 1024, 8 experts of intermediate 256, top-2, 17 tokens (odd), fp32, on `large`: one CTPU program."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MixtralConfig(hidden_size=1024, intermediate_size=256, num_local_experts=8,
                                        num_experts_per_tok=2, num_hidden_layers=1, vocab_size=16)
    torch.manual_seed(4)
    block = transformers.MixtralForCausalLM(config).model.layers[0].mlp.eval()  # as the model sets it up
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.03)
    x = torch.randn(1, 17, 1024)
    with torch.no_grad():
        expected = block(x)
        got = _on_ctpu(block, x, config="large")
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
