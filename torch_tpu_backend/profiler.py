"""`ctpu profile`: a Llama (random weights) compiled with backend="ctpu" and run once on the simulator with
the `profile` option on; the trace of its launch (the prefill forward, or with `decode` one decode step of
greedy generation with a static KV cache) and the per-kernel roofline table (device_sim.profile).

    ctpu profile [--decode] [--config small|large] [--dtype float32|bfloat16] [--out trace.json] [--json]
"""

from __future__ import annotations

import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import torch_tpu_backend.stats as ctpu_stats
from device_sim.profile import Profile, format_roofline, write_trace


def run(out: str | Path, decode: bool = False, config: str = "small", dtype: torch.dtype = torch.float32,
        tokens: int = 8, layers: int = 2, hidden: int = 64, vocab: int = 128, precision: str = "highest",
        progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Profile one launch; its trace is written to `out`. Returns the figures (JSON-able), the roofline
    table included; `result["profile"]` is the Profile itself (not JSON)."""
    from torch_tpu_backend import generate
    from torch_tpu_backend.llama_demo import tiny_llama

    say = progress or (lambda _: None)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    shape = {"layers": layers, "hidden": hidden, "vocab": vocab}
    try:
        with tempfile.TemporaryDirectory() as folder, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch._dynamo.reset()
            ctpu_stats.reset()
            if decode:
                say(f"compiling and running a {tokens}-token prefill and one decode step on the simulator "
                    "(profiled: slower than a plain run)")
                generate.run(prompt_ids=[list(range(1, tokens + 1))], max_new_tokens=2, dtype=dtype, config=config,
                             profile=folder, **shape)
            else:
                say(f"compiling and running a {tokens}-token prefill on the simulator (profiled: slower than a "
                    "plain run)")
                model = tiny_llama(dtype, **shape)
                ids = torch.randint(0, vocab, (1, tokens), generator=torch.Generator().manual_seed(1))
                compiled = torch.compile(model, backend="ctpu", options={"config": config, "profile": folder})
                with torch.no_grad():
                    compiled(ids)
    finally:
        torch.set_float32_matmul_precision(previous)
    launches = [r for r in ctpu_stats.last().launches if r.profile is not None]
    if not launches:
        raise RuntimeError("no launch ran on the CTPU: nothing was profiled")
    launch = launches[-1]  # prefill: its forward; decode: the decode step
    profile: Profile = launch.profile
    say(f"writing {out}")
    write_trace(profile, out)
    table = profile.roofline()
    return {"model": f"LlamaForCausalLM(hidden {hidden}, {layers} layers, vocab {vocab})",
            "dtype": str(dtype).removeprefix("torch."), "config": config, "matmul_precision": precision,
            "phase": "decode step" if decode else f"prefill of {tokens} tokens", "launch": launch.name,
            "launches_profiled": len(launches), "trace": str(out), "cycles": profile.cycles,
            "stats": {k: v for k, v in launch.stats.as_dict().items() if k != "wall_seconds"},
            "roofline": table, "profile": profile}


def summary(result: dict[str, Any], top: int | None = None) -> str:
    s = result["stats"]
    rows = result["roofline"]
    bound: dict[str, int] = {}
    for r in rows:
        bound[r["bound"]] = bound.get(r["bound"], 0) + r["cycles"]
    lines = [f"{result['model']}, {result['dtype']}, {result['phase']} on {result['config']}: {s['cycles']:,} cycles, "
             f"{s['bundles']:,} bundles, MXU utilization {s['mxu_utilization']:.3f}, DMA "
             f"{s['dma_bytes_loaded']:,} B in / {s['dma_bytes_stored']:,} B out, stalls {s['stall_cycles']}",
             "cycles by bound: " + ", ".join(f"{k} {v:,} ({100 * v / max(result['cycles'], 1):.1f}%)"
                                             for k, v in sorted(bound.items(), key=lambda kv: -kv[1])),
             "", format_roofline(rows, top), "",
             f"trace: {result['trace']} (open it in https://ui.perfetto.dev or chrome://tracing)"]
    return "\n".join(lines)
