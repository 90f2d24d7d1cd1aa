"""RTL-vs-simulator fuzzing: random valid programs (device_sim/rtl/program_gen.py) must give identical
traces (every issue and register write, cycle by cycle), final state, statistics and traps on both.

CI: 300 programs of seed CTPU_FUZZ_SEED (default 1) in two Verilator processes. Soak (outside CI):
    CTPU_FUZZ_PROGRAMS=5000 CTPU_FUZZ_SEED=7 pytest -m slow tests/rtl/test_fuzz.py
A failure names the case, the first differing cycle/bundle/register or address, and the command that
re-runs it with an FST waveform.
"""

from __future__ import annotations

import os

import pytest

from device_sim.rtl.fuzz import fuzz

pytestmark = pytest.mark.rtl


def _check(seed: int, programs: int) -> None:
    summary = fuzz(seed, programs, batch=150)
    assert summary.programs == programs
    assert not summary.failures, f"{len(summary.failures)} of {programs} programs mismatch:\n" + "\n".join(
        summary.failures[:5])


def test_fuzz_ci() -> None:
    _check(int(os.environ.get("CTPU_FUZZ_SEED", "1")), 300)


@pytest.mark.slow
def test_fuzz_soak() -> None:
    _check(int(os.environ.get("CTPU_FUZZ_SEED", "2")), int(os.environ.get("CTPU_FUZZ_PROGRAMS", "3000")))
