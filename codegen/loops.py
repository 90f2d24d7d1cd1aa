"""Loop passes on machine IR: hoisting loop-invariant constants out of single-block counted loops.

`hoist_invariants(func)`. Before: counted-loop blocks (`Block.loop`) whose bodies rematerialize constants
(`li`, `vbcast`, `viota`, and pure ops over them) every iteration, as instruction selection emits them.
After: the invariant instructions whose value the loop needs are moved to the end of the loop's preheader
(the block laid out before it, which falls through into it), at most `HOIST_VREGS` vector values per loop
(most used first: hoisted values stay live across the whole loop, so they cost registers for the body), and
their scalar operands with them. An instruction is invariant when it touches no memory, is not
asynchronous or control, its destination is defined nowhere else in the function, and every operand is
defined outside the loop or by another invariant instruction.
"""

from __future__ import annotations

from collections import Counter

from codegen.mir import Block, Function, MInstr, Reg

HOIST_VREGS = 12
HOIST_SREGS = 6
PURE_UNITS = ("scalar", "vector")


def _pure(ins: MInstr) -> bool:
    return ins.unit.value in PURE_UNITS and not ins.mem and ins.dst is not None and not ins.dst.phys


def _invariants(loop: Block, defs: Counter[Reg]) -> list[MInstr]:
    defined_here = {i.dst for i in loop.instrs if i.dst is not None}
    invariant: set[Reg] = set()
    out = []
    for ins in loop.instrs:  # program order: an operand's invariant definition comes first
        if not _pure(ins) or defs[ins.dst] != 1:
            continue
        if all(r not in defined_here or r in invariant for r in ins.uses):
            assert ins.dst is not None
            invariant.add(ins.dst)
            out.append(ins)
    return out


def _take(ins: MInstr, producer: dict[Reg | None, MInstr], chosen: set[int]) -> None:
    """Choose `ins` and, first, the invariant producers of its operands."""
    if id(ins) in chosen:
        return
    for r in ins.uses:
        if r in producer:
            _take(producer[r], producer, chosen)
    chosen.add(id(ins))


def _hoist_one(loop: Block, pre: Block, defs: Counter[Reg], max_vregs: int) -> int:
    candidates = _invariants(loop, defs)
    producer: dict[Reg | None, MInstr] = {i.dst: i for i in candidates}
    cand_ids = {id(i) for i in candidates}
    uses = Counter(r for i in loop.instrs if id(i) not in cand_ids for r in i.uses)
    vector = sorted((i for i in candidates if i.dst is not None and i.dst.kind == "v" and uses[i.dst]),
                    key=lambda i: -uses[i.dst])
    chosen: set[int] = set()
    for ins in vector[:max_vregs]:
        _take(ins, producer, chosen)
    # scalar constants read by vector instructions that stay in the loop (e.g. the li of a vbcast)
    staying = Counter(r for i in loop.instrs if id(i) not in chosen and i.dst is not None and i.dst.kind == "v"
                      for r in i.uses)
    budget_s = HOIST_SREGS
    for ins in candidates:
        if ins.dst is not None and ins.dst.kind == "s" and staying[ins.dst] and budget_s > 0:
            _take(ins, producer, chosen)
            budget_s -= 1
    hoisted = [i for i in loop.instrs if id(i) in chosen]
    loop.instrs = [i for i in loop.instrs if id(i) not in chosen]
    pre.instrs.extend(hoisted)
    loop.hoisted = hoisted
    return len(hoisted)


def hoist_invariants(func: Function, max_vregs: int = HOIST_VREGS) -> int:
    """Move invariant instructions of every counted loop to its preheader. Returns how many moved."""
    defs: Counter[Reg] = Counter(i.dst for b in func.blocks for i in b.instrs if i.dst is not None)
    moved = 0
    for idx, loop in enumerate(func.blocks):
        if loop.loop is None or idx == 0:
            continue
        pre = func.blocks[idx - 1]
        if pre.instrs and pre.instrs[-1].is_control:
            continue
        moved += _hoist_one(loop, pre, defs, max_vregs)
    return moved
