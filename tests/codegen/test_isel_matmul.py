"""Matmul instruction selection (codegen/isel_matmul.py) on vmem that earlier kernels left dirty.

The MXU multiplies a whole N x N weight tile: for K % N != 0 the weight rows K .. ceil(K / N) * N are
never written by B's DMA, and A's lanes past K are zero, so those rows must hold zeros (0 x NaN and
0 x inf are NaN). On `large` (N = 128) that is up to 127 rows per tile; issue 16: only the last 8 were
zeroed, and a Llama of hidden 128 gave NaN logits at 1, 2, 4 .. 22, 25 and 26 tokens (attention's
P @ V has K = tokens, Q @ K^T K = head dim 16), depending on what earlier kernels had left in vmem.
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest
import torch
from codegen_helpers import run_with_poisoned_vmem, trace

from codegen import compile_graph, isel_matmul
from codegen.isel_matmul import _layout
from device_sim.executable import run_fresh
from device_sim.runners import SimulatorRunner

torch.manual_seed(0)

CASES = [  # (config, A shape, B shape, dtype): K below, between and at multiples of N and of 8
    ("large", (16, 16), (16, 64), torch.float32),
    ("large", (24, 100), (100, 16), torch.float32),
    ("large", (8, 200), (200, 136), torch.float32),
    ("large", (16, 128), (128, 32), torch.float32),
    ("large", (16, 16), (16, 64), torch.bfloat16),
    ("large", (8, 16, 16), (8, 16, 16), torch.float32),  # batched (a batch loop): attention's P @ V
    ("large", (8, 4, 18), (8, 18, 64), torch.bfloat16),  # batched bf16, every batch resident: decode's P @ V
    ("small", (16, 12), (12, 8), torch.float32),
    ("small", (4, 3, 20), (4, 20, 5), torch.float32),
]


@pytest.mark.parametrize(("config", "a_shape", "b_shape", "dtype"), CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_weight_rows_past_k_are_zero_on_dirty_vmem(config: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...],
                                                    dtype: torch.dtype) -> None:
    a, b = torch.randn(a_shape).to(dtype), torch.randn(b_shape).to(dtype)
    cg = compile_graph(trace(torch.matmul, a, b), [a, b], config, matmul_precision="highest")
    (out,) = run_with_poisoned_vmem(cg, [a.float().numpy(), b.float().numpy()])
    ref = (a.double() @ b.double()).numpy()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)


# ---- every K compiles (k-chunks), transposed weights (x @ W.T) through mxu.lwt --------------------------
# issue 12: the Llama-3.2-1B down projection (17 x 8192 x 2048 bf16 on `large`) was refused ("K too large for
# one tile") and ran on the CPU; x @ W.T copied W transposed by DMA, element by element, on every call.
def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


def _check(config: str, x: torch.Tensor, w: torch.Tensor, transposed: bool, precision: str = "highest",
           poisoned: bool = True) -> None:
    fn = _linear if transposed else torch.matmul
    cg = compile_graph(trace(fn, x, w), [x, w], config, matmul_precision=precision)
    assert [k["kind"] for k in cg.summary["kernels"]] == ["matmul"]  # no transpose copy, no CPU fallback
    inputs = [x.float().numpy(), w.float().numpy()]
    if poisoned:
        (out,) = run_with_poisoned_vmem(cg, inputs)
    else:
        (out,), _ = run_fresh(cg, inputs, SimulatorRunner(config))
    wd = w.double()
    ref = (x.double() @ (wd.T if transposed else wd)).numpy()
    tol = 1e-2 if x.dtype == torch.bfloat16 else 1e-5
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol * np.abs(ref[np.isfinite(ref)]).max())


@pytest.mark.parametrize(("config", "m", "k", "n", "dtype", "transposed"), [
    ("large", 17, 8192, 2048, torch.bfloat16, True),  # the 1B down projection: one B panel, A whole
    ("large", 9, 8300, 136, torch.float32, False),  # fp32 parts: B in k-chunks, K % 128 != 0 zeroed per chunk
    ("large", 9, 8300, 136, torch.float32, True),
    ("small", 9, 2001, 20, torch.float32, False),  # A in k-chunks too (8 rows x all of K do not fit)
    ("small", 11, 2000, 21, torch.float32, True),
    ("small", 40, 1500, 30, torch.bfloat16, False),
], ids=str)
def test_any_k_compiles(config: str, m: int, k: int, n: int, dtype: torch.dtype, transposed: bool) -> None:
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(*((n, k) if transposed else (k, n))).to(dtype)
    _check(config, x, w, transposed, poisoned=config == "small")


@pytest.mark.parametrize(("config", "precision", "k_tiles", "m", "chunks", "a_chunked"), [
    ("large", "medium", 64, 17, 1, False),
    ("large", "highest", 65, 9, 3, False),
    ("small", "highest", 251, 9, 8, True),
])
def test_layout_chunks_k_only_when_needed(config: str, precision: str, k_tiles: int, m: int, chunks: int,
                                          a_chunked: bool) -> None:
    lanes = 128 if config == "large" else 8
    free = 32000 if config == "large" else 3800
    plan = _layout(precision, m, k_tiles, lanes, free)
    assert plan is not None
    _, mt, kc, chunked = plan
    assert (-(-k_tiles // kc), chunked) == (chunks, a_chunked) and mt >= min(m, 8)


SPECIALS = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 3e-39, -1e-45, 1e38, -1e38]


@pytest.mark.parametrize(("config", "dtype", "precision"), [
    ("large", torch.float32, "highest"), ("large", torch.bfloat16, "medium"), ("small", torch.float32, "highest"),
    ("small", torch.float32, "high"),
])
def test_transposed_weights_keep_edge_values(config: str, dtype: torch.dtype, precision: str) -> None:
    """Specials in W (one per row of W, so each lands in its own output column) through mxu.lwt and the
    fp32 split; W has a tail n-tile and a tail k-tile, vmem is poisoned with NaN."""
    m, k, n = (13, 150, 140) if config == "large" else (13, 21, 19)
    x = torch.randn(m, k).clamp(-3, 3).to(dtype)
    w = torch.randn(n, k)
    for i, value in enumerate(SPECIALS):
        w[2 * i, (7 * i) % k] = value
    _check(config, x, w.to(dtype), True, precision)


def test_transposed_weights_are_loaded_once() -> None:
    """DMA loads exactly the operands (and the argument table): W's rows go to vmem as they are."""
    x, w = torch.randn(24, 384).bfloat16(), torch.randn(272, 384).bfloat16()
    cg = compile_graph(trace(_linear, x, w), [x, w], "large")
    (out,), stats = run_fresh(cg, [x.float().numpy(), w.float().numpy()], SimulatorRunner("large"))
    assert [k["kind"] for k in cg.summary["kernels"]] == ["matmul"]
    operands = 2 * (x.numel() + w.numel())
    assert operands <= stats.dma_bytes_loaded <= operands + 64
    np.testing.assert_allclose(out, (x.double() @ w.double().T).numpy(), rtol=1e-2, atol=1e-2)


