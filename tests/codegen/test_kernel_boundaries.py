"""What a kernel boundary costs (issue 13): a kernel's last stores drain while the next kernel starts, a fill
that the next kernel overwrites whole is folded into it, and the small kernels before a decode projection
load its first weights.

Each kernel used to end waiting on all of its flags, so every boundary paid a store's DMA latency before
the next kernel's loads could even issue: two latencies a kernel, 500 cycles each on `large`. A decode
step is a chain of ~100 kernels, most of them moving a few KiB."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np
import pytest
import torch
from codegen_helpers import capture_with_mutations, compile_and_run, run_with_poisoned_vmem, trace

import fx_passes
from codegen import compile_graph, compiler, isel_common, isel_decode, isel_matmul, isel_vector
from codegen.builder import Builder
from codegen.errors import CapacityError
from codegen.isel_common import STORE_FLAGS, Flag, guard_stores_in_flight
from codegen.isel_decode import plan_prefetches
from codegen.isel_vector import KernelChain
from codegen.kernel_graph import (
    Access,
    Buffer,
    FillKernel,
    GenericKernel,
    KernelGraph,
    MatmulKernel,
    ScalarProgram,
    ScatterKernel,
    View,
)
from codegen.mir import Function, Mem
from device_sim.config import get_config
from device_sim.executable import Executable, RunStats, run_fresh
from device_sim.runners import SimulatorRunner


def _waits(func: Function) -> list[int]:
    return [i.flag for i in func.blocks[0].instrs if i.op == "wait"]


def test_a_kernel_that_writes_vmem_first_waits_for_the_stores_in_flight() -> None:
    f = Function()
    b = Builder(f)
    b.vst(b.vconst(0.0), b.const(0), 64, Mem("out", 0, 8, True))  # a fill: vmem written before any load
    guard_stores_in_flight(f)
    ops = [i.op for i in f.blocks[0].instrs]
    assert _waits(f) == list(STORE_FLAGS)
    assert ops.index("vst") > max(k for k, op in enumerate(ops) if op == "wait")


def test_a_wait_on_its_own_load_covers_the_stores_in_flight() -> None:
    # one DMA channel completes commands in issue order: this kernel's load lands after the stores before it
    f = Function()
    b = Builder(f)
    shape = b.const(8 << 16 | 8)
    b.emit("dma.ld", None, (b.const(0), b.const(64), shape, b.const(8)), flag=Flag.LOAD, mem=(Mem("in", write=True),))
    b.emit("wait", flag=Flag.LOAD)
    b.vst(b.vld(b.const(0), 64, Mem("in", 0, 8)), b.const(0), 128, Mem("out", 0, 8, True))
    guard_stores_in_flight(f)
    assert _waits(f) == [Flag.LOAD]


def test_a_loops_footer_waits_for_the_bodys_last_stores_only_where_the_next_run_writes_their_rows() -> None:
    """A layer loop's header and the body's first kernels run after the footer with the body's last stores in
    flight, compiled to expect others (the kernel's before the loop). The footer waits for them only where
    that code may write their rows before it waits them out: on a DMA of its own (the channel completes in
    order) or on the store flags (a guard). Where it does not wait, their spill slots move off those rows."""
    base = isel_common.SPILL_ROWS
    regions = {"out": base + 200, "in": base + 300, "low": base + 40}

    def kernel(*steps: str) -> Function:
        f = Function(spill_rows=(*range(0, base, 8), base + 200, base + 400))
        b = Builder(f)
        shape = b.const(8 << 16 | 8)
        for step in steps:
            if step == "load":
                b.emit("dma.ld", None, (b.const(0), b.const(64), shape, b.const(8)), flag=Flag.LOAD,
                       mem=(Mem("in", write=True),))
            elif step == "wait":
                b.emit("wait", flag=Flag.LOAD)
            elif step == "guard":
                b.block.instrs.extend(isel_common.wait_for_stores())
            elif step == "loop":
                b.emit("bnz", None, (b.const(1),), target="x")
            else:  # a vector store to that region
                b.vst(b.vconst(0.0), b.const(0), 64, Mem(step, 0, 8, True))
        return f

    def rows_of(m: Mem) -> tuple[int, int]:
        return regions[m.region] + m.lo, regions[m.region] + (8 if m.hi is None else m.hi)

    def drains(*kernels: Function, stores: isel_common.Rows = [(base + 200, base + 208)]) -> bool:  # noqa: B006
        runs = [(f, isel_common.uncovered_writes(f, rows_of)) for f in kernels]
        return not isel_common.stay_in_flight(runs, stores)

    assert drains(kernel("out", "load", "wait"))  # writes the stores' rows first
    assert drains(kernel("low", "loop", "low"))  # after a branch: any row
    assert drains(kernel("low"), kernel("low"))  # never waits them out
    assert drains(kernel("low", "load", "wait"), stores=[(base + 40, base + 48)])
    header, first = kernel(), kernel("low", "load", "wait", "out")
    assert not drains(header, first)  # waits on its own load before it writes the stores' rows
    assert first.spill_rows == (*range(0, base, 8), base + 400)  # its slot on those rows moved
    assert header.spill_rows == first.spill_rows
    assert not drains(kernel("low", "guard", "out"))  # a guard's wait on the store flags covers them too
    assert drains(kernel("low", "guard", "out"), stores=None)  # rows not known


@pytest.mark.parametrize("writes_first", [False, True])
def test_a_loop_that_loads_and_waits_first_covers_the_stores_in_flight(writes_first: bool) -> None:
    # a matmul over a runtime count of m-tiles: its entry block only sets registers up and falls into the
    # loop, whose first block loads, waits, then writes vmem: that wait covers the earlier stores on the first
    # run (the channel completes in order), so no store wait (it cost the previous kernel's store latency).
    # A loop that writes vmem before its wait gets them at the entry's end, outside the loop
    f = Function()
    b = Builder(f)
    shape = b.const(8 << 16 | 8)

    def body() -> None:
        if writes_first:
            b.vst(b.vconst(0.0), b.const(0), 256, Mem("zeroed", 0, 8, True))
        b.emit("dma.ld", None, (b.const(0), b.const(64), shape, b.const(8)), flag=Flag.LOAD,
               mem=(Mem("in", write=True),))
        b.emit("wait", flag=Flag.LOAD)
        b.vst(b.vld(b.const(0), 64, Mem("in", 0, 8)), b.const(0), 128, Mem("out", 0, 8, True))

    b.counted_loop(3, body, "mtile")
    assert guard_stores_in_flight(f) == writes_first
    assert _waits(f) == (list(STORE_FLAGS) if writes_first else [])
    assert all(i.op != "wait" or i.flag not in STORE_FLAGS for blk in f.blocks[1:] for i in blk.instrs)


def test_a_chain_of_small_kernels_pays_one_latency() -> None:
    # three reductions in a chain, each reading the one before: on `large` (latency 500) they lower as one
    # KernelChain: every load issued at once and waited for once, a member reading what the one before it
    # wrote from its output tile in vmem; each member still stores its output
    def chain(x: torch.Tensor) -> torch.Tensor:
        s = x.sum(-1, keepdim=True)
        m = (x / s).amax(-1, keepdim=True)
        return (x - m).exp().sum(-1)

    x = torch.rand(5, 40) + 0.5  # little work: the cycles are the latencies
    x[0, 3] = float("nan")  # a NaN row stays NaN through the forwarded tiles
    x[1] = 1e-40  # subnormal rows
    outs, refs, cg = compile_and_run(chain, x, config="large")
    np.testing.assert_allclose(outs[0], refs[0], rtol=1e-5)
    kernels = cg.summary["kernels"]
    assert [k.get("chained_into") for k in kernels] == [None, 0, 0]
    assert [k["bundles"] > 0 for k in kernels] == [True, False, False]
    # the argument table, the chain's loads and its last store: three latencies and the work (1,661 cycles;
    # 2,689 when each kernel waited for its own loads, 3,687 when every kernel also waited for its stores)
    assert cg.last_stats.cycles < 4 * cg.hardware.dma_latency


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fills_are_folded_into_the_reductions_they_initialize(dtype: torch.dtype) -> None:
    # the sum's 0 and the max's -inf become the reductions' initial values: no fill kernel, and the edge
    # rows still reduce as eager does (all -inf, a NaN, +-0, the largest finite values)
    x = torch.randn(9, 300, generator=torch.Generator().manual_seed(0)).to(dtype)
    x[1] = float("-inf")
    x[2, 7] = float("nan")
    x[3] = -0.0
    x[4, :2] = torch.finfo(dtype).max

    def stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.float().sum(-1), x.float().amax(-1)

    cg = compile_graph(trace(stats, x), [x], "large")
    assert "fill" not in [k["kind"] for k in cg.summary["kernels"]]
    outs = run_with_poisoned_vmem(cg, [x.float().numpy()])
    for out, ref in zip(outs, stats(x), strict=True):  # a sum's order differs from eager's: an ulp of its terms
        np.testing.assert_allclose(out, ref.numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(np.signbit(out[3]), np.signbit(ref[3].numpy()))


def _norm_then_project(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    h = xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)
    return torch.nn.functional.linear(h.bfloat16(), w)


def test_the_kernels_before_a_decode_projection_prefetch_its_first_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    # RMSNorm then x[1, 2048] @ W.T (W [2048, 2048] bf16) on `large`: the norm's small kernels load the
    # projection's first two weight groups while they wait for their own loads; same bits, fewer cycles
    torch.manual_seed(0)
    x, w = torch.randn(1, 2048).bfloat16(), (torch.randn(2048, 2048) / 45).bfloat16()
    w[5, 7], w[9, 3] = float("inf"), float("nan")  # in the first group: they reach their columns
    inputs = [x.float().numpy(), w.float().numpy()]
    cg = compile_graph(trace(_norm_then_project, x, w), [x, w], "large")
    kernels = [k for k in cg.summary["kernels"] if k.get("bundles")]
    assert [k["kind"] for k in kernels][-1] == "matmul" and all("vmem_carried" in k for k in kernels)
    (out,) = run_with_poisoned_vmem(cg, inputs)  # the prefetched rows are the only vmem kept
    _, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
    monkeypatch.setattr(compiler, "plan_prefetches", lambda *_: {})
    plain = compile_graph(trace(_norm_then_project, x, w), [x, w], "large")
    (out_plain,), plain_stats = run_fresh(plain, inputs, SimulatorRunner("large"))
    np.testing.assert_array_equal(out.view(np.uint32), out_plain.view(np.uint32))
    assert np.isinf(out[0, 5]) and np.isnan(out[0, 9])
    ref = _norm_then_project(x, w).float().numpy()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=2e-2, atol=2e-2)
    # the first group lands during the norm instead of a group's transfer and a latency into the stream
    assert stats.cycles < plain_stats.cycles - cg.hardware.dma_latency


def test_a_chain_that_cannot_be_allocated_compiles_as_its_members(monkeypatch: pytest.MonkeyPatch) -> None:
    # a chain's members share one block, where the list scheduler may interleave them past what registers
    # hold (the mini Llama's two rope range reductions did: its norm and q projection ran on the CPU); the
    # graph is then compiled again with every member a kernel of its own, and says so in its summary
    real = compiler.compile_functions

    def refuse_chains(funcs: list[Function], **kw: object) -> object:
        if any("KernelChain" in f.name for f in funcs):
            raise CapacityError("register allocation did not converge")
        return real(funcs, **kw)

    monkeypatch.setattr(compiler, "compile_functions", refuse_chains)

    def chain(x: torch.Tensor) -> torch.Tensor:
        return (x - x.amax(-1, keepdim=True)).exp().sum(-1)

    x = torch.randn(5, 40)
    x[2] = float("-inf")
    outs, refs, cg = compile_and_run(chain, x, config="large")
    np.testing.assert_allclose(outs[0], refs[0], rtol=1e-5)
    assert cg.summary["chains_undone"] == ["register allocation did not converge"]
    assert all("chained_into" not in k for k in cg.summary["kernels"])


def test_each_prefetch_issuer_loads_its_own_group_of_the_ring_half() -> None:
    # a chain spans several kernel indices but is one issuer: the issuers before a stream load groups 0 and
    # 1 of its first ring half (the second issuer's group was its distance from the first kernel: 2 here,
    # past the reserved rows: a trap on the 1B geometry), and the stream follows the plan they used
    cfg = get_config("large")
    w = View("w", 0, (2048, 2048), (1, 2048), "bf16")  # W.T of nn.Linear's [out, in] weight
    stream = MatmulKernel(View("x", 0, (1, 2048), (2048, 1), "bf16"), w, View("y", 0, (1, 2048), (2048, 1), "f32"))
    chain = KernelChain(0, [])
    fill = FillKernel(View("t", 0, (8, 128), (128, 1), "f32"), 0.0)
    out = plan_prefetches(cfg, [(chain, 0), (chain, 0), (fill, 0), (stream, 0)], cfg.vmem_rows - 64)
    issued = [out[m].issue for m in range(3)]
    plan = issued[0].plan if issued[0] else None
    assert plan is not None and [i.tiles if i else None for i in issued] == [
        range(0, plan.G), None, range(plan.G, 2 * plan.G)]  # a group each
    assert out[3].prefetched == 2 * plan.G and out[3].stream == plan
    slot = (cfg.vmem_rows - 2 * plan.G * cfg.lanes, cfg.vmem_rows)
    assert {out[m].carried for m in range(4)} == {slot} and {i.rows for i in issued if i} == {(slot[0],)}
    assert {out[m].ceiling for m in range(4)} == {cfg.vmem_rows - 2 * (slot[1] - slot[0])}  # both slots


def _stream(name: str, rows: int = 2048) -> MatmulKernel:
    """A decode projection x[1, 2048] @ W.T, W [rows, 2048] bf16: a weight stream."""
    w = View(name, 0, (2048, rows), (1, 2048), "bf16")
    y = View(name + "y", 0, (1, rows), (rows, 1), "f32")
    return MatmulKernel(View("x", 0, (1, 2048), (2048, 1), "bf16"), w, y)


def test_a_stream_prefetches_the_next_streams_first_weights() -> None:
    # a stream just before the next one (gate then up projection) or before its run of small kernels loads
    # the next stream's first groups along its last iteration; streams that are prefetched in turn take the
    # two slots at the top of vmem alternately, so a stream never loads into the half it still reads
    cfg = get_config("large")

    fill = FillKernel(View("t", 0, (8, 128), (128, 1), "f32"), 0.0)
    s0, s1, s2 = _stream("w0"), _stream("w1"), _stream("w2")
    out = plan_prefetches(cfg, [(fill, 0), (s0, 0), (s1, 0), (fill, 0), (s2, 0)], cfg.vmem_rows - 64)
    G = [out[j].stream.G for j in (1, 2, 4)]  # type: ignore[union-attr]
    assert out[0].issue is not None and out[0].issue.tiles == range(0, G[0])  # the only small kernel before s0
    assert out[1].issue is not None and out[1].issue.kernel is s1 and out[1].issue.tiles == range(0, 2 * G[1])
    assert out[2].issue is not None and out[2].issue.kernel is s2 and out[2].issue.tiles == range(0, G[2])
    assert out[3].issue is not None and out[3].issue.tiles == range(G[2], 2 * G[2])
    assert [out[j].prefetched for j in (1, 2, 4)] == [G[0], 2 * G[1], 2 * G[2]]
    slots = [out[j].carried for j in (1, 2, 4)]
    tops = [slot[1] for slot in slots]  # a slot's top; a stream fills it down as far as its half needs
    assert tops[0] != tops[1] and tops[1] != tops[2] and tops[0] == tops[2]
    assert slots[1][1] <= slots[2][0]  # s1 still reads its half while it loads s2's
    assert out[1].carried == slots[0] and out[2].issue.rows == (slots[2][0],)  # s1 keeps its half, loads s2's
    assert out[3].carried == slots[2]  # the small kernel keeps what s1 loaded for s2


def test_a_stream_of_a_prime_number_of_n_tiles_is_split_where_its_groups_cover_a_latency() -> None:
    # Qwen3-0.6B's lm_head: x[1, 1024] @ W.T, W [151936, 1024]: 1187 n-tiles (a prime) of 8 k-tiles. Its only
    # iterations were 1 n-tile (groups of 4 tiles, a bubble each): it runs as 1185 n-tiles in iterations of
    # 5 (groups of 20 tiles), then 2. A stream whose n-tiles have a divisor that covers stays whole
    cfg = get_config("large")
    x = View("x", 0, (1, 1024), (1024, 1), "bf16")
    w, y = View("w", 0, (1024, 151936), (1, 1024), "bf16"), View("y", 0, (1, 151936), (151936, 1), "f32")
    head = MatmulKernel(x, w, y)
    first, rest = isel_decode.split_ragged_streams(cfg, [head])
    assert (first.b.shape, first.c.shape, first.b.offset, first.c.offset) == ((1024, 1185 * 128), (1, 1185 * 128), 0, 0)
    assert (rest.b.shape, rest.c.shape) == ((1024, 256), (1, 256))
    assert (rest.b.offset, rest.c.offset) == (1185 * 128 * 1024, 1185 * 128)
    p = isel_decode.plan(cfg, first, cfg.vmem_rows // 2)  # packed: groups of 10 units (two k-tiles each)
    assert p.packed and p.G * isel_decode._tile_cycles(cfg, p.packed) > cfg.dma_latency
    llama = _stream("w", 128256)  # 1002 n-tiles of 16 k-tiles: iterations of 3 n-tiles cover
    assert isel_decode.split_ragged_streams(cfg, [llama]) == [llama]


def test_a_split_stream_gives_the_same_bits_in_fewer_cycles(monkeypatch: pytest.MonkeyPatch) -> None:
    # 37 n-tiles (a prime) of 8 k-tiles: 35 in iterations of 5, then 2; inf and NaN in both parts' columns,
    # -inf in the last column; every other vmem row poisoned at each kernel's start
    torch.manual_seed(3)
    x, w = torch.randn(1, 1024).bfloat16(), (torch.randn(37 * 128, 1024) / 32).bfloat16()
    for row in (7, 2000, 4479):  # in the first part
        w[row, row % 1024] = float("inf") if row % 2 else float("nan")
    w[4480, 1], w[4735, 1023] = float("nan"), float("-inf")  # the second part's first and last columns
    inputs = [x.float().numpy(), w.float().numpy()]
    cg = compile_graph(trace(_norm_then_project, x, w), [x, w], "large")
    assert [k["kind"] for k in cg.summary["kernels"]].count("matmul") == 2
    (out,) = run_with_poisoned_vmem(cg, inputs)
    _, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
    monkeypatch.setattr(compiler, "split_ragged_streams", lambda _, kernels: kernels)
    whole = compile_graph(trace(_norm_then_project, x, w), [x, w], "large")
    assert [k["kind"] for k in whole.summary["kernels"]].count("matmul") == 1
    (out_whole,), whole_stats = run_fresh(whole, inputs, SimulatorRunner("large"))
    np.testing.assert_array_equal(out.view(np.uint32), out_whole.view(np.uint32))
    ref = _norm_then_project(x, w).float().numpy()
    non_finite = [7, 2000, 4479, 4480, 4735]
    assert list(np.flatnonzero(~np.isfinite(out))) == list(np.flatnonzero(~np.isfinite(ref))) == non_finite
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=2e-2, atol=2e-2)
    # 296 tiles: 9.5k cycles of bytes; in groups of 4 tiles each group waited ~400 cycles of latency
    assert stats.cycles < 0.7 * whole_stats.cycles  # 12,093 against 25,291 when written


def _norm_then_two_projections(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    h = (xf * torch.rsqrt((xf * xf).mean(-1, keepdim=True) + 1e-6)).bfloat16()
    return torch.nn.functional.linear(h, w1) * torch.nn.functional.linear(h, w2)


def _passes_then_compile(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor):
    gm, _ = fx_passes.run_passes(trace(_norm_then_two_projections, x, w1, w2), [x, w1, w2])
    return compile_graph(gm, [x, w1, w2], "large")


def test_back_to_back_streams_give_the_same_bits_in_fewer_cycles(monkeypatch: pytest.MonkeyPatch) -> None:
    # two one-row projections in a row (an MLP's gate and up): the first loads the second's first groups
    # while it finishes; with inf and NaN in those groups, and every other vmem row poisoned at each kernel
    torch.manual_seed(0)
    x = torch.randn(1, 1, 2048).bfloat16()
    w1, w2 = ((torch.randn(2048, 2048) / 45).bfloat16() for _ in range(2))
    w2[5, 7], w2[9, 3] = float("inf"), float("nan")
    inputs = [t.float().numpy() for t in (x, w1, w2)]
    cg = _passes_then_compile(x, w1, w2)
    carried = [k.get("vmem_carried") for k in cg.summary["kernels"] if k["kind"] == "matmul"]
    assert len(carried) == 2 and None not in carried and carried[0] != carried[1]
    (out,) = run_with_poisoned_vmem(cg, inputs)
    _, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
    monkeypatch.setattr(compiler, "plan_prefetches", lambda *_: {})
    plain = _passes_then_compile(x, w1, w2)
    (out_plain,), plain_stats = run_fresh(plain, inputs, SimulatorRunner("large"))
    np.testing.assert_array_equal(out.view(np.uint32), out_plain.view(np.uint32))
    assert np.isinf(out[0, 0, 5]) and np.isnan(out[0, 0, 9])
    assert stats.cycles < plain_stats.cycles - 2 * cg.hardware.dma_latency


def test_a_prefetched_stream_issues_its_next_tiles_before_its_first_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    # the second projection's first half was loaded by the first: it issues its second iteration's first
    # tiles before it waits for that half and its activation row, so the channel does not idle in between
    torch.manual_seed(1)
    x = torch.randn(1, 1, 2048).bfloat16()
    w1, w2 = ((torch.randn(2048, 2048) / 45).bfloat16() for _ in range(2))
    w2[300, 1000], w2[2047, 2047] = float("nan"), float("-inf")  # in the early tiles and in the last one
    inputs = [t.float().numpy() for t in (x, w1, w2)]
    cg = _passes_then_compile(x, w1, w2)
    (out,) = run_with_poisoned_vmem(cg, inputs)
    _, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
    monkeypatch.setattr(isel_decode, "early_tiles", lambda *_: 0)
    late = _passes_then_compile(x, w1, w2)
    (out_late,), late_stats = run_fresh(late, inputs, SimulatorRunner("large"))
    np.testing.assert_array_equal(out.view(np.uint32), out_late.view(np.uint32))
    assert np.isnan(out[0, 0, 300]) and np.isinf(out[0, 0, 2047])
    assert stats.cycles < late_stats.cycles - 200


def _project_heads(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    # a decode step's query projection: [1, 1, H * D] -> [1, H, 1, D] (the same element order at one row)
    return torch.nn.functional.linear(x, w).view(1, 1, 32, 64).transpose(1, 2)


def test_a_projection_stores_its_bf16_result_without_a_cast_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    # the matmul's C store rounds to bf16 as the cast kernel did: same bits, inf and NaN included, one
    # kernel (a DMA latency) fewer
    torch.manual_seed(0)
    x = torch.randn(1, 1, 2048).bfloat16()
    w = (torch.randn(2048, 2048) / 45).bfloat16()
    w[5, 7], w[9, 3], w[70, 0] = float("inf"), float("nan"), 3.3e38
    inputs = [x.float().numpy(), w.float().numpy()]

    def build():
        gm, _ = fx_passes.run_passes(trace(_project_heads, x, w), [x, w])
        return compile_graph(fx_passes.inline_fused_kernels(gm), [x, w], "large")

    cg = build()
    (out,) = run_with_poisoned_vmem(cg, inputs)
    monkeypatch.setattr(compiler, "_fold_output_casts", lambda graph, kernels: kernels)
    plain = build()
    (out_plain,) = run_with_poisoned_vmem(plain, inputs)
    np.testing.assert_array_equal(out.view(np.uint32), out_plain.view(np.uint32))
    assert np.isinf(out[0, 0, 0, 5]) and np.isnan(out[0, 0, 0, 9]) and np.isfinite(out).sum() > 2000
    kinds = [k["kind"] for k in cg.summary["kernels"] if k.get("bundles")]
    assert len(kinds) == len([k for k in plain.summary["kernels"] if k.get("bundles")]) - 1
    ref = _project_heads(x, w).float().numpy()
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=2e-2, atol=2e-2)


def _swiglu(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor) -> torch.Tensor:
    # Llama's MLP: down(silu(gate(x)) * up(x)), each projection's result bf16
    f = torch.nn.functional
    return f.linear(f.silu(f.linear(x, wg)) * f.linear(x, wu), wd)


def test_gate_and_up_store_bf16_results_that_swiglu_reads_rounded(monkeypatch: pytest.MonkeyPatch) -> None:
    # bf16 on `large` at 301 tokens, hidden 1024, intermediate 2816: SwiGLU's generic reads the gate and up
    # results only through their cast to bf16, so the matmuls store them rounded (`_round_results_read_rounded`):
    # the same bits (inf, NaN, results past bf16's largest finite value and subnormal ones included), 8 bytes
    # less HBM traffic an intermediate element (2 stored and 2 loaded, of each), fewer cycles
    torch.manual_seed(0)
    tokens, hidden, inter = 301, 1024, 2816
    x = torch.randn(1, tokens, hidden).bfloat16()
    wg, wu = ((torch.randn(inter, hidden) / 32).bfloat16() for _ in range(2))
    wd = (torch.randn(hidden, inter) / 53).bfloat16()
    # a token each (a weight's inf or NaN would reach every token through down): gate results near f32's
    # largest, one finite in f32 that rounds to inf in bf16 (3.397e38), subnormal ones, a NaN, an inf
    x[0, 2] = x[0, 2] * 3e37
    x[0, 3] = 0.0
    x[0, 3, 0], wg[11, 0] = (1 + 13 / 128) * 2.0 ** 127, 1.8125
    x[0, 5] = x[0, 5] * 1e-37
    x[0, 7, 9], x[0, 8, 1] = float("nan"), float("inf")
    args = [x, wg, wu, wd]
    inputs = [a.float().numpy() for a in args]

    def build() -> tuple[np.ndarray, int, int]:
        gm, _ = fx_passes.run_passes(trace(_swiglu, *args), args)
        cg = compile_graph(fx_passes.inline_fused_kernels(gm), args, "large")
        (out,) = run_with_poisoned_vmem(cg, inputs)
        runner = SimulatorRunner("large")
        runner.simulator.profile = True
        _, stats = run_fresh(cg, inputs, runner)
        moved = sum(n for *_, n, _ in runner.simulator.recording.dma_commands)
        return out, moved, stats.cycles

    out, moved, cycles = build()
    monkeypatch.setattr(compiler, "_round_results_read_rounded", lambda graph, kernels: kernels)
    out_f32, moved_f32, cycles_f32 = build()
    np.testing.assert_array_equal(out.view(np.uint32), out_f32.view(np.uint32))
    ref = _swiglu(*args).float().numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    assert np.isnan(out[0, 7]).all() and np.isfinite(out[0, 9:]).all()
    assert moved_f32 - moved == 8 * tokens * inter, (moved, moved_f32)
    assert cycles < cycles_f32, (cycles, cycles_f32)
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=3e-2, atol=3e-2)


def test_a_result_is_stored_rounded_in_its_own_life_of_a_shared_buffer() -> None:
    # bufferization gives q_proj's result and down_proj's one buffer: q_proj's is read only rounded (its
    # permute), down_proj's by a residual add in f32. Only the first life is stored bf16; the buffer keeps
    # its f32 size, and a reader that does more than round keeps its matmul's result f32
    def view(name: str, dtype: str = "f32") -> View:
        return View(name, 0, (4, 8), (8, 1), dtype)

    def generic(body: list[tuple[str, str, list[str]]], src: View, out: str) -> GenericKernel:
        return GenericKernel((4, 8), False, [Access(src, (8, 1))], Access(view(out), (8, 1)),
                             ScalarProgram(["%in", "%out"], body, [body[-1][0]], {}))

    names = ["x", "w", "c", "q", "r"]
    g = KernelGraph({n: Buffer(n, (4, 8), "f32", "temp") for n in names}, results=[view("r")])
    permute = generic([("%0", "arith.truncf", ["%in"])], view("c"), "q")
    residual = generic([("%0", "arith.addf", ["%in", "%in"])], view("c"), "r")
    kernels = [MatmulKernel(view("x"), view("w"), view("c")), permute,
               MatmulKernel(view("q"), view("w"), view("c")), residual]
    out = compiler._round_results_read_rounded(g, kernels)
    assert [k.c.dtype for k in out if isinstance(k, MatmulKernel)] == ["bf16", "f32"]
    assert [k.inputs[0].view.dtype for k in out if isinstance(k, GenericKernel)] == ["bf16", "f32"]
    assert g.buffers["c"].dtype == "f32"
    g.buffers["c"] = Buffer("c", (4, 8), "f32", "temp")
    alone = compiler._round_results_read_rounded(g, kernels[:2])  # one life: the buffer becomes bf16
    assert alone[0].c.dtype == "bf16" and g.buffers["c"].dtype == "bf16"


def test_a_kernel_that_writes_other_rows_starts_while_the_stores_drain(monkeypatch: pytest.MonkeyPatch) -> None:
    # the iota of torch.arange follows a reduction whose store is still in flight: it writes vmem rows that
    # store does not read, so it starts at once instead of waiting a DMA latency for it (the simulator traps
    # a write to rows an in-flight DMA still reads, so a wrong overlap test fails here)
    def scaled_positions(x: torch.Tensor) -> torch.Tensor:
        return x.sum(-1, keepdim=True) * torch.arange(x.shape[-1], dtype=torch.float32)

    x = torch.randn(5, 40)
    x[1, 3], x[2] = float("nan"), -0.0  # NaN * 0 at position 0 stays NaN; -0 * 0 keeps its sign
    x[4, :2] = torch.finfo(torch.float32).max
    outs, refs, cg = compile_and_run(scaled_positions, x, config="large")
    assert [k["kind"] for k in cg.summary["kernels"]] == ["reduction", "iota", "elementwise"]
    np.testing.assert_allclose(outs[0], refs[0], rtol=1e-5)
    numbers = ~np.isnan(refs[0])  # a NaN's sign is not a result (x86 makes inf * 0 a negative NaN)
    np.testing.assert_array_equal(np.signbit(outs[0][numbers]), np.signbit(refs[0][numbers]))
    (poisoned,) = run_with_poisoned_vmem(cg, [x.numpy()])
    np.testing.assert_array_equal(poisoned.view(np.uint32), outs[0].view(np.uint32))
    monkeypatch.setattr(isel_common.KernelContext, "_clashes", lambda self, ins: isel_common._writes_vmem(ins))
    _, _, guarded = compile_and_run(scaled_positions, x, config="large")
    assert cg.last_stats.cycles < guarded.last_stats.cycles - 400


def test_a_scatter_leaves_its_last_stores_in_flight(monkeypatch: pytest.MonkeyPatch) -> None:
    # a decode step's KV-cache update (8 heads of 64, bf16, position 17 of 33) and a kernel reading the cache:
    # the scatter's stores drain while the reader's loads queue behind them on the in-order channel, so the
    # reader sees the new row, inf and NaN included, one DMA latency sooner than when the scatter waited
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(1, 8, 33, 64, generator=g).bfloat16()
    vals = torch.randn(1, 8, 1, 64, generator=g).bfloat16()
    vals[0, 3, 0, :3] = torch.tensor([float("inf"), float("nan"), -0.0])
    pos = torch.tensor([17])

    def update(cache: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
        cache.index_copy_(2, pos, vals)
        return cache.float().sum(-1)

    def run() -> tuple[np.ndarray, int]:
        gm, examples, order = capture_with_mutations(update, cache, pos, vals)
        exe = compile_graph(gm, examples, "large", verify=True)
        given = (cache, pos, vals)
        arrays = [t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()
                  for t in (given[order.index(i)] for i in range(3))]
        outs, stats = run_fresh(exe, arrays, SimulatorRunner("large"))
        return outs[0], stats.cycles

    out, cycles = run()
    expected = cache.clone()
    ref = update(expected, pos, vals).numpy()
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=1e-2, equal_nan=True)
    assert np.isnan(ref[0, 3, 17]) and np.isnan(out[0, 3, 17])  # inf + NaN: the reader saw the new row
    real = compiler.lower_scatter

    def waits_for_its_stores(ctx: isel_common.KernelContext, k: object) -> None:
        real(ctx, k)
        ctx.b.emit("wait", flag=ctx.flag(Flag.OUT))

    monkeypatch.setattr(compiler, "lower_scatter", waits_for_its_stores)
    waited, waited_cycles = run()
    np.testing.assert_array_equal(out.view(np.uint32), waited.view(np.uint32))
    assert cycles < waited_cycles - 400


def test_scatters_and_small_matmuls_are_prefetch_issuers_too() -> None:
    # between v_proj and o_proj a decode layer runs the KV-cache scatters and attention's two matmuls: they
    # fit their tiles to the vmem they get as the small generics do, so they no longer end the run of
    # kernels before o_proj (which then got one group from the last generic instead of two)
    cfg = get_config("large")

    scores = MatmulKernel(View("q", 0, (1, 64), (64, 1), "bf16"), View("k", 0, (64, 17), (1, 64), "bf16"),
                          View("s", 0, (1, 17), (17, 1), "f32"))
    scatter = ScatterKernel(View("cache", 0, (33, 64), (64, 1), "bf16"), View("idx", 0, (1, 1), (1, 1), "i32"),
                            View("new", 0, (1, 64), (64, 1), "bf16"))
    fill = FillKernel(View("t", 0, (8, 128), (128, 1), "f32"), 0.0)
    s0, s1 = _stream("w0"), _stream("w1")
    out = plan_prefetches(cfg, [(s0, 0), (scatter, 0), (scores, 0), (fill, 0), (s1, 0)], cfg.vmem_rows - 64)
    G = out[4].stream.G  # type: ignore[union-attr]
    assert out[0].issue is not None and out[0].issue.kernel is s1 and out[0].issue.tiles == range(0, G)
    assert out[1].issue is not None and out[1].issue.tiles == range(G, 2 * G)
    assert out[2].issue is None and out[3].issue is None and out[4].prefetched == 2 * G
    assert {out[m].carried for m in (1, 2, 3, 4)} == {out[4].carried}  # the matmul keeps the slot's rows
    assert out[2].ceiling == out[4].ceiling < cfg.vmem_rows


def test_a_prefetch_goes_after_the_loads_that_follow_a_zeroing_loop() -> None:
    # attention's P @ V zeroes its weight panels' padding rows in a loop before it loads them: its prefetch
    # DMAs go after those loads, before their wait (not ahead of them, where they would delay the kernel);
    # in a kernel whose first wait is inside a loop, they go before that loop
    def kernel(wait_in_loop: bool) -> Function:
        f = Function()
        b = Builder(f)
        shape = b.const(8 << 16 | 8)

        def body() -> None:
            b.vst(b.vconst(0.0), b.const(0), 64, Mem("panel", 0, 8, True))
            if wait_in_loop:
                b.emit("dma.ld", None, (b.const(0), b.const(64), shape, b.const(8)), flag=Flag.LOAD,
                       mem=(Mem("in", write=True),))
                b.emit("wait", flag=Flag.LOAD)

        b.counted_loop(3, body, "zero")
        b.emit("dma.ld", None, (b.const(0), b.const(128), shape, b.const(8)), flag=Flag.LOAD,
               mem=(Mem("b", write=True),))
        b.emit("wait", flag=Flag.LOAD)
        return f

    f = kernel(False)
    block, at = isel_common.first_wait(f.blocks)
    assert block is f.blocks[-1] and block.instrs[at].op == "wait" and block.instrs[at - 1].op == "dma.ld"
    f = kernel(True)
    block, at = isel_common.first_wait(f.blocks)
    assert block is f.blocks[0] and at == len(block.instrs)  # after the loop counter's li, before the loop


def test_a_stream_after_a_long_run_gets_larger_groups_loaded_a_quarter_each(monkeypatch: pytest.MonkeyPatch) -> None:
    # o_proj follows attention's rope, KV-cache and softmax kernels, which leave the channel idle for
    # thousands of cycles: it is planned with groups twice as large, the stream before the run and the
    # run's first three kernels each load a quarter of its first half (a quarter being what one of them moves
    # while it waits a latency for its own loads), and the later ones its second iteration (widened tiles:
    # W's k-tiles do not pair up; packed, below)
    monkeypatch.setattr(isel_decode, "PACKED", False)
    cfg = get_config("large")

    fills = [FillKernel(View(f"t{n}", 0, (8, 128), (128, 1), "f32"), 0.0) for n in range(7)]
    v_proj, o_proj, gate = _stream("v", 512), _stream("o"), _stream("g")
    kernels = [(v_proj, 0), *((f, 0) for f in fills), (o_proj, 0), (fills[0], 0), (gate, 0)]
    out = plan_prefetches(cfg, kernels, cfg.vmem_rows - 64)
    o, g = out[8].stream, out[10].stream
    assert o is not None and g is not None and o.G == 2 * g.G  # larger groups after the long run only
    quarter = o.G // 2
    shares = [range(q * quarter, (q + 1) * quarter) for q in range(4)]
    # the run's four later kernels load o_proj's second iteration into the other slot, a quarter each
    second = [range(2 * o.G + q * quarter, 2 * o.G + (q + 1) * quarter) for q in range(4)]
    assert [out[m].issue.tiles if out[m].issue else None for m in range(8)] == [*shares, *second]
    assert out[8].prefetched == 4 * o.G and out[8].issue is not None and out[8].issue.kernel is gate
    # gate's first two iterations fill the slot o_proj's last iteration does not read: the fill after o_proj
    # loads a group, o_proj the rest
    assert out[10].prefetched == 4 * g.G
    assert out[8].issue.tiles == range(3 * g.G) and out[9].issue.tiles == range(3 * g.G, 4 * g.G)
    first, other = out[8].slots
    assert out[1].carried == (first, first + 2 * o.G * cfg.lanes) and out[4].carried == out[8].carried
    assert out[8].carried == (min(first, other), max(first, other) + 2 * o.G * cfg.lanes)
    assert out[10].slots == (other, other + 2 * g.G * cfg.lanes)  # gate takes the second slot, both halves
    # with only five small kernels the run has not the time for two iterations: it loads one, all a share,
    # the stream before twice a small kernel's (its last iteration's first wait and its tail)
    short = [kernels[0], *kernels[3:]]
    out = plan_prefetches(cfg, short, cfg.vmem_rows - 64)
    o = out[6].stream
    assert o is not None and out[6].prefetched == 2 * o.G and len(out[6].slots) == 1
    issued = [out[m].issue.tiles for m in range(6)]
    assert issued[0].start == 0 and issued[-1].stop == 2 * o.G
    assert all(a.stop == b.start for a, b in itertools.pairwise(issued))
    assert len(issued[0]) in (18, 19) and all(len(t) in (9, 10) for t in issued[1:])  # 64 tiles by 2:1:1:1:1:1


def test_a_slot_that_holds_two_iterations_is_loaded_by_the_stream_before_and_a_group_a_small_kernel() -> None:
    # the slots are sized for o_proj's larger groups (after attention's long run), so each holds two
    # iterations of the streams planned with ordinary groups: gate_proj's and down_proj's first two are
    # loaded, down_proj's by gate_proj along its last iteration and a group by each of the two small kernels
    # between them (what one moves while it waits a latency for its own loads)
    cfg = get_config("large")
    fills = [FillKernel(View(f"t{n}", 0, (8, 128), (128, 1), "f32"), 0.0) for n in range(5)]
    v_proj, o_proj, gate, down = _stream("v", 512), _stream("o"), _stream("g"), _stream("d")
    kernels = [(v_proj, 0), *((f, 0) for f in fills), (o_proj, 0), (fills[0], 0), (gate, 0), (fills[1], 0),
               (fills[2], 0), (down, 0)]
    out = plan_prefetches(cfg, kernels, cfg.vmem_rows - 64)
    o, g, d = (out[j].stream for j in (6, 8, 11))
    assert o is not None and g is not None and d is not None and o.G == 2 * d.G and g.iterations > 2
    assert out[11].prefetched == 4 * d.G
    assert [out[m].issue.tiles for m in (8, 9, 10)] == [range(2 * d.G), range(2 * d.G, 3 * d.G),
                                                         range(3 * d.G, 4 * d.G)]
    half = 2 * d.G * cfg.lanes
    lo = out[11].slots[0]
    assert out[11].slots == (lo, lo + half) and out[8].issue.rows == out[11].slots
    assert out[9].carried == out[10].carried == out[11].carried == (lo, lo + 2 * half)
    assert lo + 2 * half in (cfg.vmem_rows, cfg.vmem_rows - 2 * half)  # one slot, whole
    g_lo, g_hi = out[8].carried
    assert g_hi <= lo or lo + 2 * half <= g_lo  # not gate's, which it still reads


def _record_plans(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The prefetch plans the compiler makes from now on, in order."""
    planned: list[dict] = []
    real_plan = compiler.plan_prefetches

    def recorded(*a: object) -> dict:
        planned.append(real_plan(*a))  # type: ignore[arg-type]
        return planned[-1]

    monkeypatch.setattr(compiler, "plan_prefetches", recorded)
    return planned


def _run_checked(fn: Callable[..., object], args: list[torch.Tensor]) -> tuple[np.ndarray, int]:
    """fn compiled for `large` and run: its outputs, one after the other, and its cycles; the same bits with
    every vmem row no kernel holds poisoned at each kernel's start."""
    inputs = [t.float().numpy() for t in args]
    cg = compile_graph(trace(fn, *args), args, "large")
    poisoned = run_with_poisoned_vmem(cg, inputs)
    outs, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
    out, kept = (np.concatenate([o.ravel() for o in r]) for r in (outs, poisoned))
    np.testing.assert_array_equal(out.view(np.uint32), kept.view(np.uint32))
    return out, stats.cycles


def test_a_stream_with_two_iterations_loaded_by_the_kernels_before_gives_the_same_bits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # after o_proj (larger groups after the long run: slots of two ordinary iterations), gate_proj's first
    # two iterations are loaded by o_proj, and down_proj's by gate_proj and the norm between them, into both
    # halves of one slot. inf and NaN in each of down_proj's first two iterations; every other vmem row
    # poisoned at each kernel's start; the same bits as with one iteration loaded ahead, in fewer cycles
    monkeypatch.setattr(compiler, "form_chains", lambda emitted, *_: emitted)  # a kernel a unit
    torch.manual_seed(4)
    x = torch.randn(1, 1, 2048).bfloat16()
    wv = (torch.randn(512, 2048) / 45).bfloat16()
    wo, wg, wd = ((torch.randn(2048, 2048) / 45).bfloat16() for _ in range(3))
    for row in (3, 700):  # in down_proj's iterations 0 and 1 (512 output rows each: 2 groups of 16 tiles)
        wd[row, row % 64] = float("inf") if row % 2 else float("nan")
    args = [x, wv, wo, wg, wd]
    planned = _record_plans(monkeypatch)
    out, cycles = _run_checked(_project_then_run_then_three, args)
    streams = sorted((j, pf) for j, pf in planned[-1].items() if pf.stream is not None)
    *_, (g, gate), (d, down) = streams
    G = down.stream.G
    assert [len(gate.slots), len(down.slots)] == [2, 2] and down.prefetched == 4 * G
    issued = [planned[-1][m].issue.tiles for m in range(g, d) if planned[-1][m].issue is not None]
    assert [t.start for t in issued[1:]] == [t.stop for t in issued[:-1]] and issued[-1].stop == 4 * G
    assert issued[0].start == 0 and len(issued) > 2 and all(len(t) == G for t in issued[1:])  # a group each
    monkeypatch.setattr(isel_decode, "two_ahead", lambda _: False)
    one, one_cycles = _run_checked(_project_then_run_then_three, args)
    assert not any(len(pf.slots) == 2 for pf in planned[-1].values())
    np.testing.assert_array_equal(out.view(np.uint32), one.view(np.uint32))
    ref = _project_then_run_then_three(*args).float().numpy().ravel()
    assert list(np.flatnonzero(~np.isfinite(out))) == [3, 700]
    np.testing.assert_array_equal(out[~np.isfinite(ref)], ref[~np.isfinite(ref)])
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=3e-2, atol=3e-2)
    assert cycles < one_cycles, (cycles, one_cycles)


