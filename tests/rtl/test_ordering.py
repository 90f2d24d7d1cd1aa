"""Accesses the hardware orders itself (docs/architecture.md: DMA after DMA, mm output after mm output),
back to back, where a pipeline without forwarding would read stale data. Directed; the fuzzer chains such
commands too."""

from __future__ import annotations

import numpy as np
import pytest

from device_sim.asm import assemble
from device_sim.rtl.diff import diff_batch
from device_sim.rtl.runner import RtlJob

pytestmark = pytest.mark.rtl

SETUP = "li s1, 8 ; li s2, 10\nlih s1, {rows} ; li s3, 0x1000\nli s4, 8 ; li s5, {first}\n"
PROGRAMS = {
    # a store whose first row is the previous load's last row, starting as that row is written
    "ld_st_one_row": (SETUP + "dma.ld s0, s2, s1, s4, f0\ndma.st s3, s5, s1, s4, f1\nwait f1\nhalt", 1, 10),
    "ld_st_last_row": (SETUP + "dma.ld s0, s2, s1, s4, f0\ndma.st s3, s5, s1, s4, f1\nwait f1\nhalt", 3, 12),
    "ld_bf16_st_bf16": (SETUP + "dma.ld.bf16 s0, s2, s1, s4, f0\ndma.st.bf16 s3, s5, s1, s4, f1\nwait f1\nhalt",
                        2, 11),
    "ld_ld_same_rows": (SETUP + "dma.ld s0, s2, s1, s4, f0\ndma.ld s3, s5, s1, s4, f1\nwait f1\nhalt", 2, 11),
    "st_ld_same_hbm": (SETUP + "dma.st s3, s2, s1, s4, f0\ndma.ld s3, s5, s1, s4, f1\nwait f1\nhalt", 2, 30),
    # mm then mma into the same output rows, back to back (the mma reads what the mm just wrote)
    "mm_mma_same_out": ("li s6, 8 ; li s7, 8\nlih s6, 16 ; li s1, 8\nli s2, 64 ; li s3, 3\nli s4, 100\n"
                        "dma.ld s0, s0, s6, s7, f0\nwait f0 ; mxu.lw s0, f1\nmxu.mms s1, s2, s3, f1\n"
                        "mxu.mma s1, s2, s3, f1\nmxu.mmas s4, s2, s3, f1\nwait f1\nhalt", 0, 0),
}


def test_ordered_back_to_back_accesses_match() -> None:
    rng = np.random.default_rng(3)
    hbm = {0: rng.standard_normal(4096).astype(np.float32).tobytes()}
    names = list(PROGRAMS)
    jobs = [RtlJob(assemble(t.format(rows=r, first=f), n), hbm, trace=True) for n, (t, r, f) in PROGRAMS.items()]
    reports = diff_batch(jobs, names)
    assert all(r.sim_trap is None for r in reports), [str(r.sim_trap) for r in reports]
    assert all(r.ok for r in reports), "\n".join(r.summary() for r in reports if not r.ok)
