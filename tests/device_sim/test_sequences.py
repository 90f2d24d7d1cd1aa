"""The transcendental sequences of device_sim/sequences.py: their accuracy (ulp, measured against float64
rounded by ulp_error), their special values, and that the simulator computes them bit for bit like the
numpy model (the same op list, run as a straight-line CTPU program)."""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import run_sequence

from device_sim import isa, sequences

RNG = np.random.default_rng(1234)


def _normal_floats(n: int, lo_bits: int = 0x00800000, hi_bits: int = 0x7F800000) -> np.ndarray:
    """n random positive fp32 values with uniformly random bit patterns in [lo_bits, hi_bits)."""
    return RNG.integers(lo_bits, hi_bits, n, dtype=np.int64).astype(np.uint32).view(np.float32)


def test_ops_are_ctpu_vector_instructions() -> None:
    for fn in (sequences.exp, sequences.reciprocal, sequences.rsqrt, sequences.divide):
        for op in fn.builder.ops:
            assert isa.BY_MNEMONIC[op.mnemonic].unit is isa.Unit.VECTOR


def test_exp_within_1_ulp_over_dense_sweep() -> None:
    x = np.linspace(-87.0, 88.0, 2_000_001).astype(np.float32)  # step ~8.8e-5: every binade's rounding cases
    x = np.concatenate([x, np.linspace(-1, 1, 200_001).astype(np.float32), _normal_floats(100_000, 0, 0x3F000000)])
    err = sequences.ulp_error(sequences.exp(x), np.exp(x.astype(np.float64)))
    assert err.max() < 1.0, f"max {err.max():.3f} ulp at x = {x[err.argmax()]!r}"


def test_exp_subnormal_and_overflow_ranges() -> None:
    x = np.linspace(-104.0, -87.0, 200_001).astype(np.float32)  # results in the subnormal range
    err = sequences.ulp_error(sequences.exp(x), np.exp(x.astype(np.float64)))
    assert err.max() < 1.0  # in ulps of the (subnormal) result: a single rounding
    x = np.linspace(88.0, 89.0, 10_001).astype(np.float32)
    with np.errstate(over="ignore"):
        err = sequences.ulp_error(sequences.exp(x), np.exp(x.astype(np.float64)))
    assert err.max() < 1.0  # includes the switch to +inf at 88.7228


def test_exp_special_values() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 89.0, 1e30, -104.0, -1e30], np.float32)
    y = sequences.exp(x)
    assert np.isnan(y[0]) and y.view(np.uint32)[0] == 0x7FC00000
    assert list(y[1:]) == [np.inf, 0.0, 1.0, 1.0, np.inf, np.inf, 0.0, 0.0]


def test_reciprocal_within_1p3_ulp_over_the_whole_range() -> None:
    d = np.concatenate([_normal_floats(2_000_000, 1, 0x7F800000),  # subnormal d (results up to inf) included
                        np.arange(0x3F800000, 0x40000000, 16, dtype=np.uint32).view(np.float32),
                        np.arange(0x7E800000, 0x7F800000, 64, dtype=np.uint32).view(np.float32)])  # subnormal 1/d
    for sign in (1, -1):
        with np.errstate(divide="ignore", over="ignore"):
            err = sequences.ulp_error(sequences.reciprocal(sign * d), sign / d.astype(np.float64))
        assert err.max() < 1.3, f"max {err.max():.3f} ulp at d = {d[err.argmax()]!r}"


def test_reciprocal_exact_on_powers_of_two_and_special_values() -> None:
    p = np.float32(2.0) ** np.arange(-149, 128, dtype=np.float32)  # subnormal d and subnormal 1/d included
    with np.errstate(over="ignore"):
        assert np.array_equal(sequences.reciprocal(p), (1 / p.astype(np.float64)).astype(np.float32))
    d = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**127, -3e38, 1e-45, -1e-40], np.float32)
    y = sequences.reciprocal(d)
    assert list(y[:4]) == [np.inf, -np.inf, 0.0, 0.0] and np.signbit(y[3]) and np.isnan(y[4])
    assert y[5] == np.float32(2.0**-127) and y[6] == np.float32(-1 / 3e38)  # subnormal results, not 0
    assert list(y[7:]) == [np.inf, -np.inf]  # regression (issue 16): 1/subnormal was NaN


