"""pow with a tensor exponent (BLOOM's ALiBi slopes, `base ** arange`) and with any scalar exponent, against
eager on a grid of edge values: ±0, ±1, ±inf, NaN, subnormals, the largest finite, negative bases with
integer and non-integer exponents, exponents 0, ±1/2, ±31..33, 300, 2^24 + 2 (even), 1e10, ±inf, NaN. Special
values and small integer exponents with a representable result are bit-exact; the rest (exp(y log|x|)) is
within 2.5e-6 relative."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from codegen_helpers import compile_and_run

X = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, 0.5, -0.5, 3.0, -3.0, 10.0, 1e-40, -1e-40, 1e30, -1e30, math.inf, -math.inf,
     math.nan, 3.4028235e38, 0.7]
Y = [0.0, -0.0, 1.0, -1.0, 2.0, 3.0, -3.0, 0.5, -0.5, 31.0, 300.0, 33.0, -33.0, 1.5, 1e10, math.inf, -math.inf,
     math.nan, 2.0**24 + 2, 7.0]


def _compare(got: np.ndarray, want: np.ndarray, x: np.ndarray, y: np.ndarray) -> None:
    exact = ~np.isfinite(want) | (want == 0) | ~np.isfinite(x) | ~np.isfinite(y) | (np.abs(x) == 1) | (y == 0)
    exact |= (np.abs(y) <= 255) & (y == np.trunc(y)) & (np.float64(x) ** np.float64(y) == want)  # representable
    np.testing.assert_array_equal(got[exact], want[exact])
    numbers = exact & ~np.isnan(want)  # a NaN's sign and payload are the device's
    assert (np.signbit(got[numbers]) == np.signbit(want[numbers])).all()
    np.testing.assert_allclose(got[~exact], want[~exact], rtol=2.5e-6)


def test_pow_tensor_tensor_edge_values() -> None:
    x = torch.tensor(X).repeat_interleave(len(Y))
    y = torch.tensor(Y).repeat(len(X))
    outs, refs, _ = compile_and_run(lambda a, b: torch.pow(a, b), x, y)
    _compare(outs[0], refs[0], x.numpy(), y.numpy())


@pytest.mark.parametrize("p", [-3, 5, 1.5, -0.25, 33, -104, 1e10])
def test_pow_with_a_scalar_exponent(p: float) -> None:
    x = torch.tensor(X)
    outs, refs, _ = compile_and_run(lambda a: a ** p, x)
    _compare(outs[0], refs[0], x.numpy(), np.full(len(X), p, np.float32))


def test_alibi_slopes_of_integer_powers_and_a_scalar_base() -> None:
    """BLOOM: torch.pow(base, arange(1, 1 + n)) with a float base tensor and int64 powers; pow.Scalar too."""
    base, powers = torch.tensor(2 ** (-(2 ** -(math.log2(16) - 3)))), torch.arange(1, 17)
    outs, refs, _ = compile_and_run(lambda b, p: (torch.pow(b, p), torch.pow(0.5, p.float() - 9)), base, powers)
    np.testing.assert_allclose(outs[0], refs[0], rtol=1e-6)
    np.testing.assert_array_equal(outs[1], refs[1])


def test_pow_bf16() -> None:
    x, y = torch.tensor(X).bfloat16(), torch.tensor(Y[: len(X)]).bfloat16()
    outs, refs, _ = compile_and_run(lambda a, b: torch.pow(a, b), x, y)
    np.testing.assert_allclose(outs[0], refs[0], rtol=2**-8, equal_nan=True)
