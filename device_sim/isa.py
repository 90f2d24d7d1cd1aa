"""The CTPU instruction set, defined once.

Everything else is derived from these tables: the slot encoder and decoder below, the assembler and
disassembler (`asm.py`), the simulator's dispatch (`semantics.py` registers one function per mnemonic and
checks it covers this table), the compiler's scheduler latencies, and the SystemVerilog package the RTL
imports (`sv_package.py`, checked to be in sync by a test).

A bundle is NUM_SLOTS 32-bit slot words, in SLOTS order. Every slot word has the opcode in bits 31..24;
opcode 0 is `nop` in every slot. The remaining bits are laid out by the instruction's format:

    31      24 23    19 18    14 13     9 8      4 3      0
    +---------+--------+--------+--------+--------+--------+
    | opcode  |   d    |   a    |   b    |   c    |  flag  |   R / DMA / MM / WAIT (fields used vary)
    +---------+--------+--------+--------+--------+--------+
    | opcode  |   d    |   a    |          imm14 (signed)  |   RI
    +---------+--------+--------+--------------------------+
    | opcode  |   d    |            imm19 (signed)         |   I19 (li, viota, branch targets)
    +---------+--------+-----------------------------------+
    | opcode  |   d    |   000   |      imm16 (unsigned)   |   I16 (lih)
    +---------+--------+---------+-------------------------+

Bits an instruction does not use must be zero (including a format field it has no operand for, e.g. d of
`jmp`), so every legal slot word has one assembly spelling; anything else is an illegal encoding.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

WORD_BITS = 32
OPCODE_LO = 24


class Unit(Enum):
    SCALAR = "scalar"
    VECTOR = "vector"
    VLOAD = "vload"
    VSTORE = "vstore"
    MXU = "mxu"
    DMA = "dma"
    CTRL = "ctrl"


@dataclass(frozen=True)
class Slot:
    index: int
    name: str
    unit: Unit


SLOTS: tuple[Slot, ...] = (
    Slot(0, "s0", Unit.SCALAR),
    Slot(1, "s1", Unit.SCALAR),
    Slot(2, "v0", Unit.VECTOR),
    Slot(3, "v1", Unit.VECTOR),
    Slot(4, "vld", Unit.VLOAD),
    Slot(5, "vst", Unit.VSTORE),
    Slot(6, "mxu", Unit.MXU),
    Slot(7, "dma", Unit.DMA),
    Slot(8, "ctrl", Unit.CTRL),
)
NUM_SLOTS = len(SLOTS)
BUNDLE_BYTES = NUM_SLOTS * 4
SLOTS_OF_UNIT: dict[Unit, tuple[Slot, ...]] = {u: tuple(s for s in SLOTS if s.unit is u) for u in Unit}

NUM_SREGS = 32  # s0 reads as zero; writes to it are dropped
NUM_VREGS = 32
NUM_FLAGS = 16  # completion semaphores shared by DMA and MXU


@dataclass(frozen=True)
class Field:
    name: str
    hi: int
    lo: int
    signed: bool = False

    @property
    def width(self) -> int:
        return self.hi - self.lo + 1

    @property
    def mask(self) -> int:
        return (1 << self.width) - 1

    @property
    def min(self) -> int:
        return -(1 << (self.width - 1)) if self.signed else 0

    @property
    def max(self) -> int:
        return (1 << (self.width - 1)) - 1 if self.signed else self.mask


F_D = Field("d", 23, 19)
F_A = Field("a", 18, 14)
F_B = Field("b", 13, 9)
F_C = Field("c", 8, 4)
F_FLAG = Field("flag", 3, 0)
F_IMM14 = Field("imm", 13, 0, signed=True)
F_IMM19 = Field("imm", 18, 0, signed=True)
F_IMM16 = Field("imm", 15, 0)


@dataclass(frozen=True)
class Format:
    name: str
    fields: tuple[Field, ...]

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    @property
    def used_mask(self) -> int:
        m = 0xFF << OPCODE_LO
        for f in self.fields:
            m |= f.mask << f.lo
        return m


FMT_NONE = Format("NONE", ())
FMT_R = Format("R", (F_D, F_A, F_B, F_C))
FMT_RI = Format("RI", (F_D, F_A, F_IMM14))
FMT_I19 = Format("I19", (F_D, F_IMM19))
FMT_I16 = Format("I16", (F_D, F_IMM16))
FMT_ASYNC = Format("ASYNC", (F_D, F_A, F_B, F_C, F_FLAG))  # DMA and MXU: up to 4 registers and a flag
FMT_FLAG = Format("FLAG", (F_FLAG,))
FORMATS = (FMT_NONE, FMT_R, FMT_RI, FMT_I19, FMT_I16, FMT_ASYNC, FMT_FLAG)


class Kind(Enum):
    """Operand kinds, as the assembler spells them."""

    SREG = "sreg"  # s0..s31
    VREG = "vreg"  # v0..v31
    FLAG = "flag"  # f0..f15
    IMM = "imm"  # integer expression, range-checked against its field
    TARGET = "target"  # bundle address: a label or an expression


@dataclass(frozen=True)
class Operand:
    field: str
    kind: Kind


@dataclass(frozen=True)
class Instr:
    """One instruction: mnemonic, opcode, unit, format, assembly operands, latency and semantics.

    latency: cycles from issue until the result is visible to a later bundle (1 = the next bundle).
    Results land exactly then: a read before that sees the old value (no interlocks).
    For async units (DMA, MXU) latency is 0: completion is signalled through the flag.
    """

    mnemonic: str
    opcode: int
    unit: Unit
    fmt: Format
    operands: tuple[Operand, ...]
    latency: int
    semantics: str
    writes: str | None = None  # the field naming the destination register, if any
    imm_range: tuple[int, int] | None = None  # narrower than the field allows, checked by assembler and decoder

    @property
    def used_mask(self) -> int:
        """Opcode and operand bits. A format field the instruction has no operand for is reserved too, so
        every legal slot word has exactly one assembly spelling."""
        m = 0xFF << OPCODE_LO
        for op in self.operands:
            f = self.fmt.field(op.field)
            m |= f.mask << f.lo
        return m

    @property
    def dest_kind(self) -> Kind | None:
        if self.writes is None:
            return None
        return next(o.kind for o in self.operands if o.field == self.writes)


def _ops(*spec: str) -> tuple[Operand, ...]:
    """'d:s a:s imm:i' -> operands. s=sreg v=vreg f=flag i=imm t=target."""
    kinds = {"s": Kind.SREG, "v": Kind.VREG, "f": Kind.FLAG, "i": Kind.IMM, "t": Kind.TARGET}
    out = []
    for item in spec:
        name, k = item.split(":")
        out.append(Operand(name, kinds[k]))
    return tuple(out)


# Latencies, in cycles (issue -> visible). The compiler's scheduler reads them from here.
LAT_SCALAR = 1
LAT_VALU = 2
LAT_XLANE = 4  # cross-lane / cross-sublane reductions, the exp and reciprocal units: the long pipeline
LAT_VLOAD = 2
LAT_VSTORE = 1

_TABLE: list[Instr] = []


def _def(mn: str, opcode: int, unit: Unit, fmt: Format, operands: tuple[Operand, ...], latency: int,
         semantics: str, writes: str | None = None, imm_range: tuple[int, int] | None = None) -> None:
    _TABLE.append(Instr(mn, opcode, unit, fmt, operands, latency, semantics, writes, imm_range))


_def("nop", 0x00, Unit.CTRL, FMT_NONE, (), 0, "no operation (opcode 0 is nop in every slot)")

# ---- scalar ALU: 32-bit integer, two slots -------------------------------------------------------
for i, (mn, sem) in enumerate([
    ("add", "sd = sa + sb"), ("sub", "sd = sa - sb"), ("mul", "sd = low32(sa * sb)"),
    ("and", "sd = sa & sb"), ("or", "sd = sa | sb"), ("xor", "sd = sa ^ sb"),
    ("shl", "sd = sa << (sb & 31)"), ("shr", "sd = sa >>> (sb & 31) (logical)"),
    ("sra", "sd = sa >> (sb & 31) (arithmetic)"), ("slt", "sd = sa < sb (signed) ? 1 : 0"),
    ("sltu", "sd = sa < sb (unsigned) ? 1 : 0"), ("min", "sd = min(sa, sb) (signed)"),
    ("max", "sd = max(sa, sb) (signed)"),
]):
    _def(mn, 0x01 + i, Unit.SCALAR, FMT_R, _ops("d:s", "a:s", "b:s"), LAT_SCALAR, sem, "d")
for i, (mn, sem) in enumerate([
    ("addi", "sd = sa + imm"), ("andi", "sd = sa & imm"), ("ori", "sd = sa | imm"),
    ("xori", "sd = sa ^ imm"), ("shli", "sd = sa << (imm & 31)"), ("shri", "sd = sa >>> (imm & 31)"),
    ("srai", "sd = sa >> (imm & 31)"), ("slti", "sd = sa < imm (signed) ? 1 : 0"),
]):
    _def(mn, 0x10 + i, Unit.SCALAR, FMT_RI, _ops("d:s", "a:s", "imm:i"), LAT_SCALAR, sem, "d")
_def("li", 0x18, Unit.SCALAR, FMT_I19, _ops("d:s", "imm:i"), LAT_SCALAR, "sd = sext(imm19)", "d")
_def("lih", 0x19, Unit.SCALAR, FMT_I16, _ops("d:s", "imm:i"), LAT_SCALAR,
     "sd = (imm16 << 16) | (sd & 0xffff)", "d")

# ---- vector ALU: S x N lanes of 32 bits, two slots ----------------------------------------------
_VV = _ops("d:v", "a:v", "b:v")
_V = _ops("d:v", "a:v")
for i, (mn, sem) in enumerate([
    ("vadd.f", "vd = va + vb (fp32, RNE)"), ("vsub.f", "vd = va - vb (fp32, RNE)"),
    ("vmul.f", "vd = va * vb (fp32, RNE)"),
    ("vmax.f", "vd = (vb > va) ? vb : va; NaN if either is NaN"),
    ("vmin.f", "vd = (vb < va) ? vb : va; NaN if either is NaN"),
    ("vcmp.eq.f", "vd = (va == vb) ? ~0 : 0 (fp32; NaN compares false)"),
    ("vcmp.lt.f", "vd = (va < vb) ? ~0 : 0 (fp32)"), ("vcmp.le.f", "vd = (va <= vb) ? ~0 : 0 (fp32)"),
    ("vadd.i", "vd = va + vb (int32, wraps)"), ("vsub.i", "vd = va - vb (int32, wraps)"),
    ("vmul.i", "vd = low32(va * vb)"), ("vand", "vd = va & vb"), ("vor", "vd = va | vb"),
    ("vxor", "vd = va ^ vb"), ("vshl", "vd = va << (vb & 31)"), ("vshr", "vd = va >>> (vb & 31)"),
    ("vsra", "vd = va >> (vb & 31)"), ("vcmp.eq.i", "vd = (va == vb) ? ~0 : 0 (int32)"),
    ("vcmp.lt.i", "vd = (va < vb) ? ~0 : 0 (int32, signed)"),
]):
    _def(mn, 0x30 + i, Unit.VECTOR, FMT_R, _VV, LAT_VALU, sem, "d")
for i, (mn, sem) in enumerate([
    ("vmov", "vd = va"),
    ("vcvt.f2i", "vd = int32(trunc(va)); NaN -> 0; saturates at INT32_MIN/INT32_MAX"),
    ("vcvt.i2f", "vd = fp32(va) (RNE)"),
    ("vcvt.bf", "vd = fp32(bf16_rne(va)): round to bf16 precision; NaN -> canonical NaN"),
]):
    _def(mn, 0x50 + i, Unit.VECTOR, FMT_R, _V, LAT_VALU, sem, "d")
_def("vsel", 0x58, Unit.VECTOR, FMT_R, _ops("d:v", "a:v", "b:v", "c:v"), LAT_VALU,
     "vd = (va != 0) ? vb : vc (per lane, bitwise copy)", "d")
_def("vbcast", 0x59, Unit.VECTOR, FMT_R, _ops("d:v", "a:s"), LAT_VALU, "vd = sa in every lane", "d")
_def("vext", 0x5B, Unit.VECTOR, FMT_RI, _ops("d:s", "a:v", "imm:i"), LAT_VALU,
     "sd = bits of va[imm // N][imm % N] (vector -> scalar: data-dependent addresses)", "d")
_def("viota", 0x5A, Unit.VECTOR, FMT_I19, _ops("d:v", "imm:i"), LAT_VALU,
     "vd = imm==0 ? lane index : imm==1 ? sublane index : sublane*N + lane (int32)", "d", (0, 2))
for i, (mn, sem) in enumerate([
    ("vred.sum.l", "each row of vd = tree-sum of that row of va across lanes (fp32, pairwise halves)"),
    ("vred.max.l", "each row of vd = max of that row of va across lanes"),
    ("vred.sum.s", "each column of vd = tree-sum of that column of va across sublanes"),
    ("vred.max.s", "each column of vd = max of that column of va across sublanes"),
]):
    _def(mn, 0x60 + i, Unit.VECTOR, FMT_R, _V, LAT_XLANE, sem, "d")
_def("vexp.f", 0x64, Unit.VECTOR, FMT_R, _V, LAT_XLANE,
     "vd = e^va (fp32): the exp unit computes sequences.exp_unit_seq's 30 single-rounding steps (<= 1 ulp)", "d")
_def("vrcp.f", 0x65, Unit.VECTOR, FMT_R, _V, LAT_XLANE,
     "vd = 1 / va (fp32): the reciprocal unit computes sequences.rcp_unit_seq's 26 single-rounding steps"
     " (<= 1.3 ulp)", "d")
_def("vdiv.f", 0x66, Unit.VECTOR, FMT_R, _VV, LAT_XLANE,
     "vd = va / vb (fp32): the reciprocal unit computes sequences.div_unit_seq's 27 single-rounding steps"
     " (< 3 ulp)", "d")

# ---- vector memory: one load and one store slot --------------------------------------------------
_def("vld", 0x80, Unit.VLOAD, FMT_RI, _ops("d:v", "a:s", "imm:i"), LAT_VLOAD,
     "vd = vmem rows [sa+imm, sa+imm+S)", "d")
_def("vld.row", 0x81, Unit.VLOAD, FMT_RI, _ops("d:v", "a:s", "imm:i"), LAT_VLOAD,
     "every row of vd = vmem row sa+imm (broadcast down the sublanes)", "d")
_def("vst", 0x88, Unit.VSTORE, FMT_RI, _ops("d:v", "a:s", "imm:i"), LAT_VSTORE,
     "vmem rows [sa+imm, sa+imm+S) = vd")

# ---- matrix unit: N x N weight-stationary systolic array, bf16 x bf16 -> fp32 ---------------------
_def("mxu.lw", 0x90, Unit.MXU, FMT_ASYNC, _ops("a:s", "flag:f"), 0,
     "shadow weights[k, :] = bf16(vmem row sa+k), k < N; N cycles on the weight port")
_def("mxu.lwt", 0x91, Unit.MXU, FMT_ASYNC, _ops("a:s", "flag:f"), 0,
     "shadow weights[:, n] = bf16(vmem row sa+n), n < N (transposed load)")
for i, half in enumerate(("lo", "hi")):  # a bf16 weight tile packed two to a word: half the vmem (architecture.md)
    lanes = "lanes 0 .. N/2" if half == "lo" else "lanes N/2 .. N"
    _def(f"mxu.lwt.{half}", 0x92 + i, Unit.MXU, FMT_ASYNC, _ops("a:s", "flag:f"), 0,
         f"shadow weights[k, n] = bf16 bits (k odd ? 31:16 : 15:0) of word k // 2 of {lanes} of vmem row sa+n,"
         " n < N (a transposed load of bf16 pairs, as dma.ld moves a bf16 row's words)")
for i, (suffix, acc, swap) in enumerate([("", 0, 0), ("a", 1, 0), ("s", 0, 1), ("as", 1, 1)]):
    pre = "swap shadow/active weights; " if swap else ""
    post = "vmem[sb+r] = vmem[sb+r] + p" if acc else "vmem[sb+r] = p"
    _def(f"mxu.mm{suffix}", 0x94 + i, Unit.MXU, FMT_ASYNC, _ops("a:s", "b:s", "c:s", "flag:f"), 0,
         f"{pre}for r < sc: p = sum_k bf16(vmem[sa+r][k]) * W[k, :] (fp32, k ascending); {post}")

# ---- DMA between HBM and vmem ---------------------------------------------------------------------
_DMA_OPS = _ops("a:s", "b:s", "c:s", "d:s", "flag:f")
for i, (mn, sem) in enumerate([
    ("dma.ld", "vmem[sb..] = hbm[sa..] 32-bit elements; sc = rows<<16 | cols, sd = hbm row stride (elements)"),
    ("dma.ld.bf16", "as dma.ld, hbm holds bf16, widened exactly to fp32"),
    ("dma.st", "hbm[sa..] = vmem[sb..] 32-bit elements (cols lanes per row)"),
    ("dma.st.bf16", "as dma.st, rounding fp32 to bf16 (RNE, canonical NaN)"),
]):
    _def(mn, 0xA0 + i, Unit.DMA, FMT_ASYNC, _DMA_OPS, 0, sem)

# ---- control -------------------------------------------------------------------------------------
_def("halt", 0xB0, Unit.CTRL, FMT_NONE, (), 0, "stop issuing; the machine drains DMA, MXU and pipelines")
_def("jmp", 0xB1, Unit.CTRL, FMT_I19, _ops("imm:t"), 0, "pc = target")
_def("bnz", 0xB2, Unit.CTRL, FMT_I19, _ops("d:s", "imm:t"), 0, "if sd != 0: pc = target")
_def("bz", 0xB3, Unit.CTRL, FMT_I19, _ops("d:s", "imm:t"), 0, "if sd == 0: pc = target")
_def("wait", 0xB4, Unit.CTRL, FMT_FLAG, _ops("flag:f"), 0,
     "stall this bundle until every DMA/MXU command counted on the flag has completed")

INSTRUCTIONS: tuple[Instr, ...] = tuple(_TABLE)
BY_MNEMONIC: dict[str, Instr] = {i.mnemonic: i for i in INSTRUCTIONS}
BY_OPCODE: dict[int, Instr] = {i.opcode: i for i in INSTRUCTIONS}
NOP = BY_MNEMONIC["nop"]

DMA_SHAPE_ROWS_SHIFT = 16  # the DMA shape register: rows << 16 | cols
DMA_SHAPE_COLS_MASK = 0xFFFF

MXU_ACCUMULATE = frozenset(m for m in BY_MNEMONIC if m.startswith("mxu.mm") and "a" in m[6:])
MXU_SWAP = frozenset(m for m in BY_MNEMONIC if m.startswith("mxu.mm") and "s" in m[6:])


def _check_table() -> None:
    assert len(BY_MNEMONIC) == len(INSTRUCTIONS), "duplicate mnemonic"
    assert len(BY_OPCODE) == len(INSTRUCTIONS), "duplicate opcode"
    for ins in INSTRUCTIONS:
        assert 0 <= ins.opcode <= 0xFF
        names = {f.name for f in ins.fmt.fields}
        for op in ins.operands:
            assert op.field in names, f"{ins.mnemonic}: operand {op.field} not in format {ins.fmt.name}"
        assert ins.writes is None or ins.writes in {o.field for o in ins.operands}


_check_table()


class EncodingError(ValueError):
    """A slot word or bundle that is not a legal CTPU encoding."""


def encode_slot(ins: Instr, values: dict[str, int]) -> int:
    """Encode one instruction. `values` maps field name -> integer (registers by number)."""
    word = ins.opcode << OPCODE_LO
    if ins.imm_range and not ins.imm_range[0] <= values.get("imm", 0) <= ins.imm_range[1]:
        raise EncodingError(f"{ins.mnemonic}: immediate {values.get('imm')} not in {ins.imm_range}")
    operand_fields = {op.field for op in ins.operands}
    for f in ins.fmt.fields:
        v = values.get(f.name, 0)
        if v and f.name not in operand_fields:
            raise EncodingError(f"{ins.mnemonic}: has no operand in field {f.name} (got {v})")
        if not f.min <= v <= f.max:
            raise EncodingError(f"{ins.mnemonic}: field {f.name}={v} out of range [{f.min}, {f.max}]")
        word |= (v & f.mask) << f.lo
    return word


def encode_bundle(instrs: list[tuple[Instr, dict[str, int]]]) -> tuple[int, ...]:
    """One bundle's slot words: each instruction in its unit's next free slot, in order (nops leave zeros)."""
    words = [0] * NUM_SLOTS
    taken: dict[Unit, int] = {}
    for ins, values in instrs:
        if ins is NOP:
            continue
        slots, k = SLOTS_OF_UNIT[ins.unit], taken.get(ins.unit, 0)
        if k >= len(slots):
            raise EncodingError(f"bundle has {k + 1} {ins.unit.value} instructions; the CTPU has {len(slots)} "
                                f"{ins.unit.value} slot{'s' if len(slots) != 1 else ''}")
        taken[ins.unit] = k + 1
        words[slots[k].index] = encode_slot(ins, values)
    return tuple(words)


def decode_slot(word: int, slot: Slot) -> tuple[Instr, dict[str, int]]:
    """Decode one slot word; raises EncodingError for an unknown opcode, wrong slot or reserved bits."""
    opcode = (word >> OPCODE_LO) & 0xFF
    ins = BY_OPCODE.get(opcode)
    if ins is None:
        raise EncodingError(f"slot {slot.name}: unknown opcode 0x{opcode:02x} in word 0x{word:08x}")
    if ins is not NOP and ins.unit is not slot.unit:
        raise EncodingError(f"slot {slot.name}: {ins.mnemonic} belongs to the {ins.unit.value} unit")
    if word & ~ins.used_mask & 0xFFFFFFFF:
        raise EncodingError(f"slot {slot.name}: {ins.mnemonic} has reserved bits set in 0x{word:08x}")
    values = {}
    for f in ins.fmt.fields:
        v = (word >> f.lo) & f.mask
        if f.signed and v >> (f.width - 1):
            v -= 1 << f.width
        values[f.name] = v
    if ins.imm_range and not ins.imm_range[0] <= values["imm"] <= ins.imm_range[1]:
        raise EncodingError(f"slot {slot.name}: {ins.mnemonic} immediate {values['imm']} not in {ins.imm_range}")
    return ins, values
