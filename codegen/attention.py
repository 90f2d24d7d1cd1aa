"""`ctpu::attention` as linalg: tiled over keys with an online softmax (flash-style, at the graph level), the
query heads of a kv group folded into the matmul rows (no copy of K or V per query head).

q [B, H, L, D], k [B, KVH, S, D], v [B, KVH, S, Dv], rep = H / KVH (query head h reads kv head h // rep).
q viewed [B*KVH, rep*L, D] (a free reshape) times the tile's K^T [B*KVH, D, Tk] gives the tile's scores
[B*KVH, rep*L, Tk], viewed [B, KVH, rep, L, Tk] for the generics, so a mask [B|1, H|1, L|1, S|1]
broadcasts into them through affine maps. For each tile of Tk keys (the last one partial), in f32:

    y  = scores * scale, with -inf where the boolean mask or the causal keep-mask (j <= i + S - L) drops a
         key, + an additive mask
    m' = max(m, rowmax(y));  c = m' where m' > -inf else 0 (a row with every key so far masked)
    p  = exp(y - c);  l' = exp(m - c) l + rowsum(p);  o' = exp(m - c) o + p @ V_tile  (p in bf16 there
         when q and v are bf16: one MXU pass, not the 3-4 of fp32 x bf16)

and at the end o / l, cast to q's dtype. A row whose keys are all masked has m = -inf, l = 0, o = 0: 0 with
`safe` (torch._safe_softmax), else 0 / 0 = NaN (torch.softmax); NaN or +inf scores make the row NaN, as in
eager (fx_passes/ops.py: attention_ref defines the op). One tile is the degenerate case: no rescaling.

Tk (`key_tile`) bounds what one tile materializes: the scores of a tile are [B, H, L, Tk], never [.., S].
A causal attention's queries run in blocks (`query_blocks`), each the attention above over the keys up to its
last query's, so a prefill never computes the scores above the diagonal's blocks; the blocks' outputs are
concatenated.
"""

from __future__ import annotations

import math
from typing import Any

from codegen.fx_to_mlir import BodyWriter, MlirEmitter, TValue, UnsupportedOp, affine_map
from device_sim.config import HardwareConfig

# the query dim of the row-wise generics below, which run over [B, KVH, rep, L, ...] (`rows5`): a dynamic-shape
# bucket's kernels compute only its valid queries (compiler._query_dim)
QUERY_DIM = 3
# vmem rows per score row of a tile: the tile's generics (a few operands, double-buffered) then fit even
# `small`'s vmem with rows to spare (a row of S keys used to take S / lanes vmem rows per operand); a larger
# vmem takes a 1024th of its rows (`large`: 32, 4096 keys: a decode step at a 4096-token context is one tile,
# 153,236 cycles a 1B layer against 156,732 in two: each tile's three kernels pay their DMA latencies, and
# the rescales cost a kernel)
KEY_TILE_VMEM_ROWS = 16
KEY_TILE_VMEM_SHARE = 1024
# a tile's f32 scores take at most this share of HBM (a long prefill has many query rows): `large`'s 64 MiB,
# so that each query block of a 2048-token prefill at 32 heads (8,192 score rows) is one tile of up to 2048 keys
# (a 1B layer's attention 2,321,426 -> 2,163,043 cycles; at 1/64 the last blocks took a 1536-key tile of 12
# vmem rows a row, whose row passes compute 16, and a second tile with its rescales) ...
SCORE_HBM_SHARE = 48
# ... unless that makes more tiles than this: the tiles are unrolled, a few kernels each (~2k bundles on
# `small`: 16 tiles overflow its imem)
MAX_KEY_TILES = 8
# linalg-fuse-elementwise-ops fuses the running sum and output updates of consecutive tiles into one generic
# (3 operands per tile; at 8 tiles register allocation ran out of spill slots): the running values go
# through a copy it does not fuse through after every FUSED_TILES tiles. The last tiles' updates also fuse
# with the final division into the next matmul's factor (o_proj): 4 tiles there ran out of spill slots too
FUSED_TILES = 2
# a causal attention's queries run in blocks, each over the keys it can see (the keys before its last
# query's): the key tiles past them, a triangle of the scores, are never computed (8 blocks: 56% of the
# scores; a 1B layer's 2048-token prefill 16,420,331 cycles, 17,936,519 in 4 blocks, 30,975,610 in one). A
# block has at least QUERY_BLOCK_ROWS queries, as its kernels pay fixed costs (DMA latencies, the copy of
# its queries)
QUERY_BLOCK_ROWS = 128
MAX_QUERY_BLOCKS = 8
# a causal block of at least this many score rows compares each key with its row's last key (`_last_keys`), so
# that y joins the softmax's tiled chain; a smaller one keeps the query x key iota (no copy kernel for it)
LAST_KEYS_MIN_ROWS = 1024
# ... computed over the block's flat score rows where its query count is a power of two (False: by row, the
# bit reference)
FLAT_LAST_KEYS = True


