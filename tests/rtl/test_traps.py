"""Every trap of docs/architecture.md's list, through a tiny program on the RTL and on the simulator: the
same kind, bundle (pc) and cycle. Races are simulator-only (the RTL need only match race-free programs).
"""

from __future__ import annotations

import pytest

from device_sim import isa
from device_sim.asm import assemble
from device_sim.program import Program
from device_sim.rtl.diff import diff_batch, simulate
from device_sim.rtl.runner import RtlJob, run_batch_on_rtl

pytestmark = pytest.mark.rtl

# name: (expected code, expected pc, program). Bundle 0 and 1 set registers in most programs.
PROGRAMS: dict[str, tuple[str, int, str]] = {
    "vld_oob": ("VMEM_OOB", 2, "li s1, 4090\nnop\nvld v1, s1, 0\nhalt"),
    "vld_row_oob": ("VMEM_OOB", 2, "li s1, 4095\nnop\nvld.row v1, s1, 1\nhalt"),
    "vld_negative": ("VMEM_OOB", 2, "li s1, 3\nnop\nvld v1, s1, -4\nhalt"),
    "vst_oob": ("VMEM_OOB", 2, "li s1, 4089\nnop\nvst v1, s1, 0\nhalt"),
    "dma_vmem_oob": ("VMEM_OOB", 3,
                     "li s1, 4095 ; li s2, 9\nlih s2, 1 ; li s3, 9\nnop\ndma.ld s0, s1, s2, s3, f0\nhalt"),
    "lw_oob": ("VMEM_OOB", 2, "li s1, 4089\nnop\nmxu.lw s1, f0\nhalt"),
    "mm_out_oob": ("VMEM_OOB", 2, "li s1, 4090 ; li s2, 8\nnop\nmxu.mm s0, s1, s2, f0\nhalt"),
    "mm_in_negative": ("VMEM_OOB", 2, "li s1, -2 ; li s2, 1\nli s3, 100\nmxu.mm s1, s3, s2, f0\nhalt"),
    "hbm_oob": ("HBM_OOB", 3,
                "li s1, 0 ; li s2, 4\nlih s1, 0x100 ; lih s2, 1\nli s3, 4\ndma.ld s1, s0, s2, s3, f0\nhalt"),
    "hbm_oob_stride": ("HBM_OOB", 3,
                       "li s1, 4 ; li s2, 4\nlih s2, 100 ; li s3, 0x7fff\nlih s3, 0x10\n"
                       "dma.st s0, s1, s2, s3, f0\nhalt"),
    "misaligned_f32": ("MISALIGNED", 2, "li s1, 2 ; li s2, 1\nlih s2, 1\ndma.ld s1, s0, s2, s2, f0\nhalt"),
    "misaligned_bf16": ("MISALIGNED", 2, "li s1, 1 ; li s2, 1\nlih s2, 1\ndma.st.bf16 s1, s0, s2, s2, f0\nhalt"),
    "dma_zero_cols": ("ZERO_SHAPE", 2, "li s2, 0\nlih s2, 1\ndma.ld s0, s0, s2, s0, f0\nhalt"),
    "dma_zero_rows": ("ZERO_SHAPE", 1, "li s2, 5\ndma.st s0, s0, s2, s0, f0\nhalt"),
    "mm_zero_rows": ("ZERO_SHAPE", 1, "li s1, 16\nmxu.mms s0, s1, s0, f0\nhalt"),
    "mm_too_many_rows": ("ZERO_SHAPE", 1, "li s1, 4097\nmxu.mm s0, s1, s1, f0\nhalt"),
    "mm_overlap": ("MM_OVERLAP", 1, "li s1, 4 ; li s2, 8\nmxu.mma s0, s1, s2, f0\nhalt"),
    "store_overlap": ("STORE_OVERLAP", 3,
                      "li s2, 4 ; li s3, 3\nlih s2, 2\nnop\ndma.st s0, s0, s2, s3, f0\nhalt"),
    "store_overlap_bf16": ("STORE_OVERLAP", 2,
                           "li s2, 9 ; li s3, 0\nlih s2, 3\ndma.st.bf16 s0, s0, s2, s3, f0\nhalt"),
    "pc_end": ("PC_END", 2, "li s1, 1\nnop"),
    "pc_end_after_branch": ("PC_END", 3, "li s1, 1\nbnz s1, 2\nnop"),
    "cycle_limit": ("CYCLE_LIMIT", 1, "nop\nl: jmp l"),
    "cycle_limit_in_stall": ("CYCLE_LIMIT", 3,
                             "li s2, 8 ; li s3, 8\nlih s2, 0x7ff\ndma.ld s0, s0, s2, s3, f1\nwait f1\nhalt"),
    "conflict_scalar": ("WRITE_CONFLICT", 1, "nop\nli s3, 1 ; li s3, 2\nhalt"),
    "conflict_s0": ("WRITE_CONFLICT", 0, "li s0, 1 ; addi s0, s0, 1\nhalt"),
    "conflict_vext_then_scalar": ("WRITE_CONFLICT", 2, "nop\nvext s4, v1, 3\nli s4, 7\nhalt"),
    "conflict_two_vexts": ("WRITE_CONFLICT", 1, "nop\nvext s4, v1, 3 ; vext s4, v2, 0\nhalt"),
    "conflict_reduction_then_alu": ("WRITE_CONFLICT", 3,
                                    "nop\nvred.sum.l v5, v1\nnop\nvadd.f v5, v1, v2\nhalt"),
    "conflict_reduction_then_vld": ("WRITE_CONFLICT", 3, "nop\nvred.max.s v5, v1\nnop\nvld v5, s0, 0\nhalt"),
    "conflict_two_reductions": ("WRITE_CONFLICT", 0, "vred.sum.s v5, v1 ; vred.max.l v5, v2\nhalt"),
    "conflict_alu_and_vld": ("WRITE_CONFLICT", 1, "nop\nvmov v5, v1 ; vld v5, s0, 8\nhalt"),
    "conflict_two_alus": ("WRITE_CONFLICT", 0, "viota v7, 1 ; vbcast v7, s0\nhalt"),
    "lane_range": ("LANE_RANGE", 1, "nop\nvext s1, v2, 64\nhalt"),
    "lane_negative": ("LANE_RANGE", 0, "vext s1, v2, -1\nhalt"),
    # several traps in one bundle: the simulator's order (MXU, DMA, s0, s1, v0, v1, vld, vst) decides
    "order_mxu_before_dma": ("MM_OVERLAP", 1, "li s1, 1\nmxu.mm s0, s0, s1, f0 ; dma.ld s0, s0, s0, s0, f1\nhalt"),
    "order_scalar_before_lane": ("WRITE_CONFLICT", 2,
                                 "nop\nvext s4, v1, 3\nli s4, 1 ; vext s5, v1, 99\nhalt"),
    "order_lane_before_vld": ("LANE_RANGE", 1, "li s1, 5000\nvld v1, s1, 0 ; vext s2, v1, 70\nhalt"),
    "order_v0_conflict_before_v1_lane": ("WRITE_CONFLICT", 2,
                                         "vred.sum.l v3, v1\nnop\nvmov v3, v2 ; vext s1, v1, 64\nhalt"),
    "order_vld_before_vst": ("VMEM_OOB", 1, "li s1, 4095\nvld v1, s1, 0 ; vst v2, s0, 0\nhalt"),
    "order_conflict_before_vst": ("WRITE_CONFLICT", 1, "li s1, 4095\nvmov v1, v2 ; vld v1, s0, 0 ; "
                                                      "vst v2, s1, 0\nhalt"),
    # not traps: overlapping load rows only read; an exactly full vmem / HBM is in bounds
    "load_rows_overlap_ok": ("", 0, "li s2, 4 ; li s3, 1\nlih s2, 3\ndma.ld s0, s0, s2, s3, f0\nwait f0\nhalt"),
    "vext_last_lane_ok": ("", 0, "vext s1, v2, 63\nvld v1, s1, 4088\nhalt"),
}