def test_divide_within_3_ulp_over_the_whole_range() -> None:
    """a * y, y within 1.3 ulp of 1/d: up to 2.6 ulp of q where q's significand is larger than y's, plus
    the rounding of the product (measured: 2.07)."""
    a = _normal_floats(1_000_000, 1, 0x7F800000) * RNG.choice(np.float32([-1, 1]), 1_000_000)
    d = _normal_floats(1_000_000, 1, 0x7F800000)
    near = d * RNG.uniform(0.5, 2, d.size).astype(np.float32)  # quotients near 1, at every magnitude
    for num in (a, near):
        with np.errstate(all="ignore"):
            err = sequences.ulp_error(sequences.divide(num, d), num.astype(np.float64) / d.astype(np.float64))
        assert err.max() < 3.0, f"max {err.max():.3f} ulp at {num[err.argmax()]!r} / {d[err.argmax()]!r}"


def test_divide_special_values_as_ieee() -> None:
    v = np.array([0.0, -0.0, 1e-45, -1e-40, 1.0, -2.5, 3e38, -3.4028235e38, np.inf, -np.inf, np.nan], np.float32)
    a, d = (m.ravel() for m in np.meshgrid(v, v))
    with np.errstate(all="ignore"):
        want = a / d
    got = sequences.divide(a, d)
    assert np.array_equal(np.isnan(got), np.isnan(want))
    ok = np.isnan(want) | (sequences.ulp_distance(got, want) <= 2)
    assert ok.all(), list(zip(a[~ok], d[~ok], got[~ok], want[~ok], strict=True))
    assert np.array_equal(np.signbit(got[want == 0]), np.signbit(want[want == 0]))
    assert sequences.divide(np.float32(3e38), np.float32(3e38)) == 1.0  # was 0: 1/d flushed to zero


def test_rsqrt_within_1p3_ulp_including_subnormals() -> None:
    x = np.concatenate([_normal_floats(2_000_000, 1, 0x7F800000),
                        np.arange(0x3F800000, 0x40800000, 16, dtype=np.uint32).view(np.float32)])
    err = sequences.ulp_error(sequences.rsqrt(x), 1 / np.sqrt(x.astype(np.float64)))
    assert err.max() < 1.3, f"max {err.max():.3f} ulp at x = {x[err.argmax()]!r}"


def test_rsqrt_special_values() -> None:
    x = np.array([0.0, -0.0, np.inf, -1.0, -np.inf, np.nan, 4.0, 0.25], np.float32)
    y = sequences.rsqrt(x)
    assert list(y[[0, 1, 2, 6, 7]]) == [np.inf, -np.inf, 0.0, 0.5, 2.0]
    assert np.isnan(y[3:6]).all() and (y[3:6].view(np.uint32) == 0x7FC00000).all()


def test_ulp_measures() -> None:
    one = np.float32(1.0)
    assert sequences.ulp_distance(one, np.nextafter(one, np.float32(2))) == 1
    assert sequences.ulp_distance(np.float32(-0.0), np.float32(0.0)) == 0
    assert sequences.ulp_distance(np.float32(np.nan), np.float32(np.nan)) == 0
    assert sequences.ulp_error(np.float32(1.0), 1.0 + 2.0**-24) == pytest.approx(0.5)


# ---- the simulator runs the same op list bit for bit ---------------------------------------------
SPECIALS = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 2.0**-149, 2.0**-126, 2.0**127, 88.7, -103.9,
                     3e38, -3e38, 0.5, 1e-30, -1e-40, 3.4028235e38, 1e10, -7.5e-39], np.float32)


def run_on_simulator(fn, *inputs: np.ndarray) -> np.ndarray:
    """The sequence of a numpy model (fn.builder) run on the simulator: the result's bits."""
    return run_sequence(fn.builder, fn.builder.ops[-1].dst, *inputs)


