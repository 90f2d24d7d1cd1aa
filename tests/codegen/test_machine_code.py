"""Scheduler and register allocator on random DAGs, checked by the verifiers."""

from __future__ import annotations

import random
import signal

import pytest

from codegen.builder import Builder
from codegen.machine_code import compile_function, schedule_function
from codegen.mir import Function, MInstr, Reg
from codegen.regalloc import allocate
from codegen.schedule import PRESSURE_LIMIT, schedule_block
from codegen.verify import verify_allocation, verify_schedule

OPS = ["vadd.f", "vmul.f", "vsub.f", "vred.sum.l", "vmax.f"]


def random_block(seed: int, n: int, width: int) -> Function:
    rng = random.Random(seed)
    f = Function()
    b = Builder(f)
    values = [b.vconst(float(i)) for i in range(3)]
    for _ in range(n):
        op = rng.choice(OPS)
        srcs = rng.sample(values[-width:], 1 if op == "vred.sum.l" else 2) if len(values) >= 2 else values * 2
        values.append(b.vop(op, *srcs))
    acc = values[0]
    for v in values[1:]:
        acc = b.vop("vadd.f", acc, v)  # keep everything live to the end: pressure
    s = b.sreg()
    b.emit("vext", s, (acc,), imm=0)
    b.emit("halt")
    return f


@pytest.mark.parametrize("seed", range(6))
def test_schedule_respects_latencies_and_slots(seed: int) -> None:
    f = random_block(seed, 60, 6)
    bundles = schedule_function(f)
    for blk in f.blocks:
        verify_schedule(blk.instrs, bundles[blk.label])


def test_schedule_packs_independent_work() -> None:
    f = Function()
    b = Builder(f)
    x, y = b.vconst(1.0), b.vconst(2.0)
    for _ in range(16):
        b.vop("vadd.f", x, y)  # independent: two vector slots per bundle
    b.emit("halt")
    bundles = schedule_function(f)[f.blocks[0].label]
    verify_schedule(f.blocks[0].instrs, bundles)
    assert len(bundles) <= 8 + 6


