"""RTL-vs-simulator differential checking: run a job on both, compare, and locate the first difference.

    jobs = [RtlJob(program, hbm_image, args={1: 0x100}, trace=True), ...]
    reports = diff_batch(jobs)            # one Verilator process for all jobs
    [r.summary() for r in reports if not r.ok]

A report compares the trap (kind, pc and cycle, by `traps.classify`), every RunStats counter, the final
sregs, vregs, vmem and HBM. With `trace=True` jobs both models record the per-bundle trace ((cycle, pc) per
issued bundle, ("w", cycle, reg, value) per register write as it lands), which must be identical too; the
first differing trace event names the cycle, the bundle and the register where the two diverged; vmem and
HBM differences name the first differing row/lane and byte address. The fuzzer's failure text says how to
dump an FST waveform of the failing program (device_sim/rtl/fuzz.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_sim import isa
from device_sim.program import Program
from device_sim.rtl.runner import RtlJob, RtlResult, run_batch_on_rtl
from device_sim.rtl.traps import TrapKind, classify
from device_sim.simulator import CtpuTrap, RunStats, Simulator

STAT_KEYS = ("cycles", "bundles", "stall_cycles", "slot_ops", "mxu_busy_cycles", "mxu_weight_loads", "macs",
             "dma_commands", "dma_bytes_loaded", "dma_bytes_stored")


@dataclass
class SimRun:
    sim: Simulator
    stats: RunStats | None
    trap: TrapKind | None


def simulate(job: RtlJob, config: str = "small") -> SimRun:
    """The golden model's run of a job (trace on when the job asks for it)."""
    sim = Simulator(config, max_cycles=job.max_cycles, trace=job.trace)
    if isinstance(job.hbm, np.ndarray):
        data = np.ascontiguousarray(job.hbm).view(np.uint8).reshape(-1)
        sim.m.hbm[: data.size] = data
    else:
        for addr, data in job.hbm.items():
            sim.write_hbm(addr, np.frombuffer(bytes(data), np.uint8))
    try:
        sim.load(job.program)
        return SimRun(sim, sim.run(args=job.args), None)
    except CtpuTrap as e:
        return SimRun(sim, None, classify(e))


