"""Integer arithmetic on the CTPU is exact: elementwise ops on integers run as integer instructions (`vadd.i`,
`vmul.i`, `vcmp.lt.i`, ...) and integer sums by 11-bit limbs, each summed exactly in f32. Through f32 alone
an integer above 2^24 lost its low bits silently (`x + 1` of 2^24 + 1 gave 2^24, `x == x + 1` was True)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import torch_tpu_backend.stats as ctpu_stats

BIG = torch.tensor([2**24 + 1, -(2**24) - 3, 100_000_007, -(2**30) + 5, 2**31 - 2, -(2**31) + 1, 7, 0, -1])
SMALL = torch.tensor([1, -1, 3, 2, 1, 1, 9, 0, 5])

ELEMENTWISE = {
    "add": lambda a, b: a + b, "sub": lambda a, b: a - 1, "mul": lambda a, b: (a // 1024) * b,
    "axpy": lambda a, b: b * 3 - 1 + a // 4, "neg_abs": lambda a, b: (-a // 2).abs(),
    "compare": lambda a, b: (a == a + 1, a < 16777218, a >= b, a != b),
    "where": lambda a, b: torch.where(b > 1, a, 16777219),
    "min_max": lambda a, b: (torch.maximum(a, b), torch.minimum(a, b)),
    "clamp": lambda a, b: a.clamp(-(2**24) - 2, 2**26 + 1), "relu": lambda a, b: torch.relu(a),
    "bitwise": lambda a, b: (a & b, a | 12, a ^ b, ~a, (a > 0) & (b > 2), ~(b > 2)),
    "masked_fill": lambda a, b: a.masked_fill(b > 2, 16777217), "positions": lambda a, b: torch.arange(9) + a // 2,
}


def _compiled(fn, *args):
    torch._dynamo.reset()
    ctpu_stats.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a CPU fallback warns
        got = torch.compile(fn, backend="ctpu", options={"cache": False})(*args)
    assert ctpu_stats.last().kernels_launched >= 1 and not ctpu_stats.last().fallback_ops
    return got


@pytest.mark.parametrize("name", ELEMENTWISE)
def test_integer_elementwise_is_exact_above_2_to_24(name: str) -> None:
    fn = lambda a, b: ELEMENTWISE[name](a, b)
    got, expected = _compiled(fn, BIG, SMALL), fn(BIG, SMALL)
    for g, e in zip(*(x if isinstance(x, tuple) else (x,) for x in (got, expected)), strict=True):
        assert g.dtype == e.dtype and torch.equal(g, e), (name, g, e)


def test_an_integer_matmul_runs_on_the_cpu_not_on_the_float_mxu() -> None:
    """It gave zeros, silently (the MXU multiplies floats)."""
    a, b = torch.tensor([[3, -5, 7], [0, 1, -9]]), torch.tensor([[2, 4, -8], [6, -1, 5]])
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="MXU multiplies floats"):
        got = torch.compile(lambda x, y: x @ y.t(), backend="ctpu", options={"cache": False})(a, b)
    assert torch.equal(got, a @ b.t())


def test_integer_sums_and_prefix_sums_are_exact() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(-(2**27), 2**27, (3, 5, 40), generator=g)
    x[0, 0, :4] = torch.tensor([2**24 + 1, 1, 1, 1])
    fn = lambda t: (t.sum(-1), t.sum(0), t.sum((0, 2)), t.sum(), t.cumsum(-1), (t > 0).sum(-1))
    for got, expected in zip(_compiled(fn, x), fn(x), strict=True):
        assert torch.equal(got, expected)


def test_an_integer_sum_too_long_to_be_exact_runs_on_the_cpu() -> None:
    x = torch.ones(3, 9000, dtype=torch.int64)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="integer sum of 9000 terms"):
        got = torch.compile(lambda t: t.sum(-1) + 1, backend="ctpu", options={"cache": False})(x)
    assert torch.equal(got, x.sum(-1) + 1)


def test_integer_ops_with_no_exact_form_are_refused_not_approximated() -> None:
    from codegen.fx_to_mlir import IntegerBodyWriter, MlirEmitter, UnsupportedOp

    w = IntegerBodyWriter(MlirEmitter(), "i32")
    for op in ("math.exp", "arith.divf", "math.floor"):
        with pytest.raises(UnsupportedOp, match="of integers"):
            w.op(op, "%x", "%y")
    with pytest.raises(UnsupportedOp, match=r"constant 0\.5"):
        w.const(0.5)


def test_codegen_keeps_int32_graph_values_exact() -> None:
    from codegen_helpers import trace

    from codegen import compile_graph
    from device_sim.executable import run_fresh
    from device_sim.runners import SimulatorRunner

    fn = lambda a: (a * 2 + 16777217, a.cumsum(0))
    x = BIG.int() // 4
    outs, _ = run_fresh(compile_graph(trace(fn, x), [x], "small"), [x.numpy()], SimulatorRunner("small"))
    for o, r in zip(outs, fn(x), strict=True):
        np.testing.assert_array_equal(o, r.numpy())
