"""Verifiers run between back-end passes in tests.

`verify_schedule(block, bundles)`: slot legality (each unit within its slot count, per `device_sim.isa`)
and every dependence of `schedule.build_deps` (RAW latencies, WAR/WAW landing order, memory order, waits,
block-end drain) holds in the bundles. `verify_allocation`: with physical registers, no read sees a value
other than its producer's (no foreign write to the register lands between the producer's landing and the
read), within each block.

Loops (the wrap-around): `verify_pipelined(loop)` checks a software-pipelined loop as a trace of the whole
prologue / kernel x runs / epilogue against the body's sequential semantics (modulo.py); `verify_loop_block`
checks a list-scheduled loop block the same way over three back-to-back iterations, so a value produced
late in one iteration and read early in the next is caught.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, defaultdict
from dataclasses import dataclass

from codegen.mir import ZERO, MInstr, Reg
from codegen.modulo import MEMORY_BASE_OPS, PipelinedLoop, _ivs
from codegen.schedule import SLOT_COUNT, build_deps
from device_sim import isa


class ScheduleError(AssertionError):
    pass


def verify_schedule(instrs: list[MInstr], bundles: list[list[MInstr]]) -> None:
    time: dict[int, int] = {}
    for t, bundle in enumerate(bundles):
        units = Counter(i.unit for i in bundle)
        for unit, n in units.items():
            if n > SLOT_COUNT[unit]:
                raise ScheduleError(f"bundle {t}: {n} {unit.value} instructions, {SLOT_COUNT[unit]} slots")
        for ins in bundle:
            time[id(ins)] = t
    if len(time) != len(instrs):
        raise ScheduleError("the schedule lost or duplicated instructions")
    for d in build_deps(instrs):
        a, b = time[id(instrs[d.pred])], time[id(instrs[d.succ])]
        if b < a + d.distance:
            raise ScheduleError(f"{instrs[d.succ]} at {b} violates its dependence on {instrs[d.pred]} at {a} "
                                f"(distance {d.distance})")
    for ins in instrs:
        if ins.is_control and time[id(ins)] != len(bundles) - 1:
            raise ScheduleError(f"control instruction {ins} is not in the last bundle")
    if not (instrs and instrs[-1].is_control):
        for ins in instrs:
            if time[id(ins)] + ins.latency > len(bundles):
                raise ScheduleError(f"{ins} lands after the block ends")


def verify_allocation(instrs: list[MInstr], bundles: list[list[MInstr]], assignment: dict[Reg, Reg]) -> None:
    def phys(r: Reg) -> Reg:
        return r if r.phys else assignment[r]

    order = {id(i): n for n, i in enumerate(instrs)}
    writes: list[tuple[int, Reg, int]] = []  # (landing cycle, physical register, program index)
    when: dict[int, int] = {}
    for t, bundle in enumerate(bundles):
        for ins in bundle:
            when[id(ins)] = t
            if ins.dst is not None and ins.dst != Reg("s", 0, True):
                writes.append((t + ins.info.latency, phys(ins.dst), order[id(ins)]))
    for n, ins in enumerate(instrs):
        t = when[id(ins)]
        for r in ins.uses:
            producer = max((m for m in range(n) if instrs[m].dst == r), default=None)
            land = -1 if producer is None else when[id(instrs[producer])] + instrs[producer].info.latency
            for w_land, w_reg, w_idx in writes:
                if w_reg == phys(r) and land < w_land <= t and instrs[w_idx].dst != r:
                    raise ScheduleError(f"{ins}: {phys(r)} is overwritten by {instrs[w_idx]} before the read")


@dataclass
class _Event:
    ins: MInstr  # as emitted
    time: int
    op: int  # body index
    iteration: int


def verify_pipelined(loop: PipelinedLoop, assignment: dict[Reg, Reg] | None = None, max_runs: int | None = None
                     ) -> None:
    """The trace of a pipelined loop (kernel repeated `kernel_runs` times, or `max_runs`: the same code with
    fewer runs, whose steady state repeats every run) against sequential semantics; with `assignment`, on
    physical registers (so a read that sees a foreign write is caught too)."""
    if assignment is not None:
        def phys(x: _Event) -> _Event:
            def m(r: Reg) -> Reg:
                return r if r.phys else assignment[r]
            ins = dataclasses.replace(x.ins, dst=m(x.ins.dst) if x.ins.dst else None,
                                      uses=tuple(m(r) for r in x.ins.uses))
            return _Event(ins, x.time, x.op, x.iteration)
        loop = dataclasses.replace(loop, prologue=[phys(x) for x in loop.prologue],  # type: ignore[misc]
                                   kernel=[phys(x) for x in loop.kernel], epilogue=[phys(x) for x in loop.epilogue])
    s = loop.sched
    u, ii = s.unroll, s.ii
    pro_len = (s.stages - 1) * ii
    trace = [_Event(x.ins, x.time, x.op, x.iteration) for x in loop.prologue]
    slots: Counter[tuple[int, isa.Unit]] = Counter()
    runs = loop.kernel_runs if max_runs is None else min(loop.kernel_runs, max_runs)
    for j in range(runs):
        base = pro_len + j * u * ii
        trace += [_Event(x.ins, base + x.time, x.op, x.iteration + j * u) for x in loop.kernel]
        slots[(base + u * ii - 1, isa.Unit.SCALAR)] += 1  # the counter decrement and the branch
        slots[(base + u * ii - 1, isa.Unit.CTRL)] += 1
    epi_base = pro_len + runs * u * ii
    shift = (runs - loop.kernel_runs) * u  # the epilogue's iterations, renumbered for the shorter run
    trace += [_Event(x.ins, epi_base + x.time, x.op, x.iteration + shift) for x in loop.epilogue]
    iterations = s.stages - 1 + u * runs
    _check_trace(loop.label, loop.body, trace, iterations, epi_base + loop.epilogue_len, slots)


def verify_loop_block(label: str, instrs: list[MInstr], bundles: list[list[MInstr]], iterations: int = 3) -> None:
    """A list-scheduled single-block loop run `iterations` times back to back (the wrap-around)."""
    when = {id(i): t for t, b in enumerate(bundles) for i in b}
    body = [i for i in instrs if not i.is_control]
    period = len(bundles)
    trace = [_Event(ins, it * period + when[id(ins)], k, it) for it in range(iterations)
             for k, ins in enumerate(body)]
    controls: Counter[tuple[int, isa.Unit]] = Counter()
    for it in range(iterations):
        for ins in instrs:
            if ins.is_control:
                controls[(it * period + when[id(ins)], ins.unit)] += 1
    _check_trace(label, body, trace, iterations, iterations * period, controls)


def _check_trace(label: str, body: list[MInstr], trace: list[_Event], iterations: int, end: int,
                 extra_slots: Counter[tuple[int, isa.Unit]]) -> None:
    where = f"loop {label}"
    seen = Counter((e.op, e.iteration) for e in trace)
    if set(seen) != {(k, i) for k in range(len(body)) for i in range(iterations)} or max(seen.values()) != 1:
        raise ScheduleError(f"{where}: the trace does not run every body instruction once per iteration")
    slots = Counter((e.time, e.ins.unit) for e in trace) + extra_slots
    for (t, unit), n in slots.items():
        if n > SLOT_COUNT[unit]:
            raise ScheduleError(f"{where}: cycle {t} issues {n} {unit.value} instructions")
    ivs = _ivs(body)
    landings: dict[Reg, list[tuple[int, int, int]]] = defaultdict(list)  # emitted reg -> (landing, iter, op)
    for e in trace:
        if e.ins.dst is not None and e.ins.dst != ZERO:
            land = e.time + e.ins.latency
            if land > end:
                raise ScheduleError(f"{where}: {e.ins} (iteration {e.iteration}) lands after the loop ends")
            landings[e.ins.dst].append((land, e.iteration, e.op))
    for reg, ls in landings.items():
        ls.sort()
        for a, b in itertools.pairwise(ls):
            if a[0] == b[0]:
                raise ScheduleError(f"{where}: two results land in {reg} at cycle {a[0]}")
    defs_of: dict[Reg, list[int]] = defaultdict(list)
    for k, ins in enumerate(body):
        if ins.dst is not None:
            defs_of[ins.dst].append(k)

    def expected(reg: Reg, op: int, iteration: int) -> tuple[int, int] | None:
        ks = defs_of.get(reg, [])
        before = [k for k in ks if k < op]
        if before:
            return iteration, max(before)
        return (iteration - 1, max(ks)) if ks and iteration > 0 else None

    def observed(reg: Reg, time: int) -> tuple[int, int] | None:
        got = [(it, op) for land, it, op in landings.get(reg, []) if land <= time]
        return got[-1] if got else None

    def iv_count(reg: Reg, time: int) -> int:
        return sum(1 for land, _, _ in landings.get(reg, []) if land <= time)

    rows: list[tuple[_Event, str, int | None, int]] = []  # memory events: region, relative row or None, rows
    for e in trace:
        orig = body[e.op]
        for q, (r_orig, r_emit) in enumerate(zip(orig.uses, e.ins.uses, strict=True)):
            if r_orig.phys:
                continue
            if orig.op in MEMORY_BASE_OPS and q == len(orig.uses) - 1 and r_orig in ivs:
                a_index, step = ivs[r_orig]
                want = step * (e.iteration + (1 if a_index < e.op else 0)) + int(orig.imm or 0)
                got = step * iv_count(r_emit, e.time) + int(e.ins.imm or 0)
                if want != got:
                    raise ScheduleError(f"{where}: {e.ins} (iteration {e.iteration}) addresses row {got}, "
                                        f"not {want}")
                continue
            exp, obs = expected(r_orig, e.op, e.iteration), observed(r_emit, e.time)
            if exp != obs:
                raise ScheduleError(f"{where}: {e.ins} (iteration {e.iteration}) reads {r_emit} from "
                                    f"{obs} (iteration, op), expected {exp}")
        if orig.op in MEMORY_BASE_OPS and orig.mem:
            base = orig.uses[-1]
            if base == ZERO:
                rel = int(orig.imm or 0)
            elif base in ivs:
                a_index, step = ivs[base]
                rel = step * (e.iteration + (1 if a_index < e.op else 0)) + int(orig.imm or 0)
            else:
                rel = None
            rows.append((e, orig.mem[0].region, rel, 1 if orig.op == "vld.row" else 8))
    renamed = {body[e.op].dst for e in trace if e.ins.dst != body[e.op].dst}
    for reg, ks in defs_of.items():  # final values: the sequentially last definition lands last
        if reg not in renamed and observed(reg, end) != (iterations - 1, max(ks)):
            raise ScheduleError(f"{where}: {reg} ends the loop holding {observed(reg, end)}, "
                                f"not {(iterations - 1, max(ks))}")
    by_region: dict[str, list[tuple[_Event, Reg, int | None, int]]] = defaultdict(list)
    for e, region, rel, n in rows:
        by_region[region].append((e, body[e.op].uses[-1], rel, n))
    for accesses in by_region.values():
        accesses.sort(key=lambda a: (a[0].iteration, a[0].op))
        for i, (a, base_a, ra, na) in enumerate(accesses):
            for b, base_b, rb, nb in accesses[i + 1:]:
                if b.iteration > a.iteration + 64:
                    break
                wa, wb = body[a.op].op == "vst", body[b.op].op == "vst"
                if not (wa or wb):
                    continue
                exact = base_a == base_b and ra is not None and rb is not None
                if exact and (ra + na <= rb or rb + nb <= ra):
                    continue
                need = a.time + 1 if wa and not wb else a.time + (1 if wa and wb else 0)
                if b.time < need:
                    raise ScheduleError(f"{where}: {b.ins} (iteration {b.iteration}) at {b.time} overtakes "
                                        f"{a.ins} (iteration {a.iteration}) at {a.time}")


__all__ = ["ScheduleError", "isa", "verify_allocation", "verify_loop_block", "verify_pipelined",
           "verify_schedule"]
