"""Generate one PTX kernel from a small fused FX subgraph of core-ATen elementwise ops and reductions.

Not a fixed list of fusions: the generator walks the graph's nodes in order and emits a few instructions per
node into fp32 registers (see `ops.py` for the per-op rules). Two kernel shapes:

- elementwise (no reduction): one thread per element of the broadcast output shape; each input is read
  at its broadcast position.
- reduction (sum/mean/amax/amin over the last dim): one CTA per row. Each reduction is one pass over the
  row that recomputes the element-level nodes it needs and ends in a block all-reduce; row-level nodes
  (those that depend only on reductions and per-row inputs) are evaluated once after the reduction they
  need, and the final pass writes the element-level outputs. Recomputing instead of staging keeps the
  kernel free of shared-memory rows; the re-reads hit L1/L2.
"""

from __future__ import annotations

import torch
import torch.fx
from pyptx import ptx, reg
from pyptx.reg import Reg
from pyptx.types import u32
from torch.fx.passes.shape_prop import ShapeProp

from ptx_kernels import ops
from ptx_kernels.core import (
    DTYPE_BYTES,
    KernelParam,
    PtxKernel,
    Shape,
    TensorArg,
    block_allreduce,
    ceil_div,
    ctaid,
    elem_addr,
    fconst,
    fresh_label,
    global_ptr,
    kernel_name,
    load_f32,
    numel,
    setp,
    smem_base,
    store_f32,
    tid_x,
    trace,
)
from ptx_kernels.elementwise import THREADS, broadcast_index, broadcast_shape, flat_index

ROW_THREADS_MAX = 256


class SubgraphError(NotImplementedError):
    """The subgraph uses something the generator cannot lower; the message names the FX node."""


class _Graph:
    """The analysed subgraph: nodes, shapes, dtypes, and which values live per element vs per row."""

    def __init__(self, gm: torch.fx.GraphModule, shapes: list[Shape], dtypes: list[torch.dtype]) -> None:
        self.nodes = list(gm.graph.nodes)
        self.inputs = [n for n in self.nodes if n.op == "placeholder"]
        if len(self.inputs) != len(shapes) or len(shapes) != len(dtypes):
            raise SubgraphError(
                f"subgraph has {len(self.inputs)} inputs, got {len(shapes)} shapes/{len(dtypes)} dtypes"
            )
        for dt in dtypes:
            if dt not in DTYPE_BYTES:
                raise SubgraphError(f"input dtype {dt} unsupported (fp32, bf16, bool)")
        ShapeProp(gm).propagate(
            *[torch.empty(s, dtype=d, device="meta") for s, d in zip(shapes, dtypes, strict=True)]
        )
        out_node = next(n for n in self.nodes if n.op == "output")
        outs = out_node.args[0]
        self.outputs: list[torch.fx.Node] = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        self.body = [n for n in self.nodes if n.op in ("call_function", "call_method")]
        for n in self.body:
            ops.check(n)
        self.reductions = [n for n in self.body if ops.is_reduction(n)]

    @staticmethod
    def shape(node: torch.fx.Node) -> Shape:
        return tuple(node.meta["tensor_meta"].shape)

    @staticmethod
    def dtype(node: torch.fx.Node) -> torch.dtype:
        return node.meta["tensor_meta"].dtype


def kernel_for_subgraph(
    gm: torch.fx.GraphModule, input_shapes: list[Shape], input_dtypes: list[torch.dtype]
) -> PtxKernel:
    """One PTX kernel computing `gm` for these static input shapes/dtypes (outputs in the graph's dtypes)."""
    graph = _Graph(gm, [tuple(s) for s in input_shapes], list(input_dtypes))
    if graph.reductions:
        return _reduction_kernel(graph)
    return _elementwise_kernel(graph)


def _signature(graph: _Graph) -> str:
    names = "_".join(ops.op_name(n) for n in graph.body)
    shapes = "_".join("x".join(map(str, _Graph.shape(n))) for n in graph.inputs)
    return f"{names}_{shapes}"


def _params(graph: _Graph) -> tuple[list[KernelParam], list[TensorArg], list[TensorArg]]:
    params = [KernelParam(f"in{i}", "ptr", f"in{i}") for i in range(len(graph.inputs))]
    params += [KernelParam(f"out{i}", "ptr", f"out{i}") for i in range(len(graph.outputs))]
    inputs = [TensorArg(f"in{i}", _Graph.shape(n), _Graph.dtype(n)) for i, n in enumerate(graph.inputs)]
    outputs = [TensorArg(f"out{i}", _Graph.shape(n), _Graph.dtype(n)) for i, n in enumerate(graph.outputs)]
    return params, inputs, outputs


