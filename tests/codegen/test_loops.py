"""Runtime loops in machine IR: hoisting, modulo scheduling, and the verifiers across the back edge."""

from __future__ import annotations

import dataclasses

import pytest

from codegen.builder import Builder
from codegen.loops import hoist_invariants
from codegen.machine_code import compile_function
from codegen.mir import ZERO, Function, Mem, MInstr, Reg
from codegen.modulo import pipeline_loops
from codegen.verify import ScheduleError, verify_loop_block, verify_pipelined

IN, OUT = "in", "out"


IN_ROW, OUT_ROW = 256, 1280  # vmem rows of the chunk loop's input and output


def chunk_loop(count: int, wanted: Reg | None = None) -> tuple[Function, Builder]:
    """out[off] = (in[off] * 2 + 1) for off = 0, 8, ..: a counted loop with an induction base register
    (`wanted`: a physical register holding its runtime trip count)."""
    f = Function(pinned=(wanted,) if wanted is not None else ())
    b = Builder(f)
    off = b.sreg()
    b.emit("li", off, imm=0)

    def body() -> None:
        x = b.vreg()
        b.emit("vld", x, (off,), imm=IN_ROW, mem=(Mem(IN, 0, 1024),))
        y = b.vop("vadd.f", b.vop("vmul.f", x, b.vconst(2.0)), b.vconst(1.0))
        b.emit("vst", None, (y, off), imm=OUT_ROW, mem=(Mem(OUT, 0, 1024, True),))
        b.emit("addi", off, (off,), imm=8)

    b.counted_loop(count, body, "chunk", wanted=wanted)
    b.emit("halt")
    return f, b


def test_counted_loop_is_marked() -> None:
    f, _ = chunk_loop(10)
    loops = [blk for blk in f.blocks if blk.loop is not None]
    assert len(loops) == 1 and loops[0].loop is not None and loops[0].loop.trip_count == 10


def test_hoist_moves_constants_to_the_preheader() -> None:
    f, _ = chunk_loop(10)
    moved = hoist_invariants(f)
    loop = next(blk for blk in f.blocks if blk.loop is not None)
    assert moved >= 4  # two li + two vbcast
    assert not any(i.op in ("li", "vbcast") for i in loop.instrs)


@pytest.mark.parametrize("count", [7, 40])
def test_pipelined_loop_verifies_and_overlaps_iterations(count: int) -> None:
    f, _ = chunk_loop(count)
    mc = compile_function(f, next_id=1000, pipeline=True, verify=True)
    assert mc.pipelined, mc.log
    loop = mc.pipelined[0]
    assert loop.sched.ii == 1  # one vld, two vector ops, one vst, two scalar ops per iteration
    assert loop.sched.stages > 1
    kernel = next(blk for blk in mc.func.blocks if blk.label.endswith("_kernel"))
    assert len(mc.bundles[kernel.label]) == loop.sched.unroll * loop.sched.ii


def test_pipelined_trace_catches_a_wrong_address() -> None:
    f, _ = chunk_loop(40)
    mc = compile_function(f, next_id=1000, pipeline=True)
    loop = mc.pipelined[0]
    bad = [dataclasses.replace(x, ins=dataclasses.replace(x.ins, imm=(x.ins.imm or 0) + 8))
           if x.ins.op == "vst" else x for x in loop.kernel]
    with pytest.raises(ScheduleError, match="addresses row"):
        verify_pipelined(dataclasses.replace(loop, kernel=bad))


def test_pipelined_trace_catches_a_read_before_landing() -> None:
    f, _ = chunk_loop(40)
    mc = compile_function(f, next_id=1000, pipeline=True)
    loop = mc.pipelined[0]
    early = [dataclasses.replace(x, time=x.time - 1) if x.ins.op == "vadd.f" and x.time > 0 else x
             for x in loop.prologue]
    with pytest.raises(ScheduleError):
        verify_pipelined(dataclasses.replace(loop, prologue=early))


