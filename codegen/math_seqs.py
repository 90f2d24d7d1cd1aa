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

The accuracy of each, measured by tests/codegen/test_math_seqs.py, is listed in docs/architecture.md
("Numerics contract").
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from codegen.builder import Builder
from codegen.mir import Reg
from device_sim import sequences
from device_sim.sequences import SeqBuilder

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


def model(build: Build, arity: int = 1) -> Callable[..., np.ndarray]:
    """The bit-exact numpy model of a sequence: float32 arrays in, float32 array out (`.builder` is the
    op list, e.g. to count its ops)."""
    seq = SeqBuilder()
    names = [seq.input(f"in{i}") for i in range(arity)]
    out = build(seq, *names)

    def run(*xs: np.ndarray) -> np.ndarray:
        return sequences.evaluate(seq, dict(zip(names, xs, strict=True)), [out])[0]
    run.__doc__ = build.__doc__
    run.builder = seq  # type: ignore[attr-defined]
    return run


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


# numpy models (bit-exact with what the compiler emits)
sqrt, tanh, log, erf = model(sqrt_seq), model(tanh_seq), model(log_seq), model(erf_seq)
