"""`ctpu::attention` tiled over keys with an online softmax, GQA heads folded into the matmul rows
(codegen/attention.py), against eager `F.scaled_dot_product_attention`.

Before: K and V were copied once per query head and the whole [B*H, L, S] score matrix was one buffer. Most
cases here have more keys than one tile of `small` (key_tile: 128 keys), the last tile partial, so the
running max / sum and the rescaled output are exercised; masks broadcast as [B|1, H|1, L|1, S|1].
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from codegen_helpers import trace

from codegen import compile_graph
from codegen.attention import key_tile, query_blocks
from device_sim.config import get_config
from device_sim.executable import Executable, run_fresh
from device_sim.profile import KernelProfile, analyze
from device_sim.runners import SimulatorRunner

F32, BF16 = torch.float32, torch.bfloat16
TOL = {F32: dict(rtol=2e-5, atol=2e-5), BF16: dict(rtol=2e-2, atol=2e-2)}


def _ctpu():
    import fx_passes.ops  # noqa: F401  (registers torch.ops.ctpu; codegen itself never imports fx_passes)

    return torch.ops.ctpu


def _r(*shape: int, seed: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _causal_keep(length: int, keys: int) -> torch.Tensor:
    """ctpu::attention's causal mask (bottom-right: j <= i + S - L); SDPA's is_causal is top-left."""
    return torch.arange(keys)[None, :] <= torch.arange(length)[:, None] + keys - length


def _sdpa(q, k, v, mask, causal: bool, scale: float) -> torch.Tensor:
    """Eager SDPA with ctpu's causal alignment folded into the mask (SDPA takes one or the other)."""
    if causal:
        keep = _causal_keep(q.shape[-2], k.shape[-2])
        if mask is None:
            mask = keep
        elif mask.dtype == torch.bool:
            mask = mask & keep
        else:
            mask = mask.masked_fill(~keep, -math.inf)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def run_attention(q, k, v, mask, causal: bool, scale: float, safe: bool = True, config: str = "small"
                  ) -> tuple[np.ndarray, Executable]:
    op = _ctpu().attention
    xs = [q, k, v] + ([mask] if mask is not None else [])

    def f(q, k, v, *m):
        return op(q, k, v, m[0] if m else None, causal, scale, safe)

    exe = compile_graph(trace(f, *xs), xs, config, matmul_precision="highest")
    (out,), _ = run_fresh(exe, [x.float().numpy() for x in xs], SimulatorRunner(config))
    return out, exe


def check(q, k, v, mask=None, causal: bool = False, config: str = "small", tiles: bool = True) -> Executable:
    scale = q.shape[-1] ** -0.5
    if tiles:  # the case is meant to run more than one key tile
        b, h, length, _ = q.shape
        assert key_tile(get_config(config), b * h * length, k.shape[2]) < k.shape[2]
    out, exe = run_attention(q, k, v, mask, causal, scale, config=config)
    ref = _sdpa(q, k, v, mask, causal, scale).float().numpy()
    np.testing.assert_allclose(out, ref, **TOL[q.dtype])
    return exe


def _qkv(b: int, h: int, kvh: int, length: int, keys: int, d: int, dtype: torch.dtype = F32) -> tuple:
    return (_r(b, h, length, d, seed=0, dtype=dtype), _r(b, kvh, keys, d, seed=1, dtype=dtype),
            _r(b, kvh, keys, d, seed=2, dtype=dtype))


@pytest.mark.parametrize(("heads", "kv", "length", "keys"), [
    (4, 2, 33, 150),  # GQA rep 2, odd prefill, 128 + 22 keys
    (8, 2, 1, 300),  # GQA rep 4, one query (a decode step): 128 + 128 + 44 keys
    (2, 2, 77, 133),  # MHA, odd length
])
def test_causal(heads: int, kv: int, length: int, keys: int) -> None:
    check(*_qkv(1, heads, kv, length, keys, 16), causal=True)


def test_padding_mask_and_causal_batch_of_two() -> None:
    """A boolean [B, 1, 1, S] padding mask (left padding of different lengths) with the causal mask."""
    q, k, v = _qkv(2, 4, 2, 9, 140, 16)
    keep = torch.ones(2, 1, 1, 140, dtype=torch.bool)
    keep[0, ..., :3] = False
    keep[1, ..., :131] = False  # row 1 sees keys of the last tile only
    check(q, k, v, keep, causal=True)


