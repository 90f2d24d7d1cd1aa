"""Instruction selection for the kernels that address memory by data or by position: row gathers
(embedding lookups) and iotas.

Gather, for chunks of T rows of the output (outer index i, D columns, P = ceil(D / N) vmem rows a row):
1. the T ids are DMA'd one element each into lane 0 of vmem rows 0..T-1 of an index region (any ids layout);
2. `vld` of 8 of those rows + `vext` of lane (i % 8) * N moves id i to a scalar register: the one path from
   vector data to addresses; `mul` + `add` make the table row's HBM address;
3. one `dma.ld` per row brings table[id] (1 x D) into rows i*P .. of a data region, and one `dma.st` writes
   the T x D chunk to the dense output.
Out-of-range ids are not checked here: they address outside the table (the simulator traps on HBM bounds).

Iota: `viota` (sublane * N + lane) plus the chunk base, stored to vmem, one DMA out (a 1 x n row).
"""

from __future__ import annotations

import math

from codegen.isel_common import KernelContext
from codegen.kernels import ESIZE, GatherKernel, IotaKernel, LoweringError

F_IDS, F_ROWS, F_OUT = 0, 1, 2


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
            ctx.dma(True, k.ids.view.dtype, ctx.hbm_addr(k.ids.view, off), ids_region, i, 1, 1, 1, F_IDS)
        b.emit("wait", flag=ctx.flag(F_IDS))
        zero, stride_reg = b.const(0), b.const(row_bytes)
        for g in range(0, n, 8):
            v = b.vreg()
            b.emit("vld", v, (zero,), imm=ids_region.row + g, mem=(ids_region.mem(g, g + 8),))
            for i in range(g, min(g + 8, n)):
                row_id = b.sreg()
                b.emit("vext", row_id, (v,), imm=(i - g) * n_lanes)
                addr = b.sreg()
                b.emit("mul", addr, (row_id, stride_reg))
                b.emit("add", addr, (addr, table_base))
                ctx.dma(True, k.table.dtype, addr, data_region, i * p, 1, cols, cols, F_ROWS)
        b.emit("wait", flag=ctx.flag(F_ROWS))
        out_addr = ctx.hbm_addr(k.output, k.output.offset + c0 * cols)
        ctx.dma(False, k.output.dtype, out_addr, data_region, 0, n, cols, cols, F_OUT)
        b.emit("wait", flag=ctx.flag(F_OUT))


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
        b.emit("vst", None, (v, zero), imm=region.row + row, mem=(region.mem(row, row + 8, write=True),))
    ctx.dma(False, "i32", ctx.hbm_addr(k.output, k.output.offset), region, 0, 1, n, n, F_OUT)
