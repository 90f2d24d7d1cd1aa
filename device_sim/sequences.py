"""Transcendental and normalisation sequences in CTPU vector ops, and their numpy-float32 models.

The CTPU has no rsqrt (docs/architecture.md, "Vector unit"): the compiler emits it as a sequence of
single-rounding vector ops. Exp (`vexp.f`), the reciprocal (`vrcp.f`) and division (`vdiv.f`) have units
of their own, which chain such steps in hardware. This module writes each sequence ONCE, as a list of
`VOp`s (a CTPU vector mnemonic over named values), built with a `SeqBuilder`. The same list is

- evaluated op by op in numpy (`evaluate`), which is the bit-exact reference model: every step is one
  fp32 RNE op or one int32 op, no FMA, exactly as `device_sim/semantics.py` defines the instruction;
- emitted as assembly by the programs' generator (`device_sim/programs/row_programs.py`) and, later, by the
  compiler, so a program is bit-exact against its model by construction.

Values are fp32/int32 bit patterns; arrays are shaped [..., 8, N] (sublanes x lanes) whenever a
sequence uses a cross-lane (`vred.*.l`) or cross-sublane (`vred.*.s`) reduction.

Sequences (ulp figures are measured by tests/device_sim/test_sequences.py and listed in docs/programs.md):

- `exp`: one `vexp.f`. The exp unit's steps (`exp_unit_seq`, also generated into the RTL's `fp32_exp`):
  clamp to [-104, 89], n = round(x log2e) by the 1.5*2^23 magic add, r = x - n ln2 in two Cody-Waite
  parts, e^r = 1 + r + r^2 P(r) with P a degree-4 near-minimax polynomial (Horner), times 2^n built on
  the exponent field in two halves (so subnormal results round once and overflow gives inf).
- `reciprocal`, `divide`: one `vrcp.f` / `vdiv.f`. The reciprocal unit's steps (`rcp_unit_seq`,
  `div_unit_seq`, also generated into the RTL's `fp32_rcp` and `fp32_div`): 0x7ef311c3 - bits(|d|)
  estimate, two Newton steps y(2 - d y) and a corrective one y + y(1 - d y), specials by selects; d
  outside [2^-126, 2^126] is first scaled by an exact power of two s, and the result (1 or a, times y)
  scaled back by s, so the whole fp32 range is covered.
- `rsqrt`: 0x5f3759df - bits(x)/2 estimate (subnormal x pre-scaled by 2^24), two Newton steps
  y(1.5 - (x/2) y^2), then one corrective step y + y (0.5 - (x/2) y^2); specials by selects.
- `softmax_row`, `rmsnorm_row`: one row held in one vreg (8 sublanes x N lanes).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from device_sim import numerics


def f32_bits(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", x))[0]


@dataclass(frozen=True)
class VOp:
    """One CTPU vector instruction over named values: `dst = mnemonic(*srcs)`."""

    mnemonic: str
    dst: str
    srcs: tuple[str, ...]
    tag: str = ""  # which part of a kernel it belongs to ("exp", "rcp", ...), for generated comments


@dataclass
class SeqBuilder:
    """Builds a straight-line sequence. Constants are named values whose 32-bit pattern is in `consts`."""

    ops: list[VOp] = field(default_factory=list)
    consts: dict[str, int] = field(default_factory=dict)
    inputs: list[str] = field(default_factory=list)
    tag: str = ""
    _count: int = 0

    @contextmanager
    def tagged(self, tag: str) -> Iterator[None]:
        """Tag the ops built inside (for comments in generated assembly)."""
        old, self.tag = self.tag, tag
        try:
            yield
        finally:
            self.tag = old

    def input(self, name: str) -> str:
        self.inputs.append(name)
        return name

    def const(self, name: str, value: float | int) -> str:
        """A named constant: a float is stored as its fp32 bits, an int as its int32 bits."""
        bits = f32_bits(value) if isinstance(value, float) else value & 0xFFFFFFFF
        if self.consts.get(name, bits) != bits:
            raise ValueError(f"constant {name} redefined with different bits")
        self.consts[name] = bits
        return name

    def op(self, mnemonic: str, *srcs: str) -> str:
        if mnemonic not in _SEMANTICS:
            raise ValueError(f"{mnemonic} is not a vector op the sequences use")
        self._count += 1
        dst = f"t{self._count}"
        self.ops.append(VOp(mnemonic, dst, tuple(srcs), self.tag))
        return dst


# ---- numpy semantics of the vector ops, on uint32 bit patterns (mirrors device_sim/semantics.py) ----
def _f(a: np.ndarray) -> np.ndarray:
    return a.view(np.float32)


def _i(a: np.ndarray) -> np.ndarray:
    return a.view(np.int32)


def _fp(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Callable[..., np.ndarray]:
    def run(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        r = np.asarray(fn(_f(a), _f(b)), dtype=np.float32)
        return numerics.canonicalize_nan(r).view(np.uint32)
    return run


def _mask(x: np.ndarray) -> np.ndarray:
    return np.where(x, np.uint32(0xFFFFFFFF), np.uint32(0))


def _red(axis: int, kind: str) -> Callable[[np.ndarray], np.ndarray]:
    def run(a: np.ndarray) -> np.ndarray:
        r = numerics.tree_reduce(_f(a), axis, kind)
        return np.ascontiguousarray(r).view(np.uint32)
    return run


_SEMANTICS: dict[str, Callable[..., np.ndarray]] = {
    "vadd.f": _fp(np.add),
    "vsub.f": _fp(np.subtract),
    "vmul.f": _fp(np.multiply),
    "vmax.f": _fp(numerics.fmax),
    "vmin.f": _fp(numerics.fmin),
    "vcmp.eq.f": lambda a, b: _mask(_f(a) == _f(b)),
    "vcmp.lt.f": lambda a, b: _mask(_f(a) < _f(b)),
    "vcmp.le.f": lambda a, b: _mask(_f(a) <= _f(b)),
    "vadd.i": lambda a, b: a + b,
    "vsub.i": lambda a, b: a - b,
    "vmul.i": lambda a, b: a * b,
    "vand": lambda a, b: a & b,
    "vor": lambda a, b: a | b,
    "vxor": lambda a, b: a ^ b,
    "vshl": lambda a, b: a << (b & 31),
    "vshr": lambda a, b: a >> (b & 31),
    "vsra": lambda a, b: (_i(a) >> _i(b & 31)).view(np.uint32),
    "vcmp.eq.i": lambda a, b: _mask(a == b),
    "vcmp.lt.i": lambda a, b: _mask(_i(a) < _i(b)),
    "vcvt.i2f": lambda a: _i(a).astype(np.float32).view(np.uint32),
    "vcvt.f2i": lambda a: numerics.f32_to_i32(_f(a)).view(np.uint32),
    "vcvt.bf": lambda a: numerics.round_to_bf16(_f(a)).view(np.uint32),
    "vsel": lambda m, a, b: np.where(m != 0, a, b),
    "vred.sum.l": _red(-1, "sum"),
    "vred.max.l": _red(-1, "max"),
    "vred.sum.s": _red(-2, "sum"),
    "vred.max.s": _red(-2, "max"),
}


def evaluate(b: SeqBuilder, inputs: dict[str, np.ndarray], outputs: list[str]) -> list[np.ndarray]:
    """Run the sequence op by op on fp32 arrays (all inputs broadcast to one shape); return float32 arrays."""
    shape = np.broadcast_shapes(*(np.shape(v) for v in inputs.values()))
    env: dict[str, np.ndarray] = {}
    for name, v in inputs.items():
        env[name] = np.ascontiguousarray(np.broadcast_to(np.asarray(v, dtype=np.float32), shape)).view(np.uint32)
    for name, bits in b.consts.items():
        env[name] = np.full(shape, bits, dtype=np.uint32)
    with np.errstate(all="ignore"):
        for op in b.ops:
            env[op.dst] = np.ascontiguousarray(_SEMANTICS[op.mnemonic](*(env[s] for s in op.srcs)))
    return [env[o].view(np.float32) for o in outputs]


# ---- exp -----------------------------------------------------------------------------------------
EXP_LO, EXP_HI = -104.0, 89.0  # exp(-104) < 2^-150 rounds to 0; exp(89) overflows to inf
MAGIC_ROUND = 12582912.0  # 1.5 * 2^23: t + MAGIC rounds t to an integer (RNE) for |t| < 2^22
LN2_HI = 0.693359375  # 9 significant bits: n * LN2_HI is exact for |n| < 2^15
LN2_LO = float(np.float32(np.log(2.0) - 0.693359375))
# P(r) ~ (e^r - 1 - r) / r^2 on [-ln2/2, ln2/2]: weighted least squares to the relative error of e^r
# (Lawson iteration, near-minimax: 3.1e-9 in float64), rounded to fp32. Highest degree first (Horner).
EXP_POLY = (0.001381461275741458, 0.008368710055947304, 0.04166838899254799, 0.1666652113199234,
            0.4999999403953552)


def exp_seq(b: SeqBuilder, x: str) -> str:
    """e^x: one `vexp.f` on the exp unit."""
    return b.op("vexp.f", x)


def exp_unit_seq(b: SeqBuilder, x: str) -> str:
    """What the exp unit computes, step by step: the definition of `vexp.f` (the simulator evaluates it,
    the RTL's `fp32_exp` chains the same steps). 30 single-rounding steps: 2 clamp, 4 range reduction,
    4 Cody-Waite, 12 polynomial, 8 scaling."""
    lo, hi = b.const("EXP_LO", EXP_LO), b.const("EXP_HI", EXP_HI)
    log2e, magic = b.const("LOG2E", float(np.float32(np.log2(np.e)))), b.const("MAGIC_ROUND", MAGIC_ROUND)
    ln2_hi, ln2_lo = b.const("LN2_HI", LN2_HI), b.const("LN2_LO", LN2_LO)
    one, i1, i23 = b.const("ONE", 1.0), b.const("I1", 1), b.const("I23", 23)
    xc = b.op("vmax.f", x, lo)  # NaN stays NaN (canonical) through both clamps
    xc = b.op("vmin.f", xc, hi)
    t = b.op("vmul.f", xc, log2e)
    k = b.op("vadd.f", t, magic)  # n sits in the low mantissa bits of k
    nf = b.op("vsub.f", k, magic)  # n as fp32, exact
    ni = b.op("vsub.i", k, magic)  # n as int32: bits(k) - bits(MAGIC)
    r = b.op("vsub.f", xc, b.op("vmul.f", nf, ln2_hi))  # exact (Sterbenz), n * LN2_HI exact
    r = b.op("vsub.f", r, b.op("vmul.f", nf, ln2_lo))
    p = b.const("EXP_C4", EXP_POLY[0])
    for i, c in zip(range(3, -1, -1), EXP_POLY[1:], strict=True):
        p = b.op("vadd.f", b.op("vmul.f", p, r), b.const(f"EXP_C{i}", c))
    y = b.op("vmul.f", p, b.op("vmul.f", r, r))
    y = b.op("vadd.f", b.op("vadd.f", y, r), one)  # (r^2 P + r) + 1: the small terms first
    # 2^n = 2^n1 * 2^n2, n1 = n >> 1, n2 = n - n1: both halves are normal for n in [-150, 129], so a
    # subnormal result rounds once (in the last multiply) and n = 129 overflows to inf.
    n1 = b.op("vsra", ni, i1)
    n2 = b.op("vsub.i", ni, n1)
    e1 = b.op("vadd.i", b.op("vshl", n1, i23), one)  # (n1 << 23) + bits(1.0) = bits(2^n1)
    e2 = b.op("vadd.i", b.op("vshl", n2, i23), one)
    return b.op("vmul.f", b.op("vmul.f", y, e1), e2)


# ---- reciprocal and division ---------------------------------------------------------------------
RCP_MAGIC = 0x7EF311C3
RCP_NEWTON_STEPS = 3
RCP_TINY, RCP_BIG = 2.0**-126, 2.0**126  # the core's domain; outside it d is scaled by a power of two
RCP_UP, RCP_DOWN = 2.0**24, 2.0**-4  # subnormal d * 2^24 >= 2^-125; |d| > 2^126 times 2^-4 is < 2^124


def reciprocal_core(b: SeqBuilder, d: str) -> tuple[str, str]:
    """(y, s) with y ~ 1/(d s), s a power of two that puts d s in the core's domain: the reciprocal unit's
    shared core, the first 25 steps of both `rcp_unit_seq` and `div_unit_seq` (the RTL's `fp32_rcp_core`).

    Subnormal d, whose estimate would be out of Newton's reach, is first scaled up by 2^24, and |d| >
    2^126, whose reciprocal is subnormal, down by 2^-4: exact scalings that leave only ±inf beyond 2^126.
    Then 0x7ef311c3 - bits(|d|) estimate (relative error <= 12% for |d| in [2^-126, 2^126]), two Newton
    steps y (2 - d y) and a corrective one y + y (1 - d y); ±0 -> ±inf and |d| > 2^126 -> ±0 by selects,
    NaN propagates. 25 ops.
    """
    absmask, magic = b.const("ABS_MASK", 0x7FFFFFFF), b.const("RCP_MAGIC", RCP_MAGIC)
    two, zero = b.const("TWO", 2.0), b.const("ZERO", 0.0)
    inf, big = b.const("INF", 0x7F800000), b.const("RCP_BIG", RCP_BIG)
    one = b.const("ONE", 1.0)
    ad = b.op("vand", d, absmask)
    s = b.op("vsel", b.op("vcmp.lt.f", ad, b.const("RCP_TINY", RCP_TINY)), b.const("RCP_UP", RCP_UP), one)
    s = b.op("vsel", b.op("vcmp.lt.f", big, ad), b.const("RCP_DOWN", RCP_DOWN), s)
    d = b.op("vmul.f", d, s)  # exact; 0, ±inf and NaN stay themselves
    ad = b.op("vand", d, absmask)
    sign = b.op("vxor", d, ad)  # the sign bit alone: also ±0.0
    y = b.op("vor", b.op("vsub.i", magic, ad), sign)  # estimate with d's sign
    for _ in range(RCP_NEWTON_STEPS - 1):  # y (2 - d y): the error squares each step; NaN propagates
        y = b.op("vmul.f", y, b.op("vsub.f", two, b.op("vmul.f", d, y)))
    # the last step as a correction, y + y (1 - d y), so its own rounding touches only the small term
    y = b.op("vadd.f", y, b.op("vmul.f", y, b.op("vsub.f", one, b.op("vmul.f", d, y))))
    y = b.op("vsel", b.op("vcmp.eq.f", ad, zero), b.op("vor", inf, sign), y)
    return b.op("vsel", b.op("vcmp.lt.f", big, ad), sign, y), s


def rcp_unit_seq(b: SeqBuilder, d: str) -> str:
    """What the reciprocal unit computes for `vrcp.f`, step by step (the simulator evaluates it, the RTL's
    `fp32_rcp` chains the same steps): 1/d = y s, 26 single-rounding steps, <= 1.3 ulp over the whole fp32
    range (subnormal results and overflow to ±inf included: one rounding, y * s); 1/±0 = ±inf,
    1/±inf = ±0, NaN -> NaN."""
    y, s = reciprocal_core(b, d)
    return b.op("vmul.f", y, s)


def div_unit_seq(b: SeqBuilder, a: str, d: str) -> str:
    """What the reciprocal unit computes for `vdiv.f` (the RTL's `fp32_div`): a / d = (a y) s with (y, s)
    the scaled reciprocal of d, 27 steps, < 3 ulp over the whole fp32 range (measured 2.07). a y cannot
    overflow unless the quotient does (s >= 1 when |d| is small, and |a / d| <= 4 when s < 1), and it
    underflows only where the quotient does; IEEE specials: x/±0 = ±inf, 0/0 = inf/inf = NaN, x/±inf = ±0."""
    y, s = reciprocal_core(b, d)
    return b.op("vmul.f", b.op("vmul.f", a, y), s)


def reciprocal_seq(b: SeqBuilder, d: str) -> str:
    """1/d: one `vrcp.f` on the reciprocal unit (`rcp_unit_seq`'s steps)."""
    return b.op("vrcp.f", d)


def divide_seq(b: SeqBuilder, a: str, d: str) -> str:
    """a / d: one `vdiv.f` on the reciprocal unit (`div_unit_seq`'s steps)."""
    return b.op("vdiv.f", a, d)


# ---- rsqrt ---------------------------------------------------------------------------------------
RSQRT_MAGIC = 0x5F3759DF


def rsqrt_seq(b: SeqBuilder, x: str) -> str:
    """1/sqrt(x): 28 vector ops. <= 1.3 ulp for x > 0 including subnormals; rsqrt(±0) = ±inf,
    rsqrt(+inf) = 0, rsqrt(x < 0) = NaN, NaN -> NaN."""
    tiny, two24, two12 = b.const("RSQRT_TINY", 2.0**-124), b.const("TWO24", 2.0**24), b.const("TWO12", 2.0**12)
    one, half, three_halves = b.const("ONE", 1.0), b.const("HALF", 0.5), b.const("THREE_HALVES", 1.5)
    magic, i1, zero = b.const("RSQRT_MAGIC", RSQRT_MAGIC), b.const("I1", 1), b.const("ZERO", 0.0)
    inf, nan = b.const("INF", 0x7F800000), b.const("NAN", numerics.CANONICAL_NAN_F32)
    small = b.op("vcmp.lt.f", x, tiny)  # x < 2^-124 (so x/2 would lose bits): scale by 2^24, result by 2^12
    xs = b.op("vsel", small, b.op("vmul.f", x, two24), x)
    post = b.op("vsel", small, two12, one)
    h = b.op("vmul.f", xs, half)
    y = b.op("vsub.i", magic, b.op("vshr", xs, i1))  # estimate, rel. error <= 3.5e-3
    # (h y) y rather than h (y y): y^2 would underflow for x near the top of the range
    for _ in range(2):  # y (1.5 - h y^2): 3.5e-3 -> 1.8e-5 -> 5e-10
        y = b.op("vmul.f", y, b.op("vsub.f", three_halves, b.op("vmul.f", b.op("vmul.f", h, y), y)))
    # the last step as a correction, y + y e, so its own rounding touches only the small term
    e = b.op("vsub.f", half, b.op("vmul.f", b.op("vmul.f", h, y), y))
    y = b.op("vadd.f", y, b.op("vmul.f", y, e))
    y = b.op("vmul.f", y, post)
    y = b.op("vsel", b.op("vcmp.eq.f", x, zero), b.op("vor", inf, x), y)  # ±0 -> ±inf
    y = b.op("vsel", b.op("vcmp.lt.f", x, zero), nan, y)
    return b.op("vsel", b.op("vcmp.eq.f", x, inf), zero, y)


# ---- the row kernels of the programs -------------------------------------------------------------
def softmax_row(b: SeqBuilder, x: str) -> str:
    """Softmax of one row held in one vreg: max (lanes, then sublanes), exp(x - max), sum (lanes, then
    sublanes), times the reciprocal of the sum."""
    with b.tagged("max"):
        m = b.op("vred.max.s", b.op("vred.max.l", x))
    with b.tagged("exp"):
        e = exp_seq(b, b.op("vsub.f", x, m))
    with b.tagged("sum"):
        s = b.op("vred.sum.s", b.op("vred.sum.l", e))
    with b.tagged("rcp"):
        r = reciprocal_seq(b, s)
    with b.tagged("out"):
        return b.op("vmul.f", e, r)


def rmsnorm_row(b: SeqBuilder, x: str, w: str, inv_d: float, eps: float) -> str:
    """x * rsqrt(sum(x^2) * (1/D) + eps) * w for one row held in one vreg (w laid out like x)."""
    with b.tagged("ms"):
        s = b.op("vred.sum.s", b.op("vred.sum.l", b.op("vmul.f", x, x)))
        a = b.op("vadd.f", b.op("vmul.f", s, b.const("INV_D", inv_d)), b.const("EPS", eps))
    with b.tagged("rsqrt"):
        r = rsqrt_seq(b, a)
    with b.tagged("out"):
        return b.op("vmul.f", b.op("vmul.f", x, r), w)


# ---- numpy entry points --------------------------------------------------------------------------
def model(build: Callable[..., str], arity: int = 1) -> Callable[..., np.ndarray]:
    """The bit-exact numpy model of a sequence: float32 arrays in, float32 array out (`.builder` is the
    op list, e.g. to count its ops or to run it on the simulator)."""
    b = SeqBuilder()
    names = [b.input(f"in{i}") for i in range(arity)]
    out = build(b, *names)

    def run(*xs: np.ndarray) -> np.ndarray:
        return evaluate(b, dict(zip(names, xs, strict=True)), [out])[0]
    run.__doc__ = build.__doc__
    run.builder = b  # type: ignore[attr-defined]
    return run


def _unit_bits(build: Callable[..., str], arity: int = 1) -> Callable[..., np.ndarray]:
    """A unit's instruction on fp32 bit patterns (uint32 in, uint32 out): its steps, evaluated."""
    steps = model(build, arity)

    def run(*bits: np.ndarray) -> np.ndarray:
        return steps(*(np.ascontiguousarray(x).view(np.float32) for x in bits)).view(np.uint32)
    run.__doc__ = build.__doc__
    return run


exp_unit_bits = _unit_bits(exp_unit_seq)  # vexp.f
rcp_unit_bits = _unit_bits(rcp_unit_seq)  # vrcp.f
div_unit_bits = _unit_bits(div_unit_seq, 2)  # vdiv.f
# before any sequence that emits them is built
_SEMANTICS.update({"vexp.f": exp_unit_bits, "vrcp.f": rcp_unit_bits, "vdiv.f": div_unit_bits})
exp = model(exp_seq)
reciprocal = model(reciprocal_seq)
rsqrt = model(rsqrt_seq)
divide = model(divide_seq, 2)


def rows_as_vregs(x: np.ndarray, lanes: int) -> np.ndarray:
    """[R, 8 * lanes] -> [R, 8, lanes]: each row in one vreg, the way a DMA lays it into 8 vmem rows."""
    r, d = x.shape
    if d != 8 * lanes:
        raise ValueError(f"a row of {d} elements does not fill one vreg of 8 x {lanes}")
    return np.ascontiguousarray(x, dtype=np.float32).reshape(r, 8, lanes)


def softmax_rows(x: np.ndarray, lanes: int = 8) -> np.ndarray:
    """The bit-exact model of softmax.s: row softmax of x [R, 8 * lanes]."""
    b = SeqBuilder()
    y = softmax_row(b, b.input("x"))
    return evaluate(b, {"x": rows_as_vregs(x, lanes)}, [y])[0].reshape(x.shape)


def rmsnorm_rows(x: np.ndarray, w: np.ndarray, eps: float, lanes: int = 8) -> np.ndarray:
    """The bit-exact model of rmsnorm.s: RMSNorm of x [R, 8 * lanes] with weight w [8 * lanes]."""
    b = SeqBuilder()
    y = rmsnorm_row(b, b.input("x"), b.input("w"), 1.0 / x.shape[1], eps)
    vw = rows_as_vregs(np.asarray(w, dtype=np.float32).reshape(1, -1), lanes)
    return evaluate(b, {"x": rows_as_vregs(x, lanes), "w": vw}, [y])[0].reshape(x.shape)


# ---- accuracy measures ---------------------------------------------------------------------------
def ulp_error(y: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """|y - exact| in units of the fp32 ulp at `exact` (float64): 0.5 is a correctly rounded result.

    The ulp of a value in [2^e, 2^(e+1)) is 2^(e-23), and 2^-149 below the normal range. Where `exact`
    overflows fp32 the error is 0 if y is the same infinity and inf otherwise; NaN matches NaN only.
    """
    y64 = np.asarray(y, dtype=np.float32).astype(np.float64)
    exact = np.asarray(exact, dtype=np.float64)
    with np.errstate(all="ignore"):
        mag = np.abs(exact)
        e = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
        ulp = np.exp2(np.maximum(e, -126.0) - 23.0)
        err = np.abs(y64 - exact) / ulp
    with np.errstate(over="ignore"):
        exact32 = exact.astype(np.float32)
    over = np.isinf(exact32) & ~np.isnan(exact)
    err = np.where(over, np.where(y64 == exact32, 0.0, np.inf), err)
    both_nan = np.isnan(exact) & np.isnan(y64)
    err = np.where(both_nan, 0.0, np.where(np.isnan(exact) | np.isnan(y64), np.inf, err))
    return err


def ulp_distance(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """How many fp32 values lie between a and b (0 = identical bits up to ±0; NaN vs NaN = 0)."""
    def ordered(x: np.ndarray) -> np.ndarray:
        i = np.asarray(x, dtype=np.float32).view(np.int32).astype(np.int64)
        return np.where(i < 0, -(i & 0x7FFFFFFF), i)
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    d = np.abs(ordered(a) - ordered(b)).astype(np.float64)
    nan_a, nan_b = np.isnan(a), np.isnan(b)
    return np.where(nan_a & nan_b, 0.0, np.where(nan_a | nan_b, np.inf, d))
