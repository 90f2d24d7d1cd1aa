"""Instruction selection for the kernels that address memory by data or by position: row gathers
(embedding lookups) and iotas.

Gather, for chunks of T rows of the output (outer index i, D columns, P = ceil(D / N) vmem rows a row):
1. the T ids are DMA'd one element each into lane 0 of vmem rows 0..T-1 of an index region (any ids layout);
2. `vld` of 8 of those rows + `vext` of lane (i % 8) * N moves id i to a scalar register: the one path from
   vector data to addresses; `mul` + `add` make the table row's HBM address;
3. one `dma.ld` per row brings table[id] (1 x D) into rows i*P .. of a data region, and one `dma.st` writes
   the T x D chunk to the dense output.
An id outside [0, rows) (torch raises IndexError) gets its address poisoned (`poison_unless`), so its DMA
traps on the HBM bound instead of reading another buffer.

Scatter (in place, the KV cache update), for chunks of T rows of the updates (k index components each):
1. one DMA brings the T index rows (k int32 lanes each) into vmem rows 0..T-1, one the T update rows;
2. per row, `vext` moves each component to a scalar; `sltu` against the dim's size checks it (a negative
   position was already wrapped by the emitter), `mul` + `add` make the destination row's HBM address;
   an out-of-range row's address is poisoned, so its DMA traps on the HBM bound (nothing silent; the rows
   before it in the same launch are written);
3. one `dma.st` per row writes it. bf16 rows of an even length move as 32-bit words, so every bit
   pattern (NaN payloads included) is copied exactly; rows are written in order, so a repeated index keeps
   the last row.

Iota: `viota` (sublane * N + lane) plus the chunk base, stored to vmem, one DMA out (a 1 x n row).
"""

from __future__ import annotations

import math

from codegen.builder import Builder
from codegen.isel_common import Flag, KernelContext
from codegen.kernel_graph import ESIZE, GatherKernel, IotaKernel, LoweringError, ScatterKernel
from codegen.mir import Reg
from device_sim.config import HBM_POISON


