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

Reductions (last iterator) combine `f(inputs)` across lanes, masking padding lanes with the identity
(`viota` + `vsel`), then across vmem rows of one row, and finally with the output's initial value.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from codegen.builder import Builder
from codegen.isel_common import KernelContext, Region
from codegen.kernels import ESIZE, FillKernel, GenericKernel, LoweringError, Operand, ScalarProgram, View
from codegen.math_seqs import vexp, vrecip, vrsqrt, vsqrt, vtanh
from codegen.mir import Reg

MAX_TILE_VMEM_ROWS = 256  # vmem rows of one operand's tile: bounds the unrolled code
NEG_INF = 0xFF800000
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


def lower_fill(ctx: KernelContext, k: FillKernel) -> None:
    body = ScalarProgram(["%out"], [], ["%c"], {"%c": k.value})
    gk = GenericKernel(k.output.shape or (1,), False, [], Operand(k.output, k.output.strides or (0,)), body)
    lower_generic(ctx, gk)


def lower_generic(ctx: KernelContext, k: GenericKernel) -> None:
    sizes = list(k.sizes) or [1]
    operands = [*k.inputs, k.output]
    strides = [list(o.iter_strides) or [0] for o in operands]
    views = [o.view for o in operands]
    # transposed operands (stride along the row neither 0 nor 1) are copied into row order first
    for i, st in enumerate(strides[:-1]):
        if st[-1] not in (0, 1):
            views[i], strides[i] = _materialize(ctx, views[i], st, sizes)
    if strides[-1][-1] not in (0, 1) or (strides[-1][-1] == 0) != k.reduction:
        raise LoweringError("generic whose output is not laid out along the innermost iteration dim")
    C = sizes[-1]
    outer = sizes[:-1]
    # merge the longest uniformly strided suffix of the outer dims into one row dim
    split = len(outer)
    while split > 0 and (split == len(outer) or all(st[split - 1] == st[split] * outer[split] for st in strides)):
        split -= 1
    rows = math.prod(outer[split:]) if outer else 1
    row_strides = [st[len(outer) - 1] if len(outer) > split else 0 for st in strides]
    groups = outer[:split]
    N = ctx.lanes
    P = -(-C // N)
    if P > MAX_TILE_VMEM_ROWS:
        raise LoweringError(f"innermost dim {C} needs {P} vmem rows per row (limit {MAX_TILE_VMEM_ROWS})")
    n_streams = len(operands) + sum(1 for st in strides[:-1] if st[-1] == 0)
    budget = min(ctx.vmem_free() // (2 * n_streams + 2), MAX_TILE_VMEM_ROWS)
    tile_rows = max(1, min(rows, budget // max(P, 1) - 1))
    body_args = k.body.args
    for g_index in _multi_index(groups):
        base = [sum(i * s for i, s in zip(g_index, st, strict=False)) for st in strides]
        streams = [Stream(v, rs, v.offset + bo, "row" if st[-1] == 1 else "col", arg)
                   for v, rs, bo, st, arg in zip(views, row_strides, base, strides, body_args, strict=True)]
        _tile_loop(ctx, k, streams, rows, tile_rows, C, P)


def _multi_index(dims: list[int]) -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = [()]
    for d in dims:
        out = [(*o, i) for o in out for i in range(d)]
    return out


def _materialize(ctx: KernelContext, view: View, st: list[int], sizes: list[int]) -> tuple[View, list[int]]:
    """Copy a transposed operand into HBM scratch in iteration order: one DMA pair per row (column in,
    column out through lane 0 of C vmem rows)."""
    C = sizes[-1]
    esize = ESIZE[view.dtype]
    n_rows = math.prod(sizes[:-1]) if len(sizes) > 1 else 1
    reg, off = ctx.scratch_bytes(n_rows * C * esize)
    region = ctx.region(C, "gather")
    for r, idx in enumerate(_multi_index(sizes[:-1])):
        src = view.offset + sum(i * s for i, s in zip(idx, st, strict=False))
        ctx.dma(True, view.dtype, ctx.hbm_addr(view, src), region, 0, C, 1, st[-1], 6)
        ctx.dma(False, view.dtype, ctx.b.offset_reg(reg, off + r * C * esize), region, 0, C, 1, 1, 6)
    ctx.b.emit("wait", flag=6)
    name = f"scratch@{off}"
    ctx.hbm_base[name] = (reg, off)
    dense = [0] * len(sizes)
    acc = 1
    for d in reversed(range(len(sizes))):
        dense[d] = acc if sizes[d] != 1 else 0
        acc *= sizes[d]
    return View(name, 0, tuple(sizes), tuple(dense), view.dtype), dense


def _tile_loop(ctx: KernelContext, k: GenericKernel, streams: list[Stream], rows: int, tile_rows: int, C: int,
               P: int) -> None:
    b = ctx.b
    out = streams[-1]
    loads = streams[:-1] + ([out] if k.reduction else [])  # a reduction reads its output's initial value
    for s in loads:
        per_row = P if s.kind == "row" else 1
        s.tiles = (ctx.region(tile_rows * per_row + 8, "in"), ctx.region(tile_rows * per_row + 8, "in"))
        if s.kind == "col" and s is not out:
            s.expanded = ctx.region(tile_rows * P + 8, "bcast")
    out_rows = tile_rows * (1 if k.reduction else P) + 8
    out_tiles = (ctx.region(out_rows, "out"), ctx.region(out_rows, "out"))
    tiles = [(t0, min(tile_rows, rows - t0)) for t0 in range(0, rows, tile_rows)]

    def issue_loads(i: int) -> None:
        t0, n = tiles[i]
        for s in loads:
            cols = C if s.kind == "row" else 1
            ctx.dma(True, s.view.dtype, ctx.hbm_addr(s.view, s.base + t0 * s.row_stride), s.tiles[i % 2], 0, n,
                    cols, s.row_stride, i % 2)

    issue_loads(0)
    for i, (t0, n) in enumerate(tiles):
        p = i % 2
        if i + 1 < len(tiles):
            issue_loads(i + 1)
        b.emit("wait", flag=ctx.flag(p))
        if i >= 2:
            b.emit("wait", flag=ctx.flag(2 + p))
        for s in streams[:-1]:
            if s.expanded is not None:
                _broadcast_rows(b, s.tiles[p], s.expanded, n, P)
        if k.reduction:
            _reduce_tile(ctx, k.body, streams, p, out_tiles[p], n, C, P)
            cols = 1
        else:
            _map_tile(ctx, k.body, streams, p, out_tiles[p], n, P)
            cols = C
        ctx.dma(False, out.view.dtype, ctx.hbm_addr(out.view, out.base + t0 * out.row_stride), out_tiles[p], 0, n,
                cols, out.row_stride, 2 + p)


def _lane0_mask(b: Builder) -> Reg:
    return b.vop("vcmp.eq.i", b.vop_imm("viota", 0), b.vconst_bits(0))


def _broadcast_rows(b: Builder, col: Region, dst: Region, n: int, P: int) -> None:
    """dst (row layout, P vmem rows per row) = the lane-0 value of each of the n rows of `col`."""
    mask, ninf = _lane0_mask(b), b.vconst_bits(NEG_INF)
    base = b.const(0)
    if P == 1:
        for c in range(0, n, 8):
            v = b.vreg()
            b.emit("vld", v, (base,), imm=col.row + c, mem=(col.mem(c, c + 8),))
            r = b.vop("vred.max.l", b.vop("vsel", mask, v, ninf))
            b.emit("vst", None, (r, base), imm=dst.row + c, mem=(dst.mem(c, c + 8, write=True),))
        return
    for t in range(n):
        v = b.vreg()
        b.emit("vld.row", v, (base,), imm=col.row + t, mem=(col.mem(t, t + 1),))
        r = b.vop("vred.max.l", b.vop("vsel", mask, v, ninf))
        for j in range(0, P, 8):
            row = t * P + j
            b.emit("vst", None, (r, base), imm=dst.row + row, mem=(dst.mem(row, row + 8, write=True),))


def _load(b: Builder, s: Stream, p: int, row: int) -> Reg:
    region = s.expanded if s.expanded is not None else s.tiles[p]
    v = b.vreg()
    b.emit("vld", v, (b.const(0),), imm=region.row + row, mem=(region.mem(row, row + 8),))
    return v


def _map_tile(ctx: KernelContext, body: ScalarProgram, streams: list[Stream], p: int, out: Region, n: int,
              P: int) -> None:
    b = ctx.b
    for c in range(0, n * P, 8):
        b.new_scope()
        env = {s.arg: _load(b, s, p, c) for s in streams[:-1]}
        r = evaluate(b, body, env, body.yields[0])
        b.emit("vst", None, (r, b.const(0)), imm=out.row + c, mem=(out.mem(c, c + 8, write=True),))


def _reduce_tile(ctx: KernelContext, body: ScalarProgram, streams: list[Stream], p: int, out: Region, n: int,
                 C: int, P: int) -> None:
    b = ctx.b
    out_arg = body.args[-1]
    combine_name, value = _split_reduction(body, out_arg)
    vop, red_l, red_s, identity = COMBINERS[combine_name]
    ident = b.vconst_bits(identity)
    init = streams[-1]
    zero = b.const(0)
    if P == 1:
        mask = b.vop("vcmp.lt.i", b.vop_imm("viota", 0), b.vconst_bits(C)) if C < ctx.lanes else None
        for c in range(0, n, 8):
            b.new_scope()
            env = {s.arg: _load(b, s, p, c) for s in streams[:-1]}
            f = evaluate(b, body, env, value)
            if mask is not None:
                f = b.vop("vsel", mask, f, ident)
            r = b.vop(vop, b.vop(red_l, f), _load(b, init, p, c))
            b.emit("vst", None, (r, zero), imm=out.row + c, mem=(out.mem(c, c + 8, write=True),))
        return
    chunk = 8 * ctx.lanes
    tail = C % chunk
    mask = None
    if tail:
        mask = b.vop("vcmp.lt.i", b.vop_imm("viota", 2), b.vconst_bits(tail))
    for t in range(n):
        b.new_scope()
        acc = None
        for j in range(0, P, 8):
            env = {s.arg: _load(b, s, p, t * P + j) for s in streams[:-1]}
            f = evaluate(b, body, env, value)
            if mask is not None and j + 8 >= P:
                f = b.vop("vsel", mask, f, ident)
            acc = f if acc is None else b.vop(vop, acc, f)
        total = b.vop(red_s, b.vop(red_l, acc))
        iv = b.vreg()
        region = init.tiles[p]
        b.emit("vld.row", iv, (zero,), imm=region.row + t, mem=(region.mem(t, t + 1),))
        r = b.vop(vop, total, iv)
        b.emit("vst", None, (r, zero), imm=out.row + t, mem=(out.mem(t, t + 8, write=True),))


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
    return b.vop("vmul.f", a[0], vrecip(b, a[1]))


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
        if op == "arith.divf" and ops[0] in body.constants and body.constants[ops[0]] == 1.0:
            values[name] = vrecip(b, get(ops[1]))
            return values[name]
        fn = VECTOR_OPS.get(op)
        if fn is None:
            raise LoweringError(f"scalar op {op} in a generic body has no vector lowering")
        values[name] = fn(b, [get(o) for o in ops])
        return values[name]

    return get(result)