def test_additive_per_head_mask() -> None:
    """An additive [B, H, L, S] mask: its head dim viewed [KVH, rep] (query head h of kv head h // rep)."""
    q, k, v = _qkv(1, 4, 2, 7, 150, 16)
    check(q, k, v, _r(1, 4, 7, 150, seed=3) * 2)


def test_edge_rows_across_tiles() -> None:
    """Rows whose keys are all masked (0, as SDPA), masked in the first tile only (the running max starts at
    -inf), NaN or +inf in the last tile (NaN rows, as eager), and scores of huge magnitude."""
    q, k, v = _qkv(1, 2, 1, 6, 200, 16)
    mask = torch.zeros(1, 1, 6, 200)
    mask[..., 0, :] = -math.inf
    mask[..., 1, :150] = -math.inf
    mask[..., 2, 170] = math.nan
    mask[..., 3, 171] = math.inf
    mask[..., 4, :] = _r(200, seed=4) * 1e30
    mask[..., 4, 190] = 3e38  # the only key that counts, in the last tile
    check(q, k, v, mask)


def test_bf16_edge_rows_on_large_match_the_ops_bf16_rule() -> None:
    """bf16 q, k, v at a Llama head on `large` (hd 64, 8 query heads over 2 kv heads, 33 queries over 301
    keys): P @ V takes p in bf16 (attention_ref's bf16 rule). Fully masked rows are 0 (safe softmax), a NaN
    or +inf score makes its row NaN, a NaN or inf in V reaches the rows that read it, the rest within
    bf16 rounding of the reference."""
    q, k, v = _qkv(1, 8, 2, 33, 301, 64, BF16)
    mask = torch.zeros(1, 1, 33, 301)
    mask[..., 0, :] = -math.inf
    mask[..., 1, 5] = math.nan
    mask[..., 2, 200] = math.inf
    v[0, 1, 7, 3] = math.nan  # read by kv head 1's queries (heads 4-7) at every row that keeps key 7
    v[0, 0, 9, 4] = math.inf
    out, _ = run_attention(q, k, v, mask, True, 0.125, config="large")
    ref = _ctpu().attention(q, k, v, mask, True, 0.125, True).float().numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    assert (out[0, :, 0] == 0).all() and np.isnan(out[0, :, 1]).all() and np.isnan(out[0, 4:, 10:, 3]).all()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], **TOL[BF16])


