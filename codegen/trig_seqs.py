"""sin and cos as vector-op sequences, accurate over the whole fp32 range (see math_seqs.py for the form).

Range reduction is exact Payne-Hanek in 32-bit integer lanes. |x| = m 2^k with m a 24-bit integer, so
x 2/pi mod 4 = m (2^k 2/pi mod 4): only a 96-bit window of the bits of 2/pi matters (those above it
contribute multiples of 4, those below it less than 2^-70). The window is picked per lane from eight
32-bit words of 2/pi (a select tree on the word index, then a funnel shift), cut into 12-bit limbs and
multiplied by m's two 12-bit limbs with `vmul.i` (each partial product < 2^24, each column sum < 2^26:
exact in int32), carries propagated. The top 24 bits give the quadrant n = round(x 2/pi) mod 4 and the
leading bits of the fraction f = x 2/pi - n in [-1/2, 1/2]; f is rebuilt exactly as a sum of three fp32
values (22 + 24 + 24 bits), and r = f pi/2 is formed as a double-fp32 r_hi + r_lo (|x| < pi/4 skips the
reduction: r = x). No fp32 |x| >= pi/4 comes closer to a multiple of pi/2 than |r| = 1.6e-9 ~ 2^-29
(x = 7.729179e28, found by scanning all of them), so the 70 fraction bits leave r 40 correct bits.

The kernels are fdlibm's single-precision ones (degree-9 sine, degree-8 cosine, |r| <= pi/4) with the
tail r_lo folded in; the quadrant picks sin or cos of r and its sign. sin(±0) = ±0, sin(±inf) = sin(NaN)
= NaN, likewise cos.
"""

from __future__ import annotations

import numpy as np

from codegen.builder import Builder
from codegen.math_seqs import ABS, INF, NAN, SIGN, emit, model, poly
from codegen.mir import Reg
from device_sim.sequences import SeqBuilder

SIN_POLY = (-1.6666667163e-01, 8.3333337680e-03, -1.9841270114e-04, 2.7557314297e-06)
COS_POLY = (4.1666667908e-02, -1.3888889225e-03, 2.4801587642e-05, -2.7557314297e-07)
PIO4 = float(np.float32(np.pi / 4))
PIO2 = float(np.float32(np.pi / 2))
PIO2_HI = 1.5703125  # pi/2 to 8 significant bits: (12-bit f_hi) * PIO2_HI is exact
PIO2_LO = float(np.float32(np.pi / 2 - 1.5703125))
PAD = 32  # zero bits before 2/pi in the table: the window of |x| >= 2^-1 starts at table bit >= 7


