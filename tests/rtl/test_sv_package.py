"""The generated SystemVerilog package must match isa.py and config.py (no Verilator needed)."""

from __future__ import annotations

from device_sim import isa, sv_package


def test_committed_package_is_fresh() -> None:
    committed = sv_package.PACKAGE_PATH.read_text()
    assert committed == sv_package.generate(), "stale: run `python -m device_sim.sv_package`"


def test_first_line_says_generated() -> None:
    first = sv_package.generate().splitlines()[0]
    assert "GENERATED" in first and "sv_package.py" in first


def test_every_opcode_is_in_the_package() -> None:
    text = sv_package.generate()
    for ins in isa.INSTRUCTIONS:
        assert f"{sv_package.sv_name(ins.mnemonic)}" in text
        assert f"8'h{ins.opcode:02x}" in text


def test_check_mode_detects_staleness(tmp_path) -> None:
    out = tmp_path / "pkg.sv"
    assert sv_package.main(["--out", str(out)]) == 0
    assert sv_package.main(["--check", "--out", str(out)]) == 0
    out.write_text(out.read_text() + "// edited\n")
    assert sv_package.main(["--check", "--out", str(out)]) == 1


def test_rtl_refuses_a_wide_vmem_port() -> None:
    """The RTL moves one vmem row per cycle through the DMA channel and the MXU weight port: `large`
    (vmem_port_rows 4) is simulator-only, and building the RTL for it says so instead of running with the
    wrong timing; `small` (1 row) builds as before."""
    import pytest

    from device_sim.config import get_config
    from device_sim.rtl.runner import _config_params

    assert _config_params(get_config("small"))["BPC"] == 32
    with pytest.raises(ValueError, match="one-row vmem port"):
        _config_params(get_config("large"))