@pytest.mark.parametrize("masked", [False, True])
def test_a_prefill_softmax_runs_as_one_tiled_chain_with_the_same_bits(masked: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A causal bf16 prefill on `large` at a Llama head (hd 64, 16 query heads over 4 kv heads, 301 queries:
    two query blocks of 2,400 and 2,416 score rows, enough for a tiled chain): each key tile's row max,
    exponentials, row sum and bf16 copy run as one tile loop (`isel_vector.lower_tiled_chain`), with the
    scaled and causally masked scores themselves where no mask is given (a [L, S] mask repeats over the
    heads, so its rows do not merge with the scores'), which moves the f32 scores through HBM once, not
    four or five times. Edge values (a NaN key, a key of 1e30, NaN and inf values; with the mask fully masked rows,
    NaN, +inf, 3e38 and huge additive masks) give the same bits as the members one by one and eager's
    values; the program takes fewer cycles."""
    import codegen.isel_vector

    q, k, v = _qkv(1, 16, 4, 301, 301, 64, BF16)
    k[0, 0, 1, 3] = math.nan  # every row of kv head 0's queries from query 1 on
    k[0, 1, 40, :] = 1e30  # scores of ~1e31: the rows of kv head 1 from query 40 on attend to key 40 alone
    v[0, 1, 7, 3] = math.nan
    v[0, 0, 9, 4] = math.inf
    mask = None
    if masked:
        mask = torch.zeros(1, 1, 301, 301)
        mask[..., 0, :] = -math.inf
        mask[..., 150, 100] = math.inf
        mask[..., 151, :] = _r(301, seed=4) * 1e30
        mask[..., 152, 7] = 3e38
    args = (q, k, v, mask, True, 0.125)
    tiled, exe = run_attention(*args, config="large")
    chains = [kk["index"] for kk in exe.summary["kernels"] if kk.get("chain") == "tiled"]
    assert len(chains) == 2  # one a query block
    members = 4 if masked else 5
    assert all(sum(kk.get("chained_into") == c for kk in exe.summary["kernels"]) == members - 1 for c in chains)
    monkeypatch.setattr(codegen.isel_vector, "TILED_CHAINS", False)
    alone, exe_alone = run_attention(*args, config="large")
    assert not any(kk.get("chain") == "tiled" for kk in exe_alone.summary["kernels"])
    np.testing.assert_array_equal(tiled.view(np.uint32), alone.view(np.uint32))
    ref = _ctpu().attention(*args, True).float().numpy()
    np.testing.assert_array_equal(np.isnan(tiled), np.isnan(ref))
    if masked:  # row 0 fully masked: 0; row 150's +inf: NaN
        assert (tiled[0, :, 0] == 0).all() and np.isnan(tiled[0, :, 150]).all()
    else:  # the NaN key: kv head 0's queries from query 1 on
        assert np.isnan(tiled[0, :4, 1:]).all() and not np.isnan(tiled[0, 4:, :, :3]).any()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(tiled[finite], ref[finite], **TOL[BF16])
    xs = [x.float().numpy() for x in (q, k, v, *([mask] if masked else []))]
    _, stats = run_fresh(exe, xs, SimulatorRunner("large"))
    _, stats_alone = run_fresh(exe_alone, xs, SimulatorRunner("large"))
    # measured 237,767 against 248,964 with the mask (y stays apart), fewer still without
    assert stats.cycles < (0.97 if masked else 0.95) * stats_alone.cycles, (stats.cycles, stats_alone.cycles)


@pytest.mark.parametrize(("keys", "masked"), [(1216, False), (1537, True)])
def test_row_passes_give_the_bits_of_a_member_at_a_time(keys: int, masked: bool,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A causal bf16 prefill on `large` of 64 queries over 1,216 or 1,537 keys (hd 64, 8 query heads over 2 kv
    heads: 512 score rows of P = 10 or 13 vmem rows, so that a row's last chunk runs into the next row's): the
    tiled chain's members run in row passes (`isel_vector._row_passes`: the scaled scores and their max, then
    the exponentials, their sum and their bf16 copy, a chunk of each in registers; each column loaded once a
    row, not broadcast to vmem). Edge values (a NaN key, a key of 1e30, NaN and inf values; with the mask a
    fully masked row, +inf, 3e38 and huge additive masks) give the bits of a member at a time (ROW_PASSES
    False) and eager's values, in fewer cycles."""
    import codegen.isel_vector

    q, k, v = _qkv(1, 8, 2, 64, keys, 64, BF16)
    k[0, 0, 5, 3] = math.nan  # every row of kv head 0's queries
    k[0, 1, 1100, :] = 1e30  # the rows of kv head 1 attend to key 1100 alone
    v[0, 1, 7, 3] = math.nan
    v[0, 0, 9, 4] = math.inf
    mask = None
    if masked:
        mask = torch.zeros(1, 1, 64, keys)
        mask[..., 0, :] = -math.inf
        mask[..., 50, 100] = math.inf
        mask[..., 51, :] = _r(keys, seed=4) * 1e30
        mask[..., 52, 7] = 3e38
    args = (q, k, v, mask, True, 0.125)
    passes, chain = _with_tiled_chain_cycles(*args)
    monkeypatch.setattr(codegen.isel_vector, "ROW_PASSES", False)
    alone, chain_alone = _with_tiled_chain_cycles(*args)
    np.testing.assert_array_equal(passes.view(np.uint32), alone.view(np.uint32))
    ref = _ctpu().attention(*args, True).float().numpy()
    np.testing.assert_array_equal(np.isnan(passes), np.isnan(ref))
    if masked:  # row 0 fully masked: 0; row 50's +inf: NaN
        assert (passes[0, 4:, 0] == 0).all() and np.isnan(passes[0, 4:, 50]).all()
    else:  # the NaN key: kv head 0's queries
        assert np.isnan(passes[0, :4]).all() and not np.isnan(passes[0, 4:, :, :3]).any()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(passes[finite], ref[finite], **TOL[BF16])
    assert chain < 0.9 * chain_alone, (chain, chain_alone)  # measured 7,070 against 8,077 at 1,216 keys


def test_a_row_pass_loads_its_row_values_computed_8_rows_at_a_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """A causal bf16 prefill on `large` of 64 queries over 1,024 keys (hd 64, 16 query heads over 4 kv heads:
    1,024 score rows of 8 vmem rows). What a row pass computes from its columns alone, two vector ops a row
    each: the scores' pass spreads its row's last key (a column holding it in lane 0) across lanes, the
    exponentials' pass takes the finite row max (0 where every key is masked: a compare and a select). The
    tiled chain computes both for its tile 8 rows a vector op and the passes load them
    (`isel_vector._row_values`): ~3.5 vector ops a row fewer, the same bits as a row at a time (`ROW_VALUES`
    False) with a NaN key, a key of 1e30 and NaN and inf values, and eager's values."""
    import codegen.isel_vector

    q, k, v = _qkv(1, 16, 4, 64, 1024, 64, BF16)
    k[0, 0, 5, 3] = math.nan  # every row of kv head 0's queries
    k[0, 1, 1000, :] = 1e30  # the rows of kv head 1 attend to key 1000 alone
    v[0, 1, 7, 3] = math.nan
    v[0, 0, 9, 4] = math.inf

    def run() -> tuple[np.ndarray, int, int]:
        out, _, kernels = _profiled_on_large(q, k, v)
        assert kernels
        return out, sum(kp.slot_ops["v0"] + kp.slot_ops["v1"] for kp in kernels), sum(kp.cycles for kp in kernels)

    out, ops, cycles = run()
    monkeypatch.setattr(codegen.isel_vector, "ROW_VALUES", False)
    by_row, ops_by_row, cycles_by_row = run()
    np.testing.assert_array_equal(out.view(np.uint32), by_row.view(np.uint32))
    # measured 11,817 vector ops against 15,393 (4 a row less 4 a chunk of 8 rows), 9,832 cycles against 11,168
    assert ops_by_row - ops >= 3.4 * 1024 and cycles < cycles_by_row, (ops, ops_by_row, cycles, cycles_by_row)
    ref = _ctpu().attention(q, k, v, None, True, 0.125, True).float().numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(out[0, :4]).all() and not np.isnan(out[0, 4:, :, :3]).any()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], **TOL[BF16])


