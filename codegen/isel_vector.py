"""Instruction selection for elementwise and last-dim reduction generics (and fills) on the vector unit.

The iteration space [outer..., C] is processed in *rows*: one row = the C elements of the innermost dim.
Operands are classified by their stride along it:
- row operand (stride 1): DMA'd as `rows x C`, each row over P = ceil(C / N) vmem rows (padding lanes 0);
- column operand (stride 0: one value per row, e.g. a keepdim reduction or a scalar): DMA'd as `rows x 1`,
  then broadcast across lanes in vmem (`vld` + `vsel` lane 0 + `vred.max.l`) into the row layout;
- other strides (a transposed operand): first copied into HBM scratch in row order, a column per DMA pair.
Outer dims that every operand strides uniformly merge into one row dim (one DMA per tile); the others are
unrolled at compile time. Tiles of T rows are double-buffered: the loads of tile i + 1 are issued before
tile i is computed, stores drain behind.

Program size does not grow with the tensor: the tiles run in a runtime loop (two tiles per iteration, so
buffers and flags alternate with constant addresses; HBM addresses are pointer registers), and inside a
tile the chunks of 8 vmem rows run in a runtime *chunk loop* (a single-block counted loop whose vmem row
offset is an induction register: the back end software-pipelines it). Wide rows (P > 8 vmem rows) reduce
in a row loop around a chunk loop that carries the accumulator.

Reductions (last iterator) combine `f(inputs)` across lanes, masking padding lanes with the identity
(`viota` + `vsel`), then across vmem rows of one row, and finally with the output's initial value.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

import numpy as np

from codegen.builder import Builder
from codegen.isel_common import Flag, KernelContext, Preload, Region, Resident, chunk_loop, region_rows, row_mem
from codegen.kernel_graph import (
    ESIZE,
    Access,
    FillKernel,
    GenericKernel,
    Kernel,
    LoweringError,
    ScalarProgram,
    View,
    row_major,
)
from codegen.math_seqs import vdivide, vexp, vrecip, vrsqrt, vsqrt, vtanh
from codegen.mir import ZERO, Reg
from device_sim.config import HardwareConfig
from device_sim.isa import DMA_SHAPE_COLS_MASK

MAX_TILE_VMEM_ROWS = 512  # vmem rows of one operand's tile (64 chunks): keeps double buffering useful
UNROLL_CHUNKS = 4  # chunk sequences up to this long are unrolled, longer ones run as loops
# an elementwise generic's dense trailing dims, rows narrower than a vmem row, as whole vmem rows (`_flattened`)
FLATTEN_TRAILING = True
# a tile of several pieces (groups) computes each piece's valid rows as a loop of its own only where the
# pieces are at least this many chunks of 8 vmem rows: each loop pays its software pipeline's fill and drain
# (1B-geometry layers, dynamic vs static: 16 takes attention's softmax at 65 of 128 queries from 1.057x to
# 1.042x and costs 100 of 128 0.3%; 8 took 33 of 64 from 1.051x to 1.061x)
MIN_PIECE_CHUNKS = 16
# (register holding the valid rows of each piece of a tile, the piece's rows), or None: every row is valid
ValidRows = tuple[Reg, int] | None
NEG_INF = 0xFF800000
NEG_ZERO = 0x80000000
ZERO_BITS = 0

COMBINERS = {"arith.addf": ("vadd.f", "vred.sum.l", "vred.sum.s", ZERO_BITS),
             "arith.maximumf": ("vmax.f", "vred.max.l", "vred.max.s", NEG_INF),
             "arith.maxnumf": ("vmax.f", "vred.max.l", "vred.max.s", NEG_INF)}


@dataclass
class Stream:
    """One operand of the tile loop: its view, per-row element stride and class."""

    view: View
    row_stride: int
    base: int  # element offset of the group's first row
    kind: str  # "row" | "col"
    arg: str  # body block argument name
    tiles: tuple[Region, Region] | None = None
    expanded: Region | None = None
    ptr: Reg | None = None  # HBM byte address of the next tile to load
    base_reg: Reg | None = None  # HBM byte address of `base` when it is a loop register (a group loop)


def lower_fill(ctx: KernelContext, k: FillKernel) -> None:
    body = ScalarProgram(["%out"], [], ["%c"], {"%c": k.value})
    gk = GenericKernel(k.output.shape or (1,), False, [], Access(k.output, k.output.strides or (0,)), body)
    lower_generic(ctx, gk)


def _iteration(k: GenericKernel) -> tuple[list[int], list[list[int]], list[int]]:
    """The iteration sizes and every operand's strides (inputs, then the output), size-1 outer dims dropped,
    and the kernel's iteration dim at each place."""
    sizes = list(k.sizes) or [1]
    operands = [*k.inputs, k.output]
    strides = [list(o.iter_strides) or [0] for o in operands]
    if sizes[-1] == 1:  # one element a row (a 0-d tensor, a size-1 last dim): its stride is meaningless
        for st in strides[:-1]:
            st[-1] = 1
        strides[-1][-1] = 0 if k.reduction else 1
    # an outer dim of size 1 has no stride that matters either: dropped, so that it does not stop the dims
    # around it from merging into rows ([1, H, 1, D] by [*, D, *, 1] is H rows, not H groups of one row,
    # each paying a DMA latency: a decode step's per-head permutes and rope)
    keep = [d for d in range(len(sizes) - 1) if sizes[d] != 1] + [len(sizes) - 1]
    sizes, strides = [sizes[d] for d in keep], [[st[d] for d in keep] for st in strides]
    if any(a.view.buffer == k.output.view.buffer for a in k.inputs):  # in place: keep the program's order
        return sizes, strides, keep
    order = [*_row_order(sizes[:-1], strides), len(sizes) - 1]
    return [sizes[d] for d in order], [[st[d] for d in order] for st in strides], [keep[d] for d in order]


def _row_order(outer: list[int], strides: list[list[int]]) -> list[int]:
    """The order of the outer (parallel) dims that merges the most of them into rows: the program's, or
    one operand's layout order (largest stride first). A transpose's [L, H] iteration over an [H, L, D]
    input merges nothing in the output's order (L groups of H rows, a DMA latency each) but L rows in the
    input's (H groups)."""
    candidates = [list(range(len(outer)))]
    for st in strides:
        candidates.append(sorted(range(len(outer)), key=lambda d, st=st: -abs(st[d])))

    def rows(order: list[int]) -> int:
        return _merge_rows([outer[d] for d in order], [[st[d] for d in order] + [st[-1]] for st in strides])[1]

    return max(candidates, key=rows)  # the first of the best: the program's order when it is as good


def _merge_rows(outer: list[int], strides: list[list[int]]) -> tuple[int, int, list[int]]:
    """(split, rows, row strides): the longest uniformly strided suffix of the outer dims merged into one
    row dim; the dims before `split` stay groups."""
    split = len(outer)
    while split > 0 and (split == len(outer) or all(st[split - 1] == st[split] * outer[split] for st in strides)):
        split -= 1
    rows = math.prod(outer[split:]) if outer else 1
    return split, rows, [st[len(outer) - 1] if len(outer) > split else 0 for st in strides]


