"""Machine IR: CTPU instructions over virtual registers, in basic blocks.

Instruction selection produces this IR with *virtual* registers (`Reg(kind, n)`, unlimited); launch
arguments are *pinned* registers (`Reg(kind, n, phys=True)`). Everything an instruction is (its unit, slot,
latency, which operand it writes) comes from `device_sim.isa`; this file only adds what the scheduler needs
beyond the table: the vmem rows an instruction touches (`Mem`), so that memory order is kept.

Invariants: a `Block` ends with at most one control instruction (branch/jmp/halt) and it is last; a block
without one falls through to the next block of the `Function`. A *counted loop* block (`Block.loop` set by
`Builder.counted_loop`) branches back to itself with `bnz counter` after `addi counter, counter, -1`, and its
trip count is known at compile time. A block whose `bundles` are set was scheduled by a pass (software
pipelining): later passes keep its bundles, and results of such blocks may land in the next block.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from device_sim import isa


@dataclass(frozen=True)
class Reg:
    """A scalar ('s') or vector ('v') register; virtual unless `phys`."""

    kind: str
    n: int
    phys: bool = False

    def __str__(self) -> str:
        return f"{self.kind}{self.n}" if self.phys else f"%{self.kind}{self.n}"


ZERO = Reg("s", 0, phys=True)


@dataclass(frozen=True)
class Mem:
    """vmem rows [lo, hi) of region `region` touched by an instruction (hi=None: the whole region)."""

    region: str
    lo: int = 0
    hi: int | None = None
    write: bool = False

    def overlaps(self, other: Mem) -> bool:
        if self.region != other.region:
            return False
        if self.hi is None or other.hi is None:
            return True
        return self.lo < other.hi and other.lo < self.hi


@dataclass
class MInstr:
    """One instruction. `uses` are the register operands in the table's operand order, without the
    destination; `dst` is the register the table says it writes (None for stores, DMA, MXU, control)."""

    op: str
    dst: Reg | None = None
    uses: tuple[Reg, ...] = ()
    imm: int | None = None
    flag: int | None = None
    target: str | None = None
    mem: tuple[Mem, ...] = ()
    comment: str = ""
    reload: bool = False  # a spill reload or rematerialization: the scheduler issues it just in time

    @property
    def info(self) -> isa.Instr:
        return isa.BY_MNEMONIC[self.op]

    @property
    def unit(self) -> isa.Unit:
        return self.info.unit

    @property
    def latency(self) -> int:
        return self.info.latency

    @property
    def is_async(self) -> bool:
        return self.unit in (isa.Unit.DMA, isa.Unit.MXU)

    @property
    def is_control(self) -> bool:
        return self.op in ("halt", "jmp", "bnz", "bz")

    def regs(self) -> list[Reg]:
        return ([self.dst] if self.dst else []) + list(self.uses)

    def __str__(self) -> str:
        parts = []
        uses = iter(self.uses)
        for operand in self.info.operands:
            if operand.field == self.info.writes:
                parts.append(str(self.dst))
            elif operand.kind in (isa.Kind.SREG, isa.Kind.VREG):
                parts.append(str(next(uses)))
            elif operand.kind is isa.Kind.FLAG:
                parts.append(f"f{self.flag}")
            elif operand.kind is isa.Kind.TARGET:
                parts.append(str(self.target))
            else:
                parts.append(str(self.imm))
        text = self.op + (" " + ", ".join(parts) if parts else "")
        return text + (f"  # {self.comment}" if self.comment else "")


@dataclass(frozen=True)
class LoopInfo:
    """A counted loop: `trip_count` >= 1 runs of a body ending `addi counter, counter, -1 ; bnz counter`.
    `wanted`: a register holding the runs needed at run time (1 <= value <= trip_count; a dynamic-shape
    bucket's valid rows): the loop runs at least that many, at most trip_count (its preheader clamps the
    counter with `min counter, counter, wanted`, which software pipelining rewrites)."""

    trip_count: int
    counter: Reg
    wanted: Reg | None = None


@dataclass
class Block:
    label: str
    instrs: list[MInstr] = field(default_factory=list)
    loop: LoopInfo | None = None  # set on a single-block counted loop (the body is this block)
    bundles: list[list[MInstr]] | None = None  # pre-scheduled (software pipelined) blocks
    # a counted loop's instructions that `loops.hoist_invariants` moved to the end of its preheader (the
    # pipeliner may move them back when registers, not slots, bound the loop); not kept by `Function.clone`
    hoisted: list[MInstr] = field(default_factory=list)

    def successors(self, next_label: str | None) -> list[str]:
        last = self.instrs[-1] if self.instrs else None
        if last is not None and last.op == "halt":
            return []
        if last is not None and last.op == "jmp":
            return [str(last.target)]
        out = [next_label] if next_label else []
        if last is not None and last.op in ("bnz", "bz"):
            out.append(str(last.target))
        return out


@dataclass
class Function:
    """A program, or one kernel of it: blocks in layout order, plus the pinned launch-argument registers."""

    blocks: list[Block] = field(default_factory=list)
    pinned: tuple[Reg, ...] = ()
    spill_rows: tuple[int, ...] = ()  # first vmem row of each spill slot (empty: regalloc's reserved area)
    name: str = ""  # what errors call it (a kernel of a compiled graph)

    def clone(self) -> Function:
        """A copy to compile: new blocks and instructions (the passes edit both in place), sharing what no
        pass edits (registers, memory ranges, loop infos are frozen; operand tuples). A deepcopy cost a fifth
        of a backward graph's compile time."""
        copies: dict[int, MInstr] = {}

        def fresh(ins: MInstr) -> MInstr:
            if id(ins) not in copies:  # a pre-scheduled block's bundles hold its own instructions
                copies[id(ins)] = copy.copy(ins)
            return copies[id(ins)]

        blocks = [Block(b.label, [fresh(i) for i in b.instrs], b.loop,
                        None if b.bundles is None else [[fresh(i) for i in bundle] for bundle in b.bundles])
                  for b in self.blocks]
        return Function(blocks, self.pinned, self.spill_rows, self.name)

    def max_reg_id(self) -> int:
        """The highest virtual register number in use (0 when none)."""
        return max((r.n for b in self.blocks for i in b.instrs for r in i.regs() if not r.phys), default=0)

    def dump(self) -> str:
        lines = []
        for b in self.blocks:
            lines.append(f"{b.label}:")
            lines.extend(f"    {i}" for i in b.instrs)
        return "\n".join(lines) + "\n"
