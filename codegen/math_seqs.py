"""Transcendentals as sequences of simple vector ops (the CTPU has no exp, divide, rsqrt or tanh).

exp, reciprocal and rsqrt are the sequences of `device_sim/sequences.py`, written there once as lists of
vector ops: the same lists the shipped programs assemble and whose numpy models the tests measure (exp
0.97 ulp on [-87, 88], reciprocal and rsqrt 1.22 ulp; 1/1 is exactly 1). This module only emits those
lists as machine IR, and builds sqrt and tanh from them.

- sqrt: x * rsqrt(x), with x = 0 and x = inf passed through.
- tanh: odd polynomial for |x| < 0.4, (1 - e)/(1 + e) with e = exp(-2|x|) above; within 4 ulp.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from codegen.builder import Builder
from codegen.mir import Reg
from device_sim import sequences

F = np.float32
TANH_SMALL = F(0.4)
TANH_POLY = [F(c) for c in (1.0, -1 / 3, 2 / 15, -17 / 315, 62 / 2835, -1382 / 155925, 21844 / 6081075)]
SIGN = 0x80000000
ABS = 0x7FFFFFFF
INF = 0x7F800000


def _emit(b: Builder, build: Callable[[sequences.SeqBuilder, str], str], x: Reg) -> Reg:
    """Emit one of device_sim.sequences' op lists with `x` as its input."""
    seq = sequences.SeqBuilder()
    out = build(seq, seq.input("x"))
    values: dict[str, Reg] = {"x": x}

    def value(name: str) -> Reg:
        if name not in values:  # a constant, materialised where first used
            values[name] = b.vconst_bits(seq.consts[name])
        return values[name]

    for op in seq.ops:
        values[op.dst] = b.vop(op.mnemonic, *(value(s) for s in op.srcs))
    return value(out)


def vexp(b: Builder, x: Reg) -> Reg:
    return _emit(b, sequences.exp_seq, x)


def vrecip(b: Builder, x: Reg) -> Reg:
    return _emit(b, sequences.reciprocal_seq, x)


def vrsqrt(b: Builder, x: Reg) -> Reg:
    return _emit(b, sequences.rsqrt_seq, x)


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