def _job(text: str, name: str) -> RtlJob:
    max_cycles = 1000 if name.startswith("cycle_limit") else 100_000
    return RtlJob(assemble(text, f"{name}.s"), {}, max_cycles=max_cycles, trace=True)


def _illegal_programs() -> dict[str, tuple[int, Program]]:
    """Programs the loader rejects: (pc of the bad bundle, program)."""
    ok = assemble("li s1, 1\nnop\nnop\nhalt", "base.s")
    viota = isa.encode_slot(isa.BY_MNEMONIC["viota"], {"d": 1, "imm": 2}) + 1  # mode 3
    add = isa.encode_slot(isa.BY_MNEMONIC["add"], {"d": 1, "a": 2, "b": 3})
    words = {
        "unknown_opcode": (4, 0xFF000000),
        "wrong_slot": (2, add),  # a scalar op in v0
        "reserved_bits": (0, add | 0xF),
        "viota_mode": (2, viota),
    }
    out = {}
    for name, (slot, word) in words.items():
        bundles = [list(b) for b in ok.bundles]
        bundles[2][slot] = word
        out[name] = (2, Program([tuple(b) for b in bundles]))
    jmp_out = assemble("nop\nnop\nhalt", "jmp.s")
    bundles = [list(b) for b in jmp_out.bundles]
    bundles[1][8] = isa.encode_slot(isa.BY_MNEMONIC["jmp"], {"imm": 7})
    out["branch_target_outside"] = (1, Program([tuple(b) for b in bundles]))
    return out