def _evaluate(
    graph: _Graph, nodes: list[torch.fx.Node], values: dict[torch.fx.Node, Reg], load_input
) -> None:
    """Emit instructions for `nodes` (in graph order) whose value is not yet in `values`."""
    for node in nodes:
        if node in values:
            continue
        if node.op == "placeholder":
            values[node] = load_input(node)
            continue
        args = [_arg_value(a, values, load_input) for a in node.args]
        values[node] = ops.emit(node, args, _Graph.dtype(node))


def _arg_value(arg: object, values: dict[torch.fx.Node, Reg], load_input) -> object:
    if isinstance(arg, torch.fx.Node):
        if arg not in values:
            values[arg] = load_input(arg)  # only placeholders can be missing: graph order is topological
        return values[arg]
    if isinstance(arg, (list, tuple)):
        return arg  # dims lists and the like; ops read them from the node
    if isinstance(arg, (bool, int, float)):
        return fconst(float(arg))
    return arg


def _needed(targets: list[torch.fx.Node], stop: set[torch.fx.Node]) -> set[torch.fx.Node]:
    """All nodes `targets` depend on, not looking past `stop` (already computed values)."""
    seen: set[torch.fx.Node] = set()
    todo = list(targets)
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if n not in stop:
            todo.extend(a for a in n.all_input_nodes)
    return seen


def _elementwise_kernel(graph: _Graph) -> PtxKernel:
    for n in graph.body:
        if ops.op_name(n) in ops.VIEWS and numel(_Graph.shape(n)) != numel(
            _Graph.shape(n.all_input_nodes[0])
        ):
            raise SubgraphError(
                f"node {n.name}: {ops.op_name(n)} changes the element count; not fusable here"
            )
    domain = broadcast_shape(*[_Graph.shape(n) for n in graph.outputs])
    for n in graph.outputs:
        if _Graph.shape(n) != domain:
            raise SubgraphError(f"output {n.name} has shape {_Graph.shape(n)}, expected {domain}")
    total = numel(domain)
    params, inputs, outputs = _params(graph)
    name = kernel_name("ctpu_fused_ew", _signature(graph))

    def body() -> None:
        in_ptrs = {n: global_ptr(f"in{i}") for i, n in enumerate(graph.inputs)}
        out_ptrs = [global_ptr(f"out{i}") for i in range(len(graph.outputs))]
        idx = flat_index(1)
        guard = setp("lt", idx, total) if total % THREADS else None

        def load_input(node: torch.fx.Node) -> Reg:
            shape = _Graph.shape(node)
            index = broadcast_index(idx, domain, shape)
            return load_f32(
                elem_addr(in_ptrs[node], index, DTYPE_BYTES[_Graph.dtype(node)]), _Graph.dtype(node), guard
            )

        values: dict[torch.fx.Node, Reg] = {}
        _evaluate(graph, graph.nodes[:-1], values, load_input)
        for ptr, node in zip(out_ptrs, graph.outputs, strict=True):
            store_f32(
                elem_addr(ptr, idx, DTYPE_BYTES[_Graph.dtype(node)]), values[node], _Graph.dtype(node), guard
            )
        ptx.ret()

    return trace(
        name,
        body,
        params,
        grid=(ceil_div(total, THREADS), 1, 1),
        block=(THREADS, 1, 1),
        smem_bytes=0,
        inputs=inputs,
        outputs=outputs,
        notes={"kind": "elementwise"},
    )


def _row_level(graph: _Graph, n_cols: int) -> set[torch.fx.Node]:
    """Nodes with one value per row: reductions, per-row inputs ([..., 1]) and what depends only on them."""
    row: set[torch.fx.Node] = set()
    for node in graph.nodes[:-1]:
        if node.op == "placeholder":
            shape = _Graph.shape(node)
            if numel(shape) == 1 or (shape and shape[-1] == 1) or not shape:
                row.add(node)
        elif ops.is_reduction(node):
            row.add(node)
        elif all(a in row for a in node.all_input_nodes):
            row.add(node)
    return row


