"""End-to-end parity on the simulator against eager PyTorch.

Tolerances come from the numerics contract (docs/compiler.md, "Numerics"): fp32 elementwise ops are IEEE
(rtol 1e-6); transcendentals are instruction sequences within a few ulp (rtol 1e-5 after composition);
reductions sum in a different order than torch (atol ~1e-6 * sqrt(n)); fp32 matmuls at "highest" are
6-pass bf16 (rtol ~1e-5); bf16 matmuls round once, from an fp32 accumulator.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import compile_and_run

torch.manual_seed(0)


def check(fn, *xs, rtol=1e-6, atol=1e-6, **options):
    outs, refs, cg = compile_and_run(fn, *xs, **options)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape
        np.testing.assert_allclose(o, r, rtol=rtol, atol=atol)
    return cg


def test_elementwise_broadcasting() -> None:
    x, b, c = torch.randn(5, 12), torch.randn(12), torch.randn(5, 1)
    check(lambda x, b, c: (x + b) * c - x / 3.0, x, b, c, rtol=2e-6)


def test_elementwise_rank3_and_scalar_broadcast() -> None:
    x, b = torch.randn(2, 3, 20), torch.randn(20)
    check(lambda x, b: torch.maximum(x * b, x - 0.5).abs(), x, b)


def test_transcendentals() -> None:
    x = torch.randn(6, 16) * 3
    check(lambda x: (torch.exp(x), torch.tanh(x), torch.sigmoid(x), torch.rsqrt(x.abs() + 0.1)), x,
          rtol=1e-5, atol=1e-6)


def test_reductions_last_dim() -> None:
    x = torch.randn(7, 13)
    check(lambda x: (x.sum(-1), x.amax(-1), x.mean(-1, keepdim=True)), x, atol=2e-6)


def test_reduction_wide_rows() -> None:
    x = torch.randn(3, 100)  # 13 vmem rows per row: masked partial chunk
    check(lambda x: (x.sum(-1), x.amax(-1)), x, atol=5e-6)


def test_views_and_permutes() -> None:
    x = torch.randn(4, 6)
    check(lambda x: (x.transpose(0, 1) + 1.0, x.view(2, 12) * 2.0, x.unsqueeze(0).expand(3, 4, 6) * 1.5,
                     x[:, 1:4] - 1.0), x)


@pytest.mark.parametrize("shape", [(5, 12, 7), (9, 3, 17), (16, 16, 16)])
def test_mm_highest(shape) -> None:
    m, k, n = shape
    a, b = torch.randn(m, k), torch.randn(k, n)
    check(lambda a, b: a @ b, a, b, rtol=1e-5, atol=1e-5)


def test_mm_medium_is_one_bf16_pass() -> None:
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    outs, _, _ = compile_and_run(lambda a, b: a @ b, a, b, matmul_precision="medium")
    from device_sim.numerics import mxu_matmul
    an, bn = a.numpy(), b.numpy()  # two k tiles: the MXU sums each, mxu.mmas adds them (fp32)
    ref = mxu_matmul(an[:, :8], bn[:8]) + mxu_matmul(an[:, 8:], bn[8:])
    np.testing.assert_array_equal(outs[0], ref)


def test_bmm_and_addmm() -> None:
    a, b = torch.randn(2, 5, 9), torch.randn(2, 9, 6)
    check(lambda a, b: torch.bmm(a, b), a, b, rtol=1e-5, atol=1e-5)
    x, w, bias = torch.randn(6, 10), torch.randn(10, 5), torch.randn(5)
    check(lambda x, w, bias: torch.addmm(bias, x, w), x, w, bias, rtol=1e-5, atol=1e-5)


def test_mlp() -> None:
    x, w1, b1, w2 = torch.randn(6, 16), torch.randn(24, 16), torch.randn(24), torch.randn(8, 24)
    check(lambda x, w1, b1, w2: F.linear(torch.relu(F.linear(x, w1, b1)), w2), x, w1, b1, w2, rtol=1e-5, atol=1e-5)


def test_softmax() -> None:
    x = torch.randn(5, 12) * 4
    check(lambda x: torch.softmax(x, -1), x, rtol=1e-5, atol=1e-7)


def test_rmsnorm() -> None:
    x, g = torch.randn(6, 20), torch.randn(20)
    check(lambda x, g: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g, x, g, rtol=1e-5, atol=1e-6)


def test_layernorm() -> None:
    x, g, b = torch.randn(4, 24), torch.randn(24), torch.randn(24)
    check(lambda x, g, b: F.layer_norm(x, (24,), g, b), x, g, b, rtol=1e-5, atol=1e-5)


def test_bf16_matmul_native() -> None:
    a, b = torch.randn(16, 24).bfloat16(), torch.randn(24, 8).bfloat16()
    outs, _, cg = compile_and_run(lambda a, b: a @ b, a, b)
    ref = (a.float() @ b.float()).bfloat16().float().numpy()
    np.testing.assert_allclose(outs[0], ref, rtol=1e-2, atol=1e-2)
    assert cg.last_stats.macs > 0


def test_dump_dir(tmp_path) -> None:
    x = torch.randn(4, 8)
    compile_and_run(lambda x: torch.exp(x) + 1.0, x, dump_dir=str(tmp_path), name="g")
    names = sorted(p.name for p in (tmp_path / "g").iterdir())
    assert "program.bin" in names and "summary.json" in names
    assert any("linalg-fuse-elementwise-ops" in n for n in names)
    assert any(n.endswith("program.s") for n in names) and any(n.endswith("scheduled.txt") for n in names)