def test_a_query_blocks_last_keys_are_computed_over_its_flat_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """A causal bf16 prefill on `large` of 1,024 queries (16 query heads over 4, hd 64): 8 query blocks of 128
    queries, 2,048 score rows each, whose scores compare each key with their row's last key, one value a
    row. Over the block's flat rows (row r's query is r mod 128, a power of two) that is a lane-dense iota;
    by row it took a vmem row a value (a 2048-token 1B prefill: 5,129 cycles a block). The same bits, and
    eager's values."""
    import codegen.attention

    q, k, v = _qkv(1, 16, 4, 1024, 1024, 64, BF16)
    k[0, 2, 700, :] = 1e30  # the rows of kv head 2 from query 700 on attend to key 700 alone

    def run() -> tuple[np.ndarray, int]:
        exe = compile_graph(trace(lambda q, k, v: _ctpu().attention(q, k, v, None, True, 0.125, True), q, k, v),
                            [q, k, v], "large")
        (out,), stats = run_fresh(exe, [x.float().numpy() for x in (q, k, v)], SimulatorRunner("large"))
        return out, stats.cycles

    flat, cycles = run()
    monkeypatch.setattr(codegen.attention, "FLAT_LAST_KEYS", False)
    by_row, cycles_by_row = run()
    np.testing.assert_array_equal(flat.view(np.uint32), by_row.view(np.uint32))
    assert cycles < 0.9 * cycles_by_row, (cycles, cycles_by_row)  # measured 490,960 against 566,150
    ref = _ctpu().attention(q, k, v, None, True, 0.125, True).float().numpy()
    np.testing.assert_allclose(flat, ref, **TOL[BF16])


def _profiled_on_large(q, k, v, mask=None, causal: bool = True, scale: float = 0.125,
                       ) -> tuple[np.ndarray, list[dict[str, Any]], list[KernelProfile]]:
    """The attention's output on `large`, and the profiler's roofline rows and kernels of its tiled chains."""
    op = _ctpu().attention
    xs = [q, k, v] + ([mask] if mask is not None else [])
    exe = compile_graph(trace(lambda q, k, v, *m: op(q, k, v, m[0] if m else None, causal, scale, True), *xs), xs,
                        "large")
    runner = SimulatorRunner("large")
    runner.simulator.profile = True
    (out,), _ = run_fresh(exe, [x.float().numpy() for x in xs], runner)
    tiled = {f"k{kk['index']}" for kk in exe.summary["kernels"] if kk.get("chain") == "tiled"}
    profile = analyze(runner.simulator.recording, exe.summary["kernels"])
    rows = [row for row in profile.roofline() if row["kernel"] in tiled]
    return out, rows, [kp for kp in profile.kernels if kp.label in tiled]


