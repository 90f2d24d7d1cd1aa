"""Cycles of a padded dynamic-shape program against the static program of the same size (issue 14).

A bf16 Llama geometry of `ctpu bench --llama` (random weights) compiled twice on `large`: with the sequence
marked dynamic (one program per bucket, padded to its bound) and with dynamic=False (one program per
length); each prompt length runs on both and the JSON gives the cycles and their ratio.

    python scripts/dynamic_overhead.py 1b-2l 17,100,300      # about 8 minutes on 2 cores
    python scripts/dynamic_overhead.py 1b-2l 33,65,129       # just past a short bucket's start: the worst cases
    python scripts/dynamic_overhead.py mini 17,33,100
"""

from __future__ import annotations

import json
import sys
import warnings

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import torch_tpu_backend.stats as ctpu_stats
from torch_tpu_backend.llama_bench import GEOMETRIES


def main(geometry: str, lengths: list[int]) -> dict:
    torch.manual_seed(0)
    cfg = LlamaConfig(**GEOMETRIES[geometry], max_position_embeddings=max(lengths) + 8)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    cycles: dict[str, dict[int, int]] = {"dynamic": {}, "static": {}}
    for mode in cycles:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="ctpu", dynamic=False if mode == "static" else None,
                                 options={"config": "large", "cache": False})
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
            cycles[mode][n] = stats.cycles
            print(f"{mode} {n} tokens: {stats.cycles} cycles", file=sys.stderr, flush=True)
    return {"geometry": geometry, "config": "large", "lengths": {
        n: {"static_cycles": cycles["static"][n], "dynamic_cycles": cycles["dynamic"][n],
            "ratio": round(cycles["dynamic"][n] / cycles["static"][n], 3)} for n in lengths}}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], [int(x) for x in sys.argv[2].split(",")]), indent=2))
