"""The profiler (device_sim.profile): spans per unit, kernels by label, stalls by cause, the Chrome trace and the
roofline table, checked against the simulator's statistics and against timings worked out by hand."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from device_sim import isa
from device_sim import profile as P
from device_sim.asm import assemble
from device_sim.simulator import RunStats, Simulator

F32 = np.float32

# Three "kernels" as the compiler labels them (k{i}_N, exit_N) after an entry: DMA + MXU with waits (the
# timing of test_simulator's by-hand test), a counted vector loop, a burst of mms that fills the MXU FIFO.
PROGRAM = """
    li s1, 0 ; li s2, 4096
    li s3, 8 ; li s4, 8
k0_1:
    lih s3, 16              # shape 16 x 8
    li s5, 8 ; li s6, 100
    lih s5, 8               # shape 8 x 8
    li s7, 200 ; li s8, 16
    dma.ld s1, s0, s3, s4, f0                  # c=6: start 6, 16 rows x 1 cycle, done 6+16+32 = 54
    dma.ld s2, s6, s5, s4, f0 ; li s9, 8192    # c=7: channel free at 22, done 22+8+32 = 62
    wait f0 ; mxu.lw s6, f1                    # c=8 stalls to 62; weights ready at 70
    mxu.mms s0, s7, s8, f1                     # c=63: starts 70, done 70 + 16 + 2*8 = 102
    wait f1 ; dma.st s9, s7, s3, s4, f2        # c=64 stalls to 102; done 102 + 16 + 32 = 150
k1_2:
    li s10, 50                                 # c=103
loop_3:
    addi s10, s10, -1 ; vadd.f v1, v1, v2 ; vadd.f v4, v4, v2         # 50 iterations of 2 bundles: c=104..203
    bnz s10, loop_3 ; vld v3, s0, 0 ; vadd.f v5, v5, v2 ; vadd.f v6, v6, v2
k2_4:
    li s1, 100 ; li s2, 1000                   # c=204
    mxu.mm s0, s2, s1, f3                      # c=205, starts 205 (the MXU is idle since 86)
    mxu.mm s0, s2, s1, f3                      # c=206 starts 305
    mxu.mm s0, s2, s1, f3                      # c=207 starts 405
    mxu.mm s0, s2, s1, f3                      # c=208 starts 505
    mxu.mm s0, s2, s1, f3                      # c=209: 3 waiting -> issues, starts 605
    mxu.mm s0, s2, s1, f3                      # c=210: 4 waiting -> stalls to 305, starts 705
exit_5:
    halt                                       # c=306; last mm done 705 + 100 + 16 = 821
