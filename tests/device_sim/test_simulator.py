"""The simulator's timing on small hand-checked programs, its statistics, and its traps."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from sim_helpers import run_asm

from device_sim import isa
from device_sim.asm import assemble
from device_sim.config import get_config
from device_sim.numerics import round_to_bf16
from device_sim.program import Program
from device_sim.simulator import CtpuTrap, Simulator, merge_ranges

F32 = np.float32


def test_results_land_exactly_at_issue_plus_latency() -> None:
    sim, st = run_asm("""
        li s1, 5
        add s2, s1, s1 ; li s3, 2       # scalar latency 1: sees s1 = 5
        vbcast v1, s2
        vadd.i v2, v1, v1               # vector latency 2: v1 not landed yet, reads 0
        vadd.i v3, v1, v1               # now it has: 10 + 10
        halt
    """)
    assert list(sim.sregs[:4]) == [0, 5, 10, 2]
    assert sim.vregs[2].max() == 0 and (sim.vregs[3] == 20).all()
    # 6 bundles, one per cycle; the last vadd.i (cycle 4, latency 2) lands at 6 = the drained end
    assert (st.bundles, st.cycles) == (6, 6)
    assert st.slot_ops["s0"] == 2 and st.slot_ops["s1"] == 1 and st.slot_ops["v0"] == 3


def test_counted_loop_costs_one_cycle_per_iteration() -> None:
    _, st = run_asm("""
        li s1, 100
    loop:
        addi s1, s1, -1 ; addi s2, s2, 3
        bnz s1, loop          # reads s1 from the previous bundle: counts 100 iterations of 2 bundles
        halt
    """)
    assert st.bundles == 1 + 100 * 2 + 1 and st.cycles == st.bundles


def test_dma_and_mxu_timing_by_hand() -> None:
    a = np.random.default_rng(0).standard_normal((16, 8)).astype(F32)
    w = np.eye(8, dtype=F32)
    sim, st = run_asm("""
        li s1, 0 ; li s2, 4096
        li s3, 8 ; li s4, 8
        lih s3, 16              # shape 16 x 8
        li s5, 8 ; li s6, 100
        lih s5, 8               # shape 8 x 8
        li s7, 200 ; li s8, 16
        dma.ld s1, s0, s3, s4, f0                  # c=6: start 6, 16 rows x 1 cycle, done 6+16+32 = 54
        dma.ld s2, s6, s5, s4, f0 ; li s9, 8192    # c=7: channel free at 22, done 22+8+32 = 62
        wait f0 ; mxu.lw s6, f1                    # c=8 stalls to 62; weights ready at 70
        mxu.mms s0, s7, s8, f1                     # c=63: starts 70, done 70 + 16 + 2*8 = 102
        wait f1 ; dma.st s9, s7, s3, s4, f2        # c=64 stalls to 102; done 102 + 16 + 32 = 150
        halt                                       # c=103; drained at 150
    """, {0: a, 4096: w})
    assert st.cycles == 150 and st.bundles == 12
    assert st.stall_cycles["wait"] == (62 - 8) + (102 - 64)
    assert st.mxu_busy_cycles == 16 and st.macs == 16 * 64
    assert st.dma_bytes_loaded == (16 + 8) * 8 * 4 and st.dma_bytes_stored == 16 * 8 * 4
    np.testing.assert_array_equal(sim.read_hbm(8192, (16, 8), F32), a.astype(np.float32) * 0 + _bf(a))


def test_wide_vmem_port_timing_by_hand() -> None:
    """vmem_port_rows P = 4 (as on `large`): a DMA moves up to P vmem rows per cycle unless HBM's bytes per
    cycle bind; weight_port_rows W = 4: a weight load takes N / W cycles; 1 and 1 is the one-row rule above."""
    cfg = dataclasses.replace(get_config("small"), name="wide", hbm_bytes_per_cycle=64, vmem_port_rows=4,
                              weight_port_rows=4)
    w = np.eye(8, dtype=F32)
    text = """
        li s3, 8 ; li s4, 8
        lih s3, 16 ; li s2, 4096                   # shape 16 x 8
        li s5, 8 ; li s6, 100
        lih s5, 8 ; li s8, 1                       # shape 8 x 8
        li s7, 200 ; dma.ld.bf16 s0, s0, s3, s4, f0   # c=4: 16 rows of 16 B: port-bound, 4 cycles; done 4+4+32 = 40
        dma.ld s2, s6, s5, s4, f0                  # c=5: 8 rows of 32 B = 256 B: HBM-bound, 4 cycles from 8; done 44
        wait f0 ; mxu.lw s6, f1                    # c=6 stalls to 44; weights ready at 44 + 8 / 4 = 46
        mxu.mms s0, s7, s8, f1                     # c=45: starts 46, done 46 + 1 + 16 = 63
        halt                                       # c=46; drained at 63
    """
    hbm = {0: np.ones((16, 8), np.uint16), 4096: w}
    _, st = run_asm(text, hbm, config=cfg)
    assert st.cycles == 63 and st.stall_cycles["wait"] == 44 - 6
    _, narrow = run_asm(text, hbm, config=dataclasses.replace(cfg, vmem_port_rows=1, weight_port_rows=1))
    # one row per cycle: 16 + 8 rows, then 8 cycles of weights: done 4+16+32, 20+8+32 = 60, mms at 68, end 85
    assert narrow.cycles == 85
    # the weight port alone one row per cycle: the DMAs as above (done 44), weights ready at 44 + 8 = 52
    _, slow_weights = run_asm(text, hbm, config=dataclasses.replace(cfg, weight_port_rows=1))
    assert slow_weights.cycles == 63 + 52 - 46
    with pytest.raises(ValueError, match="vmem_port_rows 3 must divide lanes 8"):
        dataclasses.replace(cfg, vmem_port_rows=3)
    with pytest.raises(ValueError, match="weight_port_rows 3 must divide lanes 8"):
        dataclasses.replace(cfg, weight_port_rows=3)


def _bf(x: np.ndarray) -> np.ndarray:
    from device_sim.numerics import round_to_bf16

    return round_to_bf16(x)


def test_mxu_fifo_full_stalls_issue() -> None:
    # five 100-row mms back to back: the FIFO holds 4 waiting commands, the fifth waits for the first start
    _, st = run_asm("""
        li s1, 100 ; li s2, 1000
        mxu.mm s0, s2, s1, f0          # c=1 starts 1
        mxu.mm s0, s2, s1, f0          # c=2 starts 101
        mxu.mm s0, s2, s1, f0          # c=3 starts 201
        mxu.mm s0, s2, s1, f0          # c=4 starts 301
        mxu.mm s0, s2, s1, f0          # c=5: waiting = 101, 201, 301 (3 < 4) -> issues, starts 401
        mxu.mm s0, s2, s1, f0          # c=6: 4 waiting -> stalls to 101, starts 501
        halt                           # c=102; last mm done 501 + 100 + 16 = 617
    """)
    assert st.stall_cycles["mxu_queue"] == 101 - 6
    assert st.cycles == 617 and st.mxu_busy_cycles == 600


def test_reading_a_dma_destination_before_wait_is_a_race() -> None:
    with pytest.raises(CtpuTrap, match=r"bundle 3 .*vld v1, s0, 0: vld touches vmem rows \[0, 8\) owned by .*bundle 2"):
        run_asm("""
            li s1, 8 ; li s2, 8
            lih s1, 8
            dma.ld s0, s0, s1, s2, f0
            vld v1, s0, 0
            halt
        """)


def test_mm_outputs_may_follow_each_other_but_not_be_read_early() -> None:
    run_asm("""
        li s1, 8 ; li s2, 100
        mxu.mm s0, s2, s1, f0
        mxu.mma s0, s2, s1, f0
        wait f0 ; vld v1, s2, 0
        halt
    """)
    with pytest.raises(CtpuTrap, match="race"):
        run_asm("""
            li s1, 8 ; li s2, 100
            mxu.mm s0, s2, s1, f0
            vld v1, s2, 0
            halt
        """)


@pytest.mark.parametrize("text,message", [
    ("vld v1, s0, 4095\nhalt", r"vmem rows \[4095, 4103\) out of bounds"),
    ("li s1, -1\nvst v1, s1, 0\nhalt", r"vmem rows \[-1, 7\) out of bounds"),
    ("li s1, 1\nli s2, 1\nlih s2, 1\ndma.ld s1, s0, s2, s2, f0\nhalt", "not aligned"),
    ("li s2, 1\ndma.ld s0, s0, s2, s2, f0\nhalt", "rows and cols must be >= 1"),
    ("li s1, 8\nmxu.mm s0, s0, s1, f0\nhalt", "overlap its input"),
    ("li s1, 5\nli s1, 6", "ran past the end of the program"),
    ("loop: jmp loop", "cycle limit"),
    ("vred.sum.l v1, v2\nnop\nvadd.f v1, v2, v3\nnop\nnop\nhalt", r"bundle 2 .*two results would land in v1"),
    ("li s3, 1 ; li s3, 2\nhalt", "two results would land in s3"),
    ("li s1, 4\nlih s1, 2\nli s2, 2\ndma.st s0, s0, s1, s2, f0\nhalt", "HBM rows would overlap"),
])
def test_traps_name_the_bundle_and_reason(text: str, message: str) -> None:
    with pytest.raises(CtpuTrap, match=message) as err:
        run_asm(text, max_cycles=1000)
    assert "trap at bundle" in str(err.value) and "(test.s" in str(err.value)


def test_hbm_out_of_bounds_dma() -> None:
    with pytest.raises(CtpuTrap, match=r"HBM bytes .* out of bounds"):
        run_asm("li s1, 8\nlih s1, 1\nli s2, 8\nlih s3, 256\ndma.ld s3, s0, s1, s2, f0\nhalt")


def test_illegal_encoding_traps_at_load_naming_the_bundle() -> None:
    good = assemble("nop\nhalt")
    bad = Program([good.bundles[0], (0x30 << 24,) + (0,) * (isa.NUM_SLOTS - 1), good.bundles[1]])
    with pytest.raises(CtpuTrap, match=r"bundle 1.*illegal encoding.*vadd.f belongs to the vector unit"):
        Simulator("small").load(bad)
    reserved = Program([(isa.BY_MNEMONIC["halt"].opcode << 24 | 1,) + (0,) * 8][::-1][0:1])
    reserved = Program([(0,) * 8 + (isa.BY_MNEMONIC["halt"].opcode << 24 | 1,)])
    with pytest.raises(CtpuTrap, match="reserved bits"):
        Simulator("small").load(reserved)


def test_hbm_persists_across_loads_and_host_access_is_checked() -> None:
    sim = Simulator("small")
    sim.write_hbm(64, np.arange(4, dtype=np.int32))
    sim.load(assemble("halt"))
    sim.run()
    np.testing.assert_array_equal(sim.read_hbm(64, (4,), np.int32), np.arange(4))
    with pytest.raises(ValueError, match="out of bounds"):
        sim.write_hbm(sim.config.hbm_bytes - 2, np.zeros(4, np.uint8))


def test_stats_are_json_ready() -> None:
    import json

    _, st = run_asm("li s1, 3 ; vbcast v1, s0\nhalt")
    d = json.loads(json.dumps(st.as_dict()))
    assert d["bundles"] == 2 and d["slot_occupancy"]["s0"] == 0.5 and d["config"] == "small"


def test_run_stats_name_the_hbm_bytes_the_stores_wrote() -> None:
    """`hbm_written`: merged byte ranges of every dma.st (what a host copy must read back), none for loads."""

    assert merge_ranges([(40, 48), (0, 8), (8, 16), (30, 41)]) == [(0, 16), (30, 48)]
    src = """
        li s2, 0
        li s3, 256
        li s4, 1024
        li s5, 65544
        li s6, 8
        dma.ld s3, s2, s5, s6, f0
        wait f0
        dma.st s4, s2, s5, s6, f1
        li s7, 2048
        li s8, 65537
        dma.st s7, s2, s8, s6, f1
        wait f1
        halt
    """
    sim = Simulator("small")
    sim.load(assemble(src))
    stats = sim.run()
    assert stats.hbm_written == [(1024, 1056), (2048, 2052)]
    assert stats.written_within(1040, 4096) == [(1040, 1056), (2048, 2052)]
    assert "hbm_written" not in stats.as_dict()


@pytest.mark.parametrize("half", ["lo", "hi"])
def test_a_packed_weight_load_gives_the_bits_and_cycles_of_a_widened_one(half: str) -> None:
    """W [8, 16] bf16 row-major, edge values included: `dma.ld` of its raw words (two bf16 a word, a row of W
    in 8 words) then `mxu.lwt.<half>` loads W[:, 0:8] (lo) or W[:, 8:16] (hi) as `dma.ld.bf16` of those
    columns then `mxu.lwt` does, in half the vmem: the same products, bit for bit, in the same cycles."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 16)).astype(F32)
    w[0, :8] = [0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3e38, 1.0]  # bf16: subnormal, near the largest
    w[5, 8:] = [np.nan, -1e-39, 3.3e38, -0.0, np.inf, 0.0, -np.inf, 2.0]
    bits = (w.view(np.uint32) >> 16).astype(np.uint16)  # truncated to bf16: exact in both paths
    x = rng.standard_normal((4, 8)).astype(F32)
    col = 0 if half == "lo" else 8
    common = """
        li s1, 0x1000 ; li s2, 100
        li s3, 8 ; li s4, 8
        lih s3, 4 ; li s5, 0
        li s6, 300 ; li s7, 4
        dma.ld s1, s5, s3, s4, f0                # x: 4 rows of 8 f32
    """
    packed, packed_st = run_asm(common + f"""
        li s8, 8 ; li s9, 8
        lih s8, 8
        dma.ld s0, s2, s8, s9, f0                # W's 8 rows, 8 raw words each
        wait f0 ; mxu.lwt.{half} s2, f1
        mxu.mms s5, s6, s7, f1
        wait f1
        halt
    """, {0: bits, 0x1000: x})
    widened, widened_st = run_asm(common + f"""
        li s8, 8 ; li s9, 16
        lih s8, 8 ; li s10, {2 * col}
        dma.ld.bf16 s10, s2, s8, s9, f0          # W[:, col:col+8] widened, a row each
        wait f0 ; mxu.lwt s2, f1
        mxu.mms s5, s6, s7, f1
        wait f1
        halt
    """, {0: bits, 0x1000: x})
    out = packed.vmem[300:304].copy()
    np.testing.assert_array_equal(out, widened.vmem[300:304])
    assert packed_st.cycles == widened_st.cycles and packed_st.mxu_weight_loads == 1
    wb = (bits[:, col:col + 8].astype(np.uint32) << 16).view(F32).astype(np.float64)
    with np.errstate(all="ignore"):
        expect = (round_to_bf16(x).astype(np.float64)[:, :, None] * wb.T[None]).sum(1)  # NaN/inf where they reach
    np.testing.assert_array_equal(np.isnan(out.view(F32)), np.isnan(expect))
    finite = np.isfinite(expect) & (np.abs(expect) < 1e30)
    np.testing.assert_allclose(out.view(F32)[finite], expect[finite], rtol=1e-5, atol=1e-30)