def _two_over_pi_words(nbits: int = 256) -> tuple[int, ...]:
    """2/pi as nbits / 32 big-endian 32-bit words after PAD zero bits: table bit p is the bit of weight
    2^-(p - PAD) of 2/pi. Exact: pi by Machin's formula in 400-bit fixed point (error < 2^-390)."""
    one = 1 << 400

    def arctan_inv(n: int) -> int:  # arctan(1/n) * 2^400, alternating series in integers
        total, power, k = 0, one // n, 0
        while power:
            total += (-1) ** k * (power // (2 * k + 1))
            power //= n * n
            k += 1
        return total

    pi = 4 * (4 * arctan_inv(5) - arctan_inv(239))
    bits = (2 * one << (nbits - PAD - 1)) // pi  # weights 2^-1 .. 2^-(nbits - PAD - 1): table bits PAD + 1 ..
    return tuple((bits >> (32 * (nbits // 32 - 1 - j))) & 0xFFFFFFFF for j in range(nbits // 32))


TWO_OVER_PI_WORDS = _two_over_pi_words()


def _reduce(b: SeqBuilder, ax: str) -> tuple[str, str, str]:
    """(r_hi, r_lo, n) with |x| = (n + 4j) pi/2 + r_hi + r_lo, |r| <= pi/4 (+ 2^-22), for finite |x| >= 2^-1
    (other lanes compute garbage that the caller discards)."""
    def c(name: str, v: int | float) -> str:
        return b.const(name, v)

    def op(mn: str, *srcs: str) -> str:
        return b.op(mn, *srcs)

    fff = c("TRIG_FFF", 0xFFF)
    # |x| = m 2^(e - 150); the window starts at table bit p0 = (e - 151) + PAD
    e = op("vshr", ax, c("I23", 23))
    m = op("vor", op("vand", ax, c("MANT_MASK", 0x7FFFFF)), c("TRIG_IMPLICIT", 0x800000))
    p0 = op("vsub.i", e, c("TRIG_P0", 151 - PAD))
    w = op("vshr", p0, c("I5", 5))  # first word, 0 .. 4 for the lanes that matter
    s = op("vand", p0, c("I31", 31))
    rs = op("vsub.i", c("I31", 31), s)
    bit = [op("vsra", op("vshl", w, c(f"I{31 - k}", 31 - k)), c("I31", 31)) for k in range(3)]  # ~0 if set
    words = [c(f"TRIG_W{j}", v) for j, v in enumerate(TWO_OVER_PI_WORDS)]
    v = []
    for j in range(4):  # v[j] = words[w + j]
        lo = op("vsel", bit[0], words[j + 1], words[j])
        hi = op("vsel", bit[0], words[j + 3], words[j + 2])
        v.append(op("vsel", bit[2], words[j + 4], op("vsel", bit[1], hi, lo)))
    one = c("I1", 1)
    u32 = [op("vor", op("vshl", v[j], s), op("vshr", op("vshr", v[j + 1], one), rs)) for j in range(3)]
    # 96-bit window U = u32[0]:u32[1]:u32[2] -> eight 12-bit limbs, least significant first
    a, bb, cc = u32
    limbs = [
        op("vand", cc, fff),
        op("vand", op("vshr", cc, c("I12", 12)), fff),
        op("vor", op("vand", op("vshl", bb, c("I8", 8)), c("TRIG_F00", 0xF00)), op("vshr", cc, c("I24", 24))),
        op("vand", op("vshr", bb, c("I4", 4)), fff),
        op("vand", op("vshr", bb, c("I16", 16)), fff),
        op("vor", op("vand", op("vshl", a, c("I4", 4)), c("TRIG_FF0", 0xFF0)), op("vshr", bb, c("I28", 28))),
        op("vand", op("vshr", a, c("I8", 8)), fff),
        op("vshr", a, c("I20", 20)),
    ]
    m0, m1 = op("vand", m, fff), op("vshr", m, c("I12", 12))
    # m U mod 2^96 in 12-bit columns 1..7 (column 0 < 2^24 only feeds bits below 2^-70 of x 2/pi)
    col = [op("vadd.i", op("vmul.i", m0, limbs[j]), op("vmul.i", m1, limbs[j - 1])) for j in range(1, 8)]
    for j in range(len(col) - 1):
        col[j + 1] = op("vadd.i", col[j + 1], op("vshr", col[j], c("I12", 12)))
    col = [op("vand", x, fff) for x in col]  # col[i] is column i + 1: bits 12 (i + 1) .. of m U

    def pair(hi: str, lo: str) -> str:
        return op("vor", op("vshl", hi, c("I12", 12)), lo)

    top = pair(col[6], col[5])  # x 2/pi mod 4 to 22 fraction bits, as an integer
    n = op("vshr", op("vadd.i", top, c("TRIG_HALF_Q", 1 << 21)), c("I22", 22))
    g = op("vsub.i", top, op("vshl", n, c("I22", 22)))  # in [-2^21, 2^21)
    fa = op("vmul.f", op("vcvt.i2f", g), c("TRIG_2M22", 2.0**-22))
    fb = op("vmul.f", op("vcvt.i2f", pair(col[4], col[3])), c("TRIG_2M46", 2.0**-46))
    fc = op("vmul.f", op("vcvt.i2f", pair(col[2], col[1])), c("TRIG_2M70", 2.0**-70))
    f_hi = op("vadd.f", fa, fb)  # exact or |fa| >= |fb|: the error is the next line's
    f_lo = op("vadd.f", op("vadd.f", op("vsub.f", fa, f_hi), fb), fc)
    # r = f pi/2: f_hi's top 12 bits times PIO2_HI exactly, the rest as a tail
    fh = op("vand", f_hi, c("TRIG_HI12", 0xFFFFF000))
    fl = op("vsub.f", f_hi, fh)
    big = op("vmul.f", fh, c("TRIG_PIO2_HI", PIO2_HI))
    tail = op("vadd.f", op("vmul.f", fh, c("TRIG_PIO2_LO", PIO2_LO)),
              op("vmul.f", op("vadd.f", fl, f_lo), c("TRIG_PIO2", PIO2)))
    r_hi = op("vadd.f", big, tail)
    r_lo = op("vsub.f", tail, op("vsub.f", r_hi, big))
    return r_hi, r_lo, n


def _sincos(b: SeqBuilder, x: str, cosine: bool) -> str:
    ax = b.op("vand", x, b.const("ABS_MASK", ABS))
    r_hi, r_lo, n = _reduce(b, ax)
    small = b.op("vcmp.lt.f", ax, b.const("TRIG_PIO4", PIO4))
    zero = b.const("ZERO", 0.0)
    r_hi = b.op("vsel", small, ax, r_hi)
    r_lo = b.op("vsel", small, zero, r_lo)
    n = b.op("vsel", small, zero, n)
    if cosine:  # cos(r + n pi/2) = sin(r + (n + 1) pi/2)
        n = b.op("vadd.i", n, b.const("I1", 1))
    z = b.op("vmul.f", r_hi, r_hi)
    # sin(r_hi + r_lo) ~ r_hi + (r_hi z S(z) + r_lo)
    sin_r = b.op("vadd.f", r_hi, b.op("vadd.f", b.op("vmul.f", b.op("vmul.f", z, r_hi), poly(b, z, SIN_POLY, "SIN_S")),
                                      r_lo))
    # cos(r_hi + r_lo) ~ w + (((1 - w) - z/2) + (z^2 C(z) - r_hi r_lo)), w = 1 - z/2 (fdlibm's k_cosf)
    one = b.const("ONE", 1.0)
    hz = b.op("vmul.f", z, b.const("HALF", 0.5))
    w = b.op("vsub.f", one, hz)
    cos_tail = b.op("vsub.f", b.op("vmul.f", b.op("vmul.f", z, z), poly(b, z, COS_POLY, "COS_C")),
                    b.op("vmul.f", r_hi, r_lo))
    cos_r = b.op("vadd.f", w, b.op("vadd.f", b.op("vsub.f", b.op("vsub.f", one, w), hz), cos_tail))
    odd = b.op("vcmp.eq.i", b.op("vand", n, b.const("I1", 1)), b.const("I1", 1))
    y = b.op("vsel", odd, cos_r, sin_r)
    y = b.op("vxor", y, b.op("vshl", b.op("vand", n, b.const("I2", 2)), b.const("I30", 30)))
    if not cosine:  # sin(-|x|) = -sin(|x|); cos is even
        y = b.op("vxor", y, b.op("vand", x, b.const("SIGN", SIGN)))
    return b.op("vsel", b.op("vcmp.lt.f", ax, b.const("INF", INF)), y, b.const("NAN", NAN))  # inf, NaN -> NaN


def sin_seq(b: SeqBuilder, x: str) -> str:
    """sin(x) over the whole fp32 range."""
    return _sincos(b, x, cosine=False)


def cos_seq(b: SeqBuilder, x: str) -> str:
    """cos(x) over the whole fp32 range."""
    return _sincos(b, x, cosine=True)


def vsin(b: Builder, x: Reg) -> Reg:
    return emit(b, sin_seq, x)


def vcos(b: Builder, x: Reg) -> Reg:
    return emit(b, cos_seq, x)


sin, cos = model(sin_seq), model(cos_seq)
