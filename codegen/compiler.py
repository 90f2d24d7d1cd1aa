"""`compile_graph`: an FX graph -> one CTPU program (a megakernel) + its HBM layout and launch ABI.

Pipeline: FX -> MLIR linalg on tensors (fx_to_mlir) -> upstream passes incl. elementwise fusion and
bufferization (mlir_pipeline) -> kernels over HBM views (kernels) -> HBM memory plan (by liveness) ->
instruction selection into machine IR (isel_vector, isel_matmul) -> list scheduling, register allocation,
assembly, binary (backend).

Launch ABI: s1 holds the HBM byte address of the *arena*, which holds every intermediate and every output
(at their placements' offsets) and starts with the *argument table*: I + 1 int32 words, the HBM byte
addresses of the I graph inputs (in placeholder order) and of the arena itself. `CompiledGraph.launch`
writes the table; the program's entry copies it to vmem, and each kernel loads the addresses it uses.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.fx

from codegen import isel_scalar_ops  # noqa: F401  (registers the extra body-op lowerings)
from codegen.backend import MachineCode, compile_functions
from codegen.builder import Builder
from codegen.errors import CapacityError
from codegen.fx_to_mlir import emit_module
from codegen.isel_common import SPILL_ROWS, KernelContext, Region, table_rows
from codegen.isel_gather import lower_gather, lower_iota
from codegen.isel_matmul import lower_matmul
from codegen.isel_vector import lower_fill, lower_generic
from codegen.kernels import (
    FillKernel,
    GatherKernel,
    GenericKernel,
    IotaKernel,
    Kernel,
    KernelGraph,
    MatmulKernel,
    View,
    describe,
    read_function,
)
from codegen.mir import Function, Reg
from codegen.mlir_pipeline import run_pipeline
from device_sim import numerics
from device_sim.config import HardwareConfig, get_config
from device_sim.program import Program
from device_sim.simulator import RunStats, Simulator

ALIGN = 64
ARENA_REG = Reg("s", 1, True)  # the one launch register


@dataclass
class BufferPlacement:
    name: str
    kind: str  # "input" | "arena"
    offset: int  # byte offset in the arena (arena buffers) or 0 (inputs: their own address in the table)
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


@dataclass
class CompiledGraph:
    """One compiled graph: the program, its HBM layout and launch ABI, and the text of every stage."""

    config: HardwareConfig
    program: Program
    inputs: list[BufferPlacement]
    outputs: list[View]
    placements: dict[str, BufferPlacement]
    arena_bytes: int
    stages: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)

    def launch(self, hbm: np.ndarray, input_addrs: Sequence[int], arena_addr: int) -> dict[int, int]:
        """Write the argument table at the start of the arena (in `hbm`, the device's bytes) and return the
        launch registers: {1: arena address}."""
        table = np.array([*input_addrs, arena_addr], dtype=np.uint32)
        if len(table) != len(self.inputs) + 1:
            raise ValueError(f"the graph has {len(self.inputs)} inputs, {len(input_addrs)} addresses were given")
        hbm[arena_addr : arena_addr + table.nbytes] = table.view(np.uint8)
        return {ARENA_REG.n: arena_addr}

    @staticmethod
    def input_bits(placement: BufferPlacement, x: np.ndarray) -> np.ndarray:
        """An input as the bits the program expects in HBM (fp32; bf16 as uint16; integers narrowed to
        int32; bools as 0 / ~0 int32 masks)."""
        return _to_device(np.asarray(x), placement.dtype)

    def read_outputs(self, hbm: np.ndarray, input_addrs: Sequence[int], arena: int) -> list[np.ndarray]:
        """The graph's outputs (fp32 arrays, bf16 results widened exactly; int32; bool) from HBM bytes."""
        outs = []
        for v in self.outputs:
            p = self.placements[v.buffer]
            base = input_addrs[self.inputs.index(p)] if p.kind == "input" else arena + p.offset
            outs.append(_read_view(hbm, base, p, v))
        return outs

    def stage(self, inputs: Sequence[np.ndarray]) -> tuple[np.ndarray, list[int], int, dict[int, int]]:
        """A fresh HBM image for one launch: inputs packed from address 0, the arena after them with its
        argument table. Returns (hbm bytes, input addresses, arena address, launch registers)."""
        data = [self.input_bits(p, x).reshape(-1).view(np.uint8) for p, x in zip(self.inputs, inputs, strict=True)]
        addrs = [sum(-(-d.nbytes // ALIGN) * ALIGN for d in data[:i]) for i in range(len(data))]
        arena = sum(-(-d.nbytes // ALIGN) * ALIGN for d in data)
        if arena + self.arena_bytes > self.config.hbm_bytes:
            raise CapacityError(f"graph needs {arena + self.arena_bytes} bytes of HBM; {self.config.name} has "
                                f"{self.config.hbm_bytes}")
        hbm = np.zeros(self.config.hbm_bytes, dtype=np.uint8)
        for a, d in zip(addrs, data, strict=True):
            hbm[a : a + d.nbytes] = d
        return hbm, addrs, arena, self.launch(hbm, addrs, arena)

    def run_on_simulator(self, inputs: Sequence[np.ndarray], trace: bool = False) -> tuple[list[np.ndarray], RunStats]:
        """Run on a fresh simulator (HBM laid out by `stage`)."""
        hbm, addrs, arena, args = self.stage(inputs)
        sim = Simulator(self.config, trace=trace)
        sim.load(self.program)
        sim.hbm[:] = hbm
        stats = sim.run(args)
        return self.read_outputs(sim.hbm, addrs, arena), stats

    def dump(self, directory: str | os.PathLike[str]) -> None:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        for i, (name, text) in enumerate(self.stages.items()):
            (d / f"{i:02d}_{name}").write_text(text)
        (d / "program.bin").write_bytes(self.program.to_bytes())
        (d / "summary.json").write_text(json.dumps(self.summary, indent=2))


def _to_device(x: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "i1":
        return np.where(np.asarray(x) != 0, -1, 0).astype(np.int32)
    if dtype == "i32":
        x = np.asarray(x)
        if x.size and (x.max() > np.iinfo(np.int32).max or x.min() < np.iinfo(np.int32).min):
            raise ValueError("integer input does not fit int32 (the CTPU narrows int64 tensors to int32)")
        return np.ascontiguousarray(x, dtype=np.int32)
    if dtype == "bf16":
        if x.dtype == np.uint16:
            return np.ascontiguousarray(x)
        return numerics.f32_to_bf16_bits(np.ascontiguousarray(x, dtype=np.float32))
    return np.ascontiguousarray(x, dtype=np.float32)


def _read_view(hbm: np.ndarray, base: int, p: BufferPlacement, v: View) -> np.ndarray:
    np_dtype = {"bf16": np.uint16, "i32": np.int32, "i1": np.int32}.get(p.dtype, np.float32)
    flat = hbm[base : base + p.nbytes].view(np_dtype)
    if p.dtype == "bf16":
        flat = numerics.bf16_bits_to_f32(flat)
    item = flat.itemsize
    out = np.array(np.lib.stride_tricks.as_strided(flat[v.offset:], v.shape, tuple(s * item for s in v.strides)))
    return out != 0 if p.dtype == "i1" else out


def plan_memory(g: KernelGraph) -> tuple[dict[str, BufferPlacement], int]:
    """Arena offsets for temporaries by liveness (first-fit reuse); outputs live to the end. The arena
    starts with the argument table."""
    last = len(g.kernels)
    live: dict[str, list[int]] = {}
    for i, k in enumerate(g.kernels):
        for v in _views(k):
            span = live.setdefault(v.buffer, [i, i])
            span[0], span[1] = min(span[0], i), max(span[1], i)
    for v in g.results:
        live.setdefault(v.buffer, [last, last])[1] = last
    placements: dict[str, BufferPlacement] = {}
    table = -(-4 * (len(g.arguments) + 1) // ALIGN) * ALIGN
    active: list[tuple[int, int, int]] = [(0, table, last + 1)]  # (offset, nbytes, end)
    arena = table
    for name, buf in g.buffers.items():
        if buf.kind == "input":
            placements[name] = BufferPlacement(name, "input", 0, buf.nbytes, buf.shape, buf.dtype)
    temps = sorted((n for n, b in g.buffers.items() if b.kind == "temp"), key=lambda n: live.get(n, [0, 0])[0])
    for name in temps:
        buf = g.buffers[name]
        start, end = live.get(name, [0, 0])
        active = [a for a in active if a[2] >= start]
        size = -(-buf.nbytes // ALIGN) * ALIGN
        offset = 0
        for a_off, a_size, _ in sorted(active):
            if offset + size <= a_off:
                break
            offset = max(offset, a_off + a_size)
        active.append((offset, size, end))
        arena = max(arena, offset + size)
        placements[name] = BufferPlacement(name, "arena", offset, buf.nbytes, buf.shape, buf.dtype)
    return placements, arena


def _views(k: Kernel) -> list[View]:
    if isinstance(k, GenericKernel):
        return [o.view for o in k.inputs] + [k.output.view]
    if isinstance(k, FillKernel | IotaKernel):
        return [k.output]
    if isinstance(k, GatherKernel):
        return [k.table, k.ids.view, k.output]
    return [k.a, k.b, k.c]


def _drop_matmul_fills(kernels: list[Kernel]) -> list[Kernel]:
    """A zero fill of a buffer whose next reader or writer is a matmul writing all of it is implied by
    `mxu.mms` (the first pass overwrites C)."""
    out: list[Kernel] = []
    for i, k in enumerate(kernels):
        if isinstance(k, FillKernel) and k.value == 0.0:
            nxt = next((n for n in kernels[i + 1:] if any(v.buffer == k.output.buffer for v in _views(n))), None)
            if isinstance(nxt, MatmulKernel) and nxt.c.buffer == k.output.buffer and nxt.c.offset == k.output.offset \
                    and math.prod(nxt.c.shape) == math.prod(k.output.shape) and _dense(nxt.c) and _dense(k.output):
                continue
        out.append(k)
    return out


def _dense(v: View) -> bool:
    expected = 1
    for size, stride in reversed(list(zip(v.shape, v.strides, strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], config: str = "small",
                  options: dict[str, Any] | None = None) -> CompiledGraph:
    """Compile `gm` to one CTPU program. `stages` holds the text of every stage (FX, MLIR before and after
    each upstream pass, the kernel graph, machine IR, scheduled bundles, assembly); `summary` the layout,
    per-kernel instruction counts and bundles and the seconds each phase took. Options: `matmul_precision`,
    `dump_dir`, `name`, `progress` (called with (kernels done, total) as the back end compiles each)."""
    options = dict(options or {})
    cfg = get_config(config)
    precision = options.get("matmul_precision", torch.get_float32_matmul_precision())
    clock = _Clock()
    stages: dict[str, str] = {"fx.txt": gm.print_readable(print_output=False) if hasattr(gm, "print_readable")
                              else str(gm.graph)}
    text, _, _ = emit_module(gm, example_inputs)
    clock.lap("fx_to_mlir")
    pipeline = run_pipeline(text)
    for name, ir_text in pipeline.stages:
        stages[f"mlir_{name}.mlir"] = ir_text
    clock.lap("mlir_passes")
    with pipeline.context:
        graph = read_function(pipeline.module)
    graph.kernels = _drop_matmul_fills(graph.kernels)
    stages["kernels.txt"] = describe(graph)
    placements, arena_bytes = plan_memory(graph)
    clock.lap("kernels_and_memory_plan")
    funcs, per_kernel, scratch = _select(graph, placements, arena_bytes, cfg, precision)
    arena_bytes += scratch
    machine_ir = "".join(f"# {f.name}\n{f.dump()}" for f in funcs)
    clock.lap("instruction_selection")
    mc: MachineCode = compile_functions(funcs, next_id=max(f.max_reg_id() for f in funcs) + 1,
                                        source_name="<compiled graph>", progress=options.get("progress"))
    clock.lap("schedule_regalloc_assemble")
    for info, n in zip(per_kernel, mc.function_bundles[1:-1], strict=True):  # without the entry and the exit
        info["bundles"] = n
    if len(mc.program) > cfg.imem_bundles:
        raise CapacityError(f"program of {len(mc.program)} bundles does not fit imem ({cfg.imem_bundles} bundles)")
    stages["machine_ir.txt"] = machine_ir
    stages["scheduled.txt"] = mc.scheduled_text()
    stages["program.s"] = mc.assembly
    inputs = [placements[n] for n in graph.arguments]
    summary = {"config": cfg.name, "kernels": per_kernel, "bundles": len(mc.program), "spilled": mc.spilled,
               "matmul_precision": precision, "arena_bytes": arena_bytes,
               "launch": {"s1": "arena", "argument_table": [*graph.arguments, "arena"]},
               "buffers": {n: dataclasses.asdict(p) for n, p in placements.items()},
               "outputs": [dataclasses.asdict(v) for v in graph.results], "compile_seconds": clock.laps}
    compiled = CompiledGraph(cfg, mc.program, inputs, graph.results, placements, arena_bytes, stages, summary)
    dump_dir = options.get("dump_dir") or os.environ.get("CTPU_DUMP_DIR")
    if dump_dir:
        compiled.dump(Path(dump_dir) / options.get("name", "graph"))
    return compiled


class _Clock:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._t, 4)
        self._t = now


def _select(graph: KernelGraph, placements: dict[str, BufferPlacement], arena_bytes: int, cfg: HardwareConfig,
            precision: str) -> tuple[list[Function], list[dict[str, Any]], int]:
    """Instruction selection into one machine-IR function per kernel, in order: the entry copies the
    argument table to vmem, then the kernels, then the exit halts (+ the HBM scratch bytes the kernels need
    beyond the arena)."""
    n_in = len(graph.arguments)
    arena = n_in  # the arena's entry in the argument table
    buffers = {name: (i, 0) for i, name in enumerate(graph.arguments)}
    buffers |= {name: (arena, p.offset) for name, p in placements.items() if p.kind == "arena"}
    table = Region("args", SPILL_ROWS, table_rows(n_in + 1, cfg.lanes))
    entry = Function(pinned=(ARENA_REG,), name="entry")
    b = Builder(entry)
    ctx = KernelContext(b, cfg, buffers, (arena, arena_bytes), table.row, precision)
    ctx.begin(entry.name)
    ctx.dma(True, "i32", ARENA_REG, table, 0, 1, n_in + 1, n_in + 1, 0)
    ctx.end()
    funcs = [entry]
    per_kernel = []
    for i, k in enumerate(graph.kernels):
        func = Function(name=f"kernel {i} ({type(k).__name__})")
        b.start_function(func, f"k{i}")
        ctx.begin(func.name)
        if isinstance(k, GenericKernel):
            lower_generic(ctx, k)
        elif isinstance(k, FillKernel):
            lower_fill(ctx, k)
        elif isinstance(k, GatherKernel):
            lower_gather(ctx, k)
        elif isinstance(k, IotaKernel):
            lower_iota(ctx, k)
        else:
            lower_matmul(ctx, k)
        ctx.end()
        funcs.append(func)
        per_kernel.append({"index": i, "kind": _kind(k), "instructions": sum(len(blk.instrs) for blk in func.blocks),
                           "mlir": k.text.splitlines()[0] if k.text else ""})
    funcs.append(Function(name="exit"))
    b.start_function(funcs[-1], "exit")
    b.emit("halt")
    return funcs, per_kernel, ctx.scratch_peak


def _kind(k: Kernel) -> str:
    if isinstance(k, MatmulKernel):
        return "matmul"
    if isinstance(k, FillKernel):
        return "fill"
    if isinstance(k, GatherKernel):
        return "gather"
    if isinstance(k, IotaKernel):
        return "iota"
    return "reduction" if k.reduction else "elementwise"

