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

import hashlib

import torch
import torch.fx
from pyptx import ptx, reg
from pyptx.reg import Reg
from pyptx.types import s32, s64, u32
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.passes.shape_prop import ShapeProp

from ptx_kernels import ops
from ptx_kernels.core import (
    DTYPE_BYTES,
    INT_DTYPES,
    KernelParam,
    PtxKernel,
    Shape,
    TensorArg,
    block_allreduce,
    ctaid,
    elem_addr,
    fconst,
    fresh_label,
    global_ptr,
    kernel_name,
    lane_and_group,
    load_f32,
    load_value,
    numel,
    setp,
    smem_base,
    store_f32,
    store_value,
    tid_x,
    trace,
)
from ptx_kernels.elementwise import broadcast_index, flat_index, trace_flat

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
                raise SubgraphError(f"input dtype {dt} unsupported (fp32, bf16, bool, int32, int64)")
        # Fake tensors, not meta ones: factory nodes (arange, full) name a real device in their kwargs.
        mode = FakeTensorMode(allow_non_fake_inputs=True)
        with mode:
            fakes = [torch.empty(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]
        ShapeProp(gm, fake_mode=mode).propagate(*fakes)
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
    """Op names, input shapes and a digest of the whole specialisation (arguments, dtypes, output shapes),
    so that two different subgraphs never share an entry name."""
    names = "_".join(ops.op_name(n) for n in graph.body)
    shapes = "_".join("x".join(map(str, _Graph.shape(n))) for n in graph.inputs)
    position = {n: i for i, n in enumerate(graph.nodes)}
    spec = "|".join(
        f"{n.op}:{ops.op_name(n) if n.op != 'placeholder' else ''}:"
        f"{torch.fx.node.map_arg((n.args, n.kwargs), lambda a: f'%{position[a]}')}:"
        f"{_Graph.shape(n)}:{_Graph.dtype(n)}"
        for n in graph.nodes[:-1]
    )
    digest = hashlib.sha1(spec.encode()).hexdigest()[:8]
    return f"{names}_{shapes}_{digest}"


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
    domain = _Graph.shape(graph.outputs[0])
    for n in graph.outputs:
        if _Graph.shape(n) != domain:
            raise SubgraphError(f"output {n.name} has shape {_Graph.shape(n)}, expected {domain}")
    total = numel(domain)
    params, inputs, outputs = _params(graph)
    name = kernel_name("ctpu_fused_ew", _signature(graph))

    def body() -> None:
        in_ptrs = {n: global_ptr(f"in{i}") for i, n in enumerate(graph.inputs)}
        out_ptrs = [global_ptr(f"out{i}") for i in range(len(graph.outputs))]
        idx, guard = flat_index(1, total)
        ev = _Indexed(in_ptrs, guard)
        coords = delinearize(idx, domain)
        for ptr, node in zip(out_ptrs, graph.outputs, strict=True):
            dt = _Graph.dtype(node)
            store_value(elem_addr(ptr, idx, DTYPE_BYTES[dt]), ev.value(node, coords), dt, guard)
        ptx.ret()

    return trace_flat(name, body, params, total, inputs=inputs, outputs=outputs, notes={"kind": "elementwise"})


Coord = list  # per dim: a u32 register or a Python int (a known coordinate)


def delinearize(flat: Reg | int, shape: Shape) -> Coord:
    """Coordinates of contiguous flat index `flat` in `shape` (size-1 dims are the constant 0)."""
    coords: Coord = [0] * len(shape)
    rest = flat
    for axis in reversed(range(len(shape))):
        extent = shape[axis]
        if extent == 1:
            continue
        if isinstance(rest, int):
            coords[axis], rest = rest % extent, rest // extent
            continue
        if axis == 0 or numel(shape[:axis]) == 1:
            coords[axis] = rest
            break
        coord, quotient = reg.scalar(u32), reg.scalar(u32)
        ptx.inst.rem.u32(coord, rest, extent)
        ptx.inst.div.u32(quotient, rest, extent)
        coords[axis], rest = coord, quotient
    return coords


def linearize(coords: Coord, shape: Shape) -> Reg | int:
    """Contiguous flat index of `coords` in `shape`."""
    const, terms, stride = 0, [], 1
    for c, extent in zip(reversed(coords), reversed(shape), strict=True):
        if isinstance(c, int):
            const += c * stride
        elif extent != 1:
            terms.append((c, stride))
        stride *= extent
    if not terms:
        return const
    out = reg.scalar(u32)
    ptx.inst.mul.lo.u32(out, terms[0][0], terms[0][1])
    for c, st in terms[1:]:
        ptx.inst.mad.lo.u32(out, c, st, out)
    if const:
        ptx.inst.add.u32(out, out, const)
    return out


def _broadcast(coords: Coord, out_shape: Shape, in_shape: Shape) -> Coord:
    lead = len(out_shape) - len(in_shape)
    return [0 if e == 1 else c for c, e in zip(coords[lead:], in_shape, strict=True)]


def _reshape(coords: Coord, out_shape: Shape, in_shape: Shape) -> Coord:
    squeezed = [(c, e) for c, e in zip(coords, out_shape, strict=True) if e != 1]
    if [e for _, e in squeezed] == [e for e in in_shape if e != 1]:  # (un)squeeze only: no index math
        it = iter(c for c, _ in squeezed)
        return [0 if e == 1 else next(it) for e in in_shape]
    return delinearize(linearize(coords, out_shape), in_shape)


def _const_u32(c: Reg | int) -> Reg:
    if isinstance(c, Reg):
        return c
    r = reg.scalar(u32)
    ptx.inst.mov.u32(r, c)
    return r


def _dim(node: torch.fx.Node, name: str, position: int, default: int, rank: int) -> int:
    d = ops._kw(node, name, position, default)
    return int(d) % rank if rank else 0


class _Indexed:
    """Evaluates subgraph nodes at given output coordinates, memoised per (node, coordinates).

    Each op maps its output coordinates to the coordinates it reads its operands at: broadcasting for
    elementwise ops, permutations for permute/transpose, offsets for slice/select/cat, a loaded row index
    for embedding. So views, gathers and index-producing ops fuse with the arithmetic around them.
    """

    def __init__(self, in_ptrs: dict[torch.fx.Node, Reg], guard: Reg | None) -> None:
        self.in_ptrs, self.guard = in_ptrs, guard
        self.cache: dict[tuple, Reg] = {}

    def value(self, node: torch.fx.Node, coords: Coord) -> Reg:
        key = (node, tuple(c if isinstance(c, int) else c.name for c in coords))
        if key not in self.cache:
            self.cache[key] = self._compute(node, coords)
        return self.cache[key]

    def _at(self, arg: object, node: torch.fx.Node, coords: Coord) -> object:
        if isinstance(arg, torch.fx.Node):
            return self.value(arg, _broadcast(coords, _Graph.shape(node), _Graph.shape(arg)))
        return arg

    def _compute(self, node: torch.fx.Node, coords: Coord) -> Reg:
        shape, dtype = _Graph.shape(node), _Graph.dtype(node)
        if node.op == "placeholder":
            index = _const_u32(linearize(coords, shape))
            addr = elem_addr(self.in_ptrs[node], index, DTYPE_BYTES[dtype])
            return load_value(addr, dtype, self.guard)
        name = ops.op_name(node)
        src = node.args[0] if node.args else None
        if name == "expand":
            return self.value(src, _broadcast(coords, shape, _Graph.shape(src)))
        if name in ops.VIEWS:
            return self.value(src, _reshape(coords, shape, _Graph.shape(src)))
        if name in ops.INDEXING:
            return self._indexing(node, name, coords, shape, dtype)
        args = [self._at(a, node, coords) for a in node.args]
        return ops.emit(node, args, dtype)

    def _indexing(self, node: torch.fx.Node, name: str, coords: Coord, shape: Shape, dtype) -> Reg:
        src = node.args[0] if node.args else None
        if name == "permute":
            dims = [int(d) % len(shape) for d in node.args[1]]
            inner: Coord = [0] * len(shape)
            for i, d in enumerate(dims):
                inner[d] = coords[i]
            return self.value(src, inner)
        if name in ("transpose", "t"):
            inner = list(coords)
            if len(shape) >= 2:
                d0 = int(node.args[1]) % len(shape) if len(node.args) > 1 else 0
                d1 = int(node.args[2]) % len(shape) if len(node.args) > 2 else 1
                inner[d0], inner[d1] = coords[d1], coords[d0]
            return self.value(src, inner)
        if name == "slice":
            in_shape = _Graph.shape(src)
            dim = _dim(node, "dim", 1, 0, len(shape))
            start = ops._kw(node, "start", 2, None) or 0
            start = start + in_shape[dim] if start < 0 else min(start, in_shape[dim])
            step = int(ops._kw(node, "step", 4, 1))
            inner = list(coords)
            inner[dim] = _affine(coords[dim], step, start)
            return self.value(src, inner)
        if name == "select":
            in_shape = _Graph.shape(src)
            dim = _dim(node, "dim", 1, 0, len(in_shape))
            index = int(node.args[2]) % in_shape[dim]
            return self.value(src, [*coords[:dim], index, *coords[dim:]])
        if name == "cat":
            return self._cat(node, coords, shape)
        if name == "embedding":
            weight, indices = node.args[0], node.args[1]
            rows = _Graph.shape(weight)[0]
            row = ops.to_s64(self.value(indices, coords[:-1]))
            ptx.inst.max.s64(row, row, 0)  # out-of-range ids read a valid row instead of faulting
            ptx.inst.min.s64(row, row, rows - 1)
            row32 = reg.scalar(u32)
            ptx.inst.cvt.u32.s64(row32, row)
            return self.value(weight, [row32, coords[-1]])
        if name == "arange":
            return _arange(node, coords, dtype)
        return _constant(node, name, dtype)

    def _cat(self, node: torch.fx.Node, coords: Coord, shape: Shape) -> Reg:
        tensors = [t for t in node.args[0] if numel(_Graph.shape(t))]
        dim = _dim(node, "dim", 1, 0, len(shape))
        result, offset = None, 0
        for t in tensors:
            extent = _Graph.shape(t)[dim]
            inner = list(coords)
            if isinstance(coords[dim], int):
                if offset <= coords[dim] < offset + extent:
                    return self.value(t, [*coords[:dim], coords[dim] - offset, *coords[dim + 1 :]])
                offset += extent
                continue
            local = reg.scalar(s32)  # clamp(c - offset, 0, extent - 1): in-bounds reads for every input
            ptx.inst.sub.s32(local, coords[dim], offset)
            ptx.inst.max.s32(local, local, 0)
            ptx.inst.min.s32(local, local, extent - 1)
            inner[dim] = local
            value = self.value(t, inner)
            if result is None:
                result = value
            else:
                mine = setp("ge", coords[dim], offset)
                out = reg.scalar(value.dtype)
                getattr(ptx.inst.selp, "s64" if value.dtype == s64 else "f32")(out, value, result, mine)
                result = out
            offset += extent
        if result is None:
            raise SubgraphError(f"node {node.name}: cat with nothing to read")
        return result


def _affine(c: Reg | int, scale: int, offset: int) -> Reg | int:
    if isinstance(c, int):
        return c * scale + offset
    out = reg.scalar(u32)
    ptx.inst.mad.lo.u32(out, c, scale, offset)
    return out


def _arange(node: torch.fx.Node, coords: Coord, dtype: torch.dtype) -> Reg:
    """arange(end) / arange(start, end[, step]): start + step * i."""
    nums = [a for a in node.args if isinstance(a, (int, float))]
    start, step = (0, 1) if len(nums) == 1 else (nums[0], nums[2] if len(nums) > 2 else 1)
    i = coords[0] if coords else 0
    if dtype in INT_DTYPES:
        out = reg.scalar(s64)
        if isinstance(i, int):
            ptx.inst.mov.s64(out, int(start) + int(step) * i)
        else:
            ptx.inst.cvt.u64.u32(out, i)
            ptx.inst.mad.lo.s64(out, out, int(step), int(start))
        return out
    out = fconst(0.0)
    if isinstance(i, int):
        ptx.inst.mov.f32(out, ops.fimm(float(start) + float(step) * i))
    else:
        ptx.inst.cvt.rn.f32.u32(out, i)
        ptx.inst.fma.rn.f32(out, out, ops.fimm(float(step)), ops.fimm(float(start)))
    return ops.finish_value(out, dtype)


def _constant(node: torch.fx.Node, name: str, dtype: torch.dtype) -> Reg:
    if name in ("zeros", "new_zeros", "zeros_like"):
        value = 0
    elif name in ("ones", "new_ones", "ones_like"):
        value = 1
    elif name == "scalar_tensor":
        value = node.args[0]
    else:  # full(size, value) / full_like(x, value)
        value = node.args[1]
    if dtype in INT_DTYPES:
        return ops.to_s64(int(value))
    return ops.finish_value(fconst(float(value)), dtype)


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
        lane, warp = lane_and_group(tid)
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
