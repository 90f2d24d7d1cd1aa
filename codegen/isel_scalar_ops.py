"""Vector lowerings of the generic-body scalar ops beyond isel_vector's core table, registered into
`isel_vector.VECTOR_OPS` at import: compares and selects (i1 values are 0 / ~0 lane masks), int32
arithmetic and conversions, and the sin / cos / log / erf / fma sequences (math_seqs.py, trig_seqs.py).
"""

from __future__ import annotations

from collections.abc import Callable

from codegen.builder import Builder
from codegen.isel_vector import VECTOR_OPS
from codegen.math_seqs import verf, vfma, vlog
from codegen.mir import Reg
from codegen.trig_seqs import vcos, vsin

ALL_ONES = 0xFFFFFFFF


def _not(b: Builder, m: Reg) -> Reg:
    return b.vop("vxor", m, b.vconst_bits(ALL_ONES))


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
    "arith.shli": _binary("vshl"), "arith.shrsi": _binary("vsra"), "arith.shrui": _binary("vshr"),
    "arith.maxsi": lambda b, a: b.vop("vsel", b.vop("vcmp.lt.i", a[0], a[1]), a[1], a[0]),
    "arith.minsi": lambda b, a: b.vop("vsel", b.vop("vcmp.lt.i", a[0], a[1]), a[0], a[1]),
    "arith.index_cast": lambda b, a: a[0],
    "arith.sitofp": lambda b, a: b.vop("vcvt.i2f", a[0]),
    "arith.fptosi": lambda b, a: b.vop("vcvt.f2i", a[0]),
    "arith.uitofp": lambda b, a: b.vop("vcvt.i2f", b.vop("vand", a[0], b.vconst_bits(1))),  # from i1
    "arith.extui": lambda b, a: b.vop("vand", a[0], b.vconst_bits(1)),  # from i1
    "arith.extsi": lambda b, a: a[0],  # i1 masks are already -1 / 0
    "arith.trunci": lambda b, a: _not(b, b.vop("vcmp.eq.i", b.vop("vand", a[0], b.vconst_bits(1)),
                                               b.vconst_bits(0))),
    "math.sin": lambda b, a: vsin(b, a[0]),
    "math.cos": lambda b, a: vcos(b, a[0]),
    "math.log": lambda b, a: vlog(b, a[0]),
    "math.erf": lambda b, a: verf(b, a[0]),
    "math.fma": lambda b, a: vfma(b, a[0], a[1], a[2]),
}
for _name, _fn in EXTRA_OPS.items():
    VECTOR_OPS.setdefault(_name, _fn)
