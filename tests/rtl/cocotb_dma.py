"""cocotb bench for ctpu_dma alone: the DMA engine between an HBM model and a vmem model.

Driver: issues random commands (dma.ld/st, f32 and bf16, 1..5 rows, partial rows of 1..4 vmem rows,
strides below, at and above cols for loads, stride >= cols for multi-row stores), back to back or with
gaps, respecting full_o like the core; a few illegal commands check trap_o without issuing. Models: vmem
(combinational read, write at the clock) and HBM (a read answers on the next clock, a write happens at the
clock), as ctpu_tb_top provides them. Monitor: records every vmem and HBM write with its cycle. Golden
model: the spec's 2-D copy (docs/architecture.md, DMA) applied in issue order (one channel, in order), with
`device_sim.numerics` for bf16 (exact widening, RNE rounding, canonical NaN), zero fill past cols, and the
timing formulas start = max(t, previous start, channel_free), done = start + xfer + latency. Checker:
done_o at issue, each command's writes inside [start, start + xfer], final vmem and HBM bit exact.
Ends asserting zero errors. Signals are driven and sampled at the falling edge (cycle c).
"""

from __future__ import annotations

import os

import cocotb
import numpy as np
from cocotb.clock import Clock
from cocotb.triggers import ClockCycles, FallingEdge, Timer

from device_sim import numerics

LANES, ROWS, HBM, BPC, LATENCY, QUEUE = 8, 512, 1 << 16, 32, 32, 8
TRAP_NONE = 0


def pack_row(words: np.ndarray) -> int:
    return int.from_bytes(np.ascontiguousarray(words, np.uint32).astype("<u4").tobytes(), "little")


