"""The Llama demo: a tiny transformers LlamaForCausalLM (random weights from a fixed seed, no download)
compiled with backend="ctpu", run on a target, its logits checked against eager PyTorch on the CPU.

    ctpu llama [--target sim] [--dtype float32|bfloat16] [--tokens 8] [--json]
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

# Tolerances, from the numerics contract: fp32 with "highest" matmul precision is fp32-accurate up to
# summation order (a few ulp per op over a 2-layer model); bf16 keeps 8 significant bits per value.
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (5e-2, 5e-2)}


def tiny_llama(dtype: torch.dtype = torch.float32, seed: int = 0, layers: int = 2, hidden: int = 64,
               vocab: int = 128) -> torch.nn.Module:
    """A LlamaForCausalLM with random weights from `seed`: head dim 16, half as many KV heads as query
    heads (grouped-query attention), an MLP twice as wide as `hidden`. The defaults are the tiny Llama."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if hidden % 32:
        raise ValueError(f"hidden size {hidden} is not a multiple of 32 (head dim 16, GQA with 2 groups)")
    torch.manual_seed(seed)
    heads = hidden // 16
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=heads // 2, vocab_size=vocab,
                      max_position_embeddings=128, use_cache=False)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def run(target: str = "sim", config: str = "small", dtype: torch.dtype = torch.float32, tokens: int = 8,
        precision: str = "highest", layers: int = 2, hidden: int = 64, vocab: int = 128) -> dict[str, Any]:
    import torch_tpu_backend.stats as ctpu_stats

    model = tiny_llama(dtype, layers=layers, hidden=hidden, vocab=vocab)
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(1))
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        with torch.no_grad():
            expected = model(ids).logits.float()
            torch._dynamo.reset()
            compiled = torch.compile(model, backend="ctpu", options={"target": target, "config": config})
            ctpu_stats.reset()
            started = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                logits = compiled(ids).logits.float()
            seconds = time.perf_counter() - started
    finally:
        torch.set_float32_matmul_precision(previous)
    rtol, atol = TOLERANCE[dtype]
    err = (logits - expected).abs()
    stats = ctpu_stats.last()
    return {
        "model": f"LlamaForCausalLM(hidden {hidden}, {layers} layers, {hidden // 16} heads, {hidden // 32} KV heads, "
                 f"vocab {vocab})", "tokens": tokens,
        "dtype": str(dtype).removeprefix("torch."), "target": target, "config": config,
        "matmul_precision": precision,
        "passed": bool(torch.allclose(logits, expected, rtol=rtol, atol=atol)) and not stats.fallback_ops,
        "max_abs_err": float(err.max()), "tolerance": {"rtol": rtol, "atol": atol},
        "compile_and_run_seconds": seconds, "stats": stats.as_dict(),
        "warnings": sorted({str(w.message)[:200] for w in caught if "ctpu" in str(w.message)}),
    }


def summary(result: dict[str, Any]) -> str:
    s = result["stats"]
    lines = [f"{result['model']}, {result['tokens']} tokens, {result['dtype']}, on {result['target']} "
             f"({result['config']}): {'PASS' if result['passed'] else 'FAIL'}",
             f"  logits max abs error {result['max_abs_err']:.3g} (rtol {result['tolerance']['rtol']}, "
             f"atol {result['tolerance']['atol']})",
             f"  {s['kernels_launched']} kernel(s), {s['bundles']} bundles, {s['cycles']} cycles, MXU utilization "
             f"{s['mxu_utilization']:.3f}, DMA {s['dma_bytes_loaded'] + s['dma_bytes_stored']} bytes",
             f"  ops on the CPU: {s['fallback_ops'] or 'none'}"]
    lines += [f"  warning: {w}" for w in result["warnings"]]
    return "\n".join(lines)
