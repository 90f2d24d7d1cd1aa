"""The RTL's fp32 adder/multiplier, bf16 conversion, f2i/i2f, compares, exp and reciprocal units against device_sim."""

from __future__ import annotations

import pytest

from device_sim.rtl import verilator_build as vb

pytestmark = pytest.mark.rtl


def test_fp_lanes_bit_exact() -> None:
    runner = vb.build("fp_lanes", "ctpu_fp_lanes", ["ctpu_fp_pkg.sv", "ctpu_isa_pkg.sv", "ctpu_fp_lanes.sv"])
    results = vb.run_test(runner, "ctpu_fp_lanes", "tests.rtl.cocotb_fp")
    from cocotb_tools.check_results import get_results

    tests, failed = get_results(results)
    assert tests >= 1 and failed == 0, f"{failed} of {tests} cocotb tests failed (see {results})"