class Golden:
    """The spec: data movement in issue order, and the timing formulas."""

    def __init__(self, vmem: np.ndarray, hbm: np.ndarray) -> None:
        self.vmem, self.hbm = vmem.copy(), hbm.copy()
        self.last_start = 0
        self.channel_free = 0

    def schedule(self, t: int, rows: int, cols: int, esize: int) -> tuple[int, int, int]:
        pitch = -(-cols // LANES)
        chunk = sum(-(-min(LANES, cols - q * LANES) * esize // BPC) for q in range(pitch))
        xfer = rows * chunk
        start = max(t, self.last_start, self.channel_free)
        self.last_start, self.channel_free = start, start + xfer
        return start, xfer, start + xfer + LATENCY

    def copy(self, store: bool, bf16: bool, hbm: int, vrow: int, rows: int, cols: int, stride: int) -> None:
        esize = 2 if bf16 else 4
        etype = np.uint16 if bf16 else np.uint32
        pitch = -(-cols // LANES)
        block = self.vmem[vrow : vrow + rows * pitch].reshape(rows, pitch * LANES)
        for r in range(rows):
            at = hbm + r * stride * esize
            elems = self.hbm[at : at + cols * esize].view(etype)
            if store:
                data = block[r, :cols]
                elems[...] = numerics.f32_to_bf16_bits(data.view(np.float32)) if bf16 else data
            else:
                block[r, :] = 0
                block[r, :cols] = numerics.bf16_bits_to_f32(elems).view(np.uint32) if bf16 else elems


@cocotb.test()
async def dma_engine_matches_the_spec(dut) -> None:
    rng = np.random.default_rng(int(os.environ.get("CTPU_DMA_SEED", "11")))
    cocotb.start_soon(Clock(dut.clk, 10, "ns").start())
    vmem = rng.integers(0, 1 << 32, size=(ROWS, LANES), dtype=np.uint64).astype(np.uint32)
    hbm = rng.integers(0, 256, size=HBM, dtype=np.uint16).astype(np.uint8)
    f32 = hbm.view(np.uint32)
    special = rng.random(f32.size) < 0.05
    f32[special] = rng.choice(np.array([0x7F800000, 0xFFC00001, 0x00000001, 0x3F808000, 0x7F7FFFFF], np.uint32),
                              size=int(special.sum()))
    golden = Golden(vmem, hbm)
    for sig in ("check_i", "issue_i", "store_i", "bf16_i", "hbm_i", "vrow_i", "shape_i", "stride_i"):
        getattr(dut, sig).value = 0
    dut.cycle_i.value = 0
    dut.rst_n.value = 0
    await ClockCycles(dut.clk, 2)
    dut.rst_n.value = 1

    errors: list[str] = []
    windows: list[tuple[int, int, str]] = []  # (start, start + xfer, "ld"/"st") per command
    writes: list[tuple[int, str]] = []  # (cycle, "ld"/"st") per monitored write
    rd_pending: tuple[int, int] | None = None  # HBM read requested last cycle: (addr, bytes)
    commands = traps = 0
    cycle, quiet_until = 0, 0
    n_commands = int(os.environ.get("CTPU_DMA_COMMANDS", "120"))
    while commands < n_commands or cycle < quiet_until:
        await FallingEdge(dut.clk)
        dut.cycle_i.value = cycle
        # HBM model: last cycle's read answers now
        if rd_pending is not None:
            addr, nbytes = rd_pending
            row = np.zeros(LANES * 4, np.uint8)
            row[:nbytes] = hbm[addr : addr + nbytes]
            dut.hbm_rdata_i.value = int.from_bytes(row.tobytes(), "little")
        # driver: maybe a command
        cmd = None
        if commands < n_commands and rng.random() < 0.5:
            store, bf16 = bool(rng.random() < 0.5), bool(rng.random() < 0.5)
            esize = 2 if bf16 else 4
            rows, cols = int(rng.integers(1, 6)), int(rng.integers(1, 4 * LANES + 1))
            stride = int(rng.integers(cols, cols + 6)) if store and rows > 1 else int(rng.integers(0, cols + 6))
            bad = rng.random() < 0.06
            if bad:  # an overlapping store, a zero shape or a misaligned address: must trap, not issue
                kind = int(rng.integers(0, 3))
                store, rows, stride = (True, max(rows, 2), cols - 1) if kind == 0 else (store, rows, stride)
                cols = 0 if kind == 1 else cols
                esize, bf16 = (4, False) if kind == 2 else (esize, bf16)
            span = ((rows - 1) * stride + max(cols, 1)) * esize
            addr = int(rng.integers(0, (HBM - span) // esize)) * esize + (2 if bad and kind == 2 else 0)
            pitch = max(1, -(-cols // LANES))
            vrow = int(rng.integers(0, ROWS - rows * pitch))
            cmd = (store, bf16, addr, vrow, rows, cols, stride, bad)
            dut.store_i.value, dut.bf16_i.value, dut.hbm_i.value, dut.vrow_i.value = int(store), int(bf16), addr, vrow
            dut.shape_i.value, dut.stride_i.value = rows << 16 | cols, stride
            dut.check_i.value = 1
        else:
            dut.check_i.value = 0
        dut.issue_i.value = 0
        await Timer(1, "ps")
        if cmd is not None:
            store, bf16, addr, vrow, rows, cols, stride, bad = cmd
            trapped = int(dut.trap_o.value) == 1
            if trapped != bad:
                errors.append(f"cycle {cycle}: trap_o {trapped} for {'a bad' if bad else 'a good'} command {cmd}")
            if bad:
                traps += 1
            elif not trapped and not int(dut.full_o.value):
                start, xfer, done = golden.schedule(cycle, rows, cols, 2 if bf16 else 4)
                if int(dut.done_o.value) != done:
                    errors.append(f"cycle {cycle}: done_o {int(dut.done_o.value)}, spec {done} for {cmd}")
                golden.copy(store, bf16, addr, vrow, rows, cols, stride)
                windows.append((start, start + xfer, "st" if store else "ld"))
                dut.issue_i.value = 1
                commands += 1
                quiet_until = done + 2
                await Timer(1, "ps")
        # vmem model: combinational read for the engine's store row
        dut.vmem_rdata_i.value = pack_row(vmem[int(dut.vmem_raddr_o.value) % ROWS])
        await Timer(1, "ps")
        # monitor: the writes performed at the coming clock edge
        rd_pending = None
        if int(dut.hbm_re_o.value):
            rd_pending = (int(dut.hbm_raddr_o.value), int(dut.hbm_rbytes_o.value))
        if int(dut.hbm_we_o.value):
            addr, nbytes = int(dut.hbm_waddr_o.value), int(dut.hbm_wbytes_o.value)
            data = int(dut.hbm_wdata_o.value).to_bytes(LANES * 4, "little")
            hbm[addr : addr + nbytes] = np.frombuffer(data[:nbytes], np.uint8)
            writes.append((cycle, "st"))
        if int(dut.vmem_we_o.value):
            row = int(dut.vmem_waddr_o.value)
            vmem[row] = np.frombuffer(int(dut.vmem_wdata_o.value).to_bytes(LANES * 4, "little"), "<u4")
            writes.append((cycle, "ld"))
        cycle += 1

    # checker: timing windows (a load row is written the cycle after its HBM read), final memories
    for c, kind in writes:
        if not any(lo <= c <= hi and k == kind for lo, hi, k in windows):
            errors.append(f"cycle {c}: a {kind} write outside every command's [start, start + xfer] window")
    if not np.array_equal(vmem, golden.vmem):
        r, lane = (int(i) for i in np.argwhere(vmem != golden.vmem)[0])
        errors.append(f"vmem row {r} lane {lane}: {vmem[r, lane]:#x}, spec {golden.vmem[r, lane]:#x}")
    if not np.array_equal(hbm, golden.hbm):
        a = int(np.argwhere(hbm != golden.hbm)[0][0])
        errors.append(f"HBM byte {a:#x}: {hbm[a]:#x}, spec {golden.hbm[a]:#x}")
    for e in errors[:20]:
        dut._log.error(e)
    dut._log.info(f"{commands} commands ({traps} illegal ones trapped), {len(writes)} row writes, "
                  f"{cycle} cycles, {len(errors)} errors")
    assert commands == n_commands and traps > 0
    assert not errors, f"{len(errors)} errors; first: {errors[0]}"
