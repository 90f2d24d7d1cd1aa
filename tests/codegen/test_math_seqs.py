"""The compiler's math sequences (codegen/math_seqs.py, trig_seqs.py and device_sim/sequences.py) over the
whole fp32 range: their numpy models (bit-exact with the emitted code) against float64 in ulp, a
hypothesis property over arbitrary fp32 inputs, the IEEE special values against CPU torch, and that the
simulator computes each op list bit for bit like its model.

ULP_BOUND is the documented accuracy (docs/architecture.md, "Numerics contract"): the error of the fp32
result against the float64 function, in ulp of the exact value (0.5 = correctly rounded; subnormal
results in ulp of the subnormal grid; an exact result past the fp32 range must give the same infinity).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sim_helpers import run_sequence

from codegen import math_seqs, trig_seqs
from device_sim import isa, sequences
from device_sim.sequences import ulp_error

RNG = np.random.default_rng(16)
F64: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "exp": np.exp, "log": np.log, "sin": np.sin, "cos": np.cos, "reciprocal": lambda x: 1 / x,
    "rsqrt": lambda x: 1 / np.sqrt(x), "sqrt": np.sqrt, "tanh": np.tanh,
    "erf": lambda x: torch.erf(torch.from_numpy(x)).numpy(),
}
MODELS = {"exp": sequences.exp, "log": math_seqs.log, "sin": trig_seqs.sin, "cos": trig_seqs.cos,
          "reciprocal": sequences.reciprocal, "rsqrt": sequences.rsqrt, "sqrt": math_seqs.sqrt,
          "tanh": math_seqs.tanh, "erf": math_seqs.erf}
ULP_BOUND = {"exp": 1.0, "log": 1.0, "sin": 1.0, "cos": 1.0, "reciprocal": 1.3, "rsqrt": 1.3, "sqrt": 2.0,
             "tanh": 3.5, "erf": 3.5}
DIVIDE_ULP = 3.0
# ±0, subnormals, the normal range's ends, ±inf, NaN, and the arguments the issue reported wrong
SPECIALS = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.1754942e-38, 1.1754944e-38, -1.1754944e-38,
                     np.inf, -np.inf, np.nan, 3.4028235e38, -3.4028235e38, 1.7e38, 1e10, -1e10, 1e30, 4096.0,
                     -4096.5, 1.0, -1.0, 0.5, 2.0, 88.72, -87.5, -103.9, -104.5, 1e-20, np.pi / 2], np.float32)


def _exact(name: str, x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        return F64[name](x.astype(np.float64))


def _bits_sweep(n: int) -> np.ndarray:
    """n random bit patterns of each sign over every finite fp32 value (subnormals included)."""
    x = RNG.integers(0, 0x7F800000, n, dtype=np.int64).astype(np.uint32).view(np.float32)
    return np.concatenate([x, -x])


@pytest.mark.parametrize("name", list(MODELS))
def test_within_ulp_bound_over_the_whole_range(name: str) -> None:
    x = np.concatenate([_bits_sweep(50_000), np.linspace(-12, 12, 100_001, dtype=np.float32), SPECIALS])
    err = ulp_error(MODELS[name](x), _exact(name, x))
    assert err.max() <= ULP_BOUND[name], f"{name}: {err.max():.3f} ulp at x = {x[err.argmax()]!r}"


@pytest.mark.parametrize("name", ["sin", "cos", "log", "exp", "reciprocal", "rsqrt"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(xs=st.lists(st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True),
                   min_size=1, max_size=64))
def test_ulp_property_over_all_fp32(name: str, xs: list[float]) -> None:
    x = np.array(xs, np.float32)
    err = ulp_error(MODELS[name](x), _exact(name, x))
    assert err.max() <= ULP_BOUND[name], f"{name}: {err.max():.3f} ulp at x = {x[err.argmax()]!r}"


def test_sin_cos_exact_range_reduction() -> None:
    """Regression (issue 16): Cody-Waite was exact to |x| ~ 200 only (sin(1e10) was 5.4e22, sin(3.4e38)
    -inf, 2e-4 off at 4096)."""
    # 7.729179e28: the fp32 value closest to a multiple of pi/2 (|r| = 1.6e-9, the hardest reduction)
    huge = np.array([1e10, 3.4028235e38, -3.4028235e38, 4096.0, 1e30, 2.0**100, 7.729178919452902e28], np.float32)
    for fn, name in ((trig_seqs.sin, "sin"), (trig_seqs.cos, "cos")):
        assert ulp_error(fn(huge), _exact(name, huge)).max() <= 1.0
    x = np.linspace(-4096, 4096, 400_001, dtype=np.float32)
    assert np.abs(trig_seqs.sin(x) - np.sin(x.astype(np.float64))).max() < 1e-7


def test_divide_over_the_whole_range() -> None:
    a, d = _bits_sweep(100_000), RNG.permutation(_bits_sweep(100_000))
    with np.errstate(all="ignore"):
        err = ulp_error(sequences.divide(a, d), a.astype(np.float64) / d.astype(np.float64))
    assert err.max() <= DIVIDE_ULP


@pytest.mark.parametrize("name", list(MODELS))
def test_special_values_match_cpu_torch(name: str) -> None:
    """NaN where CPU torch gives NaN, the same infinities and signed zeros, finite values within the bound
    of the float64 result (CPU torch is not the bound: it is off too where fp32 formulas overflow)."""
    got = MODELS[name](SPECIALS)
    cpu = getattr(torch, name)(torch.from_numpy(SPECIALS)).numpy()
    assert np.array_equal(np.isnan(got), np.isnan(cpu)), SPECIALS[np.isnan(got) != np.isnan(cpu)]
    assert np.array_equal(got[np.isinf(cpu)], cpu[np.isinf(cpu)])
    zero = cpu == 0
    assert np.array_equal(np.signbit(got[zero]), np.signbit(cpu[zero])), SPECIALS[zero]
    err = ulp_error(got, _exact(name, SPECIALS))
    assert err.max() <= ULP_BOUND[name], SPECIALS[err.argmax()]


def test_regressions_reported_in_issue_16() -> None:
    tiny = np.array([1e-45, 1e-40, -1e-45], np.float32)
    assert list(sequences.reciprocal(tiny)) == [np.inf, np.inf, -np.inf]  # was NaN
    assert np.isnan(math_seqs.log(np.float32([np.nan]))).all()  # was 89.13
    with np.errstate(divide="ignore"):
        assert ulp_error(math_seqs.log(tiny[:2]), np.log(tiny[:2].astype(np.float64))).max() <= 1.0  # was -88.0
    assert np.isnan(trig_seqs.sin(np.float32([np.inf, -np.inf, np.nan]))).all()


# ---- the simulator runs every op list bit for bit like its model -------------------------------------
@pytest.mark.parametrize("name", list(MODELS))
def test_simulator_matches_model(name: str) -> None:
    fn = MODELS[name]
    assert all(isa.BY_MNEMONIC[op.mnemonic].unit is isa.Unit.VECTOR for op in fn.builder.ops)
    x = np.concatenate([SPECIALS, RNG.normal(0, 100, 34).astype(np.float32)])
    got = run_sequence(fn.builder, fn.builder.ops[-1].dst, x)
    assert np.array_equal(got, fn(x).view(np.uint32)), x[got != fn(x).view(np.uint32)]



# ---- fma: x * y + z rounded once (the CPU's add / sub with alpha) ----------------------------------------
def _fma_exact(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """x y + z rounded once to fp32 (nearest, ties to even), from the exact rational value."""
    from fractions import Fraction

    out = np.empty_like(x)
    with np.errstate(all="ignore"):
        for i, (a, b, c) in enumerate(zip(x, y, z, strict=True)):
            if not np.isfinite([a, b, c]).all():
                out[i] = np.float32(np.float64(a) * np.float64(b) + np.float64(c))
                continue
            exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
            near = np.float32(float(exact))  # within an ulp: float64 rounding, then fp32's
            if exact == 0 or not np.isfinite(near):
                out[i] = np.float32(np.float64(a) * np.float64(b) + np.float64(c)) if exact == 0 else near
                continue
            candidates = [near, np.nextafter(near, np.float32(np.inf)), np.nextafter(near, np.float32(-np.inf))]
            out[i] = min((v for v in candidates if np.isfinite(v)),
                         key=lambda v: (abs(Fraction(float(v)) - exact), int(np.float32(v).view(np.uint32)) & 1))
    return out


def _same_bits(got: np.ndarray, want: np.ndarray) -> np.ndarray:
    return (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))


def test_fma_is_correctly_rounded() -> None:
    """Random operands over 60 binades, sums that cancel to a few bits, random bit patterns (any x, y, z:
    products that overflow or underflow, subnormals), and every combination of ±0, subnormals, ±1, the
    largest finite, ±inf and NaN. The one documented inexact case: a product below 2^-100 whose sum lands
    in [2^-127, 2^-126), within one ulp of the subnormal grid."""
    n = 3000
    x = (RNG.standard_normal(n) * np.exp2(RNG.integers(-30, 30, n))).astype(np.float32)
    y = RNG.standard_normal(n).astype(np.float32)
    near = (-(x.astype(np.float64) * y) * (1 + RNG.standard_normal(n) * 1e-6)).astype(np.float32)
    z = np.where(RNG.random(n) < 0.5, near, RNG.standard_normal(n).astype(np.float32))
    bits = RNG.integers(0, 2**32, (3, 3 * n), dtype=np.uint64).astype(np.uint32).view(np.float32)
    edges = np.float32([0.0, -0.0, 1e-45, -1e-45, 1.1754944e-38, 1.0, -1.0, 3.4028235e38, -3.4028235e38,
                        np.inf, -np.inf, np.nan])
    ex, ey, ez = (a.ravel() for a in np.meshgrid(edges, edges, edges))
    xs, ys, zs = (np.concatenate(p) for p in ((x, bits[0], ex), (y, bits[1], ey), (z, bits[2], ez)))
    got, want = math_seqs.fma(xs, ys, zs), _fma_exact(xs, ys, zs)
    with np.errstate(all="ignore"):
        tiny = np.abs(xs.astype(np.float64) * ys) < math_seqs.FMA_TINY
        documented = tiny & (np.abs(want) >= 2.0**-127) & (np.abs(want) < 2.0**-126)
        assert (np.abs(got[documented].astype(np.float64) - want[documented]) <= 2.0**-149).all()
    bad = ~_same_bits(got, want) & ~documented
    assert not bad.any(), list(zip(xs[bad], ys[bad], zs[bad], got[bad], want[bad], strict=True))[:5]


@pytest.mark.parametrize("alpha", [-0.1, 3e-4, -0.9, 1 / 3])
def test_fma_is_cpu_torch_add_with_alpha(alpha: float) -> None:
    """torch.add(p, g, alpha=a) on the CPU rounds p + a g once (ATen's fmadd): SGD's update, bit for bit."""
    p, g = torch.randn(4000), torch.randn(4000) * 10
    want = torch.add(p, g, alpha=alpha).numpy()
    got = math_seqs.fma(np.full(4000, np.float32(alpha)), g.numpy(), p.numpy())
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_fma_simulator_matches_model() -> None:
    fn = math_seqs.fma
    assert all(isa.BY_MNEMONIC[op.mnemonic].unit is isa.Unit.VECTOR for op in fn.builder.ops)
    x, y, z = (np.concatenate([SPECIALS, RNG.normal(0, 100, 34).astype(np.float32)]) for _ in range(3))
    y, z = RNG.permutation(y), RNG.permutation(z)
    got = run_sequence(fn.builder, fn.builder.ops[-1].dst, x, y, z)
    assert np.array_equal(got, fn(x, y, z).view(np.uint32))
