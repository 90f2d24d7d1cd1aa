"""Left-padded batches (attention_mask with zeros on the left) on the CTPU: eager's values, no NaN.

A padded query row sees no key at all. Eager SDPA (torch._safe_softmax) gives 0 there, Hugging Face's eager
attention (an additive finfo.min mask, a plain softmax) the mean of v; the compiled model must give the
same, whichever attention the graph holds (issue 16 item 6, issue 11 item 3: the CTPU gave NaN logits for
the whole padded row with SDPA).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import torch_tpu_backend.stats as ctpu_stats
from torch_tpu_backend.llama_demo import TOLERANCE, tiny_llama


@pytest.fixture(autouse=True)
def highest(fresh_compile: None) -> None:
    torch.set_float32_matmul_precision("highest")  # fresh_compile restores it


def left_padded(batch: int, length: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and an attention mask whose row b starts with 2 b padding positions."""
    ids = torch.randint(0, 128, (batch, length), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for b in range(1, batch):
        mask[b, : 2 * b] = 0
    return ids, mask


def padded_llama(attention: str) -> torch.nn.Module:
    model = tiny_llama()
    model.config._attn_implementation = attention
    return model


# CI time: Hugging Face's eager attention at batch 3 in CI; SDPA `slow` (17-19 s each): in CI the padded
# batch of 3 runs through SDPA in test_greedy_generate_with_a_static_cache_gives_eagers_tokens[3]
@pytest.mark.parametrize("batch,attention", [pytest.param(2, "sdpa", marks=pytest.mark.slow),
                                             pytest.param(3, "sdpa", marks=pytest.mark.slow), (3, "eager")])
def test_forward_logits_are_eager(batch: int, attention: str) -> None:
    model = padded_llama(attention)
    ids, mask = left_padded(batch)
    with torch.no_grad():
        expected = model(ids, attention_mask=mask).logits
        logits = torch.compile(model, backend="ctpu")(ids, attention_mask=mask).logits
    assert not expected.isnan().any()
    torch.testing.assert_close(logits, expected, rtol=TOLERANCE[torch.float32][0], atol=TOLERANCE[torch.float32][1])
    assert ctpu_stats.last().kernels_launched >= 1


def generate(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, use_cache=True,
                              cache_implementation="static", pad_token_id=0)


@pytest.mark.parametrize("batch", [3, pytest.param(2, marks=pytest.mark.slow)])
def test_greedy_generate_with_a_static_cache_gives_eagers_tokens(batch: int) -> None:
    """Prefill and decode compiled (the cache update may still run on the CPU: parity is the point)."""
    model = padded_llama("sdpa")
    ids, mask = left_padded(batch)
    expected = generate(model, ids, mask)
    model.forward = torch.compile(model.forward, backend="ctpu")
    tokens = generate(model, ids, mask)
    assert torch.equal(tokens, expected), (tokens.tolist(), expected.tolist())
    assert ctpu_stats.last().kernels_launched >= 1


def test_sdpa_on_large_with_head_dim_64_and_fully_masked_rows() -> None:
    """A realistic shape on `large`: head dim 64, 37 (odd) queries and keys, grouped-query heads, one
    sequence left-padded by 5 (its first 5 queries see no key)."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 8, 37, 64, generator=g)
    k, v = torch.randn(2, 2, 37, 64, generator=g), torch.randn(2, 2, 37, 64, generator=g)
    keep = torch.ones(37, 37, dtype=torch.bool).tril().expand(2, 1, 37, 37).clone()
    keep[1, :, :, :5] = False

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, enable_gqa=True)

    expected = attend(q, k, v, keep)
    assert (expected[1, :, :5] == 0).all()
    with torch.no_grad():
        out = torch.compile(attend, backend="ctpu", options={"config": "large"})(q, k, v, keep)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    s = ctpu_stats.last()
    assert s.kernels_launched == 1 and not s.fallback_ops, s.as_dict()
