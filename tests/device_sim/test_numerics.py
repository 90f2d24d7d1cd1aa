"""The numerics contract, through real CTPU instructions on the simulator, against numpy bit patterns."""

from __future__ import annotations

import numpy as np
import pytest
from sim_helpers import run_asm, vector_op

from device_sim import numerics

F32 = np.float32


def f32(*values: float) -> np.ndarray:
    return np.resize(np.array(values, F32), 64)


def bits_of(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=F32).view(np.uint32).reshape(8, 8)


def from_bits(*bits: int) -> np.ndarray:
    return np.resize(np.array(bits, np.uint32), 64).view(F32)


def test_fp32_add_rounds_ties_to_even() -> None:
    one, ulp = F32(1.0), F32(2.0**-23)
    a = f32(1.0, 1.0 + 2.0**-23, -1.0, 3.0)
    b = f32(2.0**-24, 2.0**-24, -(2.0**-24), 2.0**-23)
    out = vector_op("vadd.f v4, v1, v2", a, b).view(F32).ravel()
    assert out[0] == one  # 1 + half ulp: tie -> even (1.0)
    assert out[1] == one + 2 * ulp  # (1 + ulp) + half ulp: tie -> even (1 + 2 ulp)
    assert out[2] == -one
    np.testing.assert_array_equal(out, (a + b))


def test_subnormals_are_kept_not_flushed() -> None:
    tiny = F32(np.finfo(F32).smallest_subnormal)
    a = f32(tiny, 3 * tiny, np.finfo(F32).tiny, 1e-30)
    b = f32(tiny, -tiny, F32(0.5), F32(1e-10))
    add = vector_op("vadd.f v4, v1, v2", a, b).view(F32).ravel()
    mul = vector_op("vmul.f v4, v1, v2", a, b).view(F32).ravel()
    np.testing.assert_array_equal(add.view(np.uint32), (a + b).view(np.uint32))
    np.testing.assert_array_equal(mul.view(np.uint32), (a * b).view(np.uint32))
    assert add[0] == 2 * tiny and mul[2] == np.finfo(F32).tiny / 2  # gradual underflow


def test_inf_and_nan_results_are_canonical() -> None:
    inf = F32(np.inf)
    payload_nan = from_bits(0x7FA12345)[0]  # a signalling NaN with a payload
    a = f32(inf, inf, payload_nan, 0.0, -inf, 1.0)
    b = f32(-inf, 0.0, 1.0, 0.0, -inf, payload_nan)
    add = vector_op("vadd.f v4, v1, v2", a, b).ravel()
    mul = vector_op("vmul.f v4, v1, v2", a, b).ravel()
    mx = vector_op("vmax.f v4, v1, v2", a, b).ravel()
    assert add[0] == numerics.CANONICAL_NAN_F32  # inf + -inf
    assert mul[1] == numerics.CANONICAL_NAN_F32  # inf * 0
    assert add[2] == mul[2] == mx[2] == numerics.CANONICAL_NAN_F32  # NaN in, canonical NaN out
    assert mx[5] == numerics.CANONICAL_NAN_F32
    assert add[4] == bits_of(f32(-inf)).ravel()[0]
    assert vector_op("vsub.f v4, v1, v2", a, b).ravel()[3] == 0  # 0 - 0 = +0


def test_max_min_signed_zero_and_compare_rules() -> None:
    a, b = f32(-0.0, 0.0, 1.0, np.nan), f32(0.0, -0.0, 2.0, 1.0)
    mx = vector_op("vmax.f v4, v1, v2", a, b).ravel()
    assert mx[0] == 0x80000000 and mx[1] == 0  # b > a false for zeros: returns a
    lt = vector_op("vcmp.lt.f v4, v1, v2", a, b).ravel()
    eq = vector_op("vcmp.eq.f v4, v1, v2", a, b).ravel()
    assert list(eq[:4]) == [0xFFFFFFFF, 0xFFFFFFFF, 0, 0]  # -0 == +0; NaN compares false
    assert list(lt[:4]) == [0, 0, 0xFFFFFFFF, 0]


