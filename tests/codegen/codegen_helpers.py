"""Shared helpers: trace a function (or capture a model as the backend sees it) to a core-ATen FX graph,
compile it, run it on the simulator (also on vmem poisoned with NaN at every kernel's start)."""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from codegen import compile_graph
from device_sim.executable import Executable, read_output, run_fresh, stage
from device_sim.runners import SimulatorRunner
from device_sim.simulator import Simulator


def trace(fn, *xs: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, decomposition_table=core_aten_decompositions())(*xs)


def capture(fn, *inputs: torch.Tensor) -> tuple[torch.fx.GraphModule, list[torch.Tensor]]:
    """The core-ATen graph dynamo + AOT autograd make of `fn` (what the ctpu backend receives), with the
    real tensors it is called with (parameters lifted to inputs)."""
    from torch._dynamo.backends.common import aot_autograd

    box: dict[str, object] = {}

    def fw(gm: torch.fx.GraphModule, _: object):
        box["gm"] = gm

        def run(*args: torch.Tensor):
            box["args"] = list(args)
            return gm(*args)
        return run

    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(fn, backend=aot_autograd(fw_compiler=fw, decompositions=core_aten_decompositions()))(*inputs)
    return box["gm"], box["args"]  # type: ignore[return-value]


def capture_with_mutations(fn, *inputs: torch.Tensor) -> tuple[torch.fx.GraphModule, list, list[int]]:
    """(the graph the backend receives, its example inputs, where each of `inputs` is among its inputs)."""
    from torch._dynamo.backends.common import aot_autograd

    box: dict[str, object] = {}

    def fw(gm: torch.fx.GraphModule, examples: list):
        box["gm"], box["examples"] = gm, examples

        def run(*args: torch.Tensor):
            box["args"] = list(args)
            return gm(*args)
        return run

    torch._dynamo.reset()
    copies = [x.clone() for x in inputs]
    with torch.no_grad():
        torch.compile(fn, backend=aot_autograd(fw_compiler=fw, decompositions=core_aten_decompositions(),
                                               keep_inference_input_mutations=True))(*copies)
    args: list[torch.Tensor] = box["args"]  # type: ignore[assignment]
    order = [next(i for i, a in enumerate(args) if a is c) for c in copies]
    return box["gm"], box["examples"], order  # type: ignore[return-value]


def compile_and_run(fn, *xs: torch.Tensor, config: str = "small", **options) -> tuple[list[np.ndarray],
                                                                                     list[np.ndarray], Executable]:
    gm = trace(fn, *xs)
    cg = compile_graph(gm, list(xs), config, **options)
    outs, stats = run_fresh(cg, [x.float().numpy() for x in xs], SimulatorRunner(config))
    ref = fn(*xs)
    ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    cg.last_stats = stats  # type: ignore[attr-defined]
    return outs, [r.float().numpy() for r in ref], cg


POISON_BITS = 0x7FC00001  # a quiet NaN: what a vmem row no one wrote may hold on the device


def run_with_poisoned_vmem(exe: Executable, inputs: list[np.ndarray]) -> list[np.ndarray]:
    """Run `exe` on a fresh simulator that overwrites all of vmem but the argument table (with a layer
    loop's address window and cursor) with NaN each time a kernel starts. A kernel owns vmem (isel_common:
    nothing lives from one kernel into the next but the rows a summary entry names `vmem_carried`, a decode
    stream's prefetched weights, and `vmem_resident`, what the kernel before left there for it), so a correct
    program gives the same bits as on a zeroed vmem; a kernel that reads a row it never wrote (in the plain
    run: zeros, or whatever the kernels before it left there) now computes with NaN."""
    hbm, addrs, arena, regs = stage(exe, inputs)
    sim = Simulator(exe.hardware)
    sim.m.hbm = hbm
    sim.load(exe.program)
    compiled = [k for k in exe.summary["kernels"] if "start" in k]
    starts = [k["start"] for k in compiled]
    runs = {k["start"]: k.get("runs", 1) for k in compiled}
    carried = {k["start"]: ([k["vmem_carried"]] if "vmem_carried" in k else []) + k.get("vmem_resident", [])
               for k in compiled}
    args = exe.summary["vmem_table_rows"]
    poisoned: dict[int, int] = {}

    def poison(m, op, t, pc: int) -> None:
        poisoned[pc] = poisoned.get(pc, 0) + 1
        kept = [args, *carried[pc]]
        saved = [m.vmem[lo:hi].copy() for lo, hi in kept]
        m.vmem[:] = POISON_BITS
        for (lo, hi), rows in zip(kept, saved, strict=True):
            m.vmem[lo:hi] = rows

    for pc in starts:
        b = sim.decoded[pc]  # decoded bundles are shared (a cache): this program's start gets its own
        sim.decoded[pc] = dataclasses.replace(b, ops=((functools.partial(poison, pc=pc), None), *b.ops))
    sim.run(regs)
    assert poisoned == runs  # each kernel poisoned once per run (no loop inside a kernel starts at its start)
    return [read_output(hbm, v, addrs, arena) for v in exe.outputs]
