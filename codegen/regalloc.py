"""Register allocation by linear scan over the scheduled program, with spilling to vmem.

Before: scheduled bundles of virtual registers. After: a map virtual -> physical register such that no two
values whose live ranges overlap share a register. A live range is a list of segments in bundles of the
scheduled layout (`live_intervals`): from a definition's issue to the later of its last read and its landing
(issue + latency), from a block's start / to its end when live into / out of it (so loops are safe), with
holes where the value is dead (a pipelined kernel's values wrap around the back edge). s0 is never
allocated; pinned launch-argument registers are reserved.

When a class runs out of registers, `allocate` returns the values to spill instead; `insert_spills`
rewrites the *unscheduled* IR (store after each definition, reload before each use, in a vmem slot of the
reserved spill area), and the driver schedules and allocates again.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
from collections.abc import Callable
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
    """A value's live range: segments [start, end] (inclusive bundle positions), with holes between."""

    reg: Reg
    segments: list[tuple[int, int]]

    @property
    def start(self) -> int:
        return self.segments[0][0]

    @property
    def end(self) -> int:
        return self.segments[-1][1]


def _block_liveness(func: Function, bundles: dict[str, list[list[MInstr]]]
                    ) -> tuple[dict[str, set[Reg]], dict[str, set[Reg]], dict[str, list[str]]]:
    labels = [b.label for b in func.blocks]
    gen: dict[str, set[Reg]] = {}
    kill: dict[str, set[Reg]] = {}
    for blk in func.blocks:
        gen[blk.label], kill[blk.label] = _gen_kill(blk.instrs, bundles[blk.label], blk.bundles is not None)
    succ = {blk.label: blk.successors(labels[i + 1] if i + 1 < len(labels) else None)
            for i, blk in enumerate(func.blocks)}
    live_in: dict[str, set[Reg]] = {lb: set() for lb in labels}
    live_out: dict[str, set[Reg]] = {lb: set() for lb in labels}
    changed = True
    while changed:
        changed = False
        for label in reversed(labels):
            # a branch to another function of the program (a layer loop's back edge) carries no value
            out = set().union(*(live_in.get(s, set()) for s in succ[label])) if succ[label] else set()
            inn = gen[label] | (out - kill[label])
            if out != live_out[label] or inn != live_in[label]:
                live_out[label], live_in[label], changed = out, inn, True
    return live_in, live_out, succ


def live_intervals(func: Function, bundles: dict[str, list[list[MInstr]]]) -> dict[Reg, Interval]:
    """Live segments (in global bundle positions) of every virtual register.

    Within a block a value is live from a definition's issue to the later of its landing and its last
    read before the next definition lands (a read before that landing still sees the old value); a value
    live into / out of a block is live from the block's start / to its end. A result that lands past the
    end of a block that branches to itself also occupies its register at the block's start (the landing
    happens in the next iteration)."""
    live_in, live_out, succ = _block_liveness(func, bundles)
    segs: dict[Reg, list[tuple[int, int]]] = {}

    def add(r: Reg, a: int, b: int) -> None:
        segs.setdefault(r, []).append((a, b))

    pos = 0
    for blk in func.blocks:
        block = bundles[blk.label]
        s0, end = pos, pos + max(len(block) - 1, 0)
        pos += len(block)
        self_loop = blk.label in succ[blk.label]
        cur: dict[Reg, list[int]] = {r: [s0, s0] for r in live_in[blk.label] if not r.phys}
        old: dict[Reg, tuple[list[int], int]] = {}  # value still readable until the new definition lands
        for t, bundle in enumerate(block):
            now = s0 + t
            for ins in bundle:
                for r in ins.uses:
                    if r.phys:
                        continue
                    if r in old and now < old[r][1]:
                        old[r][0][1] = max(old[r][0][1], now)
                    elif r in cur:
                        cur[r][1] = max(cur[r][1], now)
                    else:
                        cur[r] = [now, now]
            for ins in bundle:
                r = ins.dst
                if r is None or r.phys:
                    continue
                land = now + max(ins.latency, 1)
                if r in old:
                    _close(old.pop(r)[0], cur.get(r), add, r)
                if r in cur:
                    old[r] = (cur[r], now + ins.latency)
                cur[r] = [now, land]
                if self_loop and land > end:
                    add(r, s0, min(end, s0 + land - end - 1))
        for r, (seg, new_lands) in old.items():
            if r in live_out[blk.label] and new_lands > end + 1:
                seg[1] = end  # the successor's reads before the new value lands see this one
            _close(seg, cur.get(r), add, r)
        for r, seg in cur.items():
            if r in live_out[blk.label]:
                seg[1] = max(seg[1], end)
            add(r, seg[0], seg[1])
    out = {}
    for r, ss in segs.items():
        ss.sort()
        merged: list[tuple[int, int]] = []
        for a, b in ss:
            if merged and a <= merged[-1][1] + 1:
                merged[-1] = (merged[-1][0], max(merged[-1][1], b))
            else:
                merged.append((a, b))
        out[r] = Interval(r, merged)
    return out


