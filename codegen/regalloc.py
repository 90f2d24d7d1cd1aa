"""Register allocation by linear scan over the scheduled program, with spilling to vmem.

Before: scheduled bundles of virtual registers. After: a map virtual -> physical register such that no two
values whose live ranges overlap share a register. A live range is measured in bundles of the scheduled
layout, from a definition's issue to the later of its last read and its landing (issue + latency); a value
live into or out of a block covers the whole block (so loops are safe). s0 is never allocated; pinned
launch-argument registers are reserved.

When a class runs out of registers, `allocate` returns the values to spill instead; `insert_spills`
rewrites the *unscheduled* IR (store after each definition, reload before each use, in a vmem slot of the
reserved spill area), and the driver schedules and allocates again.
"""

from __future__ import annotations

from dataclasses import dataclass

from codegen.errors import CapacityError
from codegen.mir import Function, Mem, MInstr, Reg
from device_sim import isa

SPILL_REGION = "spill"
SPILL_SLOTS = 32  # each slot holds one vreg: 8 vmem rows at the bottom of vmem
ALLOCATABLE = {"s": [Reg("s", i, True) for i in range(1, isa.NUM_SREGS)],
               "v": [Reg("v", i, True) for i in range(isa.NUM_VREGS)]}


@dataclass
class Interval:
    reg: Reg
    start: int
    end: int


def live_intervals(func: Function, bundles: dict[str, list[list[MInstr]]]) -> dict[Reg, Interval]:
    """Live ranges (in global bundle positions) of every virtual register."""
    labels = [b.label for b in func.blocks]
    start_of, pos = {}, 0
    for label in labels:
        start_of[label] = pos
        pos += len(bundles[label])
    gen: dict[str, set[Reg]] = {}
    kill: dict[str, set[Reg]] = {}
    for blk in func.blocks:
        g, k = set(), set()
        for ins in blk.instrs:  # program order decides upward-exposed uses
            g |= {r for r in ins.uses if not r.phys and r not in k}
            if ins.dst is not None and not ins.dst.phys:
                k.add(ins.dst)
        gen[blk.label], kill[blk.label] = g, k
    succ = {blk.label: blk.successors(labels[i + 1] if i + 1 < len(labels) else None)
            for i, blk in enumerate(func.blocks)}
    live_in: dict[str, set[Reg]] = {lb: set() for lb in labels}
    live_out: dict[str, set[Reg]] = {lb: set() for lb in labels}
    changed = True
    while changed:
        changed = False
        for label in reversed(labels):
            out = set().union(*(live_in[s] for s in succ[label])) if succ[label] else set()
            inn = gen[label] | (out - kill[label])
            if out != live_out[label] or inn != live_in[label]:
                live_out[label], live_in[label], changed = out, inn, True
    iv: dict[Reg, Interval] = {}

    def cover(r: Reg, a: int, b: int) -> None:
        if r.phys:
            return
        if r in iv:
            iv[r].start, iv[r].end = min(iv[r].start, a), max(iv[r].end, b)
        else:
            iv[r] = Interval(r, a, b)

    for blk in func.blocks:
        s0 = start_of[blk.label]
        end = s0 + max(len(bundles[blk.label]) - 1, 0)
        for r in live_in[blk.label]:
            cover(r, s0, s0)
        for r in live_out[blk.label]:
            cover(r, end, end)
        for t, bundle in enumerate(bundles[blk.label]):
            for ins in bundle:
                for r in ins.uses:
                    cover(r, s0 + t, s0 + t)
                if ins.dst is not None:
                    cover(ins.dst, s0 + t, s0 + t + max(ins.latency, 1))
        for r in live_in[blk.label] & live_out[blk.label]:
            cover(r, s0, end)
    return iv


def allocate(func: Function, bundles: dict[str, list[list[MInstr]]]) -> tuple[dict[Reg, Reg], list[Reg]]:
    """Linear scan. Returns (assignment, spills); spills is empty on success."""
    intervals = sorted(live_intervals(func, bundles).values(), key=lambda i: (i.start, i.end))
    free = {k: [r for r in regs if r not in func.pinned] for k, regs in ALLOCATABLE.items()}
    active: list[Interval] = []
    assignment: dict[Reg, Reg] = {}
    spills: list[Reg] = []
    # lih reads its own destination (it keeps the low half), so a constant built by li + lih stays put
    pinned_values = {i.dst for b in func.blocks for i in b.instrs if i.op == "lih"}
    for cur in intervals:
        for old in [a for a in active if a.end < cur.start]:
            active.remove(old)
            free[old.reg.kind].append(assignment[old.reg])
        pool = free[cur.reg.kind]
        if pool:
            pool.sort(key=lambda r: r.n)
            assignment[cur.reg] = pool.pop(0)
            active.append(cur)
            continue
        # spill the value of this class that lives longest
        same = [a for a in [*active, cur] if a.reg.kind == cur.reg.kind and a.reg not in pinned_values]
        if not same:
            raise RuntimeError(f"register allocation: no {cur.reg.kind} register can be spilled")
        victim = max(same, key=lambda i: i.end)
        spills.append(victim.reg)
        if victim is not cur:
            active.remove(victim)
            assignment[cur.reg] = assignment.pop(victim.reg)
            active.append(cur)
    return assignment, spills


def insert_spills(func: Function, spills: list[Reg], next_id: int, first_slot: int) -> tuple[int, int]:
    """Rewrite `func` so every register in `spills` lives in a vmem spill slot. Returns (next_id, next_slot)."""
    slot_of = {}
    for r in spills:
        if first_slot >= SPILL_SLOTS:
            raise CapacityError("register allocation: the vmem spill area is full")
        slot_of[r] = first_slot
        first_slot += 1

    def fresh(kind: str) -> Reg:
        nonlocal next_id
        next_id += 1
        return Reg(kind, next_id)

    for blk in func.blocks:
        out: list[MInstr] = []
        for ins in blk.instrs:
            uses = list(ins.uses)
            for i, r in enumerate(uses):
                if r in slot_of:
                    out.extend(_fill(r, slot_of[r], fresh, uses, i))
            ins.uses = tuple(uses)
            out.append(ins)
            if ins.dst in slot_of:
                r = ins.dst
                new = fresh(r.kind)
                ins.dst = new
                out.extend(_spill(new, slot_of[r], fresh))
        blk.instrs = out  # control instructions define nothing, so no spill store follows them
    return next_id, first_slot


def _mem(slot: int, write: bool) -> tuple[Mem, ...]:
    return (Mem(SPILL_REGION, slot * 8, slot * 8 + 8, write),)


def _spill(r: Reg, slot: int, fresh) -> list[MInstr]:
    zero = Reg("s", 0, True)
    if r.kind == "v":
        return [MInstr("vst", None, (r, zero), imm=slot * 8, mem=_mem(slot, True), comment="spill")]
    v = fresh("v")
    return [MInstr("vbcast", v, (r,), comment="spill"),
            MInstr("vst", None, (v, zero), imm=slot * 8, mem=_mem(slot, True), comment="spill")]


def _fill(r: Reg, slot: int, fresh, uses: list[Reg], i: int) -> list[MInstr]:
    zero = Reg("s", 0, True)
    if r.kind == "v":
        new = fresh("v")
        uses[i] = new
        return [MInstr("vld", new, (zero,), imm=slot * 8, mem=_mem(slot, False), comment="fill")]
    v, new = fresh("v"), fresh("s")
    uses[i] = new
    return [MInstr("vld", v, (zero,), imm=slot * 8, mem=_mem(slot, False), comment="fill"),
            MInstr("vext", new, (v,), imm=0, comment="fill")]