def _with_tiled_chain_cycles(q, k, v, mask, causal: bool, scale: float) -> tuple[np.ndarray, int]:
    """The attention's output on `large` and the cycles of its tiled chains (the profiler's kernel spans)."""
    out, rows, _ = _profiled_on_large(q, k, v, mask, causal, scale)
    assert rows
    return out, sum(row["cycles"] for row in rows)


def test_a_tiled_chain_moves_each_score_through_hbm_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """A causal bf16 prefill on `large` at the 1B model's heads (32 query heads over 8, hd 64, 512 queries in 4
    query blocks of 4,096 score rows), key tiles of 256 (as a 4096-token prefill's of 1,024): each tiled
    chain reads its f32 scores once and writes their bf16 exponentials once, 6 bytes a score and one tile of
    the causal mask's key iota, which is the same every row (`isel_vector._same_every_row`: loaded once, not
    each tile), and keeps its f32 exponentials in vmem although the next query block's tile reuses their
    buffer (`compiler._overwrites`: that block writes all of it first). Before, 10 and 14 bytes a score.
    Edge values give the bits of the members one at a time and eager's NaNs."""
    import codegen.attention
    import codegen.isel_vector

    monkeypatch.setattr(codegen.attention, "SCORE_HBM_SHARE", 768)  # 256 keys a tile at these 4,096 rows
    q, k, v = _qkv(1, 32, 8, 512, 512, 64, BF16)
    k[0, 0, 200, 3] = math.nan  # kv head 0's queries from 200 on
    k[0, 1, 300, :] = 1e30  # kv head 1's queries from 300 on attend to key 300 alone
    v[0, 2, 7, 3] = math.nan
    v[0, 3, 0, 4] = math.inf  # a key every query sees (eager's 0 * inf is NaN past a query's last key)

    def run() -> tuple[np.ndarray, dict[str, float]]:
        out, rows, _ = _profiled_on_large(q, k, v)
        scores = 8 * 4 * 128 * 256  # a chain's: a query block's 4,096 rows of one 256-key tile
        return out, {row["kernel"]: row["hbm_bytes"] / scores for row in rows}

    out, per_score = run()
    assert len(per_score) == 4 and all(b < 7.5 for b in per_score.values()), per_score  # measured 7.05
    monkeypatch.setattr(codegen.isel_vector, "TILED_CHAINS", False)
    alone, _ = run()
    np.testing.assert_array_equal(out.view(np.uint32), alone.view(np.uint32))
    ref = _ctpu().attention(q, k, v, None, True, 0.125, True).float().numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(out[0, :4, 200:]).all() and not np.isnan(out[0, :4, :200]).any()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], **TOL[BF16])


def test_fully_masked_rows_without_safe_are_nan() -> None:
    """safe=False (a hand-written softmax): a row whose keys are all masked is 0 / 0 = NaN, as eager; the
    other rows are unchanged."""
    q, k, v = _qkv(1, 2, 1, 4, 140, 16)
    keep = torch.ones(1, 1, 4, 140, dtype=torch.bool)
    keep[..., 1, :] = False
    keep[..., 2, :135] = False
    out, _ = run_attention(q, k, v, keep, False, 0.25, safe=False)
    ref = _ctpu().attention(q, k, v, keep, False, 0.25, False).numpy()
    assert np.isnan(out[:, :, 1]).all() and not np.isnan(np.delete(out, 1, axis=2)).any()
    np.testing.assert_allclose(out, ref, **TOL[F32])


@pytest.mark.parametrize(("d", "dtype"), [(64, BF16), (128, F32)])
def test_head_dims_on_small(d: int, dtype: torch.dtype) -> None:
    check(*_qkv(1, 4, 2, 5, 130, d, dtype), causal=True)


def test_bf16_gqa_odd_length() -> None:
    check(*_qkv(1, 4, 1, 33, 150, 16, BF16), causal=True)


@pytest.mark.parametrize(("d", "dtype"), [(64, BF16), (128, F32)])
def test_large_llama_shapes(d: int, dtype: torch.dtype) -> None:
    """`large`, a Llama-like head: 8 query heads over 2 kv heads, 33 queries over 300 keys (one tile there)."""
    check(*_qkv(1, 8, 2, 33, 300, d, dtype), causal=True, config="large", tiles=False)


