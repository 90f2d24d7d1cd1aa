"""The compiler's math sequences: every transcendental is a straight-line list of simple vector ops.

Each sequence is written ONCE, as a `device_sim.sequences.SeqBuilder` op list, and used twice: `emit`
turns it into machine IR for instruction selection, and `model` runs the same list op by op in numpy (the
bit-exact model tests measure in ulp against float64 over the whole fp32 range). exp, reciprocal, divide
and rsqrt are device_sim.sequences' (shared with the hand-written programs); this module adds

- sqrt: x * rsqrt(x), with ±0 and +inf passed through.
- tanh: odd polynomial for |x| < 0.4, (1 - e)/(1 + e) with e = exp(-2|x|) above.
- log: x = m 2^e with m in [sqrt(1/2), sqrt(2)) (subnormal x pre-scaled by 2^24), fdlibm's logf kernel
  (s = f / (2 + f), degree 4 in s^2); log(±0) = -inf, log(x < 0) = log(NaN) = NaN, log(inf) = inf.
- erf: odd Taylor polynomial below |x| = 0.5, 1 - erfc above (Numerical Recipes' erfcc).
- sin, cos: trig_seqs.py (exact Payne-Hanek range reduction over the whole fp32 range).
- fma: a * b + c rounded once (what the CPU's add / sub with alpha computes: `vec::fmadd`), from exact
  transformations: Dekker's product, Knuth's sum, and a sum rounded to odd (Boldo and Melquiond, "Emulation
  of FMA and correctly rounded sums: proved algorithms using rounding to odd", IEEE TC 2008).

The accuracy of each, measured by tests/codegen/test_math_seqs.py, is listed in docs/architecture.md
("Numerics contract").
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from codegen.builder import Builder
from codegen.mir import Reg
from device_sim import sequences
from device_sim.sequences import SeqBuilder, model

Build = Callable[..., str]
F = np.float32
SIGN, ABS, INF, NAN = 0x80000000, 0x7FFFFFFF, 0x7F800000, 0x7FC00000
TANH_SMALL = 0.4
TANH_POLY = tuple(float(F(c)) for c in (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925,
                                         21844 / 6081075))
LG = (0.66666662693, 0.40000972152, 0.28498786688, 0.24279078841)  # fdlibm logf: Lg1 .. Lg4
LN2_HI, LN2_LO = 6.9313812256e-01, 9.0580006145e-06  # LN2_HI has 16 significant bits: e * LN2_HI is exact
ERF_SMALL = 0.5
ERF_TAYLOR = tuple(float(F(c * 2 / np.sqrt(np.pi))) for c in (1.0, -1 / 3, 1 / 10, -1 / 42, 1 / 216, -1 / 1320))
ERFC_POLY = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
             1.48851587, -0.82215223, 0.17087277)


# ---- emission and models --------------------------------------------------------------------------
def emit(b: Builder, build: Build, *args: Reg) -> Reg:
    """Emit the op list `build(seq, *inputs)` with `args` as its inputs; constants are materialised where
    first used (the builder caches them per block)."""
    seq = SeqBuilder()
    out = build(seq, *(seq.input(f"in{i}") for i in range(len(args))))
    values: dict[str, Reg] = {f"in{i}": a for i, a in enumerate(args)}

    def value(name: str) -> Reg:
        if name not in values:
            values[name] = b.vconst_bits(seq.consts[name])
        return values[name]

    for op in seq.ops:
        values[op.dst] = b.vop(op.mnemonic, *(value(s) for s in op.srcs))
    return value(out)


def poly(b: SeqBuilder, x: str, coeffs: tuple[float, ...], name: str) -> str:
    """coeffs[0] + x (coeffs[1] + x (...)) by Horner; the constants are named name0, name1, ..."""
    p = b.const(f"{name}{len(coeffs) - 1}", coeffs[-1])
    for i in range(len(coeffs) - 2, -1, -1):
        p = b.op("vadd.f", b.op("vmul.f", p, x), b.const(f"{name}{i}", coeffs[i]))
    return p


# ---- sequences ------------------------------------------------------------------------------------
def sqrt_seq(b: SeqBuilder, x: str) -> str:
    """sqrt(x) = x rsqrt(x): 33 vector ops, <= 2 ulp; sqrt(±0) = ±0, sqrt(inf) = inf, x < 0 or NaN -> NaN."""
    r = b.op("vmul.f", x, sequences.rsqrt_seq(b, x))
    r = b.op("vsel", b.op("vcmp.eq.f", x, b.const("ZERO", 0.0)), x, r)
    return b.op("vsel", b.op("vcmp.eq.f", x, b.const("INF", INF)), x, r)


def tanh_seq(b: SeqBuilder, x: str) -> str:
    """tanh(x): an odd Taylor polynomial below |x| = 0.4, (1 - e) / (1 + e) with e = exp(-2|x|) above;
    tanh(±0) = ±0, tanh(±inf) = ±1, NaN -> NaN."""
    ax = b.op("vand", x, b.const("ABS_MASK", ABS))
    e = sequences.exp_seq(b, b.op("vmul.f", ax, b.const("MINUS_TWO", -2.0)))
    one = b.const("ONE", 1.0)
    big = b.op("vmul.f", b.op("vsub.f", one, e), sequences.reciprocal_seq(b, b.op("vadd.f", one, e)))
    big = b.op("vor", big, b.op("vand", x, b.const("SIGN", SIGN)))
    small = b.op("vmul.f", poly(b, b.op("vmul.f", x, x), TANH_POLY, "TANH_C"), x)
    return b.op("vsel", b.op("vcmp.lt.f", ax, b.const("TANH_SMALL", TANH_SMALL)), small, big)


def log_seq(b: SeqBuilder, x: str) -> str:
    """log(x): fdlibm's logf over the whole fp32 range (subnormal x scaled by 2^24 first, exactly)."""
    one, zero = b.const("ONE", 1.0), b.const("ZERO", 0.0)
    tiny = b.op("vcmp.lt.f", x, b.const("LOG_TINY", 2.0**-126))  # subnormals, zeros and negatives
    xs = b.op("vsel", tiny, b.op("vmul.f", x, b.const("TWO24", 2.0**24)), x)
    bias = b.op("vsel", tiny, b.const("LOG_BIAS_SUB", 127 + 24), b.const("LOG_BIAS", 127))
    e = b.op("vsub.i", b.op("vshr", xs, b.const("I23", 23)), bias)
    m = b.op("vor", b.op("vand", xs, b.const("MANT_MASK", 0x7FFFFF)), b.const("ONE", 1.0))
    big = b.op("vcmp.lt.f", b.const("SQRT2", float(F(np.sqrt(2.0)))), m)
    m = b.op("vsel", big, b.op("vmul.f", m, b.const("HALF", 0.5)), m)
    e = b.op("vsel", big, b.op("vadd.i", e, b.const("I1", 1)), e)
    ef = b.op("vcvt.i2f", e)
    f = b.op("vsub.f", m, one)
    s = b.op("vmul.f", f, sequences.reciprocal_seq(b, b.op("vadd.f", b.const("TWO", 2.0), f)))
    z = b.op("vmul.f", s, s)
    big_r = b.op("vmul.f", z, poly(b, z, LG, "LOG_LG"))
    hfsq = b.op("vmul.f", b.op("vmul.f", f, f), b.const("HALF", 0.5))
    inner = b.op("vadd.f", b.op("vmul.f", s, b.op("vadd.f", hfsq, big_r)),
                 b.op("vmul.f", ef, b.const("LN2_LO", LN2_LO)))
    y = b.op("vadd.f", b.op("vmul.f", ef, b.const("LN2_HI", LN2_HI)), b.op("vsub.f", f, b.op("vsub.f", hfsq, inner)))
    y = b.op("vsel", b.op("vcmp.eq.f", x, zero), b.const("NEG_INF", 0xFF800000), y)
    y = b.op("vsel", b.op("vcmp.eq.f", x, b.const("INF", INF)), x, y)
    return b.op("vsel", b.op("vcmp.le.f", zero, x), y, b.const("NAN", NAN))  # x < 0 and NaN -> NaN


