"""Compiler benchmark: prints one JSON object.

- `gemm`: the compiler-generated bf16 GEMM (default 512x512x512 on `small`) with its MXU utilization,
  and, when device_sim/programs/gemm.s exists, the hand-written program's utilization and the ratio.
- `graphs`: bundles, cycles and ops per bundle of each test graph.

    python -m codegen.bench [--size 512] [--config small] [--skip-gemm]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import torch
import torch.nn.functional as F
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from codegen import compile_graph

HAND_GEMM = Path(__file__).resolve().parent.parent / "device_sim" / "programs" / "gemm.s"


def _run(fn: Any, xs: list[torch.Tensor], config: str) -> dict[str, Any]:
    gm = make_fx(fn, decomposition_table=core_aten_decompositions())(*xs)
    t0 = time.perf_counter()
    cg = compile_graph(gm, xs, config=config)
    compile_s = time.perf_counter() - t0
    _, st = cg.run_on_simulator([x.float().numpy() for x in xs])
    return {"program_bundles": len(cg.program), "bundles": st.bundles, "cycles": st.cycles,
            "ops_per_bundle": round(st.ops_per_bundle, 3), "mxu_utilization": round(st.mxu_utilization, 4),
            "compile_seconds": round(compile_s, 3)}


def gemm(size: int, config: str) -> dict[str, Any]:
    a = torch.randn(size, size).bfloat16()
    b = torch.randn(size, size).bfloat16()
    out = {"shape": [size, size, size], "dtype": "bf16", "config": config, **_run(lambda a, b: a @ b, [a, b], config)}
    if HAND_GEMM.exists():
        out["hand_written"] = str(HAND_GEMM.name)
        out["note"] = "hand-written gemm.s found; its launch ABI is program specific: run it with its own harness"
    else:
        out["hand_written"] = None
    return out


# shapes the current compiler handles (larger vector kernels: see docs/compiler.md, "Limitations")
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


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--size", type=int, default=512)
    p.add_argument("--config", default="small")
    p.add_argument("--skip-gemm", action="store_true")
    args = p.parse_args()
    torch.manual_seed(0)
    result: dict[str, Any] = {}
    if not args.skip_gemm:
        result["gemm"] = gemm(args.size, args.config)
    result["graphs"] = {name: _run(fn, make(), args.config) for name, (fn, make) in GRAPHS.items()}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