def test_pressure_waits_that_block_each_other_across_kinds_do_not_hang_the_scheduler() -> None:
    """Scalars and vectors both at their pressure limit; X (vbcast) frees a scalar but needs a vector register,
    Y (vext) frees a vector but needs a scalar one: each waited for the other forever (a dynamic-shape
    attention kernel's spills hung the compiler so)."""
    s, v = [Reg("s", i) for i in range(200)], [Reg("v", i) for i in range(200)]
    ns, nv = PRESSURE_LIMIT["s"], PRESSURE_LIMIT["v"]
    instrs = [MInstr("li", s[100], imm=1), MInstr("viota", v[100])]
    for k in range(30):  # one live value each, and X's and Y's inputs late: the fills below come first
        instrs += [MInstr("add", s[101 + k], (s[100 + k], s[100 + k])),
                   MInstr("vadd.f", v[101 + k], (v[100 + k], v[100 + k]))]
    instrs += [MInstr("li", s[i], imm=i) for i in range(ns)] + [MInstr("viota", v[i]) for i in range(nv)]
    instrs += [MInstr("vbcast", v[50], (s[130],)), MInstr("vext", s[50], (v[130],), imm=0)]  # X, Y
    for j in range(nv):  # everything stays live until X's and Y's results are read
        instrs.append(MInstr("vadd.f", v[60 + j], (v[50] if j == 0 else v[59 + j], v[j])))
    for j in range(ns):
        instrs.append(MInstr("add", s[60 + j], (s[50] if j == 0 else s[59 + j], s[j])))

    def hung(*_: object) -> None:
        raise TimeoutError("the list scheduler did not finish a 150-instruction block in 20 s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(20)
    try:
        bundles = schedule_block(instrs)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    verify_schedule(instrs, bundles)
    assert sum(map(len, bundles)) == len(instrs)


@pytest.mark.parametrize("seed", range(3))
def test_regalloc_under_pressure_spills_and_stays_correct(seed: int) -> None:
    f = random_block(seed, 90, 90)  # ~90 values live at once: more than 32 vregs
    mc = compile_function(f, next_id=10_000)
    assert mc.spilled > 0
    for blk in mc.func.blocks:
        verify_schedule(blk.instrs, mc.bundles[blk.label])
        verify_allocation(blk.instrs, mc.bundles[blk.label], mc.assignment)


def test_regalloc_without_pressure_needs_no_spill() -> None:
    f = random_block(1, 20, 4)
    bundles = schedule_function(f)
    assignment, spills = allocate(f, bundles)
    assert not spills
    for blk in f.blocks:
        verify_allocation(blk.instrs, bundles[blk.label], assignment)


def test_program_is_encoded_from_the_bundles_and_its_text_assembles_to_the_same_words() -> None:
    """The compiler encodes bundles directly; `program.s` is a dump. Assembling that dump must give the same
    words, labels and source lines (loops, branches, DMA, MXU and every vector unit included)."""
    import torch
    import torch.nn.functional as F
    from codegen_helpers import compile_and_run

    from device_sim.asm import assemble

    x, w = torch.randn(8, 24), torch.randn(24, 16)
    for fn in (lambda x, w: F.softmax(x @ w, -1), lambda x, w: torch.sin(x).sum(-1) + w[0, :8]):
        _, _, exe = compile_and_run(fn, x, w)
        text = assemble(exe.stages["program.s"])
        assert text.bundles == exe.program.bundles
        assert text.labels == exe.program.labels and text.source_lines == exe.program.source_lines


def test_flag_roles_are_disjoint_and_fit_the_machine() -> None:
    """Every completion-flag role has flags of its own (width-2 roles by parity), all within NUM_FLAGS."""
    from codegen.isel_common import FLAG_WIDTH, Flag
    from device_sim.isa import NUM_FLAGS

    used = [int(role) + p for role in Flag for p in range(FLAG_WIDTH.get(role, 1))]
    assert len(used) == len(set(used)) and max(used) < NUM_FLAGS


def test_a_program_too_large_for_imem_costs_little_back_end() -> None:
    """A graph whose program cannot fit imem raises ProgramTooLargeError (the backend then splits it) without
    compiling every kernel first: clearly too large (by the estimate from its machine instructions), no kernel
    is compiled; otherwise compilation stops at the kernel that crosses imem. (The tiny Llama's backward
    graph, 48k bundles on small's 32k, paid its whole back end, about a third of its compile, for nothing.)"""
    import dataclasses

    import torch
    from codegen_helpers import trace

    from codegen import compiler
    from codegen.errors import ProgramTooLargeError
    from device_sim.config import get_config

    x = torch.randn(16, 32)
    gm = trace(lambda x: (x * 2.0).sum(-1, keepdim=True) + x.amax(-1, keepdim=True) * x, x)
    done: list[int] = []
    fits = compiler.compile_graph(gm, [x], "small", progress=lambda k, n: done.append(k))
    size, kernels = len(fits.program), len(done)
    small = get_config("small")

    def compile_with_imem(bundles: int) -> list[int]:
        calls: list[int] = []
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(compiler, "get_config", lambda name: dataclasses.replace(small, imem_bundles=bundles))
            if bundles > size // 2:
                mp.setattr(compiler, "BUNDLES_PER_INSTRUCTION", 0.0)  # the estimate off: the back end's check
            with pytest.raises(ProgramTooLargeError):
                compiler.compile_graph(gm, [x], "small", progress=lambda k, n: calls.append(k))
        return calls

    assert compile_with_imem(size // 4) == []
    assert 0 < len(compile_with_imem(size * 2 // 3)) < kernels


def test_two_silu_tanh_products_in_bf16_allocate_on_large() -> None:
    """silu(a) * tanh(b) + tanh(a) * silu(b), bf16 [64, 8192] on `large`: one elementwise generic whose
    straight-line body spills about 40 values. With spill slots taken first-fit, slot 0 is reused at once:
    the memory order of one slot (a fill before the next value's store) holds stores and reloads hundreds of
    bundles from their values, and every round spills the reloads again (no convergence in 32 rounds, since
    the exp unit). The driver then spills again from the start with slots taken least recently freed, which
    allocates in a few rounds, with eager's values."""
    import numpy as np
    import torch
    import torch.nn.functional as F
    from codegen_helpers import compile_and_run

    torch.manual_seed(0)
    a, b = torch.randn(64, 8192).to(torch.bfloat16), torch.randn(64, 8192).to(torch.bfloat16)

    def f(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return F.silu(a) * torch.tanh(b) + torch.tanh(a) * F.silu(b)

    outs, refs, _ = compile_and_run(f, a, b, config="large")
    np.testing.assert_allclose(outs[0], refs[0], rtol=1e-2, atol=1e-2)