def _close(seg: list[int], new: list[int] | None, add: Callable[[Reg, int, int], None], r: Reg) -> None:
    """End a value's previous segment; when it overlaps the new definition's, the two become one."""
    if new is not None and seg[1] >= new[0]:
        new[0] = min(new[0], seg[0])
    else:
        add(r, seg[0], seg[1])


def _gen_kill(instrs: list[MInstr], bundles: list[list[MInstr]], timed: bool) -> tuple[set[Reg], set[Reg]]:
    """Upward-exposed uses and definitions of a block: in program order, or for a pre-scheduled block by
    time (a read at t sees the results landed by t, so a definition counts from its landing)."""
    g: set[Reg] = set()
    k: set[Reg] = set()
    if not timed:
        for ins in instrs:
            g |= {r for r in ins.uses if not r.phys and r not in k}
            if ins.dst is not None and not ins.dst.phys:
                k.add(ins.dst)
        return g, k
    events = []
    for t, bundle in enumerate(bundles):
        for ins in bundle:
            events += [(t, 1, r) for r in ins.uses if not r.phys]
            if ins.dst is not None and not ins.dst.phys:
                events.append((t + ins.latency, 0, ins.dst))
    for _, kind, r in sorted(events, key=lambda e: (e[0], e[1])):
        if kind == 1 and r not in k:
            g.add(r)
        elif kind == 0:
            k.add(r)
    return g, k


class _RegisterFile:
    """Segments assigned to each physical register (disjoint, sorted)."""

    def __init__(self, regs: list[Reg]) -> None:
        self.regs = regs
        self.starts: dict[Reg, list[int]] = {r: [] for r in regs}
        self.items: dict[Reg, list[tuple[int, int, Reg]]] = {r: [] for r in regs}

    def conflicts(self, phys: Reg, iv: Interval) -> set[Reg]:
        out = set()
        starts, items = self.starts[phys], self.items[phys]
        for a, b in iv.segments:
            i = bisect.bisect_right(starts, b)
            while i > 0 and items[i - 1][1] >= a:
                out.add(items[i - 1][2])
                i -= 1
        return out

    def last_end_before(self, phys: Reg, pos: int) -> int:
        """End of the last segment on `phys` that starts before `pos` (-1 when none)."""
        i = bisect.bisect_left(self.starts[phys], pos)
        return self.items[phys][i - 1][1] if i else -1

    def assign(self, phys: Reg, iv: Interval) -> None:
        for a, b in iv.segments:
            i = bisect.bisect_right(self.starts[phys], a)
            self.starts[phys].insert(i, a)
            self.items[phys].insert(i, (a, b, iv.reg))

    def remove(self, phys: Reg, reg: Reg) -> None:
        keep = [x for x in self.items[phys] if x[2] != reg]
        self.items[phys] = keep
        self.starts[phys] = [x[0] for x in keep]


