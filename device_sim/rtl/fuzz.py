"""RTL-vs-simulator fuzzing with random valid programs (device_sim/rtl/program_gen.py).

    python -m device_sim.rtl.fuzz --programs 300 --seed 1          # fuzz; exit 1 on any mismatch
    python -m device_sim.rtl.fuzz --seed 1 --case 17 --waves f.fst  # re-run one case, dump its waveform

Case `i` of seed `s` is generated from `numpy.random.default_rng([s, i])`, so any failing case is re-made
from its two numbers alone. Programs run in batches (one Verilator process per batch). A mismatch report
names the first differing trace event (cycle, bundle, register) and the first differing register, vmem
row or HBM byte; the failing program is written to build/rtl/fuzz/seed<s>_case<i>.s.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from device_sim.rtl import verilator_build as vb
from device_sim.rtl.diff import DiffReport, compare, diff_batch, simulate
from device_sim.rtl.program_gen import FuzzCase, ProgramGenerator
from device_sim.rtl.runner import RtlJob, run_on_rtl

FAIL_DIR = vb.BUILD_ROOT / "fuzz"


def make_case(seed: int, index: int, trap_rate: float = 0.05) -> FuzzCase:
    return ProgramGenerator(np.random.default_rng([seed, index]), trap_rate=trap_rate).generate()


def reproduce_hint(seed: int, index: int) -> str:
    return (f"re-run: python -m device_sim.rtl.fuzz --seed {seed} --case {index} "
            f"--waves build/rtl/fuzz/seed{seed}_case{index}.fst  (FST waveform of the failing program)")


@dataclass
class FuzzSummary:
    programs: int = 0
    trapping: int = 0  # programs that (deliberately) trap, with the same kind, pc and cycle on both
    cycles: int = 0
    rtl_seconds: float = 0.0
    failures: list[str] = field(default_factory=list)


def fuzz(seed: int, programs: int, batch: int = 150, trap_rate: float = 0.05, trace: bool = True) -> FuzzSummary:
    """Fuzz `programs` cases of `seed` in batches of `batch`; a failure message per mismatching case."""
    out = FuzzSummary()
    for start in range(0, programs, batch):
        idx = list(range(start, min(programs, start + batch)))
        cases = [make_case(seed, i, trap_rate) for i in idx]
        jobs = [RtlJob(c.program, c.hbm, c.max_cycles, trace=trace) for c in cases]
        started = time.perf_counter()
        reports = diff_batch(jobs, [f"seed {seed} case {i}" for i in idx])
        out.rtl_seconds += time.perf_counter() - started
        for i, case, rep in zip(idx, cases, reports, strict=True):
            out.programs += 1
            out.cycles += rep.cycles
            out.trapping += rep.sim_trap is not None
            if not rep.ok:
                out.failures.append(_record_failure(seed, i, case, rep))
    return out


def _record_failure(seed: int, index: int, case: FuzzCase, rep: DiffReport) -> str:
    FAIL_DIR.mkdir(parents=True, exist_ok=True)
    path = FAIL_DIR / f"seed{seed}_case{index}.s"
    path.write_text(case.text)
    return f"{rep.summary()}\n  program: {path}\n  {reproduce_hint(seed, index)}"


def rerun(seed: int, index: int, waves: str | None) -> DiffReport:
    """One case on both models, with traces (and an FST waveform of the RTL run if `waves` names a file)."""
    case = make_case(seed, index)
    if waves:
        Path(waves).parent.mkdir(parents=True, exist_ok=True)
    job = RtlJob(case.program, case.hbm, case.max_cycles, trace=True)
    rtl = run_on_rtl(job.program, job.hbm, max_cycles=job.max_cycles, trace=True, waves=waves is not None,
                     wave_file=waves)
    return compare(f"seed {seed} case {index}", simulate(job), rtl, job.program)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m device_sim.rtl.fuzz", description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--programs", type=int, default=300)
    p.add_argument("--batch", type=int, default=150, help="programs per Verilator process")
    p.add_argument("--case", type=int, help="re-run this one case (with traces)")
    p.add_argument("--waves", help="with --case: write an FST waveform of the RTL run here")
    p.add_argument("--print", action="store_true", help="with --case: print the program")
    a = p.parse_args(argv)
    if a.case is not None:
        if a.print:
            print(make_case(a.seed, a.case).text)
        rep = rerun(a.seed, a.case, a.waves)
        print("match" if rep.ok else rep.summary())
        if a.waves:
            print(f"waveform: {a.waves}")
        return 0 if rep.ok else 1
    s = fuzz(a.seed, a.programs, a.batch)
    for f in s.failures:
        print(f)
    rate = s.cycles / s.rtl_seconds if s.rtl_seconds else 0.0
    print(f"{s.programs} programs (seed {a.seed}; {s.trapping} end in a deliberate trap), {s.cycles} cycles, "
          f"{len(s.failures)} mismatches; {s.rtl_seconds:.1f} s for RTL + simulator ({rate:.0f} cycles/s overall)")
    return 1 if s.failures else 0


if __name__ == "__main__":
    sys.exit(main())
