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
