"""The CTPU functional and cycle-exact simulator: the executable specification of docs/architecture.md.

`Simulator.run()` issues one bundle per cycle plus documented stalls (wait, full DMA/MXU FIFOs). Results
land at issue + latency through a small ring of pending writes, so reading a register early returns its
old value exactly as the exposed pipeline does. Vector and matrix work runs as numpy operations on whole
registers and tiles; instructions are decoded at load into (function, operands) pairs, each distinct
bundle once per process (a program reloaded per launch or per token decodes from the cache).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_sim import isa
from device_sim.config import HardwareConfig, get_config
from device_sim.machine import CtpuTrap, Machine, Operands
from device_sim.profile import Recording
from device_sim.program import Program
from device_sim.semantics import SEMANTICS, Semantics

__all__ = ["DEFAULT_MAX_CYCLES", "CtpuTrap", "RunStats", "Simulator"]
DEFAULT_MAX_CYCLES = 10**8


@dataclass(frozen=True)
class DecodedBundle:
    """One bundle's slots decoded; shared by every bundle of the same words (`_decode_words` caches it)."""

    ops: tuple[tuple[Semantics, Operands], ...]  # execution order: async units first (they claim vmem rows)
    wait_flag: int | None
    issues_dma: bool
    issues_mxu: bool
    halts: bool
    slot_mask: tuple[bool, ...]
    branch_target: int | None  # the immediate of a bz / bnz / jmp, checked against each program's length


@functools.lru_cache(maxsize=1 << 16)
def _decode_words(words: tuple[int, ...]) -> DecodedBundle:
    """Decoding is pure in the words: a program reloaded (each launch, each generated token) and the many
    identical bundles of one program decode once. Raises isa.EncodingError."""
    ops, wait, dma, mxu, halts, mask, target = [], None, False, False, False, [], None
    for slot, word in zip(isa.SLOTS, words, strict=False):
        ins, values = isa.decode_slot(word, slot)
        mask.append(ins is not isa.NOP)
        if ins is isa.NOP:
            continue
        op = Operands(ins, values, slot)
        if ins.mnemonic == "wait":
            wait = op.flag
        halts |= ins.mnemonic == "halt"
        dma |= ins.unit is isa.Unit.DMA
        mxu |= ins.unit is isa.Unit.MXU
        if ins.mnemonic in ("bnz", "bz", "jmp"):
            target = op.imm
        ops.append((SEMANTICS[ins.mnemonic], op))
    ops.sort(key=lambda fo: fo[1].ins.unit not in (isa.Unit.MXU, isa.Unit.DMA))
    return DecodedBundle(tuple(ops), wait, dma, mxu, halts, tuple(mask), target)


@dataclass
class RunStats:
    config: str
    bundles: int = 0
    cycles: int = 0
    stall_cycles: dict[str, int] = field(default_factory=lambda: {"wait": 0, "dma_queue": 0, "mxu_queue": 0})
    slot_ops: dict[str, int] = field(default_factory=lambda: {s.name: 0 for s in isa.SLOTS})
    mxu_busy_cycles: int = 0
    mxu_weight_loads: int = 0
    macs: int = 0
    dma_commands: int = 0
    dma_bytes_loaded: int = 0
    dma_bytes_stored: int = 0
    wall_seconds: float = 0.0
    hbm_written: list[tuple[int, int]] = field(default_factory=list)  # merged [lo, hi) byte ranges DMA stored to

    def written_within(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """The parts of HBM bytes [lo, hi) the run stored to (what a host copy of them must read back)."""
        return [(max(a, lo), min(b, hi)) for a, b in self.hbm_written if a < hi and b > lo]

    @property
    def mxu_utilization(self) -> float:
        return self.mxu_busy_cycles / self.cycles if self.cycles else 0.0

    @property
    def ops_per_bundle(self) -> float:
        return sum(self.slot_ops.values()) / self.bundles if self.bundles else 0.0

    @property
    def bundles_per_second(self) -> float:
        return self.bundles / self.wall_seconds if self.wall_seconds else 0.0

    def as_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items() if k != "hbm_written"}
        d["slot_occupancy"] = {k: (v / self.bundles if self.bundles else 0.0) for k, v in self.slot_ops.items()}
        d["mxu_utilization"] = self.mxu_utilization
        d["ops_per_bundle"] = self.ops_per_bundle
        d["bundles_per_second"] = self.bundles_per_second
        return d


