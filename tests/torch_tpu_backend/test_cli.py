"""The `ctpu` command line: assemble, disassemble, run with checks, the demo, and errors that name the place."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from sim_helpers import COPY

from torch_tpu_backend.cli import PROGRAMS_DIR, main


def test_asm_disasm_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = PROGRAMS_DIR / "softmax.s"
    binary, text = tmp_path / "softmax.bin", tmp_path / "softmax_dis.s"
    assert main(["asm", str(src), "-o", str(binary)]) == 0
    assert main(["disasm", str(binary), "-o", str(text)]) == 0
    again = tmp_path / "again.bin"
    assert main(["asm", str(text), "-o", str(again)]) == 0
    assert again.read_bytes() == binary.read_bytes()


def test_run_json_reports_checks_and_statistics(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", str(PROGRAMS_DIR / "rmsnorm.s"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] and report["target"] == "sim" and report["config"] == "small"
    stats = report["stats"]
    for key in ("bundles", "cycles", "stall_cycles", "slot_occupancy", "mxu_busy_cycles", "dma_bytes_loaded",
                "bundles_per_second"):
        assert key in stats
    assert stats["cycles"] >= stats["bundles"] > 0


def test_demo_prints_the_gemm_check_and_utilization_then_the_llama(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.count("PASS") >= 2 and "FAIL" not in out
    utilization = float(out.split("MXU utilization")[1].split()[0])
    assert utilization >= 0.90
    assert "LlamaForCausalLM" in out and "1 kernel(s)" in out and "ops on the CPU: none" in out


def test_errors_name_the_place_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.s"
    bad.write_text("li s1, 1\nvadd.g v1, v2, v3\nhalt\n")
    assert main(["asm", str(bad)]) == 2
    assert "bad.s:2" in capsys.readouterr().err
    corrupt = tmp_path / "corrupt.bin"
    corrupt.write_bytes(b"CTPU" + b"\x01\x00\x09\x00" + b"\x01\x00\x00\x00" + b"\x00" * 4 + b"\x00" * 36)
    assert main(["run", str(corrupt)]) == 2
    assert "CRC" in capsys.readouterr().err
    runaway = tmp_path / "runaway.s"
    runaway.write_text("loop: jmp loop\n")
    assert main(["run", str(runaway), "--max-cycles", "1000"]) == 2
    err = capsys.readouterr().err
    assert "trap at bundle 0" in err and "cycle limit" in err


def test_isa_table_lists_every_instruction(capsys: pytest.CaptureFixture[str]) -> None:
    from device_sim import isa

    assert main(["isa"]) == 0
    out = capsys.readouterr().out
    assert all(f"`{i.mnemonic}`" in out for i in isa.INSTRUCTIONS)


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Traceback" not in captured.out
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize("command", ["asm", "disasm", "run"])
def test_a_directory_is_one_line_naming_it(command: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    assert main([command, str(tmp_path)]) == 2
    assert _error_line(capsys) == f"ctpu {command}: error: {tmp_path}: is a directory"


@pytest.mark.parametrize("command", ["asm", "run"])
def test_non_utf8_source_names_the_file_and_line(command: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "latin1.s"
    src.write_bytes("li s1, 1\n; caf\xe9\nhalt\n".encode("latin-1"))
    assert main([command, str(src)]) == 2
    assert f"{src}:2: not UTF-8 text" in _error_line(capsys)


def test_unwritable_output_names_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["asm", str(PROGRAMS_DIR / "softmax.s"), "-o", str(tmp_path)]) == 2
    assert _error_line(capsys) == f"ctpu asm: error: {tmp_path}: is a directory"


def _copy_program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, *, npy: str = "x.npy", in_addr: str = "0",
                  out_addr: str = "0x100", tolerance: str = "atol = 0.0") -> Path:
    """copy.s: 8 f32 from HBM 0 to 0x100, checked against its input (with a manifest written here)."""
    from device_sim.programs import references

    monkeypatch.setattr(references, "copy_for_test", lambda inputs: inputs["X"], raising=False)
    (tmp_path / "copy.s").write_text(COPY)
    (tmp_path / "copy.toml").write_text(f"""
