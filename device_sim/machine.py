"""The CTPU's architectural state: registers, vmem, HBM, the pending-write ring, and how it traps.

The bottom of the simulator: `semantics.py` (one function per opcode) and `async_units.py` (DMA, MXU)
act on a `Machine`; `simulator.py` decodes bundles and drives the clock. This module imports no other
simulator module but the units it holds.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from device_sim import isa
from device_sim.async_units import Dma, Mxu, Ownership
from device_sim.config import HardwareConfig
from device_sim.program import Program

RING = 8  # > the longest latency: pending writes are kept per landing cycle modulo this
assert RING > max(i.latency for i in isa.INSTRUCTIONS)


class CtpuTrap(RuntimeError):
    """The machine stopped on an error; names the bundle address, the cycle and the instruction."""

    def __init__(self, message: str, pc: int, cycle: int, where: str = "", instruction: str = "",
                 index_range: bool = False) -> None:
        loc = f"bundle {pc}" + (f" ({where})" if where else "")
        text = f"trap at {loc}, cycle {cycle}: " + (f"{instruction}: " if instruction else "") + message
        super().__init__(text)
        self.pc, self.cycle, self.reason = pc, cycle, message
        # a DMA to the poison address: the program's own index check failed (the input's values, not the
        # program, are at fault: the launch raises InputRangeError, and the caller may run the op elsewhere)
        self.index_range = index_range


class Operands:
    """A decoded slot: field values as attributes, plus the instruction's mnemonic and latency."""

    __slots__ = ("a", "b", "c", "d", "flag", "imm", "ins", "lat", "mnemonic", "slot")

    def __init__(self, ins: isa.Instr, values: dict[str, int], slot: isa.Slot) -> None:
        self.d = self.a = self.b = self.c = self.flag = self.imm = 0
        for k, v in values.items():
            setattr(self, k, v)
        self.lat, self.mnemonic, self.ins, self.slot = ins.latency, ins.mnemonic, ins, slot


class Machine:
    """Architectural state and the operations the semantics functions use."""

    def __init__(self, config: HardwareConfig, hbm: np.ndarray | None = None) -> None:
        self.config = config
        n, s = config.lanes, config.sublanes
        assert n & (n - 1) == 0, "lanes must be a power of two (tree reductions)"
        self.sublanes = s
        self.vreg_shape = (s, n)
        self.s = [0] * isa.NUM_SREGS
        self.vu = np.zeros((isa.NUM_VREGS, s, n), np.uint32)
        self.vf, self.vi = self.vu.view(np.float32), self.vu.view(np.int32)
        self.vmem = np.zeros((config.vmem_rows, n), np.uint32)
        self.hbm = np.zeros(config.hbm_bytes, np.uint8) if hbm is None else hbm
        lane = np.broadcast_to(np.arange(n, dtype=np.uint32), (s, n))
        sub = np.broadcast_to(np.arange(s, dtype=np.uint32)[:, None], (s, n))
        self.iota = (lane, sub, sub * np.uint32(n) + lane)
        self.mxu = Mxu(n, config.mxu_queue, config.mxu_weight_cycles)
        self.dma = Dma(n, config.hbm_bytes_per_cycle, config.dma_latency, config.dma_queue, config.vmem_port_rows)
        self.owners = Ownership()
        self.flag_done = [0] * isa.NUM_FLAGS
        self.pending: list[list[tuple[int, int, Any]]] = [[] for _ in range(RING)]  # (kind, index, value)
        self.last_land = 0
        self.pc = 0
        self.cycle = 0
        self.current: Operands | None = None
        self.program: Program | None = None
        self.trace: list[tuple[Any, ...]] | None = None

    # -- errors --------------------------------------------------------------------------------------
    def trap(self, message: str, index_range: bool = False) -> None:
        instruction = ""
        if self.current is not None:
            from device_sim.asm import format_instruction  # printing belongs to the assembler

            values = {f.name: getattr(self.current, f.name) for f in self.current.ins.fmt.fields}
            instruction = format_instruction(self.current.ins, values)
        where = self.program.where(self.pc) if self.program else ""
        raise CtpuTrap(message, self.pc, self.cycle, where, instruction, index_range)

    # -- registers -----------------------------------------------------------------------------------
    def write_s(self, reg: int, value: int, land: int) -> None:
        self._queue(0, reg, value, land)

    def write_v(self, reg: int, value: np.ndarray, land: int) -> None:
        self._queue(1, reg, value, land)

    def vmem_store(self, row: int, value: np.ndarray, land: int) -> None:
        self.vmem_span(row, value.shape[0], "vst")
        self.owners.check(self, row, row + value.shape[0], True, "vst", "vst")
        self._queue(2, row, value, land)

    def _queue(self, kind: int, index: int, value: Any, land: int) -> None:
        slot = self.pending[land % RING]
        if kind < 2:
            for k, i, _ in slot:  # the bundle whose result would collide traps, as the RTL does
                if k == kind and i == index:
                    self.trap(f"two results would land in {'sv'[kind]}{index} in cycle {land}")
        slot.append((kind, index, value))
        if land > self.last_land:
            self.last_land = land

    def land_until(self, t: int) -> None:
        """Apply every pending write that lands at a cycle <= t (cycles after self.cycle)."""
        for c in range(self.cycle + 1 if self.cycle else 0, min(t, self.cycle + RING) + 1):
            writes = self.pending[c % RING]
            if not writes:
                continue
            self.pending[c % RING] = []
            for kind, index, value in writes:
                if kind < 2:
                    if kind == 0:
                        if index:
                            self.s[index] = value
                    else:
                        self.vu[index] = value
                    if self.trace is not None and (kind or index):
                        self.trace.append(("w", c, f"{'sv'[kind]}{index}",
                                           value if kind == 0 else value.tobytes()))
                else:
                    self.vmem[index : index + value.shape[0]] = value

    # -- vmem ----------------------------------------------------------------------------------------
    def vmem_span(self, row: int, rows: int, what: str) -> np.ndarray:
        row = row - (1 << 32) if row & 0x80000000 else row
        if row < 0 or row + rows > self.config.vmem_rows:
            self.trap(f"{what}: vmem rows [{row}, {row + rows}) out of bounds (vmem has {self.config.vmem_rows} rows)")
        return self.vmem[row : row + rows]

    def vmem_read(self, row: int, rows: int) -> np.ndarray:
        data = self.vmem_span(row, rows, "vld")
        self.owners.check(self, row, row + rows, False, "vld", "vld")
        return data.copy()

    # -- flags ---------------------------------------------------------------------------------------
    def complete_on(self, flag: int, done: int) -> None:
        if done > self.flag_done[flag]:
            self.flag_done[flag] = done
