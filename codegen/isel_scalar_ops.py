"""Vector lowerings of the generic-body scalar ops beyond isel_vector's core table, registered into
`isel_vector.VECTOR_OPS` at import: compares and selects (i1 values are 0 / ~0 lane masks), int32
arithmetic and conversions, and the sin / cos / log / erf sequences.

Sequences (fp32, checked against float64 in tests/codegen/test_frontend.py):
- sin, cos: Cody-Waite reduction by pi/2 in three parts (exact quotient for |x| < 2^7 * pi/2, i.e. the
  rope angles of positions < ~200), fdlibm's degree-9 sine / degree-8 cosine kernels, quadrant select;
  within a few ulp of the reduced argument.
- log: x = m * 2^e with m in [sqrt(1/2), sqrt(2)), fdlibm's logf kernel (s = f / (2 + f), degree-4 in s^2);
  0 -> -inf, x < 0 -> NaN, inf -> inf; subnormal inputs outside the contract.
- erf: odd Taylor polynomial below |x| = 0.5, 1 - erfc (Numerical Recipes' erfcc, relative error < 1.2e-7)
  above: absolute error ~1e-7.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from codegen.builder import Builder
from codegen.isel_vector import VECTOR_OPS
from codegen.math_seqs import vexp, vrecip
from codegen.mir import Reg

F = np.float32
ROUND_MAGIC = F(12582912.0)
TWO_OVER_PI = F(2.0 / np.pi)
PIO2 = (F(1.5707855225e00), F(1.0804334124e-05), F(6.0770999344e-11))
SIN_POLY = (F(-1.6666667163e-01), F(8.3333337680e-03), F(-1.9841270114e-04), F(2.7557314297e-06))
COS_POLY = (F(4.1666667908e-02), F(-1.3888889225e-03), F(2.4801587642e-05), F(-2.7557314297e-07))
LG = (F(0.66666662693), F(0.40000972152), F(0.28498786688), F(0.24279078841))
LN2_HI, LN2_LO = F(6.9313812256e-01), F(9.0580006145e-06)
SQRT2 = F(np.sqrt(2.0))
ERF_SMALL = F(0.5)
ERF_TAYLOR = tuple(F(c * 2 / np.sqrt(np.pi)) for c in (1.0, -1 / 3, 1 / 10, -1 / 42, 1 / 216, -1 / 1320))
ERFC_POLY = tuple(F(c) for c in (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
                                 -1.13520398, 1.48851587, -0.82215223, 0.17087277))
ALL_ONES = 0xFFFFFFFF


def _poly(b: Builder, x: Reg, coeffs: tuple[np.float32, ...]) -> Reg:
    """coeffs[0] + x * (coeffs[1] + x * (...)) by Horner."""
    p = b.vconst(coeffs[-1])
    for c in reversed(coeffs[:-1]):
        p = b.vop("vadd.f", b.vop("vmul.f", p, x), b.vconst(c))
    return p


def _not(b: Builder, m: Reg) -> Reg:
    return b.vop("vxor", m, b.vconst_bits(ALL_ONES))


def vsincos(b: Builder, x: Reg, cosine: bool) -> Reg:
    t = b.vop("vadd.f", b.vop("vmul.f", x, b.vconst(TWO_OVER_PI)), b.vconst(ROUND_MAGIC))
    n = b.vop("vsub.f", t, b.vconst(ROUND_MAGIC))
    q = b.vop("vsub.i", t, b.vconst(ROUND_MAGIC))
    r = x
    for part in PIO2:
        r = b.vop("vsub.f", r, b.vop("vmul.f", n, b.vconst(part)))
    z = b.vop("vmul.f", r, r)
    sin_r = b.vop("vadd.f", r, b.vop("vmul.f", b.vop("vmul.f", z, r), _poly(b, z, SIN_POLY)))
    cos_r = b.vop("vadd.f", b.vop("vsub.f", b.vconst(1.0), b.vop("vmul.f", z, b.vconst(0.5))),
                  b.vop("vmul.f", b.vop("vmul.f", z, z), _poly(b, z, COS_POLY)))
    if cosine:
        q = b.vop("vadd.i", q, b.vconst_bits(1))
    odd = b.vop("vcmp.eq.i", b.vop("vand", q, b.vconst_bits(1)), b.vconst_bits(1))
    v = b.vop("vsel", odd, cos_r, sin_r)
    sign = b.vop("vshl", b.vop("vand", q, b.vconst_bits(2)), b.vconst_bits(30))
    return b.vop("vxor", v, sign)


def vlog(b: Builder, x: Reg) -> Reg:
    e = b.vop("vsub.i", b.vop("vshr", x, b.vconst_bits(23)), b.vconst_bits(127))
    m = b.vop("vor", b.vop("vand", x, b.vconst_bits(0x7FFFFF)), b.vconst_bits(0x3F800000))
    big = b.vop("vcmp.lt.f", b.vconst(SQRT2), m)
    m = b.vop("vsel", big, b.vop("vmul.f", m, b.vconst(0.5)), m)
    e = b.vop("vsel", big, b.vop("vadd.i", e, b.vconst_bits(1)), e)
    ef = b.vop("vcvt.i2f", e)
    f = b.vop("vsub.f", m, b.vconst(1.0))
    s = b.vop("vmul.f", f, vrecip(b, b.vop("vadd.f", b.vconst(2.0), f)))
    z = b.vop("vmul.f", s, s)
    big_r = b.vop("vmul.f", z, _poly(b, z, LG))
    hfsq = b.vop("vmul.f", b.vop("vmul.f", f, f), b.vconst(0.5))
    inner = b.vop("vadd.f", b.vop("vmul.f", s, b.vop("vadd.f", hfsq, big_r)), b.vop("vmul.f", ef, b.vconst(LN2_LO)))
    y = b.vop("vadd.f", b.vop("vmul.f", ef, b.vconst(LN2_HI)), b.vop("vsub.f", f, b.vop("vsub.f", hfsq, inner)))
    y = b.vop("vsel", b.vop("vcmp.eq.f", x, b.vconst(0.0)), b.vconst(-np.inf), y)
    y = b.vop("vsel", b.vop("vcmp.eq.f", x, b.vconst(np.inf)), x, y)
    return b.vop("vsel", b.vop("vcmp.lt.f", x, b.vconst(0.0)), b.vconst_bits(0x7FC00000), y)


def verf(b: Builder, x: Reg) -> Reg:
    ax = b.vop("vand", x, b.vconst_bits(0x7FFFFFFF))
    small = b.vop("vmul.f", x, _poly(b, b.vop("vmul.f", x, x), ERF_TAYLOR))
    t = vrecip(b, b.vop("vadd.f", b.vconst(1.0), b.vop("vmul.f", ax, b.vconst(0.5))))
    arg = b.vop("vsub.f", _poly(b, t, ERFC_POLY), b.vop("vmul.f", ax, ax))
    erfc = b.vop("vmul.f", t, vexp(b, arg))
    large = b.vop("vsub.f", b.vconst(1.0), erfc)
    large = b.vop("vor", large, b.vop("vand", x, b.vconst_bits(0x80000000)))
    return b.vop("vsel", b.vop("vcmp.lt.f", ax, b.vconst(ERF_SMALL)), small, large)


# ---- compares: results are 0 / ~0 masks ---------------------------------------------------------------
def _cmp(op: str, swap: bool = False, negate: bool = False) -> Callable[[Builder, list[Reg]], Reg]:
    def lower(b: Builder, a: list[Reg]) -> Reg:
        m = b.vop(op, a[1], a[0]) if swap else b.vop(op, a[0], a[1])
        return _not(b, m) if negate else m
    return lower


def _one(b: Builder, a: list[Reg]) -> Reg:
    return b.vop("vor", b.vop("vcmp.lt.f", a[0], a[1]), b.vop("vcmp.lt.f", a[1], a[0]))


def _binary(op: str) -> Callable[[Builder, list[Reg]], Reg]:
    return lambda b, a: b.vop(op, a[0], a[1])


EXTRA_OPS: dict[str, Callable[[Builder, list[Reg]], Reg]] = {
    "arith.cmpf.oeq": _cmp("vcmp.eq.f"), "arith.cmpf.une": _cmp("vcmp.eq.f", negate=True),
    "arith.cmpf.olt": _cmp("vcmp.lt.f"), "arith.cmpf.ole": _cmp("vcmp.le.f"),
    "arith.cmpf.ogt": _cmp("vcmp.lt.f", swap=True), "arith.cmpf.oge": _cmp("vcmp.le.f", swap=True),
    "arith.cmpf.uge": _cmp("vcmp.lt.f", negate=True), "arith.cmpf.ugt": _cmp("vcmp.le.f", negate=True),
    "arith.cmpf.ule": _cmp("vcmp.lt.f", swap=True, negate=True),
    "arith.cmpf.ult": _cmp("vcmp.le.f", swap=True, negate=True),
    "arith.cmpf.one": _one,
    "arith.cmpi.eq": _cmp("vcmp.eq.i"), "arith.cmpi.ne": _cmp("vcmp.eq.i", negate=True),
    "arith.cmpi.slt": _cmp("vcmp.lt.i"), "arith.cmpi.sgt": _cmp("vcmp.lt.i", swap=True),
    "arith.cmpi.sle": _cmp("vcmp.lt.i", swap=True, negate=True),
    "arith.cmpi.sge": _cmp("vcmp.lt.i", negate=True),
    "arith.select": lambda b, a: b.vop("vsel", a[0], a[1], a[2]),
    "arith.andi": _binary("vand"), "arith.ori": _binary("vor"), "arith.xori": _binary("vxor"),
    "arith.addi": _binary("vadd.i"), "arith.subi": _binary("vsub.i"), "arith.muli": _binary("vmul.i"),
    "arith.index_cast": lambda b, a: a[0],
    "arith.sitofp": lambda b, a: b.vop("vcvt.i2f", a[0]),
    "arith.fptosi": lambda b, a: b.vop("vcvt.f2i", a[0]),
    "arith.uitofp": lambda b, a: b.vop("vcvt.i2f", b.vop("vand", a[0], b.vconst_bits(1))),  # from i1
    "arith.extui": lambda b, a: b.vop("vand", a[0], b.vconst_bits(1)),  # from i1
    "arith.extsi": lambda b, a: a[0],  # i1 masks are already -1 / 0
    "arith.trunci": lambda b, a: _not(b, b.vop("vcmp.eq.i", b.vop("vand", a[0], b.vconst_bits(1)),
                                               b.vconst_bits(0))),
    "math.sin": lambda b, a: vsincos(b, a[0], cosine=False),
    "math.cos": lambda b, a: vsincos(b, a[0], cosine=True),
    "math.log": lambda b, a: vlog(b, a[0]),
    "math.erf": lambda b, a: verf(b, a[0]),
}
for _name, _fn in EXTRA_OPS.items():
    VECTOR_OPS.setdefault(_name, _fn)