[program]
max_cycles = 1000
[[inputs]]
name = "X"
hbm_addr = {in_addr}
shape = [8]
dtype = "f32"
init = {{ dist = "file", path = "{npy}" }}
[[outputs]]
name = "Y"
hbm_addr = {out_addr}
shape = [8]
dtype = "f32"
[[outputs.checks]]
reference = "copy_for_test"
{tolerance}
why = "a copy is exact"
""")
    values = np.array([1.0, np.nan, np.inf, -np.inf, 0.0, -0.0, 3.0, -np.nan], dtype=np.float32)
    np.save(tmp_path / "x.npy", values)
    return tmp_path / "copy.s"


@pytest.mark.parametrize("tolerance", ["atol = 0.0", "rtol = 1e-6", "max_ulp = 0", "atol = 1e-3\nrtol = 0.0"])
def test_nan_and_infinities_matching_the_reference_pass(tolerance: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    program = _copy_program(tmp_path, monkeypatch, tolerance=tolerance)
    assert main(["run", str(program)]) == 0
    out = capsys.readouterr().out
    assert "PASS" in out and "FAIL" not in out


def test_nan_against_a_number_still_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    from device_sim.programs import references

    program = _copy_program(tmp_path, monkeypatch, tolerance="atol = 1e-3")
    monkeypatch.setattr(references, "copy_for_test", lambda inputs: np.nan_to_num(inputs["X"]))
    assert main(["run", str(program), "--json"]) == 1
    check = json.loads(capsys.readouterr().out)["checks"][0]
    assert not check["passed"] and check["mismatches"] == 4  # two NaNs and two infinities vs finite values


@pytest.mark.parametrize(("npy_bytes", "says"), [
    (b"garbage\n", "not a .npy file"),
    (b"\x93NUMPY\x01\x00v\x00{'descr'", "not a readable .npy file"),
])
def test_a_bad_npy_names_the_manifest_input_and_file(npy_bytes: bytes, says: str, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    program = _copy_program(tmp_path, monkeypatch, npy="bad.npy")
    (tmp_path / "bad.npy").write_bytes(npy_bytes)
    assert main(["run", str(program)]) == 2
    line = _error_line(capsys)
    assert f"{tmp_path / 'copy.toml'}: input 'X': {tmp_path / 'bad.npy'}: {says}" in line
    assert "pickle" not in line


def test_an_object_npy_is_refused_not_unpickled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    program = _copy_program(tmp_path, monkeypatch, npy="objects.npy")
    np.save(tmp_path / "objects.npy", np.array([object()] * 8, dtype=object), allow_pickle=True)
    assert main(["run", str(program)]) == 2
    assert "input 'X'" in _error_line(capsys)


@pytest.mark.parametrize(("which", "kwargs"), [("input 'X'", {"in_addr": "0xfffffff0"}),
                                               ("output 'Y'", {"out_addr": "0xffffff0"})])
def test_an_address_outside_hbm_names_the_tensor(which: str, kwargs: dict[str, str], tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    program = _copy_program(tmp_path, monkeypatch, **kwargs)
    assert main(["run", str(program)]) == 2
    line = _error_line(capsys)
    assert f"copy.toml: {which}: HBM bytes" in line and "outside the HBM of the small configuration" in line


def test_a_runaway_program_stops_soon_and_says_how_to_change_the_limit(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    import time

    from device_sim import manifest

    runaway = tmp_path / "runaway.s"
    runaway.write_text("loop: jmp loop\n")
    started = time.perf_counter()
    assert main(["run", str(runaway)]) == 2
    assert time.perf_counter() - started < 30  # the default used to be 10**8 cycles: ~2 minutes
    line = _error_line(capsys)
    assert f"cycle limit {manifest.MIN_MAX_CYCLES} exceeded" in line and "--max-cycles" in line
    assert main(["run", str(runaway), "--max-cycles", "5000"]) == 2
    assert "cycle limit 5000 exceeded" in _error_line(capsys)
    with pytest.raises(SystemExit):
        main(["run", str(runaway), "--max-cycles", "0"])
    assert "not a positive number" in capsys.readouterr().err