def merge_ranges(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted, disjoint [lo, hi) ranges covering `ranges` (touching ones merged)."""
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return out


class Simulator:
    """Loads a Program, holds HBM, runs to halt and reports RunStats. See docs/simulator_api.md."""

    def __init__(self, config: str | HardwareConfig = "small", max_cycles: int = DEFAULT_MAX_CYCLES,
                 trace: bool = False, profile: bool = False) -> None:
        self.config = get_config(config)
        self.max_cycles = max_cycles
        self.m = Machine(self.config)
        if trace:
            self.m.trace = []
        self.decoded: list[DecodedBundle] = []
        self.profile = profile  # record what each unit did (device_sim.profile); off costs one test a bundle
        self.recording: Recording | None = None  # the last profiled run's

    # state, as the API promises
    @property
    def sregs(self) -> np.ndarray:
        return np.array(self.m.s, dtype=np.uint32)

    @property
    def vregs(self) -> np.ndarray:
        return self.m.vu

    @property
    def vmem(self) -> np.ndarray:
        return self.m.vmem

    @property
    def hbm(self) -> np.ndarray:
        return self.m.hbm

    @property
    def trace(self) -> list[tuple[Any, ...]] | None:
        return self.m.trace

    def write_hbm(self, addr: int, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).view(np.uint8).reshape(-1)
        if addr < 0 or addr + data.size > self.config.hbm_bytes:
            raise ValueError(f"HBM write [{addr:#x}, {addr + data.size:#x}) out of bounds "
                             f"(HBM has {self.config.hbm_bytes:#x} bytes)")
        self.m.hbm[addr : addr + data.size] = data

    def read_hbm(self, addr: int, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        if addr < 0 or addr + nbytes > self.config.hbm_bytes:
            raise ValueError(f"HBM read [{addr:#x}, {addr + nbytes:#x}) out of bounds")
        return self.m.hbm[addr : addr + nbytes].view(dtype).reshape(shape).copy()

    def load(self, program: Program) -> None:
        if len(program) > self.config.imem_bundles:
            raise CtpuTrap(f"program has {len(program)} bundles; imem holds {self.config.imem_bundles}", 0, 0,
                           program.source_name)
        # a fresh core each load; HBM (the device memory) persists across programs
        hbm, trace = self.m.hbm, self.m.trace
        self.m = Machine(self.config, hbm)
        self.m.trace = [] if trace is not None else None
        self.m.program = program
        self.decoded = [self._decode(program, pc, b) for pc, b in enumerate(program.bundles)]

    def _decode(self, program: Program, pc: int, words: tuple[int, ...]) -> DecodedBundle:
        try:
            decoded = _decode_words(tuple(words))
        except isa.EncodingError as e:
            raise CtpuTrap(f"illegal encoding: {e}", pc, 0, program.where(pc)) from None
        target = decoded.branch_target
        if target is not None and not 0 <= target < len(program):
            raise CtpuTrap(f"branch target {target} outside the program (0..{len(program) - 1})", pc, 0,
                           program.where(pc))
        return decoded

    def run(self, args: dict[int, int] | None = None) -> RunStats:
        """Run the loaded program to halt. `args` presets scalar registers (the launch ABI: s1.. hold
        kernel arguments such as HBM addresses); everything else starts at zero."""
        if not self.decoded:
            raise CtpuTrap("no program loaded (or an empty one): nothing to run", 0, 0)
        m, decoded, n_bundles = self.m, self.decoded, len(self.decoded)
        for reg, value in (args or {}).items():
            if not 1 <= reg < isa.NUM_SREGS:
                raise ValueError(f"launch argument register s{reg}: must be s1..s{isa.NUM_SREGS - 1}")
            m.s[reg] = value & 0xFFFFFFFF
        stats = RunStats(self.config.name)
        stalls = stats.stall_cycles
        slot_counts = [0] * isa.NUM_SLOTS
        trace = m.trace
        rec = Recording(self.config, m.program, [b.slot_mask for b in decoded]) if self.profile else None
        m.dma.rec = m.mxu.rec = rec
        self.recording = None
        started = time.perf_counter()
        pc, c, bundles = 0, 0, 0
        m.pc, m.cycle = 0, 0
        with np.errstate(all="ignore"):
            while True:
                if pc >= n_bundles:
                    m.pc, m.cycle, m.current = pc, c, None
                    m.trap(f"pc ran past the end of the program ({n_bundles} bundles) without halt")
                b = decoded[pc]
                t = c
                if b.wait_flag is not None and m.flag_done[b.wait_flag] > t:
                    stalls["wait"] += m.flag_done[b.wait_flag] - t
                    if rec is not None:
                        rec.stall("wait", t, m.flag_done[b.wait_flag], pc, b.wait_flag)
                    t = m.flag_done[b.wait_flag]
                if b.issues_dma:
                    t2 = m.dma.fifo.ready(t)
                    stalls["dma_queue"] += t2 - t
                    if rec is not None and t2 > t:
                        rec.stall("dma_queue", t, t2, pc)
                    t = t2
                if b.issues_mxu:
                    t2 = m.mxu.fifo.ready(t)
                    stalls["mxu_queue"] += t2 - t
                    if rec is not None and t2 > t:
                        rec.stall("mxu_queue", t, t2, pc)
                    t = t2
                if t > self.max_cycles:
                    m.pc, m.cycle, m.current = pc, t, None
                    m.trap(f"cycle limit {self.max_cycles} exceeded (runaway program?)")
                m.land_until(t)
                m.cycle, m.pc = t, pc
                m.owners.expire(t)
                if trace is not None:
                    trace.append((t, pc))
                if rec is not None:
                    rec.issue(t, pc)
                next_pc = pc + 1
                for fn, op in b.ops:
                    m.current = op
                    target = fn(m, op, t)
                    if target is not None:
                        next_pc = target
                m.current = None
                bundles += 1
                for i, used in enumerate(b.slot_mask):
                    slot_counts[i] += used
                if b.halts:
                    break
                pc, c = next_pc, t + 1
            end = max(t + 1, m.last_land, max(m.flag_done), m.owners.last_done())
            m.land_until(end)
            m.cycle = end
        stats.wall_seconds = time.perf_counter() - started
        stats.bundles, stats.cycles = bundles, end
        stats.slot_ops = {s.name: slot_counts[s.index] for s in isa.SLOTS}
        stats.mxu_busy_cycles, stats.mxu_weight_loads, stats.macs = m.mxu.busy_cycles, m.mxu.weight_loads, m.mxu.macs
        stats.dma_commands = m.dma.commands
        stats.dma_bytes_loaded, stats.dma_bytes_stored = m.dma.bytes_loaded, m.dma.bytes_stored
        stats.hbm_written = merge_ranges(m.dma.stored)
        if rec is not None:
            rec.end = end
            self.recording = rec
        return stats