def test_short_loop_is_not_pipelined() -> None:
    f, _ = chunk_loop(3)
    mc = compile_function(f, next_id=1000, pipeline=True, verify=True)
    assert not mc.pipelined and any("not pipelined" in line for line in mc.log)


def test_loop_block_wraparound_is_checked() -> None:
    """A value produced in the last bundle (vred: 4 cycles) and read in the first bundle of the next
    iteration: legal inside one iteration's order, wrong across the back edge."""
    acc, s = Reg("v", 1), Reg("s", 2)
    red = MInstr("vred.sum.l", acc, (acc,))
    use = MInstr("vadd.f", Reg("v", 3), (acc, acc))
    dec = MInstr("addi", s, (s,), imm=-1)
    br = MInstr("bnz", None, (s,), target="L")
    instrs = [use, red, dec, br]
    with pytest.raises(ScheduleError):
        verify_loop_block("L", instrs, [[use], [red, dec, br]])
    verify_loop_block("L", instrs, [[use], [red], [], [], [dec, br]])


def test_unpipelined_fallback_still_verifies() -> None:
    f, _ = chunk_loop(12)
    mc = compile_function(f, next_id=1000, pipeline=False, verify=True)
    assert not mc.pipelined


def test_pipeline_log_explains_rejections() -> None:
    f = Function()
    b = Builder(f)
    b.counted_loop(4, lambda: b.emit("wait", flag=0), "w")
    b.emit("halt")
    hoist_invariants(f)
    _, log, _ = pipeline_loops(f, 100)
    assert any("not pipelined" in line for line in log)
    assert ZERO.phys


