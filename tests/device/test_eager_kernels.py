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