def _values(n: int) -> np.ndarray:
    return np.concatenate([SPECIALS, RNG.normal(0, 30, 44).astype(np.float32),
                           _normal_floats(n, 1, 0x7F800000), -_normal_floats(n, 1, 0x7F800000)])


@pytest.mark.parametrize("fn", [sequences.exp, sequences.reciprocal, sequences.rsqrt],
                         ids=["exp", "reciprocal", "rsqrt"])
def test_simulator_matches_numpy_model(fn) -> None:
    for chunk in _values(64).reshape(-1, 64):
        assert np.array_equal(run_on_simulator(fn, chunk), fn(chunk).view(np.uint32).reshape(-1)), chunk


def test_simulator_matches_divide_model() -> None:
    a, d = _values(64), RNG.permutation(_values(64))
    for x, y in zip(a.reshape(-1, 64), d.reshape(-1, 64), strict=True):
        assert np.array_equal(run_on_simulator(sequences.divide, x, y), sequences.divide(x, y).view(np.uint32))


def test_exp_is_one_instruction_of_the_exp_unit() -> None:
    """The compiler's exp is one `vexp.f`; the unit's 30 steps give its bits (and the RTL's fp32_exp)."""
    b = sequences.SeqBuilder()
    sequences.exp_seq(b, b.input("x"))
    assert [op.mnemonic for op in b.ops] == ["vexp.f"]
    unit = sequences.SeqBuilder()
    out = sequences.exp_unit_seq(unit, unit.input("x"))
    assert len(unit.ops) == 30
    x = np.array([0.0, -0.0, 1.0, -1.0, 88.72, 88.73, -87.4, -103.9, -104.1, np.inf, -np.inf, np.nan, 1e-45,
                  3e38, -3e38], dtype=np.float32)
    steps = sequences.evaluate(unit, {"x": x}, [out])[0]
    assert np.array_equal(sequences.exp(x).view(np.uint32), steps.view(np.uint32))
    assert np.array_equal(sequences.exp_unit_bits(x.view(np.uint32)), steps.view(np.uint32))


def test_reciprocal_and_divide_are_instructions_of_the_reciprocal_unit() -> None:
    """The compiler's 1 / d and a / d are one `vrcp.f` / `vdiv.f`; the unit's 26 / 27 plain vector steps
    give their bits (and the RTL's fp32_rcp / fp32_div), over subnormal, huge and special operands."""
    for seq, mnemonic in ((sequences.reciprocal_seq, "vrcp.f"), (sequences.divide_seq, "vdiv.f")):
        b = sequences.SeqBuilder()
        seq(b, *(b.input(f"in{i}") for i in range(len(isa.BY_MNEMONIC[mnemonic].operands) - 1)))
        assert [op.mnemonic for op in b.ops] == [mnemonic]
    rcp_steps, div_steps = sequences.model(sequences.rcp_unit_seq), sequences.model(sequences.div_unit_seq, 2)
    assert (len(rcp_steps.builder.ops), len(div_steps.builder.ops)) == (26, 27)
    for steps in (rcp_steps, div_steps):
        assert all(isa.BY_MNEMONIC[op.mnemonic].latency == isa.LAT_VALU for op in steps.builder.ops)
    d = np.concatenate([SPECIALS, _normal_floats(200, 1, 0x7F800000), -_normal_floats(200, 1, 0x00800000)])
    a = RNG.permutation(np.concatenate([SPECIALS, RNG.normal(0, 1e6, d.size - SPECIALS.size).astype(np.float32)]))
    assert np.array_equal(sequences.reciprocal(d).view(np.uint32), rcp_steps(d).view(np.uint32))
    assert np.array_equal(sequences.rcp_unit_bits(d.view(np.uint32)), rcp_steps(d).view(np.uint32))
    assert np.array_equal(sequences.divide(a, d).view(np.uint32), div_steps(a, d).view(np.uint32))
    assert np.array_equal(sequences.div_unit_bits(a.view(np.uint32), d.view(np.uint32)),
                          div_steps(a, d).view(np.uint32))
