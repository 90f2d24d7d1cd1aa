"""Standalone cocotb benches for two units, each with its own small Verilator build:
the systolic array (tests/rtl/cocotb_mxu_array.py) and the DMA engine (tests/rtl/cocotb_dma.py)."""

from __future__ import annotations

import pytest

from device_sim.rtl import verilator_build as vb

pytestmark = pytest.mark.rtl


def _passes(results) -> None:  # type: ignore[no-untyped-def]
    from cocotb_tools.check_results import get_results

    tests, failed = get_results(results)
    assert tests >= 1 and failed == 0, f"{failed} of {tests} cocotb tests failed (see {results})"


@pytest.mark.slow  # CI time (95 s); in CI the MXU array runs in the whole core: test_compiled_models.py
def test_systolic_array_bench() -> None:
    runner = vb.build("mxu_array", "ctpu_mxu_array",
                      ["ctpu_fp_pkg.sv", "ctpu_mxu_pe.sv", "ctpu_mxu_array.sv"], parameters={"N": 8})
    _passes(vb.run_test(runner, "ctpu_mxu_array", "tests.rtl.cocotb_mxu_array"))


@pytest.mark.slow  # CI time (42 s, its own Verilator build); in CI the DMA engine runs in the whole core:
def test_dma_engine_bench() -> None:  # test_ordering.py (back-to-back accesses), test_programs.py, test_traps.py
    runner = vb.build("dma_engine", "ctpu_dma",
                      ["ctpu_fp_pkg.sv", "ctpu_isa_pkg.sv", "ctpu_fifo_slots.sv", "ctpu_dma.sv"],
                      parameters={"LANES": 8, "VMEM_ROWS": 512, "HBM_BYTES": "64'd65536", "BPC": 32,
                                  "LATENCY": 32, "QUEUE": 8})
    _passes(vb.run_test(runner, "ctpu_dma", "tests.rtl.cocotb_dma"))