"""


def _run(profile: bool, text: str = PROGRAM) -> tuple[Simulator, RunStats]:
    rng = np.random.default_rng(0)
    sim = Simulator("small", profile=profile)
    sim.write_hbm(0, rng.standard_normal((16, 8)).astype(F32))
    sim.write_hbm(4096, np.eye(8, dtype=F32))
    sim.load(assemble(text, "profile.s"))
    return sim, sim.run()


@pytest.fixture(scope="module")
def profiled() -> tuple[RunStats, P.Profile]:
    sim, stats = _run(True)
    assert sim.recording is not None
    return stats, P.analyze(sim.recording, [{"kind": "matmul", "node": "mm_1", "module": "model.layers.0.mlp"},
                                            {"kind": "elementwise", "node": "add", "module": "model.layers.0"},
                                            {"kind": "matmul", "node": "mm_2", "module": "model.layers.1.mlp"}])


def _spans(prof: P.Profile, track: str) -> list[P.Span]:
    return [s for s in prof.spans if s.track == track]


def test_profiling_changes_no_result_and_no_cycle() -> None:
    plain_sim, plain = _run(False)
    prof_sim, prof = _run(True)
    assert plain_sim.recording is None and prof_sim.recording is not None
    strip = {"wall_seconds", "bundles_per_second"}
    assert {k: v for k, v in plain.as_dict().items() if k not in strip} == \
        {k: v for k, v in prof.as_dict().items() if k not in strip}
    np.testing.assert_array_equal(plain_sim.hbm, prof_sim.hbm)
    np.testing.assert_array_equal(plain_sim.vmem, prof_sim.vmem)
    np.testing.assert_array_equal(plain_sim.sregs, prof_sim.sregs)


def test_unit_tracks_add_up_to_the_statistics(profiled: tuple[RunStats, P.Profile]) -> None:
    stats, prof = profiled
    assert prof.cycles == stats.cycles == 821
    assert prof.busy_cycles(P.MXU_DATA) == stats.mxu_busy_cycles == 16 + 6 * 100
    assert sum(s.args["macs"] for s in _spans(prof, P.MXU_DATA)) == stats.macs
    assert len(_spans(prof, P.MXU_WEIGHTS)) == stats.mxu_weight_loads == 1
    dma = _spans(prof, P.DMA)
    assert len(dma) == stats.dma_commands
    assert sum(s.args["bytes"] for s in dma if s.name == "dma.ld") == stats.dma_bytes_loaded
    assert sum(s.args["bytes"] for s in dma if s.name == "dma.st") == stats.dma_bytes_stored
    for cause, cycles in stats.stall_cycles.items():
        assert sum(s.cycles for s in _spans(prof, P.STALLS) if s.name == cause) == cycles
    for slot in isa.SLOTS:
        spans = _spans(prof, f"slot {slot.name}")
        assert sum(s.args["ops"] for s in spans) == prof.busy_cycles(f"slot {slot.name}") == stats.slot_ops[slot.name]
        assert all(a.end < b.start for a, b in itertools.pairwise(spans))  # merged: never adjacent
    assert sum(k.bundles for k in prof.kernels) == stats.bundles
    assert sum(sum(k.slot_ops.values()) for k in prof.kernels) == sum(stats.slot_ops.values())


def test_spans_match_the_timing_worked_out_by_hand(profiled: tuple[RunStats, P.Profile]) -> None:
    _, prof = profiled
    assert [(s.name, s.start, s.end, s.args.get("flag")) for s in _spans(prof, P.STALLS)] == \
        [("wait", 8, 62, 0), ("wait", 64, 102, 1), ("mxu_queue", 210, 305, None)]
    assert [(s.name, s.start, s.end, s.args["done"]) for s in _spans(prof, P.DMA)] == \
        [("dma.ld", 6, 22, 54), ("dma.ld", 22, 30, 62), ("dma.st", 102, 118, 150)]
    assert [(s.start, s.end) for s in _spans(prof, P.MXU_WEIGHTS)] == [(62, 70)]
    assert [(s.start, s.end, s.args["done"]) for s in _spans(prof, P.MXU_DATA)] == \
        [(70, 86, 102)] + [(205 + 100 * i, 305 + 100 * i, 321 + 100 * i) for i in range(6)]
    # the loop's vector slots issue in every cycle of its 50 iterations (one span each); vld every other
    assert [(s.start, s.end) for s in _spans(prof, "slot v0")] == [(104, 204)]
    assert [(s.start, s.end) for s in _spans(prof, "slot v1")] == [(104, 204)]
    assert [(s.start, s.end) for s in _spans(prof, "slot vld")] == [(105 + 2 * i, 106 + 2 * i) for i in range(50)]
    # scalar slot s0: the loop's addi and the li before and after it make one span of every cycle 103..204
    assert (103, 105) in [(s.start, s.end) for s in _spans(prof, "slot s0")]


def test_kernel_spans_tile_the_run_in_program_order(profiled: tuple[RunStats, P.Profile]) -> None:
    _, prof = profiled
    spans = _spans(prof, P.KERNELS)
    assert [s.name for s in spans] == ["entry", "k0 mm_1", "k1 add", "k2 mm_2", "exit"]
    assert spans[0].start == 0 and spans[-1].end == prof.cycles
    assert all(a.end == b.start for a, b in itertools.pairwise(spans))
    # a kernel starts where its first bundle's stalls do; the exit covers the drain after halt
    assert [(s.start, s.end) for s in spans] == [(0, 2), (2, 103), (103, 204), (204, 306), (306, 821)]
    by = {k.label: k for k in prof.kernels}
    assert by["k0"].stall_cycles == {"wait": 54 + 38, "dma_queue": 0, "mxu_queue": 0}
    assert by["k2"].stall_cycles["mxu_queue"] == 95 and by["k1"].bundles == 1 + 100
    assert (by["k0"].dma_bytes_loaded, by["k0"].dma_bytes_stored, by["k0"].macs) == (24 * 32, 16 * 32, 16 * 64)
    assert [s.name for s in _spans(prof, P.LAYERS)] == ["model.layers.0", "model.layers.1"]
    assert [(s.start, s.end, s.args["kernels"]) for s in _spans(prof, P.LAYERS)] == [(2, 204, 2), (204, 306, 1)]


def test_roofline_names_the_binding_unit(profiled: tuple[RunStats, P.Profile]) -> None:
    _, prof = profiled
    rows = {r["kernel"]: r for r in prof.roofline()}
    assert sum(r["cycles"] for r in rows.values()) == prof.cycles
    k2 = rows["k2"]  # 600 rows streamed in 102 cycles of issue: the MXU's work outlasts the kernel
    assert (k2["macs"], k2["mxu_cycles"], k2["bound"]) == (600 * 64, 600.0, "mxu")
    assert k2["pct_of_bound"] == pytest.approx(100 * 600 / 102, abs=0.1)
    k0 = rows["k0"]  # 1.3 KB over 32 B/cycle = 40 cycles in 101: mostly waiting
    assert k0["hbm_bytes"] == 40 * 32 and k0["hbm_cycles"] == 40.0 and k0["bound"] == "latency"
    assert k0["dma_commands"] == 3
    k1 = rows["k1"]  # 200 vadds over two vector slots in 101 cycles
    assert k1["vpu_cycles"] == 100.0 and k1["bound"] == "vpu" and k1["pct_of_bound"] == pytest.approx(99.0, abs=0.1)
    text = P.format_roofline(prof.roofline(), top=2)  # the two longest (the exit's drain, k2), in program order
    assert [line.split()[0] for line in text.splitlines()[2:]] == ["k2", "exit"]


def test_chrome_trace_loads_with_one_named_thread_per_track(profiled: tuple[RunStats, P.Profile],
                                                            tmp_path) -> None:  # type: ignore[no-untyped-def]
    _, prof = profiled
    path = P.write_trace(prof, tmp_path / "t.json")
    trace = json.loads(path.read_text())
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"}
    assert sorted(names.values()) == sorted(P.TRACKS)
    complete = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(complete) == len(prof.spans)
    for e, s in zip(complete, prof.spans, strict=True):
        assert names[e["tid"]] == s.track and e["name"] == s.name
        assert round(e["ts"] * prof.config.clock_mhz) == s.start == e["args"]["cycle"]
        assert round(e["dur"] * prof.config.clock_mhz) == s.cycles == e["args"]["cycles"]


def test_a_program_without_kernel_labels_is_one_kernel() -> None:
    sim, stats = _run(True, "\n".join(ln for ln in PROGRAM.splitlines() if not ln.endswith(":") or "loop" in ln))
    prof = P.analyze(sim.recording)  # type: ignore[arg-type]
    assert [(s.name, s.start, s.end) for s in _spans(prof, P.KERNELS)] == [("program", 0, stats.cycles)]
    assert not _spans(prof, P.LAYERS) and not prof.has_layers


def test_profile_is_off_by_default_and_costs_no_recording() -> None:
    sim, _ = _run(False)
    assert sim.recording is None and sim.m.dma.rec is None and sim.m.mxu.rec is None