def allocate(func: Function, bundles: dict[str, list[list[MInstr]]]) -> tuple[dict[Reg, Reg], list[Reg]]:
    """Greedy allocation over live segments, in order of start (linear scan that can use the holes of a
    live range: a loop kernel's values wrap around its back edge). Returns (assignment, spills); spills is
    empty on success. When no register is free, the value with the longest span among this one and those
    that alone block a register is spilled."""
    intervals = live_intervals(func, bundles)
    order = sorted(intervals.values(), key=lambda i: (i.start, i.end))
    files = {k: _RegisterFile([r for r in regs if r not in func.pinned]) for k, regs in ALLOCATABLE.items()}
    assignment: dict[Reg, Reg] = {}
    spills: list[Reg] = []
    for cur in order:
        rf = files[cur.reg.kind]
        clash = {p: rf.conflicts(p, cur) for p in rf.regs}
        free = [p for p in rf.regs if not clash[p]]
        if free:
            best = max(free, key=lambda p: rf.last_end_before(p, cur.start))  # pack tightly: fewer holes
            assignment[cur.reg] = best
            rf.assign(best, cur)
            continue
        single = [(p, next(iter(c))) for p, c in clash.items() if len(c) == 1]
        if single:
            p, victim = max(single, key=lambda pv: intervals[pv[1]].end - intervals[pv[1]].start)
            if intervals[victim].end - intervals[victim].start > cur.end - cur.start:
                spills.append(victim)
                rf.remove(p, victim)
                del assignment[victim]
                assignment[cur.reg] = p
                rf.assign(p, cur)
                continue
        spills.append(cur.reg)
    return assignment, spills


def spill_rows(func: Function) -> list[int]:
    """First vmem row of every spill slot of `func`: the reserved area at the bottom of vmem (SPILL_SLOTS
    slots), then the rows above what any kernel uses, when instruction selection recorded them
    (`Function.spill_rows`)."""
    return list(func.spill_rows) if func.spill_rows else [8 * s for s in range(SPILL_SLOTS)]


def _slot_occupancy(func: Function, spills: list[Reg], rows: list[int]
                    ) -> tuple[dict[int, list[tuple[int, int]]], dict[Reg, Interval]]:
    """Live segments, in *program order* (one instruction per position; pre-scheduled blocks by their
    bundles), of every slot already in use (a store to it defines its content, a fill reads it) and of
    every value to spill. Program order, not the schedule: the scheduler keeps the program order of the
    accesses to one slot, so two values may share a slot only when they do not interfere in that order."""
    slot_at = {row: k for k, row in enumerate(rows)}
    pseudo = {k: Reg("m", k) for k in range(len(rows))}
    fake = Function(pinned=func.pinned)
    order: dict[str, list[list[MInstr]]] = {}
    for blk in func.blocks:
        instrs = []
        for ins in blk.instrs:
            m = next((m for m in ins.mem if m.region == SPILL_REGION), None)
            if m is not None:
                r = pseudo[slot_at[m.lo]]
                ins = (dataclasses.replace(ins, dst=r) if m.write
                       else dataclasses.replace(ins, uses=(*ins.uses, r)))
            instrs.append(ins)
        copy = dataclasses.replace(blk, instrs=instrs)
        if blk.bundles is not None:
            order[blk.label] = [[instrs[k] for k in range(a, a + len(b))]
                                for a, b in zip(itertools.accumulate([0] + [len(b) for b in blk.bundles]),
                                                blk.bundles, strict=False)]
        else:
            order[blk.label] = [[i] for i in instrs]
        fake.blocks.append(copy)
    iv = live_intervals(fake, order)
    wanted = set(spills)
    occupied = {k: list(iv[r].segments) for k, r in pseudo.items() if r in iv}
    return occupied, {r: iv[r] for r in wanted if r in iv}


