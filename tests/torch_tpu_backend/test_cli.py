"""The `ctpu` command line: assemble, disassemble, run with checks, the demo, and errors that name the place."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

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
