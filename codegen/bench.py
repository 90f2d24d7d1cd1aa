"""Compiler benchmark: prints one JSON object.

- `gemm`: the compiler-generated bf16 GEMM (default 512x512x512 on `small`) with its MXU utilization,
  and the hand-written device_sim/programs/gemm.s run through `device_sim.manifest.run_manifest` (same
  shape and config): its cycles and utilization and the ratio compiled / hand-written.
- `graphs`: program bundles, issued bundles, cycles, ops per bundle, MXU utilization of each graph, with
  software pipelining on (`after`) and off (`before`) for the vector graphs.

    python -m codegen.bench [--size 512] [--config small] [--skip-gemm]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from codegen import compile_graph
from device_sim.executable import run_fresh
from device_sim.runners import SimulatorRunner

HAND_GEMM = Path(__file__).resolve().parent.parent / "device_sim" / "programs" / "gemm.s"


def _run(fn: Any, xs: list[torch.Tensor], config: str, pipeline: bool = True) -> dict[str, Any]:
    gm = make_fx(fn, decomposition_table=core_aten_decompositions())(*xs)
    t0 = time.perf_counter()
    exe = compile_graph(gm, xs, config=config, pipeline=pipeline)
    compile_s = time.perf_counter() - t0
    _, st = run_fresh(exe, [x.float().numpy() for x in xs], SimulatorRunner(config))
    return {"program_bundles": len(exe.program), "bundles": st.bundles, "cycles": st.cycles,
            "ops_per_bundle": round(st.ops_per_bundle, 3), "mxu_utilization": round(st.mxu_utilization, 4),
            "compile_seconds": round(compile_s, 3)}


def gemm(size: int, config: str) -> dict[str, Any]:
    a = torch.randn(size, size).bfloat16()
    b = torch.randn(size, size).bfloat16()
    out = {"shape": [size, size, size], "dtype": "bf16", "config": config, **_run(lambda a, b: a @ b, [a, b], config)}
    if HAND_GEMM.exists() and size == 512:
        from device_sim.manifest import run_manifest

        hand = run_manifest(HAND_GEMM, config=config)
        st = hand.stats
        out["hand_written"] = {"program": HAND_GEMM.name, "cycles": st["cycles"], "bundles": st["bundles"],
                               "ops_per_bundle": round(st["ops_per_bundle"], 3),
                               "mxu_utilization": round(st["mxu_utilization"], 4),
                               "checks_passed": hand.passed}
        out["cycles_ratio_compiled_over_hand"] = round(out["cycles"] / st["cycles"], 4)
        out["utilization_ratio_compiled_over_hand"] = round(out["mxu_utilization"] / st["mxu_utilization"], 4)
    else:
        out["hand_written"] = None
    return out


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


# vector graphs at realistic sizes: measured with and without software pipelining
SCALE_GRAPHS = {
    "softmax_128x256": (lambda x: torch.softmax(x, -1), lambda: [torch.randn(128, 256)]),
    "layernorm_128x256": (lambda x: F.layer_norm(x, (256,)), lambda: [torch.randn(128, 256)]),
    "rmsnorm_16x4096": (_rms, lambda: [torch.randn(16, 4096)]),
    "exp_elementwise_128x256": (lambda x: torch.exp(x) * 0.5 + x, lambda: [torch.randn(128, 256)]),
    "axpb_elementwise_128x256": (lambda x: x * 2.0 + 1.0, lambda: [torch.randn(128, 256)]),
}

GRAPHS = {
    "elementwise_8x16": (lambda x, b: torch.exp(x + b) * 0.5, lambda: [torch.randn(8, 16), torch.randn(16)]),
    "softmax_5x12": (lambda x: torch.softmax(x, -1), lambda: [torch.randn(5, 12)]),
    "rmsnorm_6x20": (lambda x, g: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g,
                     lambda: [torch.randn(6, 20), torch.randn(20)]),
    "layernorm_4x24": (lambda x, g, b: F.layer_norm(x, (24,), g, b),
                       lambda: [torch.randn(4, 24), torch.randn(24), torch.randn(24)]),
    "mm_f32_highest_32": (lambda a, b: a @ b, lambda: [torch.randn(32, 32), torch.randn(32, 32)]),
    "mlp_6x16x24x8": (lambda x, w1, b1, w2: F.linear(torch.relu(F.linear(x, w1, b1)), w2),
                      lambda: [torch.randn(6, 16), torch.randn(24, 16), torch.randn(24), torch.randn(8, 24)]),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ctpu bench", description="compiler benchmarks, printed as JSON")
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--config", default="small")
    p.add_argument("--skip-gemm", action="store_true")
    return p


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """The GEMM, the small graphs and the pipelining comparison, as one dict."""
    torch.manual_seed(0)
    result: dict[str, Any] = {}
    if not args.skip_gemm:
        result["gemm"] = gemm(args.size, args.config)
    result["graphs"] = {name: _run(fn, make(), args.config) for name, (fn, make) in GRAPHS.items()}
    scale = {}
    for name, (fn, make) in SCALE_GRAPHS.items():
        xs = make()
        before, after = _run(fn, xs, args.config, pipeline=False), _run(fn, xs, args.config)
        scale[name] = {"before_pipelining": before, "after_pipelining": after,
                       "speedup": round(before["cycles"] / after["cycles"], 3)}
    result["pipelining"] = scale
    return result


def main(argv: list[str] | None = None) -> None:
    print(json.dumps(collect(parser().parse_args(argv)), indent=2))


if __name__ == "__main__":
    main()