def lower_gather(ctx: KernelContext, k: GatherKernel) -> None:
    b, n_lanes = ctx.b, ctx.lanes
    outer, cols = k.sizes[:-1], k.sizes[-1]
    rows = math.prod(outer)
    p = -(-cols // n_lanes)
    esize = ESIZE[k.table.dtype]
    row_bytes = k.table.strides[0] * esize
    if k.table.strides[1] != 1:
        raise LoweringError("gather from a table that is not contiguous along its rows")
    chunk = max(8, min(rows, (ctx.vmem_free() // 2 - 16) // (p + 1)) // 8 * 8)
    ids_region = ctx.region(chunk + 8, "ids")
    data_region = ctx.region(chunk * p + 8, "rows")
    table_base = ctx.hbm_addr(k.table, k.table.offset)
    flat = [_flat_index(i, outer) for i in range(rows)]
    for c0 in range(0, rows, chunk):
        n = min(chunk, rows - c0)
        b.new_scope()
        for i in range(n):
            off = k.ids.view.offset + sum(ix * s for ix, s in zip(flat[c0 + i], k.ids.iter_strides, strict=False))
            ctx.dma(True, k.ids.view.dtype, ctx.hbm_addr(k.ids.view, off), ids_region, i, 1, 1, 1, Flag.INDEX)
        b.emit("wait", flag=ctx.flag(Flag.INDEX))
        zero, stride_reg, table_rows = b.const(0), b.const(row_bytes), b.const(k.table.shape[0])
        for g in range(0, n, 8):
            v = b.vld(zero, ids_region.row + g, ids_region.mem(g, g + 8))
            for i in range(g, min(g + 8, n)):
                row_id, valid, offset, addr = b.sreg(), b.sreg(), b.sreg(), b.sreg()
                b.emit("vext", row_id, (v,), imm=(i - g) * n_lanes)
                b.emit("sltu", valid, (row_id, table_rows))  # 0 <= id < rows (a negative id is a huge unsigned)
                b.emit("mul", offset, (row_id, stride_reg))
                b.emit("add", addr, (offset, table_base))
                addr = poison_unless(b, addr, valid)
                ctx.dma(True, k.table.dtype, addr, data_region, i * p, 1, cols, cols, Flag.ROWS)
        b.emit("wait", flag=ctx.flag(Flag.ROWS))
        out_addr = ctx.hbm_addr(k.output, k.output.offset + c0 * cols)
        ctx.dma(False, k.output.dtype, out_addr, data_region, 0, n, cols, cols, Flag.OUT)
        b.emit("wait", flag=ctx.flag(Flag.OUT))


def lower_scatter(ctx: KernelContext, k: ScatterKernel) -> None:
    b, n_lanes = ctx.b, ctx.lanes
    rows, depth = k.indices.shape
    if depth > n_lanes:
        raise LoweringError(f"scatter with {depth} index components (at most {n_lanes})")
    dtype, cols, unit = _row_words(k)
    p = -(-cols // n_lanes)
    chunk = max(8, min(rows, (ctx.vmem_free() // 2 - 16) // (p + 1)) // 8 * 8)
    idx_region = ctx.region(chunk + 8, "idx")
    data_region = ctx.region(chunk * p + 8, "rows")
    esize = ESIZE[k.dest.dtype]
    dest_base = ctx.hbm_addr(k.dest, k.dest.offset)
    for c0 in range(0, rows, chunk):
        n = min(chunk, rows - c0)
        b.new_scope()
        idx_addr = ctx.hbm_addr(k.indices, k.indices.offset + c0 * k.indices.strides[0])
        ctx.dma(True, "i32", idx_addr, idx_region, 0, n, depth, k.indices.strides[0], Flag.INDEX)
        upd_addr = ctx.hbm_addr(k.updates, k.updates.offset + c0 * k.updates.strides[0])
        ctx.dma(True, dtype, upd_addr, data_region, 0, n, cols, k.updates.strides[0] // unit, Flag.ROWS)
        b.emit("wait", flag=ctx.flag(Flag.INDEX))
        b.emit("wait", flag=ctx.flag(Flag.ROWS))
        zero = b.const(0)
        sizes = [b.const(k.dest.shape[j]) for j in range(depth)]
        strides = [b.const(k.dest.strides[j] * esize) for j in range(depth)]
        for g in range(0, n, 8):
            v = b.vld(zero, idx_region.row + g, idx_region.mem(g, g + 8))
            for i in range(g, min(g + 8, n)):
                addr, valid = dest_base, None
                for j in range(depth):
                    ix = b.sreg()
                    b.emit("vext", ix, (v,), imm=(i - g) * n_lanes + j)
                    ok = b.sreg()
                    b.emit("sltu", ok, (ix, sizes[j]))  # 0 <= ix < size (a negative ix is a huge unsigned)
                    if valid is not None:
                        b.emit("and", ok, (ok, valid))
                    valid = ok
                    off, nxt = b.sreg(), b.sreg()
                    b.emit("mul", off, (ix, strides[j]))
                    b.emit("add", nxt, (addr, off))
                    addr = nxt
                assert valid is not None
                ctx.dma(False, dtype, poison_unless(b, addr, valid), data_region, i * p, 1, cols, cols, Flag.OUT)
        b.emit("wait", flag=ctx.flag(Flag.OUT))


def poison_unless(b: Builder, addr: Reg, valid: Reg) -> Reg:
    """`addr` when `valid` (1), else an address at the top of the 32-bit space, where no configuration maps
    HBM (device_sim.config.HBM_POISON), with `addr`'s alignment: a DMA to it traps on the HBM bound."""
    mask, high, out = b.sreg(), b.sreg(), b.sreg()
    b.emit("addi", mask, (valid,), imm=-1)  # 0 when valid, all ones when not
    b.emit("andi", high, (mask,), imm=HBM_POISON)
    b.emit("or", out, (addr, high))
    return out


def _row_words(k: ScatterKernel) -> tuple[str, int, int]:
    """(DMA dtype, columns a row, elements a column): bf16 rows of an even length whose every address is
    4-byte aligned move as int32 words (exact bits; a bf16 DMA would canonicalize NaN payloads)."""
    depth = k.indices.shape[1]
    cols = math.prod(k.dest.shape[depth:])
    if k.dest.dtype != "bf16":
        return k.dest.dtype, cols, 1
    even = [cols, k.dest.offset, k.updates.offset, k.updates.strides[0], *k.dest.strides[:depth]]
    return ("i32", cols // 2, 2) if all(x % 2 == 0 for x in even) else ("bf16", cols, 1)


def _flat_index(i: int, dims: tuple[int, ...]) -> tuple[int, ...]:
    out = []
    for d in reversed(dims):
        out.append(i % d)
        i //= d
    return tuple(reversed(out))


def lower_iota(ctx: KernelContext, k: IotaKernel) -> None:
    b, n_lanes = ctx.b, ctx.lanes
    n = k.output.shape[0]
    per_reg = 8 * n_lanes
    region = ctx.region(-(-n // n_lanes) + 8, "iota")
    zero = b.const(0)
    lanes = b.vop_imm("viota", 2)
    for c in range(0, n, per_reg):
        row = c // n_lanes
        v = b.vop("vadd.i", lanes, b.vconst_bits(c)) if c else lanes
        b.vst(v, zero, region.row + row, region.mem(row, row + 8, write=True))
    ctx.dma(False, "i32", ctx.hbm_addr(k.output, k.output.offset), region, 0, 1, n, n, Flag.OUT)