def test_conversions() -> None:
    a = f32(2.7, -2.7, 3e9, -3e9, np.nan, 0.5, -0.0, 16777217.0)
    out = vector_op("vcvt.f2i v4, v1", a).view(np.int32).ravel()
    assert list(out[:8]) == [2, -2, 2**31 - 1, -(2**31), 0, 0, 0, 16777216]
    ints = np.resize(np.array([16777217, -16777219, 7, -(2**31)], np.int32), 64)
    fl = vector_op("vcvt.i2f v4, v1", ints).view(F32).ravel()
    np.testing.assert_array_equal(fl, ints.astype(F32))  # numpy int->float is RNE
    assert fl[0] == 16777216.0 and fl[1] == -16777220.0


@pytest.mark.parametrize("value,expected", [
    (1.0 + 2.0**-8, 0x3F80),  # tie between 1 and 1+2^-7 -> even (1.0)
    (1.0 + 3 * 2.0**-8, 0x3F82),  # tie -> even (upper)
    (3.4e38, 0x7F80),  # overflow -> inf
    (-0.0, 0x8000),
    (float(np.finfo(F32).smallest_subnormal) * 65536 * 3, 0x0003),  # bf16 subnormal kept
])
def test_bf16_rounding(value: float, expected: int) -> None:
    assert int(numerics.f32_to_bf16_bits(np.array([value], F32))[0]) == expected
    out = vector_op("vcvt.bf v4, v1", f32(value)).ravel()[0]
    assert out == expected << 16


def test_bf16_nan_is_canonical() -> None:
    assert numerics.f32_to_bf16_bits(from_bits(0xFFFFFFFF))[0] == numerics.CANONICAL_NAN_BF16


def test_bf16_products_are_exact_and_mxu_sums_in_order() -> None:
    rng = np.random.default_rng(0)
    x = numerics.round_to_bf16(rng.standard_normal((16, 8)).astype(F32))
    w = numerics.round_to_bf16(rng.standard_normal((8, 8)).astype(F32))
    # every product of two bf16 values is exact in fp32
    prod = x[:, :, None] * w[None, :, :]
    np.testing.assert_array_equal(prod.astype(np.float64), x[:, :, None].astype(np.float64) * w[None])
    # the MXU sum is k-ascending fp32: check against a float64-free sequential model
    expected = np.zeros((16, 8), F32)
    for k in range(8):
        expected = (expected + prod[:, k, :]).astype(F32)
    np.testing.assert_array_equal(numerics.mxu_matmul(x, w), expected)


def test_mxu_on_the_simulator_is_bit_exact() -> None:
    rng = np.random.default_rng(1)
    a = rng.standard_normal((24, 8)).astype(F32) * 100
    w = rng.standard_normal((8, 8)).astype(F32)
    acc = rng.standard_normal((24, 8)).astype(F32)
    sim, _ = run_asm(MXU_PROGRAM, {0: a, 0x1000: w, 0x2000: acc})
    out = sim.read_hbm(0x3000, (24, 8), F32)
    expected = (acc + numerics.mxu_matmul(a, w)).astype(F32)
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    assert not np.array_equal(numerics.mxu_matmul(a, w), a @ w)  # bf16 inputs do change the result


MXU_PROGRAM = """
    li s1, 0 ; li s2, 0x1000
    li s3, 8 ; li s4, 8
    lih s3, 24 ; li s5, 8
    lih s5, 8 ; li s6, 0x2000
    li s7, 100 ; li s8, 200
    dma.ld s1, s0, s3, s4, f0 ; li s9, 24
    dma.ld s2, s7, s5, s4, f0 ; li s10, 0x3000
    dma.ld s6, s8, s3, s4, f0
    wait f0 ; mxu.lw s7, f1
    mxu.mmas s0, s8, s9, f1
    wait f1 ; dma.st s10, s8, s3, s4, f2
    halt
"""