def _reduction_kernel(graph: _Graph) -> PtxKernel:
    domain = _Graph.shape(graph.reductions[0].all_input_nodes[0])
    for r in graph.reductions:
        if _Graph.shape(r.all_input_nodes[0]) != domain:
            raise SubgraphError(
                f"reduction {r.name} reduces shape {_Graph.shape(r.all_input_nodes[0])}, "
                f"the first reduced {domain}; one row domain per kernel"
            )
    n_cols = domain[-1]
    rows = numel(domain) // n_cols
    row_nodes = _row_level(graph, n_cols)
    threads = max(32, min(ROW_THREADS_MAX, 1 << (n_cols - 1).bit_length()))
    num_warps = threads // 32
    params, inputs, outputs = _params(graph)
    name = kernel_name("ctpu_fused_red", _signature(graph))
    row_domain = (*domain[:-1], 1)

    def body() -> None:
        tid, row = tid_x(), ctaid("x")
        lane, warp = reg.scalar(u32), reg.scalar(u32)
        ptx.inst.and_.b32(lane, tid, 31)
        ptx.inst.shr.u32(warp, tid, 5)
        smem = smem_base()
        in_ptrs = {n: global_ptr(f"in{i}") for i, n in enumerate(graph.inputs)}
        row_start = reg.scalar(u32)
        ptx.inst.mul.lo.u32(row_start, row, n_cols)
        row_values: dict[torch.fx.Node, Reg] = {}

        def load_at(node: torch.fx.Node, flat: Reg) -> Reg:
            index = broadcast_index(flat, domain, _Graph.shape(node))
            dt = _Graph.dtype(node)
            return load_f32(elem_addr(in_ptrs[node], index, DTYPE_BYTES[dt]), dt)

        def eval_row_nodes() -> None:
            ready = [
                n
                for n in graph.nodes[:-1]
                if n in row_nodes
                and n not in row_values
                and not ops.is_reduction(n)
                and _needed([n], set(row_values)) - {n} <= set(row_values) | set(graph.inputs)
            ]
            _evaluate(graph, ready, row_values, lambda node: load_at(node, row_start))

        def element_pass(targets: list[torch.fx.Node], consume) -> None:
            """A runtime loop over this thread's columns evaluating `targets` per element."""
            col = reg.scalar(u32)
            ptx.inst.mov.u32(col, tid)
            top, done = fresh_label("col_loop"), fresh_label("col_done")
            ptx.label(top)
            ptx.bra(done, pred=setp("ge", col, n_cols))
            flat = reg.scalar(u32)
            ptx.inst.add.u32(flat, row_start, col)
            values = dict(row_values)
            order = [n for n in graph.nodes[:-1] if n in _needed(targets, set(row_values))]
            _evaluate(graph, order, values, lambda node: load_at(node, flat))
            consume(values, flat)
            ptx.inst.add.u32(col, col, threads)
            ptx.bra(top)
            ptx.label(done)

        eval_row_nodes()
        for slot, red in enumerate(graph.reductions):
            kind = ops.reduction_kind(red)
            acc = fconst(ops.REDUCTION_INIT[kind])
            source = red.all_input_nodes[0]
            combine = "max" if kind == "amax" else "min" if kind == "amin" else "add"

            def accumulate(values: dict, flat: Reg, acc: Reg = acc, source=source, combine=combine) -> None:
                getattr(ptx.inst, combine).f32(acc, acc, values[source])

            element_pass([source], accumulate)
            block_allreduce(
                acc, combine, num_warps=num_warps, lane=lane, warp=warp, smem=smem, slot=slot * num_warps * 4
            )
            if kind == "mean":
                ptx.inst.mul.rn.f32(acc, acc, ops.fimm(1.0 / n_cols))
            row_values[red] = ops.finish_value(acc, _Graph.dtype(red))
            eval_row_nodes()

        out_ptrs = [global_ptr(f"out{i}") for i in range(len(graph.outputs))]
        elem_outs = [(p, n) for p, n in zip(out_ptrs, graph.outputs, strict=True) if n not in row_nodes]
        is_first = setp("eq", tid, 0)
        for p, n in zip(out_ptrs, graph.outputs, strict=True):
            if n in row_nodes:
                if numel(_Graph.shape(n)) != rows:
                    raise SubgraphError(f"row-level output {n.name} has shape {_Graph.shape(n)}, {rows} rows")
                store_f32(
                    elem_addr(p, row, DTYPE_BYTES[_Graph.dtype(n)]), row_values[n], _Graph.dtype(n), is_first
                )
        if elem_outs:
            for _, n in elem_outs:
                if _Graph.shape(n) != domain:
                    raise SubgraphError(f"output {n.name} has shape {_Graph.shape(n)}, expected {domain}")

            def write(values: dict, flat: Reg) -> None:
                for p, n in elem_outs:
                    store_f32(elem_addr(p, flat, DTYPE_BYTES[_Graph.dtype(n)]), values[n], _Graph.dtype(n))

            element_pass([n for _, n in elem_outs], write)
        ptx.ret()

    return trace(
        name,
        body,
        params,
        grid=(rows, 1, 1),
        block=(threads, 1, 1),
        smem_bytes=len(graph.reductions) * num_warps * 4,
        inputs=inputs,
        outputs=outputs,
        notes={"kind": "reduction", "row_domain": row_domain},
    )
