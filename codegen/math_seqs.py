"""Transcendentals as sequences of simple vector ops (the CTPU has no exp, divide, rsqrt or tanh).

Each function emits machine IR through a `Builder` and has a numpy twin (`*_ref`) that performs the same
fp32 operations in the same order, so unit tests can compare the two bit for bit and measure accuracy
against float64. Constants are shared by both.

Accuracy (measured in tests/codegen/test_math_seqs.py, fp32 ulps against float64):
- exp: Cody-Waite range reduction by ln2, degree-7 Taylor polynomial, scaling by 2^n in two halves (so
  subnormal results are right); within 2 ulp on [-87, 88]; saturates to 0 / inf outside [-104, 89].
- reciprocal: bit-trick estimate + 4 Newton steps; within 2 ulp for |x| in [2^-126, 2^126]; 0 -> inf,
  inf -> 0; subnormal inputs and results are outside the contract.
- rsqrt: bit-trick estimate + 4 Newton steps; within 2 ulp for normal x > 0; 0 -> inf, inf -> 0, x < 0 -> NaN.
- tanh: odd polynomial for |x| < 0.4, (1 - e)/(1 + e) with e = exp(-2|x|) above; within 4 ulp.
"""

from __future__ import annotations

import numpy as np

from codegen.builder import Builder, f32_bits
from codegen.mir import Reg

F = np.float32
LOG2E = F(1.4426950408889634)
ROUND_MAGIC = F(12582912.0)  # 1.5 * 2^23: adding it rounds to an integer
LN2_HI = np.array(f32_bits(np.log(2.0)) & 0xFFFFF000, dtype=np.uint32).view(np.float32).item()
LN2_LO = F(np.log(2.0) - np.float64(LN2_HI))
LN2_HI = F(LN2_HI)
EXP_LO, EXP_HI = F(-104.0), F(89.0)
RECIP_MAGIC = 0x7EF311C3
RSQRT_MAGIC = 0x5F375A86
NEWTON_STEPS = 4
TANH_SMALL = F(0.4)
TANH_POLY = [F(c) for c in (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075)]
SIGN = 0x80000000
ABS = 0x7FFFFFFF
INF = 0x7F800000


def _factorials() -> list[np.float32]:
    out, f = [], 1.0
    for k in range(8):
        f = f * k if k else 1.0
        out.append(F(1.0 / f))
    return out


EXP_POLY = _factorials()


# ---- machine IR ---------------------------------------------------------------------------------
def vexp(b: Builder, x: Reg) -> Reg:
    x = b.vop("vmin.f", b.vop("vmax.f", x, b.vconst(EXP_LO)), b.vconst(EXP_HI))
    t = b.vop("vadd.f", b.vop("vmul.f", x, b.vconst(LOG2E)), b.vconst(ROUND_MAGIC))
    nf = b.vop("vsub.f", t, b.vconst(ROUND_MAGIC))
    ni = b.vop("vsub.i", t, b.vconst(ROUND_MAGIC))
    r = b.vop("vsub.f", x, b.vop("vmul.f", nf, b.vconst(LN2_HI)))
    r = b.vop("vsub.f", r, b.vop("vmul.f", nf, b.vconst(LN2_LO)))
    p = b.vconst(EXP_POLY[7])
    for k in range(6, -1, -1):
        p = b.vop("vadd.f", b.vop("vmul.f", p, r), b.vconst(EXP_POLY[k]))
    n1 = b.vop("vsra", ni, b.vconst_bits(1))
    n2 = b.vop("vsub.i", ni, n1)
    bias, shift = b.vconst_bits(127), b.vconst_bits(23)
    s1 = b.vop("vshl", b.vop("vadd.i", n1, bias), shift)
    s2 = b.vop("vshl", b.vop("vadd.i", n2, bias), shift)
    return b.vop("vmul.f", b.vop("vmul.f", p, s1), s2)


def vrecip(b: Builder, x: Reg) -> Reg:
    ax = b.vop("vand", x, b.vconst_bits(ABS))
    y = b.vop("vsub.i", b.vconst_bits(RECIP_MAGIC), ax)
    two = b.vconst(2.0)
    for _ in range(NEWTON_STEPS):
        y = b.vop("vmul.f", y, b.vop("vsub.f", two, b.vop("vmul.f", ax, y)))
    y = b.vop("vsel", b.vop("vcmp.eq.f", ax, b.vconst(0.0)), b.vconst_bits(INF), y)
    y = b.vop("vsel", b.vop("vcmp.eq.f", ax, b.vconst_bits(INF)), b.vconst(0.0), y)
    return b.vop("vor", y, b.vop("vand", x, b.vconst_bits(SIGN)))