def test_tree_reduction_order() -> None:
    # sequential summation gives 0 here (1e8 absorbs the ones); pairwise halves give 3
    row = np.array([1e8, 1.0, 1.0, 1.0, -1e8, 0.0, 0.0, 0.0], F32)
    a = np.tile(row, 8)
    out = vector_op("vred.sum.l v4, v1", a).view(F32)
    assert out[0, 0] == F32(3.0) and (out == out[:, :1]).all()
    np.testing.assert_array_equal(out, numerics.tree_reduce(a.reshape(8, 8), 1, "sum"))
    col = vector_op("vred.max.s v4, v1", np.arange(64, dtype=F32)).view(F32)
    np.testing.assert_array_equal(col, np.broadcast_to(np.arange(56, 64, dtype=F32), (8, 8)))


# ---- the vectorized numerics against their definitions, one element at a time ------------------------
EDGES = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -1e-40, 3.38e38, -3.38e38, 1.0, -1.0, 2.5], F32)


def _edge_values(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    x = numerics.round_to_bf16(rng.standard_normal(shape).astype(F32) * F32(1e3))
    edge = rng.random(shape) < 0.25
    x[edge] = rng.choice(EDGES, int(edge.sum()))
    x.view(np.uint32)[rng.random(shape) < 0.02] = 0x7FA00001  # a NaN that is not canonical
    return x


def _scalar_max(a: F32, b: F32) -> F32:
    return F32(np.nan) if np.isnan(a) or np.isnan(b) else (b if b > a else a)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=F32).view(np.uint32)


def test_fmax_fmin_and_tree_reductions_match_their_definitions_bit_for_bit() -> None:
    rng = np.random.default_rng(7)
    for _ in range(20):
        a, b = _edge_values(rng, (8, 16)), _edge_values(rng, (8, 16))
        want_max = [_scalar_max(x, y) for x, y in zip(a.ravel(), b.ravel(), strict=True)]
        want_min = [-_scalar_max(-x, -y) for x, y in zip(a.ravel(), b.ravel(), strict=True)]
        for got, want in ((numerics.fmax(a, b), want_max), (numerics.fmin(a, b), want_min)):
            want = numerics.canonicalize_nan(np.array(want, F32).reshape(a.shape))
            np.testing.assert_array_equal(_bits(got), _bits(want))
        for axis in (0, 1):
            for op in ("sum", "max"):
                x = np.moveaxis(a, axis, -1).copy()
                while x.shape[-1] > 1:  # the definition: pairwise halves, one element at a time
                    h = x.shape[-1] // 2
                    pairs = zip(x[..., :h].ravel(), x[..., h:].ravel(), strict=True)
                    with np.errstate(all="ignore"):
                        x = np.array([F32(lo + hi) if op == "sum" else _scalar_max(lo, hi) for lo, hi in pairs],
                                     F32).reshape(*x.shape[:-1], h)
                want = np.moveaxis(np.broadcast_to(numerics.canonicalize_nan(x), (*x.shape[:-1], a.shape[axis])),
                                   -1, axis)
                np.testing.assert_array_equal(_bits(numerics.tree_reduce(a, axis, op)), _bits(want))


@pytest.mark.parametrize("rows", [1, 8, 33])
def test_mxu_matmul_matches_its_definition_bit_for_bit(rows: int) -> None:
    rng = np.random.default_rng(rows)
    x, w = _edge_values(rng, (rows, 16)), _edge_values(rng, (16, 16))
    x[0], w[:, 0] = -0.0, 1.0  # -0 products only: the sum starts at +0, so it is +0
    want = np.zeros((rows, 16), F32)
    with np.errstate(all="ignore"):
        for i, j in np.ndindex(rows, 16):
            acc = F32(0.0)
            for k in range(16):  # k ascending, fp32 rounding at every step
                acc = F32(acc + F32(x[i, k] * w[k, j]))
            want[i, j] = acc
    np.testing.assert_array_equal(_bits(numerics.mxu_matmul_bf16(x, w)), _bits(numerics.canonicalize_nan(want)))
