"""The shipped programs (device_sim/programs/*.s with their manifests' inputs) on the RTL and the
simulator: identical final HBM, sregs, vregs, vmem, cycle count and statistics; and `run_manifest(...,
target="rtl")` passes the manifest's checks with the simulator's statistics."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from device_sim import numerics
from device_sim.asm import assemble, load_program
from device_sim.manifest import load_manifest, make_input, run_manifest
from device_sim.rtl.diff import diff_batch
from device_sim.rtl.runner import RtlJob

pytestmark = pytest.mark.rtl

PROGRAMS = Path(__file__).resolve().parents[2] / "device_sim" / "programs"


def manifest_job(name: str, trace: bool = False) -> RtlJob:
    """The program and the HBM image its manifest builds."""
    m = load_manifest(PROGRAMS / f"{name}.toml")
    image = {}
    for t in m.inputs:
        values = make_input(t, m.path.parent)
        data = numerics.f32_to_bf16_bits(values) if t.dtype == "bf16" else np.ascontiguousarray(values)
        image[t.hbm_addr] = data.tobytes()
    return RtlJob(load_program(m.program), image, m.max_cycles, trace=trace)


@pytest.mark.slow
def test_softmax_and_rmsnorm_match_the_simulator() -> None:
    """~160 s on 2 cores: the hand-written softmax and rmsnorm programs on the RTL, bit and cycle for cycle.
    Outside CI (`pytest -m slow`): compiled softmaxes and norms run on the RTL in CI, in the tiny Llama of
    test_compiled_models.py."""
    names = ["softmax", "rmsnorm"]
    reports = diff_batch([manifest_job(n, trace=True) for n in names], names)
    assert all(r.cycles > 1000 for r in reports)
    assert all(r.ok for r in reports), "\n".join(r.summary() for r in reports if not r.ok)


def test_gemm_two_blocks_matches_the_simulator() -> None:
    """CI: gemm.s with BLOCKS = 2 (C[0:128, 0:128] over the full K = 512; ~132k cycles, the same loops,
    double buffering and FIFO behaviour as the full program)."""
    job = manifest_job("gemm")
    text = (PROGRAMS / "gemm.s").read_text()
    assert ".equ BLOCKS, 32" in text
    job.program = assemble(text.replace(".equ BLOCKS, 32", ".equ BLOCKS, 2"), "gemm_2blocks.s")
    (rep,) = diff_batch([job], ["gemm (2 blocks)"])
    assert rep.ok and rep.cycles > 100_000, rep.summary()


@pytest.mark.slow
def test_gemm_matches_the_simulator() -> None:
    """~2.1M cycles (~100 s on the RTL here): the full 512x512x512 bf16 GEMM, bit for bit, cycle for cycle."""
    started = time.perf_counter()
    (rep,) = diff_batch([manifest_job("gemm")], ["gemm"])
    assert rep.ok, rep.summary()
    print(f"gemm: {rep.cycles} cycles, {time.perf_counter() - started:.1f} s on RTL + simulator")


def test_run_manifest_on_rtl() -> None:
    sim = run_manifest(PROGRAMS / "softmax.s")
    rtl = run_manifest(PROGRAMS / "softmax.s", target="rtl")
    assert rtl.passed and rtl.target == "rtl"
    for key in ("cycles", "bundles", "stall_cycles", "slot_ops", "mxu_busy_cycles", "macs", "dma_bytes_loaded",
                "dma_bytes_stored"):
        assert rtl.stats[key] == sim.stats[key], key
    for name, out in sim.outputs.items():
        assert np.array_equal(out.view(np.uint32), rtl.outputs[name].view(np.uint32))
