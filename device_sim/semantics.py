"""One small function per CTPU instruction: the executable semantics of `isa.py`'s one-liners.

Each function is `fn(m, op, t)`: `m` the Machine (simulator.py), `op` the decoded operands (fields of the
slot word plus the instruction's latency), `t` the issue cycle. Reads see the machine at the start of
cycle `t`; every result is queued to land at `t + latency`. Control functions return the next pc when a
branch is taken. `check_coverage()` proves every instruction of the table has exactly one function here.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from device_sim import isa, numerics, sequences
from device_sim.machine import Machine, Operands

Semantics = Callable[[Machine, Operands, int], "int | None"]
SEMANTICS: dict[str, Semantics] = {}
MASK32 = 0xFFFFFFFF


def semantics(*mnemonics: str) -> Callable[[Semantics], Semantics]:
    def register(fn: Semantics) -> Semantics:
        for mn in mnemonics:
            assert mn in isa.BY_MNEMONIC, f"semantics for unknown instruction {mn}"
            assert mn not in SEMANTICS, f"two semantics for {mn}"
            SEMANTICS[mn] = fn
        return fn
    return register


def _signed(x: int) -> int:
    return x - (1 << 32) if x & 0x80000000 else x


# ---- scalar --------------------------------------------------------------------------------------
_SCALAR_RR: dict[str, Callable[[int, int], int]] = {
    "add": lambda a, b: a + b,
    "sub": lambda a, b: a - b,
    "mul": lambda a, b: a * b,
    "and": lambda a, b: a & b,
    "or": lambda a, b: a | b,
    "xor": lambda a, b: a ^ b,
    "shl": lambda a, b: a << (b & 31),
    "shr": lambda a, b: a >> (b & 31),
    "sra": lambda a, b: _signed(a) >> (b & 31),
    "slt": lambda a, b: int(_signed(a) < _signed(b)),
    "sltu": lambda a, b: int(a < b),
    "min": lambda a, b: min(_signed(a), _signed(b)),
    "max": lambda a, b: max(_signed(a), _signed(b)),
}
_SCALAR_RI = {"addi": "add", "andi": "and", "ori": "or", "xori": "xor", "shli": "shl", "shri": "shr",
              "srai": "sra", "slti": "slt"}


def _scalar_rr(fn: Callable[[int, int], int]) -> Semantics:
    def run(m: Machine, op: Operands, t: int) -> None:
        m.write_s(op.d, fn(m.s[op.a], m.s[op.b]) & MASK32, t + op.lat)
    return run


def _scalar_ri(fn: Callable[[int, int], int]) -> Semantics:
    def run(m: Machine, op: Operands, t: int) -> None:
        m.write_s(op.d, fn(m.s[op.a], op.imm & MASK32) & MASK32, t + op.lat)
    return run


for _mn, _fn in _SCALAR_RR.items():
    semantics(_mn)(_scalar_rr(_fn))
for _mn, _base in _SCALAR_RI.items():
    semantics(_mn)(_scalar_ri(_SCALAR_RR[_base]))


@semantics("li")
def _li(m: Machine, op: Operands, t: int) -> None:
    m.write_s(op.d, op.imm & MASK32, t + op.lat)


@semantics("lih")
def _lih(m: Machine, op: Operands, t: int) -> None:
    m.write_s(op.d, (op.imm << 16) | (m.s[op.d] & 0xFFFF), t + op.lat)


# ---- vector --------------------------------------------------------------------------------------
def _fp(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Semantics:
    def run(m: Machine, op: Operands, t: int) -> None:
        r = numerics.canonicalize_nan(fn(m.vf[op.a], m.vf[op.b]).astype(np.float32, copy=False))
        m.write_v(op.d, r.view(np.uint32), t + op.lat)
    return run


def _bits(fn: Callable[[np.ndarray, np.ndarray], np.ndarray], view: str = "vu") -> Semantics:
    def run(m: Machine, op: Operands, t: int) -> None:
        src = getattr(m, view)
        r = np.asarray(fn(src[op.a], src[op.b]))
        if r.dtype != np.uint32:  # int32 arithmetic results; masks are already uint32
            r = r.astype(src.dtype, copy=False).view(np.uint32)
        m.write_v(op.d, r, t + op.lat)
    return run


def _mask(x: np.ndarray) -> np.ndarray:
    return np.where(x, np.uint32(MASK32), np.uint32(0))


semantics("vadd.f")(_fp(np.add))
semantics("vsub.f")(_fp(np.subtract))
semantics("vmul.f")(_fp(np.multiply))
semantics("vmax.f")(_fp(numerics.fmax))
semantics("vmin.f")(_fp(numerics.fmin))
semantics("vcmp.eq.f")(_bits(lambda a, b: _mask(a == b), "vf"))
semantics("vcmp.lt.f")(_bits(lambda a, b: _mask(a < b), "vf"))
semantics("vcmp.le.f")(_bits(lambda a, b: _mask(a <= b), "vf"))
semantics("vadd.i")(_bits(np.add))
semantics("vsub.i")(_bits(np.subtract))
semantics("vmul.i")(_bits(np.multiply))
semantics("vand")(_bits(np.bitwise_and))
semantics("vor")(_bits(np.bitwise_or))
semantics("vxor")(_bits(np.bitwise_xor))
semantics("vshl")(_bits(lambda a, b: a << (b & 31)))
semantics("vshr")(_bits(lambda a, b: a >> (b & 31)))
semantics("vsra")(_bits(lambda a, b: a >> (b & 31), "vi"))
semantics("vcmp.eq.i")(_bits(lambda a, b: _mask(a == b)))
semantics("vcmp.lt.i")(_bits(lambda a, b: _mask(a < b), "vi"))


@semantics("vmov")
def _vmov(m: Machine, op: Operands, t: int) -> None:
    m.write_v(op.d, m.vu[op.a].copy(), t + op.lat)


@semantics("vcvt.f2i")
def _f2i(m: Machine, op: Operands, t: int) -> None:
    m.write_v(op.d, numerics.f32_to_i32(m.vf[op.a]).view(np.uint32), t + op.lat)


@semantics("vcvt.i2f")
def _i2f(m: Machine, op: Operands, t: int) -> None:
    m.write_v(op.d, m.vi[op.a].astype(np.float32).view(np.uint32), t + op.lat)


@semantics("vcvt.bf")
def _cvt_bf(m: Machine, op: Operands, t: int) -> None:
    m.write_v(op.d, numerics.round_to_bf16(m.vf[op.a]).view(np.uint32), t + op.lat)


@semantics("vsel")
def _vsel(m: Machine, op: Operands, t: int) -> None:
    m.write_v(op.d, np.where(m.vu[op.a] != 0, m.vu[op.b], m.vu[op.c]), t + op.lat)


@semantics("vbcast")
def _vbcast(m: Machine, op: Operands, t: int) -> None:
    m.write_v(op.d, np.full(m.vreg_shape, m.s[op.a], dtype=np.uint32), t + op.lat)


@semantics("vext")
def _vext(m: Machine, op: Operands, t: int) -> None:
    flat = m.vu[op.a].reshape(-1)
    if not 0 <= op.imm < flat.size:
        m.trap(f"vext lane {op.imm} outside the register (0..{flat.size - 1})")
    m.write_s(op.d, int(flat[op.imm]), t + op.lat)


@semantics("viota")
def _viota(m: Machine, op: Operands, t: int) -> None:
    m.write_v(op.d, m.iota[op.imm].copy(), t + op.lat)


def _reduce(axis: int, kind: str) -> Semantics:
    def run(m: Machine, op: Operands, t: int) -> None:
        m.write_v(op.d, np.ascontiguousarray(numerics.tree_reduce(m.vf[op.a], axis, kind)).view(np.uint32),
                  t + op.lat)
    return run


semantics("vred.sum.l")(_reduce(1, "sum"))
semantics("vred.max.l")(_reduce(1, "max"))
semantics("vred.sum.s")(_reduce(0, "sum"))
semantics("vred.max.s")(_reduce(0, "max"))


@semantics("vexp.f")
def _vexp(m: Machine, op: Operands, t: int) -> None:
    m.write_v(op.d, sequences.exp_unit_bits(m.vu[op.a]), t + op.lat)


@semantics("vrcp.f")
def _vrcp(m: Machine, op: Operands, t: int) -> None:
    m.write_v(op.d, sequences.rcp_unit_bits(m.vu[op.a]), t + op.lat)


@semantics("vdiv.f")
def _vdiv(m: Machine, op: Operands, t: int) -> None:
    m.write_v(op.d, sequences.div_unit_bits(m.vu[op.a], m.vu[op.b]), t + op.lat)


# ---- vector memory -------------------------------------------------------------------------------
@semantics("vld")
def _vld(m: Machine, op: Operands, t: int) -> None:
    m.write_v(op.d, m.vmem_read(m.s[op.a] + op.imm, m.sublanes), t + op.lat)


@semantics("vld.row")
def _vld_row(m: Machine, op: Operands, t: int) -> None:
    row = m.vmem_read(m.s[op.a] + op.imm, 1)
    m.write_v(op.d, np.repeat(row, m.sublanes, axis=0), t + op.lat)


@semantics("vst")
def _vst(m: Machine, op: Operands, t: int) -> None:
    m.vmem_store(m.s[op.a] + op.imm, m.vu[op.d].copy(), t + op.lat)


# ---- asynchronous units --------------------------------------------------------------------------
@semantics("mxu.lw", "mxu.lwt", "mxu.lwt.lo", "mxu.lwt.hi")
def _mxu_lw(m: Machine, op: Operands, t: int) -> None:
    half = {"mxu.lwt.lo": 0, "mxu.lwt.hi": 1}.get(op.mnemonic)
    m.mxu.load_weights(m, m.s[op.a], op.flag, transpose=op.mnemonic != "mxu.lw", t=t, packed_half=half)


@semantics("mxu.mm", "mxu.mma", "mxu.mms", "mxu.mmas")
def _mxu_mm(m: Machine, op: Operands, t: int) -> None:
    m.mxu.matmul(m, m.s[op.a], m.s[op.b], m.s[op.c], op.flag, accumulate=op.mnemonic in isa.MXU_ACCUMULATE,
                  swap=op.mnemonic in isa.MXU_SWAP, t=t)


@semantics("dma.ld", "dma.ld.bf16", "dma.st", "dma.st.bf16")
def _dma(m: Machine, op: Operands, t: int) -> None:
    m.dma.copy(m, hbm=m.s[op.a], vmem=m.s[op.b], shape=m.s[op.c], stride=m.s[op.d], flag=op.flag,
               store=op.mnemonic.startswith("dma.st"), bf16=op.mnemonic.endswith(".bf16"), t=t)


# ---- control -------------------------------------------------------------------------------------
@semantics("nop", "wait", "halt")  # wait is a stall (simulator.py), halt ends the run loop
def _nothing(m: Machine, op: Operands, t: int) -> None:
    return None


@semantics("jmp")
def _jmp(m: Machine, op: Operands, t: int) -> int:
    return op.imm


@semantics("bnz")
def _bnz(m: Machine, op: Operands, t: int) -> int | None:
    return op.imm if m.s[op.d] != 0 else None


@semantics("bz")
def _bz(m: Machine, op: Operands, t: int) -> int | None:
    return op.imm if m.s[op.d] == 0 else None


def check_coverage() -> None:
    missing = [i.mnemonic for i in isa.INSTRUCTIONS if i.mnemonic not in SEMANTICS]
    if missing:
        raise AssertionError(f"instructions without semantics: {missing}")


check_coverage()