def test_bf16_gemm_keeps_the_mxu_busy_on_large() -> None:
    """The compiled bf16 GEMM 1024^3 on `large`, in simulator counts (exact, not timed): 81.8% MXU
    utilization when an m-tile loaded all of A before its first mm and m-tiles were 512 rows; 93.8% with the
    pipelined start; 96.5% with cross-kernel work (67,882 cycles); 97.1% (67,485) with the first mm on a
    fifth of A's first k-tile and the last C tile stored in two parts (the rest: the argument table's,
    A's and the store's DMA latencies and the MXU's drain, ~1,750 cycles of 65,536 MXU rows)."""
    from codegen.bench import gemm

    torch.manual_seed(0)
    assert gemm(1024, "large")["mxu_utilization"] >= 0.97


@pytest.mark.parametrize(("m", "k", "n", "transposed"), [
    (1000, 384, 520, False),  # one m-tile of 1000 rows: first mm on 200 of them, C stored as 752 + 248
    (2100, 256, 300, True),  # m-tiles of 1024, 1024 and 52 (too short to split), W.T through mxu.lwt
    (300, 130, 129, False),  # 300 rows, a tail k-tile and a tail n-tile
], ids=str)
def test_split_first_mm_and_last_store_give_the_same_bits(m: int, k: int, n: int, transposed: bool) -> None:
    """The pipelined start's first mm in two commands (rows as A's two DMAs land) and an m-tile's last C
    tile in two commands and two stores (on the two MXU flags): every row computed once, from the A rows
    it should read, on vmem poisoned with NaN; specials in rows at the split points reach only their row."""
    x = torch.randn(m, k).clamp(-3, 3).bfloat16()
    w = torch.randn(*((n, k) if transposed else (k, n))).bfloat16()
    for row in (0, 199, 200, 751, 752, m - 1):
        if row < m:
            x[row, row % k] = float("inf") if row % 2 else float("nan")
    fn = _linear if transposed else torch.matmul
    cg = compile_graph(trace(fn, x, w), [x, w], "large")
    (out,) = run_with_poisoned_vmem(cg, [x.float().numpy(), w.float().numpy()])
    wd = w.double()
    ref = (x.double() @ (wd.T if transposed else wd)).numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(out[~finite & ~np.isnan(ref)], ref[~finite & ~np.isnan(ref)])
    np.testing.assert_allclose(out[finite], ref[finite], rtol=1e-2, atol=1e-2 * np.abs(ref[finite]).max())