@pytest.mark.parametrize(("o_rows", "whole", "packed"), [(1024, True, True), (2048, False, True),
                                                        (1024, True, False), (2048, False, False)])
def test_a_loop_edge_after_a_stream_the_run_loads_whole_costs_more(monkeypatch: pytest.MonkeyPatch, o_rows: int,
                                                                   whole: bool, packed: bool) -> None:
    # a layer's kernels: v_proj, attention's long run, o_proj, a norm, gate and up projections. After the long
    # run Qwen3's o_proj (1024 x 2048: one packed iteration, or two widened) is loaded whole and computed in
    # vmem with the channel idle unless it loads the next stream's weights, which no edge lets it do: a
    # body that ends there costs more than one that ends at v_proj. Llama-1B's (two packed iterations, more
    # than the run loads, or four) loads the rest itself: both edges cost nothing
    monkeypatch.setattr(isel_decode, "PACKED", packed)
    cfg = get_config("large")
    fill = FillKernel(View("t", 0, (8, 128), (128, 1), "f32"), 0.0)
    layer = [_stream("v", 512), *[fill] * 8, _stream("o", o_rows), fill, _stream("g"), _stream("u")]
    cost = isel_decode.loop_edge_cost(cfg, layer * 3)
    after_o, after_v = cost(10, len(layer)), cost(1, len(layer))
    assert after_v == 0 and (after_o > after_v) == whole