def erf_seq(b: SeqBuilder, x: str) -> str:
    """erf(x): an odd Taylor polynomial below |x| = 0.5, 1 - t exp(P(t) - x^2) with t = 1 / (1 + |x|/2)
    above; erf(±0) = ±0, erf(±inf) = ±1, NaN -> NaN."""
    one = b.const("ONE", 1.0)
    ax = b.op("vand", x, b.const("ABS_MASK", ABS))
    small = b.op("vmul.f", x, poly(b, b.op("vmul.f", x, x), ERF_TAYLOR, "ERF_T"))
    t = sequences.reciprocal_seq(b, b.op("vadd.f", one, b.op("vmul.f", ax, b.const("HALF", 0.5))))
    arg = b.op("vsub.f", poly(b, t, ERFC_POLY, "ERFC_C"), b.op("vmul.f", ax, ax))
    erfc = b.op("vmul.f", t, sequences.exp_seq(b, arg))
    large = b.op("vor", b.op("vsub.f", one, erfc), b.op("vand", x, b.const("SIGN", SIGN)))
    return b.op("vsel", b.op("vcmp.lt.f", ax, b.const("ERF_SMALL", ERF_SMALL)), small, large)


FMA_HI_MASK = 0xFFFFF000  # the sign, the exponent and 11 of 23 significand bits: 12 significant bits
FMA_TINY = 2.0**-100  # below, the product's rounding error may be below the subnormal grid (not exact)