# ---- decode attention: many small bf16 matmuls with every batch resident in vmem ------------------------
# issue 13: at one token, q @ K^T and P @ V run one small matmul per KV head; as a batch loop each head paid
# a DMA latency in and one out (10,492 and 12,891 cycles a kernel on the 1B geometry, 8 KV heads).
def _bmm_kt(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    return torch.bmm(q, k.transpose(1, 2))


@pytest.mark.parametrize(("heads", "rows", "d", "keys", "fn"), [
    (8, 4, 64, 18, "qk"),  # the 1B geometry at one token: 32 query heads over 8 KV heads, head dim 64
    (8, 4, 64, 18, "pv"),
    (4, 2, 128, 301, "qk"),  # head dim 128, an odd context over three n-tiles
    (4, 2, 128, 301, "pv"),  # K = 301: weight rows past it zeroed in every batch's panels
    # a prefill of 128 queries (a dynamic bucket's, 1B geometry): 512 rows a KV head, one m-tile a batch, whose
    # MXU work outlasts a DMA latency (11,929 cycles as the batch loop, 5,286 resident)
    (8, 512, 64, 128, "qk"),
    (8, 512, 64, 128, "pv"),
    (2, 1000, 128, 250, "pv"),  # 4 heads of 250 queries over head dim 128: an odd m-tile, K = 250
], ids=str)
def test_resident_batches_pay_one_latency_not_one_per_batch(heads: int, rows: int, d: int, keys: int, fn: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    q = torch.randn(heads, rows, d).bfloat16()
    kv = torch.randn(heads, keys, d).bfloat16()
    p = torch.softmax(torch.randn(heads, rows, keys), -1).bfloat16()
    kv[0, 3, 5] = float("inf")  # specials reach the outputs they touch and no other
    kv[1, 7, 1] = float("nan")
    args = [q, kv] if fn == "qk" else [p, kv]
    cg = compile_graph(trace(_bmm_kt if fn == "qk" else torch.matmul, *args), args, "large")
    assert [k["kind"] for k in cg.summary["kernels"]] == ["matmul"]
    inputs = [t.float().numpy() for t in args]
    (out,) = run_with_poisoned_vmem(cg, inputs)
    a, b = (t.double() for t in args)
    ref = (a @ b.transpose(-1, -2) if fn == "qk" else a @ b).numpy()
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    _, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
    monkeypatch.setattr(isel_matmul, "MAX_RESIDENT_BATCHES", 0)  # the batch loop, for comparison
    looped = compile_graph(trace(_bmm_kt if fn == "qk" else torch.matmul, *args), args, "large")
    (out_looped,), loop_stats = run_fresh(looped, inputs, SimulatorRunner("large"))
    np.testing.assert_array_equal(out, out_looped)
    # resident: the program's entry, the loads, the MXU, the stores; the loop paid a latency a batch
    assert stats.cycles < loop_stats.cycles - (heads - 2) * cg.hardware.dma_latency


@pytest.mark.parametrize("fn", ["qk", "pv"])
def test_resident_batches_compute_a_group_while_the_next_loads(fn: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # a decode step at context 1024 (8 KV heads, 4 query rows each, head dim 64, bf16): 1 MiB of K or V. The
    # heads load in four groups on flags of their own, so the MXU starts on the first group while the others
    # still stream in, and a group's stores go along the next group's MXU work; same bits as one group
    g = torch.Generator().manual_seed(5)
    q = torch.randn(8, 4, 64, generator=g).bfloat16()
    kv = torch.randn(8, 1024, 64, generator=g).bfloat16()
    p = torch.softmax(torch.randn(8, 4, 1024, generator=g), -1).bfloat16()
    kv[7, 1023, 63], kv[2, 500, 0], kv[5, 9, 9] = float("inf"), float("nan"), -0.0  # in the last, middle groups
    args = [q, kv] if fn == "qk" else [p, kv]
    fn_ = _bmm_kt if fn == "qk" else torch.matmul
    inputs = [t.float().numpy() for t in args]
    cg = compile_graph(trace(fn_, *args), args, "large")
    (out,) = run_with_poisoned_vmem(cg, inputs)
    _, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
    a, b = (t.double() for t in args)
    ref = (a @ b.transpose(-1, -2) if fn == "qk" else a @ b).numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(isel_matmul, "RESIDENT_FLAGS", ((isel_matmul.Flag.LOAD, 0),))  # one group: all, then MXU
    whole = compile_graph(trace(fn_, *args), args, "large")
    (out_whole,), whole_stats = run_fresh(whole, inputs, SimulatorRunner("large"))
    np.testing.assert_array_equal(out.view(np.uint32), out_whole.view(np.uint32))
    assert stats.cycles < whole_stats.cycles - 500


@pytest.mark.parametrize(("rows", "d", "halves"), [(2, 128, True), (4, 64, False)], ids=["qwen3", "llama-1b"])
@pytest.mark.parametrize("fn", ["qk", "pv"])
def test_the_last_group_of_resident_batches_is_one_batch_whose_weights_land_in_halves(
        fn: str, rows: int, d: int, halves: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step at context 1024 on `large`: 8 KV heads of bf16 K or V, in four groups. Every head's query
    rows (or probabilities) move in one DMA, and where the MXU takes a head's weights in at most half the
    time HBM delivers them (Qwen3: 2 query rows a head, head dim 128, 16 weight tiles of 16 cycles against
    256 cycles of transfer) the groups shrink to a last one of one head whose K or V lands in halves: the
    MXU keeps up, and its tail after the last byte is half a head's work. The 1B's head dim 64 fills half a
    weight tile (128 cycles of MXU against 128 of HBM): even groups stay. Specials on both sides of the last
    head's split, and in the first group; the same bits as with a DMA a head and even groups, and on vmem
    poisoned with NaN."""
    g = torch.Generator().manual_seed(7)
    a = (torch.randn(8, rows, d, generator=g) if fn == "qk"
         else torch.softmax(torch.randn(8, rows, 1024, generator=g), -1)).bfloat16()
    kv = torch.randn(8, 1024, d, generator=g).bfloat16()
    kv[7, 511, 3], kv[7, 512, 5], kv[7, 1023, d - 1] = float("inf"), float("nan"), -0.0  # the last head's halves
    kv[0, 0, 0] = -float("inf")
    a[3, 0, :2] = torch.tensor([-0.0, 1e-39])  # a signed zero and a subnormal
    args = [a, kv]
    fn_ = _bmm_kt if fn == "qk" else torch.matmul
    inputs = [t.float().numpy() for t in args]

    def build() -> tuple[np.ndarray, Any]:
        cg = compile_graph(trace(fn_, *args), args, "large")
        (out,), stats = run_fresh(cg, inputs, SimulatorRunner("large"))
        (poisoned,) = run_with_poisoned_vmem(cg, inputs)
        np.testing.assert_array_equal(poisoned.view(np.uint32), out.view(np.uint32))
        return out, stats

    out, stats = build()
    x, w = (t.double() for t in args)
    ref = (x @ w.transpose(-1, -2) if fn == "qk" else x @ w).numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=2e-2, atol=2e-2)
    # the argument table, every head's A in one, K or V a head (the last in two halves), C a head
    assert stats.dma_commands == 1 + 1 + 8 + halves + 8
    monkeypatch.setattr(isel_matmul, "JOINT_A", False)
    monkeypatch.setattr(isel_matmul, "LAST_HALVES", False)
    before, before_stats = build()
    np.testing.assert_array_equal(out.view(np.uint32), before.view(np.uint32))
    assert before_stats.dma_commands == 1 + 8 + 8 + 8
    # measured: Qwen3's 3,958 against 4,093 (q @ K^T) and 3,983 against 4,111 (P @ V); the 1B's within 20
    if halves:
        assert stats.cycles < before_stats.cycles - 100, (stats.cycles, before_stats.cycles)
    else:
        assert stats.cycles < before_stats.cycles + 30, (stats.cycles, before_stats.cycles)


def _bmm(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.bmm(p, v)


@pytest.mark.parametrize("op", ["q @ K^T", "P @ V"])
def test_resident_batches_run_in_rounds_when_vmem_holds_only_some(op: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # context 4096: 8 KV heads' K or V (4 MiB of bf16) take more vmem than `large` has, so the heads run in
    # rounds: A and C have regions of every head, K or V panels three groups of slots in turn, a round's
    # loads issued as soon as the weight loads of the round three before have read its slots, its stores
    # along the next round's MXU work (`_resident_rounds`, by_batch). The batch loop paid a DMA latency per
    # head and n-tile (71,270 cycles a kernel on the 1B geometry); rounds that each waited for the last one's
    # stores took 14,837 here, double-buffered rounds 7,849 (q @ K^T), a DMA latency a round. Poisoned vmem
    # checks that no round reads rows an earlier one left (the zeroed rows) or one another group is loading
    rounds: list[tuple[int, int, bool]] = []
    real = isel_matmul._resident_rounds
    monkeypatch.setattr(isel_matmul, "_resident_rounds",
                        lambda ctx, B, R, *rest: rounds.append((B, R, rest[-1])) or real(ctx, B, R, *rest))
    g = torch.Generator().manual_seed(6)
    if op == "q @ K^T":
        a, b = torch.randn(8, 4, 64, generator=g).bfloat16(), torch.randn(8, 4096, 64, generator=g).bfloat16()
        fn, ref_fn = _bmm_kt, lambda x, y: x @ y.transpose(1, 2)
    else:
        a, b = torch.randn(8, 4, 4096, generator=g).bfloat16(), torch.randn(8, 4096, 64, generator=g).bfloat16()
        fn, ref_fn = _bmm, lambda x, y: x @ y
    b[7, 4095, 0], b[6, 17, 3], b[0, 0, 0] = float("inf"), float("nan"), -0.0  # the last round's included
    args = [a, b]
    cg = compile_graph(trace(fn, *args), args, "large")
    assert [k["kind"] for k in cg.summary["kernels"]] == ["matmul"]
    (B, R, by_batch), = rounds
    assert by_batch and -(-B // (R // isel_matmul.ROUND_DEPTH)) > isel_matmul.ROUND_DEPTH  # every group reused
    (out,) = run_with_poisoned_vmem(cg, [t.float().numpy() for t in args])
    _, stats = run_fresh(cg, [t.float().numpy() for t in args], SimulatorRunner("large"))
    ref = ref_fn(a.double(), b.double()).numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    np.testing.assert_array_equal(np.isinf(out), np.isinf(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=2e-2, atol=2e-2)
    # the argument table; a head's A in one DMA and its K or V rows in two halves (one a 128-key n-tile
    # before: issuing their address arithmetic bound the kernel; halves: the MXU starts on the first); a
    # head's C in one DMA, row-major (`_mxu_by_row`; it was one a 128-key n-tile, 8 * 32 commands and 8,835
    # cycles)
    assert stats.dma_commands == 1 + 8 * 3 + 8
    # measured 6,345 and 6,397 (6,564 and 6,653 with whole heads): the argument table's latency (500), the
    # first half head's (500 + 256), the weight port busy from then on (256 tiles of 16 cycles, 4,096 cycles:
    # as long as the heads' DMA) and the program's end waiting for the last stores
    assert stats.cycles < 6_550


# ---- fp32 x bf16: an operand loaded from bf16 has no residual parts ----------------------------------------
# issue 13: attention with fp32 queries over a bf16 KV cache multiplies fp32 operands by bf16 K and V (the
# cast fused into the matmul's load); at "highest" it ran all 6 bf16 passes, 3 of them against the bf16
# operand's residual parts, which are exact zeros.
@pytest.mark.parametrize(("queries", "precision"), [
    (1, "highest"),  # a decode step: every KV head's matmuls resident, hi carries nothing non-finite
    (40, "highest"),  # a prefill: the m-tile path, with a separate finite-only hi beside hi_full
    (40, "high"),
], ids=str)
def test_passes_against_a_bf16_operand_give_the_same_bits(queries: int, precision: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    import fx_passes.ops  # noqa: F401  (registers torch.ops.ctpu; codegen itself never imports fx_passes)

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, n, 64, generator=gen) for h, n in ((16, queries), (4, 300), (4, 300)))
    k, v = k.bfloat16(), v.bfloat16()
    q[0, 1, 0, 7] = float("inf")
    k[0, 0, 3, 5] = float("inf")
    v[0, 1, 7, 1], v[0, 0, 9, 2], v[0, 2, 11, 3] = float("nan"), float("inf"), -3e38
    v[0, 3, 13, 4] = 1e-39  # subnormal in fp32, 0 once the MXU's bf16 operand flushes it (both ways alike)

    def attention(q, k, v):
        return torch.ops.ctpu.attention(q, k, v, None, True, 0.125, True)

    def run() -> tuple[np.ndarray, int]:
        cg = compile_graph(trace(attention, q, k, v), [q, k, v], "large", matmul_precision=precision)
        (out,), stats = run_fresh(cg, [t.float().numpy() for t in (q, k, v)], SimulatorRunner("large"))
        return out, stats.cycles

    out, cycles = run()
    every_pass = isel_matmul._passes
    monkeypatch.setattr(isel_matmul, "_passes", lambda p, names, hi_full, a_bf16, b_bf16:
                        every_pass(p, names, hi_full, False, False))
    out_all, cycles_all = run()
    np.testing.assert_array_equal(out.view(np.uint32), out_all.view(np.uint32))
    assert np.isnan(out).any() and np.isinf(out).any()
    assert cycles < cycles_all


def test_a_bf16_operand_drops_only_passes_through_its_zero_parts() -> None:
    names = ["hi_full", "mid", "lo"]  # no separate hi: lo carries the non-finite values
    assert isel_matmul._passes("highest", names, False, False, True) == [(2, 0), (0, 2), (1, 0), (0, 0)]
    assert isel_matmul._passes("highest", names, False, True, False) == [(2, 0), (0, 2), (0, 1), (0, 0)]
    assert isel_matmul._passes("highest", [*names, "hi"], True, False, True) == [(2, 3), (1, 3), (0, 0)]
    assert isel_matmul._passes("high", ["hi_full", "mid"], False, False, True) == [(1, 0), (0, 1), (0, 0)]
    assert isel_matmul._passes("high", ["hi_full", "mid", "hi"], True, False, True) == [(1, 2), (0, 0)]
    assert len(isel_matmul._passes("highest", names, False, False, False)) == 6


# ---- runtime row counts: a dynamic-shape bucket's padded M (issue 14) ------------------------------------
RUNTIME_ROWS = [  # (config, batch, M, K, N, dtype, valid rows)
    ("large", 0, 64, 300, 200, torch.bfloat16, 37),  # one m-tile, K and N past whole tiles
    pytest.param("large", 0, 512, 8192, 256, torch.bfloat16, 300,  # m-tiles of 128 rows (down_proj's K)
                 marks=pytest.mark.slow),
    ("large", 0, 256, 4096, 128, torch.bfloat16, 131),  # m-tiles of 2 x 128 rows: a partial second one
    ("large", 0, 256, 2048, 384, torch.bfloat16, 129),  # one m-tile of 256 rows, its first n-tiles pipelined
    ("large", 0, 48, 40, 24, torch.float32, 48),  # every row valid
    ("small", 0, 40, 20, 12, torch.float32, 17),  # fp32 "highest": the split parts
    ("small", 2, 24, 16, 8, torch.float32, 9),  # bmm: the valid rows of each batch
    ("large", 0, 33, 64, 64, torch.bfloat16, 0),  # a count of 0 computes one row, never none or all
]


@pytest.mark.parametrize(("config", "batch", "m", "k", "n", "dtype", "valid"), RUNTIME_ROWS,
                         ids=lambda v: str(v).replace("torch.", ""))
def test_runtime_rows_give_the_static_bits_and_leave_the_padding(config: str, batch: int, m: int, k: int, n: int,
                                                                 dtype: torch.dtype, valid: int) -> None:
    """A matmul whose FX node carries fx_passes' padding mark (PADDING_META: rows past a runtime value are
    padding nothing reads) computes only those rows, reading the count from the argument table: its rows
    have the bits of the same matmul compiled without the mark (edge values among them), its padding rows
    hold NaN and inf in A and are never read (C's rows there stay as the fresh arena left them: zeros), and
    it takes fewer cycles when rows are left out."""
    g = torch.Generator().manual_seed(m + k)
    lead = (batch,) if batch else ()
    a = torch.randn(*lead, m, k, generator=g).to(dtype)
    w = torch.randn(*lead, k, n, generator=g).to(dtype)
    a[..., 0, :4] = torch.tensor([float("inf"), -0.0, 1e-39, float("nan")])
    rows = max(valid, 1)
    a[..., rows:, ::2], a[..., rows:, 1::2] = float("nan"), float("inf")
    count = torch.tensor(valid, dtype=torch.int32)
    gm = trace(lambda a, w, count: a @ w, a, w, count)
    static = compile_graph(gm, [a, w, count], config, matmul_precision="highest")
    (mm,) = [node for node in gm.graph.nodes if node.target in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)]
    mm.meta["ctpu_padding"] = {-2: list(gm.graph.nodes)[2].name}
    dynamic = compile_graph(gm, [a, w, count], config, matmul_precision="highest")
    assert dynamic.value_inputs == [2] and static.value_inputs == []
    inputs = [a.float().numpy(), w.float().numpy(), count.numpy()]
    (want,), static_stats = run_fresh(static, inputs, SimulatorRunner(config))
    (got,), stats = run_fresh(dynamic, inputs, SimulatorRunner(config))
    np.testing.assert_array_equal(got[..., :rows, :].view(np.uint32), want[..., :rows, :].view(np.uint32))
    np.testing.assert_array_equal(got[..., rows:, :], 0.0)
    if rows < m:
        assert stats.cycles < static_stats.cycles


def _softmax_then_values(scores: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return torch.bmm(torch.softmax(scores, -1).bfloat16(), v)


def _probabilities_and_values(context: int) -> list[torch.Tensor]:
    """Qwen3's decode attention after its scores: 8 KV heads of 2 query rows, head dim 128, `context` keys;
    specials in the first head's values, which the kernel before P @ V loads."""
    g = torch.Generator().manual_seed(9)
    scores = torch.randn(8, 2, context, generator=g)
    scores[0, 0, :3] = torch.tensor([-float("inf"), 3e4, -1e-40])
    v = torch.randn(8, context, 128, generator=g).bfloat16()
    v[0, 0, 0], v[0, context // 2, 1], v[0, context - 1, 127] = -0.0, 1e-39, 3e38
    v[7, 1, 2] = float("nan")
    return [scores, v]


@pytest.mark.parametrize("context", [1024, 4096])
def test_the_kernel_before_resident_batches_loads_their_first_weights(
        context: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode's softmax computes with the channel idle (~1,100 cycles a layer at 4096 positions, ~150 at
    1024) while P @ V waits for its first head's values. The kernel before now loads them, behind its own
    loads, into rows at its top, and leaves the DMA in flight (`first_batch_weights`,
    `KernelContext.preload`): P @ V takes the rows as its first slot's panel and waits for them only before
    that head's MXU work. One round in groups (1024 positions) and rounds of a head (4096, where the values
    fill vmem: the taken rows count as the slot they are). The same bits as loading them itself, on vmem
    poisoned with NaN too; eager's values; measured 5,282 against 5,538 cycles at 1024 and 13,161 against
    14,185 at 4096."""
    args = _probabilities_and_values(context)
    inputs = [t.float().numpy() for t in args]

    def build() -> tuple[np.ndarray, int, list[Any]]:
        cg = compile_graph(trace(_softmax_then_values, *args), args, "large")
        (out,), stats = run_fresh(cg, inputs, SimulatorRunner("large"))
        (poisoned,) = run_with_poisoned_vmem(cg, inputs)
        np.testing.assert_array_equal(poisoned.view(np.uint32), out.view(np.uint32))
        matmul = cg.summary["kernels"][-1]
        assert matmul["kind"] == "matmul"
        return out, stats.cycles, matmul.get("vmem_resident") or []

    out, cycles, taken = build()
    assert len(taken) == 1 and taken[0][1] - taken[0][0] == context, taken  # the first head's values
    ref = (torch.softmax(args[0], -1).bfloat16().double() @ args[1].double()).numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=2e-2, atol=2e-2 * np.abs(ref[finite]).max())
    monkeypatch.setattr(isel_matmul, "PRELOAD_FIRST_B", False)
    out_off, cycles_off, taken_off = build()
    assert taken_off == []
    np.testing.assert_array_equal(out.view(np.uint32), out_off.view(np.uint32))
    assert cycles < cycles_off - 200, (cycles, cycles_off)


def test_a_function_that_does_not_take_a_preload_in_flight_waits_for_it_first(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the kernel after does not take the rows a preload left in flight (here: P @ V told not to), they
    are its vmem like any other: it waits for the DMA (COPY) before anything else, so that no late row
    lands on its own; one that takes them waits only before it reads them. The same bits as without the
    preload, on vmem poisoned with NaN too."""
    import re

    from codegen import compiler
    from codegen.isel_common import Flag

    args = _probabilities_and_values(1024)
    inputs = [t.float().numpy() for t in args]

    def build() -> tuple[np.ndarray, str]:
        cg = compile_graph(trace(_softmax_then_values, *args), args, "large")
        (out,), _ = run_fresh(cg, inputs, SimulatorRunner("large"))
        (poisoned,) = run_with_poisoned_vmem(cg, inputs)
        np.testing.assert_array_equal(poisoned.view(np.uint32), out.view(np.uint32))
        program = cg.stages["program.s"]
        last = list(re.finditer(r"^k\d+_\d+:\n", program, re.M))[-1]  # P @ V's function
        return out, program[last.end():].split("\n", 1)[0]

    starts_with_wait = re.compile(rf"\s*wait f{int(Flag.COPY)}\b")
    out, first = build()
    assert not starts_with_wait.match(first), first
    monkeypatch.setattr(isel_matmul, "first_batch_weights", lambda *_: None)  # the taker's; not the compiler's
    assert compiler.first_batch_weights is not isel_matmul.first_batch_weights
    out_untaken, first = build()
    assert starts_with_wait.match(first), first
    monkeypatch.setattr(compiler, "first_batch_weights", lambda *_: None)
    out_off, first = build()
    assert not starts_with_wait.match(first), first
    for other in (out_untaken, out_off):
        np.testing.assert_array_equal(out.view(np.uint32), other.view(np.uint32))


def test_the_next_weight_tile_loads_ahead_of_the_last_c_tiles_store() -> None:
    """Attention's q @ K^T shape, batched by KV head ([8, 1024, 64] @ [8, 64, 1536], bf16, `large`): in the
    n-tile loop, the next key tile's DMA is issued before the previous C tile's store (behind the store's
    transfer in the channel, it waited that out and then its own latency while the MXU idled), and a weight
    load before the wait for the store of the C tile its stream overwrites (the load does not touch C).
    110,769 cycles against 111,697 before (98,304 MXU rows); in f32, one 1B layer's q @ K^T 124,116 ->
    122,780."""
    torch.manual_seed(0)
    q, k = torch.randn(8, 1024, 64).bfloat16(), torch.randn(8, 1536, 64).bfloat16()

    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.bmm(q, k.transpose(1, 2))

    cg = compile_graph(trace(scores, q, k), [q, k], "large")
    (out,), stats = run_fresh(cg, [q.float().numpy(), k.float().numpy()], SimulatorRunner("large"))
    np.testing.assert_allclose(out, scores(q, k).float().numpy(), rtol=1e-2, atol=6.3e-2)
    lines = cg.stages["program.s"].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ntile_"))
    body = lines[start + 1:next(i for i in range(start, len(lines)) if "bnz" in lines[i])]

    def first(text: str) -> int:
        return next(i for i, line in enumerate(body) if text in line)
    assert first("dma.ld") < first("dma.st"), body
    assert first("mxu.lwt") < first("wait f2"), body
    assert stats.cycles < 108_000


def test_a_long_k_projection_keeps_the_mxu_streaming_across_its_n_tiles() -> None:
    """The 1B geometry's down_proj (K = 8192, N = 2048, bf16, `large`) over 256 rows: A's m-tile over all of
    K leaves room for m-tiles of 128 rows, so a command streams 128 rows, less than the MXU's drain (2N).
    Each n-tile issues the commands that cover that drain before the previous C tile's store waits for it
    (with one, the MXU ran dry: 167 cycles an n-tile), the panel stream moves two k-tiles a command (its
    last DMA's latency ran past the step), and the pipelined start loads panel 2 along C tile 1's last
    commands (at once, the DMA queue held the instruction stream while the MXU ran out: ~2,300 cycles an
    m-tile). 274,129 -> 266,215 cycles (262,144 MXU rows); the 2,048-row down_proj 2,185,704 -> 2,123,188."""
    torch.manual_seed(0)
    x, w = torch.randn(256, 8192).bfloat16(), torch.randn(2048, 8192).bfloat16()

    def down(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.t()

    cg = compile_graph(trace(down, x, w), [x, w], "large")
    runner = SimulatorRunner("large")
    runner.simulator.profile = True
    (out,), stats = run_fresh(cg, [x.float().numpy(), w.float().numpy()], runner)
    ref = down(x.float(), w.float()).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-2, atol=0.3)
    streams = runner.simulator.recording.streams  # (pc, start, stream end, done, macs)
    idle = [nxt[1] - cur[2] for cur, nxt in itertools.pairwise(streams) if nxt[1] > cur[2]]
    assert len(idle) <= 12 and sum(idle) < 3_000, idle  # the m-tile starts; before, a gap every n-tile
    assert stats.cycles < 268_000


def test_a_short_m_tile_issues_its_next_panels_loads_first() -> None:
    """A 17-token prefill's gate_proj ([17, 2048] @ [2048, 8192]^T, bf16, `large`): a command of 24 rows is
    shorter than its weight tile's DMA, so HBM binds. The next panel's loads then go right after a step's
    first command and all at once: issued after the commands that cover the previous tile's drain, or two a
    command, they left HBM idle (81,644 cycles against 67,319)."""
    torch.manual_seed(0)
    x, w = torch.randn(17, 2048).bfloat16(), torch.randn(8192, 2048).bfloat16()

    def gate(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x @ w.t()

    cg = compile_graph(trace(gate, x, w), [x, w], "large")
    (out,), stats = run_fresh(cg, [x.float().numpy(), w.float().numpy()], SimulatorRunner("large"))
    np.testing.assert_allclose(out, gate(x.float(), w.float()).numpy(), rtol=1e-2, atol=0.2)
    assert stats.cycles < 67_500

def test_q_k_t_keeps_the_mxu_streaming_within_and_across_its_batches() -> None:
    """The same q @ K^T shape. Within a batch: an n-tile of one MXU command runs it in two pieces of rows
    and stores its C tile by the same pieces, each once its own rows are done (stored whole after the
    tile's drain, a C tile took its transfer and the DMA latency, longer than the other tile's stream, and
    the MXU waited ~240 cycles a key tile: 110,769 -> 107,185 cycles). Across batches: each batch loads the
    next one's A (into a second buffer) and first key tile behind its last MXU command, so a batch starts
    after the last one's drain, not after its own loads' latency too (~1,000 -> ~280 cycles idle a batch:
    107,185 -> 102,234 cycles; 98,304 MXU rows). One 1B layer's attention at 2048 tokens: 2,985,599 ->
    2,903,319 cycles with the pieces, q @ K^T at 80% -> 91% of its MXU bound."""
    torch.manual_seed(0)
    q, k = torch.randn(8, 1024, 64).bfloat16(), torch.randn(8, 1536, 64).bfloat16()

    def scores(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return torch.bmm(q, k.transpose(1, 2))

    cg = compile_graph(trace(scores, q, k), [q, k], "large")
    runner = SimulatorRunner("large")
    runner.simulator.profile = True
    (out,), stats = run_fresh(cg, [q.float().numpy(), k.float().numpy()], runner)
    np.testing.assert_allclose(out, scores(q, k).float().numpy(), rtol=1e-2, atol=6.3e-2)
    lines = cg.stages["program.s"].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("ntile_"))
    body = " ; ".join(lines[start + 1:next(i for i in range(start, len(lines)) if "bnz" in lines[i])])
    assert body.count("mxu.mm") == 4 and body.count("dma.st") == 4, body  # two n-tiles a loop run
    streams = runner.simulator.recording.streams  # (pc, start, stream end, done, macs)
    assert len(streams) == 8 * 12 * 2
    gaps = [nxt[1] - cur[2] for cur, nxt in itertools.pairwise(streams)]
    batch_starts = [i for i, gap in enumerate(gaps) if gap > 0]
    assert len(batch_starts) == 7 and all(i % 24 == 23 for i in batch_starts), gaps
    assert all(gaps[i] < 2 * 128 + 32 for i in batch_starts), [gaps[i] for i in batch_starts]  # the drain
    assert stats.cycles < 103_000


def test_p_v_batches_start_while_the_batch_before_ends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Attention's P @ V at 1,536 keys: 8 batches of [1024, 1536] @ [1536, 64], one n-tile, A loaded by a
    pipelined start. Each batch issues the next one's first two load groups once every command but its
    last is done, computes into C tile i % 2 and leaves its C store to the next batch, after that one's
    first command (`START_AHEAD`): the MXU streams from the first batch to the last with no gap (each batch
    waited ~600-960 cycles for its first group's DMA latency: 105,954 -> 99,174 cycles, 98,304 MXU rows).
    The same bits as batch by batch, with NaN, inf and the largest finite values in some batches only."""
    torch.manual_seed(0)
    p, v = torch.rand(8, 1024, 1536).bfloat16(), torch.randn(8, 1536, 64).bfloat16()
    p[1, 5, 7], p[2, 1023, 0], v[3, 1535, 63], v[4, 0, 0] = float("nan"), float("inf"), float("-inf"), 3e38
    p[6, 100:140] = 0.0  # rows of zeros against batch 6's values
    inputs = [p.float().numpy(), v.float().numpy()]

    def pv(p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.bmm(p, v).float()

    def run(start_ahead: bool) -> tuple[np.ndarray, list[tuple[int, ...]]]:
        monkeypatch.setattr(isel_matmul, "START_AHEAD", start_ahead)
        cg = compile_graph(trace(pv, p, v), [p, v], "large")
        runner = SimulatorRunner("large")
        runner.simulator.profile = True
        (out,), _ = run_fresh(cg, inputs, runner)
        return out, runner.simulator.recording.streams

    out, streams = run(True)
    before, streams_before = run(False)
    np.testing.assert_array_equal(out.view(np.uint32), before.view(np.uint32))
    ref = pv(p, v).numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=1e-2, atol=0.5)
    assert np.isnan(out[1, 5]).all() and not np.isnan(out[0]).any() and not np.isnan(out[5]).any()

    def gaps(streams: list[tuple[int, ...]]) -> list[int]:  # (pc, start, stream end, done, macs)
        return [nxt[1] - cur[2] for cur, nxt in itertools.pairwise(sorted(streams, key=lambda s: s[1]))]

    assert len(streams) == len(streams_before)
    assert max(gaps(streams)) <= 0, gaps(streams)
    assert sum(g for g in gaps(streams_before) if g > 0) > 7 * 500  # batch by batch: a latency each
    mxu_rows = 8 * 1024 * 12
    assert streams[-1][2] - streams[0][1] == mxu_rows
