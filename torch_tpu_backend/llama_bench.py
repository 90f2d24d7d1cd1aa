"""`ctpu bench --llama GEOMETRY`: one Llama geometry (random bf16 weights) compiled with backend="ctpu",
greedy generate() with a static KV cache on `large`: a prefill and one decode step, both on the simulator.
Prints decode cycles per token against the HBM roofline of the configuration (every weight byte read once
plus the KV cache bytes the step must read, from the model's config), their ratio, and the prefill's MXU
utilization; `--top N` adds the decode step's N longest kernels from the profiler's roofline table.

    ctpu bench --llama 1b-2l [--prompt 17] [--top 10]
    ctpu bench --llama 1b-2l --context 4096 [--top 10]   # one decode step at a long context, no prefill
    ctpu bench --llama qwen3-0.6b-2l [--top 10]           # Qwen3-0.6B's layers (head dim 128, QK-norm)
    ctpu bench --llama 1b-2l --dynamic 17,33,129          # dynamic-shape overhead: cycles against static
"""

from __future__ import annotations

import sys
import tempfile
import warnings
from typing import Any

import torch

import torch_tpu_backend.stats as ctpu_stats
from device_sim.config import get_config

_1B = {"hidden_size": 2048, "intermediate_size": 8192, "num_attention_heads": 32, "num_key_value_heads": 8,
       "head_dim": 64, "rope_theta": 500000.0, "tie_word_embeddings": True}
GEOMETRIES: dict[str, dict[str, Any]] = {
    "1b": _1B | {"num_hidden_layers": 16, "vocab_size": 128256},  # Llama 3.2 1B
    "1b-2l": _1B | {"num_hidden_layers": 2, "vocab_size": 2048},  # its layers, two of them, a small vocab
    # the same proportions (GQA 4:1, head dim 64, MLP 4x) at a size a CI run affords
    "mini": {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 4, "num_key_value_heads": 1,
             "head_dim": 64, "rope_theta": 500000.0, "tie_word_embeddings": True, "num_hidden_layers": 2,
             "vocab_size": 512},
}
_QWEN3_06B = {"hidden_size": 1024, "intermediate_size": 3072, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "rope_theta": 1000000.0, "tie_word_embeddings": True}
QWEN3_GEOMETRIES: dict[str, dict[str, Any]] = {
    "qwen3-0.6b": _QWEN3_06B | {"num_hidden_layers": 28, "vocab_size": 151936},  # Qwen3-0.6B
    "qwen3-0.6b-2l": _QWEN3_06B | {"num_hidden_layers": 2, "vocab_size": 2048},
}


