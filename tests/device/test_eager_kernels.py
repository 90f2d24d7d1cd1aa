"""Eager ops on ctpu tensors run on the CTPU as compiled single-op kernels, cached per op and layout."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_tpu_backend.stats as ctpu_stats
from fx_passes import CtpuFallbackWarning


def test_elementwise_and_reductions_run_on_the_ctpu() -> None:
    x, y = torch.randn(16, 32), torch.randn(16, 32)
    xd, yd = x.to("ctpu"), y.to("ctpu")
    ctpu_stats.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CtpuFallbackWarning)  # nothing here may fall back
        out = torch.tanh(xd) * yd + xd
        total = out.sum(dim=-1)
    torch.testing.assert_close(out.cpu(), torch.tanh(x) * y + x, rtol=2e-6, atol=1e-6)
    torch.testing.assert_close(total.cpu(), (torch.tanh(x) * y + x).sum(dim=-1), rtol=1e-5, atol=1e-5)
    s = ctpu_stats.last()
    assert s.kernels_launched == 4 and not s.fallback_ops and s.cycles > 0


def test_kernels_are_cached_per_layout() -> None:
    from torch_tpu_backend.device import eager

    xd = torch.randn(8, 8).to("ctpu")
    (xd * 3.0).cpu()
    size = len(eager._cache)
    for _ in range(3):
        (xd * 3.0).cpu()
    assert len(eager._cache) == size  # same op, shapes and dtypes: no new compile
    (torch.randn(4, 8).to("ctpu") * 3.0).cpu()
    assert len(eager._cache) == size + 1


def test_cpu_eager_mode_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_tpu_backend.device import eager_compiler

    monkeypatch.setenv("CTPU_EAGER", "cpu")
    assert eager_compiler.compile_single_op(torch.ops.aten.exp.default, (torch.ones(2, device="ctpu"),), {}) is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fills_run_on_the_ctpu(dtype: torch.dtype) -> None:
    """zero_ and fill_ (torch.zeros / zeros_like on ctpu: an optimizer's state) are CTPU kernels (they ran on
    the CPU), bit for bit: ±0, a subnormal, ±inf, NaN, the largest finite (fp32), a strided view."""
    values = [-0.0, 0.0, 1e-45, float("inf"), float("-inf"), float("nan"), 0.1]
    values += [-3.4028234663852886e38] if dtype == torch.float32 else []
    with warnings.catch_warnings():
        warnings.simplefilter("error", CtpuFallbackWarning)
        for value in values:
            x = torch.randn(5, 3).to(dtype)
            xd = x.to("ctpu")
            ctpu_stats.reset()
            xd.fill_(value)
            assert ctpu_stats.last().kernels_launched == 1
            assert torch.equal(xd.cpu().view(torch.uint8), x.fill_(value).view(torch.uint8)), value
        zeros = torch.zeros(4, 6, dtype=dtype, device="ctpu")
        view = torch.ones(4, 6, dtype=dtype, device="ctpu")
        view[:, 1::2].zero_()
    assert torch.equal(zeros.cpu(), torch.zeros(4, 6, dtype=dtype))
    want = torch.ones(4, 6, dtype=dtype)
    want[:, 1::2] = 0
    assert torch.equal(view.cpu(), want)
    assert not ctpu_stats.last().fallback_ops


def test_kernels_are_not_shared_between_equal_scalars_of_another_sign_or_type() -> None:
    """-0.0 == 0.0 (and 1 == 1.0 == True) as dict keys: the kernel compiled for x + -0.0 answered x + 0.0,
    silently (-0 + 0 is +0). The cache keys a scalar by its type and sign."""
    x = torch.tensor([-0.0, 1.0, -2.0])
    xd = x.to("ctpu")
    for scalar in (-0.0, 0.0, False, 1, 1.0, True):
        got = torch.add(xd, scalar).cpu()
        want = torch.add(x, scalar)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (scalar, got, want)
