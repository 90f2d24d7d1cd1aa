"""fp32 math sequences (exp, log, tanh, erf, activations) as short PTX instruction runs.

PTX has only a few transcendental instructions (ex2.approx, lg2.approx, rsqrt.approx, tanh.approx); the
accurate functions are built from them here. Accuracy targets are fp32 parity with eager PyTorch at ~1e-6
relative for moderate inputs: `tanh.approx` (2^-11) is deliberately not used, `erf` is Abramowitz-Stegun
7.1.26 (|error| < 1.5e-7).
"""

from __future__ import annotations

import math

import numpy as np
from pyptx import ptx, reg
from pyptx.reg import Reg
from pyptx.types import f32

from ptx_kernels.core import fimm, setp

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def new() -> Reg:
    return reg.scalar(f32)


def binary(op: str, a: Reg, b: Reg | str) -> Reg:
    """add/sub/mul/min/max with round-to-nearest where PTX allows the modifier."""
    out = new()
    if op in ("add", "sub", "mul"):
        getattr(ptx.inst, op).rn.f32(out, a, b)
    else:
        getattr(ptx.inst, op).f32(out, a, b)
    return out


def div(a: Reg, b: Reg | str) -> Reg:
    out = new()
    ptx.inst.div.rn.f32(out, a, b)
    return out


def fma(a: Reg, b: Reg | str, c: Reg | str) -> Reg:
    out = new()
    ptx.inst.fma.rn.f32(out, a, b, c)
    return out


def neg(a: Reg) -> Reg:
    out = new()
    ptx.inst.neg.f32(out, a)
    return out


def abs_(a: Reg) -> Reg:
    out = new()
    ptx.inst.abs.f32(out, a)
    return out


def exp(x: Reg) -> Reg:
    """e^x = 2^(x*log2(e)); ex2.approx is accurate to ~2 ulp over the range that matters."""
    scaled = binary("mul", x, fimm(LOG2E))
    out = new()
    ptx.inst.ex2.approx.f32(out, scaled)
    return out


def log(x: Reg) -> Reg:
    out = new()
    ptx.inst.lg2.approx.f32(out, x)
    return binary("mul", out, fimm(LN2))


def sqrt(x: Reg) -> Reg:
    out = new()
    ptx.inst.sqrt.rn.f32(out, x)
    return out


def rsqrt(x: Reg) -> Reg:
    # 1/sqrt with IEEE sqrt and division: rsqrt.approx is off by up to 2 ulp, which breaks exact
    # comparisons in normalisation tests for no measurable speed gain in memory-bound kernels.
    return div(fimm(1.0), sqrt(x))


def sigmoid(x: Reg) -> Reg:
    e = exp(neg(x))
    return div(fimm(1.0), binary("add", e, fimm(1.0)))


def tanh(x: Reg) -> Reg:
    """tanh(x) = sign(x) * (1 - 2 / (e^(2|x|) + 1)); stable for large |x| (e^... -> inf gives 1)."""
    ax = abs_(x)
    e = exp(binary("mul", ax, fimm(2.0)))
    t = div(fimm(2.0), binary("add", e, fimm(1.0)))
    mag = binary("sub", fimm(1.0), t)
    out = new()
    ptx.inst.copysign.f32(out, x, mag)
    return out


def erf(x: Reg) -> Reg:
    """Abramowitz-Stegun 7.1.26 on |x|, sign restored with copysign."""
    ax = abs_(x)
    t = div(fimm(1.0), fma(ax, fimm(0.3275911), fimm(1.0)))
    poly = fimm(1.061405429)
    acc = new()
    ptx.inst.mov.f32(acc, poly)
    for coef in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
        acc = fma(acc, t, fimm(coef))
    acc = binary("mul", acc, t)
    e = exp(neg(binary("mul", ax, ax)))
    mag = fma(neg(acc), e, fimm(1.0))
    out = new()
    ptx.inst.copysign.f32(out, x, mag)
    return out


def relu(x: Reg) -> Reg:
    return binary("max", x, fimm(0.0))


def silu(x: Reg) -> Reg:
    return binary("mul", x, sigmoid(x))


def gelu(x: Reg) -> Reg:
    """0.5 * x * (1 + erf(x / sqrt(2))), torch's default (approximate='none')."""
    e = erf(binary("mul", x, fimm(1.0 / math.sqrt(2.0))))
    half_x = binary("mul", x, fimm(0.5))
    return fma(half_x, e, half_x)


def gelu_tanh(x: Reg) -> Reg:
    """0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), torch's approximate='tanh'."""
    x3 = binary("mul", binary("mul", x, x), x)
    inner = binary("mul", fma(x3, fimm(0.044715), x), fimm(math.sqrt(2.0 / math.pi)))
    th = tanh(inner)
    half_x = binary("mul", x, fimm(0.5))
    return fma(half_x, th, half_x)


ACTIVATIONS = {"none": lambda x: x, "relu": relu, "silu": silu, "gelu": gelu, "gelu_tanh": gelu_tanh}


def activation(name: str, x: Reg) -> Reg:
    if name not in ACTIVATIONS:
        raise NotImplementedError(f"ptx kernels: unknown activation {name!r} (have {sorted(ACTIVATIONS)})")
    return ACTIVATIONS[name](x)


def select(cond: Reg, a: Reg, b: Reg) -> Reg:
    """cond is an f32 0/1 value (how booleans live in registers): a where cond != 0 else b."""
    p = setp("neu", cond, fimm(0.0), "f32")
    out = new()
    ptx.inst.selp.f32(out, a, b, p)
    return out


def compare(cmp: str, a: Reg, b: Reg) -> Reg:
    """An f32 0/1 result of an ordered comparison (ne is unordered, so NaN != NaN like torch)."""
    kind = {"eq": "eq", "ne": "neu", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge"}[cmp]
    p = setp(kind, a, b, "f32")
    out = new()
    ptx.inst.selp.f32(out, fimm(1.0), fimm(0.0), p)
    return out


# 2*pi split for Cody-Waite reduction: TWO_PI_HI has 8 significant bits, so k * TWO_PI_HI is exact for
# |k| < 2^16 (|x| < ~4e5); the fp32 remainder MID and what is left of it (LO) follow as two fma steps.
_TWO_PI_HI = 6.28125
_TWO_PI_MID = float(np.float32(2.0 * math.pi - _TWO_PI_HI))
_TWO_PI_LO = float(np.float32(2.0 * math.pi - _TWO_PI_HI - _TWO_PI_MID))


def _reduce_2pi(x: Reg) -> Reg:
    """x - k 2 pi with k = rint(x / 2 pi), r in [-pi, pi], where sin.approx/cos.approx are accurate
    (absolute error ~2^-21); they degrade quickly outside that range, hence the reduction."""
    k = binary("mul", x, fimm(1.0 / (2.0 * math.pi)))
    ptx.inst.cvt.rni.f32.f32(k, k)
    r = fma(neg(k), fimm(_TWO_PI_HI), x)
    r = fma(neg(k), fimm(_TWO_PI_MID), r)
    return fma(neg(k), fimm(_TWO_PI_LO), r)


def cos(x: Reg) -> Reg:
    out = new()
    ptx.inst.cos.approx.f32(out, _reduce_2pi(x))
    return out


def sin(x: Reg) -> Reg:
    out = new()
    ptx.inst.sin.approx.f32(out, _reduce_2pi(x))
    return out
