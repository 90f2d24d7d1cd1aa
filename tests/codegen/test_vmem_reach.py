"""Every vmem row of `large` (32768) is addressable: vld / vst immediates are 14-bit signed (rows up to
8191), so a row past that goes through a base register (`Builder.vmem_address`). Issue 12: a kernel whose
tiles sat past row 8191 raised "immediate ... does not fit vst's 14-bit signed field" and fell back.

Each graph is compiled twice on `large`: as is (its regions low in vmem) and with every kernel's regions
moved up by `shift` rows (straddling row 8192, straddling an 8192-row window boundary, far up). Only the
addresses change, so the outputs must be the same bits; both match eager.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import compile_and_run, run_with_poisoned_vmem

from codegen.isel_common import KernelContext

FP32, BF16 = (2e-5, 2e-6), (1.6e-2, 1e-2)
SUM_FP32 = (2e-5, 2e-5 * 300)  # fp32 sums of 300 products of N(0, 1): another order, cancellation
GRAPHS = {  # name -> (fn, inputs, (rtol, atol) against eager)
    "elementwise": (lambda x: torch.exp(x) * 0.5 + x, lambda: [torch.randn(96, 520)], FP32),
    "softmax_bf16": (lambda x: torch.softmax(x, -1), lambda: [torch.randn(40, 1000).bfloat16()], BF16),
    "rmsnorm_weight": (lambda x, g: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * g,
                       lambda: [torch.randn(24, 600), torch.randn(600)], FP32),
    "column_broadcast": (lambda x, c: x - c, lambda: [torch.randn(72, 300), torch.randn(72, 1)], FP32),
    "matmul_bf16": (lambda a, b: a @ b, lambda: [torch.randn(64, 200).bfloat16(), torch.randn(200, 136).bfloat16()],
                    (1.6e-2, 0.1)),
    "matmul_fp32_split": (lambda a, b: a @ b, lambda: [torch.randn(40, 300), torch.randn(300, 72)], SUM_FP32),
    "gather": (lambda t, i: F.embedding(i, t), lambda: [torch.randn(64, 200), torch.randint(0, 64, (37,))], FP32),
}
SHIFTS = [8192 - 40, 12288 - 100, 24000]


def _shifted(monkeypatch: pytest.MonkeyPatch, shift: int) -> None:
    post_init = KernelContext.__post_init__

    def moved(self: KernelContext) -> None:
        post_init(self)
        self._base_row += shift

    monkeypatch.setattr(KernelContext, "__post_init__", moved)


def _peak_row(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    peak = [0]
    region = KernelContext.region

    def recording(self: KernelContext, rows: int, hint: str):  # type: ignore[no-untyped-def]
        r = region(self, rows, hint)
        peak[0] = max(peak[0], r.row + r.rows)
        return r

    monkeypatch.setattr(KernelContext, "region", recording)
    return peak


@pytest.mark.parametrize("shift", SHIFTS)
@pytest.mark.parametrize("name", list(GRAPHS))
def test_tiles_past_row_8191_give_the_same_bits(name: str, shift: int, monkeypatch: pytest.MonkeyPatch) -> None:
    fn, make, (rtol, atol) = GRAPHS[name]
    torch.manual_seed(0)
    xs = make()
    low, refs, _ = compile_and_run(fn, *xs, config="large")
    with monkeypatch.context() as m:
        _shifted(m, shift)
        peak = _peak_row(m)
        high, _, exe = compile_and_run(fn, *xs, config="large", verify=True)
    assert peak[0] > 8192
    for lo, hi, ref in zip(low, high, refs, strict=True):
        np.testing.assert_array_equal(hi.view(np.uint32), lo.view(np.uint32))
        np.testing.assert_allclose(hi, ref, rtol=rtol, atol=atol)
    # no row outside what the kernel wrote is read (poisoned vmem gives the same bits)
    poisoned = run_with_poisoned_vmem(exe, [x.float().numpy() for x in xs])
    for p, hi in zip(poisoned, high, strict=True):
        np.testing.assert_array_equal(p.view(np.uint32), hi.view(np.uint32))


def test_a_bf16_matmul_filling_vmem_compiles_unshifted(monkeypatch: pytest.MonkeyPatch) -> None:
    """No help from the test: a bf16 matmul with K = 4000 puts its weight tiles past row 8191 by itself."""
    torch.manual_seed(1)
    a, b = torch.randn(16, 4000).bfloat16(), torch.randn(4000, 200).bfloat16()
    peak = _peak_row(monkeypatch)
    (out,), (ref,), exe = compile_and_run(lambda a, b: a @ b, a, b, config="large")
    assert peak[0] > 8192
    assert len(exe.summary["kernels"]) == 1
    np.testing.assert_allclose(out, ref, rtol=1.6e-2, atol=0.25)


def test_issue12_llama_hidden_512_on_large_is_one_program() -> None:
    """`ctpu llama --config large --hidden 512 --layers 2 --vocab 1024 --tokens 128 --dtype bfloat16`: its
    linears' tiles sat past row 8191 and fell back to the CPU (3 launches). ~45 s on this machine."""
    from torch_tpu_backend import llama_demo

    result = llama_demo.run(config="large", dtype=torch.bfloat16, tokens=128, layers=2, hidden=512, vocab=1024)
    assert result["stats"]["fallback_ops"] == {} and result["stats"]["kernels_launched"] == 1
    assert result["passed"], result["max_abs_err"]


@pytest.mark.parametrize(("fn", "dtype"), [
    pytest.param(lambda x: torch.exp(x) + 1.0, torch.float32, id="exp-fp32"),
    pytest.param(lambda x: torch.softmax(x, -1), torch.float32, id="softmax-fp32"),
    pytest.param(lambda x: torch.softmax(x, -1), torch.bfloat16, id="softmax-bf16")])
def test_rows_wider_than_the_dma_column_field(fn, dtype: torch.dtype) -> None:  # type: ignore[no-untyped-def]
    """A DMA's shape register is rows << 16 | cols: a row of 70000 elements (547 vmem rows on `large`: it
    fits vmem) overflowed into the row count and gave wrong numbers silently. Now: pieces of whole rows."""
    torch.manual_seed(2)
    (out,), (ref,), _ = compile_and_run(fn, torch.randn(3, 70000).to(dtype), config="large")
    rtol, atol = BF16 if dtype == torch.bfloat16 else FP32
    np.testing.assert_allclose(out, ref, rtol=rtol, atol=atol)