def vrsqrt(b: Builder, x: Reg) -> Reg:
    y = b.vop("vsub.i", b.vconst_bits(RSQRT_MAGIC), b.vop("vshr", x, b.vconst_bits(1)))
    hx = b.vop("vmul.f", x, b.vconst(0.5))
    for _ in range(NEWTON_STEPS):
        y = b.vop("vmul.f", y, b.vop("vsub.f", b.vconst(1.5), b.vop("vmul.f", hx, b.vop("vmul.f", y, y))))
    y = b.vop("vsel", b.vop("vcmp.eq.f", x, b.vconst(0.0)), b.vconst_bits(INF), y)
    y = b.vop("vsel", b.vop("vcmp.eq.f", x, b.vconst_bits(INF)), b.vconst(0.0), y)
    return b.vop("vsel", b.vop("vcmp.lt.f", x, b.vconst(0.0)), b.vconst_bits(0x7FC00000), y)


def vsqrt(b: Builder, x: Reg) -> Reg:
    r = b.vop("vmul.f", x, vrsqrt(b, x))
    r = b.vop("vsel", b.vop("vcmp.eq.f", x, b.vconst(0.0)), x, r)
    return b.vop("vsel", b.vop("vcmp.eq.f", x, b.vconst_bits(INF)), x, r)


def vtanh(b: Builder, x: Reg) -> Reg:
    ax = b.vop("vand", x, b.vconst_bits(ABS))
    e = vexp(b, b.vop("vmul.f", ax, b.vconst(-2.0)))
    one = b.vconst(1.0)
    big = b.vop("vmul.f", b.vop("vsub.f", one, e), vrecip(b, b.vop("vadd.f", one, e)))
    big = b.vop("vor", big, b.vop("vand", x, b.vconst_bits(SIGN)))
    x2 = b.vop("vmul.f", x, x)
    p = b.vconst(TANH_POLY[-1])
    for c in reversed(TANH_POLY[:-1]):
        p = b.vop("vadd.f", b.vop("vmul.f", p, x2), b.vconst(c))
    small = b.vop("vmul.f", p, x)
    return b.vop("vsel", b.vop("vcmp.lt.f", ax, b.vconst(TANH_SMALL)), small, big)


# ---- numpy twins (same operations, same order) ----------------------------------------------------
def _bits(a: np.ndarray) -> np.ndarray:
    return np.asarray(a, dtype=np.float32).view(np.int32)


def _float(i: np.ndarray) -> np.ndarray:
    return np.asarray(i, dtype=np.int32).view(np.float32)


def exp_ref(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        x = np.minimum(np.maximum(F(x), EXP_LO), EXP_HI).astype(F)
        t = (x * LOG2E + ROUND_MAGIC).astype(F)
        nf = (t - ROUND_MAGIC).astype(F)
        ni = _bits(t) - _bits(ROUND_MAGIC)
        r = (x - nf * LN2_HI).astype(F)
        r = (r - nf * LN2_LO).astype(F)
        p = np.full_like(r, EXP_POLY[7])
        for k in range(6, -1, -1):
            p = (p * r + EXP_POLY[k]).astype(F)
        n1 = ni >> 1
        n2 = ni - n1
        s1 = _float((n1 + 127) << 23)
        s2 = _float((n2 + 127) << 23)
        return (p * s1 * s2).astype(F)


def recip_ref(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        x = F(x)
        ax = np.abs(x)
        y = _float(np.int32(RECIP_MAGIC) - _bits(ax))
        for _ in range(NEWTON_STEPS):
            y = (y * (F(2.0) - ax * y)).astype(F)
        y = np.where(ax == 0, F(np.inf), y)
        y = np.where(np.isinf(ax), F(0.0), y)
        return np.copysign(y, x).astype(F)


def rsqrt_ref(x: np.ndarray) -> np.ndarray:
    with np.errstate(all="ignore"):
        x = F(x)
        y = _float(np.int32(RSQRT_MAGIC) - (_bits(x).view(np.uint32) >> 1).astype(np.int32))
        hx = (x * F(0.5)).astype(F)
        for _ in range(NEWTON_STEPS):
            y = (y * (F(1.5) - hx * (y * y))).astype(F)
        y = np.where(x == 0, F(np.inf), y)
        y = np.where(x == np.inf, F(0.0), y)
        return np.where(x < 0, F(np.nan), y).astype(F)
