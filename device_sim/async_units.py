"""The CTPU's asynchronous units: the MXU and the DMA engine, with their FIFOs, timing and vmem ownership.

The simulator performs a command's data movement when it issues (in program order) and computes, from
docs/architecture.md's formulas, the cycles at which it starts and completes. Any access to vmem rows an
in-flight command owns is a race (the hardware would not order it), so `Ownership` traps on it: a
race-free program gives the same results whatever the hardware's internal timing, which is what lets
this model be exact while the RTL moves data row by row.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from device_sim import isa, numerics
from device_sim.config import HBM_POISON, HardwareConfig

if TYPE_CHECKING:
    from device_sim.profile import Recording


class Machine(Protocol):
    """What the units use of the machine that holds them (device_sim.machine.Machine)."""

    config: HardwareConfig
    hbm: np.ndarray
    vmem: np.ndarray
    pc: int
    owners: Ownership

    def trap(self, message: str, index_range: bool = False) -> None: ...
    def vmem_span(self, row: int, rows: int, what: str) -> np.ndarray: ...
    def complete_on(self, flag: int, done: int) -> None: ...


@dataclass
class Owned:
    lo: int
    hi: int
    writes: bool
    done: int
    pc: int
    unit: str  # "dma", "mxu.w" (weight port reads), "mxu.in" (mm input), "mxu.out" (mm output)


class Ownership:
    """vmem rows owned by in-flight commands, from issue until their completion cycle."""

    def __init__(self) -> None:
        self.owned: list[Owned] = []

    def expire(self, t: int) -> None:
        if self.owned:
            self.owned = [o for o in self.owned if o.done > t]

    def check(self, m: Machine, lo: int, hi: int, writes: bool, unit: str, what: str) -> None:
        for o in self.owned:
            if o.lo < hi and lo < o.hi and (writes or o.writes) and not _ordered(o.unit, unit):
                m.trap(f"{what} touches vmem rows [{max(lo, o.lo)}, {min(hi, o.hi)}) owned by the in-flight "
                       f"command of bundle {o.pc} until cycle {o.done} (a race: wait on its flag first)")

    def claim(self, m: Machine, lo: int, hi: int, writes: bool, done: int, unit: str, what: str) -> None:
        self.check(m, lo, hi, writes, unit, what)
        self.owned.append(Owned(lo, hi, writes, done, m.pc, unit))

    def last_done(self) -> int:
        return max((o.done for o in self.owned), default=0)


def _ordered(a: str, b: str) -> bool:
    """Pairs the hardware orders itself: DMA after DMA (one channel), mm output after mm output."""
    return (a == b == "dma") or (a == b == "mxu.out")


class CommandFifo:
    """An in-order command FIFO: a command holds an entry from issue until it starts."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self.starts: deque[int] = deque()
        self.last_start = 0

    def ready(self, t: int) -> int:
        """The first cycle >= t at which an entry is free."""
        starts = self.starts
        while starts and starts[0] <= t:
            starts.popleft()
        if len(starts) >= self.depth:
            t = starts[len(starts) - self.depth]
            while starts and starts[0] <= t:
                starts.popleft()
        return t

    def push(self, start: int) -> None:
        self.starts.append(start)
        self.last_start = start


