"""Instruction selection for linalg.matmul / batch_matmul on the MXU.

Layout (N = lanes = MXU size). For one batch and one m-tile of Mt rows:
- A is held as KT = ceil(K / N) column blocks of Mt vmem rows (block kt, row m = A[m, kt*N : kt*N + N]),
  one strided DMA per block; lanes past K are zero-filled by the DMA;
- for each n-tile, B[:, n0 : n0 + N] is one DMA of K vmem rows (rows K .. KT*N are zeroed once), so the
  weight tile (kt) is the N consecutive rows kt*N .. kt*N + N: `mxu.lw` loads it into the shadow buffer while
  the previous `mxu.mm(a)s` streams, which swaps it in and streams the Mt rows of A's block kt;
- C[m-tile, n-tile] accumulates in Mt vmem rows (`mxu.mms` first, `mxu.mmas` after) and is stored with one DMA.
B tiles, C tiles and their flags are double-buffered across n-tiles, so the MXU streams back to back.

fp32 operands follow `torch.get_float32_matmul_precision()`: each is split in vmem into bf16 parts
(hi = bf(x), mid = bf(x - hi), lo = bf(x - hi - mid), with `vcvt.bf` and `vsub.f`; `_split` says how hi
avoids rounding a finite x near the fp32 maximum to inf) and the cross products are accumulated, smallest
first: "highest" 6 passes, "high" 3, "medium" 1. bf16 operands run 1 pass.

IEEE specials survive the split. The residuals are finite-only (inf - inf never happens), and inf or NaN
must never meet a zero part of the other operand (inf * 0 = NaN) where fp32 would multiply it by a
nonzero value: so the parts that hold a non-finite x are chosen by the passes they take part in.
- With room in vmem for one more region per operand (`_layout`), hi is finite-only too and the hi x hi
  pass reads `hi_full` instead, which holds x itself where x is not finite: every product is then the
  IEEE one (up to bf16's range: a partner below 2^-133 is 0 in bf16, so inf times it is NaN).
- Otherwise the last residual part (lo, or mid for "high") carries x, the only part that meets nothing
  but the other operand's hi: inf times a finite value is right, but inf x inf at the same k is NaN.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from codegen.isel_common import Flag, KernelContext, Region, chunk_loop, row_mem
from codegen.kernel_graph import LoweringError, MatmulKernel, View
from codegen.mir import ZERO, Reg

PASSES = {  # (part of A, part of B), accumulated in this order (small terms first)
    "highest": [("lo", "hi"), ("mid", "mid"), ("hi", "lo"), ("mid", "hi"), ("hi", "mid"), ("hi_full", "hi_full")],
    "high": [("mid", "hi"), ("hi", "mid"), ("hi_full", "hi_full")],
    "medium": [("hi_full", "hi_full")],
}
RESIDUALS = {"highest": ("mid", "lo"), "high": ("mid",), "medium": ()}
HI16 = 0xFFFF0000  # the bits of a bf16 value in an fp32 word
BF16_FINITE_MAX = 0x7F7F7FFF  # the largest fp32 that rounds to a finite bf16 (0x7f7f, 3.39e38)
SIGN = 0x80000000
UNROLL_SPLIT_CHUNKS = 4  # splits of up to this many chunks of 8 vmem rows are unrolled, longer ones loop
UNROLL_BATCHES = 2  # batched matmuls of more batches run a batch loop
MIN_N_TILE_PAIRS = 2  # n loops of fewer pairs of n-tiles are unrolled
UNROLL_K_TILES = 4  # k loops up to this many tiles are unrolled, longer ones run as loops (more unrolled
# tiles x up to 6 bf16 passes keep too many row constants live: allocation did not converge)


def lower_matmul(ctx: KernelContext, k: MatmulKernel) -> None:
    a, bm, c = k.a, k.b, k.c
    batched = len(c.shape) == 3
    B = c.shape[0] if batched else 1
    M, K = a.shape[-2:]
    Nn = bm.shape[-1]
    for v, what in ((a, "A"), (bm, "B"), (c, "C")):
        if v.strides[-1] != 1:
            raise LoweringError(f"matmul operand {what} is not contiguous along its last dim: {v.strides}")
    precision = "medium" if a.dtype == "bf16" and bm.dtype == "bf16" else ctx.matmul_precision
    L = ctx.lanes
    KT, NT = -(-K // L), -(-Nn // L)
    names, mt = _layout(precision, M, KT, L, ctx.vmem_free())
    if mt is None:
        raise LoweringError(f"matmul {M}x{K}x{Nn} does not fit vmem (K too large for one tile)")
    parts = len(names)
    index = {name: i for i, name in enumerate(names)}
    index.setdefault("hi", 0)  # no separate hi: the in-place region is hi (and hi_full is hi)
    passes = [(index[pa], index[pb]) for pa, pb in PASSES[precision]]
    a_parts = [ctx.region(KT * mt, f"a{q}_") for q in range(parts)]
    b_raw = [ctx.region(KT * L, "braw") for _ in range(2)]
    b_parts = [b_raw] + [[ctx.region(KT * L, f"b{q}_") for _ in range(2)] for q in range(1, parts)]
    c_tiles = [ctx.region(mt, "c") for _ in range(2)]
    if K % L:  # weight rows K .. KT * L must be zero: the DMA never writes them, and 0 x stale NaN / inf is NaN
        _zero_rows(ctx, b_raw, K // 8 * 8, KT * L)
    m_tiles = [(m0, min(mt, M - m0)) for m0 in range(0, M, mt)]
    tiles = (a_parts, b_raw, b_parts, c_tiles, passes, KT, NT, "hi" in names[1:])
    b = ctx.b
    if B > UNROLL_BATCHES:  # batches as a runtime loop: pointer registers at each batch's A, B and C
        pa, pb, pc = b.sreg(), b.sreg(), b.sreg()
        for ptr, v in ((pa, a), (pb, bm), (pc, c)):
            b.emit("addi", ptr, (ctx.hbm_addr(v, v.offset),), imm=0)

        def batch_body() -> None:
            for m0, rows in m_tiles:
                _m_tile(ctx, k, rows, _At(pa, m0 * a.strides[-2]), _At(pb, 0), _At(pc, m0 * c.strides[-2]), *tiles)
            for ptr, v in ((pa, a), (pb, bm), (pc, c)):
                if v.strides[0]:
                    b.addi(ptr, v.strides[0] * _esize(v), ptr)

        b.counted_loop(B, batch_body, "batch")
        return
    for batch in range(B):
        a0, b0, c0 = ((v.offset + (v.strides[0] * batch if batched else 0)) for v in (a, bm, c))
        rest = m_tiles
        full = [t for t in m_tiles if t[1] == mt]
        if len(full) >= 3:  # m-tiles as a runtime loop: pointer registers at the tile's A and C rows
            pa, pc = b.sreg(), b.sreg()
            b.emit("addi", pa, (ctx.hbm_addr(a, a0),), imm=0)
            b.emit("addi", pc, (ctx.hbm_addr(c, c0),), imm=0)

            def m_body(pa: Reg = pa, pc: Reg = pc, b0: int = b0) -> None:
                _m_tile(ctx, k, mt, _At(pa, 0), _At(None, b0), _At(pc, 0), *tiles)
                b.addi(pa, mt * a.strides[-2] * _esize(a), pa)
                b.addi(pc, mt * c.strides[-2] * _esize(c), pc)

            b.counted_loop(len(full), m_body, "mtile")
            rest = m_tiles[len(full):]
        for m0, rows in rest:
            _m_tile(ctx, k, rows, _At(None, a0 + m0 * a.strides[-2]), _At(None, b0),
                    _At(None, c0 + m0 * c.strides[-2]), *tiles)


@dataclass(frozen=True)
class _At:
    """Where an operand's part starts: `elem` elements past a pointer register, or past its buffer's start
    (reg None: the address is built from the argument table)."""

    reg: Reg | None
    elem: int

    def addr(self, ctx: KernelContext, view: View, elem: int) -> Reg:
        if self.reg is None:
            return ctx.hbm_addr(view, self.elem + elem)
        return ctx.b.offset_reg(self.reg, (self.elem + elem) * _esize(view))


def _esize(v: View) -> int:
    return 2 if v.dtype == "bf16" else 4


def _m_tile(ctx: KernelContext, k: MatmulKernel, rows: int, a_at: _At, b_at: _At, c_at: _At,
            a_parts: list[Region], b_raw: list[Region], b_parts: list[list[Region]], c_tiles: list[Region],
            passes: list[tuple[int, int]], KT: int, NT: int, hi_full: bool) -> None:
    """One m-tile (`rows` rows of A and C) against all of B: A loaded and split once, B and C tiles
    double-buffered across the n-tiles."""
    b = ctx.b
    a, bm, c = k.a, k.b, k.c
    L = ctx.lanes
    K, Nn = a.shape[-1], bm.shape[-1]
    mt = a_parts[0].rows // KT

    def a_addr(elem: int) -> Reg:
        return a_at.addr(ctx, a, elem)

    def c_addr(elem: int) -> Reg:
        return c_at.addr(ctx, c, elem)

    def cols(nt: int) -> int:
        return min(L, Nn - nt * L)

    def b_addr(nt: int) -> Reg:
        return b_at.addr(ctx, bm, nt * L)

    def n_tile(p: int, wait_store: bool, store_prev: tuple[Reg, int] | None,
               load_next: tuple[Reg, int] | None) -> None:
        """One n-tile in buffer p: split B, the first MXU pass, the previous tile's C store and the next
        tile's B load (both overlap the MXU), the other passes."""
        b.emit("wait", flag=ctx.flag(Flag.LOAD, p))
        weights = [b_raw[p]] + [parts[p] for parts in b_parts[1:]]
        if len(weights) > 1:
            _split(ctx, weights, KT * L, hi_full)
        if wait_store:
            b.emit("wait", flag=ctx.flag(Flag.STORE, p))
        commands = [(qa, qb, kt) for qa, qb in passes for kt in range(KT)]
        _mxu(ctx, a_parts, weights, c_tiles[p], commands[:1], rows, mt, first=True, parity=p)
        if store_prev is not None:
            _store_c(ctx, c_tiles[1 - p], store_prev[0], rows, store_prev[1], c, 1 - p)
        if load_next is not None:
            ctx.dma(True, bm.dtype, load_next[0], b_raw[1 - p], 0, K, load_next[1], bm.strides[-2], Flag.LOAD, 1 - p)
        _mxu(ctx, a_parts, weights, c_tiles[p], commands[1:], rows, mt, first=False, parity=p)

    def static_tile(nt: int) -> None:
        n_tile(nt % 2, nt >= 2, (c_addr((nt - 1) * L), cols(nt - 1)) if nt >= 1 else None,
               (b_addr(nt + 1), cols(nt + 1)) if nt + 1 < NT else None)

    ctx.dma(True, bm.dtype, b_addr(0), b_raw[0], 0, K, cols(0), bm.strides[-2], Flag.LOAD)
    for kt in range(KT):
        ctx.dma(True, a.dtype, a_addr(kt * L), a_parts[0], kt * mt, rows, min(L, K - kt * L), a.strides[-2],
                Flag.MATMUL_A)
    b.emit("wait", flag=ctx.flag(Flag.MATMUL_A))
    if len(a_parts) > 1:
        _split(ctx, a_parts, KT * mt, hi_full)
    # tiles 2 .. 2 * pairs + 1 run as a loop over pairs (buffers and flags alternate with constant names;
    # the B and C addresses are pointer registers): their neighbours' loads and stores are full tiles
    pairs = max(0, (NT - 4) // 2) if NT - 4 >= 2 * MIN_N_TILE_PAIRS else 0
    for nt in range(min(NT, 2)):
        static_tile(nt)
    if pairs:
        b_ptr, c_ptr = b.sreg(), b.sreg()
        b.emit("addi", b_ptr, (b_addr(3),), imm=0)
        b.emit("addi", c_ptr, (c_addr(L),), imm=0)

        def pair() -> None:
            for p in (0, 1):
                n_tile(p, True, (c_ptr, L), (b_ptr, L))
                b.addi(b_ptr, L * _esize(bm), b_ptr)
                b.addi(c_ptr, L * _esize(c), c_ptr)

        b.counted_loop(pairs, pair, "ntile")
    for nt in range(2 + 2 * pairs, NT):
        static_tile(nt)
    last = (NT - 1) % 2
    _store_c(ctx, c_tiles[last], c_addr((NT - 1) * L), rows, cols(NT - 1), c, last)
    ctx.end()


def _store_c(ctx: KernelContext, tile: Region, addr: Reg, rows: int, cols: int, c: View, p: int) -> None:
    ctx.b.emit("wait", flag=ctx.flag(Flag.MXU, p))
    ctx.dma(False, c.dtype, addr, tile, 0, rows, cols, c.strides[-2], Flag.STORE, p)


def _layout(precision: str, M: int, KT: int, L: int, free: int) -> tuple[list[str], int | None]:
    """The part regions of each operand, in order (the first is the raw values' region, rewritten in place),
    and the m-tile rows: a separate finite-only hi next to hi_full when that costs no m-tile rows (module
    docstring), else hi in place carrying nothing non-finite. mt None: K is too large for vmem."""
    def rows_for(parts: int) -> int | None:
        b_rows = 2 * parts * (KT * L + 8)
        budget = free - b_rows - 64
        mt = min(-(-M // 8) * 8, max(8, (budget // (parts * KT + 2)) // 8 * 8), 512)
        divisors = [d for d in range(8, mt + 1, 8) if M % d == 0 and 2 * d >= mt]
        mt = divisors[-1] if divisors else mt  # no tail m-tile: less code
        return mt if parts * KT * mt + 2 * mt + b_rows + 32 <= free else None

    names = ["hi_full", *RESIDUALS[precision]]
    mt = rows_for(len(names))
    if len(names) > 1 and mt is not None and rows_for(len(names) + 1) == mt:
        return [*names, "hi"], mt
    return names, mt


def _split(ctx: KernelContext, parts: list[Region], rows: int, hi_full: bool) -> None:
    """parts[0] holds fp32 values x; rewrite it in place and fill the other parts with the bf16 split
    (module docstring): with `hi_full`, parts = [hi_full, mid, (lo,) hi]; without, [hi, mid, (lo)] with
    the last part carrying non-finite x. Short regions are unrolled; longer ones run a chunk loop (code
    size independent of the operand's size).

    With a lo part the split is exact whichever way hi is rounded, so hi is x truncated to bf16 (one op,
    never inf for finite x); with mid alone ("high") hi is rounded to nearest, which halves the dropped
    mid x mid term, after clamping x to ±BF16_FINITE_MAX. The region written in place is the one stored
    first: the next chunk's load waits for it."""
    b = ctx.b
    residuals = parts[1:-1] if hi_full else parts[1:]
    exact = len(residuals) > 1

    def chunk(off: Reg, r: int = 0) -> None:
        def store(v: Reg, region: Region) -> None:
            b.vst(v, off, region.row + r, row_mem(region, off, r, 8, write=True))

        x = b.vld(off, parts[0].row + r, row_mem(parts[0], off, r, 8))
        zero = b.vconst(0.0)
        if exact:
            hi = b.vop("vand", x, b.vconst_bits(HI16))  # ±inf stay ±inf, a NaN may become inf
            if hi_full:
                store(b.vop("vsel", b.vop("vcmp.eq.f", x, x), hi, x), parts[0])
            rest = b.vop("vsub.f", x, hi)  # exact for finite x, NaN for ±inf and NaN
            finite = b.vop("vcmp.eq.f", rest, rest)
        else:
            clamped = b.vop("vmin.f", b.vop("vmax.f", x, b.vconst_bits(SIGN | BF16_FINITE_MAX)),
                            b.vconst_bits(BF16_FINITE_MAX))  # NaN stays NaN, ±inf become finite
            finite = b.vop("vcmp.eq.f", b.vop("vsub.f", x, x), zero)
            if hi_full:  # the MXU rounds `clamped` to hi itself
                store(b.vop("vsel", finite, clamped, x), parts[0])
            hi = b.vop("vcvt.bf", clamped)
            rest = b.vop("vsub.f", x, hi)  # exact for finite x
        store(b.vop("vsel", finite, hi, zero), parts[-1] if hi_full else parts[0])
        for q, region in enumerate(residuals):
            part = b.vop("vcvt.bf", rest)
            if q + 1 < len(residuals):
                rest = b.vop("vsub.f", rest, part)
            carrier = not hi_full and q + 1 == len(residuals)
            store(b.vop("vsel", finite, part, x if carrier else zero), region)

    _chunks(ctx, -(-rows // 8), chunk, "split")


def _zero_rows(ctx: KernelContext, regions: list[Region], lo: int, hi: int) -> None:
    """Zero rows lo .. hi (multiples of 8) of each region."""
    b = ctx.b
    zero = b.vconst(0.0)
    for region in regions:
        def chunk(off: Reg, r: int = 0, region: Region = region) -> None:
            b.vst(zero, off, region.row + lo + r, row_mem(region, off, lo + r, 8, write=True))

        _chunks(ctx, (hi - lo) // 8, chunk, "zero")


def _chunks(ctx: KernelContext, chunks: int, chunk: Callable[..., None], hint: str) -> None:
    """chunk(off, r) over `chunks` chunks of 8 vmem rows: unrolled (constant addresses) up to
    UNROLL_SPLIT_CHUNKS, else a chunk loop (code size independent of the row count)."""
    if chunks <= UNROLL_SPLIT_CHUNKS:
        for c in range(chunks):
            chunk(ZERO, 8 * c)
    else:
        chunk_loop(ctx.b, chunks, chunk, hint)


def _mxu(ctx: KernelContext, a_parts: list[Region], weights: list[Region], c_tile: Region,
         commands: list[tuple[int, int, int]], rows: int, mt: int, first: bool, parity: int) -> None:
    """Issue lw + mm(a)s for each (part of A, part of B, k tile); runs of one pass longer than
    UNROLL_K_TILES become a counted loop with pointer registers."""
    b = ctx.b
    f = ctx.flag(Flag.MXU, parity)
    n_rows = b.const(rows)
    c_row = b.const(c_tile.row)
    L = ctx.lanes
    i = 0
    while i < len(commands):
        qa, qb, kt = commands[i]
        run = [cmd for cmd in commands[i:] if cmd[:2] == (qa, qb)]
        if len(run) > UNROLL_K_TILES and not first:
            w_ptr, a_ptr = b.sreg(), b.sreg()
            b.emit("li", w_ptr, imm=weights[qb].row + kt * L)
            b.emit("li", a_ptr, imm=a_parts[qa].row + kt * mt)

            def body(w_ptr: Reg = w_ptr, a_ptr: Reg = a_ptr, qa: int = qa, qb: int = qb) -> None:
                b.emit("mxu.lw", None, (w_ptr,), flag=f, mem=(weights[qb].mem(),))
                b.emit("mxu.mmas", None, (a_ptr, b.const(c_tile.row), b.const(rows)), flag=f,
                       mem=(a_parts[qa].mem(), c_tile.mem(0, rows, True)))
                b.emit("addi", w_ptr, (w_ptr,), imm=L)
                b.emit("addi", a_ptr, (a_ptr,), imm=mt)

            b.counted_loop(len(run), body, "ktile")
            n_rows, c_row = b.const(rows), b.const(c_tile.row)
            i += len(run)
            continue
        w_row = weights[qb].row + kt * L
        b.emit("mxu.lw", None, (b.const(w_row),), flag=f, mem=(weights[qb].mem(kt * L, kt * L + L),))
        op = "mxu.mms" if first and i == 0 else "mxu.mmas"
        a_row = a_parts[qa].row + kt * mt
        b.emit(op, None, (b.const(a_row), c_row, n_rows), flag=f,
               mem=(a_parts[qa].mem(kt * mt, kt * mt + rows), c_tile.mem(0, rows, True)))
        i += 1