def build(geometry: str, positions: int, **overrides: Any) -> tuple[Any, torch.nn.Module]:
    """The config and a bf16 model of `geometry` (random weights, seeded) with `positions` positions;
    `overrides` replace config fields (scripts/real_scale.py: any number of layers, any vocab)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    if geometry in GEOMETRIES:
        cfg: Any = LlamaConfig(**GEOMETRIES[geometry] | overrides, max_position_embeddings=positions)
        family: Any = LlamaForCausalLM
    elif geometry in QWEN3_GEOMETRIES:
        cfg = Qwen3Config(**QWEN3_GEOMETRIES[geometry] | overrides, max_position_embeddings=positions)
        family = Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown geometry {geometry!r}; known: {', '.join([*GEOMETRIES, *QWEN3_GEOMETRIES])}")
    torch.manual_seed(0)
    return cfg, family(cfg).to(torch.bfloat16).eval()


def roofline_bytes(cfg: Any, context: int) -> dict[str, int]:
    """HBM bytes one decode step must read at least: every weight once (tied embeddings once; bf16) and the
    K and V rows of `context` cached positions in every layer."""
    h, i, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    hd = cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    qk_norms = 2 * hd if getattr(cfg, "model_type", "") == "qwen3" else 0
    layer = h * q + 2 * h * kv + q * h + 3 * h * i + 2 * h + qk_norms  # q, k, v, o, gate, up, down, norms
    embed = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    weights = 2 * (L * layer + embed + h)  # + the final norm
    return {"weight_bytes": weights, "kv_bytes": 2 * L * 2 * kv * context}


def run(geometry: str, prompt: int = 17, config: str = "large", top: int | None = None) -> dict[str, Any]:
    """Compile and run the prefill of `prompt` tokens and one decode step; the figures as a JSON-able dict."""
    cfg, model = build(geometry, prompt + 8)
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(1))
    kw = {"max_new_tokens": 2, "do_sample": False, "cache_implementation": "static"}
    with torch.no_grad(), warnings.catch_warnings(), tempfile.TemporaryDirectory() as folder:
        warnings.simplefilter("ignore")
        eager = model.generate(ids, **kw)
        torch._dynamo.reset()
        options = {"config": config} | ({"profile": folder} if top is not None else {})
        model.forward = torch.compile(model.forward, backend="ctpu", options=options)
        ctpu_stats.reset()
        out = model.generate(ids, **kw)
    launches = ctpu_stats.last().launches
    if len(launches) != 2:
        raise RuntimeError(f"expected a prefill and a decode launch, got {len(launches)}")
    prefill, decode = launches
    hw = get_config(config)
    need = roofline_bytes(cfg, prompt + 1)  # the decode step attends over the prompt and its own token
    roof = (need["weight_bytes"] + need["kv_bytes"]) / hw.hbm_bytes_per_cycle
    result: dict[str, Any] = {
        "geometry": geometry, "config": config, "dtype": "bfloat16", "layers": cfg.num_hidden_layers,
        "vocab": cfg.vocab_size, "prompt_tokens": prompt, "tokens_equal_eager": out.tolist() == eager.tolist(),
        "decode_cycles_per_token": decode.stats.cycles, **need, "hbm_roofline_cycles": round(roof),
        "decode_roofline_ratio": round(decode.stats.cycles / roof, 3),
        "decode_dma_bytes": decode.stats.dma_bytes_loaded + decode.stats.dma_bytes_stored,
        "prefill_cycles": prefill.stats.cycles, "prefill_mxu_utilization": round(prefill.stats.mxu_utilization, 4),
    }
    if top is not None and decode.profile is not None:
        rows = sorted(decode.profile.roofline(), key=lambda r: -r["cycles"])
        result["decode_kernels"] = rows[:top]
    return result


def run_context(geometry: str, context: int, config: str = "large", top: int | None = None) -> dict[str, Any]:
    """One decode step at position `context` - 1 of a static KV cache of `context` positions, filled with
    random bf16 keys and values (no prefill to compile: long contexts cost only the step), compiled and
    eager from the same cache; the figures as a JSON-able dict, as `run` gives them for its decode step."""
    import copy

    from transformers import StaticCache

    if context < 2:
        raise ValueError(f"--context {context}: a decode step needs a cached position before it (>= 2)")
    cfg, model = build(geometry, context)
    cache = StaticCache(config=cfg, max_cache_len=context)
    g = torch.Generator().manual_seed(1)
    step = {"input_ids": torch.randint(0, cfg.vocab_size, (1, 1), generator=g),
            "cache_position": torch.tensor([context - 1]), "use_cache": True}
    with torch.no_grad(), warnings.catch_warnings(), tempfile.TemporaryDirectory() as folder:
        warnings.simplefilter("ignore")
        model(**step, past_key_values=cache)  # lays out the cache's tensors
        for layer in cache.layers:  # the cached positions: random keys and values, as a long prompt leaves them
            for t in (layer.keys, layer.values):
                t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        eager_cache = copy.deepcopy(cache)
        eager = model(**step, past_key_values=eager_cache).logits
        torch._dynamo.reset()
        options = {"config": config} | ({"profile": folder} if top is not None else {})
        model.forward = torch.compile(model.forward, backend="ctpu", options=options)
        ctpu_stats.reset()
        logits = model(**step, past_key_values=cache).logits
    (decode,) = ctpu_stats.last().launches
    hw = get_config(config)
    need = roofline_bytes(cfg, context)
    roof = (need["weight_bytes"] + need["kv_bytes"]) / hw.hbm_bytes_per_cycle
    error = (logits.float() - eager.float()).abs().max().item() / eager.float().abs().max().item()
    result: dict[str, Any] = {
        "geometry": geometry, "config": config, "dtype": "bfloat16", "layers": cfg.num_hidden_layers,
        "vocab": cfg.vocab_size, "context": context,
        "token_equal_eager": logits[0, -1].argmax().item() == eager[0, -1].argmax().item(),
        "logits_max_error_vs_eager": round(error, 5), "cpu_ops": sum(ctpu_stats.last().fallback_ops.values()),
        "decode_cycles_per_token": decode.stats.cycles, **need, "hbm_roofline_cycles": round(roof),
        "decode_roofline_ratio": round(decode.stats.cycles / roof, 3),
        "decode_dma_bytes": decode.stats.dma_bytes_loaded + decode.stats.dma_bytes_stored,
    }
    if top is not None and decode.profile is not None:
        rows = sorted(decode.profile.roofline(), key=lambda r: -r["cycles"])
        result["decode_kernels"] = rows[:top]
    return result


def run_dynamic(geometry: str, lengths: list[int], config: str = "large", **overrides: Any) -> dict[str, Any]:
    """The cost of dynamic shapes: a forward of each prompt length compiled with the sequence marked dynamic
    (one program a bucket, padded to its bound, computing the valid rows) and with dynamic=False (one
    program a length); each length's cycles in both and their ratio, as a JSON-able dict. `overrides`
    replace config fields (fewer layers)."""
    if not lengths or min(lengths) < 2:
        raise ValueError(f"--dynamic {lengths}: prompt lengths of at least 2 (dynamo specializes 0 and 1)")
    cfg, model = build(geometry, max(lengths) + 8, **overrides)
    cycles: dict[str, dict[int, int]] = {"dynamic": {}, "static": {}}
    for mode, per_length in cycles.items():
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="ctpu", dynamic=False if mode == "static" else None,
                                 options={"config": config, "cache": False})
        for n in lengths:
            ids = torch.randint(0, cfg.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            if mode == "dynamic":
                torch._dynamo.mark_dynamic(ids, 1)
            ctpu_stats.reset()
            with torch.no_grad(), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                compiled(ids)
            stats = ctpu_stats.last()
            if stats.fallback_ops:
                raise RuntimeError(f"{mode} at {n} tokens ran ops on the CPU: {dict(stats.fallback_ops)}")
            per_length[n] = stats.cycles
            print(f"{mode} {n} tokens: {stats.cycles} cycles", file=sys.stderr, flush=True)
    ratios = {n: cycles["dynamic"][n] / cycles["static"][n] for n in lengths}
    return {"geometry": geometry, "config": config, "dtype": "bfloat16", "layers": cfg.num_hidden_layers,
            "max_ratio": round(max(ratios.values()), 3),
            "lengths": {n: {"static_cycles": cycles["static"][n], "dynamic_cycles": cycles["dynamic"][n],
                            "ratio": round(ratios[n], 3)} for n in lengths}}
