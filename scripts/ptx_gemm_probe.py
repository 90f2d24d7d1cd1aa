"""Where does each element of the bf16 wgmma GEMM come from? A diagnostic for a Hopper GPU.

    python scripts/ptx_gemm_probe.py OUT_DIR

For each operand-B layout ("kn": contiguous [K, N], read N-major with the wgmma transpose bit; "nk": the
transposed view of a contiguous [N, K], K-major) and shapes that isolate one feature each (one k16 step,
the four k16 steps of one K tile, the m64n256 wgmma, several tiles and K tiles wrapping the 4-stage
mbarrier ring, a batch), the GEMM runs on coded inputs whose products are exact in bf16:

- A one-hot: a[b, m, k] = 1 where k == m % K, so out[b, m, n] = w[b, m % K, n];
- w = k % 256 + 1 ("row code") then w = n % 256 + 1 ("column code"): the output names the K row and the
  N column each element was read from;
- random normal operands against the fp32 product (max abs error, relative to the largest |product|).

`OUT_DIR/probe.json` holds per case the fraction of elements that match each code and the random error;
`OUT_DIR/probe_gemm.npz` the raw coded outputs (`<case>_rows`, `<case>_cols`) for offline decoding. Then
the tiny Llama (fp32, bf16) is compiled for the ptx target with every target-compile failure's traceback
kept, and its logits compared with eager CUDA: `OUT_DIR/probe.log`.
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ptx_kernels import run
from ptx_kernels.gemm import gemm

BF16 = torch.bfloat16
# name -> (batch, M, N, K)
CASES = {
    "one_k16": (1, 128, 128, 16),
    "one_ktile": (1, 128, 128, 64),
    "n256": (1, 128, 256, 64),
    "multi_tile_ring": (1, 256, 384, 576),
    "batch_tails": (2, 130, 264, 72),
}


def _operand_w(code: torch.Tensor, layout: str) -> torch.Tensor:
    """w as the kernel wants it: [batch, K, N] contiguous ("kn") or the transposed view of [batch, N, K]."""
    if layout == "kn":
        return code.contiguous()
    return code.transpose(1, 2).contiguous().transpose(1, 2)


def probe_gemm(raw: dict[str, np.ndarray]) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for layout in ("kn", "nk"):
        for name, (b, m, n, k) in CASES.items():
            case = f"{layout}_{name}"
            try:
                kernel = gemm(m, n, k, batch=b, w_layout=layout, out_dtype=torch.float32)
                rows = torch.arange(m, device="cuda") % k
                a = torch.zeros(b, m, k, device="cuda", dtype=BF16)
                a[:, torch.arange(m, device="cuda"), rows] = 1
                kk = torch.arange(k, device="cuda").view(1, k, 1).expand(b, k, n)
                nn = torch.arange(n, device="cuda").view(1, 1, n).expand(b, k, n)
                row_code, col_code = (kk % 256 + 1).to(BF16), (nn % 256 + 1).to(BF16)
                (got_rows,) = run(kernel, a, _operand_w(row_code, layout))
                (got_cols,) = run(kernel, a, _operand_w(col_code, layout))
                want_rows = (rows % 256 + 1).float().view(1, m, 1).expand(b, m, n)
                want_cols = (torch.arange(n, device="cuda") % 256 + 1).float().view(1, 1, n).expand(b, m, n)
                ar = torch.randn(b, m, k, device="cuda").to(BF16)
                wr = _operand_w(torch.randn(b, k, n, device="cuda").to(BF16), layout)
                (got,) = run(kernel, ar, wr)
                ref = ar.float() @ wr.float()
                torch.cuda.synchronize()
                err = (got.view(b, m, n) - ref).abs().max().item()
                results[case] = {
                    "batch_m_n_k": [b, m, n, k],
                    "row_code_match": (got_rows.view(b, m, n) == want_rows).float().mean().item(),
                    "col_code_match": (got_cols.view(b, m, n) == want_cols).float().mean().item(),
                    "random_max_abs_err": err,
                    "random_rel_err": err / max(ref.abs().max().item(), 1e-30),
                }
                raw[f"{case}_rows"] = got_rows.view(b, m, n).cpu().numpy()
                raw[f"{case}_cols"] = got_cols.view(b, m, n).cpu().numpy()
            except Exception as e:  # keep probing the other cases
                results[case] = {"error": f"{type(e).__name__}: {e}"[:2000], "trace": traceback.format_exc()}
            print(case, json.dumps({k_: v for k_, v in results[case].items() if k_ != "trace"}), flush=True)
    return results


def probe_tiny_llama(log: list[str]) -> dict[str, Any]:
    """Compile the tiny Llama for the ptx target; keep every target-compile failure with its traceback."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "ptx_kernels"))
    from test_compile_ptx import tiny_llama

    from torch_tpu_backend import ptx_target
    from torch_tpu_backend.dynamo import ctpu_backend

    original = ptx_target.PtxTarget.compile

    def compile_logged(self: Any, gm: torch.fx.GraphModule, *args: Any) -> Any:
        try:
            return original(self, gm, *args)
        except Exception:
            log.append(f"PtxTarget.compile failed on a graph of {len(gm.graph.nodes)} nodes:\n"
                       f"{gm.graph}\n{traceback.format_exc()}")
            raise

    ptx_target.PtxTarget.compile = compile_logged
    results: dict[str, Any] = {}
    try:
        for dtype in (torch.float32, BF16):
            key = str(dtype).removeprefix("torch.")
            try:
                model, ids = tiny_llama(dtype)
                torch._dynamo.reset()
                compiled = torch.compile(model, backend=ctpu_backend, options={"target": "ptx", "cache": False})
                with warnings.catch_warnings(record=True) as caught, torch.no_grad():
                    warnings.simplefilter("always")
                    got = compiled(ids).logits.float().cpu()
                ref = model.cuda()(ids.cuda()).logits.float().cpu()
                results[key] = {
                    "max_abs_err": (got - ref).abs().max().item(),
                    "warnings": [str(w.message)[:500] for w in caught],
                }
            except Exception as e:
                results[key] = {"error": f"{type(e).__name__}: {e}"[:2000]}
                log.append(f"tiny llama {key}:\n{traceback.format_exc()}")
            print("tiny_llama", key, json.dumps(results[key])[:2000], flush=True)
    finally:
        ptx_target.PtxTarget.compile = original
    return results


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".")
    out.mkdir(parents=True, exist_ok=True)
    raw: dict[str, np.ndarray] = {}
    log: list[str] = []
    summary = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "gemm": probe_gemm(raw)}
    np.savez_compressed(out / "probe_gemm.npz", **raw)
    summary["tiny_llama"] = probe_tiny_llama(log)
    (out / "probe.json").write_text(json.dumps(summary, indent=2))
    (out / "probe.log").write_text("\n\n".join(log) or "no target-compile failure\n")


if __name__ == "__main__":
    main()