def key_tile(cfg: HardwareConfig, query_rows: int, keys: int) -> int:
    """Keys per tile, whole vmem rows: KEY_TILE_VMEM_ROWS vmem rows of the configuration (a
    KEY_TILE_VMEM_SHARE of a larger vmem's rows), fewer (at least one vmem row) when `query_rows` (B * H * L)
    rows of f32 scores of that width would take more than 1/SCORE_HBM_SHARE of HBM, more when there would be
    more than MAX_KEY_TILES tiles; all keys when fewer."""
    lanes = cfg.lanes
    by_hbm = cfg.hbm_bytes // SCORE_HBM_SHARE // (4 * max(query_rows, 1)) // lanes * lanes
    by_vmem = lanes * max(KEY_TILE_VMEM_ROWS, cfg.vmem_rows // KEY_TILE_VMEM_SHARE)
    tile = max(lanes, min(by_vmem, by_hbm))
    return min(keys, max(tile, -(-keys // (MAX_KEY_TILES * lanes)) * lanes))


def _mask_5d(e: MlirEmitter, mask: TValue, b: int, hkv: int, rep: int, length: int, keys: int) -> TValue:
    """The mask viewed [B|1, KVH|1, rep|1, L|1, S|1] (a reshape: its head dim is H or 1)."""
    if len(mask.shape) > 4:
        raise UnsupportedOp(f"attention mask {mask.type} of rank > 4")
    mb, mh, ml, ms = (1,) * (4 - len(mask.shape)) + mask.shape
    if mb not in (1, b) or mh not in (1, hkv * rep) or ml not in (1, length) or ms not in (1, keys):
        raise UnsupportedOp(f"attention mask {mask.type} does not broadcast to [{b}, {hkv * rep}, {length}, {keys}]")
    heads = (hkv, rep) if mh != 1 else (1, 1)
    return e.reshape(mask, (mb, *heads, ml, ms))


def _key_slice(e: MlirEmitter, x: TValue, dim: int, start: int, end: int) -> TValue:
    return x if x.shape[dim] == 1 or (start, end) == (0, x.shape[dim]) else e.extract_slice(x, dim, start, end)


def _kv_operand(e: MlirEmitter, t: TValue, start: int, end: int, dtype: str, transpose: bool) -> TValue:
    """Keys [start, end) of k or v [B, KVH, S, D] as a matmul operand [B*KVH, Tk, D] (or [.., D, Tk]) of
    `dtype`: a reshape when nothing changes, else one copy generic (cast, slice, transpose), which fusion
    folds into the matmul."""
    b, h, s, d = t.shape
    tile = _key_slice(e, t, 2, start, end)
    if tile is t and t.dtype == dtype and not transpose:
        return e.reshape(t, (b * h, s, d))
    shape = (b, h, d, end - start) if transpose else (b, h, end - start, d)
    maps = [affine_map(4, ["d0", "d1", "d3", "d2"] if transpose else None), affine_map(4)]
    copy = e.generic([tile], maps, e.empty(shape, dtype), ["parallel"] * 4,
                     lambda a, w: w.cast(a[0], t.dtype, dtype))
    return e.reshape(copy, (b * h, *shape[2:]))


def _finite_base(m: str, w: BodyWriter) -> str:
    """The row max to subtract: 0 where every key so far is masked (m = -inf: -inf - -inf would be NaN)."""
    return w.select(w.cmp("oeq", m, w.const(-math.inf)), w.const(0.0), m)


def query_blocks(length: int, keys: int) -> list[tuple[int, int]]:
    """The query blocks [start, end) of a causal attention: MAX_QUERY_BLOCKS of near-equal size (fewer where
    a block would have under QUERY_BLOCK_ROWS queries); one when the keys before the first query (S - L)
    are as many as the queries, as the blocks would skip little of the keys."""
    n = min(MAX_QUERY_BLOCKS, length // QUERY_BLOCK_ROWS)
    if n < 2 or keys - length >= length:
        return [(0, length)]
    return [(length * i // n, length * (i + 1) // n) for i in range(n)]


def attention(e: MlirEmitter, q: TValue, k: TValue, v: TValue, mask: TValue | None, causal: bool, scale: float,
              safe: bool = True, kv_len: TValue | None = None) -> TValue:
    b, hq, length, d = q.shape
    hkv, keys, dv = k.shape[1], k.shape[2], v.shape[-1]
    if hq % hkv:
        raise UnsupportedOp(f"{hq} query heads over {hkv} kv heads")
    if not keys or not length:
        raise UnsupportedOp(f"attention over {keys} keys and {length} queries")
    rep = hq // hkv
    # Q K^T: bf16 operands go to the MXU as they are (exact products, fp32 accumulation: eager's upcast
    # matmul); otherwise both in f32
    qk_dtype = "bf16" if q.dtype == k.dtype == "bf16" else "f32"
    # P @ V: with bf16 q and v, p = exp(y - c) meets V on the MXU rounded to bf16 (one pass; the row sum l
    # stays fp32): attention_ref's bf16 rule
    pv_dtype = "bf16" if q.dtype == v.dtype == "bf16" else "f32"
    mask5 = _mask_5d(e, mask, b, hkv, rep, length, keys) if mask is not None else None

    def over_keys(first: int, last: int) -> TValue:
        """Queries [first, last) over the keys they can see, [0, key_end), in key tiles: [B, H, n, Dv]."""
        n, key_end = last - first, last + keys - length if causal and kv_len is None else keys
        rows5 = (b, hkv, rep, n)
        qs = q if n == length else e.extract_slice(q, 2, first, last)
        # a block's queries (a strided slice) are copied into the matmul's rows
        qm = e.reshape(qs if qs is q and q.dtype == qk_dtype else
                       e.elementwise([qs], lambda a, w: a[0], dtype=qk_dtype), (b * hkv, rep * n, d))
        block_mask = None if mask5 is None else _key_slice(e, mask5, 3, first, last)
        last_keys = _last_keys(e, rows5, first + keys - length) \
            if causal and kv_len is None and b * hq * n >= LAST_KEYS_MIN_ROWS else None
        tile = key_tile(e.config, b * hq * n, key_end)
        m = l_sum = o = None
        for start in range(0, key_end, tile):
            end = min(key_end, start + tile)
            scores = e.matmul(qm, _kv_operand(e, k, start, end, qk_dtype, True), "f32")
            operands: list[Any] = [e.reshape(scores, (*rows5, end - start))]
            if block_mask is not None:
                operands.append(_key_slice(e, block_mask, 4, start, end))
            if last_keys is not None:
                operands.append(last_keys)
            elif causal:  # key start + j is kept for query first + i when start + j <= first + i + S - L
                operands.append(e.iota((n, end - start), lambda i, w, s=start: w.cmp("sle", i[1], w.op(
                    "arith.addi", i[0], w.const_int(first + keys - length - s), dtype="i32"), "i32"), "i1"))
            present = None if kv_len is None else _present(e, kv_len, start, end)
            if present is not None:
                operands.append(present)
            y = e.elementwise(operands, _masked(mask, causal, scale, present is not None,
                                                None if last_keys is None else start), dtype="f32", keep_bool=True)
            m_tile = e.reduce_last(y, "max", True)
            m_new = m_tile if m is None else e.elementwise([m, m_tile],
                                                           lambda a, w: w.op("arith.maximumf", a[0], a[1]))
            p = e.elementwise([y, m_new],
                              lambda a, w: w.op("math.exp", w.op("arith.subf", a[0], _finite_base(a[1], w))))
            p_sum = e.reduce_last(p, "sum", True)
            values = _kv_operand(e, v, start, end, pv_dtype, False)
            if present is not None:  # absent keys' values are never read (0 * NaN would be NaN)
                values = e.elementwise([e.reshape(present, (end - start, 1)), values],
                                       lambda a, w: w.select(a[0], a[1], w.const(0.0)), dtype=pv_dtype,
                                       keep_bool=True)
            p_mxu = p if pv_dtype == "f32" else e.elementwise([p], lambda a, w: a[0], dtype=pv_dtype)
            pv = e.matmul(e.reshape(p_mxu, (b * hkv, rep * n, end - start)), values, "f32")
            pv = e.reshape(pv, (*rows5, dv))
            if m is None:
                l_sum, o = p_sum, pv
            else:
                l_sum = e.elementwise([l_sum, m, m_new, p_sum], _rescaled)
                o = e.elementwise([o, m, m_new, pv], _rescaled)
                if (start // tile + 1) % FUSED_TILES == 0 and end < key_end:
                    l_sum, o = e.fusion_barrier(l_sum), e.fusion_barrier(o)
            m = m_new
        assert m is not None and l_sum is not None and o is not None

        def normalise(a: list[str], w: BodyWriter) -> str:
            r = w.op("arith.divf", a[0], a[1])
            return w.select(w.cmp("oeq", a[2], w.const(-math.inf)), w.const(0.0), r) if safe else r

        return e.reshape(e.elementwise([o, l_sum, m], normalise, dtype=q.dtype), (b, hq, n, dv))

    blocks = query_blocks(length, keys) if causal and kv_len is None else [(0, length)]
    return over_keys(0, length) if len(blocks) == 1 else e.concat([over_keys(*blk) for blk in blocks], 2)


def _last_keys(e: MlirEmitter, rows5: tuple[int, ...], offset: int) -> TValue:
    """[B, KVH, rep, n, 1] f32: the last key a causal query row keeps (query i: i + offset), one value a score
    row, so that y's operands merge its rows (an iota along the queries would not: its heads repeat it) and
    the softmax's passes run as one tiled chain (`isel_vector.lower_tiled_chain`). f32 holds the key indices
    exactly (fewer than 2^24); the copy keeps fusion from folding it back into y as an iota, and every layer
    takes the same one (`MlirEmitter.reused`: a copy a layer made the layers unlike)."""
    if offset + rows5[3] >= 1 << 24:
        raise UnsupportedOp(f"a causal attention over {offset + rows5[3]} keys (f32 key indices are exact below 2^24)")
    key = ("attention.last_keys", rows5, offset)
    if key not in e.reused:
        n = rows5[3]
        # over the flat rows, lane-dense: [.., n, 1] took a vmem row a value (5,129 cycles at 8,192 rows, for
        # each of a 2048-token prefill's 8 query blocks)
        if FLAT_LAST_KEYS and n & (n - 1) == 0:
            flat = e.iota((math.prod(rows5),), lambda i, w: w.cast(w.op(
                "arith.addi", w.op("arith.andi", i[0], w.const_int(n - 1), dtype="i32"), w.const_int(offset),
                dtype="i32"), "i32", "f32"), "f32")
            e.reused[key] = e.reshape(e.fusion_barrier(flat), (*rows5, 1))
        else:
            last = e.iota((*rows5, 1), lambda i, w: w.cast(w.op("arith.addi", i[3], w.const_int(offset),
                                                                dtype="i32"), "i32", "f32"), "f32")
            e.reused[key] = e.fusion_barrier(last)
    return e.reused[key]


def _present(e: MlirEmitter, kv_len: TValue, start: int, end: int) -> TValue:
    """[end - start] i1: key start + j < kv_len (integer compare)."""
    return e.elementwise([kv_len], lambda a, w: w.cmp("slt", w.op("arith.addi", w.index(0), w.const_int(start),
                                                                 dtype="i32"), a[0], "i32"),
                         dtype="i1", shape=(end - start,), result="i1")


def _masked(mask: TValue | None, causal: bool, scale: float, limited: bool = False,
            key_start: int | None = None) -> Any:
    """The body of y: [scores, mask?, causal keep? (or with `key_start` the row's last key), key present?] ->
    scores * scale, masked. With key_start, key key_start + j is kept where it is at most the row's last."""
    def body(vals: list[str], w: BodyWriter) -> str:
        y = w.op("arith.mulf", vals[0], w.const(scale))
        rest = vals[1:]
        if mask is not None:
            mv, rest = rest[0], rest[1:]
            y = w.select(mv, y, w.const(-math.inf)) if mask.dtype == "i1" else w.op("arith.addf", y, mv)
        if causal and key_start is not None:
            key = w.cast(w.op("arith.addi", w.index(4), w.const_int(key_start), dtype="i32"), "i32", "f32")
            y, rest = w.select(w.cmp("ole", key, rest[0]), y, w.const(-math.inf)), rest[1:]
        elif causal:
            y, rest = w.select(rest[0], y, w.const(-math.inf)), rest[1:]
        if limited:
            y = w.select(rest[0], y, w.const(-math.inf))
        return y
    return body


def _rescaled(a: list[str], w: BodyWriter) -> str:
    """[acc, m, m', tile term] -> exp(m - c(m')) acc + tile term."""
    alpha = w.op("math.exp", w.op("arith.subf", a[1], _finite_base(a[2], w)))
    return w.op("arith.addf", w.op("arith.mulf", alpha, a[0]), a[3])