def _events(trace: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """Trace events in a canonical order: by cycle, issues before writes, writes by register."""
    out = []
    for e in trace:
        if e[0] == "w":
            _, cycle, reg, value = e
            out.append((cycle, 1, reg, value))
        else:
            out.append((e[0], 0, "", e[1]))
    return sorted(out, key=lambda e: (e[0], e[1], e[2]))


def _last_issue(events: list[tuple[Any, ...]], cycle: int) -> str:
    pcs = [e for e in events if e[1] == 0 and e[0] <= cycle]
    return f"last bundle issued: {pcs[-1][3]} at cycle {pcs[-1][0]}" if pcs else "no bundle issued yet"


def _show(e: tuple[Any, ...] | None) -> str:
    if e is None:
        return "nothing (trace ended)"
    cycle, kind, reg, value = e
    if kind == 0:
        return f"bundle {value} issues at cycle {cycle}"
    if isinstance(value, bytes):
        words = np.frombuffer(value, "<u4")
        return f"{reg} <- [{', '.join(f'{w:#x}' for w in words[:4])}, ...] at cycle {cycle}"
    return f"{reg} <- {value:#x} at cycle {cycle}"


def _producer(events: list[tuple[Any, ...]], program: Program, cycle: int, reg: str) -> str:
    """The bundle whose result lands in `reg` at `cycle`: issued at cycle - latency, writing reg."""
    issued = {e[0]: e[3] for e in events if e[1] == 0}
    for pc in (issued.get(cycle - lat) for lat in sorted({i.latency for i in isa.INSTRUCTIONS if i.writes})):
        if pc is None or pc >= len(program):
            continue
        for slot, word in zip(isa.SLOTS, program.bundles[pc], strict=True):
            ins, values = isa.decode_slot(word, slot)
            if ins.writes and issued.get(cycle - ins.latency) == pc and \
                    f"{ins.dest_kind.value[0]}{values[ins.writes]}" == reg:
                return f"written by bundle {pc} ({ins.mnemonic} in slot {slot.name}, issued at cycle " \
                       f"{cycle - ins.latency})"
    return "producer not found"


def first_trace_difference(sim_trace: list[tuple[Any, ...]], rtl_trace: list[tuple[Any, ...]],
                           program: Program | None = None) -> str | None:
    """Where the per-bundle traces first disagree: cycle, bundle (pc) and register; None if identical."""
    a, b = _events(sim_trace), _events(rtl_trace)
    for i in range(max(len(a), len(b))):
        ea = a[i] if i < len(a) else None
        eb = b[i] if i < len(b) else None
        if ea != eb:
            cycle = min(e[0] for e in (ea, eb) if e is not None)
            where = _last_issue(a, cycle)
            if ea is not None and eb is not None and ea[1] == eb[1] == 1 and ea[:3] == eb[:3] and \
                    isinstance(ea[3], bytes):
                wa, wb = np.frombuffer(ea[3], "<u4"), np.frombuffer(eb[3], "<u4")
                lane = int(np.argmax(wa != wb))
                detail = f"; {ea[2]} element {lane}: sim {wa[lane]:#010x} rtl {wb[lane]:#010x}"
            else:
                detail = ""
            write = next((e for e in (ea, eb) if e is not None and e[1] == 1), None)
            if write is not None and program is not None:
                where = _producer(a, program, write[0], write[2])
            return (f"first trace difference at cycle {cycle}, {where}: "
                    f"sim {_show(ea)}, rtl {_show(eb)}{detail}")
    return None


def _first_array_difference(name: str, a: np.ndarray, b: np.ndarray) -> str:
    idx = tuple(int(i) for i in np.argwhere(a != b)[0])
    count = int((a != b).sum())
    if name == "hbm":
        label = f"HBM byte {idx[0]:#x}"
    elif name == "vmem":
        label = f"vmem row {idx[0]} lane {idx[1]}"
    elif name == "sregs":
        label = f"s{idx[0]}"
    else:
        label = f"v{idx[0]} sublane {idx[1]} lane {idx[2]}"
    return f"{label}: sim {a[idx]:#x} rtl {b[idx]:#x} ({count} differing elements in {name})"


@dataclass
class DiffReport:
    name: str
    errors: list[str] = field(default_factory=list)
    sim_trap: TrapKind | None = None
    rtl_trap: TrapKind | None = None
    cycles: int = 0

    @property
    def ok(self) -> bool:
        return not self.errors

    def summary(self) -> str:
        return f"{self.name}: " + "; ".join(self.errors)


def compare(name: str, run: SimRun, rtl: RtlResult, program: Program | None = None) -> DiffReport:
    """Every difference between the simulator's run and the RTL's, first differing location first."""
    rep = DiffReport(name, sim_trap=run.trap)
    rtl_trap = TrapKind(rtl.trap.code, rtl.trap.pc, rtl.trap.cycle) if rtl.trap is not None else None
    rep.rtl_trap = rtl_trap
    if run.trap is not None or rtl_trap is not None:
        # kind, pc and cycle must agree; the state after a trap is not specified (the RTL may have moved
        # more DMA rows by then)
        if run.trap != rtl_trap:
            rep.errors.append(f"trap: sim {run.trap or 'none'}, rtl {rtl_trap or 'none'}")
    else:
        assert run.stats is not None
        rep.cycles = run.stats.cycles
        s, r = run.stats.as_dict(), rtl.stats.as_dict()
        for key in STAT_KEYS:
            if s[key] != r[key]:
                rep.errors.append(f"stats.{key}: sim {s[key]} rtl {r[key]}")
        for arr in ("sregs", "vregs", "vmem", "hbm"):
            a, b = getattr(run.sim, arr), getattr(rtl, arr)
            if not np.array_equal(a, b):
                rep.errors.append(_first_array_difference(arr, a, b))
    if run.sim.trace is not None and rtl.trace is not None:
        # every issue and register write, cycle by cycle (before a trap: up to its cycle)
        end = run.trap.cycle if run.trap is not None else None
        where = first_trace_difference(_until(run.sim.trace, end), _until(rtl.trace, end), program)
        if where:
            rep.errors.insert(0, where)
    return rep


def _until(trace: list[tuple[Any, ...]], end: int | None) -> list[tuple[Any, ...]]:
    if end is None:
        return trace
    return [e for e in trace if (e[1] if e[0] == "w" else e[0]) < end]


def diff_batch(jobs: list[RtlJob], names: list[str] | None = None, config: str = "small") -> list[DiffReport]:
    """Run every job on the RTL (one process) and on the simulator; one report per job."""
    names = names or [f"job {i}" for i in range(len(jobs))]
    results = run_batch_on_rtl(jobs, config)
    return [compare(n, simulate(j, config), r, j.program) for n, j, r in zip(names, jobs, results, strict=True)]
