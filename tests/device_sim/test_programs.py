"""The shipped programs (device_sim/programs/*.s): each assembles, runs on the simulator with its manifest,
passes every output check, and takes exactly its golden number of cycles (a timing change anywhere in the
simulator, assembler or program shows up here). Also the manifest machinery itself."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from sim_helpers import COPY

from device_sim import manifest as mf
from device_sim.asm import load_program
from device_sim.config import get_config
from device_sim.programs import references, row_programs
from device_sim.simulator import RunStats

PROGRAMS = Path(mf.__file__).parent / "programs"

# program -> (cycles, bundles) on `small`, measured; update together with docs/programs.md
GOLDEN = {
    "gemm": (2_098_475, 72_468),
    "softmax": (1_124, 499),  # 2,151 cycles before the exp unit, 1,259 before the reciprocal unit
    "rmsnorm": (1_645, 1_406),
}


@pytest.fixture(scope="module")
def results() -> dict[str, mf.ManifestResult]:
    return {name: mf.run_manifest(PROGRAMS / f"{name}.s") for name in GOLDEN}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_program_passes_its_checks(name: str, results: dict[str, mf.ManifestResult],
                                   record_property: pytest.RecordProperty) -> None:
    r = results[name]
    assert r.checks, "every shipped program checks its outputs"
    assert r.passed, r.summary()
    exact = [c for c in r.checks if c.tolerance == "max_ulp <= 0"]
    assert exact and all(c.max_ulp == 0 for c in exact), "bit-exact against its model"
    record_property("bundles_per_second", round(r.stats["bundles_per_second"]))
    print(r.summary(), f"\n  simulator: {r.stats['bundles_per_second']:.0f} bundles/s")


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_program_golden_cycles(name: str, results: dict[str, mf.ManifestResult]) -> None:
    s = results[name].stats
    assert (s["cycles"], s["bundles"]) == GOLDEN[name]


def test_gemm_mxu_utilization(results: dict[str, mf.ManifestResult]) -> None:
    s = results["gemm"].stats
    assert s["mxu_busy_cycles"] == 512 * 512 * 512 // 64  # every MAC once: rows streamed x 64 MACs
    assert s["mxu_utilization"] >= 0.90
    assert s["mxu_busy_cycles"] / s["cycles"] == pytest.approx(s["mxu_utilization"])


def test_generated_programs_are_up_to_date() -> None:
    for name, k in row_programs.ROW_PROGRAMS.items():
        assert (PROGRAMS / f"{name}.s").read_text() == row_programs.generate(k)[0], (
            f"{name}.s is stale: run `python -m device_sim.programs.row_programs`")


def test_gemm_model_matches_numerics_mxu_matmul() -> None:
    """references.gemm_mxu_order is written independently of numerics.mxu_matmul; on one k-tile they agree."""
    from device_sim import numerics

    rng = np.random.default_rng(0)
    a = numerics.round_to_bf16(rng.normal(size=(16, 8)).astype(np.float32))
    b = numerics.round_to_bf16(rng.normal(size=(8, 8)).astype(np.float32))
    assert np.array_equal(references.gemm_mxu_order({"A": a, "B": b}), numerics.mxu_matmul(a, b))


# ---- manifests -----------------------------------------------------------------------------------
def test_load_manifest() -> None:
    m = mf.load_manifest(PROGRAMS / "gemm.s")
    assert m.config == "small" and m.program == PROGRAMS / "gemm.s"
    assert [t.name for t in m.inputs] == ["A", "B"] and m.inputs[0].dtype == "bf16"
    assert [c.reference for c in m.outputs[0].checks] == ["gemm_mxu_order", "matmul_f64"]
    assert all(c.why for c in m.outputs[0].checks)


def test_manifest_errors(tmp_path: Path) -> None:
    bad = tmp_path / "p.toml"
    bad.write_text('[[inputs]]\nname = "X"\nhbm_addr = 0\nshape = [8]\ndtype = "f16"\ninit = {}\n')
    with pytest.raises(mf.ManifestError, match="dtype 'f16'"):
        mf.load_manifest(bad)
    bad.write_text('[[outputs]]\nname = "Y"\nhbm_addr = 0\nshape = [8]\ndtype = "f32"\n'
                   '[[outputs.checks]]\nreference = "x"\nwhy = "?"\n')
    with pytest.raises(mf.ManifestError, match="max_ulp or atol"):
        mf.load_manifest(bad)


def test_run_manifest_with_file_input_and_injected_runner(tmp_path: Path) -> None:
    (tmp_path / "copy.s").write_text(COPY)
    np.save(tmp_path / "x.npy", np.arange(8, dtype=np.float32))
    (tmp_path / "copy.toml").write_text("""
[program]
max_cycles = 1000
[[inputs]]
name = "X"
hbm_addr = 0
shape = [8]
dtype = "f32"
init = { dist = "file", path = "x.npy" }
[[outputs]]
name = "X"
hbm_addr = 0x100
shape = [8]
dtype = "f32"
[[outputs.checks]]
reference = "identity_for_test"
max_ulp = 0
why = "a copy"
""")
    references.identity_for_test = lambda inputs: inputs["X"]  # type: ignore[attr-defined]
    try:
        r = mf.run_manifest(tmp_path / "copy.s")
        assert r.passed and r.stats["cycles"] > 0 and np.array_equal(r.outputs["X"], np.arange(8))

        calls = []

        class SevensRunner:  # any device_sim.runners.Runner: this one writes 7s where X is read back
            name, config = "fake", get_config("small")

            def run(self, program, hbm, args, max_cycles=None):
                calls.append((len(program), args, max_cycles, hbm[:32].view(np.float32).tolist()))
                hbm[0x100:0x120].view(np.float32)[:] = 7
                return RunStats("small", bundles=1, cycles=1)

        r = mf.run_manifest(tmp_path / "copy.s", runner=SevensRunner())
        assert calls == [(6, {}, 1000, list(range(8)))] and r.target == "fake"
        assert not r.passed and r.checks[0].mismatches == 7  # 7 == 7 at index 7 only
    finally:
        del references.identity_for_test  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match="does not run CTPU programs"):
        mf.run_manifest(tmp_path / "copy.s", target="ptx")


def test_program_without_manifest_just_runs(tmp_path: Path) -> None:
    (tmp_path / "bare.s").write_text("nop\nhalt\n")
    r = mf.run_manifest(tmp_path / "bare.s")
    assert r.checks == [] and r.passed and r.stats["cycles"] == 2
    assert len(load_program(tmp_path / "bare.s")) == 2
