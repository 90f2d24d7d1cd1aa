"""The mismatch report (device_sim/rtl/diff.py) names the first differing cycle, bundle and register, or
the first differing vmem row / HBM byte. No Verilator needed: two simulator runs stand in for the RTL."""

from __future__ import annotations

import numpy as np

from device_sim.asm import assemble
from device_sim.rtl.diff import compare, first_trace_difference, simulate
from device_sim.rtl.runner import RtlJob, RtlResult

PROGRAM = """
    li s1, 8 ; li s2, 0x100
    lih s1, 1
    dma.ld s0, s0, s1, s1, f0
    wait f0 ; vld v1, s0, 0
    nop
    vadd.f v2, v1, v1 ; vext s3, v1, 2
    nop
    vst v2, s0, 8 ; li s4, 8
    dma.st s2, s4, s1, s1, f1
    halt
"""


def _as_rtl(job: RtlJob) -> RtlResult:
    run = simulate(job)
    assert run.stats is not None
    return RtlResult(stats=run.stats, sregs=run.sim.sregs.copy(), vregs=run.sim.vregs.copy(),
                     vmem=run.sim.vmem.copy(), hbm=run.sim.hbm.copy(), trace=list(run.sim.trace or []))


def _job(x: np.ndarray) -> RtlJob:
    return RtlJob(assemble(PROGRAM, "p.s"), {0: x.tobytes()}, trace=True)


def test_identical_runs_match() -> None:
    x = np.arange(8, dtype=np.float32)
    assert compare("same", simulate(_job(x)), _as_rtl(_job(x))).ok


def test_first_difference_names_cycle_bundle_register_and_addresses() -> None:
    x = np.arange(8, dtype=np.float32)
    y = x.copy()
    y[2] = 100.0  # lane 2 differs: first seen when vld lands in v1
    rep = compare("diff", simulate(_job(x)), _as_rtl(_job(y)), _job(x).program)
    assert not rep.ok
    text = rep.summary()
    first = rep.errors[0]
    assert first.startswith("first trace difference at cycle")
    assert "v1" in first and "element 2" in first and "written by bundle 3 (vld in slot vld" in first, first
    assert "vmem row 0 lane 2" in text and "HBM byte 0xa" in text and "s3" in text, text


def test_trace_difference_in_issue_order() -> None:
    a = [(0, 0), (1, 1), ("w", 2, "s1", 5), (2, 2)]
    b = [(0, 0), (1, 1), ("w", 2, "s1", 5), (3, 2)]
    msg = first_trace_difference(a, b)
    assert msg is not None and "cycle 2" in msg and "bundle 2 issues at cycle 2" in msg
    assert first_trace_difference(a, list(a)) is None
