"""Eager ops on ctpu tensors: views, strides, in-place, out=, 0-d, printing, one warning per fallback op."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch

from torch_tpu_backend import stats
from torch_tpu_backend.device import eager
from torch_tpu_backend.device.fallback import CtpuFallbackWarning


def _pair(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    cpu = torch.arange(float(torch.Size(shape).numel())).reshape(shape)
    return cpu, cpu.to("ctpu")


def test_views_share_hbm() -> None:
    cpu, dev = _pair(4, 6)
    for view in (lambda t: t.t(), lambda t: t[1:, ::2], lambda t: t.view(3, 8), lambda t: t.unfold(1, 2, 2),
                 lambda t: t.diagonal(), lambda t: t.as_strided((2, 2), (1, 6), 3), lambda t: t[2],
                 lambda t: t.permute(1, 0).reshape(6, 4)[::2], lambda t: t.expand(2, 4, 6)):
        v_dev, v_cpu = view(dev), view(cpu)
        assert (v_dev.shape, v_dev.stride(), v_dev.storage_offset()) == (
            v_cpu.shape, v_cpu.stride(), v_cpu.storage_offset())
        assert torch.equal(v_dev.cpu(), v_cpu)
    assert dev.t().untyped_storage().data_ptr() == dev.untyped_storage().data_ptr()


def test_inplace_writes_back_through_views() -> None:
    cpu, dev = _pair(4, 6)
    for t in (cpu, dev):
        t[:, 1::2].add_(100)
        t.t()[2].mul_(-1)
        t[0].zero_()
        t.diagonal().fill_(7)
    assert torch.equal(dev.cpu(), cpu)
    y = dev.clone()
    assert y.add_(1) is y  # in-place returns the caller's tensor


def test_out_variants_resize_and_write() -> None:
    cpu, dev = _pair(3, 5)
    out = torch.empty(0, device="ctpu")
    res = torch.mul(dev, 2, out=out)
    assert res is out and out.shape == (3, 5) and torch.equal(out.cpu(), cpu * 2)
    buf = torch.zeros(2, 3, 5, device="ctpu")
    torch.add(dev, 1, out=buf[1])  # out= into a view
    assert torch.equal(buf.cpu()[1], cpu + 1) and buf.cpu()[0].abs().sum() == 0
    vals, idx = torch.empty(0, device="ctpu"), torch.empty(0, dtype=torch.long, device="ctpu")
    torch.max(dev, 1, out=(vals, idx))
    assert torch.equal(vals.cpu(), cpu.max(1).values) and torch.equal(idx.cpu(), cpu.max(1).indices)


def test_non_contiguous_inputs() -> None:
    cpu, dev = _pair(6, 8)
    for fn in (lambda t: t.t() @ t, lambda t: t[::2, 1::3].exp(), lambda t: t.t().sum(0),
               lambda t: torch.cat([t.t(), t.t()]), lambda t: t.t().softmax(-1), lambda t: t.t() + t.t()):
        torch.testing.assert_close(fn(dev).cpu(), fn(cpu))
    r = (dev.t() * 2)
    assert r.stride() == (cpu.t() * 2).stride()  # the CPU kernel's output layout is kept


def test_zero_dim_tensors_and_scalars() -> None:
    cpu, dev = _pair(5)
    s = dev.sum()
    assert s.dim() == 0 and s.device.type == "ctpu" and s.item() == 10.0
    assert float(dev[3]) == 3.0 and int(dev.argmax()) == 4 and bool(dev.max() > 3)
    assert torch.equal((dev * s).cpu(), cpu * 10)
    assert torch.equal((dev + torch.tensor(1.0)).cpu(), cpu + 1)  # a 0-d CPU tensor mixes with ctpu
    assert dev.tolist() == cpu.tolist()


def test_printing() -> None:
    cpu, dev = _pair(2, 3)
    assert repr(dev) == repr(cpu)[:-1] + ", device='ctpu:0')"
    assert "device='ctpu:0'" in repr(torch.tensor(2.5, device="ctpu"))
    assert "ctpu" in str(torch.empty(0, device="ctpu"))


def test_one_warning_per_fallback_op_and_stats() -> None:
    x = torch.randn(4, device="ctpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            x.cumprod(0)  # no CTPU lowering: runs on the CPU
    names = [str(w.message) for w in caught if issubclass(w.category, CtpuFallbackWarning)]
    assert len(names) == 1 and "aten::cumprod" in names[0]
    assert stats.last().fallback_ops["aten::cumprod.out"] == 3


def test_fallback_warning_category_is_public() -> None:
    assert torch.ctpu.CtpuFallbackWarning is CtpuFallbackWarning
    with pytest.warns(CtpuFallbackWarning, match="aten::sort"):
        torch.ones(3, device="ctpu").sort()


def test_eager_hook_takes_over_ops() -> None:
    seen: list[str] = []

    def compiler(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if op is not torch.ops.aten.neg.out:
            return None  # not compiled: the CPU fallback runs it

        def kernel(x: torch.Tensor, *, out: torch.Tensor) -> torch.Tensor:
            seen.append("neg")
            return out.copy_(x.cpu() * -1)  # stands in for a launch on the CTPU

        return kernel

    previous = eager.get_eager_compiler()
    eager.set_eager_compiler(compiler)
    try:
        x = torch.arange(3.0, device="ctpu")
        assert torch.equal((-x).cpu(), torch.tensor([0.0, -1.0, -2.0]))
        assert torch.equal((-x).cpu(), torch.tensor([0.0, -1.0, -2.0]))
        assert seen == ["neg", "neg"] and len(eager._cache) >= 1
        assert "aten::neg.out" not in stats.last().fallback_ops
    finally:
        eager.set_eager_compiler(previous)


def test_conjugate_and_negative_views_copy_resolved() -> None:
    x = torch.randn(3, dtype=torch.complex64)
    dev = x.to("ctpu").conj()
    assert dev.is_conj() and torch.equal(dev.cpu(), x.conj()) and torch.equal((dev * 1).cpu(), x.conj())
    neg = torch._neg_view(torch.ones(2, device="ctpu"))
    assert torch.equal(neg.cpu(), -torch.ones(2))
