"""The ops of training graphs (issue 15, item 2) on the simulator against eager, fp32 at "highest", with edge
values: reductions over any set of dims (the backward of every broadcast sums over batch dims)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from codegen_helpers import compile_and_run

torch.manual_seed(0)


def check(fn, *xs, rtol=1e-5, atol=1e-6):
    outs, refs, cg = compile_and_run(fn, *xs)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape
        np.testing.assert_allclose(o, r, rtol=rtol, atol=atol)
    return cg


def _edges(*shape: int) -> torch.Tensor:
    x = torch.randn(*shape)
    flat = x.view(-1)
    flat[:6] = torch.tensor([0.0, -0.0, 1e-40, -1e30, 3e38, 5.0])  # no cancellation: sums differ in order
    return x


@pytest.mark.parametrize("dims", [(0,), (1,), (0, 1), (0, 2), (1, 2), (0, 1, 2), ()])
def test_sum_over_any_dims(dims: tuple[int, ...]) -> None:
    x = _edges(3, 5, 20)
    check(lambda x: (x.sum(dims), x.sum(dims, keepdim=True), x.amax(dims), x.mean(dims)), x, atol=2e-5)


def test_reductions_with_inf_and_nan_in_outer_dims() -> None:
    x = torch.randn(4, 6, 9)
    x[1, 2, 3], x[2, 0, 0], x[3, 5, 8] = math.inf, -math.inf, math.nan
    outs, refs, _ = compile_and_run(lambda x: (x.sum(0), x.amax((0, 1)), x.sum((0, 2))), x)
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_sum_of_a_transposed_and_broadcast_operand() -> None:
    """A permute folded into the reduction (its operand strided), and a broadcast operand (stride 0 along
    a reduced dim), reduced over outer dims on the realistic large configuration."""
    x, b = torch.randn(2, 17, 128), torch.randn(128)
    outs, refs, _ = compile_and_run(lambda x, b: ((x.transpose(0, 1) * b).sum((0, 1)), (x + b).sum(1)), x, b,
                                    config="large")
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=5e-5)


def test_integer_and_bool_sums_keep_torch_dtype() -> None:
    x = torch.randn(5, 7)
    outs, refs, _ = compile_and_run(lambda x: ((x > 0).sum(0).float(), (x > 0).sum().float() / 2), x)
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_array_equal(o, r)
