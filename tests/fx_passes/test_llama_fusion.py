"""The tiny Hugging Face Llama end to end: every pattern fuses, and the logits (and KV cache) match eager."""

from __future__ import annotations

import pytest
import torch
import transformers
from fx_helpers import Traced, aot_trace, assert_outputs_close, ctpu_ops, passes_verified, run_graph


def tiny_llama(attn_implementation: str, dtype: torch.dtype) -> transformers.LlamaForCausalLM:
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
        attn_implementation=attn_implementation,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).eval().to(dtype)


def trace_llama(attn_implementation: str, dtype: torch.dtype) -> Traced:
    model = tiny_llama(attn_implementation, dtype)

    def forward(ids: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = model(ids)
        cache = [t for layer in out.past_key_values.layers for t in (layer.keys, layer.values)]
        return out.logits, *cache

    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    return aot_trace(forward, ids)


def expected_ops(layers: int = 2) -> dict[str, int]:
    return {
        "rms_norm": 2 * layers + 1,
        "attention": layers,
        "swiglu": layers,
        "rope": 2 * layers,  # q and k
        "linear": 7 * layers + 1,  # q, k, v, o, gate, up, down; lm_head
    }


def check_llama(traced: Traced) -> None:
    report = passes_verified(traced)
    ops = ctpu_ops(traced.gm)
    assert {name: ops.count(name) for name in expected_ops()} == expected_ops()
    assert report.fallback_ops == []
    # The graph's outputs hold the logits and the KV cache, in the function's order.
    assert_outputs_close(run_graph(traced.gm, traced.inputs), list(traced.eager), "fused Llama vs eager")


def test_tiny_llama_fp32() -> None:
    traced = trace_llama("sdpa", torch.float32)
    check_llama(traced)
    logits = run_graph(traced.gm, traced.inputs)[0]
    torch.testing.assert_close(logits, traced.eager[0], atol=1e-5, rtol=1e-5)
    attention = [n for n in traced.gm.graph.nodes if str(n.target) == "ctpu.attention.default"]
    # The causal mask Hugging Face builds from aranges is recognised and dropped.
    assert all(n.args[3] is None and n.args[4] is True for n in attention)
    # Grouped-query attention: k and v keep their 2 heads, the op repeats them.
    assert all(n.args[1].meta["val"].shape[1] == 2 for n in attention)


@pytest.mark.parametrize(
    ("attn_implementation", "dtype"), [("eager", torch.float32), ("sdpa", torch.bfloat16)]
)
def test_tiny_llama_other_forms(attn_implementation: str, dtype: torch.dtype) -> None:
    check_llama(trace_llama(attn_implementation, dtype))
