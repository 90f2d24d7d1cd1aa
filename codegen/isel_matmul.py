"""Instruction selection for linalg.matmul / batch_matmul on the MXU.

Layout (N = lanes = MXU size). For one batch and one m-tile of Mt rows (up to MAX_M_TILE):
- A is held as KT = ceil(K / N) column blocks of Mt vmem rows (block kt, row m = A[m, kt*N : kt*N + N]),
  one strided DMA per block; lanes past K are zero-filled by the DMA;
- B is loaded by *panel*: the k-rows of one chunk of KC k-tiles of one n-tile (KC = KT, one chunk, unless
  two panels do not fit vmem: then K is tiled and C accumulates across the chunks, `_layout`). B[:, n0 :
  n0 + N] is one DMA (rows past K in the last k-tile zeroed), so weight tile kt is N consecutive rows:
  `mxu.lw` loads it into the shadow buffer while the previous `mxu.mm(a)s` streams, which swaps it in and
  streams the Mt rows of A's block kt. B = W.T (W [N, K] row-major: nn.Linear's weight, a view the kernel
  reader keeps) is loaded as it is: one DMA per k-tile of W's rows n0 .. n0 + N (lanes past K zeroed), and
  `mxu.lwt` makes vmem row n weight column n, so a transposed weight costs nothing extra;
- C[m-tile, n-tile] accumulates in Mt vmem rows (`mxu.mms` first, `mxu.mmas` after) and is stored with one DMA.
B panels are double-buffered by step (n-tile x chunk), C tiles by n-tile, so the MXU streams back to back; a
panel is reloaded once the weight loads that read it are done (flag WEIGHTS). When A's m-tile over all of K
does not fit either, A is loaded by chunk with its panel (`a_chunked`, small configurations and huge K).
An m-tile's first two n-tiles start pipelined (`_pipelined_start`): loads grouped by the commands that
need them, so the MXU starts after the first A block and weight tile, not after all of A.

fp32 operands follow `torch.get_float32_matmul_precision()`: each is split in vmem into bf16 parts
(hi = bf(x), mid = bf(x - hi), lo = bf(x - hi - mid), with `vcvt.bf` and `vsub.f`; `_split` says how hi
avoids rounding a finite x near the fp32 maximum to inf) and the cross products are accumulated, smallest
first: "highest" 6 passes, "high" 3, "medium" 1. bf16 operands run 1 pass; an fp32 x bf16 matmul (attention's
P @ V in a bf16 model) skips the passes through the bf16 operand's residuals, which are zero (`_passes`).

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

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from codegen import isel_decode
from codegen.isel_common import Flag, KernelContext, Preload, Region, Resident, chunk_loop, region_rows, row_mem
from codegen.kernel_graph import LoweringError, MatmulKernel, View
from codegen.mir import ZERO, Reg
from device_sim.isa import DMA_SHAPE_ROWS_SHIFT

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
HEAD_GROUP_ROWS = 640  # DMA rows per load group of a pipelined first n-tile (more than the DMA latency)
HEAD_MAX_K_TILES = 64  # first n-tiles of up to this many k-tiles are pipelined (unrolled by group)
# ... and m-tiles whose rows are a runtime value (a dynamic-shape bucket's) of at least this many rows: 1B
# projections at 129 of 256 rows ~1,000 cycles faster each, at 33 of 64 ~450 slower (A is small there)
HEAD_MIN_RUNTIME_ROWS = 128
MAX_M_TILE = 1024  # rows of A and C per m-tile: each m-tile pays a pipeline fill and drain
UNROLL_BATCHES = 2  # batched matmuls of more batches run a batch loop
MAX_RESIDENT_BATCHES = 32  # `_resident_batches` unrolls its batches
# ... and their MXU commands: more than this many a batch only where a batch's MXU work is within a DMA
# latency (the list scheduler's time grows with the unrolled block: 38 n-tiles a batch on `small` took minutes)
MAX_RESIDENT_COMMANDS = 4
ROW_COMMAND_ROWS = 8  # resident batches of at most this many rows of A run an MXU command a row (`_mxu_by_row`)
ROUND_HALVES = True  # resident rounds of a batch each move each batch's weights in halves (`_resident_batches`)
JOINT_A = True  # one resident round by row loads every batch's A in one DMA (the same)
PREFETCH_AFTER_ROUNDS = True  # resident rounds issue a prefetch before their last round (`_resident_rounds`)
LAST_HALVES = True  # one resident round in groups: its last batch a group, its weights in halves (the same)
PRELOAD_FIRST_B = True  # the kernel before resident batches loads their first batch's B (`first_batch_weights`)
SPLIT_MIN_ROWS = 256  # m-tiles of at least this many rows start on part of A and end storing C in two parts
# a batch loop's pipelined starts issue the next batch's first loads behind their last command (`_starts_ahead`)
START_AHEAD = True
A_ROWS, A_REST = -1, -2  # a pipelined start's A loads (in place of an n-tile): rows 0 .. head (all), the rest
MIN_N_TILE_PAIRS = 2  # n loops of fewer pairs of n-tiles are unrolled
UNROLL_K_TILES = 4  # k loops up to this many tiles are unrolled, longer ones run as loops (more unrolled
# tiles x up to 6 bf16 passes keep too many row constants live: allocation did not converge)


def lower_matmul(ctx: KernelContext, k: MatmulKernel) -> None:
    a, bm, c = k.a, k.b, k.c
    batched = len(c.shape) == 3
    B = c.shape[0] if batched else 1
    M, K = a.shape[-2:]
    Nn = bm.shape[-1]
    for v, what in ((a, "A"), (c, "C")):
        if v.strides[-1] != 1:
            raise LoweringError(f"matmul operand {what} is not contiguous along its last dim: {v.strides}")
    trans_b = bm.strides[-1] != 1 and Nn > 1  # B = W.T with W [N, K] row-major: loaded with mxu.lwt
    if trans_b and bm.strides[-2] != 1 and K > 1:
        raise LoweringError(f"matmul operand B is contiguous along neither dim: {bm.strides}")
    precision = "medium" if a.dtype == "bf16" and bm.dtype == "bf16" else ctx.matmul_precision
    prefetched = ctx.prefetch.stream if ctx.prefetch is not None else None  # planned with its prefetch
    stream = prefetched or isel_decode.plan(ctx.config, k, ctx.vmem_free())
    if stream is not None:  # one row against a weight: streamed at HBM speed
        isel_decode.lower_decode_matmul(ctx, k, stream)  # issues the next stream's prefetch, if it has one
        return
    _lower_general(ctx, k, B, batched, M, K, Nn, trans_b, precision)
    if ctx.prefetch is not None and ctx.prefetch.issue is not None:  # planned as a stream, it could not be one
        isel_decode.issue_prefetch(ctx)


def _lower_general(ctx: KernelContext, k: MatmulKernel, B: int, batched: bool, M: int, K: int, Nn: int,
                   trans_b: bool, precision: str) -> None:
    a, bm, c = k.a, k.b, k.c
    L = ctx.lanes
    KT, NT = -(-K // L), -(-Nn // L)
    if k.row_segments > 1:  # each segment's valid rows: in resident batches, else all rows are computed
        if _resident_batches(ctx, k, B, batched, KT, NT, trans_b, precision):
            return
        k = dataclasses.replace(k, valid_rows=None, row_segments=1)
    runtime_rows = k.valid_rows is not None and B <= UNROLL_BATCHES
    if not runtime_rows and _resident_batches(ctx, k, B, batched, KT, NT, trans_b, precision):
        return
    plan = _layout(precision, M, KT, L, ctx.vmem_free(), runtime_rows)
    if plan is None:
        raise LoweringError(f"matmul {M}x{K}x{Nn} does not fit vmem (not even 8 rows and one k-tile)")
    names, mt, KC, a_chunked = plan
    parts = len(names)
    a_tiles = KC if a_chunked else KT
    hi_full = "hi" in names[1:]
    t = _Tiling(
        a_sets=[[ctx.region(a_tiles * mt, f"a{q}_") for q in range(parts)] for _ in range(2 if a_chunked else 1)],
        b_sets=[[ctx.region(KC * L, f"b{q}_") for q in range(parts)] for _ in range(2)],
        c_tiles=[ctx.region(mt, "c") for _ in range(2)],
        passes=_passes(precision, names, hi_full, a.dtype == "bf16", bm.dtype == "bf16"),
        mt=mt, KT=KT, KC=KC, NT=NT, hi_full=hi_full, trans_b=trans_b, a_chunked=a_chunked)
    if K % L and not trans_b and t.nch == 1:
        # weight rows K .. KT * L must be zero: the DMA never writes them, and 0 x stale NaN / inf is NaN
        # (with several k-chunks the last chunk zeroes them as it is loaded: other chunks share its panel)
        _zero_rows(ctx, [s[0] for s in t.b_sets], K // 8 * 8, KT * L)
    m_tiles = [(m0, min(mt, M - m0)) for m0 in range(0, M, mt)]
    b = ctx.b
    if runtime_rows:
        _valid_m_tiles(ctx, k, t, B, batched, M)
        return
    if B > UNROLL_BATCHES:  # batches as a runtime loop: pointer registers at each batch's A, B and C
        pa, pb, pc = b.sreg(), b.sreg(), b.sreg()
        for ptr, v in ((pa, a), (pb, bm), (pc, c)):
            b.emit("addi", ptr, (ctx.hbm_addr(v, v.offset),), imm=0)
        if _prefetches_batches(ctx, k, t, m_tiles):
            _batches_ahead(ctx, k, t, B, m_tiles[0][1], pa, pb, pc)
            return

        def batch_body() -> None:
            for m0, rows in m_tiles:
                _m_tile(ctx, k, t, rows, _At(pa, m0 * a.strides[-2]), _At(pb, 0), _At(pc, m0 * c.strides[-2]))
            _next_batch(ctx, k, pa, pb, pc)

        b.counted_loop(B, batch_body, "batch")
        return
    for batch in range(B):
        a0, b0, c0 = ((v.offset + (v.strides[0] * batch if batched else 0)) for v in (a, bm, c))
        rest = m_tiles
        full = [tile for tile in m_tiles if tile[1] == mt]
        if len(full) >= 3:  # m-tiles as a runtime loop: pointer registers at the tile's A and C rows
            pa, pc = b.sreg(), b.sreg()
            b.emit("addi", pa, (ctx.hbm_addr(a, a0),), imm=0)
            b.emit("addi", pc, (ctx.hbm_addr(c, c0),), imm=0)

            def m_body(pa: Reg = pa, pc: Reg = pc, b0: int = b0) -> None:
                _m_tile(ctx, k, t, mt, _At(pa, 0), _At(None, b0), _At(pc, 0))
                b.addi(pa, mt * a.strides[-2] * _esize(a), pa)
                b.addi(pc, mt * c.strides[-2] * _esize(c), pc)

            b.counted_loop(len(full), m_body, "mtile")
            rest = m_tiles[len(full):]
        for m0, rows in rest:
            _m_tile(ctx, k, t, rows, _At(None, a0 + m0 * a.strides[-2]), _At(None, b0),
                    _At(None, c0 + m0 * c.strides[-2]))


def _valid_m_tiles(ctx: KernelContext, k: MatmulKernel, t: _Tiling, B: int, batched: bool, M: int) -> None:
    """The m-tiles of a matmul whose valid rows are a runtime value (a dynamic-shape bucket's padded M):
    a loop over m-tiles while rows are left, each of min(rows left, mt) rows at run time: A's DMA, the MXU
    commands and C's store move only those (padding rows of C are left as they were: nothing reads them)."""
    a, bm, c = k.a, k.b, k.c
    b, mt = ctx.b, t.mt
    for batch in range(B):
        a0, b0, c0 = ((v.offset + (v.strides[0] * batch if batched else 0)) for v in (a, bm, c))
        pa, pc = b.sreg(), b.sreg()
        b.emit("addi", pa, (ctx.hbm_addr(a, a0),), imm=0)
        b.emit("addi", pc, (ctx.hbm_addr(c, c0),), imm=0)
        left = ctx.valid_count(k.valid_rows, M)

        def m_body(pa: Reg = pa, pc: Reg = pc, left: Reg = left, b0: int = b0) -> None:
            rows = b.emit("min", b.sreg(), (left, b.const(mt)))
            _m_tile(ctx, k, dataclasses.replace(t, rows_reg=rows), mt, _At(pa, 0), _At(None, b0), _At(pc, 0))
            b.addi(pa, mt * a.strides[-2] * _esize(a), pa)
            b.addi(pc, mt * c.strides[-2] * _esize(c), pc)

        b.while_positive(left, mt, m_body, "mtile")


RESIDENT_FLAGS = ((Flag.LOAD, 0), (Flag.LOAD, 1), (Flag.MATMUL_A, 0), (Flag.MATMUL_A, 1))  # a group of batches each


def _next_batch(ctx: KernelContext, k: MatmulKernel, pa: Reg, pb: Reg, pc: Reg) -> None:
    """Advance a batch loop's pointer registers at A, B and C to the next batch."""
    for ptr, v in ((pa, k.a), (pb, k.b), (pc, k.c)):
        if v.strides[0]:
            ctx.b.addi(ptr, v.strides[0] * _esize(v), ptr)


def _prefetches_batches(ctx: KernelContext, k: MatmulKernel, t: _Tiling, m_tiles: list[tuple[int, int]]) -> bool:
    """Whether a batch loop loads each batch's A and first B panel during the batch before it
    (`_batches_ahead`): one m-tile a batch, A whole in one part, with room for its second buffer, or loaded
    by a pipelined start that can start ahead (`_starts_ahead`)."""
    if len(m_tiles) != 1 or t.a_chunked or len(t.a_sets[0]) != 1 or t.rows_reg is not None:
        return False
    rows = m_tiles[0][1]
    if _head_group(t, rows, ctx.lanes):
        return START_AHEAD and _starts_ahead(ctx, t, rows, k.a)
    return ctx.vmem_free() >= region_rows(t.KT * t.mt)


def _batches_ahead(ctx: KernelContext, k: MatmulKernel, t: _Tiling, B: int, rows: int, pa: Reg, pb: Reg,
                   pc: Reg) -> None:
    """B batches of one m-tile each, A in two buffers (batch i in buffer i % 2): each batch but the last
    loads the next one's A and first B panel behind its last MXU command, so that the next batch starts
    on them at once instead of paying their DMA latency after its drain (~1,000 cycles a batch of attention's
    q @ K^T). Batch 0 and the last are code of their own, the ones between a loop of two batches a run.
    Pipelined starts (one buffer of A: P @ V at 1,536 keys, ~960 cycles a batch) issue the next batch's first
    load groups behind the last command instead; batch i computes into C tile i % 2 and batch i + 1 stores
    it, so that neither the next batch's first command nor its issue waits for this batch's C store."""
    b = ctx.b
    a, bm = k.a, k.b
    group = bool(_head_group(t, rows, ctx.lanes))
    if not group:  # A's second buffer (a pipelined start needs none)
        t = dataclasses.replace(t, a_sets=[t.a_sets[0], [ctx.region(t.KT * t.mt, "a0_")]])

    def batch(a_buf: int, prefetched: bool, has_next: bool) -> None:
        ahead = (_At(pa, a.strides[0]), _At(pb, bm.strides[0])) if has_next else None
        _m_tile(ctx, k, t, rows, _At(pa, 0), _At(pb, 0), _At(pc, 0), a_buf=a_buf, prefetched=prefetched,
                ahead=ahead, c_first=a_buf if group else 0, previous_c=prefetched and group)
        _next_batch(ctx, k, pa, pb, pc)

    batch(0, False, True)
    pairs, odd = divmod(B - 2, 2)
    if pairs:
        b.counted_loop(pairs, lambda: (batch(1, True, True), batch(0, True, True)), "batches")
    if odd:
        batch(1, True, True)
    batch((B - 1) % 2, True, False)


def first_batch_weights(k: MatmulKernel, lanes: int) -> Preload | None:
    """Batch 0's B of resident batches by row as the rows one DMA brings into its panel, which the kernel
    before may load for them behind its own loads (`KernelContext.preload`): decode attention's first KV
    head, its keys for q @ K^T (a key a vmem row) or its values for P @ V (a value row a vmem row). The
    softmax before P @ V at 4096 positions computed ~1,100 cycles with the channel idle, while P @ V waited
    for its first head's values. None where B does not land so (several n-tiles of V, a panel past the
    last key or value, more than bf16 operands' one pass)."""
    a, bm, c = k.a, k.b, k.c
    if not PRELOAD_FIRST_B or len(c.shape) != 3 or c.shape[0] < 2 or a.shape[-2] > ROW_COMMAND_ROWS \
            or (a.dtype, bm.dtype) != ("bf16", "bf16"):
        return None
    K, N = bm.shape[-2:]
    if bm.strides[-1] != 1 and N > 1:  # K^T: whole, one k-tile, its n-tiles views of the keys' rows
        if K <= lanes and bm.strides[-2] == 1 and N % lanes == 0 and N > lanes:
            return Preload(bm, bm.offset, N, K, bm.strides[-1], N, in_flight=True)
        return None
    if N <= lanes and K % lanes == 0 and K > lanes:  # V: one n-tile, no zero rows past K
        return Preload(bm, bm.offset, K, N, bm.strides[-2], K, in_flight=True)
    return None


def _resident_batches(ctx: KernelContext, k: MatmulKernel, B: int, batched: bool, KT: int, NT: int,
                      trans_b: bool, precision: str) -> bool:
    """Batched matmuls of at most one m-tile a batch (attention's q @ K^T and P @ V for each KV head, at decode
    and at a prefill of up to MAX_M_TILE query rows a head group) with many batches' A, B and C in vmem at
    once: all of them in one round, every load issued first and the MXU work in groups that each wait for
    their own loads, or, when vmem holds only some, in double-buffered rounds (`_resident_rounds`). The
    general batch loop waits a DMA latency in and one out per batch: at 128 queries of 4 heads a group (512
    rows a batch) the scores took 11,929 cycles that way and take 5,286 here. A batch of more than
    MAX_RESIDENT_COMMANDS MXU commands only where its MXU work is within a latency. With segments of valid
    rows (`MatmulKernel.row_segments`: attention's [rep, L] rows of a dynamic-shape bucket) each command's mm
    runs a segment at a time over that segment's valid rows (a runtime count), under one weight load; A and C
    still move whole (their padding rows are arbitrary: nothing reads them); that way even one batch (a
    single KV head) multiplies only its valid rows. False (nothing emitted) when it does not apply or two
    batches do not fit."""
    a, bm, c = k.a, k.b, k.c
    L, b = ctx.lanes, ctx.b
    M, K = a.shape[-2:]
    mt = -(-M // 8) * 8
    names = ["hi_full", *RESIDUALS[precision]]  # hi in place, carrying nothing non-finite (`_layout`)
    parts = len(names)
    passes = _passes(precision, names, False, a.dtype == "bf16", bm.dtype == "bf16")
    # B = K^T of one k-tile (head dim <= lanes): a batch's keys land one a row in one DMA, its n-tiles' panels
    # views of that region (a DMA an n-tile cost each batch 16 commands at 2048 keys: the kernel was bound
    # by issuing their address arithmetic)
    whole_b = trans_b and KT == 1 and bm.strides[-2] == 1
    # a few rows (decode: a KV head's query rows) over several k-tiles or n-tiles: a batch's A and C each in
    # one DMA, row-major (row m's k-tile kt at region row m * KT + kt, its n-tile nt at m * NT + nt), and an
    # MXU command a row. A DMA a tile (16 a head at 2048 keys: P's k-tiles, the scores' n-tiles) filled the
    # DMA queue, and issuing them stalled the kernel past its first group's loads
    by_row = M <= ROW_COMMAND_ROWS and passes == [(0, 0)] and KT * NT > 1 and a.strides[-1] == 1 and c.strides[-1] == 1
    per_batch = parts * (KT * mt + 8 + NT * (KT * L + 8)) + NT * (mt + 8)
    # batch 0's B where the kernel before loaded it (`first_batch_weights`): slot 0's panel, not loaded; its
    # rows count as free (where it lies, below this kernel's ceiling, it may split the rows above)
    first = first_batch_weights(k, L) if by_row else None
    first_b = ctx.take_resident(first.view.buffer, bm.dtype, first.base, first.rows, first.cols, first.stride) \
        if first is not None else None
    free = ctx.vmem_free() + (first_b.rows if first_b else 0)
    R = min(B, free // per_batch)  # batch slots
    # in rounds, A and C regions of every batch, B in slots, where that leaves ROUND_DEPTH slots: a round's
    # loads then wait only for the weight loads of the round whose slots they take, not its MXU work, and
    # no round waits for stores (`_resident_rounds`)
    own_rows = parts * region_rows(KT * mt) + (region_rows(M * NT) if by_row else NT * region_rows(mt))  # A and C
    slot_rows = parts * NT * region_rows(KT * L)  # B
    by_batch = R < B and (free - B * own_rows) // slot_rows >= ROUND_DEPTH
    if by_batch:
        R = min(B, (free - B * own_rows) // slot_rows)
    n_commands = len(passes) * NT * KT  # a batch's MXU commands, unrolled for every batch
    # rows an mm: a batch's, or with segments a segment's (a bucket of 512 queries of 4 heads a KV head is
    # 2048 rows a batch)
    seg = M // k.row_segments
    # one batch: only for its segments' runtime rows (a single KV head)
    if not (1 < B or k.row_segments > 1) or B > MAX_RESIDENT_BATCHES or seg > MAX_M_TILE \
            or (n_commands > MAX_RESIDENT_COMMANDS and n_commands * mt > ctx.config.dma_latency) \
            or R < min(B, 2):
        return False
    # by row with a C region a batch: C's elements as a load of its rows would bring them, which it leaves in
    # vmem for the next kernel (`_leave_c`: decode's scores, which the softmax chain reads there), its regions
    # first, so that they do not split the kernel's other regions from the next kernel's
    leave = by_row and (by_batch or R == B) and _can_leave_c(ctx, k, B, batched)

    def c_regions() -> list[list[Region]]:
        return [[ctx.region(M * NT, "c")] if by_row else [ctx.region(mt, "c") for _ in range(NT)]
                for _ in range(B if by_batch else R)]

    c_tiles = c_regions() if leave else []
    # one round by row whose batches' A rows follow each other in HBM (decode's query rows of every KV head):
    # A in one DMA. A DMA a batch took half the DMA queue, and issuing the rest, the next stream's prefetch
    # last, held the MXU back until the queue had room for it (Qwen3's q @ K^T at 1024 positions: ~550 cycles
    # after its first group had landed)
    joint_a = JOINT_A and by_row and parts == 1 and R == B and batched and a.strides[0] == M * a.strides[-2]
    if joint_a:
        a_rows = M * KT  # a batch's, row-major (`_mxu_by_row`)
        whole_a = ctx.region(B * a_rows, "a0_")
        a_parts = [[whole_a.view(i * a_rows, a_rows)] for i in range(B)]
    else:
        a_parts = [[ctx.region(KT * mt, f"a{q}_") for q in range(parts)] for _ in range(B if by_batch else R)]

    def a_slot(i: int, s: int) -> list[Region]:
        return a_parts[i if by_batch else s]

    raw_b = [first_b if s == 0 and first_b else ctx.region(NT * L, "b0_") for s in range(R)] if whole_b else []
    panels = [[[raw_b[s].view(nt * L, L) if whole_b and q == 0 else first_b if s == 0 and first_b
                else ctx.region(KT * L, f"b{q}_") for q in range(parts)] for nt in range(NT)] for s in range(R)]
    c_tiles = c_tiles or c_regions()

    def c_slot(i: int, s: int) -> list[Region]:
        return c_tiles[i if by_batch else s]

    t = _Tiling(a_sets=[], b_sets=[], c_tiles=[], passes=passes, mt=mt, KT=KT, KC=KT, NT=NT, hi_full=False,
                trans_b=trans_b, a_chunked=False)
    if K % L and not trans_b:  # weight rows past K must be zero (0 x stale NaN / inf is NaN): no DMA writes them
        _zero_rows(ctx, [p[0] for row in panels for p in row], K // 8 * 8, KT * L)

    def at(v: View, batch: int) -> int:
        return v.offset + (v.strides[0] * batch if batched else 0)

    def cols(nt: int) -> int:
        return min(L, bm.shape[-1] - nt * L)

    commands = [(qa, qb, kt, kt) for qa, qb in passes for kt in range(KT)]
    # attention's query heads: the valid rows at the start of each segment
    segments = (seg, ctx.valid_count(k.valid_rows, seg)) if k.row_segments > 1 else None
    # a round a batch, and the DMA no faster than the MXU (a KV head's tile in the time HBM delivers it): the
    # MXU works on a batch after it has landed, so the last batch's work is the kernel's tail. Each batch's B
    # moves in halves (by weight tile: n-tiles of K^T, k-tiles of V), the first on the round's load flag, the
    # second on the round's ROUND_HALF_FLAGS, and the MXU starts on the first half
    splittable = by_row and (whole_b or (not trans_b and NT == 1)) and KT * NT >= 2
    halves = ROUND_HALVES and by_batch and splittable
    half = (NT // 2 if whole_b else KT // 2) * L  # B's rows in the first half (keys, or V's rows)
    # one round in groups (below): where the MXU takes a batch's weights in at most half the time HBM delivers
    # them (Qwen3's keys of head dim 128; not the 1B's of 64, which fill half a weight tile), it keeps up
    # with groups that shrink, and what it has left when the last lands is the kernel's tail: the last group
    # is one batch, its B in halves (qwen3-0.6b-2l decode at 1024 positions, A in one DMA: 87,151 -> 86,643
    # cycles, 87,241 with a DMA a batch's A; the 1B's attention, where the MXU only keeps pace: 265,978 ->
    # 266,490)
    mxu_cycles = NT * KT * ctx.config.mxu_weight_cycles
    transfer = K * bm.shape[-1] * _esize(bm) // ctx.config.hbm_bytes_per_cycle
    last_halves = LAST_HALVES and not by_batch and R == B and splittable and 2 * mxu_cycles <= transfer

    def second_half(i: int, group: int) -> tuple[Flag, int] | None:
        """The flag batch i's second half of B lands on, where its B moves in halves; `group`: its slot group."""
        if halves:
            return ROUND_HALF_FLAGS[group]
        return LAST_HALF_FLAG if last_halves and i == B - 1 else None

    def load(i: int, s: int, role: Flag, parity: int) -> None:  # batch i's A and B into slot s
        if joint_a:
            if i == 0:  # every batch's, on the first group's flag: each group waits for it first
                ctx.dma(True, a.dtype, ctx.hbm_addr(a, a.offset), whole_a, 0, B * M, K, a.strides[-2], role, parity)
        elif by_row:
            ctx.dma(True, a.dtype, ctx.hbm_addr(a, at(a, i)), a_slot(i, s)[0], 0, M, K, a.strides[-2], role, parity)
        else:
            _dma_tiles(ctx, a, ctx.hbm_addr(a, at(a, i)), a_slot(i, s)[0], mt, KT, M, K, role, parity)
        if i == 0 and first_b:  # landed: the kernel before loaded it
            return
        second = second_half(i, ROUND_LOAD_FLAGS.index((role, parity)) if halves else 0)
        if second is not None:  # B's rows (keys of K^T, or V's rows) by halves: whole_b's shape is B transposed
            rows, width = bm.shape[-2:][::-1] if whole_b else bm.shape[-2:]
            stride = bm.strides[-1 if whole_b else -2]
            region = raw_b[s] if whole_b else panels[s][0][0]
            ctx.dma(True, bm.dtype, ctx.hbm_addr(bm, at(bm, i)), region, 0, half, width, stride, role, parity)
            ctx.dma(True, bm.dtype, ctx.hbm_addr(bm, at(bm, i) + half * stride), region, half, rows - half, width,
                    stride, *second)
            return
        if whole_b:
            ctx.dma(True, bm.dtype, ctx.hbm_addr(bm, at(bm, i)), raw_b[s], 0, bm.shape[-1], K, bm.strides[-1],
                    role, parity)
            return
        for nt in range(NT):
            if trans_b:
                hbm = ctx.hbm_addr(bm, at(bm, i) + nt * L * bm.strides[-1])
                _dma_tiles(ctx, bm, hbm, panels[s][nt][0], L, KT, cols(nt), K, role, parity)
            else:
                ctx.dma(True, bm.dtype, ctx.hbm_addr(bm, at(bm, i) + nt * L), panels[s][nt][0], 0, K, cols(nt),
                        bm.strides[-2], role, parity)

    def compute(slots: list[tuple[int, int]], parity: int, group: int = 0) -> None:  # (batch, slot)s: splits, then MXU
        # commands; `group`: the round's slot group (its load flags)
        for i, s in slots if parts > 1 else ():
            _split(ctx, a_slot(i, s), KT * mt, False)
            for nt in range(NT):
                _split(ctx, panels[s][nt], KT * L, False)
        if first_b and any(i == 0 for i, _ in slots):  # the kernel before left its DMA in flight
            b.emit("wait", flag=ctx.flag(Flag.COPY))
        for i, s in slots:
            if by_row:
                second = second_half(i, group)
                _mxu_by_row(ctx, a_slot(i, s)[0], [panel[0] for panel in panels[s]], c_slot(i, s)[0], M, KT, trans_b,
                            parity, (half // L * (KT if whole_b else 1), second) if second else None)
                continue
            for nt in range(NT):
                _mxu(ctx, t, a_slot(i, s), panels[s][nt], c_slot(i, s)[nt], commands, M, first=True, overwrite=True,
                     parity=parity, segments=segments)

    def store(slots: list[tuple[int, int]], parity: int, flag: tuple[Flag, int] = (Flag.STORE, 0)) -> None:
        b.emit("wait", flag=ctx.flag(Flag.MXU, parity))  # only these slots' commands are on it
        for i, s in slots:
            if by_row:
                ctx.dma(False, c.dtype, ctx.hbm_addr(c, at(c, i)), c_slot(i, s)[0], 0, M, bm.shape[-1], c.strides[-2],
                        *flag)
                continue
            for nt in range(NT):
                ctx.dma(False, c.dtype, ctx.hbm_addr(c, at(c, i) + nt * L), c_slot(i, s)[nt], 0, M, cols(nt),
                        c.strides[-2], *flag)

    if leave:
        _leave_c(ctx, k, [c[0] for c in c_tiles], B)
    if R < B:  # rounds: the next rounds load while this one computes
        _resident_rounds(ctx, B, R, load, compute, store, by_batch)
        return True
    # one round in up to four groups, each loading on a flag of its own: a group's MXU work starts when its
    # operands have landed, along the next groups' DMA, and its stores go along the next group's MXU work. A
    # group per half latency of transfer: short loads (a few positions of context) stay one group, as each
    # group's wait drains the MXU
    half_latency = ctx.config.hbm_bytes_per_cycle * ctx.config.dma_latency // 2  # bytes
    load_bytes = B * (M * K * _esize(a) + K * bm.shape[-1] * _esize(bm))
    n = max(1, min(len(RESIDENT_FLAGS), B, load_bytes // half_latency))
    # with the last batch a group of its own (`last_halves`), the others split evenly before it
    ends = [B - 1 - (n - 1 - g) * (B - 1) // (n - 1) for g in range(n)] + [B] if last_halves and n > 1 else \
        [g * B // n for g in range(n + 1)]
    groups = [[(i, i) for i in range(lo, hi)] for lo, hi in itertools.pairwise(ends)]
    for slots, (role, parity) in zip(groups, RESIDENT_FLAGS, strict=False):
        for i, s in slots:
            load(i, s, role, parity)
    for g, (slots, (role, parity)) in enumerate(zip(groups, RESIDENT_FLAGS, strict=False)):
        b.emit("wait", flag=ctx.flag(role, parity))
        compute(slots, g % 2)
        if g:
            store(groups[g - 1], (g - 1) % 2)  # g - 2's commands were waited
    store(groups[-1], (n - 1) % 2)
    return True


LEAVE_C = True  # resident batches leave C in vmem for the next kernel (a knob for the tests' comparison)


def _can_leave_c(ctx: KernelContext, k: MatmulKernel, B: int, batched: bool) -> bool:
    """Whether resident batches by row can leave C in vmem as the [B * M, N] rows it is: f32 (what the MXU
    wrote is what a load brings), whole vmem rows (a load zeroes the lanes past a row's last element, the MXU
    writes them), every batch's rows one after the other in HBM and in whole chunks of 8 vmem rows."""
    c = k.c
    M, N = c.shape[-2:]
    dense = B == 1 or (batched and c.strides[0] == M * c.strides[-2])
    return LEAVE_C and c.dtype == "f32" and c.strides[-1] == 1 and N % ctx.lanes == 0 and dense \
        and M * N // ctx.lanes % 8 == 0


def _leave_c(ctx: KernelContext, k: MatmulKernel, regions: list[Region], B: int) -> None:
    """C left in vmem for the next kernel (`KernelContext.leave`), where its batches' regions are one after
    the other (`_can_leave_c`)."""
    c = k.c
    M, N = c.shape[-2:]
    rows = M * N // ctx.lanes
    if any(r.row != regions[0].row + i * rows for i, r in enumerate(regions)):
        return
    region = Region(regions[0].name, regions[0].row, B * rows)
    ctx.leave(Resident(c.buffer, c.dtype, c.offset, B * M, N, c.strides[-2], region))


# the load and store flags of resident rounds by slot group: a round's loads, and the stores its C tiles
# wait for before the round `ROUND_DEPTH` later rewrites them (OUT: a third store flag)
ROUND_LOAD_FLAGS = ((Flag.LOAD, 0), (Flag.LOAD, 1), (Flag.MATMUL_A, 0))
ROUND_STORE_FLAGS = ((Flag.STORE, 0), (Flag.STORE, 1), (Flag.OUT, 0))
ROUND_DEPTH = len(ROUND_LOAD_FLAGS)
# the second half of a round's B, where it moves in halves: flags that no other part of such a kernel uses
ROUND_HALF_FLAGS = ((Flag.MATMUL_A, 1), (Flag.INDEX, 0), (Flag.ROWS, 0))
# one round in groups: the last batch's second half of B (a flag none of `RESIDENT_FLAGS`)
LAST_HALF_FLAG = (Flag.INDEX, 0)


def _resident_rounds(ctx: KernelContext, B: int, R: int, load: Callable[[int, int, Flag, int], None],
                     compute: Callable[[list[tuple[int, int]], int, int], None],
                     store: Callable[[list[tuple[int, int]], int, tuple[Flag, int]], None],
                     by_batch: bool = False) -> None:
    """More batches than vmem holds (R slots): rounds of up to R // depth batches in `depth` groups of slots
    used in turn, ROUND_DEPTH where R allows, else two. Round k's MXU parity is k % 2 (its store waits for
    it). Two ways:
    - slots hold a batch's A, B and C: round k + depth - 1's loads are issued before round k's MXU work, into
      the slots of round k - 1, whose stores waited for its MXU work; round k waits for round k - depth's
      stores (`ROUND_STORE_FLAGS`) before its MXU work rewrites their C tiles;
    - `by_batch`: A and C have a region a batch, only B panels take slots. Round k + depth's loads are
      issued as soon as round k's weight loads have read its panels (flag WEIGHTS), round k's stores along
      round k + 1's MXU work, and no round waits for stores: the DMA queue holds the next rounds' loads
      while the MXU works, and the weight port takes a round as it lands (decode's q @ K^T over 8 KV heads of
      4096 keys, a head a round, in a 1B layer: 8,407 cycles with two groups, a DMA latency a round; 5,607
      this way, against 4,612 of transfer).
    Rounds in place of resident batches waited a latency in and out each, 3x the kernel's transfer time at a
    4096-token context."""
    depth = ROUND_DEPTH if R >= ROUND_DEPTH else 2
    # by_batch: a round a batch (the last round's MXU work is the kernel's tail: q @ K^T alone, rounds of two
    # heads of 4096 keys took 7,009 cycles, of one 6,564)
    size = 1 if by_batch else max(1, R // depth)
    count = -(-B // size)
    rounds = [range(r * B // count, (r + 1) * B // count) for r in range(count)]  # even sizes, each <= size

    def slots(k: int) -> list[tuple[int, int]]:
        return [(i, (k % depth) * size + j) for j, i in enumerate(rounds[k])]

    def issue(k: int) -> None:
        if k < count:
            for i, s in slots(k):
                load(i, s, *ROUND_LOAD_FLAGS[k % depth])

    def store_round(k: int) -> None:
        store(slots(k), k % 2, ROUND_STORE_FLAGS[k % depth])

    b = ctx.b
    for k in range(depth if by_batch else depth - 1):
        issue(k)
    for k in range(count):
        if not by_batch:
            issue(k + depth - 1)
        if PREFETCH_AFTER_ROUNDS and count > depth and k == count - 1 and b.block.instrs:
            # the next stream's prefetch tiles, issued here, fill the channel through the last round's landing
            # and MXU tail, where their first wait put them ahead of the later rounds' loads; after the last
            # loads' issue, the full DMA queue held the MXU work of the rounds before (by_batch: 12 tiles of
            # a projection after q @ K^T at 4096 positions, 17,601 cycles there, 17,872 here: 16,833)
            ctx.prefetch_after = b.block.instrs[-1]
        b.emit("wait", flag=ctx.flag(*ROUND_LOAD_FLAGS[k % depth]))
        if k >= depth and not by_batch:  # round k - depth's stores still read these C tiles
            b.emit("wait", flag=ctx.flag(*ROUND_STORE_FLAGS[k % depth]))
        compute(slots(k), k % 2, k % depth)
        if not by_batch:
            store_round(k)
            continue
        if k + depth < count:
            b.emit("wait", flag=ctx.flag(Flag.WEIGHTS, k % 2))
            issue(k + depth)
        if k:
            store_round(k - 1)
    if by_batch:
        store_round(count - 1)


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

    def plus(self, elem: int) -> _At:
        return _At(self.reg, self.elem + elem)


@dataclass(frozen=True)
class _Tiling:
    """The vmem regions and tile counts of one matmul kernel. K is split into chunks of KC k-tiles (one
    chunk when a whole B panel fits); B panels (one chunk of one n-tile) are double-buffered by step
    (step = n-tile x chunk, buffer parity (n-tile parity * chunks + chunk) % 2), so are A's chunks when
    A does not fit whole (`a_chunked`: reloaded for every step); C tiles alternate by n-tile parity."""

    a_sets: list[list[Region]]  # [buffer][part]
    b_sets: list[list[Region]]  # [buffer][part]: part 0 is the raw panel, split in place
    c_tiles: list[Region]
    passes: list[tuple[int, int]]
    mt: int
    KT: int
    KC: int
    NT: int
    hi_full: bool
    trans_b: bool
    a_chunked: bool
    rows_reg: Reg | None = None  # the m-tile's rows at run time (`_valid_m_tiles`), at most its static rows

    @property
    def nch(self) -> int:
        return -(-self.KT // self.KC)

    def parity(self, pc: int, kc: int) -> int:
        """The buffer (and MXU / weight flag) parity of chunk kc of an n-tile of parity pc."""
        return (pc * self.nch + kc) % 2

    def tiles(self, kc: int) -> int:
        return min(self.KC, self.KT - kc * self.KC)


def _esize(v: View) -> int:
    return 2 if v.dtype == "bf16" else 4


def _mxu_bound(ctx: KernelContext, rows: int, bm: View) -> bool:
    """Whether an MXU command over `rows` rows outlasts the DMA of its weight tile (of B `bm`)."""
    return rows * ctx.config.hbm_bytes_per_cycle >= ctx.lanes * ctx.lanes * _esize(bm)


def _m_tile(ctx: KernelContext, k: MatmulKernel, t: _Tiling, rows: int, a_at: _At, b_at: _At, c_at: _At,
            a_buf: int = 0, prefetched: bool = False, ahead: tuple[_At, _At] | None = None,
            c_first: int = 0, previous_c: bool = False) -> None:
    """One m-tile (`rows` rows of A and C) against all of B: A loaded and split once (or per step when
    chunked), B panels and C tiles double-buffered across the steps and n-tiles. A is in buffer `a_buf`;
    `prefetched`: it and the first B panel were loaded by the m-tile before; `ahead`: the next m-tile's A
    and B, whose A (into the other buffer) and first panel this one loads behind its last MXU command. A
    pipelined start of one n-tile computes into C tile `c_first` and issues the next m-tile's first load
    groups instead, leaving its C store to the next one, which issues it after its first command
    (`previous_c`)."""
    b = ctx.b
    a, bm, c = k.a, k.b, k.c
    L = ctx.lanes
    K, Nn = a.shape[-1], bm.shape[-1]
    nch, mt = t.nch, t.mt
    col_elems = L * (bm.strides[-1] if t.trans_b else 1)  # from one n-tile's B to the next

    def cols(nt: int) -> int:
        return min(L, Nn - nt * L)

    def c_addr(elem: int) -> Reg:
        return c_at.addr(ctx, c, elem)

    def load(at: _At, ncols: int, kc: int, p: int) -> None:
        _load_panel(ctx, k, t, a_at, rows, at, ncols, kc, p)

    def step(pc: int, kc: int, wait_store: bool, store_prev: tuple[Reg, int] | None,
             load_next: tuple[_At, int, int] | None, last: bool) -> None:
        """Chunk kc of an n-tile of parity pc: split the panel, the first MXU commands, the previous tile's
        C store and the next step's loads (both overlap the MXU), the other commands; the m-tile's `last`
        step issues its last command by `pieces` of rows, for the pieces' stores to overlap it, and so does
        every n-tile of one command (`by_pieces`): its last piece after the previous tile's stores, so that a
        wait on that piece's flag (OUT) is not also a wait on this tile's."""
        p = t.parity(pc, kc)
        b.emit("wait", flag=ctx.flag(Flag.LOAD, p))
        kts = t.tiles(kc)
        weights = t.b_sets[p]
        a_parts, a_tile0 = (t.a_sets[p], 0) if t.a_chunked else (t.a_sets[a_buf], kc * t.KC)
        if len(weights) > 1:
            _split(ctx, weights, kts * L, t.hi_full)
            if t.a_chunked:
                _split(ctx, a_parts, kts * mt, t.hi_full)
        commands = [(qa, qb, a_tile0 + j, j) for qa, qb in t.passes for j in range(kts)]  # by_pieces: one, kc 0
        # the commands issued before the previous tile's store, which waits for that tile's drain (2N
        # cycles): enough rows to keep the MXU streaming meanwhile (short m-tiles take several), where
        # the MXU binds (a command's rows outlast its weight tile's DMA): where HBM binds, the next
        # panel's loads, issued after them, must not wait
        ends_by_pieces = last and bool(pieces) and len(commands) > 1
        lead = max(1, min(len(commands) - ends_by_pieces, 1 + 2 * L // rows if _mxu_bound(ctx, rows, bm) else 1,
                          ctx.config.mxu_queue))
        _mxu(ctx, t, a_parts, weights, t.c_tiles[pc], commands[:lead], rows, first=True, overwrite=kc == 0, parity=p,
             pieces=pieces[:1] if by_pieces else pieces if last and len(commands) == 1 else None,
             wait_before_mm=ctx.flag(Flag.STORE, pc) if kc == 0 and wait_store else None)
        # the next step's loads go first: behind the previous C tile's store in the channel, a load would
        # wait out the store's transfer and then its own latency while the MXU idles
        stream: _TileStream | None = None
        if load_next is not None:
            # buffers 1 - p were read by the previous step: its weight loads (and its mms, for A) are done
            b.emit("wait", flag=ctx.flag(Flag.WEIGHTS, 1 - p))
            if t.a_chunked:
                b.emit("wait", flag=ctx.flag(Flag.MXU, 1 - p))
            if t.trans_b and not t.a_chunked:  # W's k-tiles issued along the MXU commands
                at, ncols, kc_next = load_next
                k0 = kc_next * t.KC * L
                stream = _TileStream(ctx, bm, at.addr(ctx, bm, k0), t.b_sets[1 - p][0], L, t.tiles(kc_next), ncols,
                                     min(t.KC * L, K - k0), Flag.LOAD, 1 - p)
                if len(commands) == lead:  # no later command to pace the loads along
                    stream.rest()
                    stream = None
                elif stream.remaining():
                    stream.one()
                    stream.issued += 1
            else:
                load(*load_next, 1 - p)
        if store_prev is not None:
            _store_c(ctx, t, t.c_tiles[1 - pc], store_prev[0], rows, store_prev[1], c, 1 - pc,
                     pieces if by_pieces else None)
        if by_pieces:  # the last piece, with the weights the first swapped in
            (qa, _, ka, _), (lo, hi) = commands[0], pieces[-1]
            _mm_rows(ctx, a_parts[qa], ka * t.mt, t.c_tiles[pc], lo, hi, "mxu.mm", _piece_flag(ctx, p, 1))
        rest = commands[lead:-1] if ends_by_pieces else commands[lead:]
        _mxu(ctx, t, a_parts, weights, t.c_tiles[pc], rest, rows, first=False, overwrite=False, parity=p,
             stream=stream)
        if ends_by_pieces:
            _mxu(ctx, t, a_parts, weights, t.c_tiles[pc], commands[-1:], rows, first=False, overwrite=False,
                 parity=p, stream=stream, pieces=pieces)
        if stream is not None:
            stream.rest()

    def n_tile(pc: int, wait_store: bool, store_prev: tuple[Reg, int] | None, cur: tuple[_At, int],
               nxt: tuple[_At, int] | None, last: bool = False) -> None:
        for kc in range(nch):
            following = (*cur, kc + 1) if kc + 1 < nch else (*nxt, 0) if nxt is not None else None
            step(pc, kc, wait_store, store_prev if kc == 0 else None, following, last and kc == nch - 1)

    def b_col(nt: int) -> tuple[_At, int]:
        return b_at.plus(nt * col_elems), cols(nt)

    def static_tile(nt: int) -> None:  # a prefetched m-tile's first two C tiles wait for their last stores:
        # its loads went ahead of those in the DMA channel, which no longer orders them
        n_tile(nt % 2, nt >= 2 or prefetched, (c_addr((nt - 1) * L), cols(nt - 1)) if nt >= 1 else None, b_col(nt),
               b_col(nt + 1) if nt + 1 < t.NT else None, last=nt == t.NT - 1)

    group = _head_group(t, rows, L)
    head = min(t.NT, 2) if group else 0  # n-tiles the pipelined start computes
    start_ahead = group and ahead is not None  # the next m-tile's first load groups: `_pipelined_start`
    assert not (c_first or previous_c) or (group and t.NT == 1)
    pieces = _row_pieces(rows) if t.NT > head and t.rows_reg is None else []  # the last n-tile is a static one
    # n-tiles of one MXU command each: every one by pieces, its C tile stored by pieces too, each piece's
    # store as soon as its rows are done (a whole tile's store, issued after the tile's drain, took its
    # transfer and the DMA latency: more than the other C tile's stream, which the MXU then waited out)
    by_pieces = bool(pieces) and not head and t.nch == 1 and len(t.passes) * t.KT == 1
    if group:
        def previous_store() -> None:  # the m-tile before's: one n-tile, its C a batch before this one's
            _store_c(ctx, t, t.c_tiles[1 - c_first], c_at.addr(ctx, c, -c.strides[0]), rows, cols(0), c,
                     1 - c_first, done_on=ctx.flag(Flag.OUT))

        _pipelined_start(ctx, k, t, rows, a_at, [b_col(nt) for nt in range(head)],
                         b_col(head) if head < t.NT else None, (c_addr(0), cols(0)), c_first, prefetched,
                         ahead if start_ahead else None, previous_store if previous_c else None)
    elif not prefetched:
        load(*b_col(0), 0, 0)
    if not t.a_chunked and not group:
        if not prefetched:
            _dma_tiles(ctx, a, a_at.addr(ctx, a, 0), t.a_sets[a_buf][0], mt, t.KT, rows, K, Flag.MATMUL_A, a_buf,
                       t.rows_reg)
        b.emit("wait", flag=ctx.flag(Flag.MATMUL_A, a_buf))
        if len(t.a_sets[0]) > 1:
            _split(ctx, t.a_sets[0], t.KT * mt, t.hi_full)
    # tiles 2 .. 2 * pairs + 1 run as a loop over pairs (buffers and flags alternate with constant names;
    # the B and C addresses are pointer registers): their neighbours' loads and stores are full tiles
    NT = t.NT
    pairs = max(0, (NT - 4) // 2) if NT - 4 >= 2 * MIN_N_TILE_PAIRS else 0
    for nt in range(head, min(NT, 2)):
        static_tile(nt)
    if pairs:
        b_ptr, c_ptr = b.sreg(), b.sreg()
        b.emit("addi", b_ptr, (b_at.addr(ctx, bm, 2 * col_elems),), imm=0)
        b.emit("addi", c_ptr, (c_addr(L),), imm=0)

        def pair() -> None:
            for p in (0, 1):
                n_tile(p, True, (c_ptr, L), (_At(b_ptr, 0), L), (_At(b_ptr, col_elems), L))
                b.addi(b_ptr, col_elems * _esize(bm), b_ptr)
                b.addi(c_ptr, L * _esize(c), c_ptr)

        b.counted_loop(pairs, pair, "ntile")
    for nt in range(2 + 2 * pairs, NT):
        static_tile(nt)
    if ahead is not None and not start_ahead:  # every command is issued: the next m-tile's A, and its first
        # panel once the weight loads that read that panel's buffer are done
        _dma_tiles(ctx, a, ahead[0].addr(ctx, a, 0), t.a_sets[1 - a_buf][0], mt, t.KT, rows, K, Flag.MATMUL_A,
                   1 - a_buf)
        b.emit("wait", flag=ctx.flag(Flag.WEIGHTS, 0))
        load(ahead[1], cols(0), 0, 0)
    last = (NT - 1 + c_first) % 2
    if not start_ahead:  # else the next m-tile stores C (`previous_c`)
        _store_c(ctx, t, t.c_tiles[last], c_addr((NT - 1) * L), rows, cols(NT - 1), c, last, pieces)


def _load_panel(ctx: KernelContext, k: MatmulKernel, t: _Tiling, a_at: _At, rows: int, at: _At, ncols: int, kc: int,
                p: int) -> None:
    """DMA chunk kc of the n-tile whose B starts at `at` (and A's chunk kc when A is chunked) into
    buffers p. Transposed B: one DMA per k-tile, W's rows n0 .. n0 + ncols as they are (mxu.lwt reads
    vmem row n as weight column n), lanes past K zero-filled."""
    a, bm = k.a, k.b
    L, K, nch, mt = ctx.lanes, k.a.shape[-1], t.nch, t.mt
    k0 = kc * t.KC * L
    kk = min(t.KC * L, K - k0)
    raw = t.b_sets[p][0]
    if t.a_chunked:
        _dma_tiles(ctx, a, a_at.addr(ctx, a, k0), t.a_sets[p][0], mt, t.tiles(kc), rows, kk, Flag.LOAD, p,
                   t.rows_reg)
    if t.trans_b:
        _dma_tiles(ctx, bm, at.addr(ctx, bm, k0), raw, L, t.tiles(kc), ncols, kk, Flag.LOAD, p)
        return
    if kk % L and nch > 1:  # rows past K in the last chunk's panel (other chunks wrote them)
        _zero_rows(ctx, [raw], kk // 8 * 8, t.tiles(kc) * L)
    ctx.dma(True, bm.dtype, at.addr(ctx, bm, k0 * bm.strides[-2]), raw, 0, kk, ncols, bm.strides[-2],
            Flag.LOAD, p)


def _head_group(t: _Tiling, rows: int, L: int) -> int:
    """k-tiles per load group of a pipelined first n-tile (0: not pipelined). The first n-tile needs all
    of A's m-tile and B's first panel: loaded in groups of k-tiles (a group at least a DMA latency's rows,
    so that two groups in flight keep the channel busy), its MXU commands start as the first group lands
    instead of after all of them. bf16 (one part: no split) with A whole and one k-chunk, k loops that
    are short enough to unroll by group."""
    if len(t.a_sets[0]) > 1 or t.a_chunked or t.nch > 1 or t.KT > HEAD_MAX_K_TILES or \
            (t.rows_reg is not None and rows < HEAD_MIN_RUNTIME_ROWS):
        return 0
    return 1 if t.KT * (L + rows) >= 3 * HEAD_GROUP_ROWS else 0


@dataclass(frozen=True)
class _HeadLoads:
    """A pipelined start's commands (n-tile, k-tile) in order and its loads (n-tile, or A_ROWS / A_REST for
    A; k-tile) in groups; A's k-tile 0 rows 0 .. a_head come first (`_first_rows`). Two n-tiles run k-tiles
    0 .. h for both first."""

    h: int
    order: list[tuple[int, int]]
    groups: list[list[tuple[int, int]]]
    group_of: dict[tuple[int, int], int]
    a_head: int

    def needs(self, n: int, kt: int) -> int:
        """The last group command (n, kt) reads."""
        return max(self.group_of[(n, kt)], self.group_of[(A_ROWS, kt)], self.group_of.get((A_REST, kt), -1))


def _head_loads(ctx: KernelContext, t: _Tiling, rows: int, n_tiles: int, a: View) -> _HeadLoads:
    L, K, KT = ctx.lanes, a.shape[-1], t.KT
    h = KT // 2 if n_tiles == 2 else KT
    order = [(n, kt) for kt in range(h) for n in range(n_tiles)] + [(0, kt) for kt in range(h, KT)]
    if n_tiles == 2:
        order += [(1, kt) for kt in range(h, KT)]
    # loads in the order the commands need them, grouped at command boundaries: the first group is the
    # first command's, so that the MXU starts as early as it can; a long A k-tile 0 comes in two parts, the
    # first command in two (`_first_rows`) (rows at run time: A's k-tiles whole, each DMA moving the
    # m-tile's valid rows)
    a_head = rows if t.rows_reg is not None else _first_rows(ctx, rows, min(L, K) * _esize(a))
    groups: list[list[tuple[int, int]]] = [[]]
    group_of: dict[tuple[int, int], int] = {}
    size = 0
    for i, (n, kt) in enumerate(order):
        for item in ((n, kt), (A_ROWS, kt)):  # the small weight tile first: its mxu.lw runs during A's DMA
            if item not in group_of:
                group_of[item] = len(groups) - 1
                groups[-1].append(item)
                size += L if item[0] >= 0 else a_head if kt == 0 else rows
        if i == 0 and a_head < rows:
            group_of[(A_REST, 0)] = len(groups)
            groups.append([(A_REST, 0)])
        if (i == 0 or size >= HEAD_GROUP_ROWS) and i + 1 < len(order):
            groups.append([])
            size = 0
    return _HeadLoads(h, order, groups, group_of, a_head)


def _starts_ahead(ctx: KernelContext, t: _Tiling, rows: int, a: View) -> bool:
    """Whether the next m-tile's pipelined start (one n-tile; `_head_group`) can issue its first two load
    groups while this one's last command runs: that reads A's last k-tile (the loads must not overwrite it)."""
    if t.NT != 1 or t.KT < 2:
        return False
    head = _head_loads(ctx, t, rows, 1, a)
    return all(kt != t.KT - 1 for g in head.groups[:2] for n, kt in g if n < 0)


def _pipelined_start(ctx: KernelContext, k: MatmulKernel, t: _Tiling, rows: int, a_at: _At,
                     tiles: list[tuple[_At, int]], nxt: tuple[_At, int] | None, c0: tuple[Reg, int],
                     c_first: int = 0, prefetched: bool = False, ahead: tuple[_At, _At] | None = None,
                     after_first: Callable[[], None] | None = None) -> None:
    """The first one or two n-tiles of an m-tile, their loads pipelined with the MXU: n-tile 0 alone needs
    all of A's m-tile and a B panel, more DMA rows than MXU rows. So with two n-tiles (C tiles 0 and 1
    from panels 0 and 1) the MXU first runs k-tiles 0 .. h for both (two MXU rows per A row loaded), then
    h .. KT for C tile 0, whose store and the load of panel 2 (two of its k-tiles a command, transposed B)
    then overlap h .. KT for C tile 1. Loads are
    issued in the order the commands need them, in groups of at least HEAD_GROUP_ROWS DMA rows on
    MATMUL_A (group parity), groups g + 1 and g + 2 in flight while the MXU works on group g's.
    One n-tile (`_starts_ahead`), into C tile c_first: `prefetched`, the m-tile before issued groups 0 and 1;
    `ahead` (the next m-tile's A and B), this one issues them once every command but its last (on OUT) is
    done: P @ V at 1,536 keys waited ~960 cycles a batch for its first group's DMA latency. `after_first`
    runs once the first command is issued (the m-tile before's C store: its wait for that m-tile's last
    command there would keep the MXU idle through this one's first weight load)."""
    b, L = ctx.b, ctx.lanes
    a, bm, c = k.a, k.b, k.c
    K, KT = a.shape[-1], t.KT
    two = len(tiles) == 2
    assert not (two and (c_first or prefetched or ahead))
    head = _head_loads(ctx, t, rows, len(tiles), a)
    h, order, groups, group_of, a_head, needs = head.h, head.order, head.groups, head.group_of, head.a_head, head.needs

    def issue(g: int, a_from: _At = a_at, b_tiles: list[tuple[_At, int]] = tiles) -> None:
        for n, kt in groups[g]:
            kk = min(L, K - kt * L)
            if n < 0:
                r0, nrows = (a_head, rows - a_head) if n == A_REST else (0, a_head if kt == 0 else rows)
                ctx.dma(True, a.dtype, a_from.addr(ctx, a, kt * L + r0 * a.strides[-2]), t.a_sets[0][0],
                        kt * t.mt + r0, nrows, kk, a.strides[-2], Flag.MATMUL_A, g % 2, rows_reg=t.rows_reg)
                continue
            at, ncols = b_tiles[n]
            raw = t.b_sets[n][0]
            if t.trans_b:
                ctx.dma(True, bm.dtype, at.addr(ctx, bm, kt * L), raw, kt * L, ncols, kk, bm.strides[-1],
                        Flag.MATMUL_A, g % 2)
            else:
                ctx.dma(True, bm.dtype, at.addr(ctx, bm, kt * L * bm.strides[-2]), raw, kt * L, kk, ncols,
                        bm.strides[-2], Flag.MATMUL_A, g % 2)

    issued = min(2, len(groups))
    for g in range(0 if prefetched else issued):
        issue(g)
    waited = -1
    pending: list[tuple[_At, int, int]] = []  # (B at, columns, k-tile) of the next panel still to load

    def wait_for(g: int) -> None:
        nonlocal waited, issued
        while waited < g:
            waited += 1
            b.emit("wait", flag=ctx.flag(Flag.MATMUL_A, waited % 2))
            if issued < len(groups) and issued == waited + 2:
                issue(issued)
                issued += 1

    def pc(n: int) -> int:  # the C tile (and MXU flags) of n-tile n
        return (n + c_first) % 2

    for i, (n, kt) in enumerate(order):
        tail = two and i == len(order) - (KT - h)  # the first command of C tile 1's k-tiles h .. KT
        if tail or (not two and issued == len(groups) and nxt is not None and i == len(order) - 1):
            for g in range(issued, len(groups)):  # the last groups, then the next panel behind them
                issue(g)
            issued = len(groups)
            if nxt is not None:
                b.emit("wait", flag=ctx.flag(Flag.WEIGHTS, 0 if two else 1))
                if two and t.trans_b and _mxu_bound(ctx, rows, bm):  # two DMAs a command of C tile 1's: all
                    # at once, the instruction stream waited on the DMA queue while the MXU ran out of commands
                    pending = [(*nxt, j) for j in range(KT)]
                else:
                    _load_panel(ctx, k, t, a_at, rows, *nxt, 0, 0 if two else 1)
                nxt = None
        # a prefetched start's loads went ahead of the C store before it in the DMA channel
        store_done = ctx.flag(Flag.STORE, pc(n)) if prefetched and i == 0 else None
        if i == 0 and a_head < rows:  # rows 0 .. a_head as their A lands, then the rest with the same weights
            wait_for(max(group_of[(n, kt)], group_of[(A_ROWS, kt)]))
            _mxu(ctx, t, t.a_sets[0], t.b_sets[n], t.c_tiles[pc(n)], [(0, 0, kt, kt)], a_head, first=True,
                 overwrite=True, parity=pc(n), wait_before_mm=store_done)
            wait_for(group_of[(A_REST, kt)])
            _mm_rows(ctx, t.a_sets[0][0], kt * t.mt, t.c_tiles[pc(n)], a_head, rows, "mxu.mm",
                     ctx.flag(Flag.MXU, pc(n)))
            if after_first is not None:
                after_first()
            continue
        wait_for(needs(n, kt))
        last = ahead is not None and i == len(order) - 1
        _mxu(ctx, t, t.a_sets[0], t.b_sets[n], t.c_tiles[pc(n)], [(0, 0, kt, kt)], rows, first=True,
             overwrite=kt == 0, parity=pc(n), wait_before_mm=store_done,
             done_on=ctx.flag(Flag.OUT) if last else None)
        if i == 0 and after_first is not None:
            after_first()
        if last:  # every command but the last done: the next m-tile's first groups
            assert ahead is not None
            b.emit("wait", flag=ctx.flag(Flag.MXU, pc(n)))
            for g in range(min(2, len(groups))):
                issue(g, ahead[0], [(ahead[1], tiles[0][1])])
        for at, ncols, j in pending[:2]:  # W's rows as they are (`_load_panel`); straight-line code: no
            # pointer register advances across the commands (a register defined once can be spilled)
            ctx.dma(True, bm.dtype, at.addr(ctx, bm, j * L), t.b_sets[0][0], j * L, ncols, min(L, K - j * L),
                    bm.strides[-1], Flag.LOAD, 0)
        del pending[:2]
        if tail:  # C tile 0 is complete: its store overlaps C tile 1's last k-tiles
            _store_c(ctx, t, t.c_tiles[0], c0[0], rows, c0[1], c, 0)
    assert not pending, pending  # C tile 1 has KT - KT // 2 commands after the tail: two DMAs each suffice
    if not two and nxt is not None:
        b.emit("wait", flag=ctx.flag(Flag.WEIGHTS, 1))
        _load_panel(ctx, k, t, a_at, rows, *nxt, 0, 1)


class _TileStream:
    """DMAs of `count` k-tiles of an operand contiguous along K (A, or B = W.T), issued a few at a time
    (`one`, e.g. one per MXU command: both FIFOs are shallow, so issuing a panel's k-tiles at once would
    stall the MXU's issue behind the DMA queue) and the rest at the end (`rest`). Tile j is `rows` rows (HBM
    row stride v.strides[-2], or W's row stride for B) of the j-th N lanes of the kk columns from `hbm`,
    at region row j * row_step, lanes past kk zero-filled (the last tile, when kk % N, by `rest`)."""

    def __init__(self, ctx: KernelContext, v: View, hbm: Reg, region: Region, row_step: int, count: int,
                 rows: int, kk: int, flag: Flag, p: int, rows_reg: Reg | None = None) -> None:
        b, L = ctx.b, ctx.lanes
        self.ctx, self.v, self.hbm, self.region, self.row_step = ctx, v, hbm, region, row_step
        self.count, self.rows, self.kk, self.flag, self.p = count, rows, kk, flag, p
        self.rows_reg = rows_reg  # the rows at run time (at most `rows`)
        self.shape = ctx.dma_shape(rows_reg, L) if rows_reg is not None else None
        self.stride = v.strides[-2] if v.strides[-1] == 1 else v.strides[-1]
        self.full = kk // L if kk % L else count  # tiles of N columns, issued from pointer registers
        self.issued = 0
        self.h, self.row = b.sreg(), b.sreg()
        b.emit("addi", self.h, (hbm,), imm=0)
        b.emit("li", self.row, imm=region.row)

    def remaining(self) -> int:
        return self.full - self.issued

    def one(self) -> None:
        """Issue the next full tile (in a loop body too: it advances the pointer registers)."""
        b, L = self.ctx.b, self.ctx.lanes
        op = "dma.ld" + (".bf16" if self.v.dtype == "bf16" else "")
        shape = self.shape or b.const(self.rows << DMA_SHAPE_ROWS_SHIFT | L)
        b.emit(op, None, (self.h, self.row, shape, b.const(self.stride)), flag=self.ctx.flag(self.flag, self.p),
               mem=(self.region.mem(write=True),))
        b.addi(self.h, L * _esize(self.v), self.h)
        b.emit("addi", self.row, (self.row,), imm=self.row_step)

    def rest(self) -> None:
        n = self.remaining()
        if n > UNROLL_K_TILES:
            self.ctx.b.counted_loop(n, self.one, "dmatile")
        else:
            for _ in range(n):
                self.one()
        self.issued = self.full
        L = self.ctx.lanes
        for j in range(self.full, self.count):
            self.ctx.dma(True, self.v.dtype, self.ctx.b.offset_reg(self.hbm, j * L * _esize(self.v)), self.region,
                         j * self.row_step, self.rows, min(L, self.kk - j * L), self.stride, self.flag, self.p,
                         rows_reg=self.rows_reg)


def _dma_tiles(ctx: KernelContext, v: View, hbm: Reg, region: Region, row_step: int, count: int, rows: int,
               kk: int, flag: Flag, p: int, rows_reg: Reg | None = None) -> None:
    """All of a `_TileStream` at once."""
    _TileStream(ctx, v, hbm, region, row_step, count, rows, kk, flag, p, rows_reg).rest()


def _store_c(ctx: KernelContext, t: _Tiling, tile: Region, addr: Reg, rows: int, cols: int, c: View,
             pc: int, pieces: list[tuple[int, int]] | None = None, done_on: int | None = None) -> None:
    """Store C tile pc once the MXU commands of its n-tile's last step are done (they run in order); by
    `pieces` of rows (`_row_pieces`), each once its own command is done (`_piece_flag`); `done_on`: the
    flag its last command completes on, if another."""
    p = t.parity(pc, t.nch - 1)
    for j, (lo, hi) in enumerate(pieces or [(0, rows)]):
        ctx.b.emit("wait", flag=_piece_flag(ctx, p, j) if done_on is None else done_on)
        ctx.dma(False, c.dtype, ctx.b.offset_reg(addr, lo * c.strides[-2] * _esize(c)), tile, lo, hi - lo, cols,
                c.strides[-2], Flag.STORE, pc, rows_reg=None if pieces else t.rows_reg)


def _layout(precision: str, M: int, KT: int, L: int, free: int, runtime_rows: bool = False,
            ) -> tuple[list[str], int, int, bool] | None:
    """(part names, m-tile rows, k-tiles per chunk, A chunked): the part regions of each operand in order
    (the first is the raw values' region, rewritten in place), with a separate finite-only hi next to
    hi_full when that costs no m-tile rows (module docstring), else hi in place carrying nothing
    non-finite. K is chunked only when a whole B panel does not fit, A only when its m-tile of 8 rows
    over all of K does not either. The m-tile divides M where a divisor is at least half of what fits, so
    that no tail m-tile needs its own code, except with `runtime_rows` (the m-tile loop takes a runtime
    count of rows, and each m-tile loads all of B: at 129 valid rows of a 256-row bucket, m-tiles of 128 loaded
    a down_proj's weights twice, 181,480 cycles against 138,026 in the static program). None: nothing fits
    (not even one k-tile)."""
    def rows_for(parts: int, KC: int, a_chunked: bool) -> int | None:
        b_rows = 2 * parts * (KC * L + 8)
        a_tiles = parts * (2 if a_chunked else 1) * (KC if a_chunked else KT)
        a_regions = parts * (2 if a_chunked else 1)
        budget = free - b_rows - 8 * a_regions - 32
        mt = min(-(-M // 8) * 8, max(8, (budget // (a_tiles + 2)) // 8 * 8), MAX_M_TILE)
        divisors = [] if runtime_rows else [d for d in range(8, mt + 1, 8) if M % d == 0 and 2 * d >= mt]
        mt = divisors[-1] if divisors else mt  # no tail m-tile: less code
        return mt if a_tiles * mt + 2 * mt + b_rows + 8 * a_regions + 32 <= free else None

    names = ["hi_full", *RESIDUALS[precision]]
    for a_chunked in (False, True):
        for KC in range(KT, 0, -1):
            if KC < KT and -(-KT // KC) == -(-KT // (KC + 1)):
                continue  # as many chunks as KC + 1 gives: take the larger
            mt = rows_for(len(names), KC, a_chunked)
            if mt is None:
                continue
            if len(names) > 1 and rows_for(len(names) + 1, KC, a_chunked) == mt:
                return [*names, "hi"], mt, KC, a_chunked
            return names, mt, KC, a_chunked
    return None


def _passes(precision: str, names: list[str], hi_full: bool, a_bf16: bool, b_bf16: bool) -> list[tuple[int, int]]:
    """The MXU passes, (A part, B part) indices into `names` (no separate hi: the in-place part is hi, and
    hi_full is hi). An operand loaded from bf16 is its own hi: its residual parts are exact zeros, so the
    passes that read them add +0 and are dropped (an fp32 x bf16 matmul at "highest" takes 3 or 4 passes,
    not 6), except the one through the residual that carries its non-finite values when there is no
    hi_full (`_split`)."""
    index = {name: i for i, name in enumerate(names)}
    index.setdefault("hi", 0)
    residuals = RESIDUALS[precision]
    zero = set(residuals if hi_full else residuals[:-1])
    return [(index[pa], index[pb]) for pa, pb in PASSES[precision]
            if not (a_bf16 and pa in zero) and not (b_bf16 and pb in zero)]


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


def _first_rows(ctx: KernelContext, rows: int, row_bytes: int) -> int:
    """Rows of A's first k-tile in a pipelined start's first load group: all of a short m-tile; of a long
    one the fewest h whose MXU rows (a cycle each) last as long as the DMA of the other rows - h (x cycles
    each): h >= rows * x / (1 + x). The MXU starts on them while the rest is in flight."""
    x = row_bytes / ctx.config.hbm_bytes_per_cycle
    h = -(-int(rows * x / (1 + x)) // 8) * 8
    return h if rows >= SPLIT_MIN_ROWS and h < rows else rows


def _row_pieces(rows: int) -> list[tuple[int, int]]:
    """The row ranges of an m-tile's last MXU command and C store (none: one command, one store): all but
    the last quarter, whose store overlaps the last quarter's MXU rows, then that quarter. Two pieces, on
    flags of their own (`_piece_flag`: a wait on a flag waits for every command counted on it)."""
    if rows < SPLIT_MIN_ROWS:
        return []
    q = rows // 32 * 8
    return [(0, rows - q), (rows - q, rows)]


def _piece_flag(ctx: KernelContext, parity: int, j: int) -> int:
    """The flag piece j of a C tile's last command completes on: the first on its step's MXU flag, the last
    on OUT, which matmuls use for nothing else, so the next n-tile's commands (on the other MXU flag) can
    be issued before the wait for this tile's last piece."""
    return ctx.flag(Flag.MXU, parity) if j == 0 else ctx.flag(Flag.OUT)


def _mm_rows(ctx: KernelContext, a: Region, a_row: int, c_tile: Region, lo: int, hi: int, op: str, flag: int,
             count: Reg | None = None) -> None:
    """One MXU command over rows lo .. hi of an m-tile (A's k-tile at region row a_row, C's tile); `count`: a
    register holding the rows it runs at run time (at most hi - lo)."""
    b = ctx.b
    b.emit(op, None, (b.const(a.row + a_row + lo), b.const(c_tile.row + lo), count or b.const(hi - lo)), flag=flag,
           mem=(a.mem(a_row + lo, a_row + hi), c_tile.mem(lo, hi, True)))


def _mxu_by_row(ctx: KernelContext, a: Region, panels: list[Region], c: Region, M: int, KT: int, trans_b: bool,
                parity: int, second_half: tuple[int, tuple[Flag, int]] | None = None) -> None:
    """C[m, nt] = sum over k-tiles kt of A[m, kt] @ W[kt, nt], A and C row-major (A row m's k-tile kt at region
    row m * KT + kt, C's n-tile nt at m * NT + nt; panel nt holds W's k-tiles): per weight tile a load and M
    one-row commands, the first swapping the weights in (overwriting C at kt 0, then accumulating). The next
    tile's weights load right after that swap, so the weight port does not wait for the other rows'
    commands. Each row in k-tile order: the bits of the tile-wise commands. `second_half`: the weight tiles from
    this one on (in that order) land on that flag, waited for before the first of them loads."""
    b, L, NT = ctx.b, ctx.lanes, len(panels)
    fw, f = ctx.flag(Flag.WEIGHTS, parity), ctx.flag(Flag.MXU, parity)
    tiles = [(nt, kt) for nt in range(NT) for kt in range(KT)]

    def lw(nt: int, kt: int) -> None:
        b.emit("mxu.lwt" if trans_b else "mxu.lw", None, (b.const(panels[nt].row + kt * L),), flag=fw,
               mem=(panels[nt].mem(kt * L, kt * L + L),))

    lw(*tiles[0])
    for j, (nt, kt) in enumerate(tiles):
        for m in range(M):
            op = ("mxu.mms" if m == 0 else "mxu.mm") if kt == 0 else ("mxu.mmas" if m == 0 else "mxu.mma")
            ra, rc = m * KT + kt, m * NT + nt
            b.emit(op, None, (b.const(a.row + ra), b.const(c.row + rc), b.const(1)), flag=f,
                   mem=(a.mem(ra, ra + 1), c.mem(rc, rc + 1, True)))
            if m == 0 and j + 1 < len(tiles):
                if second_half is not None and j + 1 == second_half[0]:
                    b.emit("wait", flag=ctx.flag(*second_half[1]))
                lw(*tiles[j + 1])


def _chunks(ctx: KernelContext, chunks: int, chunk: Callable[..., None], hint: str) -> None:
    """chunk(off, r) over `chunks` chunks of 8 vmem rows: unrolled (constant addresses) up to
    UNROLL_SPLIT_CHUNKS, else a chunk loop (code size independent of the row count)."""
    if chunks <= UNROLL_SPLIT_CHUNKS:
        for c in range(chunks):
            chunk(ZERO, 8 * c)
    else:
        chunk_loop(ctx.b, chunks, chunk, hint)


def _mxu(ctx: KernelContext, t: _Tiling, a_parts: list[Region], weights: list[Region], c_tile: Region,
         commands: list[tuple[int, int, int, int]], rows: int, first: bool, overwrite: bool, parity: int,
         stream: _TileStream | None = None, pieces: list[tuple[int, int]] | None = None,
         segments: tuple[int, Reg] | None = None, wait_before_mm: int | None = None,
         done_on: int | None = None) -> None:
    """Issue lw(t) + mm(a)s for each (part of A, part of B, A's k-tile, the panel's k-tile); the first
    mm of an n-tile overwrites C (`overwrite`), the others accumulate. Runs of one pass longer than
    UNROLL_K_TILES become a counted loop with pointer registers. Weight loads complete on WEIGHTS
    (their panel is then free), mms on MXU, both of the step's parity. `stream`: one of its DMAs is
    issued with each command while it has any. `pieces` (one command): its mm by those row ranges, the
    same weights, piece j completing on `_piece_flag`. `segments` (rows a segment, a register
    of valid rows): each mm by segment, over the valid rows at its start, the same weights. `wait_before_mm`:
    a flag the first mm waits on (C's tile still being stored) and its weight load does not, so the load
    runs under the MXU's current stream. `done_on`: the flag the mms complete on, if not MXU's."""
    b = ctx.b
    f, fw = ctx.flag(Flag.MXU, parity) if done_on is None else done_on, ctx.flag(Flag.WEIGHTS, parity)
    lw = "mxu.lwt" if t.trans_b else "mxu.lw"
    mt, L = t.mt, ctx.lanes
    n_rows = t.rows_reg or b.const(rows)
    c_row = b.const(c_tile.row)
    i = 0
    while i < len(commands):
        qa, qb, ka, kb = commands[i]
        run = [cmd for cmd in commands[i:] if cmd[:2] == (qa, qb)]
        if len(run) > UNROLL_K_TILES and not first and not pieces and not segments:
            w_ptr, a_ptr = b.sreg(), b.sreg()
            b.emit("li", w_ptr, imm=weights[qb].row + kb * L)
            b.emit("li", a_ptr, imm=a_parts[qa].row + ka * mt)

            def body(w_ptr: Reg = w_ptr, a_ptr: Reg = a_ptr, qa: int = qa, qb: int = qb, dmas: int = 0) -> None:
                b.emit(lw, None, (w_ptr,), flag=fw, mem=(weights[qb].mem(),))
                b.emit("mxu.mmas", None, (a_ptr, b.const(c_tile.row), t.rows_reg or b.const(rows)), flag=f,
                       mem=(a_parts[qa].mem(), c_tile.mem(0, rows, True)))
                b.emit("addi", w_ptr, (w_ptr,), imm=L)
                b.emit("addi", a_ptr, (a_ptr,), imm=mt)
                for _ in range(dmas):
                    stream.one()  # type: ignore[union-attr]

            # where the MXU binds, the stream's DMAs two a command while it has them, so the next panel
            # lands well before this step ends: paced one a command, its last DMA's latency ran past the
            # step's last command and the MXU waited for it
            done = 0
            for dmas in (2, 1) if stream is not None and _mxu_bound(ctx, rows, stream.v) else (1,):
                runs = min(len(run) - done, stream.remaining() // dmas) if stream is not None else 0
                if runs:
                    b.counted_loop(runs, lambda body=body, dmas=dmas: body(dmas=dmas), "ktile")
                    stream.issued += runs * dmas  # type: ignore[union-attr]
                    done += runs
            if len(run) > done:
                b.counted_loop(len(run) - done, body, "ktile")
            n_rows, c_row = t.rows_reg or b.const(rows), b.const(c_tile.row)
            i += len(run)
            continue
        w_row = weights[qb].row + kb * L
        b.emit(lw, None, (b.const(w_row),), flag=fw, mem=(weights[qb].mem(kb * L, kb * L + L),))
        if wait_before_mm is not None and i == 0:
            b.emit("wait", flag=wait_before_mm)
        op = "mxu.mms" if overwrite and i == 0 else "mxu.mmas"
        if pieces:
            assert len(commands) == 1
            unswapped = op[:-1]  # mxu.mms -> mxu.mm, mxu.mmas -> mxu.mma
            for j, (lo, hi) in enumerate(pieces):  # the first swaps the weights in, the others reuse them
                _mm_rows(ctx, a_parts[qa], ka * mt, c_tile, lo, hi, op if j == 0 else unswapped,
                         _piece_flag(ctx, parity, j))
        elif segments:
            seg, valid = segments
            for lo in range(0, rows, seg):  # the first swaps the weights in, the others reuse them
                _mm_rows(ctx, a_parts[qa], ka * mt, c_tile, lo, lo + seg, op if lo == 0 else op[:-1], f, valid)
        else:
            a_row = a_parts[qa].row + ka * mt
            b.emit(op, None, (b.const(a_row), c_row, n_rows), flag=f,
                   mem=(a_parts[qa].mem(ka * mt, ka * mt + rows), c_tile.mem(0, rows, True)))
        if stream is not None and stream.remaining():
            stream.one()
            stream.issued += 1
        i += 1
