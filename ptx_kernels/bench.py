"""Benchmark the PTX kernels against torch on one GPU; prints JSON.

    python -m ptx_kernels.bench            # on an H100/H200: GEMMs (bf16 wgmma, fp32 SIMT) vs torch.matmul,
                                           # causal GQA attention vs SDPA, RMSNorm/SwiGLU bandwidth
    python -m ptx_kernels.bench --dry-run  # anywhere: generate and ptxas-check the kernels it would launch

Figures are ratios measured in the same run (GEMM: torch time / PTX time, > 1 means the PTX kernel is
faster) and achieved bandwidth as a fraction of the device's nominal HBM peak.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections.abc import Callable

import torch

from ptx_kernels import assemble, kernel_for, run
from ptx_kernels.core import PtxKernel

GEMM_SIZES = (4096, 8192)
ROWS, HIDDEN, FFN = 16384, 4096, 11008
FP32_GEMM = 4096
ATTN_Q, ATTN_KV = (1, 32, 2048, 128), (1, 8, 2048, 128)
# Nominal HBM bandwidth in bytes/s by the words of the device name (the driver does not report it); the
# first entry whose words all occur in the name wins, so GH200 precedes H200. The H100 SXM calls itself
# "NVIDIA H100 80GB HBM3".
PEAK_BYTES_PER_S = {
    "H100 SXM": 3.35e12,
    "H100 HBM3": 3.35e12,
    "H100 PCIe": 2.0e12,
    "H100 NVL": 3.9e12,
    "GH200": 4.0e12,
    "H200": 4.8e12,
}


def kernels() -> dict[str, PtxKernel]:
    bf16 = torch.bfloat16
    out = {
        f"gemm_{n}": kernel_for("aten::mm", [(n, n), (n, n)], [bf16, bf16], {"w_layout": "kn"})
        for n in GEMM_SIZES
    }
    n = FP32_GEMM
    out["gemm_f32_simt"] = kernel_for("aten::mm", [(n, n), (n, n)], [torch.float32] * 2, {"w_layout": "kn"})
    out["attention_d128_prefill"] = kernel_for(
        "ctpu::attention", [ATTN_Q, ATTN_KV, ATTN_KV, None], [bf16] * 3 + [None], {"causal": True}
    )
    out["rms_norm"] = kernel_for("ctpu::rms_norm", [(ROWS, HIDDEN), (HIDDEN,)], [bf16, bf16], {"eps": 1e-6})
    out["swiglu"] = kernel_for("ctpu::swiglu", [(ROWS, FFN), (ROWS, FFN)], [bf16, bf16], {"act": "silu"})
    return out


def _time_ms(fn: Callable[[], object], iters: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _peak(name: str) -> float | None:
    words = name.split()
    for key, value in PEAK_BYTES_PER_S.items():
        if all(any(w.startswith(part) for w in words) for part in key.split()):
            return value
    return None


def measure(ks: dict[str, PtxKernel]) -> dict[str, object]:
    name = torch.cuda.get_device_name()
    peak = _peak(name)
    result: dict[str, object] = {"device": name, "peak_hbm_bytes_per_s": peak}
    for n in GEMM_SIZES:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        kernel = ks[f"gemm_{n}"]
        ptx_ms = _time_ms(lambda kernel=kernel, a=a, b=b: run(kernel, a, b))
        torch_ms = _time_ms(lambda a=a, b=b: torch.matmul(a, b))
        (got,) = run(kernel, a, b)
        ref = torch.matmul(a, b).float()
        err = (got.view(n, n).float() - ref).abs().max().item()
        result[f"gemm_{n}"] = {
            "ptx_tflops": 2 * n**3 / ptx_ms / 1e9,
            "torch_tflops": 2 * n**3 / torch_ms / 1e9,
            "ratio_torch_over_ptx_time": torch_ms / ptx_ms,
            "max_abs_err_vs_torch": err,
            # bf16 outputs: rounding alone gives up to ~2^-8 of the largest |value|; more is a wrong answer
            "rel_err_vs_torch": err / max(ref.abs().max().item(), 1e-30),
        }
    n = FP32_GEMM
    a, b = torch.randn(n, n, device="cuda"), torch.randn(n, n, device="cuda")
    torch.backends.cuda.matmul.allow_tf32 = False  # compare with torch's fp32-exact ("highest") matmul
    ptx_ms = _time_ms(lambda: run(ks["gemm_f32_simt"], a, b))
    torch_ms = _time_ms(lambda: torch.matmul(a, b))
    (got,) = run(ks["gemm_f32_simt"], a, b)
    result["gemm_f32_simt"] = {
        "ptx_tflops": 2 * n**3 / ptx_ms / 1e9,
        "torch_tflops": 2 * n**3 / torch_ms / 1e9,
        "ratio_torch_over_ptx_time": torch_ms / ptx_ms,
        "max_abs_err_vs_torch": (got.view(n, n) - torch.matmul(a, b)).abs().max().item(),
    }
    q = torch.randn(ATTN_Q, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(ATTN_KV, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(ATTN_KV, device="cuda", dtype=torch.bfloat16)
    ptx_ms = _time_ms(lambda: run(ks["attention_d128_prefill"], q, k, v))
    torch_ms = _time_ms(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    )
    result["attention_d128_prefill"] = {"ptx_ms": ptx_ms, "torch_sdpa_ms": torch_ms,
                                        "ratio_torch_over_ptx_time": torch_ms / ptx_ms}
    x = torch.randn(ROWS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: run(ks["rms_norm"], x, w))
    result["rms_norm"] = _bandwidth(2 * x.numel() * 2 + HIDDEN * 2, ms, peak)
    g = torch.randn(ROWS, FFN, device="cuda", dtype=torch.bfloat16)
    u = torch.randn(ROWS, FFN, device="cuda", dtype=torch.bfloat16)
    ms = _time_ms(lambda: run(ks["swiglu"], g, u))
    result["swiglu"] = _bandwidth(3 * g.numel() * 2, ms, peak)
    return result


def _bandwidth(nbytes: int, ms: float, peak: float | None) -> dict[str, float | None]:
    achieved = nbytes / (ms * 1e-3)
    return {"ms": ms, "bytes_per_s": achieved, "fraction_of_peak": achieved / peak if peak else None}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="generate and ptxas-check only; no GPU needed")
    args = parser.parse_args(argv)
    ks = kernels()
    ptxas = {}
    for key, kernel in ks.items():
        r = assemble(kernel)
        ptxas[key] = {
            "kernel": kernel.name,
            "registers": r.registers,
            "spill_stores": r.spill_stores,
            "spill_loads": r.spill_loads,
            "dynamic_smem_bytes": kernel.smem_bytes,
            "grid": kernel.grid,
            "block": kernel.block,
        }
    if args.dry_run:
        print(json.dumps({"mode": "dry-run", "ptxas": ptxas}, indent=2))
        return
    print(json.dumps({"mode": "gpu", "ptxas": ptxas, **measure(ks)}, indent=2))


if __name__ == "__main__":
    main()