def _flattened(k: GenericKernel, lanes: int) -> GenericKernel:
    """An elementwise generic whose rows are narrower than a vmem row, with the trailing dims that every
    operand lays out densely (row-major, the last at stride 1) as [m / N, N]: a row of C elements takes a
    whole vmem row (one element a row for attention's [.., L, 1] row values, whose 8,192 rows a 256-query
    block made a ~30K-cycle kernel of a division; a causal query block's copy of its queries, [KVH, rep,
    256, 64] from q's [H, L, 64], rows of 64). All dims where every operand is dense in one layout. Not for
    reductions, a dynamic-shape bucket's bounded kernels, or where N does not divide the merged dims."""
    n = math.prod(k.sizes)
    if k.reduction or k.valid_extent is not None or not k.sizes or k.sizes[-1] >= lanes:
        return k
    operands = [*k.inputs, k.output]
    if n % lanes == 0 and all(row_major(k.sizes, a.iter_strides) for a in operands):
        split, m = 0, n
    else:  # the dense trailing dims
        split, m = len(k.sizes) - 1, k.sizes[-1]
        if not FLATTEN_TRAILING or any(a.iter_strides[-1] != 1 for a in operands):
            return k
        while split > 0 and all(a.iter_strides[split - 1] == m for a in operands):
            split -= 1
            m *= k.sizes[split]
        if m % lanes:  # also where nothing merged: the last dim alone is narrower than N
            return k
    shape = (*k.sizes[:split], m // lanes, lanes)

    def flat(a: Access) -> Access:
        strides = (*a.iter_strides[:split], lanes, 1)
        return Access(View(a.view.buffer, a.view.offset, shape, strides, a.view.dtype), strides)

    return dataclasses.replace(k, sizes=shape, inputs=[flat(a) for a in k.inputs], output=flat(k.output))


def lower_generic(ctx: KernelContext, k: GenericKernel) -> None:
    k = _flattened(k, ctx.lanes)
    sizes, strides, dims = _iteration(k)
    views = [o.view for o in [*k.inputs, k.output]]
    # transposed operands (stride along the row neither 0 nor 1) are copied into row order first
    for i, st in enumerate(strides[:-1]):
        if st[-1] not in (0, 1):
            views[i], strides[i] = _materialize(ctx, views[i], st, sizes)
    if strides[-1][-1] not in (0, 1) or (strides[-1][-1] == 0) != k.reduction:
        raise LoweringError("generic whose output is not laid out along the innermost iteration dim")
    C = sizes[-1]
    outer = sizes[:-1]
    N = ctx.lanes
    P = -(-C // N)
    split, rows, row_strides = _merge_rows(outer, strides)
    bounded = _bounded_place(k, dims, outer)
    shared_tile = False  # bounded groups that one tile holds together (their loop is the tile loop)
    if bounded is not None and bounded >= split and bounded > 0:
        # rows bounded at or inside the merged rows (attention's [KVH, rep, L] query rows): the dims before
        # the bounded one are groups, each holding the same runtime count of valid rows, merged into one loop
        # where they can be. Inside the rows, only where the groups still share tiles (enough of them to
        # loop, or few enough to share one) or each fills a tile; else each would wait a DMA latency, and
        # the rows stay whole
        g_sizes, g_strides, g_dims = _merged_groups(sizes, strides, dims, bounded)
        g_split = len(g_sizes) - 1 - (len(outer) - bounded)
        group_rows = math.prod(outer[bounded:]) * P
        one_tile = g_split == 1 and g_sizes[0] * group_rows <= max_tile_vmem_rows(ctx.config)
        if bounded == split or max(g_sizes[:g_split]) > UNROLL_CHUNKS or one_tile or \
                group_rows >= max_tile_vmem_rows(ctx.config):
            sizes, strides, dims, split = g_sizes, g_strides, g_dims, g_split
            outer = sizes[:-1]
            rows = math.prod(outer[split:])
            shared_tile = one_tile
    groups = outer[:split]
    body_args = k.body.args
    # groups (outer dims not merged into rows): the longest group dim runs as a runtime loop whose
    # operand addresses are pointer registers (code size independent of it), the others are unrolled
    d, looped = _longest(groups) if groups else (0, 1)
    looped = looped if looped > UNROLL_CHUNKS or shared_tile else 1
    valid = _valid_rows(k, dims, outer, split)
    buffers: TileBuffers | None = None
    for g_index in _multi_index(groups[:d] + groups[d + 1:] if looped > 1 else groups):
        if looped > 1:
            g_index = (*g_index[:d], 0, *g_index[d:])
        base = [sum(i * s for i, s in zip(g_index, st, strict=False)) for st in strides]
        streams = [Stream(v, rs, v.offset + bo, "row" if st[-1] == 1 else "col", arg)
                   for v, rs, bo, st, arg in zip(views, row_strides, base, strides, body_args, strict=True)]
        if buffers is None:  # groups run one after another and share one set of tiles (vmem is not freed)
            buffers = _tile_buffers(ctx, k, streams, rows * looped, P)
        if looped == 1:
            _tile_loop(ctx, k, streams, buffers, rows, C, P, valid=valid)
            if math.prod(groups) == 1 and valid is None and _leaves_output(ctx, k, streams[-1], rows, C, buffers):
                out = streams[-1]
                region = buffers.out[0]
                ctx.leave(Resident(out.view.buffer, out.view.dtype, out.base, rows, C, out.row_stride,
                                   Region(region.name, region.row, rows * P)))
            continue
        if rows <= buffers.tile_rows:  # whole groups fit a tile: the group loop is the tile loop
            steps = [st[d] * ESIZE[s.view.dtype] for s, st in zip(streams, strides, strict=True)]
            _tile_loop(ctx, k, streams, buffers, rows, C, P, groups=(looped, steps), valid=valid)
            continue
        for s in streams:
            s.base_reg = ctx.b.sreg()
            ctx.b.emit("addi", s.base_reg, (ctx.hbm_addr(s.view, s.base),), imm=0)

        def group(streams: list[Stream] = streams, buffers: TileBuffers = buffers) -> None:
            _tile_loop(ctx, k, streams, buffers, rows, C, P, valid=valid)
            for s, st in zip(streams, strides, strict=True):
                if st[d]:
                    ctx.b.addi(s.base_reg, st[d] * ESIZE[s.view.dtype], s.base_reg)

        ctx.b.counted_loop(looped, group, "group")


def _leaves_output(ctx: KernelContext, k: GenericKernel, out: Stream, rows: int, C: int,
                   buffers: TileBuffers) -> bool:
    """Whether a map of one tile leaves its output in vmem for the next kernel (`KernelContext.leave`: a
    decode step's attention output, which o_proj's weight stream reads there, a DMA latency earlier): whole
    vmem rows (a load zeroes the lanes past a row's end, the map writes them), and what a load of the stored
    values brings: f32, or bf16 rounded by the body itself (`arith.truncf`) or read as bf16."""
    if k.reduction or out.kind != "row" or rows > buffers.tile_rows or C % ctx.lanes:
        return False
    made = dict((name, op) for name, op, _ in k.body.ops)
    result = k.body.yields[0]
    exact = out.view.dtype == "f32" or made.get(result) == "arith.truncf" or (
        result in k.body.args[:-1] and k.inputs[k.body.args.index(result)].view.dtype == "bf16")
    return exact and out.view.dtype in ("f32", "bf16")


def _valid_rows(k: GenericKernel, dims: list[int], outer: list[int], split: int) -> tuple[int, int] | None:
    """(argument holding the valid length, rows per unit of it) when the kernel's valid extent bounds the
    rows of each group: the bounded iteration dim is the outermost of the dims merged into rows."""
    if k.valid_extent is None or split >= len(outer) or dims[split] != k.valid_extent[1]:
        return None
    return k.valid_extent[0], math.prod(outer[split + 1:])


def _bounded_place(k: GenericKernel, dims: list[int], outer: list[int]) -> int | None:
    """The place among the outer dims of the iteration dim the kernel's valid extent bounds, if any."""
    if k.valid_extent is None or k.valid_extent[1] not in dims[:len(outer)]:
        return None
    return dims.index(k.valid_extent[1])


def _merged_groups(sizes: list[int], strides: list[list[int]], dims: list[int],
                   split: int) -> tuple[list[int], list[list[int]], list[int]]:
    """The group dims (before `split`) merged where every operand strides them uniformly (attention's KVH and
    rep: one group dim of KVH x rep, a runtime loop, not rep unrolled copies of a loop over KVH)."""
    sizes, strides, dims = list(sizes), [list(st) for st in strides], list(dims)
    d = split - 1
    while d > 0:
        if all(st[d - 1] == st[d] * sizes[d] for st in strides):
            sizes[d - 1:d + 1] = [sizes[d - 1] * sizes[d]]
            for st in strides:
                st[d - 1:d + 1] = [st[d]]
            dims[d - 1:d + 1] = [dims[d]]
        d -= 1
    return sizes, strides, dims


def _longest(dims: list[int]) -> tuple[int, int]:
    """(index, size) of the longest dim (the first of equals): the one worth a runtime loop."""
    d = max(range(len(dims)), key=lambda i: (dims[i], -i))
    return d, dims[d]


def _multi_index(dims: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for d in dims:
        out = [(*o, i) for o in out for i in range(d)]
    return out


def _materialize(ctx: KernelContext, view: View, st: list[int], sizes: list[int]) -> tuple[View, list[int]]:
    """Copy a transposed operand into HBM scratch in iteration order: one DMA pair per row (column in,
    column out through lane 0 of C vmem rows); a runtime loop over the longest outer dim."""
    b = ctx.b
    C = sizes[-1]
    esize = ESIZE[view.dtype]
    n_rows = math.prod(sizes[:-1]) if len(sizes) > 1 else 1
    reg, off = ctx.scratch_bytes(n_rows * C * esize)
    region = ctx.region(C, "gather")
    outer = sizes[:-1] or [1]

    def pair(src: Reg, dst: Reg) -> None:
        ctx.dma(True, view.dtype, src, region, 0, C, 1, st[-1], Flag.COPY)
        ctx.dma(False, view.dtype, dst, region, 0, C, 1, 1, Flag.COPY)

    # the longest outer dim is a runtime loop (pointer registers) when long, the others are unrolled
    d, count = _longest(outer)
    src_step = st[d] * esize if len(sizes) > 1 else 0
    dst_step = math.prod(outer[d + 1:]) * C * esize
    for idx in _multi_index(outer[:d] + outer[d + 1:]):
        full = (*idx[:d], 0, *idx[d:])
        src = ctx.hbm_addr(view, view.offset + sum(i * s for i, s in zip(full, st, strict=False)))
        dst_off = off + sum(i * math.prod(outer[j + 1:]) for j, i in enumerate(full)) * C * esize
        if count > UNROLL_CHUNKS:
            src_ptr, dst_ptr = b.sreg(), b.sreg()
            b.emit("addi", src_ptr, (src,), imm=0)
            b.emit("addi", dst_ptr, (b.offset_reg(reg, dst_off),), imm=0)

            def copy_row(src: Reg = src_ptr, dst: Reg = dst_ptr) -> None:
                pair(src, dst)
                b.addi(src, src_step, src)
                b.addi(dst, dst_step, dst)

            b.counted_loop(count, copy_row, "transpose")
        else:
            for j in range(count):
                pair(b.offset_reg(src, j * src_step), b.offset_reg(reg, dst_off + j * dst_step))
    b.emit("wait", flag=ctx.flag(Flag.COPY))
    name = f"scratch@{off}"
    ctx.hbm_base[name] = (reg, off)
    dense = [0] * len(sizes)
    acc = 1
    for d in reversed(range(len(sizes))):
        dense[d] = acc if sizes[d] != 1 else 0
        acc *= sizes[d]
    return View(name, 0, tuple(sizes), tuple(dense), view.dtype), dense


def max_tile_vmem_rows(config: HardwareConfig) -> int:
    """vmem rows of one operand's tile: MAX_TILE_VMEM_ROWS, or more where a DMA latency moves more rows
    (`large`: 500 cycles x 4 full bf16 rows, 2048), so that two tiles in flight keep the channel busy. Full
    rows: the port may move more rows a cycle than HBM delivers full ones (`large`: 8 against 4)."""
    rows_per_cycle = max(1, min(config.vmem_port_rows, config.hbm_bytes_per_cycle // (2 * config.lanes)))
    return max(MAX_TILE_VMEM_ROWS, 1 << (config.dma_latency * rows_per_cycle - 1).bit_length())


def _choose_tile_rows(ctx: KernelContext, k: GenericKernel, streams: list[Stream], rows: int, P: int) -> int:
    """The most rows per tile (<= `max_tile_vmem_rows` per operand) whose double-buffered tiles fit the free
    vmem."""
    out = streams[-1]
    loads = streams[:-1] + ([out] if k.reads_output else [])
    by_rows = _maps_by_rows(k, P, streams)

    def need(t: int) -> int:
        total = 2 * region_rows(t * (1 if k.reduction else P) + 8)
        for s in loads:
            total += 2 * region_rows(t * (P if s.kind == "row" else 1) + 8)
            if s.kind == "col" and s is not out:  # its broadcast rows, or an upper bound of its row values
                total += region_rows(t * (1 if by_rows else P) + 8)
        return total

    t = max(1, min(rows, max_tile_vmem_rows(ctx.config) // P))
    while t > 1 and need(t) > ctx.vmem_free():
        t = max(1, min(t - 1, t * ctx.vmem_free() // need(t)))
    if need(t) > ctx.vmem_free():
        raise LoweringError(f"{ctx.kernel}: one row of {P} vmem rows per operand does not fit vmem")
    return t


@dataclass(frozen=True)
class TileBuffers:
    """The vmem of a generic's tile loop: T rows a tile, double-buffered tiles of each loaded stream (in
    stream order; None for the output of a map), the broadcast row layout of each column stream, the output
    tiles."""

    tile_rows: int
    tiles: list[tuple[Region, Region] | None]
    expanded: list[Region | None]
    out: tuple[Region, Region]
    row_values: RowValues | None = None  # a row pass's


def _tile_buffers(ctx: KernelContext, k: GenericKernel, streams: list[Stream], rows: int, P: int) -> TileBuffers:
    out = streams[-1]
    tile_rows = _choose_tile_rows(ctx, k, streams, rows, P)
    by_rows = _maps_by_rows(k, P, streams)
    tiles: list[tuple[Region, Region] | None] = []
    expanded: list[Region | None] = []
    for s in streams:
        per_row = P if s.kind == "row" else 1
        loaded = s is not out or k.reads_output
        tiles.append((ctx.region(tile_rows * per_row + 8, "in"), ctx.region(tile_rows * per_row + 8, "in"))
                     if loaded else None)
        expanded.append(ctx.region(tile_rows * P + 8, "bcast") if s.kind == "col" and s is not out and not by_rows
                        else None)
    out_rows = tile_rows * (1 if k.reduction else P) + 8
    return TileBuffers(tile_rows, tiles, expanded, (ctx.region(out_rows, "out"), ctx.region(out_rows, "out")),
                       _row_values(ctx, k.body, streams, set(), tile_rows) if by_rows else None)


def _tile_loop(ctx: KernelContext, k: GenericKernel, streams: list[Stream], buffers: TileBuffers, rows: int,
               C: int, P: int, groups: tuple[int, list[int]] | None = None,
               valid: tuple[int, int] | None = None) -> None:
    """Double-buffered tiles of T rows: tile i waits for its loads (flag LOAD + i % 2), issues the loads of
    tile i + 1, waits for the store of tile i - 2 (STORE + i % 2), computes, and stores. Pairs of full tiles
    run in a runtime loop; the last one or two tiles follow it (the last tile may be partial).

    `groups` (count, each stream's byte step from a group to the next): `count` groups of `rows` rows run
    as the tiles, as many whole groups a tile as fit (one DMA per group and stream), so that groups do not
    each pay a DMA latency (a transpose's heads).

    `valid` (argument, rows per unit of its value): only the first value x unit rows are valid (the rest is
    a dynamic-shape bucket's padding that nothing reads): the tiles run while rows are left, each moving
    min(rows left, T) rows (`_runtime_tiles`); with `groups`, each group holds that many valid rows of its
    `rows`, which its DMAs move. Either way a tile's loops run about its valid rows (`_over_rows`)."""
    b = ctx.b
    out = streams[-1]
    loads = streams[:-1] + ([out] if k.reads_output else [])  # a reduction reads its output's initial value
    tile_rows, out_tiles = buffers.tile_rows, buffers.out
    for s, tiles, expanded in zip(streams, buffers.tiles, buffers.expanded, strict=True):
        s.tiles, s.expanded = tiles, expanded
    # each tile: (rows of one DMA piece, pieces)
    if groups is None:
        sizes = [(min(tile_rows, rows - t0), 1) for t0 in range(0, rows, tile_rows)]
        steps: list[int | None] = [None] * len(streams)
    else:
        count, steps = groups[0], list(groups[1])
        per = tile_rows // rows
        sizes = [(rows, min(per, count - g0)) for g0 in range(0, count, per)]
    step = {id(s): st for s, st in zip(streams, steps, strict=True)}

    def move(load: bool, s: Stream, region: Region, p: int, n: int, pieces: int, rows_reg: Reg | None) -> None:
        """The DMAs of one tile of stream s, a piece after another in vmem, advancing its HBM pointer (by n
        rows a piece: `rows_reg`, the rows moved at run time, is at most n)."""
        ptr = s.ptr if load else out_ptr
        assert ptr is not None
        cols = C if s.kind == "row" else 1  # a reduction's output is a column
        pitch = -(-cols // ctx.lanes)
        for j in range(pieces):
            ctx.dma(load, s.view.dtype, ptr, region, j * n * pitch, n, cols, s.row_stride,
                    Flag.LOAD if load else Flag.STORE, p, rows_reg=rows_reg)
            nbytes = n * s.row_stride * ESIZE[s.view.dtype] if step[id(s)] is None else step[id(s)]
            if nbytes:
                b.addi(ptr, nbytes, ptr)

    for s in loads:
        s.ptr = b.sreg()
        b.emit("addi", s.ptr, (s.base_reg or ctx.hbm_addr(s.view, s.base),), imm=0)
    out_ptr = b.sreg()
    b.emit("addi", out_ptr, (out.base_reg or ctx.hbm_addr(out.view, out.base),), imm=0)

    def issue_loads(p: int, size: tuple[int, int], rows_reg: Reg | None = None) -> None:
        for s in loads:
            assert s.tiles is not None
            move(True, s, s.tiles[p], p, *size, rows_reg)

    def tile(p: int, size: tuple[int, int], issue_next: Callable[[], None], rows_reg: Reg | None = None) -> None:
        n = size[0] * size[1]
        b.emit("wait", flag=ctx.flag(Flag.LOAD, p))
        issue_next()
        # a runtime tile computes about the rows it moves: rows_reg of each piece of size[0] rows
        computed = (rows_reg, size[0]) if valid is not None and rows_reg is not None else None
        for s in streams[:-1]:
            if s.expanded is not None:
                assert s.tiles is not None
                _broadcast_rows(b, s.tiles[p], s.expanded, n, P, s.view.dtype in ("i32", "i1"), computed)
        b.emit("wait", flag=ctx.flag(Flag.STORE, p))
        if k.reduction:
            _reduce_tile(ctx, k.body, streams, p, out_tiles[p], n, C, P, k.init, computed)
        elif _maps_by_rows(k, P, streams):
            values = buffers.row_values
            if values is not None:
                _fill_row_values(b, k.body, streams, set(), values, p, n, computed)
            _row_pass(ctx, [RowWork(k, streams, out_tiles[p], C, row_values=values.loaded(streams, p) if values
                                    else {})], p, n, P, computed)
        else:
            _map_tile(ctx, k.body, streams, p, out_tiles[p], n, P, computed)
        move(False, out, out_tiles[p], p, *size, rows_reg)
        b.new_block("tile_next")  # a tile's code ends a block: its DMA issues before the next tile's waits

    if valid is not None and groups is None:
        _runtime_tiles(ctx, valid, rows, sizes[0][0], issue_loads, tile)
        return
    # with groups: the valid rows each group holds
    moved = None if valid is None else _valid_count(ctx, valid, rows)

    def static_tile(p: int, size: tuple[int, int], next_size: tuple[int, int] | None) -> None:
        tile(p, size, lambda: issue_loads(1 - p, next_size, moved) if next_size else None, moved)

    _double_buffered(b, sizes, lambda size: issue_loads(0, size, moved), static_tile, "tiles")


Size = TypeVar("Size")  # a tile's size: its rows, or (rows of a DMA piece, pieces)


def _double_buffered(b: Builder, sizes: list[Size], first_loads: Callable[[Size], None],
                     tile: Callable[[int, Size, Size | None], None], hint: str) -> None:
    """Tiles of `sizes` (all but the last full) in buffers 0 and 1 by turns: the first tile's loads, pairs
    of full tiles in a counted loop, then the one or two left. `tile(p, size, next size or None)` computes
    in buffer p and issues the next tile's loads into the other."""
    first_loads(sizes[0])
    pairs = (len(sizes) - 1) // 2  # tiles 0 .. 2 * pairs - 1 are full and each has a next tile
    if pairs:
        b.counted_loop(pairs, lambda: (tile(0, sizes[0], sizes[0]), tile(1, sizes[0], sizes[0])), hint)
    for i in range(2 * pairs, len(sizes)):
        tile(i % 2, sizes[i], sizes[i + 1] if i + 1 < len(sizes) else None)


def _runtime_tiles(ctx: KernelContext, valid: tuple[int, int], rows: int, T: int,
                   issue_loads: Callable[..., None], tile: Callable[..., None]) -> None:
    """The tile loop over a runtime count of rows (value of argument valid[0] x valid[1], clamped to
    [1, rows]): pairs of tiles while rows are left, each tile computing T rows and moving min(left, T) (the
    computed rows past them are never stored); the next tile's loads are issued only when rows are left for
    it, so that no DMA moves 0 rows."""
    b = ctx.b
    left = _valid_count(ctx, valid, rows)

    def now(x: Reg) -> Reg:
        return b.emit("min", b.sreg(), (x, b.const(T)))

    def runtime_tile(p: int) -> None:
        def issue_next() -> None:
            nxt = b.emit("addi", b.sreg(), (left,), imm=-T)
            b.if_positive(nxt, lambda: issue_loads(1 - p, (T, 1), now(nxt)), "next_tile")

        tile(p, (T, 1), issue_next, now(left))

    def pair() -> None:
        runtime_tile(0)
        b.addi(left, -T, left)
        b.if_positive(left, lambda: runtime_tile(1), "odd_tile")

    issue_loads(0, (T, 1), now(left))
    b.while_positive(left, T, pair, "tiles")  # after a skipped odd tile, left <= -T: the loop ends


def _valid_count(ctx: KernelContext, valid: tuple[int, int], rows: int) -> Reg:
    """A register holding the valid rows among `rows` (`_tile_loop`'s valid: argument, rows per unit)."""
    return ctx.valid_count(valid[0], rows // valid[1], valid[1])


def _over_rows(b: Builder, n: int, vrows_per_row: int, rows: ValidRows,
               emit: Callable[[Reg, int, Reg | None], None]) -> None:
    """emit(first row, count, valid) over a tile's n rows, where `valid` is None (every row counts) or a
    register holding the valid rows among the count, which the emitted loops take as their runtime trip
    count (`chunk_loop`'s wanted), so that a tile of a dynamic-shape bucket computes about the rows it holds,
    not all n (rows past them up to a loop's rounding are computed and never stored). `rows`: (a register
    holding the valid rows of each piece, the piece's rows: a group's), or None. Pieces that do not fill
    whole chunks of 8 vmem rows share chunks, and pieces shorter than MIN_PIECE_CHUNKS would each pay a
    pipeline's fill: such tiles are computed whole."""
    if rows is None:
        emit(ZERO, n, None)
        return
    valid, piece = rows
    if n == piece:
        emit(ZERO, n, valid)
        return
    if piece * vrows_per_row % 8 or piece * vrows_per_row < 8 * MIN_PIECE_CHUNKS:
        emit(ZERO, n, None)
        return
    first = b.sreg()
    b.emit("li", first, imm=0)

    def one_piece() -> None:
        emit(first, piece, valid)
        b.addi(first, piece, first)

    b.counted_loop(n // piece, one_piece, "piece")


def _chunks(b: Builder, valid: Reg | None, vrows_per_row: int) -> Reg | None:
    """A register holding the chunks of 8 vmem rows that `valid` rows span (None: None)."""
    if valid is None:
        return None
    vrows = valid if vrows_per_row == 1 else b.emit("mul", b.sreg(), (valid, b.const(vrows_per_row)))
    return b.emit("srai", b.sreg(), (b.emit("addi", b.sreg(), (vrows,), imm=7),), imm=3)


def _set_times(b: Builder, dst: Reg, first: Reg, factor: int) -> None:
    """dst = first x factor (li 0 for a tile's first row)."""
    if first == ZERO:
        b.emit("li", dst, imm=0)
    else:
        b.emit("mul", dst, (first, b.const(factor)))


def _lane0_mask(b: Builder) -> Reg:
    return b.vop("vcmp.eq.i", b.vop_imm("viota", 0), b.vconst_bits(0))


def _lane0_everywhere(b: Builder, v: Reg, integer: bool) -> Reg:
    """Each row's lane-0 value in every lane: a max across lanes over -inf elsewhere. Integer and bool
    bits are not fp32 values (a NaN or subnormal pattern would not survive a float max), so they travel
    as two exact 16-bit halves converted to fp32 and back."""
    def spread(x: Reg) -> Reg:
        return b.vop("vred.max.l", b.vop("vsel", _lane0_mask(b), x, b.vconst_bits(NEG_INF)))
    if not integer:
        return spread(v)
    sixteen = b.vconst_bits(16)
    lo = b.vop("vcvt.i2f", b.vop("vand", v, b.vconst_bits(0xFFFF)))
    hi = b.vop("vcvt.i2f", b.vop("vshr", v, sixteen))
    return b.vop("vor", b.vop("vshl", b.vop("vcvt.f2i", spread(hi)), sixteen), b.vop("vcvt.f2i", spread(lo)))


def _broadcast_rows(b: Builder, col: Region, dst: Region, n: int, P: int, integer: bool = False,
                    rows: ValidRows = None) -> None:
    """dst (row layout, P vmem rows per row) = the lane-0 value of each of the n rows of `col` (integer:
    int32 / bool bits, copied exactly); `rows`: see `_over_rows`."""
    if P == 1:
        def chunk(off: Reg) -> None:
            v = b.vld(off, col.row, row_mem(col, off, 0, 8))
            r = _lane0_everywhere(b, v, integer)
            b.vst(r, off, dst.row, row_mem(dst, off, 0, 8, True))

        _over_rows(b, n, 1, rows, lambda first, count, valid: chunk_loop(
            b, -(-count // 8), chunk, "bcast", first, wanted=_chunks(b, valid, 1)))
        return
    P8 = -(-P // 8)
    row_base = b.sreg()

    def row(t: Reg) -> None:
        v = b.vld(t, col.row, row_mem(col, t, 0, 1), "vld.row")
        r = _lane0_everywhere(b, v, integer)
        if P8 <= UNROLL_CHUNKS:
            for j in range(P8):
                b.vst(r, row_base, dst.row + 8 * j, row_mem(dst, row_base, 0, 8, True))
        else:
            chunk_loop(b, P8, lambda off: b.vst(r, off, dst.row, row_mem(dst, off, 0, 8, True)), "bcast_row",
                       row_base)
        b.emit("addi", row_base, (row_base,), imm=P)

    def part(first: Reg, count: int, valid: Reg | None) -> None:
        _set_times(b, row_base, first, P)
        chunk_loop(b, count, row, "bcast_rows", first, step=1, ivs={row_base: P}, wanted=valid)

    _over_rows(b, n, P, rows, part)


def _load(b: Builder, s: Stream, p: int, base: Reg, row: int = 0) -> Reg:
    assert s.tiles is not None
    region = s.expanded if s.expanded is not None else s.tiles[p]
    return b.vld(base, region.row + row, row_mem(region, base, row, 8))


def _store(b: Builder, r: Reg, out: Region, base: Reg, row: int = 0) -> None:
    b.vst(r, base, out.row + row, row_mem(out, base, row, 8, True))


def _maps_by_rows(k: GenericKernel, P: int, streams: list[Stream]) -> bool:
    """Whether a generic maps row by row (`_row_pass`): a map with a column operand over rows of whole chunks
    of 8 vmem rows or more, at most UNROLL_CHUNKS of them."""
    return ROW_PASSES and not k.reduction and 8 <= P <= 8 * UNROLL_CHUNKS and any(
        s.kind == "col" for s in streams[:-1])


def _derived(body: ScalarProgram, args: set[str]) -> list[str]:
    """The body's values computed from `args` and constants alone (each depending on one of `args`), in order."""
    known, out = set(args), []
    for res, _, ops in body.ops:
        if ops and all(o in known or o in body.constants for o in ops) and any(o in known for o in ops):
            known.add(res)
            out.append(res)
    return out


def _evaluated(b: Builder, body: ScalarProgram, env: dict[str, Reg], names: list[str]) -> dict[str, Reg]:
    """env with the values `names` (each computable from env and the earlier names) emitted now."""
    values = dict(env)
    for name in names:
        values[name] = evaluate(b, body, values, name)
    return values


@dataclass
class RowWork:
    """One generic's part in a row pass (`_row_pass`): its streams and output tile (of the tile's parity),
    the columns whose every lane holds the row's value, the row operands an earlier work of the pass computes
    (argument -> that work's index: its value, never loaded), and for a map whether its value is stored to
    its output tile (something past the pass reads it there)."""

    kernel: GenericKernel
    streams: list[Stream]
    out: Region
    C: int
    full_lanes: set[str] = field(default_factory=set)
    fed: dict[str, int] = field(default_factory=dict)
    stored: bool = True
    # a row's values from its columns (`_row_values`) in these regions, every lane of a row (the tile's columns
    # when an earlier reduction spread them): loaded, not computed, by the pass
    row_values: dict[str, Region] = field(default_factory=dict)


def _row_pass(ctx: KernelContext, works: list[RowWork], p: int, n: int, P: int, rows: ValidRows = None) -> None:
    """Maps and reductions over a tile's n rows of P >= 8 vmem rows, a row at a time, each chunk of a row
    computing every work in turn (a prefill softmax's scaled scores and their max, then the exponentials, their
    sum and their bf16 copy): a work reads an earlier one's value in a register, not from vmem, and a map's
    value that only the pass reads is never stored. Each column operand is loaded once a row (`vld.row`,
    spread across lanes unless `full_lanes` says every lane holds it), and what a body computes from its
    columns alone once a row: no broadcast pass stores a column's rows to vmem for the chunks to load; or,
    with `row_values`, those values were computed for the tile 8 rows at a time (`_row_values`). A row
    operand the same in every row (a key index) is loaded, and what derives from it computed, once a tile. A
    reduction combines its row's chunks in registers and stores the row's value at the row's end.
    A row's last chunk of a P that is no multiple of 8 runs into the next row's first vmem rows: a reduction
    masks them out, a map's store there is overwritten by the next row's (vst order is kept), past the last
    row it lands in the tile's 8 spare rows. `rows`: see `_over_rows`."""
    b = ctx.b
    P8 = -(-P // 8)
    # per work: (columns, what derives from them, rows loaded each chunk, each chunk's values computed once a tile)
    parts = []
    for w in works:
        body = w.kernel.body
        cols = [s for s in w.streams[:-1] if s.kind == "col"]
        rows_in = [s for s in w.streams[:-1] if s.kind == "row" and s.arg not in w.fed]
        fixed = [s for s in rows_in if _same_every_row(s)]
        chunks = [_evaluated(b, body, {s.arg: _load(b, s, p, ZERO, 8 * j) for s in fixed},
                             _derived(body, {s.arg for s in fixed})) for j in range(P8)]
        varying = [s for s in rows_in if not _same_every_row(s)]
        parts.append((cols, _derived(body, {s.arg for s in cols}), varying, chunks))
    reductions = [_Reduction(b, w.kernel.body, w.kernel.init) if w.kernel.reduction else None for w in works]
    row_base = b.sreg()

    def row(t: Reg) -> None:
        envs = []
        for w, (cols, per_row, _, _) in zip(works, parts, strict=True):
            if w.row_values:
                envs.append({name: b.vld(t, r.row, row_mem(r, t, 0, 1), "vld.row") for name, r in w.row_values.items()})
                continue
            env = {}
            for s in cols:
                assert s.tiles is not None
                v = b.vld(t, s.tiles[p].row, row_mem(s.tiles[p], t, 0, 1), "vld.row")
                env[s.arg] = v if s.arg in w.full_lanes else _lane0_everywhere(b, v, s.view.dtype in ("i32", "i1"))
            envs.append(_evaluated(b, w.kernel.body, env, per_row))
        accs: list[Reg | None] = [None] * len(works)
        for j in range(P8):
            values: list[Reg] = []
            for i, (w, (_, _, varying, chunks)) in enumerate(zip(works, parts, strict=True)):
                body = w.kernel.body
                env = envs[i] | chunks[j] | {a: values[src] for a, src in w.fed.items()} | {
                    s.arg: _load(b, s, p, row_base, 8 * j) for s in varying}
                r = reductions[i]
                if r is not None:
                    f = evaluate(b, body, env, r.value)
                    tail = w.C % (8 * ctx.lanes)
                    if tail and j == P8 - 1:
                        f = r.masked(f, tail)
                    accs[i] = r.combined(accs[i], f)
                    values.append(f)
                    continue
                v = evaluate(b, body, env, body.yields[0])
                if w.stored:
                    _store(b, v, w.out, row_base, 8 * j)
                values.append(v)
        for w, r, acc in zip(works, reductions, accs, strict=True):
            if r is not None and acc is not None:
                _store(b, r.row_value(acc, w.streams[-1], p, t), w.out, t)
        b.emit("addi", row_base, (row_base,), imm=P)

    def part(first: Reg, count: int, valid: Reg | None) -> None:
        _set_times(b, row_base, first, P)
        chunk_loop(b, count, row, "row_pass", first, step=1, ivs={row_base: P}, wanted=valid)

    _over_rows(b, n, P, rows, part)


def _map_tile(ctx: KernelContext, body: ScalarProgram, streams: list[Stream], p: int, out: Region, n: int,
              P: int, rows: ValidRows = None) -> None:
    b = ctx.b

    def chunk(off: Reg) -> None:
        env = {s.arg: _load(b, s, p, off) for s in streams[:-1]}
        _store(b, evaluate(b, body, env, body.yields[0]), out, off)

    def part(first: Reg, count: int, valid: Reg | None) -> None:
        start = b.sreg() if P > 1 and first != ZERO else first
        if start != first:
            _set_times(b, start, first, P)
        chunk_loop(b, -(-count * P // 8), chunk, "map", start, wanted=_chunks(b, valid, P))

    _over_rows(b, n, P, rows, part)


class _Reduction:
    """A reduction body's combiner: `combined` adds a chunk's values to a row's accumulator (None: none yet),
    `row_value` reduces it across lanes and sublanes and combines the output's initial value.
    The first chunk's value starts a row's accumulator where combining it with the identity first changes no
    bit of the result: a max (a NaN comes out canonical from the last max, with the initial value), a sum whose
    constant initial value is not -0 (0 + -0 is +0: only a row of -0 sums to -0 this way, and adding that
    initial value makes it +0 too). A vector op less a row: a prefill softmax's reductions are VPU-bound."""

    def __init__(self, b: Builder, body: ScalarProgram, init_value: float | None) -> None:
        self.b, self.init_value = b, init_value
        combine_name, self.value = _split_reduction(body, body.args[-1])
        self.vop, self.red_l, self.red_s, self.identity = COMBINERS[combine_name]
        self.starts_with_first = self.vop == "vmax.f" or (
            init_value is not None and int(np.float32(init_value).view(np.uint32)) != NEG_ZERO)

    def masked(self, f: Reg, tail: int) -> Reg:
        """f where a chunk's element is among its first `tail` (a row's last, partial chunk), the identity past."""
        b = self.b
        return b.vop("vsel", b.vop("vcmp.lt.i", b.vop_imm("viota", 2), b.vconst_bits(tail)), f,
                     b.vconst_bits(self.identity))

    def combined(self, acc: Reg | None, f: Reg) -> Reg:
        if acc is None:
            return f if self.starts_with_first else self.b.vop(self.vop, self.b.vconst_bits(self.identity), f)
        return self.b.vop(self.vop, acc, f)

    def initial(self, out: Stream, p: int, base: Reg, one_row: bool = False) -> Reg:
        """The output's initial value at `base`: a folded fill's constant, else what the tile loaded."""
        b = self.b
        if self.init_value is not None:
            return b.vconst_bits(int(np.float32(self.init_value).view(np.uint32)))
        assert out.tiles is not None
        if not one_row:
            return _load(b, out, p, base)
        return b.vld(base, out.tiles[p].row, row_mem(out.tiles[p], base, 0, 1), "vld.row")

    def with_initial(self, reduced: Reg, out: Stream, p: int, base: Reg, one_row: bool = False) -> Reg:
        """`reduced` (a lanes' reduction) combined with the output's initial value at `base`: as it is where that
        is a max's -inf (a lanes' max has made its NaN canonical already)."""
        if self.vop == "vmax.f" and self.init_value == -math.inf:
            return reduced
        return self.b.vop(self.vop, reduced, self.initial(out, p, base, one_row))

    def row_value(self, acc: Reg, out: Stream, p: int, t: Reg) -> Reg:
        """Row t's value from its accumulator, combined with the initial value."""
        b = self.b
        return self.with_initial(b.vop(self.red_s, b.vop(self.red_l, acc)), out, p, t, one_row=True)


def _reduce_tile(ctx: KernelContext, body: ScalarProgram, streams: list[Stream], p: int, out: Region, n: int,
                 C: int, P: int, init_value: float | None, rows: ValidRows = None) -> None:
    b = ctx.b
    r = _Reduction(b, body, init_value)
    vop, red_l, identity, value = r.vop, r.red_l, r.identity, r.value
    if P == 1:
        def chunk(off: Reg) -> None:
            env = {s.arg: _load(b, s, p, off) for s in streams[:-1]}
            f = evaluate(b, body, env, value)
            if C < ctx.lanes:
                mask = b.vop("vcmp.lt.i", b.vop_imm("viota", 0), b.vconst_bits(C))
                f = b.vop("vsel", mask, f, b.vconst_bits(identity))
            _store(b, r.with_initial(b.vop(red_l, f), streams[-1], p, off), out, off)

        _over_rows(b, n, 1, rows, lambda first, count, valid: chunk_loop(
            b, -(-count // 8), chunk, "reduce", first, wanted=_chunks(b, valid, 1)))
        return
    tail = C % (8 * ctx.lanes)
    P8 = -(-P // 8)
    plain = P8 - 1 if tail else P8  # the last chunk of a row is masked when the row ends inside it
    row_base = b.sreg()

    def f_at(base: Reg, row: int) -> Reg:
        return evaluate(b, body, {s.arg: _load(b, s, p, base, row) for s in streams[:-1]}, value)

    def row(t: Reg) -> None:
        acc: Reg | None = None
        if plain <= UNROLL_CHUNKS:  # a new register a step: the pipeliner can overlap rows (it renames values,
            for j in range(plain):  # not a register written twice)
                acc = r.combined(acc, f_at(row_base, 8 * j))
        else:
            acc = b.vreg()
            b.emit("vbcast", acc, (b.const(identity),))
            chunk_loop(b, plain, lambda off: b.emit(vop, acc, (acc, f_at(off, 0))), "reduce_row", row_base)
        if tail:
            acc = r.combined(acc, r.masked(f_at(row_base, 8 * plain), tail))
        assert acc is not None
        _store(b, r.row_value(acc, streams[-1], p, t), out, t)
        b.emit("addi", row_base, (row_base,), imm=P)

    def part(first: Reg, count: int, valid: Reg | None) -> None:
        _set_times(b, row_base, first, P)
        chunk_loop(b, count, row, "reduce_rows", first, step=1, ivs={row_base: P}, wanted=valid)

    _over_rows(b, n, P, rows, part)


def _split_reduction(body: ScalarProgram, out_arg: str) -> tuple[str, str]:
    """The yielded value must be `combine(value, out)`: returns (combine op, value name)."""
    producer = {res: (name, ops) for res, name, ops in body.ops}
    y = body.yields[0]
    if y not in producer:
        raise LoweringError("reduction body yields no combination")
    name, ops = producer[y]
    if name not in COMBINERS or out_arg not in ops or len(ops) != 2:
        raise LoweringError(f"reduction combiner {name} over {ops} is not supported")
    value = ops[1] if ops[0] == out_arg else ops[0]
    return name, value


# ---- scalar body -> vector ops --------------------------------------------------------------------------
def _binary(op: str) -> Callable[[Builder, list[Reg]], Reg]:
    return lambda b, a: b.vop(op, a[0], a[1])


def _divide(b: Builder, a: list[Reg]) -> Reg:
    return vdivide(b, a[0], a[1])


def _reciprocal_constant(c: object) -> float | None:
    """fp32(1 / c) for a constant divisor c whose reciprocal is a normal fp32 value, else None. x * fp32(1/c)
    is within 1 ulp of x / c (exact for powers of two), closer and much shorter than the divide sequence."""
    if not isinstance(c, (int, float)) or isinstance(c, bool):
        return None
    c32 = np.float32(c)
    if not np.isfinite(c32) or c32 == 0:
        return None
    inv = np.float32(1.0 / np.float64(c32))
    return float(inv) if np.isfinite(inv) and abs(inv) >= 2.0**-126 else None


VECTOR_OPS: dict[str, Callable[[Builder, list[Reg]], Reg]] = {
    "arith.addf": _binary("vadd.f"), "arith.subf": _binary("vsub.f"), "arith.mulf": _binary("vmul.f"),
    "arith.maximumf": _binary("vmax.f"), "arith.maxnumf": _binary("vmax.f"),
    "arith.minimumf": _binary("vmin.f"), "arith.minnumf": _binary("vmin.f"),
    "arith.divf": _divide,
    "arith.negf": lambda b, a: b.vop("vxor", a[0], b.vconst_bits(0x80000000)),
    "math.absf": lambda b, a: b.vop("vand", a[0], b.vconst_bits(0x7FFFFFFF)),
    "math.exp": lambda b, a: vexp(b, a[0]),
    "math.tanh": lambda b, a: vtanh(b, a[0]),
    "math.rsqrt": lambda b, a: vrsqrt(b, a[0]),
    "math.sqrt": lambda b, a: vsqrt(b, a[0]),
    "arith.truncf": lambda b, a: b.vop("vcvt.bf", a[0]),
    "arith.extf": lambda b, a: a[0],
}


def evaluate(b: Builder, body: ScalarProgram, env: dict[str, Reg], result: str) -> Reg:
    """Emit the ops of `body` needed for `result` (constants become broadcast registers)."""
    producer = {res: (name, ops) for res, name, ops in body.ops}
    values = dict(env)

    def get(name: str) -> Reg:
        if name in values:
            return values[name]
        if name in body.constants:
            c = body.constants[name]
            values[name] = b.vconst(c)
            return values[name]
        op, ops = producer[name]
        if op == "arith.divf" and body.constants.get(ops[0]) == 1.0:
            values[name] = vrecip(b, get(ops[1]))
            return values[name]
        if op == "arith.divf" and (inv := _reciprocal_constant(body.constants.get(ops[1]))) is not None:
            values[name] = b.vop("vmul.f", get(ops[0]), b.vconst(inv))
            return values[name]
        fn = VECTOR_OPS.get(op)
        if fn is None:
            raise LoweringError(f"scalar op {op} in a generic body has no vector lowering")
        values[name] = fn(b, [get(o) for o in ops])
        return values[name]

    return get(result)


# ---- chains: consecutive small generics in one kernel -------------------------------------------------
# At one token most kernels are a few KiB: each waits a DMA latency for loads of what the kernel before it
# stored (a decode step's norms, rope and softmax pieces; 500 cycles each on `large`). A chain lowers a run
# of them in one context: every load of the run is issued at its start and waited for once, and a member
# reads what an earlier member wrote from that member's output tile in vmem (the tile holds exactly what
# the store writes, and a load would bring back: bf16 values are bf16-exact, other types are raw words).
# A member stores its output unless nothing outside the chain reads it or a later member rewrites it
# (`KernelChain.private`).
# vmem rows of one operand's single tile (chains are for small kernels): at least 64, a 32nd of vmem on a
# larger configuration (`large`: 1024 rows; a decode step's softmax over a key chunk of 2048 positions, 32
# heads of f32 scores, is 512; a norm of hidden 2048 over a dynamic-shape bucket of 64 tokens is 1024)
CHAIN_MIN_TILE_ROWS, CHAIN_TILE_SHARE = 64, 32
CHAIN_MAX_MEMBERS = 16
# runs of generics too large for one tile, over the same rows, run as one tile loop (`lower_tiled_chain`: a
# prefill softmax's passes over a key tile of scores)
TILED_CHAINS = True
# a tiled chain's members over rows of 8 to 8 * UNROLL_CHUNKS vmem rows run in row passes (`_row_passes`), and
# maps with a column operand row by row; False: a member at a time, each column broadcast to vmem first
ROW_PASSES = True
# a row pass (a tiled chain's, a tile loop's) loads what a row computes from its columns alone (the columns
# spread across lanes, a softmax's finite row max, a norm's factor) from regions its tile filled 8 rows a vector
# op (`_row_values`); False: each row computes them in the pass (two vector ops a row for a column's spread)
ROW_VALUES = True
# a tiled chain's first member takes at least this share of vmem (`large`: 4,096 rows, a 2048-token prefill's
# key tile 8,192 score rows of 1,536 keys): a smaller run's few tiles pay the loop's fill and drain, and a
# dynamic-shape bucket's members, which compute only their valid rows, are not chained
TILED_MIN_SHARE = 8


@dataclass
class ChainMember:
    """A generic that runs as one tile: every outer dim merged into `rows` rows of C elements (P vmem rows
    a row), no operand to copy into row order first."""

    kernel: GenericKernel
    streams: list[Stream]
    rows: int
    C: int
    P: int
    valid: tuple[int, int] | None = None  # a dynamic-shape bucket's valid rows (`_tile_loop`'s valid)
    out_tile: Region | None = None

    def pitch(self, s: Stream) -> tuple[int, int]:
        """(vmem rows, elements) a row of stream s takes in its tile."""
        return (self.P, self.C) if s.kind == "row" else (1, 1)

    def tile_rows(self, s: Stream) -> int:
        """vmem rows stream s's tile takes: its rows, and 8 more, which a row's 8-row loads read past its last
        where a row takes fewer (what a preload for it takes too: `rows_to_preload`)."""
        return self.rows * self.pitch(s)[0] + 8

    def reads(self) -> list[Stream]:
        return self.streams[:-1] + ([self.streams[-1]] if self.kernel.reads_output else [])


@dataclass(eq=False)
class KernelChain:
    """Consecutive generics lowered as one kernel (`lower_chain`); `first` is the first member's index.
    `private`: the members whose output nothing outside the chain reads (compiler.private_chain_outputs):
    it stays in its vmem tile, never stored."""

    first: int
    members: list[ChainMember]
    private: frozenset[int] = frozenset()
    tiled: bool = False  # members too large for one tile run as tiles of rows (`lower_tiled_chain`)


def chain_member(k: object, lanes: int, max_rows: int = CHAIN_MIN_TILE_ROWS) -> ChainMember | None:
    if not isinstance(k, GenericKernel):
        return None
    sizes, strides, dims = _iteration(k)
    if any(st[-1] not in (0, 1) for st in strides[:-1]) or strides[-1][-1] not in (0, 1) \
            or (strides[-1][-1] == 0) != k.reduction:
        return None
    split, rows, row_strides = _merge_rows(sizes[:-1], strides)
    C, P = sizes[-1], -(-sizes[-1] // lanes)
    if split or rows * P > max_rows:
        return None
    operands = [*k.inputs, k.output]
    streams = [Stream(o.view, rs, o.view.offset, "row" if st[-1] == 1 else "col", arg)
               for o, rs, st, arg in zip(operands, row_strides, strides, k.body.args, strict=True)]
    return ChainMember(k, streams, rows, C, P, _valid_rows(k, dims, sizes[:-1], split))


def _forwards(writer: ChainMember, reader: ChainMember, s: Stream) -> bool:
    """Whether `reader`'s stream s can read `writer`'s output tile as its own: the same rows of the buffer
    at the same vmem pitch, s reading a row's first element or all of them."""
    out = writer.streams[-1]
    if out.view.buffer != s.view.buffer or out.base != s.base or writer.rows != reader.rows:
        return False
    if reader.rows > 1 and out.row_stride != s.row_stride:
        return False
    (pw, ew), (pr, er) = writer.pitch(out), reader.pitch(s)
    return (pw, ew) == (pr, er) or (er == 1 and pw == 1)


def _tile_rows_needed(m: ChainMember, forwarded: set[int]) -> int:
    rows = region_rows(m.tile_rows(m.streams[-1]))
    for s in m.reads():
        if id(s) not in forwarded:
            rows += region_rows(m.tile_rows(s))
    return rows + sum(region_rows(m.rows * m.P + 8) for s in m.streams[:-1] if s.kind == "col")


def form_chains(kernels: list[tuple[object, int]], config: HardwareConfig, vmem_rows: int,
                apart: Callable[[str, str], bool] | None = None) -> list[tuple[object, int]]:
    """`kernels` (what each kernel lowers to, its segment: compiler._emitted_kernels) with every run of two or
    more chainable generics of one segment replaced by one KernelChain (at each member's index). A run
    ends where a member would read a buffer an earlier member wrote other than as that member's output
    tile holds it, or where the members' tiles would take more than `vmem_rows`. Runs too large for one tile
    become tiled chains (`_tiled_run`) where `apart(a, b)` says which buffers never share HBM bytes."""
    lanes, tile_rows = config.lanes, max(CHAIN_MIN_TILE_ROWS, config.vmem_rows // CHAIN_TILE_SHARE)
    out = list(kernels)
    i = 0
    while i < len(kernels):
        members: list[ChainMember] = []
        written: dict[str, ChainMember] = {}
        rows = 0
        j = i
        while j < len(kernels) and len(members) < CHAIN_MAX_MEMBERS and kernels[j][1] == kernels[i][1]:
            m = chain_member(kernels[j][0], lanes, tile_rows)
            if m is None:
                break
            forwarded = set()
            for s in m.reads():
                w = written.get(s.view.buffer)
                if w is not None and not _forwards(w, m, s):
                    break
                if w is not None:
                    forwarded.add(id(s))
            else:
                need = _tile_rows_needed(m, forwarded)
                if rows + need <= vmem_rows:
                    rows += need
                    members.append(m)
                    written[m.streams[-1].view.buffer] = m
                    j += 1
                    continue
            break
        tiled = len(members) < 2 and apart is not None and TILED_CHAINS
        if tiled:
            assert apart is not None
            members = _tiled_run(kernels, i, lanes, _tiled_min_rows(config), apart)
            while len(members) >= 2 and _tiles_vmem(members, frozenset(), 8) > vmem_rows:
                members = members[:-1]  # tiles of 8 rows must fit (every output stored: the most they take)
            j = i + len(members)
        if len(members) >= 2:
            chain = KernelChain(i, members, tiled=tiled)
            for n in range(i, j):
                out[n] = (chain, kernels[n][1])
            i = j
        else:
            i += 1
    return out


def tiled_runs(kernels: list[Kernel], config: HardwareConfig) -> list[tuple[int, int]]:
    """The runs of kernels [first, last] that `form_chains` may lower as tiled chains, whatever their buffers'
    placement: the memory plan keeps every buffer of such a run alive across it (`compiler.plan_memory`)."""
    if not TILED_CHAINS:
        return []
    segmented: list[tuple[object, int]] = [(k, 0) for k in kernels]
    out, i = [], 0
    while i < len(kernels):
        n = len(_tiled_run(segmented, i, config.lanes, _tiled_min_rows(config), lambda a, b: True))
        if n >= 2:
            out.append((i, i + n - 1))
        i += max(n, 1)
    return out


def _tiled_min_rows(config: HardwareConfig) -> int:
    """vmem rows a tiled chain's first member must take (more than one chain tile: `TILED_MIN_SHARE`)."""
    return max(CHAIN_MIN_TILE_ROWS, config.vmem_rows // CHAIN_TILE_SHARE, config.vmem_rows // TILED_MIN_SHARE)


def _tiled_run(kernels: list[tuple[object, int]], i: int, lanes: int, min_rows: int,
               apart: Callable[[str, str], bool]) -> list[ChainMember]:
    """The generics from kernels[i] on that run as one tile loop over their rows (`lower_tiled_chain`): each
    too large for one chain tile or reading a member's output, all of the same rows, every row valid. A run
    ends where a member would read a buffer an earlier member wrote other than as its output tile holds it,
    or would write HBM that a member loads or writes other than the rows its own tile loaded: a tile's
    stores precede the next tiles' loads, where the members one by one read everything before any wrote
    (and the memory plan reuses a buffer's bytes once its last reader ran: `apart`)."""
    members: list[ChainMember] = []
    written: dict[str, ChainMember] = {}
    loaded: list[tuple[Stream, ChainMember]] = []
    j = i
    while j < len(kernels) and len(members) < CHAIN_MAX_MEMBERS and kernels[j][1] == kernels[i][1]:
        m = chain_member(kernels[j][0], lanes, 1 << 62)
        if m is None or m.valid is not None or (members and m.rows != members[0].rows):
            break
        reads = m.reads()
        forwarded = [s for s in reads if s.view.buffer in written]
        if any(not _forwards(written[s.view.buffer], m, s) for s in forwarded):
            break
        if not forwarded and m.rows * m.P <= min_rows:
            break  # small and independent of the run: not worth a tile loop of its own
        loads = [(s, m) for s in reads if s.view.buffer not in written]
        out = m.streams[-1]
        # written in place over rows the chain loads: only where each tile writes the rows it loaded
        if any(_tile_key(s, sm) != _tile_key(out, m) if s.view.buffer == out.view.buffer
               else not apart(s.view.buffer, out.view.buffer) for s, sm in loaded + loads) \
                or any(not apart(w, out.view.buffer) for w in written if w != out.view.buffer) \
                or any(not apart(s.view.buffer, w) for s, _ in loads for w in written if w != s.view.buffer):
            break
        loaded += loads
        members.append(m)
        written[out.view.buffer] = m
        j += 1
    return members


def _tile_key(s: Stream, m: ChainMember) -> tuple:
    """What a tiled chain's tile of stream s holds: streams of one key share a tile."""
    return s.view.buffer, s.view.dtype, s.base, s.row_stride, s.kind, m.pitch(s)


COPY_CHUNKS = 8  # chunks of a row `_copy_row` holds in registers at a time
PRELOAD_ROWS = True  # the kernel before a decode chain loads its small operands for it (`rows_to_preload`)
PRELOAD_MAX_ROWS = 64  # vmem rows of an operand it loads so


def _moved_once(s: Stream, m: ChainMember) -> bool:
    """Whether a chain's load of stream s moves one row, copied in vmem to the others (`_copy_row`) while
    the other loads land: s is the same row for every row (a decode softmax's key mask over its heads), which
    a DMA would read from HBM once a row (4096 keys, 32 heads: 512 KiB for 16 KiB, ahead of the scores)."""
    return s.kind == "row" and s.row_stride == 0 and m.rows > 1 and m.P % 8 == 0


def _copy_row(b: Builder, source: Region, tile: Region, rows: int, P: int) -> None:
    """Every row of `tile` (P vmem rows each, P a multiple of 8) = the row `source` holds (the tile's own row 0,
    or a row left in vmem by the kernel before): its chunks held in registers, COPY_CHUNKS at a time, each
    stored to every row (but row 0 when it is the source) by a loop over the rows."""
    first = 1 if source == tile else 0
    for c0 in range(0, P // 8, COPY_CHUNKS):
        chunks = range(c0, min(P // 8, c0 + COPY_CHUNKS))
        held = [b.vld(ZERO, source.row + 8 * c, source.mem(8 * c, 8 * c + 8)) for c in chunks]

        def store(off: Reg, held: list[Reg] = held, chunks: range = chunks) -> None:
            for v, c in zip(held, chunks, strict=True):
                b.vst(v, off, tile.row + 8 * c, tile.mem(first * P, rows * P, write=True))
        chunk_loop(b, rows - first, store, "copy_row", b.const(first * P), step=P)


def lower_chain(ctx: KernelContext, chain: KernelChain) -> None:
    """Every member's loads (but what an earlier member's output tile holds, or the kernel before left in vmem:
    `KernelContext.take_resident`) at once (a row operand the same for every row moved once and copied in
    vmem: `_moved_once`), one wait, then each member computes into its output tile and stores it (but a
    private one). Where every member has the same rows and valid rows
    (a dynamic-shape bucket's norm and its neighbours), the chain moves and computes only those; else the
    members with valid rows compute only theirs (their padding rows, which nothing reads, move as they are:
    rope's cos and sin, whose head dim is the bucket's size, beside a norm)."""
    b = ctx.b
    first = chain.members[0]
    shared = all((m.rows, m.valid) == (first.rows, first.valid) and m.C <= DMA_SHAPE_COLS_MASK
                 for m in chain.members)
    moved = _valid_count(ctx, first.valid, first.rows) if shared and first.valid is not None else None
    counts: dict[tuple[tuple[int, int], int], Reg] = {}

    def computed(m: ChainMember) -> ValidRows:
        if moved is not None:
            return moved, m.rows
        if m.valid is None:
            return None
        key = (m.valid, m.rows)
        if key not in counts:
            counts[key] = _valid_count(ctx, m.valid, m.rows)
        return counts[key], m.rows

    # what the kernel before left in vmem (decode's scores, from q @ K^T; a row moved once, which it loaded
    # for this chain: `preload`): read there, not loaded
    chain_loads = _chain_loads(chain)
    left = {id(s): region for s, m in chain_loads if (region := _resident_tile(ctx, s, m)) is not None}
    left_rows = {id(s): region for s, m in chain_loads if _moved_once(s, m) and (
        region := ctx.take_resident(s.view.buffer, s.view.dtype, s.base, 1, m.C, s.row_stride)) is not None}
    written: dict[str, ChainMember] = {}
    loads: list[tuple[Stream, ChainMember]] = []
    computed_from: list[tuple[Stream, ChainMember]] = []  # the chain's inputs: loaded, or left in vmem
    for m in chain.members:
        for s in m.reads():
            w = written.get(s.view.buffer)
            if w is not None:
                assert w.out_tile is not None and _forwards(w, m, s)
                s.tiles = (w.out_tile, w.out_tile)
            elif id(s) in left:
                s.tiles = (left[id(s)], left[id(s)])
                computed_from.append((s, m))
            else:
                tile = ctx.region(m.tile_rows(s), "in")
                s.tiles = (tile, tile)
                loads.append((s, m))
                computed_from.append((s, m))
        for s in m.streams[:-1]:
            s.expanded = ctx.region(m.rows * m.P + 8, "bcast") if s.kind == "col" else None
        m.out_tile = ctx.region(m.tile_rows(m.streams[-1]), "out")
        written[m.streams[-1].view.buffer] = m
    once = [(s, m) for s, m in loads if _moved_once(s, m)]
    rest = [(s, m) for s, m in loads if not _moved_once(s, m)]
    for s, m in once:  # first: they are copied as the rest land
        assert s.tiles is not None
        if id(s) not in left_rows:
            ctx.dma(True, s.view.dtype, ctx.hbm_addr(s.view, s.base), s.tiles[0], 0, 1, m.pitch(s)[1],
                    s.row_stride, Flag.LOAD, parity=1)
    # the rows of each part: None, every member's own rows (one part)
    halves = _row_halves(ctx, chain, [(s, m) for s, m in computed_from if not _moved_once(s, m)]) \
        if moved is None else None
    parts: list[tuple[int, int] | None] = list(halves) if halves else [None]
    for part, flag in zip(parts, ROW_HALF_FLAGS, strict=False):
        for s, m in rest:
            assert s.tiles is not None
            r0, count = part or (0, m.rows)
            ctx.dma(True, s.view.dtype, ctx.hbm_addr(s.view, s.base + r0 * s.row_stride), s.tiles[0],
                    r0 * m.pitch(s)[0], count, m.pitch(s)[1], s.row_stride, flag, rows_reg=moved)
    if any(id(s) not in left_rows for s, _ in once):
        b.emit("wait", flag=ctx.flag(Flag.LOAD, 1))
    for s, m in once:
        assert s.tiles is not None
        _copy_row(b, left_rows.get(id(s), s.tiles[0]), s.tiles[0], m.rows, m.P)
    for part, flag in zip(parts, ROW_HALF_FLAGS, strict=False):
        if rest:
            b.emit("wait", flag=ctx.flag(flag))
        for j, m in enumerate(chain.members):
            # a block per member: the list scheduler, which works per block, keeps each member's register
            # pressure its own (two sin / cos range reductions interleaved did not fit the registers)
            b.new_block("chain_member")
            k, out = m.kernel, m.streams[-1]
            assert m.out_tile is not None
            rows = computed(m)
            r0, count = part or (0, m.rows)
            streams, out_tile = _rows_of(m, r0, count)
            for s in streams[:-1]:
                if s.expanded is not None:
                    assert s.tiles is not None
                    _broadcast_rows(b, s.tiles[0], s.expanded, count, m.P, s.view.dtype in ("i32", "i1"), rows)
            if k.reduction:
                _reduce_tile(ctx, k.body, streams, 0, out_tile, count, m.C, m.P, k.init, rows)
            else:
                _map_tile(ctx, k.body, streams, 0, out_tile, count, m.P, rows)
            if j not in chain.private:
                ctx.dma(False, out.view.dtype, ctx.hbm_addr(out.view, out.base + r0 * out.row_stride), out_tile, 0,
                        count, m.pitch(out)[1], out.row_stride, Flag.STORE, rows_reg=moved)


def lower_tiled_chain(ctx: KernelContext, chain: KernelChain) -> None:
    """A chain whose members are too large for one tile (a prefill's softmax over a key tile of every query
    row: the row max, the exponentials, their sum, their bf16 copy for P @ V) as a loop of double-buffered
    tiles of T rows (`_double_buffered`, as `_tile_loop`), every member computing the tile in turn: a member
    reads an earlier member's output where its tile holds it, so the chain moves each value through HBM at
    most once (the exponentials' f32, which only the chain reads, never), where the members one by one
    loaded and stored every intermediate."""
    b = ctx.b
    members, rows = chain.members, chain.members[0].rows
    T = _chain_tile_rows(ctx, chain)
    written: dict[str, ChainMember] = {}
    loads: list[tuple[Stream, ChainMember]] = []
    loads_once: list[tuple[Stream, ChainMember]] = []  # rows the same in every tile (a causal mask's key iota)
    loaded: dict[tuple, tuple[Region, Region]] = {}  # a tile's key (`_tile_key`): its two regions
    outs: dict[int, tuple[Region, Region]] = {}
    source = _chain_sources(members)
    passes = _row_passes(members, source)
    by_rows = _by_rows(members, passes)
    for j, m in enumerate(members):
        for s in m.reads():
            w = written.get(s.view.buffer)
            if w is not None:
                s.tiles = outs[id(w)]
            elif _tile_key(s, m) in loaded:  # the rows an earlier member loaded
                s.tiles = loaded[_tile_key(s, m)]
            elif _same_every_row(s):  # loaded once, into one region both tiles read
                region = ctx.region(T * m.pitch(s)[0] + 8, "in")
                s.tiles = loaded[_tile_key(s, m)] = (region, region)
                loads_once.append((s, m))
            else:
                n = T * m.pitch(s)[0] + 8
                s.tiles = loaded[_tile_key(s, m)] = (ctx.region(n, "in"), ctx.region(n, "in"))
                loads.append((s, m))
        for s in m.streams[:-1]:
            s.expanded = ctx.region(T * m.P + 8, "bcast") if s.kind == "col" and j not in by_rows else None
        n = T * m.pitch(m.streams[-1])[0] + 8
        out = ctx.region(n, "out")
        outs[id(m)] = (out, out) if j in chain.private else (out, ctx.region(n, "out"))
        written[m.streams[-1].view.buffer] = m
    stores = [(m, outs[id(m)]) for j, m in enumerate(members) if j not in chain.private]
    # in a row pass: the columns an earlier reduction of a constant initial value wrote (every lane of a row
    # holds its value), the row operands an earlier member of the pass computes (by its place in the pass),
    # and the maps whose value no store and no member past the pass reads
    full_lanes: dict[int, set[str]] = {}
    fed: dict[int, dict[str, int]] = {}
    unstored: set[int] = set()
    for ps in passes:
        for j in ps:
            full_lanes[j] = {s.arg for s in members[j].streams[:-1] if s.kind == "col" and id(s) in source
                             and members[source[id(s)]].kernel.reduction and members[source[id(s)]].kernel.init
                             is not None}
            fed[j] = {s.arg: ps.index(source[id(s)]) for s in members[j].streams[:-1]
                      if s.kind == "row" and source.get(id(s)) in ps}
            readers = {k for k, m in enumerate(members) for s in m.reads() if source.get(id(s)) == j}
            if j in chain.private and readers <= set(ps):
                unstored.add(j)
    row_values = {j: rv for j in by_rows
                  if (rv := _row_values(ctx, members[j].kernel.body, members[j].streams, full_lanes[j], T)) is not None}
    for s, _ in loads + loads_once:
        s.ptr = b.sreg()
        b.emit("addi", s.ptr, (ctx.hbm_addr(s.view, s.base),), imm=0)
    store_ptrs = []
    for m, _ in stores:
        out_s = m.streams[-1]
        store_ptrs.append(b.emit("addi", b.sreg(), (ctx.hbm_addr(out_s.view, out_s.base),), imm=0))

    def move(load: bool, s: Stream, m: ChainMember, ptr: Reg, region: Region, p: int, n: int) -> None:
        cols = m.pitch(s)[1] if s.kind == "row" else 1
        ctx.dma(load, s.view.dtype, ptr, region, 0, n, cols, s.row_stride, Flag.LOAD if load else Flag.STORE, p)
        b.addi(ptr, n * s.row_stride * ESIZE[s.view.dtype], ptr)

    def issue_loads(p: int, n: int) -> None:
        for s, m in loads:
            assert s.tiles is not None and s.ptr is not None
            move(True, s, m, s.ptr, s.tiles[p], p, n)

    def first_loads(n: int) -> None:  # the first tile has the most rows
        for s, m in loads_once:
            assert s.tiles is not None and s.ptr is not None
            move(True, s, m, s.ptr, s.tiles[0], 0, n)
        issue_loads(0, n)

    def tile(p: int, n: int, next_n: int | None) -> None:
        b.emit("wait", flag=ctx.flag(Flag.LOAD, p))
        if next_n:
            issue_loads(1 - p, next_n)
        b.emit("wait", flag=ctx.flag(Flag.STORE, p))
        for ps in passes:
            b.new_block("tiled_member")  # each pass's register pressure its own, as in `lower_chain`
            if ps[0] in by_rows:
                works = []
                for j in ps:
                    m = members[j]
                    values = row_values.get(j)
                    if values is not None:
                        _fill_row_values(b, m.kernel.body, m.streams, full_lanes[j], values, p, n)
                    works.append(RowWork(m.kernel, m.streams, outs[id(m)][p], m.C, full_lanes[j], fed[j],
                                         j not in unstored, values.loaded(m.streams, p) if values else {}))
                _row_pass(ctx, works, p, n, members[ps[0]].P)
                continue
            m = members[ps[0]]
            streams = m.streams
            for s in streams[:-1]:
                if s.expanded is not None:
                    assert s.tiles is not None
                    _broadcast_rows(b, s.tiles[p], s.expanded, n, m.P, s.view.dtype in ("i32", "i1"))
            if m.kernel.reduction:
                _reduce_tile(ctx, m.kernel.body, streams, p, outs[id(m)][p], n, m.C, m.P, m.kernel.init)
            else:
                _map_tile(ctx, m.kernel.body, streams, p, outs[id(m)][p], n, m.P)
        for (m, tiles), ptr in zip(stores, store_ptrs, strict=True):
            move(False, m.streams[-1], m, ptr, tiles[p], p, n)
        b.new_block("tile_next")  # a tile's code ends a block: its DMA issues before the next tile's waits

    _double_buffered(b, [min(T, rows - t0) for t0 in range(0, rows, T)], first_loads, tile, "chain_tiles")


@dataclass(frozen=True)
class RowValues:
    """A row pass's `_row_values`: the values to compute for a tile, the region (T + 8 rows) of each the pass
    reads, and the columns it reads as they are (spread across lanes by an earlier reduction)."""

    derived: list[str]
    regions: dict[str, Region]
    as_they_are: set[str]

    def loaded(self, streams: list[Stream], p: int) -> dict[str, Region]:
        """What the pass loads each row value from, with tile parity p."""
        return self.regions | {s.arg: s.tiles[p] for s in streams[:-1] if s.arg in self.as_they_are and s.tiles}


def _row_values(ctx: KernelContext, body: ScalarProgram, streams: list[Stream], full_lanes: set[str],
                tile_rows: int) -> RowValues | None:
    """What a row-pass member computes from its columns alone, to be computed for a tile 8 rows a vector op
    (`_fill_row_values`) rather than a row at a time in the pass, with regions for its tiles of `tile_rows`. A column
    holding its row's value in lane 0 is spread across lanes there too (two vector ops a row in the pass: a
    causal softmax's last key), and a softmax's finite row max takes two (a compare and a select). None where
    nothing is won or the pass would load more per row."""
    cols = [s for s in streams[:-1] if s.kind == "col"]
    if not ROW_VALUES or not cols:
        return None
    derived = _derived(body, {s.arg for s in cols})
    inner = {s.arg for s in cols} | set(derived)
    read = {o for res, _, ops in body.ops if res not in inner for o in ops} | set(body.yields)
    as_they_are = {s.arg for s in cols if s.arg in full_lanes and s.arg in read}
    stored = [name for name in [*(s.arg for s in cols), *derived] if name in read and name not in as_they_are]
    if len(stored) + len(as_they_are) > len(cols) or not (derived or any(s.arg not in full_lanes for s in cols)):
        return None
    return RowValues(derived, {name: ctx.region(tile_rows + 8, "row_value") for name in stored}, as_they_are)


def _fill_row_values(b: Builder, body: ScalarProgram, streams: list[Stream], full_lanes: set[str],
                     values: RowValues, p: int, n: int, rows: ValidRows = None) -> None:
    """The `_row_values` of a tile's n rows, 8 rows a chunk: each column's rows (lane 0 spread across lanes), the
    values computed from them, those the pass reads stored to their regions. `rows`: see `_over_rows`."""
    def chunk(off: Reg) -> None:
        env = {}
        for s in streams[:-1]:
            if s.kind == "col":
                v = _load(b, s, p, off)
                env[s.arg] = v if s.arg in full_lanes else _lane0_everywhere(b, v, s.view.dtype in ("i32", "i1"))
        computed = _evaluated(b, body, env, values.derived)
        for name, region in values.regions.items():
            _store(b, computed[name], region, off)

    _over_rows(b, n, 1, rows, lambda first, count, valid: chunk_loop(
        b, -(-count // 8), chunk, "row_values", first, wanted=_chunks(b, valid, 1)))


def _chain_sources(members: list[ChainMember]) -> dict[int, int]:
    """For each stream a member reads (by id) that an earlier member wrote: that member's index (the last
    writer of its buffer)."""
    written: dict[str, int] = {}
    source = {}
    for j, m in enumerate(members):
        for s in m.reads():
            if s.view.buffer in written:
                source[id(s)] = written[s.view.buffer]
        written[m.streams[-1].view.buffer] = j
    return source


def _row_passes(members: list[ChainMember], source: dict[int, int]) -> list[list[int]]:
    """A tiled chain's members in passes over a tile, in order: runs of members of the same P >= 8 vmem rows
    a row (at most UNROLL_CHUNKS chunks of 8) that `_row_pass` computes together, a member breaking a run
    where it reads a column the run computes (a row's reduction is complete only at the row's end); every
    other member a pass of its own. `source`: `_chain_sources`."""
    passes: list[list[int]] = []

    def row_wise(m: ChainMember) -> bool:
        return ROW_PASSES and 8 <= m.P <= 8 * UNROLL_CHUNKS

    for j, m in enumerate(members):
        run = passes[-1] if passes else []
        if run and row_wise(m) and row_wise(members[run[0]]) and m.P == members[run[0]].P and not any(
                s.kind == "col" and source.get(id(s)) in run for s in m.reads()):
            run.append(j)
        else:
            passes.append([j])
    return passes


def _by_rows(members: list[ChainMember], passes: list[list[int]]) -> set[int]:
    """The members whose pass (`_row_passes`) runs as a row pass: several members, or a map with a column
    operand."""
    return {j for ps in passes if len(ps) > 1 or _maps_by_rows(members[ps[0]].kernel, members[ps[0]].P,
                                                               members[ps[0]].streams) for j in ps}


def _chain_tile_rows(ctx: KernelContext, chain: KernelChain) -> int:
    """The most rows per tile of a tiled chain (a multiple of 8, at most `max_tile_vmem_rows` vmem rows of
    its widest row) whose tiles fit the free vmem: two of each load and stored output, one of each private
    output and broadcast column."""
    widest = max(m.P for m in chain.members)
    t = min(chain.members[0].rows, max(8, max_tile_vmem_rows(ctx.config) // widest // 8 * 8))
    while t > 1 and _tiles_vmem(chain.members, chain.private, t) > ctx.vmem_free():
        t = max(1, t // 2)
    if _tiles_vmem(chain.members, chain.private, t) > ctx.vmem_free():
        raise LoweringError(f"{ctx.kernel}: one row of a tiled chain does not fit vmem")
    return t


def _tiles_vmem(members: list[ChainMember], private: frozenset[int], t: int) -> int:
    """vmem rows a tiled chain's tiles of t rows take (`lower_tiled_chain`): two of each load and stored
    output, one of each private output and broadcast column, each region rounded up to whole chunks."""
    written: set[str] = set()
    loaded: set[tuple] = set()
    sizes = []
    by_rows = _by_rows(members, _row_passes(members, _chain_sources(members)))
    for j, m in enumerate(members):
        for s in m.reads():
            if s.view.buffer not in written and _tile_key(s, m) not in loaded:
                loaded.add(_tile_key(s, m))
                sizes += (1 if _same_every_row(s) else 2) * [t * m.pitch(s)[0] + 8]
        if j not in by_rows:
            sizes += [t * m.P + 8 for s in m.streams[:-1] if s.kind == "col"]
        else:  # an upper bound of its `_row_values` regions
            sizes += [t + 8 for s in m.streams[:-1] if s.kind == "col"]
        sizes += (1 if j in private else 2) * [t * m.pitch(m.streams[-1])[0] + 8]
        written.add(m.streams[-1].view.buffer)
    return sum(region_rows(n) for n in sizes)


def _same_every_row(s: Stream) -> bool:
    """A row operand whose rows are all one row (row stride 0: a causal mask's key iota beside each score
    row): a tiled chain loads its tile once, not each tile again (4 bytes a score through HBM)."""
    return s.kind == "row" and s.row_stride == 0


def _chain_loads(chain: KernelChain) -> list[tuple[Stream, ChainMember]]:
    """The streams a chain reads from HBM: those no earlier member's output tile holds."""
    written: set[str] = set()
    out = []
    for m in chain.members:
        out += [(s, m) for s in m.reads() if s.view.buffer not in written]
        written.add(m.streams[-1].view.buffer)
    return out


def rows_to_preload(chain: KernelChain) -> list[Preload]:
    """What the kernel before may load for the chain (`KernelContext.preload`), so that it does not wait a DMA
    latency for it: the rows the chain moves once (`_moved_once`: decode's key mask, one row ahead of its
    first member), and with `PRELOAD_ROWS` a decode chain's small operands, in the rows its tiles would take
    (`_tile_held`: the residual row and the norm's weight after o_proj and down_proj, whose output row the
    stream leaves in vmem: 86,643 -> 85,882 cycles of qwen3-0.6b-2l decode at 1024 positions, with
    `KernelContext.take_resident`'s rows above a ceiling; QK-norm's heads of q and k and its weights after
    v_proj: 85,882 -> 85,144)."""
    out: dict[tuple, Preload] = {}
    if chain.tiled:
        return []
    for s, m in _chain_loads(chain):
        if _moved_once(s, m):
            out[(s.view.buffer, s.base, 1)] = Preload(s.view, s.base, 1, m.C, s.row_stride, m.P)
        elif PRELOAD_ROWS and _tile_held(s, m) and m.rows * m.P <= PRELOAD_MAX_ROWS:
            out[(s.view.buffer, s.base, m.rows)] = Preload(s.view, s.base, m.rows, m.C, s.row_stride,
                                                           m.tile_rows(s))
    return list(out.values())


def _tile_held(s: Stream, m: ChainMember) -> bool:
    """Whether stream s's rows, left in vmem, can be read as s's tile would hold them: whole vmem rows a row,
    whole chunks of 8 rows, no runtime row count."""
    return s.kind == "row" and m.rows * m.P % 8 == 0 and m.valid is None


def _resident_tile(ctx: KernelContext, s: Stream, m: ChainMember) -> Region | None:
    """Where the kernel before left stream s's rows in vmem as s's tile would hold them (`_tile_held`), else
    None."""
    if not _tile_held(s, m):
        return None
    return ctx.take_resident(s.view.buffer, s.view.dtype, s.base, m.rows, m.C, s.row_stride)


# a chain's loads in two halves of its rows: the first on LOAD, the second on a flag of its own
ROW_HALF_FLAGS = (Flag.LOAD, Flag.HALF)


def _row_halves(ctx: KernelContext, chain: KernelChain, loads: list[tuple[Stream, ChainMember]]
                ) -> list[tuple[int, int]] | None:
    """The chain's rows as (first row, count) parts: two halves where its loads take a DMA latency or more of
    transfer (a decode softmax's 512 KiB of scores at 4096 keys: the members compute the first half while the
    second lands, and store the first half's outputs while they compute the second), else None (one part).
    Every member runs row by row (a reduction along a row), so each element's arithmetic is the same either
    way."""
    n, cfg = chain.members[0].rows, ctx.config
    moved = sum(m.rows * m.C * ESIZE[s.view.dtype] for s, m in loads)
    if n % 2 or moved < cfg.hbm_bytes_per_cycle * cfg.dma_latency \
            or any(m.rows != n or m.valid is not None for m in chain.members):
        return None
    half = n // 2
    if any(half * m.pitch(s)[0] % 8 or half * m.P % 8 for m in chain.members for s in m.streams):
        return None  # a half would share a chunk of 8 vmem rows with the other
    return [(0, half), (half, half)]


def _rows_of(m: ChainMember, r0: int, count: int) -> tuple[list[Stream], Region]:
    """m's streams and output tile restricted to rows [r0, r0 + count) (views of their tiles)."""
    assert m.out_tile is not None
    if (r0, count) == (0, m.rows):
        return m.streams, m.out_tile

    def rows(region: Region | None, pitch: int) -> Region | None:
        return None if region is None else region.view(r0 * pitch, count * pitch)

    streams = []
    for s in m.streams:
        tiles = s.tiles and (rows(s.tiles[0], m.pitch(s)[0]), rows(s.tiles[1], m.pitch(s)[0]))
        streams.append(dataclasses.replace(s, tiles=tiles, expanded=rows(s.expanded, m.P)))
    out = rows(m.out_tile, m.pitch(m.streams[-1])[0])
    assert out is not None
    return streams, out
