"""A small builder for machine IR: fresh virtual registers, constants, address arithmetic, loops.

Instruction selection calls these helpers instead of constructing `MInstr` by hand, so the spelling of
common idioms (32-bit constants with li/lih, addresses beyond the 14-bit immediate, counted loops) is
written once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from codegen.mir import ZERO, Block, Function, LoopInfo, Mem, MInstr, Reg

IMM14 = (-(1 << 13), (1 << 13) - 1)
IMM19 = (-(1 << 18), (1 << 18) - 1)


def f32_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float32).view(np.uint32))


class Builder:
    """Appends instructions to the current block of a `Function`."""

    def __init__(self, func: Function) -> None:
        self._ids = itertools.count(1)
        self._labels = itertools.count()
        self.start_function(func)

    def start_function(self, func: Function, hint: str = "entry") -> None:
        """Append to `func` from now on (a fresh block). Register numbers and labels continue, so functions
        built by one builder never share a virtual register or a label."""
        self.func = func
        self.block = self.new_block(hint)

    # ---- registers and blocks ---------------------------------------------------------------------
    def sreg(self) -> Reg:
        return Reg("s", next(self._ids))

    def vreg(self) -> Reg:
        return Reg("v", next(self._ids))

    def new_block(self, hint: str) -> Block:
        b = Block(f"{hint}_{next(self._labels)}")
        self.func.blocks.append(b)
        self.block = b
        self._sconst, self._vconst = {}, {}  # constants are cached per block (no cross-block liveness surprises)
        return b

    def new_scope(self) -> None:
        """Forget cached constants: later uses rematerialize them (li + vbcast are cheap, long-lived
        constant registers are not)."""
        self._sconst, self._vconst = {}, {}

    def emit(self, op: str, dst: Reg | None = None, uses: tuple[Reg, ...] = (), imm: int | None = None,
             flag: int | None = None, target: str | None = None, mem: tuple[Mem, ...] = (),
             comment: str = "") -> Reg | None:
        self.block.instrs.append(MInstr(op, dst, tuple(uses), imm, flag, target, mem, comment))
        return dst

    # ---- scalars ----------------------------------------------------------------------------------
    def const(self, value: int) -> Reg:
        """A scalar register holding the 32-bit `value` (li, or li + lih), cached per block."""
        value &= 0xFFFFFFFF
        if value == 0:
            return ZERO
        if value in self._sconst:
            return self._sconst[value]
        signed = value - (1 << 32) if value >> 31 else value
        r = self.sreg()
        if IMM19[0] <= signed <= IMM19[1]:
            self.emit("li", r, imm=signed)
        else:  # li + shli + ori rather than li + lih: every register defined once, so spillable
            hi, lo = self.sreg(), self.sreg()
            self.emit("li", hi, imm=signed >> 13)
            self.emit("shli", lo, (hi,), imm=13)
            self.emit("ori", r, (lo,), imm=signed & 0x1FFF)
        self._sconst[value] = r
        return r

    def addi(self, base: Reg, offset: int, dst: Reg | None = None) -> Reg:
        """dst = base + offset, for any 32-bit offset."""
        dst = dst or self.sreg()
        if IMM14[0] <= offset <= IMM14[1]:
            self.emit("addi", dst, (base,), imm=offset)
        else:
            self.emit("add", dst, (base, self.const(offset)))
        return dst

    def offset_reg(self, base: Reg, offset: int) -> Reg:
        """base + offset as a register (base itself when offset is 0)."""
        return base if offset == 0 else self.addi(base, offset)

    # ---- vectors ----------------------------------------------------------------------------------
    def vconst_bits(self, bits: int) -> Reg:
        bits &= 0xFFFFFFFF
        if bits in self._vconst:
            return self._vconst[bits]
        v = self.vreg()
        self.emit("vbcast", v, (self.const(bits),))
        self._vconst[bits] = v
        return v

    def vconst(self, x: float) -> Reg:
        return self.vconst_bits(f32_bits(x))

    def vop(self, op: str, *srcs: Reg) -> Reg:
        v = self.vreg()
        self.emit(op, v, srcs)
        return v

    def vop_imm(self, op: str, imm: int, *srcs: Reg) -> Reg:
        v = self.vreg()
        self.emit(op, v, srcs, imm=imm)
        return v

    # ---- loops ------------------------------------------------------------------------------------
    def counted_loop(self, count: int, body: Callable[[], None], hint: str = "loop") -> None:
        """Run `body` `count` times (count >= 1) as a runtime loop: the body emits into one block that
        branches back to itself; the counter is a fresh register counting down."""
        counter = self.sreg()
        self.emit("li", counter, imm=count)
        loop = self.new_block(hint)
        body()
        self.emit("addi", counter, (counter,), imm=-1)
        self.emit("bnz", None, (counter,), target=loop.label)
        if self.block is loop:  # a single-block loop: candidate for software pipelining
            loop.loop = LoopInfo(count, counter)
        self.new_block(f"{hint}_exit")
