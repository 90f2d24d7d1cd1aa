"""Instruction selection for the kernels that address memory by data or by position: row gathers
(embedding lookups) and iotas.

Gather, for chunks of T rows of the output (outer index i, D columns, P = ceil(D / N) vmem rows a row):
1. the T ids are DMA'd into lane 0 of vmem rows 0..T-1 of an index region, one DMA per run of ids at a
   constant stride (one for contiguous ids; any layout);
2. `vld` of 8 of those rows + `vext` of lane (i % 8) * N moves id i to a scalar register: the one path from
   vector data to addresses; `mul` + `add` make the table row's HBM address;
3. one `dma.ld` per row brings table[id] (1 x D) into rows i*P .. of a data region, and one `dma.st` writes
   the T x D chunk to the dense output.
Steps 2-3 run 8 rows an iteration of a runtime loop: code size does not grow with T (a prefill's 2048
token embeddings, an MoE's expert-sorted rows).
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
Steps 2-3 run 8 rows an iteration of a runtime loop, as the gather's (a prefill's KV cache update).

Iota: `viota` (sublane * N + lane) plus the chunk base, stored to vmem, one DMA out (a 1 x n row).
"""

from __future__ import annotations

import math
from collections.abc import Callable

from codegen.builder import Builder
from codegen.isel_common import Flag, KernelContext, Region, chunk_loop, row_mem
from codegen.kernel_graph import ESIZE, GatherKernel, IotaKernel, LoweringError, ScatterKernel
from codegen.mir import ZERO, Reg
from device_sim.config import HBM_POISON


def lower_gather(ctx: KernelContext, k: GatherKernel) -> None:
    outer, cols = k.sizes[:-1], k.sizes[-1]
    rows = math.prod(outer)
    p = -(-cols // ctx.lanes)
    if k.table.strides[1] != 1:
        raise LoweringError("gather from a table that is not contiguous along its rows")
    chunk = max(8, min(rows, (ctx.vmem_free() // 2 - 16) // (p + 1)) // 8 * 8)
    ids_region = ctx.region(chunk + 8, "ids")
    data_region = ctx.region(chunk * p + 8, "rows")
    id_at = [k.ids.view.offset + sum(ix * s for ix, s in zip(_flat_index(i, outer), k.ids.iter_strides, strict=False))
             for i in range(rows)]
    for c0 in range(0, rows, chunk):
        ctx.b.new_scope()
        _gather_chunk(ctx, k, id_at[c0:c0 + chunk], ids_region, data_region)
        out_addr = ctx.hbm_addr(k.output, k.output.offset + c0 * cols)
        ctx.dma(False, k.output.dtype, out_addr, data_region, 0, min(chunk, rows - c0), cols, cols, Flag.OUT)
        if c0 + chunk < rows:  # the next chunk reuses the rows; the last chunk's stores drain into the next kernel
            ctx.b.emit("wait", flag=ctx.flag(Flag.OUT))


def _gather_chunk(ctx: KernelContext, k: GatherKernel, id_at: list[int], ids_region: Region,
                  data_region: Region) -> None:
    """The table rows of the ids at element offsets `id_at` into `data_region`, row i at vmem row i * P."""
    b, n, cols = ctx.b, len(id_at), k.sizes[-1]
    p = -(-cols // ctx.lanes)
    for first, count, step in _runs(id_at):
        ctx.dma(True, k.ids.view.dtype, ctx.hbm_addr(k.ids.view, id_at[first]), ids_region, first, count, 1, step,
                Flag.INDEX)
    b.emit("wait", flag=ctx.flag(Flag.INDEX))
    table_base = ctx.hbm_addr(k.table, k.table.offset)
    stride_reg, table_rows = b.const(k.table.strides[0] * ESIZE[k.table.dtype]), b.const(k.table.shape[0])

    def gather_rows(first: int, count: int, at: Reg, data_at: Reg) -> None:
        """Rows first .. first + count (<= 8), `at` rows further (a loop's offset; `data_at` = at * P)."""
        v = b.vld(at, ids_region.row + first, row_mem(ids_region, at, first, 8))
        for j in range(count):
            row_id, valid, offset, addr = b.sreg(), b.sreg(), b.sreg(), b.sreg()
            b.emit("vext", row_id, (v,), imm=j * ctx.lanes)
            b.emit("sltu", valid, (row_id, table_rows))  # 0 <= id < rows (a negative id is a huge unsigned)
            b.emit("mul", offset, (row_id, stride_reg))
            b.emit("add", addr, (offset, table_base))
            ctx.dma(True, k.table.dtype, poison_unless(b, addr, valid), data_region, (first + j) * p, 1, cols, cols,
                    Flag.ROWS, base=data_at)

    _eight_rows_at_a_time(b, n, p, gather_rows, "gather")
    b.emit("wait", flag=ctx.flag(Flag.ROWS))


def _eight_rows_at_a_time(b: Builder, n: int, p: int, rows: Callable[[int, int, Reg, Reg], None], hint: str) -> None:
    """rows(first, count, at, data_at) for the n rows of a chunk, 8 at a time, in order: a runtime loop (`at`:
    its row offset, `data_at` = at * P) when there are more than two groups, so code size does not grow
    with n; constant addresses otherwise."""
    groups = n // 8
    if groups <= 2:  # short: constant addresses
        for g in range(groups):
            rows(8 * g, 8, ZERO, ZERO)
    else:
        data_at = b.sreg()
        b.emit("addi", data_at, (ZERO,), imm=0)

        def eight_rows(at: Reg) -> None:
            rows(0, 8, at, data_at)
            b.emit("addi", data_at, (data_at,), imm=8 * p)

        chunk_loop(b, groups, eight_rows, hint, ivs={data_at: 8 * p})
    if n % 8:
        rows(8 * groups, n % 8, ZERO, ZERO)


def _runs(offsets: list[int]) -> list[tuple[int, int, int]]:
    """(first, count, step): the offsets as maximal runs at a constant positive step (one DMA each)."""
    runs: list[tuple[int, int, int]] = []
    i = 0
    while i < len(offsets):
        step = offsets[i + 1] - offsets[i] if i + 1 < len(offsets) else 0
        count = 1
        while step > 0 and i + count < len(offsets) and offsets[i + count] - offsets[i + count - 1] == step:
            count += 1
        runs.append((i, count, max(step, 1)))
        i += count
    return runs


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
        sizes = [b.const(k.dest.shape[j]) for j in range(depth)]
        strides = [b.const(k.dest.strides[j] * esize) for j in range(depth)]

        def scatter_rows(first: int, count: int, at: Reg, data_at: Reg, sizes: list[Reg] = sizes,
                         strides: list[Reg] = strides) -> None:
            v = b.vld(at, idx_region.row + first, row_mem(idx_region, at, first, 8))
            for i in range(count):
                addr, valid = dest_base, None
                for j in range(depth):
                    ix = b.sreg()
                    b.emit("vext", ix, (v,), imm=i * n_lanes + j)
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
                ctx.dma(False, dtype, poison_unless(b, addr, valid), data_region, (first + i) * p, 1, cols, cols,
                        Flag.OUT, base=data_at)

        _eight_rows_at_a_time(b, n, p, scatter_rows, "scatter")  # in order: a repeated index keeps the last row
        if c0 + chunk < rows:  # as in lower_gather
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