def _split(b: SeqBuilder, x: str) -> tuple[str, str]:
    """x = hi + lo exactly, each with at most 12 significant bits (so hi * hi, hi * lo, lo * lo are exact):
    hi by masking the low 12 significand bits, which never overflows (Veltkamp's 4097 x does, past 2^115)."""
    hi = b.op("vand", x, b.const("FMA_HI_MASK", FMA_HI_MASK))
    return hi, b.op("vsub.f", x, hi)


def _two_sum(b: SeqBuilder, x: str, y: str) -> tuple[str, str]:
    """(s, e): s = RN(x + y) and s + e = x + y exactly (no overflow)."""
    s = b.op("vadd.f", x, y)
    bb = b.op("vsub.f", s, x)
    return s, b.op("vadd.f", b.op("vsub.f", x, b.op("vsub.f", s, bb)), b.op("vsub.f", y, bb))


def _sum_to_odd(b: SeqBuilder, x: str, y: str) -> str:
    """RO(x + y), rounded to odd: RN(x + y), moved to its odd neighbour toward the exact sum when that was
    not representable and RN gave an even significand (so the sticky information survives a later rounding)."""
    v, e = _two_sum(b, x, y)
    one, zero_i = b.const("I1", 1), b.const("I0", 0)
    inexact = b.op("vxor", b.op("vcmp.eq.f", e, b.const("ZERO", 0.0)), b.const("ALL_ONES", 0xFFFFFFFF))
    inexact_even = b.op("vand", inexact, b.op("vcmp.eq.i", b.op("vand", v, one), zero_i))
    away = b.op("vcmp.eq.i", b.op("vand", b.op("vxor", v, e), b.const("SIGN", SIGN)), zero_i)
    step = b.op("vsel", away, one, b.const("MINUS_ONE_I", 0xFFFFFFFF))  # away from 0 iff e has v's sign
    return b.op("vsel", inexact_even, b.op("vadd.i", v, step), v)


