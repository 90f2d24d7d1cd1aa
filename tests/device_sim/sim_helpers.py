"""Helpers for device_sim tests: run assembly text on the simulator with HBM contents."""

from __future__ import annotations

import numpy as np

from device_sim.asm import assemble
from device_sim.simulator import RunStats, Simulator


def run_asm(text: str, hbm: dict[int, np.ndarray] | None = None, config: str = "small",
            max_cycles: int = 10**7, trace: bool = False) -> tuple[Simulator, RunStats]:
    sim = Simulator(config, max_cycles=max_cycles, trace=trace)
    for addr, arr in (hbm or {}).items():
        sim.write_hbm(addr, arr)
    sim.load(assemble(text, "test.s"))
    return sim, sim.run()


# A program copying 8 f32 from HBM 0x0 to HBM 0x100 (for manifests: input at 0, output at 0x100).
COPY = """
    li s1, 8 ; li s2, 8
    lih s1, 1 ; li s3, 0x100
    dma.ld s0, s0, s1, s2, f0
    wait f0
    dma.st s3, s0, s1, s2, f1
    halt
"""


# A program template applying one vector op to vregs loaded from HBM (operands at 0x0, 0x1000, 0x2000;
# result stored at 0x3000). Bundles are spaced so every latency has elapsed before the next read.
VECTOR_OP = """
    li s1, 0 ; li s2, 0x1000
    li s3, 8 ; li s4, 8
    lih s3, 8 ; li s5, 0x2000
    li s6, 0x3000 ; li s7, 16
    dma.ld s1, s0, s3, s4, f0
    dma.ld s2, s4, s3, s4, f0
    dma.ld s5, s7, s3, s4, f0
    wait f0 ; vld v1, s0, 0
    vld v2, s0, 8
    vld v3, s0, 16
    nop
    {OP}
    nop
    nop
    nop
    vst v4, s0, 24 ; li s8, 24
    dma.st s6, s8, s3, s4, f1
    halt
"""


def vector_op(op: str, a: np.ndarray, b: np.ndarray | None = None, c: np.ndarray | None = None) -> np.ndarray:
    """Run `op` (e.g. 'vadd.f v4, v1, v2') on 8x8 operands given as arrays of 32-bit values; return uint32 bits."""
    def bits(x: np.ndarray | None) -> np.ndarray:
        return np.zeros((8, 8), np.uint32) if x is None else np.ascontiguousarray(x).reshape(8, 8).view(np.uint32)
    sim, _ = run_asm(VECTOR_OP.replace("{OP}", op), {0: bits(a), 0x1000: bits(b), 0x2000: bits(c)})
    return sim.read_hbm(0x3000, (8, 8), np.uint32)
