"""Runners: what runs a CTPU program over an HBM image. One interface, two machines.

    stats = runner.run(program, hbm, args={1: arena}, max_cycles=None)   # hbm: uint8, read and written in place

`SimulatorRunner` is the cycle-exact simulator (it may own the HBM array: the runtime's device memory IS
its `hbm`); `RtlRunner` (device_sim/rtl/runner.py) runs the SystemVerilog core under Verilator and copies
the final HBM back. A trap raises `CtpuTrap` on both.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from device_sim.config import HardwareConfig, get_config
from device_sim.program import Program
from device_sim.simulator import DEFAULT_MAX_CYCLES, RunStats, Simulator


class Runner(Protocol):
    name: str
    config: HardwareConfig

    def run(self, program: Program, hbm: np.ndarray, args: dict[int, int],
            max_cycles: int | None = None) -> RunStats: ...


class SimulatorRunner:
    """The simulator as a runner. `hbm` given to `run` becomes the simulator's HBM (no copy when it is the
    array the simulator already holds)."""

    name = "sim"

    def __init__(self, config: str | HardwareConfig = "small", max_cycles: int = DEFAULT_MAX_CYCLES,
                 trace: bool = False) -> None:
        self.config = get_config(config)
        self.simulator = Simulator(self.config, max_cycles=max_cycles, trace=trace)

    @property
    def hbm(self) -> np.ndarray:
        return self.simulator.hbm

    def run(self, program: Program, hbm: np.ndarray, args: dict[int, int],
            max_cycles: int | None = None) -> RunStats:
        sim = self.simulator
        if hbm is not sim.m.hbm:
            if hbm.shape != sim.m.hbm.shape:
                raise ValueError(f"HBM image of {hbm.size} bytes; {self.config.name} has {self.config.hbm_bytes}")
            sim.m.hbm = hbm
        default = sim.max_cycles
        sim.max_cycles = max_cycles or default
        try:
            sim.load(program)
            return sim.run(args=args)
        finally:
            sim.max_cycles = default
