"""Instruction selection for the kernels that address memory by data or by position: row gathers
(embedding lookups) and iotas.

Gather, for chunks of T rows of the output (outer index i, D columns, P = ceil(D / N) vmem rows a row):
1. the T ids are DMA'd into lane 0 of vmem rows 0..T-1 of an index region, one DMA per run of ids at a
   constant stride (one for contiguous ids; any layout);
2. `vld` of 8 of those rows, vector ops make each row's table address (`_IndexLanes`), and `vext` of lane
   (i % 8) * N moves it to a scalar register: the one path from vector data to addresses;
3. one `dma.ld` per row brings table[id] (1 x D) into rows i*P .. of a data region, and one `dma.st` writes
   the T x D chunk to the dense output.
Steps 2-3 run 32 rows an iteration of a runtime loop (`_rows_by_eight`): code size does not grow with T
(a prefill's 2048 token embeddings, an MoE's expert-sorted rows).
An id outside [0, rows) (torch raises IndexError) gets its address poisoned (HBM_POISON), so its DMA
traps on the HBM bound instead of reading another buffer.

Scatter (in place, the KV cache update), for chunks of T rows of the updates (k index components each):
1. one DMA brings the T index rows (k int32 lanes each) into vmem rows 0..T-1, one the T update rows;
2. per 8 rows, vector ops make each row's HBM address from its components (`_IndexLanes`: a component
   outside [0, size) poisons it; a negative position was already wrapped by the emitter), and one `vext`
   a row moves it to a scalar. An out-of-range row's DMA traps on the HBM bound (nothing silent; the rows
   before it in the same launch are written);
3. one `dma.st` per row writes it. bf16 rows of an even length move as 32-bit words, so every bit
   pattern (NaN payloads included) is copied exactly; rows are written in order, so a repeated index keeps
   the last row.
Steps 2-3 run in a runtime loop, as the gather's (a prefill's KV cache update).

Iota: `viota` (sublane * N + lane) plus the chunk base, stored to vmem, one DMA out (a 1 x n row).
"""

from __future__ import annotations

import itertools
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
    lanes = _IndexLanes(b, 1, table_base, k.table.shape[:1], [k.table.strides[0] * ESIZE[k.table.dtype]])

    def gather_rows(first: int, count: int, at: Reg, data_at: Reg) -> None:
        """Rows first .. first + count (<= 8), `at` rows further (a loop's offset; `data_at` = at * P)."""
        addresses = lanes.addresses(b.vld(at, ids_region.row + first, row_mem(ids_region, at, first, 8)))
        for j in range(count):
            addr = b.sreg()
            b.emit("vext", addr, (addresses,), imm=j * ctx.lanes)
            ctx.dma(True, k.table.dtype, addr, data_region, (first + j) * p, 1, cols, cols, Flag.ROWS, base=data_at)

    _rows_by_eight(b, n, p, gather_rows, "gather")
    b.emit("wait", flag=ctx.flag(Flag.ROWS))


def _rows_by_eight(b: Builder, n: int, p: int, rows: Callable[[int, int, Reg, Reg], None], hint: str,
                   start: Reg = ZERO, data_start: Reg = ZERO) -> None:
    """rows(first, count, at, data_at) for the n rows of a chunk, 8 at a time, in order: a runtime loop (`at`:
    its row offset, `data_at` = at * P, from `start` and `data_start`) of GROUPS_PER_RUN groups a run, so code
    size does not grow with n (the groups of a run overlap: a lone group's address chain and its DMAs left
    the bundles mostly empty); the rows after the last whole run at constant addresses."""
    run = 8 * GROUPS_PER_RUN
    runs = n // run
    if runs:
        data_at = b.sreg()
        b.emit("addi", data_at, (data_start,), imm=0)

        def one_run(at: Reg) -> None:
            for g in range(GROUPS_PER_RUN):
                rows(8 * g, 8, at, data_at)
            b.emit("addi", data_at, (data_at,), imm=run * p)

        chunk_loop(b, runs, one_run, hint, start=start, step=run, ivs={data_at: run * p})
    for first in range(runs * run, n, 8):  # the rest: constant addresses
        rows(first, min(8, n - first), start, data_start)