class Mxu:
    """Weight-stationary N x N array with active and shadow weight buffers (docs/architecture.md, MXU)."""

    def __init__(self, n: int, queue: int, weight_cycles: int) -> None:
        self.n = n
        self.weight_cycles = weight_cycles  # N rows through a port of weight_port_rows rows per cycle
        self.fifo = CommandFifo(queue)
        self.active = np.zeros((n, n), np.float32)
        self.shadow = np.zeros((n, n), np.float32)
        self.weight_port_free = 0
        self.shadow_free = 0
        self.weights_ready = 0
        self.data_port_free = 0
        self.busy_cycles = 0
        self.weight_loads = 0
        self.macs = 0
        self.rec: Recording | None = None  # the profiler's, while one records

    def load_weights(self, m: Machine, row: int, flag: int, transpose: bool, t: int,
                     packed_half: int | None = None) -> None:
        """`packed_half` (mxu.lwt.lo / .hi): each row's words hold bf16 pairs, the low half first; the
        weights are the N bf16 of words [half * N/2, half * N/2 + N/2)."""
        n = self.n
        rows = m.vmem_span(row, n, "mxu.lw")
        start = max(t, self.fifo.last_start, self.weight_port_free, self.shadow_free)
        done = start + self.weight_cycles
        m.owners.claim(m, row, row + n, False, done, "mxu.w", "mxu weight load")
        if packed_half is not None:
            words = rows[:, packed_half * n // 2 : (packed_half + 1) * n // 2]
            rows = np.stack([words & 0xFFFF, words >> 16], axis=-1).reshape(n, n) << 16
        w = numerics.round_to_bf16(rows.view(np.float32))
        self.shadow = np.ascontiguousarray(w.T if transpose else w)
        self.weight_port_free = self.weights_ready = done
        self.weight_loads += 1
        if self.rec is not None:
            self.rec.mxu_weights(m.pc, start, done, transpose)
        self.fifo.push(start)
        m.complete_on(flag, done)

    def matmul(self, m: Machine, x_row: int, out_row: int, rows: int, flag: int, accumulate: bool,
               swap: bool, t: int) -> None:
        n = self.n
        if rows == 0 or rows > m.config.vmem_rows:
            m.trap(f"mxu.mm streams {rows} rows; it needs 1..{m.config.vmem_rows}")
        if x_row < out_row + rows and out_row < x_row + rows:
            m.trap(f"mxu.mm output rows [{out_row}, {out_row + rows}) overlap its input rows [{x_row}, {x_row + rows})")
        x = m.vmem_span(x_row, rows, "mxu.mm input")
        m.vmem_span(out_row, rows, "mxu.mm output")
        start = max(t, self.fifo.last_start, self.data_port_free, self.weights_ready if swap else 0)
        done = start + rows + 2 * n
        m.owners.claim(m, x_row, x_row + rows, False, done, "mxu.in", "mxu.mm input")
        m.owners.claim(m, out_row, out_row + rows, True, done, "mxu.out", "mxu.mm output")
        if swap:
            self.active, self.shadow = self.shadow, self.active
            self.shadow_free = start
        p = numerics.mxu_matmul_bf16(numerics.round_to_bf16(x.view(np.float32)), self.active)
        if accumulate:
            with np.errstate(all="ignore"):
                p = numerics.canonicalize_nan(m.vmem[out_row : out_row + rows].view(np.float32) + p)
        m.vmem[out_row : out_row + rows] = p.view(np.uint32)
        self.data_port_free = start + rows
        self.busy_cycles += rows
        self.macs += rows * n * n
        if self.rec is not None:
            self.rec.mxu_stream(m.pc, start, start + rows, done, rows * n * n)
        self.fifo.push(start)
        m.complete_on(flag, done)


class Dma:
    """One DMA channel between HBM and vmem, with an in-order FIFO (docs/architecture.md, DMA)."""

    def __init__(self, lanes: int, bytes_per_cycle: int, latency: int, queue: int, port_rows: int = 1) -> None:
        self.lanes = lanes
        self.port_rows = port_rows
        self.bytes_per_cycle = bytes_per_cycle
        self.latency = latency
        self.fifo = CommandFifo(queue)
        self.channel_free = 0
        self.commands = 0
        self.bytes_loaded = 0
        self.bytes_stored = 0
        self.stored: list[tuple[int, int]] = []  # HBM byte ranges [lo, hi) the stores covered, in issue order
        self.rec: Recording | None = None  # the profiler's, while one records

    def copy(self, m: Machine, hbm: int, vmem: int, shape: int, stride: int, flag: int, store: bool, bf16: bool,
             t: int) -> None:
        rows, cols = shape >> isa.DMA_SHAPE_ROWS_SHIFT, shape & isa.DMA_SHAPE_COLS_MASK
        esize = 2 if bf16 else 4
        kind = "dma.st" if store else "dma.ld"
        if rows == 0 or cols == 0:
            m.trap(f"{kind} with shape {rows}x{cols}: rows and cols must be >= 1")
        if hbm % esize:
            m.trap(f"{kind}: HBM address {hbm:#x} is not aligned to its {esize}-byte elements")
        if store and rows > 1 and stride < cols:
            m.trap(f"dma.st with row stride {stride} < {cols} columns: its HBM rows would overlap")
        last = hbm + ((rows - 1) * stride + cols) * esize
        if last > m.config.hbm_bytes:
            poisoned = hbm >= HBM_POISON & 0xFFFFFFFF  # software's mark for an index out of range (config.py)
            m.trap(f"{kind}: HBM bytes [{hbm:#x}, {last:#x}) out of bounds (HBM has {m.config.hbm_bytes:#x} bytes)"
                   + (": the poison address, an index out of range" if poisoned else ""), index_range=poisoned)
        n = self.lanes
        pitch = -(-cols // n)
        m.vmem_span(vmem, rows * pitch, kind)

        # timing: one channel, bound by HBM's bytes per cycle or by vmem's port_rows rows per cycle
        # (port_rows 1: each vmem row costs ceil(its valid bytes / bandwidth) cycles, the original rule)
        if self.port_rows == 1:
            xfer = rows * sum(-(-min(n, cols - q * n) * esize // self.bytes_per_cycle) for q in range(pitch))
        else:
            xfer = max(-(-rows * pitch // self.port_rows), -(-rows * cols * esize // self.bytes_per_cycle))
        start = max(t, self.fifo.last_start, self.channel_free)
        self.channel_free = start + xfer
        done = start + xfer + self.latency
        m.owners.claim(m, vmem, vmem + rows * pitch, not store, done, "dma", kind)

        etype = np.uint16 if bf16 else np.uint32
        view = np.lib.stride_tricks.as_strided(
            m.hbm[hbm:last].view(etype), shape=(rows, cols), strides=(stride * esize, esize), writeable=True)
        block = m.vmem[vmem : vmem + rows * pitch].reshape(rows, pitch * n)
        if store:
            data = block[:, :cols]
            view[...] = numerics.f32_to_bf16_bits(data.view(np.float32)) if bf16 else data
            self.bytes_stored += rows * cols * esize
            self.stored.append((hbm, last))
        else:
            block[...] = 0
            block[:, :cols] = numerics.bf16_bits_to_f32(view).view(np.uint32) if bf16 else view
            self.bytes_loaded += rows * cols * esize
        self.commands += 1
        if self.rec is not None:
            self.rec.dma(m.pc, start, start + xfer, done, rows * cols * esize, store)
        self.fifo.push(start)
        m.complete_on(flag, done)
