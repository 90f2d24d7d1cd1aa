"""Profiling compiled graphs: the `profile` option (one trace per launch, results and cycles unchanged) and
`ctpu profile` (a trace that loads, kernels named after FX nodes, layers, the roofline table)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import torch_tpu_backend.stats as ctpu_stats
from device_sim import profile as P
from torch_tpu_backend.cli import main
from torch_tpu_backend.options import CompileOptions


def _kernel_spans(trace: dict) -> list[dict]:
    tid = next(e["tid"] for e in trace["traceEvents"] if e["name"] == "thread_name" and e["args"]["name"] == P.KERNELS)
    return [e for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == tid]


def _mlp_run(options: dict[str, object]) -> tuple[torch.Tensor, list[ctpu_stats.LaunchRecord]]:
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.SiLU(), torch.nn.Linear(32, 16)).eval()
    x = torch.randn(8, 16)
    torch._dynamo.reset()
    ctpu_stats.reset()
    compiled = torch.compile(mlp, backend="ctpu", options=options)
    with torch.no_grad():
        outs = [compiled(x), compiled(x)]
    assert torch.equal(outs[0], outs[1])
    return outs[0], ctpu_stats.last().launches


def test_profile_option_writes_one_trace_per_launch_and_changes_nothing(fresh_compile: None, tmp_path: Path) -> None:
    plain, plain_launches = _mlp_run({})
    profiled, launches = _mlp_run({"profile": str(tmp_path / "traces")})
    assert torch.equal(plain, profiled)
    assert [r.stats.cycles for r in launches] == [r.stats.cycles for r in plain_launches]
    assert all(r.profile is None for r in plain_launches)
    files = sorted((tmp_path / "traces").glob("*.json"))
    assert len(files) == len(launches) == 2
    for path, record in zip(files, launches, strict=True):
        prof, stats = record.profile, record.stats
        assert prof.cycles == stats.cycles and prof.busy_cycles(P.MXU_DATA) == stats.mxu_busy_cycles
        trace = json.loads(path.read_text())
        spans = _kernel_spans(trace)
        assert spans[0]["args"]["cycle"] == 0 and sum(s["args"]["cycles"] for s in spans) == stats.cycles
        names = [s["name"] for s in spans[1:-1]]  # between the entry and the exit: k{i} and its FX node
        assert names and all(len(n.split()) == 2 and n.startswith("k") for n in names)
        modules = {s["args"]["module"] for s in spans[1:-1]}  # a fused kernel is named after its last node
        assert "2" in modules and len(modules) >= 2 and modules <= {"0", "1", "2"}, modules


def test_profile_needs_the_simulator() -> None:
    assert CompileOptions.resolve({"profile": "t"}).profile == "t"
    with pytest.raises(ValueError, match="profile needs target 'sim'"):
        CompileOptions.resolve({"profile": "t", "target": "rtl"})


# CI time: the decode case (which compiles the prefill too) in CI; the prefill alone `slow` (13 s)
@pytest.mark.parametrize("decode", [pytest.param(False, marks=pytest.mark.slow), True], ids=["prefill", "decode"])
def test_ctpu_profile_writes_a_trace_and_the_roofline(fresh_compile: None, tmp_path: Path, decode: bool,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "trace.json"
    argv = ["profile", "--layers", "1", "--hidden", "32", "--vocab", "32", "--tokens", "4", "--out", str(out)]
    assert main([*argv, "--json", *(["--decode"] if decode else [])]) == 0
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "ctpu profile: writing" in captured.err  # progress on stderr, JSON alone on stdout
    assert result["phase"] == ("decode step" if decode else "prefill of 4 tokens")
    assert result["launches_profiled"] == 1  # generate() counts each forward call on its own: the last one
    rows = result["roofline"]
    assert result["cycles"] == result["stats"]["cycles"] == sum(r["cycles"] for r in rows)
    assert sum(r["macs"] for r in rows) == result["stats"]["macs"]
    stats = result["stats"]
    assert sum(r["hbm_bytes"] for r in rows) == stats["dma_bytes_loaded"] + stats["dma_bytes_stored"]
    assert {r["bound"] for r in rows} <= {"hbm", "mxu", "vpu", "latency"}
    assert any(r["kind"] == "scatter" for r in rows) == decode  # a decode step writes the static KV cache
    trace = json.loads(out.read_text())
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert tracks == set(P.TRACKS)
    layers = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["tid"] == 2]
    assert layers and set(layers) == {"model.layers.0"}  # split where a kernel without a module sits between
    names = " ".join(s["name"] for s in _kernel_spans(trace))
    assert "linear" in names and "attention" in names and "rms_norm" in names
    if not decode:
        assert main([*argv, "--top", "3"]) == 0
        text = capsys.readouterr().out
        assert "cycles by bound" in text and "%bound" in text and str(out) in text
        table = text.split("\n\n")[1].splitlines()  # header, rule, the 3 kernels with the most cycles
        assert len(table) == 2 + 3 and table[1] == "-" * len(table[0])