GROUPS_PER_RUN = 8


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
    if depth == 1 and chunk > CONTIGUOUS_RUN:  # chunks of whole runs: a run never straddles two
        chunk = chunk // CONTIGUOUS_RUN * CONTIGUOUS_RUN
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
        lanes = _IndexLanes(b, depth, dest_base, k.dest.shape, [s * esize for s in k.dest.strides])

        def scatter_rows(first: int, count: int, at: Reg, data_at: Reg, lanes: _IndexLanes = lanes) -> None:
            v = b.vld(at, idx_region.row + first, row_mem(idx_region, at, first, 8))
            addresses = lanes.addresses(v)
            for i in range(count):
                addr = b.sreg()
                b.emit("vext", addr, (addresses,), imm=i * n_lanes)
                ctx.dma(False, dtype, addr, data_region, (first + i) * p, 1, cols, cols, Flag.OUT, base=data_at)

        # in order: a repeated index keeps the last row
        if depth == 1 and min(n, k.dest.shape[0]) >= CONTIGUOUS_RUN:
            _by_contiguous_runs(ctx, k, n, idx_region, data_region, dest_base, scatter_rows)
        else:
            _rows_by_eight(b, n, p, scatter_rows, "scatter")
        if c0 + chunk < rows:  # as in lower_gather
            b.emit("wait", flag=ctx.flag(Flag.OUT))


CONTIGUOUS_RUN = 256  # rows a contiguity check covers (its latency, ~50 cycles, is the loop's)