def _project_then_run_then_two(x: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, wg: torch.Tensor
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    # v_proj, a long run of small kernels (reductions between elementwise steps: attention's place), o_proj
    # and a projection after it (of the same row, so that o_proj's inf and NaN stay in their columns)
    a = torch.nn.functional.linear(x, wv).float()
    for _ in range(3):
        a = a - a.mean(-1, keepdim=True)
        a = a * torch.rsqrt((a * a).mean(-1, keepdim=True) + 1e-6)
    t = a.repeat(1, 1, 4).bfloat16()
    return torch.nn.functional.linear(t, wo), torch.nn.functional.linear(t, wg)


def _project_then_run_then_three(x: torch.Tensor, wv: torch.Tensor, wo: torch.Tensor, wg: torch.Tensor,
                                 wd: torch.Tensor) -> torch.Tensor:
    # the above, then a norm (two small kernels) and down_proj after gate_proj
    o, g = _project_then_run_then_two(x, wv, wo, wg)
    g = (g + o).float()
    g = g * torch.rsqrt((g * g).mean(-1, keepdim=True) + 1e-6)
    return torch.nn.functional.linear(g.bfloat16(), wd)


@pytest.mark.parametrize(("rows", "saved"), [(2048, 1500), (1024, 500)])
def test_a_stream_after_a_long_run_has_two_iterations_loaded_and_gives_the_same_bits(
        monkeypatch: pytest.MonkeyPatch, rows: int, saved: int) -> None:
    # o_proj (`rows` x 2048) after a long run: the run's first kernels load its first iteration into one
    # slot, the later ones its second into the other. Llama-1B's (2048 rows, four iterations) computes both
    # while it loads the third at half pace and the fourth after, then loads the next projection's first
    # groups into the second slot. Qwen3-0.6B's (1024 rows, two iterations) is all prefetched: it loads
    # nothing but the next projection's first groups, into the first slot (its last iteration reads the
    # second). inf and NaN in each of o_proj's iterations and in the next projection's first group; every
    # other vmem row poisoned at each kernel's start. Widened tiles (packed, below)
    monkeypatch.setattr(isel_decode, "PACKED", False)
    monkeypatch.setattr(compiler, "form_chains", lambda emitted, *_: emitted)  # a kernel a unit
    torch.manual_seed(2)
    x = torch.randn(1, 1, 2048).bfloat16()
    wv = (torch.randn(512, 2048) / 45).bfloat16()
    wo, wg = (torch.randn(rows, 2048) / 45).bfloat16(), (torch.randn(2048, 2048) / 45).bfloat16()
    non_finite = [r for r in (5, 700, 1100, 2040) if r < rows]  # one an iteration (512 rows each)
    for row in non_finite:
        wo[row, row % 64] = float("inf") if row % 2 else float("nan")
    wg[3, 9] = float("-inf")
    args = [x, wv, wo, wg]
    planned = _record_plans(monkeypatch)
    out, cycles = _run_checked(_project_then_run_then_two, args)
    two = [(j, pf) for j, pf in planned[-1].items() if len(pf.slots) == 2 and pf.issue is not None]
    assert len(two) == 1
    j, pf = two[0]
    assert pf.stream is not None and pf.prefetched == 4 * pf.stream.G and pf.stream.iterations == rows // 512
    # the next projection's first two iterations, both in the slot o_proj's last iteration does not read:
    # o_proj issues them (nothing runs between)
    after = planned[-1][j + 1]
    slot_top = pf.slots[pf.stream.iterations % 3 != 2] + 2 * pf.stream.G * 128  # slots share their tops
    half = 2 * after.stream.G * 128
    assert after.prefetched == 4 * after.stream.G and after.slots == (slot_top - 2 * half, slot_top - half)
    assert pf.issue is not None and pf.issue.rows == after.slots and pf.issue.tiles == range(4 * after.stream.G)
    monkeypatch.setattr(isel_decode, "two_ahead", lambda _: False)
    one, one_cycles = _run_checked(_project_then_run_then_two, args)
    assert not any(len(pf.slots) == 2 for pf in planned[-1].values())
    np.testing.assert_array_equal(out.view(np.uint32), one.view(np.uint32))
    ref = np.concatenate([r.float().numpy().ravel() for r in _project_then_run_then_two(*args)])
    assert list(np.flatnonzero(~np.isfinite(out))) == [*non_finite, rows + 3]
    np.testing.assert_array_equal(out[~np.isfinite(ref)], ref[~np.isfinite(ref)])
    finite = np.isfinite(ref)
    np.testing.assert_allclose(out[finite], ref[finite], rtol=3e-2, atol=3e-2)
    assert cycles < one_cycles - saved  # 25,379 against 27,403 (2048 rows), 22,643 against 23,324 when written


def test_a_stream_the_long_run_loads_whole_leaves_its_later_kernels_to_the_next_stream() -> None:
    # packed, Qwen3-0.6B's o_proj (1024 x 2048) is one iteration of 64 units (two k-tiles each: 4 MiB of vmem
    # for 4 MB of weights, half what widened tiles take): v_proj (two latencies' worth: its last iteration's
    # first wait and its tail) and the run's first kernels (a latency's worth each) load it all, and its
    # later kernels, o_proj (along its MXU work, from vmem) and the norm after it load gate_proj's first two
    # iterations into the other slot, gate planned to fill it
    cfg = get_config("large")
    fills = [FillKernel(View(f"t{n}", 0, (8, 128), (128, 1), "f32"), 0.0) for n in range(9)]
    v_proj, o_proj, gate = _stream("v", 512), _stream("o", 1024), _stream("g")
    kernels = [(v_proj, 0), *((f, 0) for f in fills), (o_proj, 0), (fills[0], 0), (gate, 0)]
    out = plan_prefetches(cfg, kernels, cfg.vmem_rows - 64)
    o, g = out[10].stream, out[12].stream
    assert o is not None and g is not None and o.packed and g.packed
    assert o.iterations == 1 and out[10].prefetched == 2 * o.G
    by = {m: out[m].issue for m in range(12) if m in out and out[m].issue is not None}
    mine = [m for m, issue in by.items() if issue.kernel is o_proj]
    small = isel_decode._small_capacity(cfg, o)  # 8 units
    assert mine == list(range(1 + -(-(2 * o.G - 2 * small) // small)))
    assert len(by[0].tiles) == 2 * small and all(len(by[m].tiles) <= small for m in mine[1:])
    ahead = [m for m, issue in by.items() if issue.kernel is gate]
    assert ahead == list(range(len(mine), 12))  # the rest of the run, o_proj and the norm
    tiles = [by[m].tiles for m in ahead]
    assert tiles[0].start == 0 and all(a.stop == b.start for a, b in itertools.pairwise(tiles))
    assert tiles[-1].stop == out[12].prefetched == 4 * g.G and 4 * g.G * cfg.lanes == 2 * o.G * cfg.lanes
    assert len(by[10].tiles) > 3 * max(len(by[m].tiles) for m in ahead if m != 10)  # its MXU time's worth
    # gate's two iterations sit in the slot o_proj does not read; the kernels that load them keep both
    (o_row,) = out[10].slots
    o_slot = range(o_row, o_row + 2 * o.G * cfg.lanes)
    assert not any(r in o_slot for r in out[12].slots)
    both = (min(o_row, *out[12].slots), max(o_slot.stop, max(out[12].slots) + 2 * g.G * cfg.lanes))
    assert all(out[m].carried == both for m in ahead[:-1])


@pytest.mark.parametrize(("rows", "saved"), [(1024, 2000), (2048, 0)])
def test_packed_weight_streams_give_the_bits_of_widened_ones_in_fewer_cycles(
        monkeypatch: pytest.MonkeyPatch, rows: int, saved: int) -> None:
    # v_proj, a long run, o_proj (`rows` x 2048: Qwen3-0.6B's is loaded whole by the run, Llama-1B's in part)
    # and the projection after it, with W's bf16 moved raw, two to a vmem word (`mxu.lwt.lo` / `.hi`), and
    # widened (`dma.ld.bf16`, `mxu.lwt`): the same bits, inf and NaN in every o_proj iteration's columns,
    # every vmem row no kernel holds poisoned at each kernel's start
    monkeypatch.setattr(compiler, "form_chains", lambda emitted, *_: emitted)  # a kernel a unit
    torch.manual_seed(4)
    x = torch.randn(1, 1, 2048).bfloat16()
    wv = (torch.randn(512, 2048) / 45).bfloat16()
    wo, wg = (torch.randn(rows, 2048) / 45).bfloat16(), (torch.randn(2048, 2048) / 45).bfloat16()
    for row in (5, 700, 1023, 2040)[: 3 if rows == 1024 else 4]:
        wo[row, (row * 7) % 2048] = float("inf") if row % 2 else float("nan")
    wg[3, 1999] = float("-inf")
    args = [x, wv, wo, wg]
    planned = _record_plans(monkeypatch)
    packed, cycles = _run_checked(_project_then_run_then_two, args)
    assert all(pf.stream.packed for pf in planned[-1].values() if pf.stream is not None)
    monkeypatch.setattr(isel_decode, "PACKED", False)
    widened, widened_cycles = _run_checked(_project_then_run_then_two, args)
    assert not any(pf.stream.packed for pf in planned[-1].values() if pf.stream is not None)
    np.testing.assert_array_equal(packed.view(np.uint32), widened.view(np.uint32))
    assert (~np.isfinite(packed)).sum() == (3 if rows == 1024 else 4) + 1
    assert cycles < widened_cycles - saved, (cycles, widened_cycles)  # measured 19,736 vs 22,230; 24,913 vs 24,940


def test_a_decode_softmax_over_a_2048_key_chunk_is_one_chain(monkeypatch: pytest.MonkeyPatch) -> None:
    # a decode step at context 4096 runs its softmax over key chunks of 2048: 32 heads of f32 scores are
    # 512 vmem rows a tile, which a chain member may take on `large` (a 32nd of vmem): one
    # kernel, not one a reduction and elementwise step, each paying a DMA latency in and out
    torch.manual_seed(3)
    x = torch.randn(1, 32, 1, 2048) * 4
    x[0, 3, 0, 100], x[0, 7, 0, 9], x[0, 9, 0, 5] = float("inf"), float("nan"), 1e-40  # subnormal
    x[0, 5] = float("-inf")  # a fully masked row: NaN, as eager
    x[0, 6, 0, 17] = -0.0

    def softmax(s: torch.Tensor) -> torch.Tensor:
        return torch.softmax(s, -1)

    def build() -> tuple[np.ndarray, int, int, int]:
        cg = compile_graph(trace(softmax, x), [x], "large")
        (out,) = run_with_poisoned_vmem(cg, [x.numpy()])
        _, stats = run_fresh(cg, [x.numpy()], SimulatorRunner("large"))
        return out, len([k for k in cg.summary["kernels"] if k.get("bundles")]), stats.cycles, stats.dma_bytes_stored

    out, kernels, cycles, stored = build()
    ref = softmax(x).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-7, equal_nan=True)
    assert np.isnan(out[0, 5]).all() and np.isnan(out[0, 3]).all() and np.isnan(out[0, 7]).all()
    # the row max, the exponentials and their sums stay in the chain's tiles (`compiler.private_chain_outputs`):
    # only the result is stored: 256 KiB against 512 KiB and two rows of 128 B (5,131 cycles against 5,143:
    # the chain is bound by its VPU work, along which the stores went)
    assert stored == x.numel() * 4
    with monkeypatch.context() as m:
        m.setattr(compiler, "private_chain_outputs", lambda *_: frozenset())
        every, _, every_cycles, every_stored = build()
    np.testing.assert_array_equal(out.view(np.uint32), every.view(np.uint32))
    assert every_stored > 2 * stored and cycles <= every_cycles
    monkeypatch.setattr(isel_vector, "CHAIN_TILE_SHARE", 4 * isel_vector.CHAIN_TILE_SHARE)  # 256 rows: unchained
    monkeypatch.setattr(isel_vector, "TILED_CHAINS", False)  # (not a tile loop either)
    unchained, many, unchained_cycles, _ = build()
    np.testing.assert_array_equal(out.view(np.uint32), unchained.view(np.uint32))
    assert kernels == 1 < many and cycles < unchained_cycles - 2 * get_config("large").dma_latency  # 7,429


def _masked_softmax(s: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return torch.softmax(torch.where(m, s * 0.125, float("-inf")), -1)


def _run_masked_softmax(x: torch.Tensor, mask: torch.Tensor) -> tuple[np.ndarray, Executable, RunStats]:
    """`_masked_softmax` compiled for `large`: its output with vmem poisoned, the program, a fresh run's stats."""
    cg = compile_graph(trace(_masked_softmax, x, mask), [x, mask], "large")
    inputs = [x.numpy(), mask.numpy()]
    (out,) = run_with_poisoned_vmem(cg, inputs)
    _, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
    return out, cg, stats


@pytest.mark.parametrize("valid", [4096, 3001, 0])
def test_a_decode_softmax_loads_its_key_mask_once_not_once_a_head(monkeypatch: pytest.MonkeyPatch,
                                                                   valid: int) -> None:
    """A decode step's masked softmax at 4096 keys (32 heads, `large`): the key mask is the same row for
    every head. The chain loads it once (16 KiB), ahead of the scores, and copies it to the other rows in
    vmem while the scores land, where a DMA of row stride 0 read it from HBM once a head (512 KiB before the
    scores could land). The same bits (edge values; keys past the valid ones masked; valid 0: every row
    fully masked, NaN as eager), 496 KiB fewer loaded and at least 200 cycles fewer (7,727 against 7,967; 8,080
    against 8,576 before the chain's rows came in halves, the second landing while the first computes)."""
    torch.manual_seed(5)
    x = torch.randn(1, 32, 1, 4096) * 4
    x[0, 3, 0, 100], x[0, 7, 0, 9], x[0, 9, 0, 5], x[0, 6, 0, 17] = float("inf"), float("nan"), 1e-40, -0.0
    x[0, 11, 0, 200] = 3.0e38
    mask = torch.arange(4096) < valid

    def build() -> tuple[np.ndarray, int, int]:
        out, _, stats = _run_masked_softmax(x, mask)
        return out, stats.cycles, stats.dma_bytes_loaded

    out, cycles, loaded = build()
    np.testing.assert_allclose(out, _masked_softmax(x, mask).numpy(), rtol=1e-5, atol=1e-7, equal_nan=True)
    monkeypatch.setattr(isel_vector, "_moved_once", lambda *_: False)
    every, every_cycles, every_loaded = build()
    np.testing.assert_array_equal(out.view(np.uint32), every.view(np.uint32))
    assert every_loaded - loaded == 31 * 4096 * 4 and cycles < every_cycles - 200, (cycles, every_cycles)


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def _decode_attention_inputs(heads: int, dim: int, keys: int, seed: int) -> list[torch.Tensor]:
    """One decode step's bf16 q [1, heads, 1, dim] over 8 KV heads of `keys` keys, the last 37 masked (an
    additive bf16 mask), -0 and a subnormal in q."""
    torch.manual_seed(seed)
    q = torch.randn(1, heads, 1, dim).bfloat16()
    k, v = torch.randn(1, 8, keys, dim).bfloat16(), torch.randn(1, 8, keys, dim).bfloat16()
    mask = torch.zeros(1, 1, 1, keys).bfloat16()
    mask[..., keys - 37:] = float("-inf")
    q[0, 1, 0, 3], q[0, 3, 0, 4] = -0.0, 1e-39
    return [q, k, v, mask]


@pytest.mark.parametrize(("heads", "dim", "keys"), [(32, 64, 2001), (32, 64, 2048), (16, 128, 1025)])
def test_decode_attention_matmuls_move_a_heads_rows_in_one_dma_and_give_the_same_bits(
        monkeypatch: pytest.MonkeyPatch, heads: int, dim: int, keys: int) -> None:
    # one decode step's attention over `keys` cached keys (bf16, on `large`; Llama-1B's 32 query heads over 8
    # KV heads of dim 64, Qwen3-0.6B's 16 of dim 128): q @ K^T has up to 16 n-tiles of scores a head (the last
    # partial at 2001 and 1025), P @ V as many k-tiles of P. Each head's query rows of them moved a DMA a tile
    # (144 commands a kernel at 2048 keys, filling the queue); now a DMA a head, row-major, with an MXU
    # command a row. inf in a key (its heads' rows NaN, as eager), NaN in a
    # masked key's value (0 x NaN: NaN, as eager), -0 and a subnormal in q; vmem poisoned at each kernel's
    # start. At 2048 the bits are the tile-wise commands' (whose compile at 2001 keys took over 10 minutes)
    rep = heads // 8
    q, k, v, mask = _decode_attention_inputs(heads, dim, keys, 4)
    k[0, 2, keys // 2, 7] = float("inf")
    q[0, 2 * rep:3 * rep, 0, 7] = q[0, 2 * rep:3 * rep, 0, 7].abs() + 0.5  # +inf scores: kv head 2's heads
    v[0, 5, keys - 3, 11] = float("nan")
    args = [q, k, v, mask]
    inputs = [t.float().numpy() for t in args]

    def build() -> tuple[np.ndarray, int, int]:
        gm, _ = fx_passes.run_passes(trace(_decode_attention, *args), args)  # one fused attention
        cg = compile_graph(gm, args, "large")
        (out,) = run_with_poisoned_vmem(cg, inputs)
        _, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
        return out, stats.dma_commands, stats.cycles

    out, commands, cycles = build()
    ref = _decode_attention(*(t.float() for t in args)).numpy()
    nan = np.isnan(ref).any(axis=-1).ravel()
    assert list(np.flatnonzero(nan)) == [*range(2 * rep, 3 * rep), *range(5 * rep, 6 * rep)]  # kv heads 2, 5
    assert np.isnan(out).any(axis=-1).ravel().tolist() == nan.tolist()
    np.testing.assert_allclose(out[~np.isnan(ref)], ref[~np.isnan(ref)], rtol=2e-2, atol=2e-2)
    assert commands < 100
    if keys != 2048:
        return
    monkeypatch.setattr(isel_matmul, "ROW_COMMAND_ROWS", 0)  # a DMA a tile, a command a tile
    tiled, tiled_commands, tiled_cycles = build()
    np.testing.assert_array_equal(out.view(np.uint32), tiled.view(np.uint32))
    assert commands < tiled_commands - 200 and cycles < tiled_cycles - 1000  # 60 and 300; 12,067 and 13,331


@pytest.mark.parametrize(("heads", "dim", "keys"), [(32, 64, 4001), (16, 128, 4095)])
def test_decode_attention_rounds_move_each_heads_keys_and_values_in_halves(
        monkeypatch: pytest.MonkeyPatch, heads: int, dim: int, keys: int) -> None:
    """Decode attention at ~4096 keys on `large` (the 1B's 32 heads of dim 64, Qwen3's 16 of 128; keys not a
    multiple of the tile): vmem holds a few KV heads at once, so q @ K^T and P @ V run a round a KV head, the
    DMA no faster than the MXU. Each head's K (V) moves in two halves on flags of their own and the MXU starts
    on the first: the same bits as whole heads (inf keys, a NaN masked value, -0 and a subnormal in q, masked
    keys), and each matmul's tail after its last load half a head shorter (1B layer: q @ K^T 5,607 -> 5,342
    cycles, P @ V 5,895 -> 5,642)."""
    rep = heads // 8
    q, k, v, mask = _decode_attention_inputs(heads, dim, keys, 6)
    k[0, 7, keys // 3, 5] = float("inf")  # the last head (its second half of keys lands apart)
    q[0, 7 * rep:, 0, 5] = q[0, 7 * rep:, 0, 5].abs() + 0.5
    v[0, 0, keys - 3, 11] = float("nan")  # masked: 0 x NaN is NaN, as eager
    v[0, 7, keys - 100, 2] = float("inf")
    args = [q, k, v, mask]
    inputs = [t.float().numpy() for t in args]
    halves: list[bool] = []
    resident = isel_matmul._resident_batches

    def spy(ctx: object, kernel: MatmulKernel, *rest: object) -> bool:
        done = resident(ctx, kernel, *rest)
        halves.append(done and any(i.flag == int(isel_matmul.ROUND_HALF_FLAGS[0][0]) + 1 for blk in ctx.b.func.blocks
                                   for i in blk.instrs if i.op == "wait"))
        return done

    monkeypatch.setattr(isel_matmul, "_resident_batches", spy)

    def build() -> tuple[np.ndarray, int]:
        gm, _ = fx_passes.run_passes(trace(_decode_attention, *args), args)
        cg = compile_graph(gm, args, "large")
        (out,) = run_with_poisoned_vmem(cg, inputs)
        _, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
        return out, stats.cycles

    out, cycles = build()
    assert halves == [True, True]  # q @ K^T and P @ V
    ref = _decode_attention(*(t.float() for t in args)).numpy()
    nan = np.isnan(ref).any(axis=-1).ravel()
    assert list(np.flatnonzero(nan)) == [*range(rep), *range(7 * rep, 8 * rep)]
    assert np.isnan(out).any(axis=-1).ravel().tolist() == nan.tolist()
    np.testing.assert_allclose(out[~np.isnan(ref)], ref[~np.isnan(ref)], rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(isel_matmul, "ROUND_HALVES", False)
    whole, whole_cycles = build()
    np.testing.assert_array_equal(out.view(np.uint32), whole.view(np.uint32))
    assert cycles < whole_cycles - 300, (cycles, whole_cycles)


@pytest.mark.parametrize(("heads", "dim", "keys"), [(32, 64, 4096), (16, 128, 2048)])
def test_decode_softmax_reads_the_scores_where_q_k_left_them_in_vmem(
        monkeypatch: pytest.MonkeyPatch, heads: int, dim: int, keys: int) -> None:
    """A decode step's attention on `large` (the 1B's 32 heads of dim 64 at 4096 keys, Qwen3's 16 of 128 at
    2048): q @ K^T leaves its f32 scores in vmem (a region a KV head, one after the other: the [heads, keys]
    rows as a load would bring them) and the softmax chain after it reads them there instead of waiting for
    their store and a load of 512 KiB (`KernelContext.take_resident`); q @ K^T also loads the key mask's row
    for it (`preload`), so the chain waits for nothing and starts at once (and the chain loads the first KV
    head's values for P @ V after it). Under poisoned vmem (all of
    vmem NaN at each kernel's start but what it is meant to find there) the same bits as with the scores
    loaded: inf keys, a NaN in a masked value, -0 and a subnormal in q, masked keys; 400+ cycles fewer (1B
    layer: the chain 4,553 -> 3,796 cycles)."""
    rep = heads // 8
    q, k, v, mask = _decode_attention_inputs(heads, dim, keys, 8)
    k[0, 4, keys // 5, 9] = float("inf")
    q[0, 4 * rep:5 * rep, 0, 9] = q[0, 4 * rep:5 * rep, 0, 9].abs() + 0.5  # +inf scores: kv head 4's heads
    v[0, 1, keys - 2, 3] = float("nan")  # masked: 0 x NaN is NaN, as eager
    args = [q, k, v, mask]
    inputs = [t.float().numpy() for t in args]

    def build() -> tuple[np.ndarray, int, list]:
        gm, _ = fx_passes.run_passes(trace(_decode_attention, *args), args)
        cg = compile_graph(gm, args, "large")
        (out,) = run_with_poisoned_vmem(cg, inputs)
        _, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
        return out, stats.cycles, [k.get("vmem_resident") for k in cg.summary["kernels"] if "start" in k]

    out, cycles, resident = build()
    # the chain, after q @ K^T: the scores, and the key mask's row that q @ K^T loaded for it (`preload`)
    (scores, mask_row) = resident[1]
    assert scores[1] - scores[0] == heads * keys // 128 and mask_row[1] - mask_row[0] == keys // 128
    # P @ V, after the chain: the first KV head's values, which the chain loaded for it (`first_batch_weights`)
    ((values_lo, values_hi),) = resident[2]
    assert values_hi - values_lo == keys and resident[0] is None and resident[3:] == [None]
    ref = _decode_attention(*(t.float() for t in args)).numpy()
    nan = np.isnan(ref).any(axis=-1).ravel()
    assert list(np.flatnonzero(nan)) == [*range(rep, 2 * rep), *range(4 * rep, 5 * rep)]
    assert np.isnan(out).any(axis=-1).ravel().tolist() == nan.tolist()
    np.testing.assert_allclose(out[~np.isnan(ref)], ref[~np.isnan(ref)], rtol=2e-2, atol=2e-2)
    monkeypatch.setattr(isel_matmul, "LEAVE_C", False)
    loaded, loaded_cycles, _ = build()
    np.testing.assert_array_equal(out.view(np.uint32), loaded.view(np.uint32))
    assert cycles < loaded_cycles - 400, (cycles, loaded_cycles)  # 16,472 and 17,148; 13,654 and 14,268


@pytest.mark.parametrize("heads", [32, 16])
def test_a_long_softmax_chain_computes_its_first_half_of_rows_while_the_second_lands(
        monkeypatch: pytest.MonkeyPatch, heads: int) -> None:
    """A decode step's softmax chain over 4096 keys on `large` (f32 scores of 32 heads: 512 KiB, a DMA latency
    of transfer; 16 heads of 8192 keys, Qwen3's at twice the context): its rows load in two halves on flags of
    their own, and every member computes the first half while the second lands, then stores it while it
    computes the second. The same bits as one whole (inf, NaN, -0, a subnormal, 3e38, masked keys, a fully
    masked row), at least 400 cycles fewer (7,967 against 8,576; 8,845 against 9,503)."""
    keys = 131072 // heads
    torch.manual_seed(7)
    x = torch.randn(1, heads, 1, keys) * 4
    x[0, 3, 0, 100], x[0, 7, 0, 9], x[0, 9, 0, 5], x[0, 6, 0, 17] = float("inf"), float("nan"), 1e-40, -0.0
    x[0, heads - 1, 0, 200] = 3.0e38
    mask = torch.rand(1, heads, 1, keys) < 0.9
    mask[0, heads // 2] = False  # a fully masked row in the second half: NaN, as eager

    def build() -> tuple[np.ndarray, int, int]:
        out, cg, stats = _run_masked_softmax(x, mask)
        return out, stats.cycles, cg.stages["program.s"].count(f"wait f{int(Flag.HALF)}\n")

    out, cycles, halves = build()
    assert halves
    np.testing.assert_allclose(out, _masked_softmax(x, mask).numpy(), rtol=1e-5, atol=1e-7, equal_nan=True)
    monkeypatch.setattr(isel_vector, "_row_halves", lambda *_: None)
    whole, whole_cycles, none = build()
    assert not none
    np.testing.assert_array_equal(out.view(np.uint32), whole.view(np.uint32))
    assert cycles < whole_cycles - 400, (cycles, whole_cycles)


@pytest.mark.parametrize(("heads", "dim"), [(16, 128), (8, 256)])
def test_a_decode_stream_reads_its_activation_row_where_the_kernel_before_left_it(
        monkeypatch: pytest.MonkeyPatch, heads: int, dim: int) -> None:
    """A decode step's o_proj on `large` (Qwen3's 16 heads of 128 into 1024; 8 of 256): the generic before
    it (the attention output's normalization, rounded to bf16) leaves its [heads, dim] rows in vmem, and the
    weight stream reads its A row there (`KernelContext.take_resident`: the same elements as the one row of
    heads * dim it would load) instead of loading it (a DMA latency after the store: in a model, where the
    run before loads the stream's first weights, the stream waits for nothing else; qwen3-0.6b-2l decode
    82,754 -> 82,370 cycles). Under poisoned vmem the same bits as with the row loaded (inf, NaN, -0, a
    subnormal, a value that rounds to inf, a fully masked head's 0 / 0), the row's load gone, and no more
    cycles (alone, the stream's own first weight loads take that latency anyway)."""
    torch.manual_seed(3)
    o = torch.randn(1, heads, 1, dim) * 3
    o[0, 1, 0, 5], o[0, 2, 0, 7], o[0, 3, 0, 9], o[0, 4, 0, 11] = float("inf"), float("nan"), -0.0, 1e-41
    o[0, 5, 0, 13] = 3.4e38  # rounds to bf16 inf
    l_sum = torch.rand(1, heads, 1, 1) + 0.5
    o[0, 6], l_sum[0, 6] = 0.0, 0.0  # 0 / 0
    w = (torch.randn(1024, heads * dim) / 32).to(torch.bfloat16)

    def f(o: torch.Tensor, l_sum: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        a = (o / l_sum).to(torch.bfloat16).transpose(1, 2).reshape(1, 1, heads * dim)
        return torch.nn.functional.linear(a, w)

    args = [o, l_sum, w]
    inputs = [t.float().numpy() for t in args]

    def build() -> tuple[np.ndarray, int, list]:
        cg = compile_graph(trace(f, *args), args, "large")
        (out,) = run_with_poisoned_vmem(cg, inputs)
        _, stats = run_fresh(cg, inputs, SimulatorRunner("large"))
        return out, stats, [k.get("vmem_resident") for k in cg.summary["kernels"] if "start" in k]

    out, stats, resident = build()
    assert resident[-1] is not None and resident[-1][0][1] - resident[-1][0][0] == heads * dim // 128, resident
    ref = f(*args).float().numpy()
    np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
    monkeypatch.setattr(isel_vector, "_leaves_output", lambda *_: False)
    loaded, loaded_stats, resident = build()
    assert resident[-1] is None
    np.testing.assert_array_equal(out.view(np.uint32), loaded.view(np.uint32))
    assert (stats.dma_commands, stats.dma_bytes_loaded) == (loaded_stats.dma_commands - 1,
                                                            loaded_stats.dma_bytes_loaded - 2 * heads * dim)
    assert stats.cycles <= loaded_stats.cycles, (stats.cycles, loaded_stats.cycles)


def test_an_rms_norm_over_many_rows_computes_its_factor_once_a_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill's RMS norm (517 rows of hidden 2048, bf16, `large`) computes rsqrt(mean(x^2) + eps) once a row
    in a [rows, 1] generic (`fx_ops._rms_norm`), not once an element (two rsqrt sequences an element): the
    same bits as inline, rows of 3e38 (the sum of squares overflows: the scaled path), NaN, inf, zeros,
    subnormals and -0 included, and eager's values, in fewer than half the cycles."""
    import fx_passes.ops  # noqa: F401  (registers torch.ops.ctpu)
    from codegen import fx_ops

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(517, 2048, generator=g) * 3).bfloat16()
    x[0], x[1, 5], x[2], x[3, 7], x[4], x[5, 3] = 3e38, float("nan"), 0.0, float("inf"), 1e-40, -0.0
    w = torch.randn(2048, generator=g).bfloat16()

    def norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return torch.ops.ctpu.rms_norm(x, w, 1e-6)

    def build() -> tuple[np.ndarray, int, int]:
        cg = compile_graph(trace(norm, x, w), [x, w], "large")
        (out,), stats = run_fresh(cg, [x.float().numpy(), w.float().numpy()], SimulatorRunner("large"))
        return out, stats.cycles, sum("math.rsqrt" in line for line in cg.stages["kernels.txt"].splitlines())

    out, cycles, rsqrt_kernels = build()
    monkeypatch.setattr(fx_ops, "RMS_FACTOR_MIN_ROWS", 1 << 30)
    inline, inline_cycles, _ = build()
    np.testing.assert_array_equal(out.view(np.uint32), inline.view(np.uint32))
    assert rsqrt_kernels == 1 and 2 * cycles < inline_cycles, (cycles, inline_cycles)  # the [517, 1] generic
    ref = norm(x.float(), w.float()).bfloat16().float().numpy()
    assert np.isnan(out[1]).all() and (out[2] == 0).all() and np.isfinite(out[0]).all()  # row 0: scaled
    np.testing.assert_array_equal(np.isnan(out[1:]), np.isnan(ref[1:]))  # row 3's inf: NaN there, 0 elsewhere
    rows = list(range(4, 517))  # row 0: eager's sum of squares overflows to inf (0 and NaN)
    np.testing.assert_allclose(out[rows], ref[rows], rtol=2e-2, atol=2e-2)