def test_compile_graph_honours_pipeline_false() -> None:
    """`compile_graph(..., pipeline=False)` compiles without software pipelining (the option was once
    shadowed by the MLIR pipeline's result, so every graph was pipelined): the same answer, more cycles."""
    import numpy as np
    import torch
    from codegen_helpers import compile_and_run

    x = torch.randn(64, 256)
    on, ref, exe_on = compile_and_run(lambda x: torch.softmax(x, -1), x)
    off, _, exe_off = compile_and_run(lambda x: torch.softmax(x, -1), x, pipeline=False)
    np.testing.assert_allclose(on[0], ref[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(on[0], off[0])
    assert exe_off.last_stats.cycles > exe_on.last_stats.cycles
    assert len(exe_off.program) < len(exe_on.program)  # no prologue / epilogue copies


def test_a_value_read_two_kernel_runs_after_its_load_keeps_its_register() -> None:
    """Six row slices of one [4, 6, 40] input and a constant in one elementwise kernel on `small` (P = 5 vmem
    rows a row): a vld at kernel bundle 5 (II 6, latency 2) read at bundle 0 two runs later, one name (the
    next load lands after that read). The allocator took the value for dead between the read and the load,
    gave its register to an add, and the result was silently wrong (errors of ~3). Now a live-out value whose
    redefinition lands past the block's end lives to the end. The trace check on every compile (which had
    caught it and compiled the loop unpipelined) no longer rejects the loop."""
    import numpy as np
    import torch
    from codegen_helpers import compile_and_run

    x = torch.randn(4, 6, 40, generator=torch.Generator().manual_seed(0))
    outs, refs, exe = compile_and_run(lambda t: sum((t[:, i] for i in range(1, 6)), t[:, 0] + 0.5), x)
    np.testing.assert_allclose(outs[0], refs[0], rtol=1e-6, atol=1e-6)
    assert exe.summary["pipelined_loops"] >= 1 and exe.summary["pipelining_undone"] == []


def test_live_out_value_is_live_until_its_redefinition_lands() -> None:
    """Block-level: v1 defined at 0, redefined at 4 by a 4-cycle reduction that lands after the block's end,
    and read by the successor before that: the first value holds its register through the whole block."""
    from codegen.mir import Block
    from codegen.regalloc import live_intervals

    v0, v1, v2 = Reg("v", 0, True), Reg("v", 1), Reg("v", 2)
    first = MInstr("vadd.f", v1, (v0, v0))
    other = MInstr("vadd.f", v2, (v0, v0))
    use_other = MInstr("vadd.f", v2, (v2, v2))
    late = MInstr("vred.sum.l", v1, (v0,))
    read = MInstr("vadd.f", Reg("v", 3), (v1, v1))
    f = Function(blocks=[Block("a", [first, other, use_other, late]), Block("b", [read, MInstr("halt")])])
    bundles = {"a": [[first], [other], [use_other], [], [late]], "b": [[read, f.blocks[1].instrs[1]]]}
    segments = live_intervals(f, bundles)[v1].segments
    assert segments[0][0] == 0 and segments[0][1] >= 4, segments


@pytest.mark.parametrize("body, placement, ratio", [("silu(a) * erf(b)", "vmem pool", 0.7),
                                                     ("gelu(a) * tanh(b)", "hoisted instructions moved back", 0.9)])
def test_a_register_bound_loop_frees_the_registers_its_constants_hold(
        monkeypatch: pytest.MonkeyPatch, body: str, placement: str, ratio: float) -> None:
    """A bf16 body on `large` with many polynomial constants: hoisted, they stay taken across the loop and
    the registers, not the slots, bound the II. Placed otherwise it runs in fewer cycles, with the same bits
    as with the constants hoisted (NaN, inf, -0, subnormals included): silu(a) * erf(b) keeps them in a vmem
    pool (a vld per use, on the idle load slot; values loaded again for their late use), measured 19,616
    against 35,916 cycles; gelu(a) * tanh(b) moves the constants' instructions back into the loop
    (`_constants_back`), 34,407 against 43,052. (The pool's body was SwiGLU's silu(a) * b until the exp unit,
    then silu(a) * tanh(b) until the reciprocal unit made each slot-bound.)"""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from codegen_helpers import trace

    import codegen.modulo as modulo
    from codegen import compile_graph
    from device_sim.executable import run_fresh
    from device_sim.runners import SimulatorRunner

    a, b = torch.randn(64, 8192).to(torch.bfloat16), torch.randn(64, 8192).to(torch.bfloat16)
    a[0, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-39, -3e38])
    b[1, :4] = torch.tensor([float("nan"), float("inf"), 0.0, -0.0])
    bodies = {"silu(a) * erf(b)": lambda a, b: F.silu(a) * torch.erf(b),
              "gelu(a) * tanh(b)": lambda a, b: F.gelu(a) * torch.tanh(b)}
    f = bodies[body]
    if body.startswith("gelu"):  # eager's CPU gelu(inf) is NaN, ours inf (tests/codegen/test_edge_values.py)
        a[0, 0] = 1e30

    def run() -> tuple[np.ndarray, int, list[str]]:
        exe = compile_graph(trace(f, a, b), [a, b], "large")
        (out,), stats = run_fresh(exe, [a.float().numpy(), b.float().numpy()], SimulatorRunner("large"))
        return out, stats.cycles, exe.summary["pipelining"]

    placed, cycles, log = run()
    assert any(placement in line and "registers bound the II" in line for line in log), log
    monkeypatch.setattr(modulo, "_constants_placed", lambda func, loop, pre, body, sched, *args: (body, sched))
    hoisted, hoisted_cycles = run()[:2]
    np.testing.assert_array_equal(placed.view(np.uint32), hoisted.view(np.uint32))
    torch.testing.assert_close(torch.from_numpy(placed), f(a, b).float(), rtol=1.6e-2, atol=1e-5, equal_nan=True)
    assert cycles < ratio * hoisted_cycles, (cycles, hoisted_cycles)


def differences_loop(count: int) -> Function:
    """out[16 i] = in[8 i] - in[8 (i - 1)] (in[-8] read as 0), then the last input chunk at LAST_ROW: two
    induction bases of different steps (with the counter, three scalar ops an iteration: 1.5 bundles on two
    scalar slots), a value carried to the next iteration, and a value read after the loop."""
    f = Function()
    b = Builder(f)
    src, dst, prev = b.sreg(), b.sreg(), b.vreg()
    b.emit("li", src, imm=0)
    b.emit("li", dst, imm=0)
    b.emit("vbcast", prev, (ZERO,))

    def body() -> None:
        x = b.vreg()
        b.emit("vld", x, (src,), imm=IN_ROW, mem=(Mem(IN, 0, 1024),))
        b.emit("vst", None, (b.vop("vsub.f", x, prev), dst), imm=OUT_ROW, mem=(Mem(OUT, 0, 2048, True),))
        b.emit("vor", prev, (x, x))
        b.emit("addi", src, (src,), imm=8)
        b.emit("addi", dst, (dst,), imm=16)

    b.counted_loop(count, body, "diff")
    b.emit("vst", None, (prev, ZERO), imm=LAST_ROW, mem=(Mem(OUT, 0, 2048, True),))
    b.emit("halt")
    return f


LAST_ROW = 4000


@pytest.mark.parametrize("count", [80, 82, 83])
def test_a_loop_bound_at_a_fraction_of_a_bundle_runs_two_iterations_a_widened_body(count: int, monkeypatch) -> None:
    """Three scalar ops an iteration on two slots: an II of 2 for 1.5 bundles of work. Widened to two
    iterations a body, the loop runs them in an II of 3 or less, with the same results: the carried value renamed
    per copy, each induction base advanced once by two steps, the value read after the loop where it was.
    A trip count that no width divides (83) keeps the plain body, and so does a loop too short for the
    widening to save MIN_WIDENING_GAIN cycles (40 iterations: 20)."""
    import numpy as np

    from codegen import modulo
    from device_sim.simulator import Simulator

    def run() -> tuple[np.ndarray, np.ndarray, int, list[str], list]:
        mc = compile_function(differences_loop(count), next_id=1000, pipeline=True, verify=True)
        sim = Simulator("small")
        sim.load(mc.program)
        sim.vmem[IN_ROW:IN_ROW + count * 8] = x.view(np.uint32)
        bundles = sim.run().bundles
        out = sim.vmem[OUT_ROW:OUT_ROW + count * 16].view(np.float32).reshape(count, 16, -1)[:, :8]
        return out.copy(), sim.vmem[LAST_ROW:LAST_ROW + 8].view(np.float32).copy(), bundles, mc.log, mc.pipelined

    x = np.random.default_rng(0).standard_normal((count * 8, 8)).astype(np.float32)
    x[:8, :3] = [np.inf, np.nan, -0.0]
    out, last, bundles, log, pipelined = run()
    chunks = x.reshape(count, 8, 8)
    expected = chunks - np.concatenate([np.zeros((1, 8, 8), np.float32), chunks[:-1]])
    np.testing.assert_array_equal(out.view(np.uint32), expected.view(np.uint32))
    np.testing.assert_array_equal(last.view(np.uint32), chunks[-1].view(np.uint32))
    assert len(pipelined) == 1, log
    monkeypatch.setattr(modulo, "MAX_WIDTH", 1)
    plain_out, plain_last, plain_bundles, _, plain = run()
    assert plain[0].sched.ii == 2 and len(plain[0].body) == 6, plain[0].body
    np.testing.assert_array_equal(plain_out.view(np.uint32), out.view(np.uint32))
    np.testing.assert_array_equal(plain_last.view(np.uint32), last.view(np.uint32))
    if count % 2:
        assert not any("widened" in line for line in log) and bundles == plain_bundles
        short = compile_function(differences_loop(40), next_id=1000, pipeline=True)
        assert not any("widened" in line for line in short.log), short.log
        return
    assert any("widened to 2" in line for line in log), log
    assert len(pipelined[0].body) == 10, pipelined[0].body  # two copies of 4, one addi a base
    assert pipelined[0].sched.ii <= 3, pipelined[0].sched  # 3 scalar ops for two iterations: 2 at best
    assert bundles < 0.8 * plain_bundles, (bundles, plain_bundles)


@pytest.mark.parametrize("count", [40, 41])
def test_a_runtime_trip_count_runs_at_least_the_wanted_iterations(count: int) -> None:
    """A counted loop with a runtime trip count (`wanted`, a launch register: a dynamic-shape bucket's valid
    chunks), software-pipelined: for every wanted value it computes at least the wanted chunks and at most
    `count`, with the prologue and epilogue of the static loop, and runs fewer bundles for fewer chunks.
    Its kernel runs one iteration a run (II 1, 7 stages); the division for other unrolls is checked below."""
    import numpy as np

    from device_sim.simulator import Simulator

    f, _ = chunk_loop(count, wanted=Reg("s", 1, True))
    mc = compile_function(f, next_id=1000, pipeline=True, verify=True)
    assert mc.pipelined, mc.log
    bundles = {}
    for wanted in (1, 2, 5, count // 2, count - 1, count, count + 7):
        sim = Simulator("small")
        x = np.arange(count * 8 * sim.vmem.shape[1], dtype=np.float32).reshape(count * 8, -1)
        sim.load(mc.program)
        sim.vmem[IN_ROW:IN_ROW + count * 8] = x.view(np.uint32)
        bundles[wanted] = sim.run({1: wanted}).bundles
        out = sim.vmem[OUT_ROW:OUT_ROW + count * 8].view(np.float32)
        done = int((out != 0).any(axis=1).sum()) // 8  # x * 2 + 1 is never 0 here
        assert min(wanted, count) <= done <= count, (wanted, done)
        np.testing.assert_array_equal(out[:done * 8], x[:done * 8] * 2 + 1)
        assert not out[done * 8:].any()
    assert bundles[1] < bundles[count // 2] < bundles[count] == bundles[count + 7], bundles


@pytest.mark.parametrize("u", [1, 2, 3, 5, 6, 7, 12])
def test_the_runtime_trip_count_divides_exactly(u: int) -> None:
    from codegen.modulo import _reciprocal

    most = 4096
    found = _reciprocal(u, most)
    assert found is not None
    s, m = found
    assert all((x * m) >> s == x // u for x in range(most + 1)) and most * m < 2**31


def test_a_program_over_imem_is_compiled_again_with_no_loop_larger_than_its_schedule() -> None:
    """silu(a) * erf(b) in bf16 on `large`: its loop runs fastest with its constants in a vmem pool, a
    deeper pipeline with more code. Where imem is one bundle short of that program, the compiler compiles
    it again with every loop's code at most its given schedule's (`compact_code`), and it fits: the same
    bits (edge values included); 464 -> 384 bundles, 19,616 -> 35,916 cycles. (A decode softmax's division
    was this test's pool until the reciprocal unit made it one instruction.)"""
    import dataclasses

    import numpy as np
    import torch
    import torch.nn.functional as F
    from codegen_helpers import trace

    from codegen import compile_graph
    from device_sim.config import get_config
    from device_sim.executable import run_fresh
    from device_sim.runners import SimulatorRunner

    torch.manual_seed(5)
    a, b = torch.randn(64, 8192).to(torch.bfloat16), torch.randn(64, 8192).to(torch.bfloat16)
    a[0, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-39, -3e38])
    b[1, :4] = torch.tensor([float("nan"), float("inf"), 0.0, -0.0])

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.silu(a) * torch.erf(b)

    def build(imem: int) -> tuple[np.ndarray, int, int, bool]:
        cfg = dataclasses.replace(get_config("large"), imem_bundles=imem)
        exe = compile_graph(trace(f, a, b), [a, b], cfg)
        (out,), stats = run_fresh(exe, [a.float().numpy(), b.float().numpy()], SimulatorRunner("large"))
        return out, stats.cycles, exe.summary["bundles"], exe.summary["compact_code"]

    fast, cycles, bundles, compact = build(get_config("large").imem_bundles)
    assert not compact
    small, small_cycles, small_bundles, small_compact = build(bundles - 1)
    assert small_compact and small_bundles < bundles and small_cycles > cycles, (small_bundles, bundles)
    np.testing.assert_array_equal(small.view(np.uint32), fast.view(np.uint32))
    torch.testing.assert_close(torch.from_numpy(fast), f(a, b).float(), rtol=1.6e-2, atol=1e-5, equal_nan=True)