@pytest.mark.slow  # CI time (41 s); the fusion barrier: test_a_2048_token_prefill_with_its_output_projection_*
def test_long_context_on_small() -> None:
    """1024 keys, 64 queries on `small`: 8 tiles of 128 keys. linalg-fuse-elementwise-ops fused the running
    sum and output updates of every tile into the final division, one generic of 3 operands per tile that ran
    out of spill slots here (so tiles were capped at 4, 256 keys each); a copy after every FUSED_TILES tiles
    stops the fusion. Before tiling, P @ V's K did not fit vmem."""
    assert key_tile(get_config("small"), 4 * 64, 1024) == 128
    check(*_qkv(1, 4, 2, 64, 1024, 16), causal=True)


def test_edge_rows_across_the_fusion_barrier() -> None:
    """8 tiles (1100 keys: 4 of 144, the barrier's copy, 3 more, 92): rows all masked, masked up to the last
    tile, NaN or +inf after the barrier, scores of huge magnitude; the running max / sum / output cross it."""
    keys = 1100
    assert key_tile(get_config("small"), 2 * 6, keys) == 144
    q, k, v = _qkv(1, 2, 1, 6, keys, 16)
    mask = torch.zeros(1, 1, 6, keys)
    mask[..., 0, :] = -math.inf
    mask[..., 1, :1050] = -math.inf  # the running max is -inf through the barrier
    mask[..., 2, 1040] = math.nan
    mask[..., 3, 1099] = math.inf
    mask[..., 4, :] = _r(keys, seed=4) * 1e30
    mask[..., 4, 10] = 3e38  # the only key that counts, in the first tile
    check(q, k, v, mask)


def test_query_blocks() -> None:
    """A causal prefill's queries run in blocks of at least 128, at most 8; one block where the keys before
    the queries are as many as the queries (a chunk after a long cache) or there are few queries."""
    assert query_blocks(2048, 2048) == [(256 * i, 256 * (i + 1)) for i in range(8)]
    assert query_blocks(1000, 1000) == [(0, 142), (142, 285), (285, 428), (428, 571), (571, 714), (714, 857),
                                        (857, 1000)]
    assert query_blocks(301, 301) == [(0, 150), (150, 301)]
    assert query_blocks(300, 500) == [(0, 150), (150, 300)]
    assert query_blocks(255, 255) == [(0, 255)] and query_blocks(1, 300) == [(0, 1)]
    assert query_blocks(300, 600) == [(0, 300)]


def test_a_long_prefills_query_blocks_are_one_key_tile_each() -> None:
    """The 1B geometry on `large` (32 query heads): each query block of a 2048-token prefill (256 queries,
    8,192 score rows) takes all the keys it sees in one tile, its f32 scores at most 64 MiB (1/48 of HBM):
    no second tile with its rescale kernels, and its rows of 2, 4, .. 16 vmem rows, where 1536-key tiles
    (12 rows, whose row passes compute 16) cost the attention 2,321,426 cycles against 2,163,043. At 4096
    tokens (512 queries a block) tiles of 1024 keys, 8 vmem rows, not 768 (6)."""
    cfg = get_config("large")
    assert all(key_tile(cfg, 32 * (last - first), last) == last for first, last in query_blocks(2048, 2048))
    assert key_tile(cfg, 32 * 512, 4096) == 1024


def _blocks_off(monkeypatch: pytest.MonkeyPatch) -> None:
    import codegen.attention

    monkeypatch.setattr(codegen.attention, "MAX_QUERY_BLOCKS", 1)


