"""Whole-graph benchmarks through `torch.compile(backend="ctpu")`: the graphs of the parity suite (mini
attention block, causal GQA attention, MLP, the tiny Llama in fp32 and bf16), each compiled, run once on a
target and checked against eager PyTorch. Per graph: kernels launched, bundles issued,
cycles, ops per bundle, matrix-unit utilization, DMA bytes, compile + run seconds and the largest error.

    ctpu bench --models-only [--config small]

`generation` (in the same JSON): greedy generate() with a static KV cache through `ctpu generate`'s path,
prefill and decode cycles per token, simulated and simulator tokens/s, host bytes, CPU ops, eager parity:
the tiny Llama (fp32, "highest") on the configuration asked for, and on `large` a wider Llama-shaped model
(bf16, hidden 512, 2 layers, head dim 16, vocab 1024).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

import torch_tpu_backend.stats as ctpu_stats


class MiniAttention(torch.nn.Module):
    """x[16,64] @ w1[64,64] -> RMSNorm -> softmax -> @ w2[64,32] (the compiler issue's yardstick)."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = torch.nn.Parameter(torch.randn(64, 64) / 8)
        self.w2 = torch.nn.Parameter(torch.randn(64, 32) / 8)
        self.norm = torch.nn.RMSNorm(64, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.norm(x @ self.w1), -1) @ self.w2


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def _graphs() -> dict[str, tuple[Callable[..., Any], Callable[[], list[torch.Tensor]], str]]:
    """name -> (function, inputs, float32 matmul precision)."""
    from torch_tpu_backend.llama_demo import tiny_llama

    torch.manual_seed(0)
    mini = MiniAttention().eval()
    mlp = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.SiLU(), torch.nn.Linear(128, 64)).eval()
    llama32, llama16 = tiny_llama(torch.float32), tiny_llama(torch.bfloat16)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    return {
        "mlp_16x64x128x64_f32": (mlp, lambda: [torch.randn(16, 64)], "highest"),
        "mini_attention_16x64_f32": (mini, lambda: [torch.randn(16, 64)], "highest"),
        "attention_causal_gqa_4x2heads_16x32_f32": (
            _attention, lambda: [torch.randn(1, 4, 16, 32), torch.randn(1, 2, 16, 32), torch.randn(1, 2, 16, 32)],
            "highest"),
        "tiny_llama_f32_highest": (lambda ids: llama32(ids).logits, lambda: [ids], "highest"),
        "tiny_llama_bf16": (lambda ids: llama16(ids).logits, lambda: [ids], "highest"),
    }


@contextlib.contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _one(fn: Callable[..., Any], inputs: list[torch.Tensor], precision: str, config: str) -> dict[str, Any]:
    with _matmul_precision(precision):
        torch._dynamo.reset()
        ctpu_stats.reset()
        compiled = torch.compile(fn, backend="ctpu", options={"config": config, "cache": False})
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            t0 = time.perf_counter()
            out = compiled(*inputs)
            seconds = time.perf_counter() - t0
            ref = fn(*inputs)
    s = ctpu_stats.last()
    sim = [launch.stats for launch in s.launches]
    return {
        "matmul_precision": precision, "kernels_launched": s.kernels_launched,
        "fallback_ops": sum(s.fallback_ops.values()),
        "bundles": s.bundles, "cycles": s.cycles,
        "ops_per_bundle": round(sum(sum(st.slot_ops.values()) for st in sim) / max(s.bundles, 1), 3),
        "mxu_utilization": round(s.mxu_utilization, 4), "dma_bytes": s.dma_bytes,
        "compile_and_run_seconds": round(seconds, 3),
        "max_abs_err": float((out.float() - ref.float()).abs().max()),
    }


def run(config: str = "small", progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    out = {}
    for name, (fn, make, precision) in _graphs().items():
        if progress is not None:
            progress(name)
        out[name] = _one(fn, make(), precision, config)
    return out


GENERATION = {  # name -> (config, dtype, shape of the random-weight Llama); `None` config: the one asked for
    "tiny_llama_f32": (None, torch.float32, {}),
    "llama_hidden512_bf16_large": ("large", torch.bfloat16, {"hidden": 512, "layers": 2, "vocab": 1024}),
}


def generation(config: str = "small", new_tokens: int = 4,
               progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Prefill (8 prompt tokens) and decode figures of greedy generation with a static cache, per model."""
    from torch_tpu_backend import generate

    out = {}
    for name, (cfg, dtype, shape) in GENERATION.items():
        if progress is not None:
            progress(name)
        torch._dynamo.reset()
        with _matmul_precision("highest"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            r = generate.run(prompt_ids=[list(range(1, 9))], max_new_tokens=new_tokens, dtype=dtype,
                             config=cfg or config, check=True, **shape)
        out[name] = {"config": r["config"], "dtype": r["dtype"], "model": r["model"],
                     "prompt_tokens": r["prompt_tokens"], "new_tokens": r["new_tokens"],
                     "tokens_equal_eager": r["check"]["passed"], "wall_seconds_per_token": r["wall_seconds"] /
                     r["new_tokens"], "prefill": _phase(r["prefill"]), "decode": _phase(r["decode"])}
    return out


def _phase(p: dict[str, Any]) -> dict[str, Any]:
    keep = ("calls", "tokens", "cycles", "kernels", "cpu_ops", "host_bytes_uploaded", "host_bytes_read_back")
    return {**{k: p[k] for k in keep}, **p["figures"]}