def _by_contiguous_runs(ctx: KernelContext, k: ScatterKernel, n: int, idx_region: Region, data_region: Region,
                        dest_base: Reg, rows: Callable[[int, int, Reg, Reg], None]) -> None:
    """A scatter of one flat row index a row, by runs of CONTIGUOUS_RUN rows: a run whose indices are
    consecutive and inside the destination moves in one DMA, any other run a DMA a row (`rows`). A KV cache
    update at consecutive positions (2048 rows a head in a prefill) was bound by its one-row DMAs (16,384 of
    them in a 1B layer). The check: every index minus its place in the run equals the first index (lane 0 of
    each index row; the other lanes are stale), and the first is in [0, rows - run]; a run that fails it, a
    bad index included, takes the rows' path, which traps on it. The rows after the last whole run take it."""
    b, run = ctx.b, CONTIGUOUS_RUN
    dtype, cols, unit = _row_words(k)
    p = -(-cols // ctx.lanes)
    sublane, eight = b.vop_imm("viota", 1), b.vconst_bits(8)
    zero = b.vconst_bits(0)
    last_first = b.const(k.dest.shape[0] - run + 1)
    row_bytes = b.const(k.dest.strides[0] * ESIZE[k.dest.dtype])
    data_at = b.sreg()
    b.emit("addi", data_at, (ZERO,), imm=0)

    def one_run(at: Reg) -> None:
        loads = [b.vld(at, idx_region.row + 8 * g, row_mem(idx_region, at, 8 * g, 8)) for g in range(run // 8)]
        first = b.emit("vext", b.sreg(), (loads[0],), imm=0)
        expected = b.vop("vbcast", first)
        # row 8g + s holds first + 8g + s: rows 0..7 against first, each later one against the one 8 before
        offsets = [b.vop("vxor", loads[0], b.vop("vadd.i", expected, sublane))]
        offsets += [b.vop("vxor", b.vop("vsub.i", v, u), eight) for u, v in itertools.pairwise(loads)]
        while len(offsets) > 1:  # a tree: the check's latency is the loop's
            offsets = [b.vop("vor", *offsets[i:i + 2]) if i + 1 < len(offsets) else offsets[i]
                       for i in range(0, len(offsets), 2)]
        # a row in the run: offset 0, compared -1 (all bits), -1.0 as fp32; one off it 0.0; the largest over
        # the rows is -1.0 only when every row is in the run
        worst = b.vop("vred.max.s", b.vop("vcvt.i2f", b.vop("vcmp.eq.i", offsets[0], zero)))
        every_row = b.emit("sltu", b.sreg(), (ZERO, b.emit("vext", b.sreg(), (worst,), imm=0)))
        fast = b.emit("and", b.sreg(), (every_row, b.emit("sltu", b.sreg(), (first, last_first))))

        def one_dma() -> None:
            at_row = b.emit("add", b.sreg(), (dest_base, b.emit("mul", b.sreg(), (first, row_bytes))))
            ctx.dma(False, dtype, at_row, data_region, 0, run, cols, k.dest.strides[0] // unit, Flag.OUT,
                    base=data_at)

        b.if_positive(fast, one_dma, "run")
        b.if_positive(b.emit("xori", b.sreg(), (fast,), imm=1),
                      lambda: _rows_by_eight(b, run, p, rows, "scatter", at, data_at), "rows")
        b.emit("addi", data_at, (data_at,), imm=run * p)

    runs = n // run
    chunk_loop(b, runs, one_run, "runs", step=run, ivs={data_at: run * p})
    _rows_by_eight(b, n - runs * run, p, lambda first, count, at, data: rows(runs * run + first, count, at, data),
                   "scatter")


class _IndexLanes:
    """Eight index rows' destination addresses, computed in the vector unit. A vmem row of indices holds
    component j in lane j: one `vmul.i` by the strides (lane j: the dim's stride in bytes; lane 0 adds the
    destination's base) makes each lane's address term, and lane sums make the row's address, in every lane
    of its row. `vred.sum.l` adds fp32, exact below 2^24: the terms are summed in pieces of bits whose sums
    stay below 2^22 (two pieces for up to 4 components). A component outside [0, size) turns its lane's top
    piece into 2^23, which poisons the row's address (HBM_POISON's bits or-ed in: its DMA traps on
    the HBM bound, as a gather's). A row then costs one `vext` beside its DMA; a per-component scalar
    check, multiply and add spilled at 18 bundles a row."""

    def __init__(self, b: Builder, depth: int, base: Reg, shape: tuple[int, ...], stride_bytes: list[int]) -> None:
        self.b, self.depth = b, depth
        lane = b.vop_imm("viota", 0)
        # lanes >= depth: stride 0 and a limit no component exceeds (a vmem row's other lanes are stale)
        stride, limit = b.vconst_bits(0), b.vconst_bits(0x7FFFFFFF)
        for j in range(depth):
            at = b.vop("vcmp.eq.i", lane, b.vconst_bits(j))
            stride = b.vop("vsel", at, b.vconst_bits(stride_bytes[j]), stride)
            limit = b.vop("vsel", at, b.vconst_bits((shape[j] - 1) ^ _SIGN), limit)
        self.stride, self.limit = stride, limit
        self.piece_bits = 22 - (depth - 1).bit_length()  # depth pieces sum below 2^22: exact in fp32
        self.base = b.vop("vsel", b.vop("vcmp.eq.i", lane, b.vconst_bits(0)), b.vop("vbcast", base), b.vconst_bits(0))

    def addresses(self, v: Reg) -> Reg:
        """Row i's destination address (poisoned when out of range) in every lane of row i, for the index
        rows in `v`."""
        b = self.b
        terms = b.vop("vadd.i", b.vop("vmul.i", v, self.stride), self.base)
        # ix outside [0, size) as unsigned: a signed compare of both sides with the sign bit flipped
        bad = b.vop("vcmp.lt.i", self.limit, b.vop("vxor", v, b.vconst_bits(_SIGN)))
        if self.depth == 1:  # lane 0 holds the whole address: no lane sums (a valid one is below 2^31)
            return b.vop("vor", terms, b.vop("vand", bad, b.vconst_bits(HBM_POISON)))
        address, top = None, None
        for shift in range(0, 32, self.piece_bits):
            piece = b.vop("vshr", terms, b.vconst_bits(shift)) if shift else terms
            if shift + self.piece_bits < 32:
                piece = b.vop("vand", piece, b.vconst_bits((1 << self.piece_bits) - 1))
            else:  # the top piece: a bad lane's is the marker
                piece = b.vop("vsel", bad, b.vconst_bits(_BAD), piece)
            top = b.vop("vcvt.f2i", b.vop("vred.sum.l", b.vop("vcvt.i2f", piece)))
            part = b.vop("vshl", top, b.vconst_bits(shift)) if shift else top
            address = part if address is None else b.vop("vadd.i", address, part)
        assert address is not None and top is not None
        poisoned = b.vop("vcmp.lt.i", b.vconst_bits(_BAD - 1), top)
        return b.vop("vor", address, b.vop("vand", poisoned, b.vconst_bits(HBM_POISON)))


_SIGN = -(1 << 31)
_BAD = 1 << 23  # the top piece of a bad lane: above any sum of valid pieces (< 2^22)


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