# slow (~95 s on 2 cores): `pytest -m slow`; causal query blocks run in CI in the 2048-token prefill tests
@pytest.mark.slow
def test_causal_query_blocks_skip_the_keys_they_cannot_see(monkeypatch: pytest.MonkeyPatch) -> None:
    """259 causal queries on `small` (GQA 4 over 2, head dim 16) in two blocks: block [0, 129) reads keys
    [0, 129) only, in 3 key tiles; block [129, 259) all 259 in 5. Edge rows: row 0 fully masked (0), a NaN
    score (a NaN row), +inf (NaN), huge scores, a NaN key (row 200 and later read it; the rows before mask it
    in the tile that holds it), and the values eager's. With the blocks the MXU does a quarter fewer MACs and
    the program takes fewer cycles than over all keys, with the same bits."""
    q, k, v = _qkv(1, 4, 2, 259, 259, 16)
    assert query_blocks(259, 259) == [(0, 129), (129, 259)]
    mask = torch.zeros(1, 1, 259, 259)
    mask[..., 0, 0] = -math.inf
    mask[..., 5, 3] = math.nan
    mask[..., 140, 100] = math.inf
    mask[..., 200, :] = _r(259, seed=4) * 1e30
    k[0, 1, 200, 7] = math.nan
    blocked, exe = run_attention(q, k, v, mask, True, 0.25)
    ref = _ctpu().attention(q, k, v, mask, True, 0.25, True).numpy()
    np.testing.assert_array_equal(np.isnan(blocked), np.isnan(ref))
    assert (blocked[0, :, 0] == 0).all() and np.isnan(blocked[0, :, 5]).all() and np.isnan(blocked[0, :, 140]).all()
    assert np.isnan(blocked[0, 2:, 200:]).all() and not np.isnan(blocked[0, 2:, 6:140]).any()
    finite = ~np.isnan(ref)
    np.testing.assert_allclose(blocked[finite], ref[finite], **TOL[F32])
    _, stats = run_fresh(exe, [x.numpy() for x in (q, k, v, mask)], SimulatorRunner("small"))
    _blocks_off(monkeypatch)
    whole, exe_whole = run_attention(q, k, v, mask, True, 0.25)
    _, stats_whole = run_fresh(exe_whole, [x.numpy() for x in (q, k, v, mask)], SimulatorRunner("small"))
    np.testing.assert_array_equal(np.isnan(whole), np.isnan(blocked))
    np.testing.assert_allclose(whole[finite], blocked[finite], rtol=1e-6, atol=1e-6)
    assert stats.macs < 0.8 * stats_whole.macs and stats.cycles < stats_whole.cycles, (stats, stats_whole)


@pytest.mark.parametrize(("d", "dtype"), [(64, BF16), (128, F32)])
def test_causal_query_blocks_at_llama_heads_on_large(d: int, dtype: torch.dtype) -> None:
    """`large`, a Llama-like prefill of 301 tokens (8 query heads over 2 kv heads): two query blocks of 150
    and 151, one key tile each, eager SDPA's values."""
    assert query_blocks(301, 301) == [(0, 150), (150, 301)]
    check(*_qkv(1, 8, 2, 301, 301, d, dtype), causal=True, config="large", tiles=False)


def test_no_buffer_holds_the_whole_score_matrix() -> None:
    """Every buffer of the compiled graph holds at most one key tile of scores (B*H*L*Tk values): before,
    the scores [B*H, L, S] (and K / V repeated per query head) were buffers of the program."""
    b, h, kvh, length, keys, d = 1, 4, 2, 33, 300, 16
    q, k, v = _qkv(b, h, kvh, length, keys, d)
    exe = check(q, k, v, causal=True)
    tile = key_tile(get_config("small"), b * h * length, keys)
    sizes = {n: math.prod(buf["shape"]) for n, buf in exe.summary["buffers"].items()}
    assert max(sizes.values()) == b * h * length * tile, sizes
    assert b * h * length * keys > max(sizes.values())


def test_causal_gqa_33_positions_compiles_with_no_cpu_op() -> None:
    """Issue 12's report (`small`, causal GQA, 33 positions, head dim 16): SDPA through the ctpu backend is
    one program with nothing on the CPU, and eager's values."""
    import torch_tpu_backend.stats as ctpu_stats

    q, k, v = _qkv(1, 4, 2, 33, 33, 16)

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    torch._dynamo.reset()
    ctpu_stats.reset()
    out = torch.compile(f, backend="ctpu")(q, k, v)
    assert dict(ctpu_stats.last().fallback_ops) == {}
    np.testing.assert_allclose(out.numpy(), f(q, k, v).numpy(), **TOL[F32])


