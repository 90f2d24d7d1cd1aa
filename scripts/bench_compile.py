"""Compile time of the tiny Llama: the ctpu backend against Inductor (CPU), measured in one run; prints JSON.

    python scripts/bench_compile.py [--config small] [--precision highest]

For each backend: `first_call_s` (dynamo + AOT + backend compile + one run), `steady_call_s` (a second run),
`compile_s` = their difference; for ctpu also what codegen reports per phase (`summary.compile_seconds`)
and whether the graph ran as one CTPU kernel or fell back (with the reason). Both compile cold: the ctpu
compile cache and Inductor's caches point at fresh temporary directories.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import warnings
from typing import Any

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")
_tmp = tempfile.mkdtemp(prefix="ctpu_bench_")
os.environ["CTPU_CACHE_DIR"] = os.path.join(_tmp, "ctpu")
os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(_tmp, "inductor")
os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"

import torch  # noqa: E402
import torch.fx  # noqa: E402


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=False)
    return LlamaForCausalLM(cfg).eval()


def timed(fn: Any, ids: torch.Tensor) -> tuple[float, float, torch.Tensor]:
    with torch.no_grad():
        t0 = time.perf_counter()
        out = fn(ids).logits
        t1 = time.perf_counter()
        fn(ids)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, out


def frontend_phases(gm: torch.fx.GraphModule, examples: Any, *_: Any) -> dict[str, float]:
    """Seconds of codegen's front end alone (FX -> MLIR, the upstream passes, the kernel reader)."""
    from codegen.fx_ops import emit_module
    from codegen.kernel_graph import read_function
    from codegen.mlir_pipeline import run_pipeline

    t0 = time.perf_counter()
    text, _, _ = emit_module(gm, examples)
    t1 = time.perf_counter()
    res = run_pipeline(text)
    t2 = time.perf_counter()
    with res.context:
        n = len(read_function(res.module).kernels)
    t3 = time.perf_counter()
    return {"fx_to_mlir": round(t1 - t0, 3), "mlir_passes": round(t2 - t1, 3), "kernels": round(t3 - t2, 3),
            "kernel_count": n}


def bench_ctpu(model: torch.nn.Module, ids: torch.Tensor, config: str) -> dict[str, Any]:
    import codegen
    import torch_tpu_backend.stats as stats

    reports: list[dict[str, Any]] = []
    compile_graph = codegen.compile_graph

    def recording(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            cg = compile_graph(*args, **kwargs)
        except codegen.UnsupportedError as e:
            reports.append({"error": str(e).splitlines()[0], "seconds": round(time.perf_counter() - t0, 3),
                            "frontend_phases": frontend_phases(*args)})
            raise
        reports.append({"seconds": time.perf_counter() - t0, "bundles": len(cg.program),
                        "phases": cg.summary["compile_seconds"], "kernels": len(cg.summary["kernels"])})
        return cg

    codegen.compile_graph = recording
    torch._dynamo.reset()
    stats.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        first, steady, _ = timed(torch.compile(model, backend="ctpu", options={"config": config}), ids)
    s = stats.last()
    one_kernel = s.kernels_launched == 2 and not s.fallback_ops  # two calls
    return {"first_call_s": round(first, 3), "steady_call_s": round(steady, 3), "compile_s": round(first - steady, 3),
            "one_ctpu_kernel": one_kernel, "fallback_ops": sum(s.fallback_ops.values()), "codegen": reports}


def bench_inductor(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    torch._dynamo.reset()
    first, steady, _ = timed(torch.compile(model, backend="inductor"), ids)
    return {"first_call_s": round(first, 3), "steady_call_s": round(steady, 3), "compile_s": round(first - steady, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--config", default="small")
    parser.add_argument("--precision", default="highest", choices=["highest", "high", "medium"])
    args = parser.parse_args()
    torch.set_float32_matmul_precision(args.precision)
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    ctpu = bench_ctpu(model, ids, args.config)
    inductor = bench_inductor(model, ids)
    print(json.dumps({"model": "LlamaForCausalLM(hidden 64, 2 layers, 4 heads / 2 kv, vocab 128), ids [1, 8]",
                      "config": args.config, "matmul_precision": args.precision, "threads": torch.get_num_threads(),
                      "ctpu": ctpu, "inductor": inductor,
                      "compile_ratio_ctpu_over_inductor": round(ctpu["compile_s"] / inductor["compile_s"], 2)},
                     indent=2))


if __name__ == "__main__":
    main()
