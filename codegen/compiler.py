"""`compile_graph`: an FX graph -> one CTPU program (a megakernel) + its HBM layout: an `Executable`.

Pipeline: FX -> MLIR linalg on tensors (fx_to_mlir) -> upstream passes incl. elementwise fusion and
bufferization (mlir_pipeline) -> kernels over HBM views (kernels) -> HBM memory plan (by liveness) ->
instruction selection into machine IR (isel_vector, isel_matmul) -> list scheduling, register allocation,
assembly, binary (backend).

Launch ABI: s1 holds the HBM byte address of the *arena*, which holds every intermediate and every output
(at their placements' offsets) and starts with the *argument table*: I + 1 int32 words, the HBM byte
addresses of the I graph inputs (in placeholder order) and of the arena itself, then the layer loops'
per-repetition address tables (`Executable.address_table`, see `layer_loop`). `device_sim.executable`
writes the tables at launch; the program's entry copies the argument table to vmem, and each kernel loads
the addresses it uses.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.fx

from codegen import isel_scalar_ops  # noqa: F401  (registers the extra body-op lowerings)
from codegen.attention import QUERY_DIM
from codegen.builder import Builder
from codegen.errors import CapacityError, ProgramTooLargeError
from codegen.fx_ops import emit_module
from codegen.isel_common import (
    SPILL_ROWS,
    Flag,
    KernelContext,
    Preload,
    Region,
    Rows,
    rows_within,
    stay_in_flight,
    table_rows,
    wait_for_stores,
)
from codegen.isel_decode import (
    PREFETCH_KERNELS,
    Issue,
    Prefetch,
    issue_prefetch,
    loop_edge_cost,
    plan_prefetches,
    split_ragged_streams,
    streams_back_to_back,
)
from codegen.isel_gather import lower_gather, lower_iota, lower_scatter
from codegen.isel_matmul import first_batch_weights, lower_matmul
from codegen.isel_vector import (
    KernelChain,
    form_chains,
    lower_chain,
    lower_fill,
    lower_generic,
    lower_tiled_chain,
    rows_to_preload,
    tiled_runs,
)
from codegen.kernel_graph import (
    Access,
    FillKernel,
    GatherKernel,
    GenericKernel,
    IotaKernel,
    Kernel,
    KernelGraph,
    LoweringError,
    MatmulKernel,
    ScatterKernel,
    View,
    describe,
    read_function,
    row_major,
    views_of,
    written_buffer,
)
from codegen.layer_loop import (
    NEXT_ROW,
    Loop,
    emit_footer,
    emit_header,
    emit_init,
    find_loops,
    hoist_invariant_kernels,
    layers_two_at_a_time,
    loop_layout,
    next_slot_name,
    occurrence_slots,
    reads_next_window,
    rename_to_slots,
    sink_fills,
    slot_index,
    slot_name,
)
from codegen.machine_code import MachineCode, compile_functions
from codegen.mir import Function, MInstr, Reg
from codegen.mlir_pipeline import run_pipeline
from device_sim.config import HardwareConfig, get_config
from device_sim.executable import ALIGN, ARENA_REGISTER, ArgSpec, Executable, OutputView
from device_sim.numerics import round_to_bf16

ARENA_REG = Reg("s", ARENA_REGISTER, True)  # the one launch register


@dataclass
class BufferPlacement:
    name: str
    kind: str  # "input" | "arena"
    offset: int  # byte offset in the arena (arena buffers) or 0 (inputs: their own address in the table)
    nbytes: int
    shape: tuple[int, ...]
    dtype: str


def plan_memory(g: KernelGraph, extra_words: int = 0, together: Sequence[tuple[int, int]] = ()
                ) -> tuple[dict[str, BufferPlacement], int]:
    """Arena offsets for temporaries by liveness (first-fit reuse); outputs live to the end. The arena
    starts with the argument table (+ `extra_words`: runtime values and the layer loops' address tables).
    `together`: runs of kernels [first, last] that may run as one (tiled chains, whose tiles interleave the
    members' loads and stores): a buffer any of them touches lives across the whole run."""
    last = len(g.kernels)
    live: dict[str, list[int]] = {}
    for i, k in enumerate(g.kernels):
        for v in views_of(k):
            span = live.setdefault(v.buffer, [i, i])
            span[0], span[1] = min(span[0], i), max(span[1], i)
    for first, end in together:
        for k in g.kernels[first:end + 1]:
            for v in views_of(k):
                span = live[v.buffer]
                span[0], span[1] = min(span[0], first), max(span[1], end)
    for v in g.results:
        live.setdefault(v.buffer, [last, last])[1] = last
    placements: dict[str, BufferPlacement] = {}
    table = -(-4 * (len(g.arguments) + 1 + extra_words) // ALIGN) * ALIGN
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


def _fold_fills(kernels: list[Kernel]) -> list[Kernel]:
    """A fill whose buffer's next reader or writer overwrites all of it without reading it first costs a
    kernel (a DMA latency) for nothing: a zero fill before a matmul writing all of C is implied by `mxu.mms`
    (the first pass overwrites C); a fill before a reduction into exactly its view becomes the reduction's
    initial value (`GenericKernel.init`), a vector constant instead of a load."""
    out: list[Kernel] = []
    folded: dict[int, float] = {}
    for i, k in enumerate(kernels):
        if i in folded:
            assert isinstance(k, GenericKernel)
            out.append(dataclasses.replace(k, init=folded[i]))
            continue
        if isinstance(k, FillKernel):
            j, nxt = next(((j, n) for j, n in enumerate(kernels[i + 1:], i + 1)
                           if any(v.buffer == k.output.buffer for v in views_of(n))), (None, None))
            if isinstance(nxt, MatmulKernel) and k.value == 0.0 and _same_elements(nxt.c, k.output):
                continue
            if isinstance(nxt, GenericKernel) and nxt.reduction and nxt.init is None and _same_elements(
                    nxt.output.view, k.output) and all(a.view.buffer != k.output.buffer for a in nxt.inputs) \
                    and _exact_in(k.value, k.output.dtype):
                assert j is not None
                folded[j] = k.value
                continue
        out.append(k)
    return out


def _fold_output_casts(graph: KernelGraph, kernels: list[Kernel]) -> list[Kernel]:
    """A matmul whose f32 result is read only by a cast to bf16 in the same element order (a projection's
    output, `truncf` fused after it; at one row its [1, H, 1, D] permute is the same order) stores bf16
    itself: its C store rounds as the cast does (RNE, canonical NaN), and the cast's kernel, a DMA latency
    for a few KiB, goes."""
    out = list(kernels)
    for mm in [k for k in kernels if isinstance(k, MatmulKernel)]:
        c = mm.c
        users = [k for k in out if any(v.buffer == c.buffer for v in views_of(k))]
        if len(c.shape) != 2 or c.dtype != "f32" or graph.buffers[c.buffer].kind != "temp" or len(users) != 2 \
                or users[0] is not mm or any(v.buffer == c.buffer for v in graph.results):
            continue
        cast = users[1]
        if not isinstance(cast, GenericKernel) or cast.reduction or len(cast.inputs) != 1 \
                or [op[1:] for op in cast.body.ops] != [("arith.truncf", [cast.body.args[0]])] \
                or cast.body.yields != [cast.body.ops[0][0]] or cast.output.view.dtype != "bf16":
            continue
        src, dst = cast.inputs[0], cast.output
        same_order = all(a == b for size, a, b in zip(cast.sizes, src.iter_strides, dst.iter_strides, strict=True)
                         if size != 1)
        between = out[out.index(mm) + 1:out.index(cast)]  # the result is written earlier: nothing may use it
        if not same_order or not _same_elements(src.view, c) or math.prod(cast.sizes) != math.prod(c.shape) \
                or not _dense(dst.view) or any(v.buffer == dst.view.buffer for k in between for v in views_of(k)):
            continue
        out[out.index(mm)] = dataclasses.replace(mm, c=View(dst.view.buffer, dst.view.offset, c.shape, c.strides,
                                                              "bf16"))
        out.remove(cast)
    return out


def _round_results_read_rounded(graph: KernelGraph, kernels: list[Kernel]) -> list[Kernel]:
    """A matmul whose f32 result every kernel after it reads only through a cast to bf16 (SwiGLU's gate and
    up projections: silu(bf16(gate)) * bf16(up), the casts fused into one generic; q_proj's, permuted) stores
    bf16 itself: its C store rounds as their cast does (RNE, canonical NaN), so the cast of the loaded value
    changes no bit, and half the bytes cross HBM (a 1B layer's 2048-token SwiGLU read 128 MiB of f32
    results). Its readers are those until a kernel writes all of the buffer again (bufferization gives
    q_proj's result and down_proj's one buffer); the buffer keeps its f32 size where it has other lives."""
    out = list(kernels)
    for i, mm in enumerate(out):
        if not isinstance(mm, MatmulKernel):
            continue
        c, buffer = mm.c, graph.buffers[mm.c.buffer]
        touching = [j for j, k in enumerate(out) if j != i and any(v.buffer == c.buffer for v in views_of(k))]
        rewritten = next((j for j in touching if j > i and _writes_all(graph, out[j], c.buffer)), len(out))
        users = [j for j in touching if i < j < rewritten]
        if len(c.shape) != 2 or c.dtype != "f32" or buffer.kind != "temp" or not users \
                or any(v.buffer == c.buffer for v in graph.results) or not _all_of(graph, c) \
                or not all(_reads_only_rounded(out[j], c.buffer) for j in users):
            continue

        out[i] = dataclasses.replace(mm, c=dataclasses.replace(c, dtype="bf16"))
        for j in users:
            k = out[j]
            assert isinstance(k, GenericKernel)
            out[j] = dataclasses.replace(k, inputs=[
                Access(dataclasses.replace(a.view, dtype="bf16"), a.iter_strides) if a.view.buffer == c.buffer else a
                for a in k.inputs])
        if touching == users:
            graph.buffers[c.buffer] = dataclasses.replace(buffer, dtype="bf16")
    return out


def _writes_all(graph: KernelGraph, k: Kernel, name: str) -> bool:
    """Whether kernel k writes every element of buffer `name` and reads none of it (a generic, or a matmul
    whose C is all of it)."""
    if isinstance(k, MatmulKernel):
        return k.c.buffer == name and k.a.buffer != name and k.b.buffer != name and _all_of(graph, k.c)
    return _overwrites(graph, k, name)


def _all_of(graph: KernelGraph, v: View) -> bool:
    """Whether view v covers every element of its buffer, densely."""
    return _dense(v) and not v.offset and math.prod(v.shape) == math.prod(graph.buffers[v.buffer].shape)


def _reads_only_rounded(k: Kernel, name: str) -> bool:
    """Whether k is a generic that reads buffer `name` (and does not write it) only as the operand of
    `arith.truncf` ops (to bf16: a generic's truncf yields bf16)."""
    if not isinstance(k, GenericKernel) or k.output.view.buffer == name:
        return False
    args = {k.body.args[i] for i, a in enumerate(k.inputs) if a.view.buffer == name}
    return not args & set(k.body.yields) and all(
        op == "arith.truncf" for _, op, operands in k.body.ops if args & set(operands))


def _same_elements(a: View, b: View) -> bool:
    """Whether two views of one buffer cover the same elements (both dense, same offset and size)."""
    return a.buffer == b.buffer and a.offset == b.offset and math.prod(a.shape) == math.prod(b.shape) \
        and _dense(a) and _dense(b)


def _exact_in(value: float, dtype: str) -> bool:
    """A float fill value the reduction can start from in f32 exactly as the fill would have stored it."""
    if dtype == "f32":
        return True
    if dtype == "bf16":
        return bool(np.isnan(value)) or float(round_to_bf16(np.float32(value))) == float(np.float32(value))
    return False


def _dense(v: View) -> bool:
    return row_major(v.shape, v.strides)


# A program has 0.67 - 0.70 bundles per machine instruction before scheduling (the tiny Llama's forward and
# backward graphs, halves included): an estimate past imem by the margin is too large, without the back end.
BUNDLES_PER_INSTRUCTION = 0.6
IMEM_MARGIN = 1.25


def compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor], config: str = "small", *,
                  matmul_precision: str | None = None, pipeline: bool = True, verify: bool = False,
                  layer_loops: bool = True, progress: Callable[[int, int], None] | None = None) -> Executable:
    """Compile `gm` to one CTPU program. The executable's `stages` hold the text of every stage (FX, MLIR
    before and after each upstream pass, the kernel graph, machine IR, scheduled bundles, assembly); its
    `summary` the layout, per-kernel instruction counts and bundles and the seconds each phase took.
    matmul_precision: fp32 matmuls ("highest" | "high" | "medium"; default torch's setting). pipeline:
    software-pipeline loops. verify: run the schedule / allocation verifiers. layer_loops: compile each run
of repeated kernel sequences (identical layers) once, as a loop (`layer_loop`). progress(kernels done, total)
    is called as the back end compiles each kernel."""
    cfg = get_config(config)
    precision = matmul_precision or torch.get_float32_matmul_precision()
    clock = _Clock()
    stages: dict[str, str] = {"fx.txt": gm.print_readable(print_output=False) if hasattr(gm, "print_readable")
                              else str(gm.graph)}
    text, _, user_results = emit_module(gm, example_inputs, cfg)
    clock.lap("fx_to_mlir")
    mlir = run_pipeline(text)
    for name, ir_text in mlir.stages:
        stages[f"mlir_{name}.mlir"] = ir_text
    clock.lap("mlir_passes")
    with mlir.context:
        graph = read_function(mlir.module)
    mutated = _mutated_inputs(graph, len(user_results))
    kernels = hoist_invariant_kernels(_fold_fills(sink_fills(graph.kernels)), graph)
    kernels = _round_results_read_rounded(graph, _fold_output_casts(graph, kernels))
    kernels = split_ragged_streams(cfg, bound_padded_rows(kernels, gm))
    graph.kernels = streams_back_to_back(cfg, kernels)
    loops = find_loops(graph, edge_cost=loop_edge_cost(cfg, graph.kernels)) if layer_loops else []
    if any(lp.repeats == 2 for lp in loops) and _unrolled_fits(graph, cfg, precision):
        # two repetitions save one body's code but cost the prefetch across the loop's edges (1b-2l decode:
        # 274,564 cycles looped, 270,481 unrolled, with a header that waited): kept only where imem needs it
        loops = [lp for lp in loops if lp.repeats > 2]
    value_inputs = _value_inputs(graph)
    placements, arena_bytes = _memory_plan(graph, loops, cfg)
    clock.lap("kernels_and_memory_plan")
    chains_undone: list[str] = []
    chains, compact, tried_crossing = True, False, False
    while True:
        selection = _select(graph, placements, arena_bytes, cfg, precision, loops, chains)
        if not tried_crossing:
            tried_crossing = True
            crossing = _crossing_the_loops_edge(graph, cfg, precision, loops, selection, chains)
            if crossing is not None:
                loops, placements, arena_bytes, selection = crossing
        funcs, per_kernel, scratch, table_entries, planned = selection
        machine_ir = "".join(f"# {f.name}\n{f.dump()}" for f in funcs)
        clock.lap("instruction_selection")
        instructions = sum(len(b.instrs) for f in funcs for b in f.blocks)
        if instructions * BUNDLES_PER_INSTRUCTION > IMEM_MARGIN * cfg.imem_bundles:
            # clearly too large: the backend splits the graph without paying for this program's back end first
            raise ProgramTooLargeError(f"{instructions} machine instructions make about "
                                       f"{int(instructions * BUNDLES_PER_INSTRUCTION)} bundles, more than imem's "
                                       f"{cfg.imem_bundles}")
        try:
            mc: MachineCode = compile_functions(funcs, next_id=max(f.max_reg_id() for f in funcs) + 1,
                                                source_name="<compiled graph>", pipeline=pipeline, verify=verify,
                                                progress=progress, max_bundles=cfg.imem_bundles, compact=compact)
            if len(mc.program) > cfg.imem_bundles:
                raise ProgramTooLargeError(f"program of {len(mc.program)} bundles does not fit imem "
                                           f"({cfg.imem_bundles} bundles)")
            break
        except ProgramTooLargeError:
            # loops pipelined for the fewest cycles may take more code than imem holds (a 2-layer fp32 Llama
            # of 57 tokens on `small`): once more, with no loop larger than its given schedule
            if compact or not pipeline:
                raise
            compact = True
        except CapacityError as e:
            # a chain's members share one block, where the list scheduler may interleave them past what
            # registers hold (two sin/cos range reductions): the members compile as kernels of their own
            if not chains or not any("chained_into" in k for k in per_kernel):
                raise
            chains = False
            chains_undone.append(str(e))
    stages["kernels.txt"] = describe(graph) + "".join(
        f"loop: kernels {lp.first}..{lp.first + lp.period - 1} run {lp.repeats} times over {len(lp.slots[0])} "
        f"address slots\n" for lp in loops)
    arena_bytes += scratch
    address_table = _address_table(graph, placements, loops, planned.last_rows)
    clock.lap("schedule_regalloc_assemble")
    starts = [sum(mc.function_bundles[:i]) for i in range(len(funcs))]
    for info in per_kernel:
        f = info.pop("function")
        if f is not None:
            info["start"], info["bundles"] = starts[f], mc.function_bundles[f]
    stages["machine_ir.txt"] = machine_ir
    stages["scheduled.txt"] = mc.scheduled_text()
    stages["program.s"] = mc.assembly
    inputs = [ArgSpec(n, placements[n].shape, placements[n].dtype, placements[n].nbytes) for n in graph.arguments]
    outputs = [_output_view(v, placements[v.buffer], graph.arguments) for v in graph.results]
    summary = {"config": cfg.name, "kernels": per_kernel, "bundles": len(mc.program), "spilled": mc.spilled,
               "matmul_precision": precision, "arena_bytes": arena_bytes,
               "launch": {"s1": "arena", "argument_table": [*graph.arguments, "arena", *(
                   f"value of {graph.arguments[i]}" for i in value_inputs)]},
               "buffers": {n: dataclasses.asdict(p) for n, p in placements.items()},
               "outputs": [dataclasses.asdict(v) for v in graph.results], "compile_seconds": clock.laps}
    summary["mutated_inputs"] = [graph.arguments[i] for i in mutated]
    summary["pipelined_loops"] = len(mc.pipelined)
    summary["pipelining_undone"] = [line for line in mc.log if "trace check" in line]  # a compiler bug
    summary["pipelining"] = mc.log  # per counted loop: pipelined (II, stages) or why not; where its constants live
    summary["chains_undone"] = chains_undone
    summary["compact_code"] = compact  # the program fit imem only with every loop's code at its given size
    summary["loops"] = [{"kernels": [lp.first, lp.first + lp.period - 1], "runs": lp.repeats,
                         "slots": len(lp.slots[0])} for lp in loops]
    summary["vmem_table_rows"] = [SPILL_ROWS, SPILL_ROWS + table_rows(table_entries, cfg.lanes)]
    return Executable(cfg.name, mc.program, inputs, outputs, arena_bytes, stages, summary, mutated, address_table,
                      value_inputs)


# set by fx_passes/dynamic.py (PADDING_META) on nodes of a dynamic-shape bucket's program: {dim counted from
# the last: name of the placeholder holding its valid length} for padded dims whose padding nothing reads
PADDING_META = "ctpu_padding"
# fused ops whose generics also run along a dim of the padded size that is not the padded one (keys)
_KEYED_OPS = ("ctpu.attention.default",)
# the FX ops whose matmul kernel computes the node's value row for row (fused ops with inner matmuls, such as
# attention, have other rows)
_ROW_MATMULS = ("aten.mm.default", "aten.bmm.default", "aten.addmm.default", "ctpu.linear.default")


def bound_padded_rows(kernels: list[Kernel], gm: torch.fx.GraphModule) -> list[Kernel]:
    """Kernels of a dynamic-shape bucket's program compute only the valid rows of a padded dim (PADDING_META
    on their FX node), reading the valid length from its placeholder at run time:
    - a matmul of a row-wise op (mm, bmm, addmm, ctpu::linear) whose C is the node's value, padded at dim -2
      (`MatmulKernel.valid_rows`), or a fused attention's, whose rows are [rep, L] a KV head
      (`MatmulKernel.row_segments`);
    - a generic of the node (its own, or one the node's op lowered to: a norm's reductions, a projection's
      elementwise factor) with exactly one iteration dim of the padded size, a parallel dim its output
      indexes: the node's padded rows, as every op that marks them is row-wise along them
      (`GenericKernel.valid_extent`). Of two dims of that size (a hidden size equal to the bucket's), the
      one at the padded place of the output; attention's row-wise generics run along their query dim
      (`_query_dim`)."""
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    nodes = {n.name: n for n in gm.graph.nodes}
    out = []
    for k in kernels:
        node = nodes.get(k.origin[0]) if isinstance(k, MatmulKernel | GenericKernel) else None
        value = node.meta.get("val") if node is not None else None
        padding = {dim: name for dim, name in (node.meta.get(PADDING_META, {}) if node is not None else {}).items()
                   if name in placeholders and isinstance(value, torch.Tensor) and -value.dim() <= dim < 0}
        if isinstance(k, MatmulKernel) and -2 in padding and str(node.target) in _ROW_MATMULS and \
                value.dim() >= 2 and tuple(value.shape[-2:]) == tuple(k.c.shape[-2:]):
            k = dataclasses.replace(k, valid_rows=placeholders.index(padding[-2]))
        elif isinstance(k, MatmulKernel) and -2 in padding and str(node.target) in _KEYED_OPS and \
                value.dim() == 4 and len(k.c.shape) == 3 and k.c.shape[0] * k.c.shape[1] == value.shape[:3].numel():
            # attention's q @ K^T and P @ V over all its queries (not a causal query block's): [rep * L] rows a
            # KV head, the valid queries of each query head
            k = dataclasses.replace(k, valid_rows=placeholders.index(padding[-2]),
                                    row_segments=k.c.shape[-2] // value.shape[-2])
        elif isinstance(k, GenericKernel) and len(padding) == 1:
            (dim, name), = padding.items()
            d = _padded_iteration_dim(k, dim, value, str(node.target))
            if d is not None:
                k = dataclasses.replace(k, valid_extent=(placeholders.index(name), d))
        out.append(k)
    return out


def _padded_iteration_dim(k: GenericKernel, dim: int, value: torch.Tensor, op: str) -> int | None:
    """The iteration dim of a generic lowered from a node whose value is padded at `dim` (from the last) that
    runs along that padding: the one iteration dim of the padded size, a parallel dim, that indexes an
    output dim at the same place from the last (None when none or several do), size-1 dims not counted (a
    norm's [L, 1] sums, a projection's [L, I] factor, a rope's [H, L, D/2] halves; a reduction's output may
    lack the node's last dim, which it reduces). A fused attention's generics run along its keys as well
    (K^T, V, the key mask): of those, only its result and its row-wise generics (`_query_dim`) count."""
    size, view = value.shape[dim], k.output.view
    if op in _KEYED_OPS and view.shape != tuple(value.shape):
        return _query_dim(k, size) if dim == -2 else None
    last = len(k.sizes) - 1
    dims = [d for d in range(len(k.sizes)) if k.sizes[d] == size and not (k.reduction and d == last)]
    placed = [d for d in dims if _at_padded_place(k, d, dim, value)]
    return placed[0] if len(placed) == 1 else None


def _at_padded_place(k: GenericKernel, d: int, dim: int, value: torch.Tensor) -> bool:
    """Whether iteration dim d indexes exactly one dim of the output, at the node's padded place: the same
    place from the last, or after dims that multiply to the node's before its padded dim (its rows: o_proj's
    factor [L, H * D], written as [L, KVH, rep, D]). A hidden size equal to the bucket's gives two dims of
    the padded size; only the rows' is at the padded place."""
    view, size, stride = k.output.view, k.sizes[d], k.output.iter_strides[d]
    indexed = [j for j in range(len(view.shape)) if view.shape[j] == size and view.strides[j] == stride]
    if len(indexed) != 1:
        return False
    place, node_place = _place(view.shape, indexed[0]), _place(value.shape, len(value.shape) + dim)
    leading = math.prod(view.shape[:indexed[0]]) == math.prod(value.shape[:len(value.shape) + dim])
    return place == node_place or leading or (k.reduction and place - 1 == node_place)


def _query_dim(k: GenericKernel, size: int) -> int | None:
    """A fused attention's row-wise generic ([B, KVH, rep, L, ...]: scores, their row max and sum,
    probabilities) runs along the queries at `attention.QUERY_DIM`, a parallel dim its output indexes; its
    other generics (K^T, V, the key mask) run along keys only."""
    d = QUERY_DIM
    if len(k.sizes) <= d + 1 or k.sizes[d] != size or not k.output.iter_strides[d]:
        return None
    return d


def _place(shape: Sequence[int], j: int) -> int:
    """Dim j's place counted from the last (-1), dims of size 1 not counted."""
    return -1 - sum(1 for n in shape[j + 1:] if n != 1)


def _value_inputs(graph: KernelGraph) -> list[int]:
    """The arguments whose values the argument table holds (after the arena's entry), in order."""
    return sorted({k.valid_rows for k in graph.kernels if isinstance(k, MatmulKernel) and k.valid_rows is not None}
                  | {k.valid_extent[0] for k in graph.kernels
                     if isinstance(k, GenericKernel) and k.valid_extent is not None})


def _memory_plan(graph: KernelGraph, loops: list[Loop], cfg: HardwareConfig
                 ) -> tuple[dict[str, BufferPlacement], int]:
    """`plan_memory` with the argument table's entries (the value inputs and the loops' address tables), the
    runs that may become tiled chains together (`isel_vector.tiled_runs`)."""
    return plan_memory(graph, len(_value_inputs(graph)) + sum((lp.repeats + 1) * len(lp.slots[0]) for lp in loops),
                       tiled_runs(graph.kernels, cfg))


def _crossing_the_loops_edge(graph: KernelGraph, cfg: HardwareConfig, precision: str, loops: list[Loop],
                             selection: Any, chains: bool) -> tuple[list[Loop], dict[str, BufferPlacement], int,
                                                                   Any] | None:
    """The loops, their memory plan and selection, where the decode prefetch of `selection` (of `loops`) could
    not cross the layers' loop's edge: a layer of an odd count of weight-slot turns plans its streams into the
    other slot than the layer before (packed Qwen3-0.6B: 7 a layer), so copies of a one-layer body plan
    differently and the edge stays a boundary, where the next layer's first weights load late. Two layers a
    repetition plan the same each repetition (of an odd count of layers, the last runs after the loop): that
    where it crosses and fits imem (at least two repetitions of two layers); else the loop unrolled, where
    the program is estimated to fit imem (a loop of 3 repetitions: 4 Qwen3 layers). None where neither."""
    n = selection[4].uncrossed
    if n is None:
        return None
    lp = loops[n]

    def selected(alternative: list[Loop]) -> tuple[list[Loop], dict[str, BufferPlacement], int, Any]:
        placements, arena_bytes = _memory_plan(graph, alternative, cfg)
        return alternative, placements, arena_bytes, _select(graph, placements, arena_bytes, cfg, precision,
                                                             alternative, chains)

    if lp.repeats >= 5 - lp.repeats % 2:
        two = selected([*loops[:n], layers_two_at_a_time(graph, lp), *loops[n + 1:]])
        if two[3][4].uncrossed is None and _fits_imem(two[3][0], cfg):
            return two
    body = sum(info.get("instructions", 0) for info in selection[1][lp.first:lp.first + lp.period])
    if not _fits_imem(selection[0], cfg, more=(lp.repeats - 1) * body):
        return None  # not selected unrolled to learn it: a long model's layers are a long selection
    unrolled = selected([*loops[:n], *loops[n + 1:]])
    return unrolled if _fits_imem(unrolled[3][0], cfg) else None


def _unrolled_fits(graph: KernelGraph, cfg: HardwareConfig, precision: str) -> bool:
    """Whether the program without layer loops is estimated to fit imem (with room: the estimate is rough)."""
    placements, arena_bytes = _memory_plan(graph, [], cfg)
    return _fits_imem(_select(graph, placements, arena_bytes, cfg, precision, [])[0], cfg)


def _fits_imem(funcs: list[Function], cfg: HardwareConfig, more: int = 0) -> bool:
    """Whether selected functions, and `more` instructions, are estimated to fit imem, with room (the estimate
    is rough)."""
    instructions = sum(len(b.instrs) for f in funcs for b in f.blocks) + more
    return instructions * BUNDLES_PER_INSTRUCTION < 0.8 * cfg.imem_bundles


def _address_table(graph: KernelGraph, placements: dict[str, BufferPlacement], loops: list[Loop],
                   last_rows: dict[int, tuple[str, ...]]) -> list[tuple[int, int]]:
    """The loops' per-repetition address tables, one after the other, as (argument-table entry, byte
    offset) per word: repetition i's slot j is the address of the buffer it uses there. Each table ends
    with one more row, which the last repetition loads as its next row (`layer_loop.emit_header`): its own
    again, or `last_rows[n]` for loop n (what the kernels after it read: `_prefetches`)."""
    n_in = len(graph.arguments)
    words = []
    for n, lp in enumerate(loops):
        for row in (*lp.slots, last_rows.get(n, lp.slots[-1])):
            for name in row:
                p = placements[name]
                words.append((graph.arguments.index(name), 0) if p.kind == "input" else (n_in, p.offset))
    return words


def _mutated_inputs(graph: KernelGraph, n_outputs: int) -> list[int]:
    """The inputs the program writes (the emitter returns their new values after the `n_outputs` outputs),
    dropped from `graph.results`. Bufferization made each such value its input's whole buffer; anything else
    would be a mutation the caller never sees, so it is refused."""
    mutated = []
    for v in graph.results[n_outputs:]:
        buf = graph.buffers[v.buffer]
        if buf.kind != "input" or v.offset != 0 or v.shape != buf.shape or not _dense(v):
            raise LoweringError(f"an input mutation was not bufferized into its input: {v}")
        mutated.append(buf.index)
    graph.results = graph.results[:n_outputs]
    return mutated


def _output_view(v: View, p: BufferPlacement, arguments: list[str]) -> OutputView:
    if p.kind == "input":
        return OutputView(v.shape, v.strides, v.offset, p.dtype, p.nbytes, input=arguments.index(v.buffer))
    return OutputView(v.shape, v.strides, v.offset, p.dtype, p.nbytes, base=p.offset)


class _Clock:
    def __init__(self) -> None:
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name] = round(now - self._t, 4)
        self._t = now


def _select(graph: KernelGraph, placements: dict[str, BufferPlacement], arena_bytes: int, cfg: HardwareConfig,
            precision: str, loops: list[Loop], chains: bool = True
            ) -> tuple[list[Function], list[dict[str, Any]], int, int, _Prefetches]:
    """Instruction selection into one machine-IR function per kernel, in order: the entry copies the
    argument table to vmem, then the kernels, then the exit halts. A loop's body kernels are selected once,
    between the loop's init + header and its footer; its other repetitions emit nothing. Returns the
    functions, per-kernel information (`function`: the index of its function, None for a repetition),
    the HBM scratch bytes the kernels need beyond the arena, the argument-table entries reserved in vmem and
    the decode prefetch plan (`_prefetches`: the last rows of loops' address tables that differ from their
    last repetition's).
    chains: lower runs of small generics as one kernel each (`isel_vector.form_chains`)."""
    n_in = len(graph.arguments)
    arena = n_in  # the arena's entry in the argument table
    values = {arg: arena + 1 + j for j, arg in enumerate(_value_inputs(graph))}  # their entries follow it
    fixed = n_in + 1 + len(values)
    buffers = {name: (i, 0) for i, name in enumerate(graph.arguments)}
    buffers |= {name: (arena, p.offset) for name, p in placements.items() if p.kind == "arena"}
    layout = loop_layout(fixed, loops, cfg.lanes) if loops else None
    entries = layout.entries if layout else fixed
    table = Region("args", SPILL_ROWS, table_rows(entries, cfg.lanes))
    entry = Function(pinned=(ARENA_REG,), name="entry")
    b = Builder(entry)
    ctx = KernelContext(b, cfg, buffers, (arena, arena_bytes), table.row, precision, table_entries=entries,
                        values=values)
    ctx.begin(entry.name)
    ctx.dma(True, "i32", ARENA_REG, table, 0, 1, fixed, fixed, Flag.LOAD)
    ctx.end()
    funcs = [entry]

    ran: list[tuple[Function, tuple[Rows, bool]]] = []  # each function, with its `uncovered` (uncovered_writes)

    def function(name: str, hint: str, emit: Callable[[], None]) -> Function:
        func = Function(name=name)
        b.start_function(func, hint)
        ctx.begin(func.name)
        emit()
        ctx.end()
        funcs.append(func)
        ran.append((func, ctx.uncovered))
        return func

    per_kernel: list[dict[str, Any]] = []
    starts = {lp.first: lp for lp in loops}
    free_rows = cfg.vmem_rows - ctx.base_row
    emitted = _emitted_kernels(graph, loops)
    if chains:  # runs of small generics lowered as one kernel (isel_vector.KernelChain)
        emitted = form_chains(emitted, cfg, free_rows // 2, lambda a, b: _apart(placements, loops, a, b))
        touched: dict[str, set[int]] = {}  # buffer -> the kernels that read or write it
        for i, k in enumerate(graph.kernels):
            for v in views_of(k):
                touched.setdefault(v.buffer, set()).add(i)
        for chain in {id(k): k for k, _ in emitted if isinstance(k, KernelChain)}.values():
            chain.private = private_chain_outputs(graph, loops, chain, touched)
    planned = _prefetches(cfg, graph, emitted, free_rows, loops)
    prefetches = planned.plan
    preloads = _preloads(emitted, loops, cfg.lanes)
    table_word = fixed  # the next loop's address table, in words from the arena's start
    loop: Loop | None = None
    for i, k in enumerate(graph.kernels):
        info = {"index": i, "kind": _kind(k), "mlir": k.text.splitlines()[0] if k.text else "", "node": k.origin[0],
                "module": k.origin[1]}
        per_kernel.append(info)
        if i in starts:
            loop = starts[i]
            assert layout is not None
            ctx.buffers = {slot_name(j): (layout.window + j, 0) for j in range(len(loop.slots[0]))} | {
                next_slot_name(j): (layout.next_window + j, 0) for j in range(len(loop.slots[0]))}
            # the header also runs after the footer, with the body's last stores in flight: assumed to read no
            # more rows than those of the kernel before the loop (in a rotated loop, the same kernel), which
            # the footer makes true (it waits for them where they read more)
            back_edge_stores = ctx.stores_in_flight
            function(f"loop at kernel {i}: init", "loop_init", lambda lp=loop, at=4 * table_word: emit_init(
                ctx, layout, table, arena, at, len(lp.slots[0])))
            ctx.assume_stores(back_edge_stores)
            header = function(f"loop at kernel {i}: header", "loop", lambda lp=loop, at=4 * table_word: emit_header(
                ctx, layout, table, arena, at, len(lp.slots[0])))
            header_run = len(ran) - 1
            table_word += (loop.repeats + 1) * len(loop.slots[0])
        if loop is not None and i >= loop.first + loop.period * loop.repeats:
            loop, ctx.buffers = None, buffers
        lowered = emitted[i][0]
        if lowered is None:
            assert loop is not None
            info |= {"function": None, "bundles": 0, "same_code_as": loop.first + (i - loop.first) % loop.period}
            continue
        if loop is not None:
            info["runs"] = loop.repeats
        if isinstance(lowered, KernelChain) and lowered.first != i:
            info |= {"function": None, "bundles": 0, "chained_into": lowered.first}
        else:
            ctx.prefetch = prefetches.get(i)
            func = function(f"kernel {i} ({type(lowered).__name__})", f"k{i}",
                            lambda k=lowered, i=i: _lower(ctx, k, preloads.get(i, [])))
            issue = ctx.prefetch.issue if ctx.prefetch is not None else None
            if issue is not None and reads_next_window(issue.kernel):
                # before the argument loads of the next repetition's addresses: the header's DMA of them
                func.blocks[0].instrs.insert(0, MInstr("wait", flag=int(NEXT_ROW)))
                info["prefetches_for"] = "the next repetition"
            if i == planned.wait_before:  # what the loop's last repetition loaded for no kernel lands first
                func.blocks[0].instrs.insert(0, MInstr("wait", flag=int(Flag.PREFETCH)))
                info["waits_first_for"] = "the loop's last prefetch"
            if ctx.prefetch is not None and ctx.prefetch.carried:
                info["vmem_carried"] = list(ctx.prefetch.carried)
            if ctx.taken:  # rows it reads where the kernel before left them (`KernelContext.take_resident`)
                info["vmem_resident"] = [list(rows) for rows in ctx.taken]
            ctx.prefetch = None
            info["function"] = len(funcs) - 1
            info["instructions"] = sum(len(blk.instrs) for blk in func.blocks)
            if isinstance(lowered, KernelChain):  # the profiler names the kernel's span after every member's node
                nodes = (m.kernel.origin[0] for m in lowered.members if m.kernel.origin[0])
                info["node"] = " + ".join(dict.fromkeys(nodes))
                info["chain"] = "tiled" if lowered.tiled else "one tile"
        if loop is not None and i == loop.first + loop.period - 1:  # also after a chain's last member
            # the body's last stores in flight, where the header and the body's first kernels expect others:
            # waited for only where those kernels may write their rows before they wait them out themselves
            drain = not rows_within(ctx.stores_in_flight, back_edge_stores) and not stay_in_flight(
                ran[header_run:], ctx.stores_in_flight)
            function(f"loop at kernel {loop.first}: footer", "loop_next",
                     lambda lp=loop, h=header.blocks[0].label, d=drain: emit_footer(ctx, layout, table, lp, h, d))
    funcs.append(Function(name="exit"))
    b.start_function(funcs[-1], "exit")
    funcs[-1].blocks[0].instrs.extend(wait_for_stores())  # the outputs are in HBM when the program halts
    b.emit("halt")
    return funcs, per_kernel, ctx.scratch_peak, entries, planned


def _apart(placements: dict[str, BufferPlacement], loops: list[Loop], a: str, b: str) -> bool:
    """Whether buffers a and b never share HBM bytes: an input and a temporary, or temporaries whose arena
    ranges are disjoint; two slots of a loop's body where their buffers are so in every repetition (of every
    loop that has both slots: a conservative answer for the loop the body is). Not known (so not) for two
    inputs (views of one tensor may alias) or the next repetition's slots."""
    ja, jb = slot_index(a), slot_index(b)
    if ja is not None and jb is not None:
        pairs = [(row[ja], row[jb]) for lp in loops for row in lp.slots if max(ja, jb) < len(row)]
        return bool(pairs) and all(_apart(placements, [], x, y) for x, y in pairs)
    pa, pb = placements.get(a), placements.get(b)
    if pa is None or pb is None or a == b or pa.kind == pb.kind == "input":
        return False
    if "input" in (pa.kind, pb.kind):
        return True
    return pa.offset + pa.nbytes <= pb.offset or pb.offset + pb.nbytes <= pa.offset


def private_chain_outputs(graph: KernelGraph, loops: list[Loop], chain: KernelChain,
                          touched: dict[str, set[int]]) -> frozenset[int]:
    """The members of `chain` whose output needs no store, in every run of the chain (each layer of a loop
    body it is in): a later member writes the same view (a softmax's exponentials, divided in place), or
    its buffer is a temporary, no result, that no kernel after the chain reads before one writes all of it
    (`touched`: the kernels that read or write each buffer; one before it wrote what a member overwrites: a
    prefill softmax's exponentials, computed in place over its scaled scores; bufferization gives the next
    query block's scores the same buffer). Their values stay in the chain's vmem tiles (a decode softmax's
    scaled scores and f32 probabilities: 1 MiB of stores a 1B layer at a 4096-token context; a 2048-token
    prefill's exponentials, 4 bytes a score)."""
    results = {v.buffer for v in graph.results}
    loop = next((lp for lp in loops if lp.first <= chain.first < lp.first + lp.period), None)
    runs = [r * loop.period for r in range(loop.repeats)] if loop is not None else [0]
    n = len(chain.members)

    def private(j: int) -> bool:
        for run in runs:
            outs = [k.output.view for k in graph.kernels[chain.first + run:chain.first + run + n]
                    if isinstance(k, GenericKernel)]
            assert len(outs) == n
            if outs[j] in outs[j + 1:]:
                continue
            name = outs[j].buffer
            later = [t for t in touched[name] if t >= chain.first + run + n]
            if graph.buffers[name].kind != "temp" or name in results or \
                    (later and not _overwrites(graph, graph.kernels[min(later)], name)):
                return False
        return True

    return frozenset(j for j in range(n) if private(j))


def _overwrites(graph: KernelGraph, k: Kernel, name: str) -> bool:
    """Whether kernel k writes every element of buffer `name` and reads none of it."""
    return isinstance(k, GenericKernel) and k.output.view.buffer == name and not k.reads_output and \
        all(a.view.buffer != name for a in k.inputs) and _all_of(graph, k.output.view)


def _emitted_kernels(graph: KernelGraph, loops: list[Loop]) -> list[tuple[Kernel | None, int]]:
    """For each kernel: what is lowered for it (a loop body's kernels renamed to the loop's slots; None for a
    repetition of a body, which emits nothing) and its segment, a run of kernels no loop init, header or
    footer interrupts (code in one segment runs in order, once per run of the segment)."""
    out: list[tuple[Kernel | None, int]] = []
    segment = 0
    loop: Loop | None = None
    slots: list[int] = []
    for i, k in enumerate(graph.kernels):
        starting = next((lp for lp in loops if lp.first == i), None)
        if starting is not None:
            loop, slots, segment = starting, occurrence_slots(starting, graph), segment + 1
        if loop is not None and i >= loop.first + loop.period * loop.repeats:
            loop, segment = None, segment + 1
        if loop is None:
            out.append((k, segment))
        elif i >= loop.first + loop.period:
            out.append((None, segment))
        else:
            first = sum(len(views_of(b)) for b in graph.kernels[loop.first:i])
            out.append((rename_to_slots(k, slots[first:first + len(views_of(k))]), segment))
            if i == loop.first + loop.period - 1:
                segment += 1  # the footer
    return out


@dataclass
class _Prefetches:
    """The decode prefetch plan (`isel_decode.Prefetch` per kernel index), the last rows of loops' address
    tables that differ from their last repetition's, and the kernel after a loop whose last repetition
    loaded weights no kernel after it reads: it waits for them first (None: none)."""

    plan: dict[int, Prefetch]
    last_rows: dict[int, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    wait_before: int | None = None
    uncrossed: int | None = None  # the layers' loop whose edge no prefetch crosses (`_crossing_the_loops_edge`)


def _prefetches(cfg: HardwareConfig, graph: KernelGraph, emitted: list[tuple[Kernel | None, int]], free_rows: int,
                loops: list[Loop]) -> _Prefetches:
    """The decode prefetch plan (`plan_prefetches`) of the kernels as emitted, across the edge of the layers'
    loop where its body plans the same in every repetition: planned over the body three times between the
    kernels before the loop and after it, as one run of code. The body's last kernels then load the next
    repetition's first stream, at the next window's addresses, and the last kernel before the loop loads the
    same tiles of the first repetition's. The last repetition's next window is the address table's last row:
    the same stream after the loop (a rotated body: the last layer's rest follows), else its own again, whose
    loads the kernel after the loop waits for. Where the copies of the body plan differently (the slots'
    parity flips from one to the next) the edge stays a boundary."""
    base = plan_prefetches(cfg, emitted, free_rows)
    streams = [sum(isinstance(k, MatmulKernel) and base.get(i) is not None and base[i].stream is not None
                   for i, (k, _) in enumerate(emitted[lp.first:lp.first + lp.period], lp.first)) for lp in loops]
    if not loops or max(streams) == 0:
        return _Prefetches(base)
    n = streams.index(max(streams))  # the layers' loop
    lp = loops[n]
    f, p, end = lp.first, lp.period, lp.first + lp.period * lp.repeats
    if end >= len(emitted):
        return _Prefetches(base)
    body = emitted[f][1]
    merged = {body - 1, body, body + 2}  # before the loop, its body, after it (its footer's repetitions between)
    pre = [(k, body if s in merged else s) for k, s in emitted[:f]]
    copy = [(k, body) for k, _ in emitted[f:f + p]]
    post = [(k, body if s in merged else s) for k, s in emitted[end:]]
    for follows in (True, False):  # the stream after the loop, or none of the body's
        vplan = plan_prefetches(cfg, pre + copy * 3 + (post if follows else copy), free_rows)
        out = _across_edge(graph, lp, vplan, follows)
        if out is None:
            continue
        plan, last_row, first_stream, tiles = out
        # the first repetition runs the body's code too: the last kernel before the loop loads what the
        # body's last kernels load for the next repetition (tiles `tiles` of its first stream)
        u = f - 1
        if u < 0 or emitted[u][0] is None:
            continue
        if isinstance(emitted[u][0], KernelChain):
            u = emitted[u][0].first
        steady = plan[f + first_stream]
        lo, hi = min(steady.slots), max(steady.slots) + 2 * steady.stream.G * cfg.lanes
        last = base.get(u)
        if last is not None and last.carried and last.carried[0] < hi and lo < last.carried[1]:
            continue  # it reads that slot itself
        if not isinstance(emitted[u][0], PREFETCH_KERNELS) and not (last and last.stream):
            continue  # it issues no prefetch
        ceiling = min(last.ceiling if last else cfg.vmem_rows, plan.get(f, steady).ceiling, lo)
        issue = Issue(graph.kernels[f + first_stream], steady.stream, tiles, steady.slots)
        plan = {i: pf for i, pf in base.items() if i < f} | plan
        plan[u] = dataclasses.replace(last, issue=issue, ceiling=ceiling) if last else Prefetch(ceiling, issue=issue)
        if not follows:  # after the loop as without the edge
            plan |= {i: pf for i, pf in base.items() if i >= end}
        return _Prefetches(plan, {n: last_row}, None if follows else end)
    return _Prefetches(base, uncrossed=n)


def _across_edge(graph: KernelGraph, lp: Loop, vplan: dict[int, Prefetch], follows: bool
                 ) -> tuple[dict[int, Prefetch], tuple[str, ...], int, range] | None:
    """From the plan of the kernels before the loop, its body three times and the kernels after it (`follows`;
    else the body a fourth time): the plan of the body (its second copy's, once the third plans the same:
    every repetition runs its code) and of the kernels after the loop (`follows`), the address table's last
    row, the body's first stream and the tiles of it the body's last kernels load for the next repetition.
    None where the copies plan differently, no prefetch crosses the edge, or the stream after the loop is not
    the body's first."""
    f, p, end = lp.first, lp.period, lp.first + lp.period * lp.repeats
    stream_at = sorted(v for v, pf in vplan.items() if pf.stream is not None and pf.prefetched)

    def target(v: int) -> int:  # the stream issuer v loads for
        return next((u for u in stream_at if u > v), len(graph.kernels) * 4)

    def same(a: Prefetch | None, b: Prefetch | None, issues: bool = True) -> bool:
        if a is None or b is None:
            return a is b
        if issues and (a.issue is None) != (b.issue is None):
            return False
        ia, ib = a.issue, b.issue
        return dataclasses.replace(a, issue=None) == dataclasses.replace(b, issue=None) and (
            not issues or ia is None or (ia.plan, ia.tiles, ia.rows, _signature(ia.kernel)) == (
                ib.plan, ib.tiles, ib.rows, _signature(ib.kernel)))

    two, three = f + p, f + 2 * p  # the second and third copies
    crossing = [v for v in range(two, three) if v in vplan and vplan[v].issue is not None and target(v) >= three]
    if not crossing or not all(same(vplan.get(two + t), vplan.get(three + t)) for t in range(p)):
        return None
    first_stream = target(crossing[0]) - three
    tiles = sorted(t for v in crossing for t in vplan[v].issue.tiles)
    if tiles != list(range(tiles[0], tiles[-1] + 1)):
        return None
    stream = graph.kernels[f + first_stream]
    last = list(lp.slots[-1])
    occurrence = occurrence_slots(lp, graph)
    at = sum(len(views_of(k)) for k in graph.kernels[f:f + first_stream])
    slots = occurrence[at:at + len(views_of(stream))]
    if follows:  # the last repetition loads the stream after the loop, where the table's last row points
        post = three + p + first_stream
        after = {target(v) for v in range(three, three + p) if v in vplan and vplan[v].issue is not None
                 and target(v) >= three + p}
        if after != {post} or end + first_stream >= len(graph.kernels) or \
                not same(vplan[post], vplan[three + first_stream], issues=False):
            return None
        post_kernel = graph.kernels[end + first_stream]
        if _signature(stream) != _signature(post_kernel):
            return None
        for slot, v in zip(slots, views_of(post_kernel), strict=True):
            if last[slot] != lp.slots[-1][slot] and last[slot] != v.buffer:
                return None  # a slot two of its views name differently
            last[slot] = v.buffer
    plan: dict[int, Prefetch] = {}
    for v, pf in vplan.items():
        if v < two or three <= v < three + p or (not follows and v >= three + p):
            continue  # before the loop as without the edge (`_prefetches`), the body: its second copy's plan
        if pf.issue is not None and two <= v < three <= target(v):  # the next repetition's, in the next window
            kernel = rename_to_slots(pf.issue.kernel, slots, next_slot_name)
            pf = dataclasses.replace(pf, issue=dataclasses.replace(pf.issue, kernel=kernel))
        plan[v - p if v < three else end + v - (three + p)] = pf
    return plan, tuple(last), first_stream, range(tiles[0], tiles[-1] + 1)


def _signature(k: Kernel) -> list[tuple[Any, ...]]:
    """`k`'s type and views but their buffers: kernels of one signature lower to the same code."""
    return [type(k), *((v.shape, v.strides, v.offset, v.dtype) for v in views_of(k))]


def _preloads(emitted: list[tuple[Kernel | None, int]], loops: list[Loop], lanes: int) -> dict[int, list[Preload]]:
    """For a kernel whose function the next kernel's follows (same segment): what it loads for that one which
    it does not write itself, where that one is a chain (`rows_to_preload`) or resident batches (their first
    batch's weights: `first_batch_weights`). In a loop's body buffers are slots: two slots are one buffer
    where a repetition's row names it twice."""
    starts = [i for i, (k, _) in enumerate(emitted)
              if k is not None and not (isinstance(k, KernelChain) and k.first != i)]
    out = {}
    for i, j in itertools.pairwise(starts):
        (k, segment), (after, next_segment) = emitted[i], emitted[j]
        if segment != next_segment:
            continue
        if isinstance(after, KernelChain):
            wanted = rows_to_preload(after)
        elif isinstance(after, MatmulKernel):
            wanted = [p] if (p := first_batch_weights(after, lanes)) is not None else []
        else:
            continue
        loop = next((lp for lp in loops if lp.first <= i < lp.first + lp.period), None)
        writes = {m.kernel.output.view.buffer for m in k.members} if isinstance(k, KernelChain) \
            else {written_buffer(k)}
        wanted = [p for p in wanted if not any(_same_buffer(p.view.buffer, w, loop) for w in writes)]
        if wanted:
            out[i] = wanted
    return out


def _same_buffer(a: str, b: str, loop: Loop | None) -> bool:
    """Whether two buffer names of a kernel's views (a loop body's: slots) name one buffer in some run."""
    if a == b:
        return True
    if loop is None:
        return False
    names = {slot_name(j): j for j in range(len(loop.slots[0]))}
    return a in names and b in names and any(row[names[a]] == row[names[b]] for row in loop.slots)


def _lower(ctx: KernelContext, k: Kernel, preloads: Sequence[Preload] = ()) -> None:
    if isinstance(k, KernelChain):
        (lower_tiled_chain if k.tiled else lower_chain)(ctx, k)
    elif isinstance(k, GenericKernel):
        lower_generic(ctx, k)
    elif isinstance(k, FillKernel):
        lower_fill(ctx, k)
    elif isinstance(k, GatherKernel):
        lower_gather(ctx, k)
    elif isinstance(k, IotaKernel):
        lower_iota(ctx, k)
    elif isinstance(k, ScatterKernel):
        lower_scatter(ctx, k)
    else:
        lower_matmul(ctx, k)
    if ctx.prefetch is not None and ctx.prefetch.issue is not None and not isinstance(k, MatmulKernel):
        issue_prefetch(ctx)  # a stream issues its prefetch along its last iteration
    for p in preloads:  # in the rows the kernel left free
        ctx.preload(p)


def _kind(k: Kernel) -> str:
    if isinstance(k, MatmulKernel):
        return "matmul"
    if isinstance(k, FillKernel):
        return "fill"
    if isinstance(k, GatherKernel):
        return "gather"
    if isinstance(k, IotaKernel):
        return "iota"
    if isinstance(k, ScatterKernel):
        return "scatter"
    return "reduction" if k.reduction else "elementwise"