def test_every_trap_matches_the_simulator() -> None:
    names = list(PROGRAMS)
    jobs = [_job(PROGRAMS[n][2], n) for n in names]
    illegal = _illegal_programs()
    names += list(illegal)
    jobs += [RtlJob(p, {}, trace=True) for _, p in illegal.values()]
    reports = diff_batch(jobs, names)
    failures = [r.summary() for r in reports if not r.ok]
    expected = {n: (c, pc) for n, (c, pc, _) in PROGRAMS.items()}
    expected.update({n: ("PC_END" if n.startswith("branch") else "ILLEGAL", pc) for n, (pc, _) in illegal.items()})
    for r in reports:
        code, pc = expected[r.name]
        got = (r.sim_trap.code, r.sim_trap.pc) if r.sim_trap else ("", 0)
        if got != (code, pc):
            failures.append(f"{r.name}: the simulator trapped {r.sim_trap}, the test expects {code} at {pc}")
    assert not failures, "\n".join(failures)


def test_core_traps_at_fetch_without_the_loader() -> None:
    """The loader catches illegal bundles; a core released without it traps when it fetches one."""
    illegal = _illegal_programs()
    jobs = [RtlJob(p, {}, loader=False) for _, p in illegal.values()]
    results = run_batch_on_rtl(jobs)
    for (name, (pc, _)), res in zip(illegal.items(), results, strict=True):
        want = "PC_END" if name.startswith("branch") else "ILLEGAL"
        # the bad branch is taken at bundle 1, so the core traps fetching bundle 7
        want_pc = 7 if name.startswith("branch") else pc
        assert res.trap is not None and (res.trap.code, res.trap.pc) == (want, want_pc), f"{name}: {res.trap}"


def test_the_simulator_traps_on_races() -> None:
    """Races are the simulator's to catch (documented: the RTL only matches race-free programs)."""
    run = simulate(_job("li s2, 8\nlih s2, 8\ndma.ld s0, s0, s2, s2, f0\nvld v1, s0, 0\nhalt", "race"))
    assert run.trap is not None and run.trap.code == "RACE" and run.trap.pc == 3
