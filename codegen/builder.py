"""A small builder for machine IR: fresh virtual registers, constants, address arithmetic, loops.

Instruction selection calls these helpers instead of constructing `MInstr` by hand, so the spelling of
common idioms (32-bit constants with li/lih, addresses beyond the 14-bit immediate, counted loops) is
written once.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from codegen.mir import ZERO, Block, Function, LoopInfo, Mem, MInstr, Reg

IMM14 = (-(1 << 13), (1 << 13) - 1)
IMM19 = (-(1 << 18), (1 << 18) - 1)
VMEM_WINDOW = 1 << 13  # vmem rows past IMM14 are reached from base + k * VMEM_WINDOW, immediates within +-4096


def f32_bits(x: float) -> int:
    return int(np.array(x, dtype=np.float32).view(np.uint32))


@dataclass
class _LoopFrame:
    """A counted loop being built: where its loop-invariant values go, and its induction registers."""

    preheader: Block  # the block that falls into the loop
    steps: dict[Reg, int]  # induction register -> step (holds its start value at the preheader's end)
    bases: dict[tuple[Reg, int], Reg] = field(default_factory=dict)  # vmem base registers made for this loop
    companions: list[tuple[Reg, int]] = field(default_factory=list)  # induction bases to advance, with steps


def _drop_unread_advances(loop: Block, ivs: dict[Reg, int]) -> None:
    """Drop the advance of an induction register that a single-block loop reads nowhere else (its accesses
    all went through companions): a scalar slot an iteration, which bounds short loops' II."""
    def advance(ins: MInstr) -> bool:
        return ins.op == "addi" and ins.dst in ivs and ins.uses == (ins.dst,)
    reads = Counter(r for ins in loop.instrs for r in ins.uses)
    unread = {ins.dst for ins in loop.instrs if advance(ins) and reads[ins.dst] == 1}
    loop.instrs = [ins for ins in loop.instrs if not (advance(ins) and ins.dst in unread)]


class Builder:
    """Appends instructions to the current block of a `Function`."""

    def __init__(self, func: Function) -> None:
        self._ids = itertools.count(1)
        self._labels = itertools.count()
        self._loops: list[_LoopFrame] = []
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
        self._vbase: dict[tuple[Reg, int], Reg] = {}
        return b

    def new_scope(self) -> None:
        """Forget cached constants: later uses rematerialize them (li + vbcast are cheap, long-lived
        constant registers are not)."""
        self._sconst, self._vconst, self._vbase = {}, {}, {}

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

    # ---- vmem addresses -----------------------------------------------------------------------------
    def vmem_address(self, base: Reg, row: int) -> tuple[Reg, int]:
        """(register, immediate) addressing vmem row `base + row` in a vld / vst, whose immediate is 14-bit
        signed. A row within reach keeps `base` (the common case: unchanged code). A farther one goes through
        a register holding base + w (w a multiple of VMEM_WINDOW, the immediate within +-4096: room for the
        software pipeliner's corrections), one per (base, w), hoisted out of loops: a constant goes into the
        outermost loop's preheader, a loop's induction base gets a companion induction register (same step)
        set up in that loop's preheader."""
        if row <= IMM14[1]:
            return base, row
        window = (row + VMEM_WINDOW // 2) // VMEM_WINDOW * VMEM_WINDOW
        return self._vmem_base(base, window), row - window

    def _vmem_base(self, base: Reg, offset: int) -> Reg:
        key = (base, offset)
        frame = next((f for f in reversed(self._loops) if base in f.steps), None)
        if frame is None and base == ZERO and self._loops:
            frame = self._loops[0]
        if frame is None:  # outside loops, or a base that is neither constant nor an induction register
            if key not in self._vbase:
                self._vbase[key] = self.const(offset) if base == ZERO else self.addi(base, offset)
            return self._vbase[key]
        if key not in frame.bases:
            r = self.sreg()
            if base == ZERO:
                frame.preheader.instrs.append(MInstr("li", r, imm=offset))
            else:
                offset_reg = self._vmem_base(ZERO, offset)  # defined first: in this or an enclosing preheader
                frame.preheader.instrs.append(MInstr("add", r, (base, offset_reg)))
                frame.companions.append((r, frame.steps[base]))
            frame.bases[key] = r
        return frame.bases[key]

    def vld(self, base: Reg, row: int, mem: Mem, op: str = "vld") -> Reg:
        """A vld (or vld.row) of vmem row `base + row`, at any row."""
        v = self.vreg()
        addr, imm = self.vmem_address(base, row)
        self.emit(op, v, (addr,), imm=imm, mem=(mem,))
        return v

    def vst(self, value: Reg, base: Reg, row: int, mem: Mem) -> None:
        """A vst of `value` to vmem row `base + row`, at any row."""
        addr, imm = self.vmem_address(base, row)
        self.emit("vst", None, (value, addr), imm=imm, mem=(mem,))

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
    def counted_loop(self, count: int, body: Callable[[], None], hint: str = "loop",
                     ivs: dict[Reg, int] | None = None, wanted: Reg | None = None) -> None:
        """Run `body` `count` times (count >= 1) as a runtime loop: the body emits into one block that
        branches back to itself; the counter is a fresh register counting down. `ivs`: registers that hold
        their start value here and that the body advances by the given step (vmem bases: `vmem_address`
        gives them companions); their values after the loop are unspecified. `wanted`: a register holding
        the runs needed at run time, 1 <= value <= count: the loop runs at least that many and at most
        `count` (a software-pipelined loop rounds up to whole kernel runs)."""
        counter = self.sreg()
        self.emit("li", counter, imm=count)
        if wanted is not None:
            self.emit("min", counter, (counter, wanted))
        loop = self._loop_body(body, hint, ivs)
        self.emit("addi", counter, (counter,), imm=-1)
        self.emit("bnz", None, (counter,), target=loop.label)
        if self.block is loop:  # a single-block loop: candidate for software pipelining
            loop.loop = LoopInfo(count, counter, wanted)
        self.new_block(f"{hint}_exit")

    def _loop_body(self, body: Callable[[], None], hint: str, ivs: dict[Reg, int] | None = None) -> Block:
        """`body` emitted from a new block (the loop's head, returned) within a loop frame, then the induction
        bases' advance: what every loop shape shares up to its back edge."""
        frame = _LoopFrame(self.block, dict(ivs or {}))
        self._loops.append(frame)
        loop = self.new_block(hint)
        body()
        self._loops.pop()
        for r, step in frame.companions:
            self.addi(r, step, r)
        if self.block is loop:
            _drop_unread_advances(loop, frame.steps)
        return loop

    def if_positive(self, x: Reg, body: Callable[[], None], hint: str = "if") -> None:
        """Run `body` only when x > 0 (a forward branch around its blocks)."""
        more = self.sreg()
        self.emit("slt", more, (ZERO, x))
        self.emit("bz", None, (more,), target="")
        skip = self.block.instrs[-1]
        self.new_block(hint)
        body()
        skip.target = self.new_block(f"{hint}_end").label

    def while_positive(self, left: Reg, step: int, body: Callable[[], None], hint: str = "loop") -> None:
        """Run `body`, then `left -= step`, again while left > 0: a loop whose trip count is a runtime value
        (rows left of a runtime size). The body runs at least once; it may read `left`."""
        loop = self._loop_body(body, hint)
        self.addi(left, -step, left)
        more = self.sreg()
        self.emit("slt", more, (ZERO, left))
        self.emit("bnz", None, (more,), target=loop.label)
        self.new_block(f"{hint}_exit")