def fma_seq(b: SeqBuilder, x: str, y: str, z: str) -> str:
    """x * y + z rounded once (about 95 vector ops). The product x y = ph + pl exactly (Dekker, halves by
    masking), z + ph = th + tl exactly (Knuth), v = RO(tl + pl), the result RN(th + v): correctly rounded
    (Boldo and Melquiond, "Emulation of FMA and correctly rounded sums: proved algorithms using rounding to
    odd", IEEE TC 2008, Theorem 5.3), given that pl is representable and nothing overflows. So x and z are
    scaled first (exactly) where that does not hold: by 2^-64 where x y overflows (the sum may still be
    finite), the result scaled back; by 2^64 where |x y| < 2^-100 and |z| < 2^-60 (below, pl may not be
    representable), the result scaled back from RO(th + v) when it is subnormal (one rounding, to the
    subnormal grid; within one subnormal ulp for results in [2^-127, 2^-126)). A tiny product beside a larger
    z rounds as ph + z, which is then exact. IEEE specials as fma: inf * 0 = NaN, NaN propagates, z = ±0
    gives RN(x y) with its sign, an infinite z with finite x, y gives z."""
    abs_mask, inf, zero = b.const("ABS_MASK", ABS), b.const("INF", INF), b.const("ZERO", 0.0)
    all_ones = b.const("ALL_ONES", 0xFFFFFFFF)

    def finite(a: str) -> str:
        return b.op("vcmp.lt.f", b.op("vand", a, abs_mask), inf)

    def below(a: str, bound: float, name: str) -> str:
        return b.op("vcmp.lt.f", b.op("vand", a, abs_mask), b.const(name, bound))

    product = b.op("vmul.f", x, y)
    naive = b.op("vadd.f", product, z)
    finite_xy = b.op("vand", finite(x), finite(y))
    big = b.op("vand", finite_xy, b.op("vxor", finite(product), all_ones))
    small = b.op("vand", below(product, FMA_TINY, "FMA_TINY"), below(z, 2.0**-60, "FMA_Z_SMALL"))
    down, up = b.const("FMA_DOWN", 2.0**-64), b.const("FMA_UP", 2.0**64)
    scale = b.op("vsel", big, down, b.op("vsel", small, up, b.const("ONE", 1.0)))
    xs, zs = b.op("vmul.f", x, scale), b.op("vmul.f", z, scale)
    ph = b.op("vmul.f", xs, y)
    xh, xl = _split(b, xs)
    yh, yl = _split(b, y)
    pl = b.op("vsub.f", b.op("vmul.f", xh, yh), ph)
    pl = b.op("vadd.f", pl, b.op("vmul.f", xh, yl))
    pl = b.op("vadd.f", pl, b.op("vmul.f", xl, yh))
    pl = b.op("vadd.f", pl, b.op("vmul.f", xl, yl))
    th, tl = _two_sum(b, zs, ph)
    v = _sum_to_odd(b, tl, pl)
    exact = b.op("vadd.f", th, v)
    ok = b.op("vxor", below(ph, FMA_TINY, "FMA_TINY"), all_ones)
    ok = b.op("vand", b.op("vand", ok, finite(ph)), b.op("vand", finite(exact), finite(z)))
    back = b.op("vsel", big, up, b.op("vsel", small, down, b.const("ONE", 1.0)))
    result = b.op("vmul.f", exact, back)
    subnormal = b.op("vand", small, below(result, 2.0**-126, "FMA_MIN_NORMAL"))
    result = b.op("vsel", subnormal, b.op("vmul.f", _sum_to_odd(b, th, v), back), result)
    out = b.op("vsel", ok, result, naive)
    # z = ±0 and x y != 0: x y rounded (its sign survives an underflow to ±0, which ph + z loses for z = +0)
    not_zero = b.op("vxor", b.op("vor", b.op("vcmp.eq.f", x, zero), b.op("vcmp.eq.f", y, zero)), all_ones)
    out = b.op("vsel", b.op("vand", b.op("vcmp.eq.f", z, zero), not_zero), product, out)
    # z = ±inf and x, y finite: z (an overflowing x y is finite in the exact sum; ph + z gives NaN for -z)
    return b.op("vsel", b.op("vand", b.op("vcmp.eq.f", b.op("vand", z, abs_mask), inf), finite_xy), z, out)


# ---- machine-IR entry points (isel_vector's VECTOR_OPS) ----------------------------------------------
def vexp(b: Builder, x: Reg) -> Reg:
    return emit(b, sequences.exp_seq, x)


def vrecip(b: Builder, x: Reg) -> Reg:
    return emit(b, sequences.reciprocal_seq, x)


def vdivide(b: Builder, a: Reg, d: Reg) -> Reg:
    return emit(b, sequences.divide_seq, a, d)


def vrsqrt(b: Builder, x: Reg) -> Reg:
    return emit(b, sequences.rsqrt_seq, x)


def vsqrt(b: Builder, x: Reg) -> Reg:
    return emit(b, sqrt_seq, x)


def vtanh(b: Builder, x: Reg) -> Reg:
    return emit(b, tanh_seq, x)


def vlog(b: Builder, x: Reg) -> Reg:
    return emit(b, log_seq, x)


def verf(b: Builder, x: Reg) -> Reg:
    return emit(b, erf_seq, x)


def vfma(b: Builder, x: Reg, y: Reg, z: Reg) -> Reg:
    return emit(b, fma_seq, x, y, z)


# numpy models (bit-exact with what the compiler emits)
sqrt, tanh, log, erf = model(sqrt_seq), model(tanh_seq), model(log_seq), model(erf_seq)
fma = model(fma_seq, arity=3)
