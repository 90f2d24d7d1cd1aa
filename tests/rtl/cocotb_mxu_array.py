"""cocotb bench for ctpu_mxu_array alone: the N x N weight-stationary systolic array.

Driver: presents weight rows (win_*: row i of a load in the cycle after row i-1, into bank 0 or 1, plain or
transposed) and activation rows (xin_*: one row per cycle with the bank it uses), already rounded to bf16
as the MXU's ports do. Monitor: samples out_o every cycle. Golden model: `device_sim.numerics.mxu_matmul`
(bf16 x bf16 products as fp32, k-ascending fp32 sums) against the weights the row's bank held when it was
presented. Checker: row r presented in cycle c must appear, bit exact, at out_o in cycle c + 2N (the
timing docs/architecture.md's `done = start + rows + 2N` relies on). Scenarios: both banks, lw and lwt,
a weight load into one bank while rows of the other stream (double buffering: the load starts with the
first row of the other bank, as `shadow_free` allows), gaps between rows, fp specials. Ends asserting zero
errors. Signals are driven and sampled at the falling edge (cycle c = between rising edges c and c + 1).
"""

from __future__ import annotations

import os

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, FallingEdge

from device_sim import numerics

SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-40, -3e38, 65504.0], np.float32)


def pack(values: np.ndarray) -> int:
    return int.from_bytes(np.ascontiguousarray(values, np.float32).view("<u4").tobytes(), "little")


def unpack(value: int, n: int) -> np.ndarray:
    return np.frombuffer(value.to_bytes(n * 4, "little"), "<u4").copy()


def rand_matrix(rng: np.random.Generator, shape: tuple[int, int], specials: bool) -> np.ndarray:
    m = rng.standard_normal(shape).astype(np.float32) * np.float32(rng.choice([0.01, 1.0, 1e6]))
    if specials:
        mask = rng.random(shape) < 0.05
        m[mask] = rng.choice(SPECIALS, size=int(mask.sum()))
    return numerics.round_to_bf16(m)


class ArrayBench:
    def __init__(self, dut, n: int) -> None:
        self.dut, self.n = dut, n
        self.cycle = 0
        self.banks = [np.zeros((n, n), np.float32), np.zeros((n, n), np.float32)]
        self.weight_ops: dict[int, tuple[int, int, bool, np.ndarray]] = {}  # cycle -> (row i, bank, t, row)
        self.row_ops: dict[int, tuple[int, np.ndarray]] = {}  # cycle -> (bank, x row)
        self.expected: dict[int, np.ndarray] = {}  # cycle -> output row bits
        self.errors: list[str] = []
        self.checked = 0

    def load(self, start: int, bank: int, w: np.ndarray, transpose: bool) -> None:
        """Schedule an N-cycle weight load; the golden bank changes once the load has completed."""
        for i in range(self.n):
            self.weight_ops[start + i] = (i, bank, transpose, w[i])

    def stream(self, start: int, bank: int, x: np.ndarray, gap: int = 0) -> int:
        c = start
        for row in x:
            self.row_ops[c] = (bank, row)
            c += 1 + gap
        return c

    async def run(self, cycles: int) -> None:
        dut, n = self.dut, self.n
        pending_w: dict[int, np.ndarray] = {}
        for _ in range(cycles):
            await FallingEdge(dut.clk)
            c = self.cycle
            # monitor + checker: out_o during this cycle
            if c in self.expected:
                got = unpack(int(dut.out_o.value), n)
                want = self.expected.pop(c)
                self.checked += 1
                if not np.array_equal(got, want):
                    bad = int(np.argmax(got != want))
                    self.errors.append(f"cycle {c}: out lane {bad} = {got[bad]:#010x}, want {want[bad]:#010x}")
            # driver: weights
            if c in self.weight_ops:
                i, bank, t, row = self.weight_ops[c]
                dut.win_v_i.value, dut.win_idx_i.value, dut.win_bank_i.value = 1, i, bank
                dut.win_t_i.value, dut.win_i.value = int(t), pack(row)
                w = pending_w.setdefault(bank, self.banks[bank].copy())
                if t:
                    w[:, i] = row
                else:
                    w[i, :] = row
                if i == n - 1:  # rows presented from the next cycle on use the new weights
                    self.banks[bank] = pending_w.pop(bank)
            else:
                dut.win_v_i.value = 0
            # driver: activation rows, and what the golden model expects 2N cycles later
            if c in self.row_ops:
                bank, row = self.row_ops[c]
                dut.xin_v_i.value, dut.xin_bank_i.value, dut.xin_i.value = 1, bank, pack(row)
                p = numerics.mxu_matmul(row[None, :], self.banks[bank])[0]
                self.expected[c + 2 * n] = p.view(np.uint32)
            else:
                dut.xin_v_i.value = 0
            self.cycle += 1


@cocotb.test()
async def systolic_array_matches_mxu_matmul(dut) -> None:
    n = int(os.environ.get("CTPU_ARRAY_N", "8"))
    rng = np.random.default_rng(int(os.environ.get("CTPU_ARRAY_SEED", "5")))
    cocotb.start_soon(Clock(dut.clk, 10, "ns").start())
    dut.rst_n.value = 0
    dut.win_v_i.value = 0
    dut.xin_v_i.value = 0
    await ClockCycles(dut.clk, 2)
    dut.rst_n.value = 1
    bench = ArrayBench(dut, n)
    c = 2
    for trial in range(12):
        specials = trial % 3 == 2
        w0, w1, w2 = (rand_matrix(rng, (n, n), specials) for _ in range(3))
        rows0, rows1, rows2 = (int(rng.integers(1, 3 * n)) for _ in range(3))
        x0, x1, x2 = (rand_matrix(rng, (r, n), specials) for r in (rows0, rows1, rows2))
        bank = trial % 2
        bench.load(c, bank, w0, transpose=bool(trial & 2))
        bench.load(c + n, 1 - bank, w1, transpose=not trial & 2)
        s1 = c + 2 * n  # weights_ready of the second load
        end0 = bench.stream(s1, bank, x0, gap=int(trial == 4))
        s2 = end0
        end1 = bench.stream(s2, 1 - bank, x1)
        # double buffering: reload `bank` from the cycle the other bank's rows start (shadow_free)
        bench.load(s2, bank, w2, transpose=False)
        s3 = max(end1, s2 + n)
        c = bench.stream(s3, bank, x2) + int(rng.integers(0, 3))
    await bench.run(c + 2 * n + 4)
    for e in bench.errors[:20]:
        dut._log.error(e)
    dut._log.info(f"checked {bench.checked} output rows, {len(bench.errors)} errors")
    assert bench.checked > 100 and not bench.expected, "rows were scheduled but not checked"
    assert not bench.errors, f"{len(bench.errors)} mismatching output rows; first: {bench.errors[0]}"
