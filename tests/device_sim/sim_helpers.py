"""Helpers for device_sim tests: run assembly text on the simulator with HBM contents."""

from __future__ import annotations

import numpy as np

from device_sim import isa
from device_sim.asm import assemble
from device_sim.config import HardwareConfig
from device_sim.sequences import SeqBuilder
from device_sim.simulator import RunStats, Simulator


def run_asm(text: str, hbm: dict[int, np.ndarray] | None = None, config: str | HardwareConfig = "small",
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


def sequence_program(b: SeqBuilder, out: str) -> str:
    """A CTPU program running the op list of a sequence (device_sim.sequences.SeqBuilder): input i from
    vmem rows 8i..8i+7, one op per bundle with its latency waited out, the result to the 8 rows after the
    inputs. A constant is built (li/lih/vbcast) into a spare vreg just before each op that reads it;
    vregs are reused after a value's last read."""
    lines: list[str] = []
    regs: dict[str, int] = {}
    free = list(range(31, -1, -1))
    for i, name in enumerate(b.inputs):
        regs[name] = free.pop()
        lines += [f"vld v{regs[name]}, s0, {8 * i}", "nop"]
    last = {s: i for i, op in enumerate(b.ops) for s in op.srcs}
    for i, op in enumerate(b.ops):
        temps = []
        for s in dict.fromkeys(op.srcs):
            if s in b.consts:
                bits = b.consts[s]
                regs[s] = free.pop()
                temps.append(s)
                lines += [f"li s1, {bits & 0xFFFF}", f"lih s1, {bits >> 16}", f"vbcast v{regs[s]}, s1", "nop"]
        srcs = [f"v{regs[s]}" for s in op.srcs]
        for s in dict.fromkeys(op.srcs):
            if s in temps or (last[s] == i and s != out):
                free.append(regs.pop(s))
        regs[op.dst] = free.pop()
        lines.append(f"{op.mnemonic} v{regs[op.dst]}, " + ", ".join(srcs))
        lines += ["nop"] * (isa.BY_MNEMONIC[op.mnemonic].latency - 1)
    lines += [f"vst v{regs[out]}, s0, {8 * len(b.inputs)}", "halt"]
    return "\n".join(lines)


def run_sequence(b: SeqBuilder, out: str, *inputs: np.ndarray, config: str = "small") -> np.ndarray:
    """Run a sequence's op list on the simulator on inputs of one vreg each (8 x lanes values); return the
    result's bits, flat."""
    sim = Simulator(config)
    sim.load(assemble(sequence_program(b, out), "sequence.s"))
    for i, x in enumerate(inputs):
        sim.vmem[8 * i:8 * i + 8] = np.asarray(x, np.float32).reshape(8, -1).view(np.uint32)
    sim.run()
    return sim.vmem[8 * len(inputs):8 * len(inputs) + 8].copy().reshape(-1)
