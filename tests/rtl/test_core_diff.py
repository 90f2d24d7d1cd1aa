"""Differential tests: the same programs on the RTL core and on the simulator (the golden model).

Every program runs in one Verilator process (run_batch_on_rtl); final HBM, vmem, sregs, vregs, cycle
count and statistics must be identical.
"""

from __future__ import annotations

import numpy as np
import pytest

from device_sim import isa
from device_sim.asm import assemble
from device_sim.rtl.runner import RtlJob, RtlResult, run_batch_on_rtl
from device_sim.simulator import Simulator

pytestmark = pytest.mark.rtl

# One vector op on vregs loaded from HBM 0x0, 0x1000, 0x2000; result stored at 0x3000 (as in
# tests/device_sim/sim_helpers.py). Bundles are spaced so every latency has elapsed before the next read.
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

MXU_PROGRAM = """
    li s1, 0 ; li s2, 0x1000
    li s3, 8 ; li s4, 8
    lih s3, 8 ; li s5, 16
    li s7, 0x2000 ; li s8, 0x3000
    dma.ld s1, s0, s3, s4, f0
    dma.ld s2, s4, s3, s4, f0
    wait f0 ; mxu.lw s4, f1
    mxu.mms s0, s5, s4, f1
    mxu.lwt s4, f1
    wait f1 ; mxu.mmas s0, s5, s4, f1
    wait f1 ; dma.st s7, s5, s3, s4, f2
    dma.st.bf16 s8, s5, s3, s4, f2
    wait f2
    halt
"""

MXU_PACKED_PROGRAM = """
    li s1, 0x2000 ; li s3, 8
    lih s3, 8 ; li s4, 8
    li s5, 16 ; li s7, 0x3000
    dma.ld s0, s0, s3, s4, f0
    dma.ld s1, s4, s3, s4, f0
    wait f0 ; mxu.lwt.lo s4, f1
    mxu.mms s0, s5, s4, f1
    mxu.lwt.hi s4, f1
    wait f1 ; mxu.mmas s0, s5, s4, f1
    wait f1 ; dma.st s7, s5, s3, s4, f2
    wait f2
    halt
"""

DMA_BF16_PROGRAM = """
    li s1, 0x100 ; li s3, 5
    lih s3, 3 ; li s4, 7
    li s2, 40 ; li s7, 0x4000
    dma.ld.bf16 s1, s2, s3, s4, f3
    wait f3
    dma.st s7, s2, s3, s4, f3
    wait f3 ; vld v1, s2, 0
    vred.sum.l v2, v1 ; vred.max.s v3, v1
    nop
    vcvt.bf v4, v1
    nop
    halt
"""

SCALAR_PROGRAM = """
    li s1, -5 ; li s2, 3
    add s3, s1, s2 ; sub s4, s1, s2
    mul s5, s1, s2 ; sra s6, s1, s2
    shr s7, s1, s2 ; sltu s8, s1, s2
    slt s9, s1, s2 ; min s10, s1, s2
    max s11, s1, s2 ; xori s12, s1, 0x155
    lih s12, 0x1234 ; slti s13, s2, 4
    shli s14, s2, 30 ; srai s15, s1, 1
    halt
"""


def _vector_programs() -> list[str]:
    out = []
    for ins in isa.INSTRUCTIONS:
        if ins.unit is not isa.Unit.VECTOR:
            continue
        kinds = [o.kind for o in ins.operands]
        if ins.mnemonic == "viota":
            out += [VECTOR_OP.replace("{OP}", f"viota v4, {k}") for k in range(3)]
        elif ins.mnemonic == "vext":
            out += [VECTOR_OP.replace("{OP}", f"vext s9, v1, {k} ; vext s10, v3, {63 - k}") for k in (0, 5, 63)]
        elif ins.mnemonic == "vbcast":
            out.append(VECTOR_OP.replace("{OP}", "vbcast v4, s6"))
        else:
            regs = ["v4", "v1", "v2", "v3"][: len(kinds)]
            out.append(VECTOR_OP.replace("{OP}", f"{ins.mnemonic} {', '.join(regs)}"))
    return out


def _hbm(rng: np.random.Generator) -> dict[int, bytes]:
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, -1e-40, 3.4e38], np.float32)
    a = rng.standard_normal(64).astype(np.float32)
    a[:8] = special
    b = (rng.standard_normal(64) * 4).astype(np.float32)
    c = rng.integers(-(1 << 31), 1 << 31, size=64, dtype=np.int64).astype(np.int32).view(np.float32)
    bf = rng.integers(0, 1 << 16, size=64, dtype=np.int64).astype(np.uint16)
    return {0: a.tobytes(), 0x1000: b.tobytes(), 0x2000: c.tobytes(), 0x100: bf.tobytes()}


def _simulate(job: RtlJob) -> Simulator:
    sim = Simulator("small", max_cycles=job.max_cycles)
    for addr, data in job.hbm.items():
        sim.write_hbm(addr, np.frombuffer(data, np.uint8))
    sim.load(job.program)
    sim.stats = sim.run()  # type: ignore[attr-defined]
    return sim


def compare(sim: Simulator, rtl: RtlResult) -> list[str]:
    """Differences between the simulator's and the RTL's final state and statistics."""
    errs = []
    s, r = sim.stats.as_dict(), rtl.stats.as_dict()  # type: ignore[attr-defined]
    for key in ("cycles", "bundles", "stall_cycles", "slot_ops", "mxu_busy_cycles", "mxu_weight_loads", "macs",
                "dma_commands", "dma_bytes_loaded", "dma_bytes_stored"):
        if s[key] != r[key]:
            errs.append(f"{key}: sim {s[key]} rtl {r[key]}")
    if rtl.trap is not None:
        errs.append(f"unexpected {rtl.trap}")
    for name in ("sregs", "vregs", "vmem", "hbm"):
        a, b = getattr(sim, name), getattr(rtl, name)
        if not np.array_equal(a, b):
            idx = np.argwhere(a != b)[0]
            errs.append(f"{name}{list(idx)}: sim {a[tuple(idx)]:#x} rtl {b[tuple(idx)]:#x}")
    return errs


def test_programs_match_simulator() -> None:
    rng = np.random.default_rng(7)
    texts = [*_vector_programs(), MXU_PROGRAM, MXU_PACKED_PROGRAM, DMA_BF16_PROGRAM, SCALAR_PROGRAM]
    jobs = [RtlJob(assemble(t, f"prog{i}.s"), _hbm(rng)) for i, t in enumerate(texts)]
    results = run_batch_on_rtl(jobs)
    failures = []
    for i, (job, res) in enumerate(zip(jobs, results, strict=True)):
        errs = compare(_simulate(job), res)
        if errs:
            failures.append(f"program {i} ({texts[i].strip().splitlines()[-8:]}): {errs[:4]}")
    assert not failures, "\n".join(failures)
