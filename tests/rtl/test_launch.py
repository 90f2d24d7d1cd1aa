"""The runtime's launch path: `run_on_rtl(program, hbm_array, config=..., args={1: ...})` presets s1..s31
(the launch ABI) and returns the final HBM; the same launch on the simulator gives the same result."""

from __future__ import annotations

import numpy as np
import pytest

from device_sim.asm import assemble
from device_sim.rtl.runner import run_on_rtl
from device_sim.simulator import Simulator

pytestmark = pytest.mark.rtl

# y[i] = x[i] * 2 + s3 (as fp32 bits of vbcast); s1 = HBM x, s2 = HBM y, s3 = a scalar argument
KERNEL = """
    li s4, 8 ; li s5, 8
    lih s4, 2 ; li s6, 100
    dma.ld s1, s6, s4, s5, f0
    wait f0 ; vld v1, s6, 0 ; vbcast v2, s3
    nop
    vadd.f v3, v1, v1
    nop
    vadd.f v4, v3, v2
    nop
    vst v4, s6, 0
    dma.st s2, s6, s4, s5, f1
    wait f1
    halt
"""


def test_launch_with_args_matches_the_simulator() -> None:
    sim = Simulator("small")
    x = np.arange(16, dtype=np.float32) - 3.5
    sim.write_hbm(0x2000, x)
    sim.write_hbm(0x9000, np.full(16, 7.0, np.float32))  # the output buffer's old contents
    hbm_before = sim.hbm.copy()
    args = {1: 0x2000, 2: 0x9000, 3: int(np.float32(0.25).view(np.uint32))}
    program = assemble(KERNEL, "kernel.s")
    result = run_on_rtl(program, hbm_before, config="small", args=args)
    assert result.trap is None
    sim.load(program)
    stats = sim.run(args=args)
    assert np.array_equal(result.hbm, sim.hbm)
    assert np.array_equal(result.sregs, sim.sregs) and result.sregs[3] == args[3]
    assert result.stats.cycles == stats.cycles
    y = result.hbm[0x9000 : 0x9000 + 64].view(np.float32)
    assert np.array_equal(y, x * 2 + np.float32(0.25))