@pytest.mark.parametrize(("config", "keys", "kv_len", "head_dim"), [("small", 300, 233, 64), ("large", 301, 257, 128)])
def test_kv_len_keys_past_it_are_never_read(config: str, keys: int, kv_len: int, head_dim: int) -> None:
    """kv_len (a key dim padded to a dynamic-shape bucket): keys past it hold NaN in K and inf / NaN in V, over
    several key tiles on `small` (the last partial), GQA 8 query heads over 2, a causal mask; the result is
    attention over the first kv_len keys, computed by eager."""
    _ctpu()
    g = torch.Generator().manual_seed(keys)
    q = torch.randn(1, 8, 3, head_dim, generator=g)
    k, v = torch.randn(1, 2, keys, head_dim, generator=g), torch.randn(1, 2, keys, head_dim, generator=g)
    k[:, :, kv_len:], v[:, :, kv_len:: 2], v[:, :, kv_len + 1:: 2] = math.nan, math.inf, math.nan
    n = torch.tensor(kv_len, dtype=torch.int32)
    fn = lambda q, k, v, n: torch.ops.ctpu.attention(q, k, v, None, True, 0.125, True, n)
    exe = compile_graph(trace(fn, q, k, v, n), [q, k, v, n], config)
    (out,), _ = run_fresh(exe, [q.numpy(), k.numpy(), v.numpy(), n.numpy()], SimulatorRunner(config))
    keep = torch.arange(kv_len) <= torch.arange(3)[:, None] + keys - 3  # causal aligns with the padded length
    ref = F.scaled_dot_product_attention(q, k[:, :, :kv_len].repeat_interleave(4, 1),
                                         v[:, :, :kv_len].repeat_interleave(4, 1), attn_mask=keep, scale=0.125)
    np.testing.assert_allclose(out, ref.numpy(), **TOL[F32])


def test_a_2048_token_prefill_with_its_output_projection_compiles_as_one_program() -> None:
    """32 heads x 2048 queries over 2048 keys on `large`: 8 key tiles of 256 keys (a tile's f32 scores are
    bounded by SCORE_HBM_SHARE), then o_proj. The final normalization, the rescales of the tiles since the
    last fusion barrier and the transpose into o_proj's rows fuse into the matmul's factor: with 4 tiles
    there (FUSED_TILES was 4) its register allocation ran out of spill slots, and a 1B-geometry layer at
    2048 tokens was split into two programs with a permute on the CPU between them. Compiled, not run."""
    import fx_passes.ops  # noqa: F401  (torch.ops.ctpu)

    b, h, kvh, length, d = 1, 32, 2, 2048, 16
    assert key_tile(get_config("large"), b * h * length, length) == 256
    q, k, v = _qkv(b, h, kvh, length, length, d, BF16)
    w = _r(h * d, h * d, seed=3, dtype=BF16)

    def f(q, k, v, w):
        o = torch.ops.ctpu.attention(q, k, v, None, True, d ** -0.5, True)
        return o.transpose(1, 2).reshape(b, length, h * d) @ w.t()

    exe = compile_graph(trace(f, q, k, v, w), [q, k, v, w], "large")
    assert len(exe.program) <= get_config("large").imem_bundles
    assert exe.summary["kernels"][-1]["kind"] == "matmul"


def test_query_blocks_that_share_a_key_tile_read_k_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """The 1B geometry's attention at 2048 tokens on `large` (32 heads over 8 KV heads, head dim 64), its f32
    score tiles at most 1/64 of HBM (1536 keys; the default share makes each query block one tile): the
    last causal query blocks see the same 1536 keys, and CSE keeps one transposed copy of that key tile for
    the three q @ K^T matmuls that read it. The kernel reader folds it into all three (they read K in place,
    through `mxu.lwt`), as it does for one: no kernel copies K (the copy moved a DMA pair a column, ~0.2M
    cycles of the 3.38M). Compiled, not run (the same bits as with the copy: the attention alone, run on
    the simulator, ~1.5 minutes)."""
    import codegen.attention
    import fx_passes.ops  # noqa: F401  (torch.ops.ctpu)

    monkeypatch.setattr(codegen.attention, "SCORE_HBM_SHARE", 64)
    q, k, v = _qkv(1, 32, 8, 2048, 2048, 64, BF16)

    def f(q, k, v):
        return torch.ops.ctpu.attention(q, k, v, None, True, 0.125, True)

    exe = compile_graph(trace(f, q, k, v), [q, k, v], "large")
    lines = exe.stages["kernels.txt"].splitlines()
    k_arg = "%arg1["
    assert not [ln for ln in lines if "elementwise" in ln and f"({k_arg}" in ln]
    scores = [ln for ln in lines if "matmul" in ln and f"@ {k_arg}" in ln]
    assert len(scores) == sum("matmul" in ln for ln in lines) // 2  # every q @ K^T reads K itself
    assert sum("[8, 64, 1536] strides [131072, 1, 64]" in ln for ln in scores) == 3
