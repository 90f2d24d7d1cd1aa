"""`verilator --lint-only -Wall` must be clean on the core and on the harness (waivers carry reasons)."""

from __future__ import annotations

import os
import subprocess

import pytest

from device_sim.config import LARGE
from device_sim.rtl import verilator_build as vb

pytestmark = pytest.mark.rtl


@pytest.mark.parametrize("top", ["ctpu_core", "ctpu_tb_top"])
def test_lint_clean(top: str) -> None:
    root = vb.verilator_root()
    srcs = vb.CORE_SOURCES + (["ctpu_tb_top.sv"] if top == "ctpu_tb_top" else [])
    env = {**os.environ, "VERILATOR_ROOT": str(root)}
    proc = subprocess.run([str(root / "bin" / "verilator"), "--lint-only", "-Wall", "--timing", "--top-module", top,
                           *srcs], cwd=vb.RTL_DIR, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


# `large` itself (128 lanes: 16,384 PEs, 32768 x 4096-bit vmem) does not fit Verilator's lint on this machine
# (killed at 24 GB after 9 minutes); this lints the design at 32 lanes with large's memory sizes, DMA and
# queues. --replication-limit: resetting the 32 x 32 array's registers with '0 is a > 8192-bit fill, which
# -Wall flags as a "suspect" replication (WIDTHCONCAT); it is intended.
@pytest.mark.slow
def test_lint_scaled_up_config() -> None:
    root = vb.verilator_root()
    params = {"LANES": 32, "VMEM_ROWS": 32768, "HBM_BYTES": f"64'd{LARGE.hbm_bytes}", "BPC": 1024, "DMA_LATENCY": 500,
              "DMA_QUEUE": 8, "MXU_QUEUE": 4}
    env = {**os.environ, "VERILATOR_ROOT": str(root)}
    proc = subprocess.run([str(root / "bin" / "verilator"), "--lint-only", "-Wall", "--timing", "--replication-limit",
                           "1048576", "--top-module", "ctpu_core", *(f"-G{k}={v}" for k, v in params.items()),
                           *vb.CORE_SOURCES], cwd=vb.RTL_DIR, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
