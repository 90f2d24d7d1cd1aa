"""Verifiers run between back-end passes in tests.

`verify_schedule(block, bundles)`: slot legality (each unit within its slot count, per `device_sim.isa`)
and every dependence of `schedule.build_deps` (RAW latencies, WAR/WAW landing order, memory order, waits,
block-end drain) holds in the bundles. `verify_allocation`: with physical registers, no read sees a value
other than its producer's (no foreign write to the register lands between the producer's landing and the
read), within each block.
"""

from __future__ import annotations

from collections import Counter

from codegen.mir import MInstr, Reg
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


__all__ = ["ScheduleError", "isa", "verify_allocation", "verify_schedule"]
