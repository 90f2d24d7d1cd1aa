"""Compiled graphs on the RTL: the program `torch.compile(backend="ctpu")` makes of a whole model (the tiny
Llama, fp32 at "highest" and bf16; the mini attention block) runs on the SystemVerilog core with the same
final HBM, registers, vmem, statistics and cycle count as on the simulator, and its outputs match eager."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from test_layer_loop import block_stack
from test_models import MiniAttention, capture, tiny_llama

import fx_passes
from codegen import compile_graph
from device_sim.executable import launch, run_fresh, stage
from device_sim.rtl.diff import diff_batch
from device_sim.rtl.runner import RtlJob
from device_sim.runners import SimulatorRunner

pytestmark = pytest.mark.rtl


def logits(model: torch.nn.Module):
    return lambda ids: model(ids).logits


def test_compiled_models_match_the_simulator_and_eager() -> None:
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    cases = {  # name: (function, input, tolerance against eager)
        "tiny llama fp32": (logits(tiny_llama(torch.float32)), ids, 1e-4),
        "tiny llama bf16": (logits(tiny_llama(torch.bfloat16)), ids, 3e-2),
        "mini attention": (MiniAttention().eval(), torch.randn(16, 64), 1e-4),
        "layer loop": (block_stack([32] * 7), torch.randn(16, 32), 1e-4),  # 6 equal blocks: one loop body
    }
    jobs, runs = [], []
    for fn, x, tol in cases.values():
        gm, args = capture(fn, x)
        gm, _ = fx_passes.run_passes(gm, args)
        cg = compile_graph(fx_passes.inline_fused_kernels(gm), args, matmul_precision="highest")
        assert bool(cg.summary["loops"]) == (fn is cases["layer loop"][0])
        arrays = [(a.float() if a.is_floating_point() else a).detach().numpy() for a in args]
        hbm, _, _, regs = stage(cg, arrays)
        jobs.append(RtlJob(cg.program, hbm, args=regs))
        runs.append((cg, arrays, fn, x, tol))
    reports = diff_batch(jobs, list(cases))
    assert all(r.ok for r in reports), "\n".join(r.summary() for r in reports if not r.ok)
    assert reports[0].cycles > 50_000  # a whole model ran (112k cycles since weights load with mxu.lwt)
    # the RTL's final HBM is the simulator's, bit for bit: so are the outputs read from it
    for cg, arrays, fn, x, tol in runs:
        (out,), _ = run_fresh(cg, arrays, SimulatorRunner(cg.config))
        with torch.no_grad():
            ref = fn(x).float().numpy()
        np.testing.assert_allclose(out.reshape(ref.shape), ref, rtol=tol, atol=tol)


def test_edge_values_match_the_simulator() -> None:
    """The math sequences on ±0, subnormals, ±inf, NaN, the largest finite values and huge arguments
    (tests/codegen/test_edge_values.py), division of every pair of them and an fp32 matmul holding
    infinities end with the same bits on the RTL as on the simulator."""
    from test_edge_values import UNARY, _edges

    x = _edges()
    d = x.flip(-1).contiguous()
    a = x.reshape(8, -1).clone()
    a[0, :3] = torch.tensor([math.inf, -math.inf, math.nan])

    def fn(x: torch.Tensor, d: torch.Tensor, a: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (*(f(x) for f, _ in UNARY.values()), x / d, a @ a.T.clamp(-1e30, 1e30))

    gm, args = capture(fn, x, d, a)
    gm, _ = fx_passes.run_passes(gm, args)
    cg = compile_graph(fx_passes.inline_fused_kernels(gm), args, matmul_precision="highest")
    hbm, _, _, regs = stage(cg, [t.detach().numpy() for t in args])
    (report,) = diff_batch([RtlJob(cg.program, hbm, args=regs)], ["edge values"])
    assert report.ok, report.summary()


def test_a_decode_step_with_its_kv_cache_matches_the_simulator(monkeypatch: pytest.MonkeyPatch) -> None:
    """One decode step of the tiny Llama, as generate() with a static cache launches it (the KV cache rows
    written in place at a position read at run time), on the SystemVerilog core: the final HBM (the cache
    included), registers and cycle count are the simulator's, and the step wrote the new rows."""
    from torch_tpu_backend import ctpu_target, runtime

    launches = []
    real_launch = ctpu_target.launch_executable

    def record(exe, tensors, *rest):  # type: ignore[no-untyped-def]
        launches.append((exe, [runtime.to_numpy_bits(t).copy() for t in tensors]))  # the inputs before it
        return real_launch(exe, tensors, *rest)

    monkeypatch.setattr(ctpu_target, "launch_executable", record)
    model = tiny_llama(torch.float32)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        torch._dynamo.reset()
        model.forward = torch.compile(model.forward, backend="ctpu")
        with torch.no_grad():
            model.generate(ids, max_new_tokens=2, do_sample=False, use_cache=True, cache_implementation="static")
    finally:
        torch.set_float32_matmul_precision(previous)
    assert len(launches) == 2  # the prefill, then one decode step: each one program
    exe, inputs = launches[1]
    assert exe.mutated_inputs  # the cache buffers (and transformers' position counter)
    hbm, addrs, arena, regs = stage(exe, inputs)
    (report,) = diff_batch([RtlJob(exe.program, hbm.copy(), args=regs)], ["tiny llama decode step"])
    assert report.ok, report.summary()
    after = hbm.copy()
    _, stats = launch(exe, SimulatorRunner(exe.config), after, addrs, arena)
    assert stats.cycles == report.cycles > 50_000  # 94k since weights load with mxu.lwt
    spans = [slice(addrs[i], addrs[i] + exe.inputs[i].nbytes) for i in exe.mutated_inputs]
    written = [np.count_nonzero(after[span] != hbm[span]) for span in spans]
    assert sum(written) > 0  # the new K / V rows (and the counter) landed in the inputs' own buffers


def test_a_kv_update_by_runs_matches_the_simulator() -> None:
    """A KV cache update at consecutive positions (`isel_gather._by_contiguous_runs`) on the SystemVerilog
    core: 2 heads x 260 positions of a 300-position cache are 520 rows, a first run of 256 consecutive rows
    (one DMA), a second across the two heads (a DMA a row) and 8 rows after them. The final HBM (the cache,
    written in place), registers and cycle count are the simulator's, and the cache is eager's."""
    from codegen_helpers import capture_with_mutations
    from test_scatter import _assign, _bits

    g = torch.Generator().manual_seed(4)
    cache, vals = torch.randn(1, 2, 300, 16, generator=g), torch.randn(1, 2, 260, 16, generator=g)
    pos = torch.arange(3, 263)
    gm, examples, order = capture_with_mutations(_assign, cache, pos, vals)
    exe = compile_graph(gm, examples, "small")
    given = (cache, pos, vals)
    hbm, addrs, arena, regs = stage(exe, [given[order.index(i)].numpy() for i in range(3)])
    (report,) = diff_batch([RtlJob(exe.program, hbm.copy(), args=regs)], ["kv update by runs"])
    assert report.ok, report.summary()
    _, stats = launch(exe, SimulatorRunner("small"), hbm, addrs, arena)
    assert stats.cycles == report.cycles
    expected = cache.clone()
    _assign(expected, pos, vals)
    at = addrs[order[0]]
    np.testing.assert_array_equal(hbm[at: at + cache.numel() * 4].view(np.int32).reshape(cache.shape),
                                  _bits(expected))