def insert_spills(func: Function, spills: list[Reg], next_id: int, spread: bool = False) -> int:
    """Rewrite `func` so every register in `spills` lives in a vmem spill slot, or, for a constant (one
    definition, by an instruction without register operands: `li`, `viota`), is defined again before each
    use instead. A value takes a slot no other value has used when there is one (a shared slot orders the
    two values' accesses in memory, which can hold the spill store back); else the first slot whose content
    is dead (after its last fill) wherever the value is live, in program order; with `spread`, of those the
    one whose last use is longest past (the driver's second try: a slot's memory order, a fill before the
    next value's store, ties the two values' accesses together, and first-fit reuse of slot 0 can hold them
    so far from their values that every round spills the reloads again). Slots in use are read off
    `func`'s spill instructions, so rounds need no bookkeeping. Returns the next free register id."""
    defs: dict[Reg, list[MInstr]] = {}
    for blk in func.blocks:
        for ins in blk.instrs:
            if ins.dst is not None:
                defs.setdefault(ins.dst, []).append(ins)
    remat = {r: d[0] for r in spills if len(d := defs.get(r, [])) == 1 and not d[0].uses and not d[0].mem
             and d[0].unit in (isa.Unit.SCALAR, isa.Unit.VECTOR)}
    to_slot = [r for r in spills if r not in remat]
    rows = spill_rows(func)
    occupied, intervals = _slot_occupancy(func, to_slot, rows)
    slot_of: dict[Reg, int] = {}
    for r in sorted(to_slot, key=lambda r: (intervals[r].start, intervals[r].end) if r in intervals else (0, 0)):
        segs = intervals[r].segments if r in intervals else []
        k = next((k for k in range(len(rows)) if not occupied.get(k)), None)
        if k is None:
            free = (k for k in range(len(rows)) if not _overlap(occupied[k], segs))
            if spread:
                start = segs[0][0] if segs else 0
                k = min(free, key=lambda k: _last_end_before(occupied[k], start), default=None)
            else:
                k = next(free, None)
        if k is None:
            raise CapacityError(f"register allocation: the vmem spill area is full ({len(rows)} slots)")
        slot_of[r] = rows[k]
        occupied.setdefault(k, []).extend(segs)
        occupied[k].sort()

    def fresh(kind: str) -> Reg:
        nonlocal next_id
        next_id += 1
        return Reg(kind, next_id)

    for blk in func.blocks:
        out: list[MInstr] = []
        for ins in blk.instrs:
            if ins.dst in remat:
                continue  # defined again at each use
            uses = list(ins.uses)
            for i, r in enumerate(uses):
                if r in remat:
                    uses[i] = fresh(r.kind)
                    out.append(dataclasses.replace(remat[r], dst=uses[i], comment="fill", reload=True))
                elif r in slot_of:
                    out.extend(_fill(r, slot_of[r], fresh, uses, i))
            ins.uses = tuple(uses)
            out.append(ins)
            if ins.dst in slot_of:
                r = ins.dst
                new = fresh(r.kind)
                ins.dst = new
                out.extend(_spill(new, slot_of[r], fresh))
        blk.instrs = out  # control instructions define nothing, so no spill store follows them
    return next_id


def _last_end_before(segs: list[tuple[int, int]], pos: int) -> int:
    """The end of the last of sorted `segs` that ends before `pos` (-1 when none)."""
    return max((b for _, b in segs if b < pos), default=-1)


def _overlap(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> bool:
    """Whether two sorted lists of inclusive segments intersect."""
    i = j = 0
    while i < len(a) and j < len(b):
        if a[i][1] < b[j][0]:
            i += 1
        elif b[j][1] < a[i][0]:
            j += 1
        else:
            return True
    return False


def _mem(row: int, write: bool) -> tuple[Mem, ...]:
    return (Mem(SPILL_REGION, row, row + 8, write),)


def _spill(r: Reg, slot: int, fresh) -> list[MInstr]:
    zero = Reg("s", 0, True)
    if r.kind == "v":
        return [MInstr("vst", None, (r, zero), imm=slot, mem=_mem(slot, True), comment="spill")]
    v = fresh("v")
    return [MInstr("vbcast", v, (r,), comment="spill"),
            MInstr("vst", None, (v, zero), imm=slot, mem=_mem(slot, True), comment="spill")]


def _fill(r: Reg, slot: int, fresh, uses: list[Reg], i: int) -> list[MInstr]:
    zero = Reg("s", 0, True)
    if r.kind == "v":
        new = fresh("v")
        uses[i] = new
        return [MInstr("vld", new, (zero,), imm=slot, mem=_mem(slot, False), comment="fill", reload=True)]
    v, new = fresh("v"), fresh("s")
    uses[i] = new
    return [MInstr("vld", v, (zero,), imm=slot, mem=_mem(slot, False), comment="fill", reload=True),
            MInstr("vext", new, (v,), imm=0, comment="fill", reload=True)]
