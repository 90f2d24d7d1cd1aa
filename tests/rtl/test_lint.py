"""`verilator --lint-only -Wall` must be clean on the core and on the harness (waivers carry reasons)."""

from __future__ import annotations

import os
import subprocess

import pytest

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
