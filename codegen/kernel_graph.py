"""Read the bufferized MLIR function into a list of kernels over strided HBM views.

Before: one `func.func @main` on memrefs (after `one-shot-bufferize`): `memref.alloc`s, views
(expand/collapse_shape, subview), `linalg.fill`, `linalg.generic`, `linalg.matmul`, `linalg.batch_matmul`.
After: `KernelGraph` with one `Buffer` per function argument / alloc, every memref value as a `View`
(buffer, element offset, shape, strides: read from its static strided layout), and the kernels in program
order. Generic bodies become `ScalarProgram`s (op name + operand names), constants captured from the
function body included; compare ops carry their predicate in the name (`arith.cmpf.olt`).

Two body ops that read something other than the generic's operands are split out of the generic:
- `linalg.index d` (arange, causal masks) becomes an extra operand reading an `IotaKernel`'s int32 buffer
  [0, 1, .., n-1] with stride 1 along iteration dim d (0 elsewhere);
- `memref.load %table[index_cast(%id), linalg.index(last)]` (an embedding lookup, possibly fused into its
  consumer) becomes a `GatherKernel` that copies the addressed rows into a dense temporary, which the
  generic then reads as an ordinary operand.
Integer and bool constants are kept as the fp32 value with the same 32-bit pattern (a lane's bits);
`true` is ~0, because bool lanes are 0 / ~0 masks.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass, field

import numpy as np
from iree.compiler import ir

from codegen.errors import UnsupportedError

ESIZE = {"f32": 4, "bf16": 2, "i32": 4, "i1": 4}
CMPF = ("false", "oeq", "ogt", "oge", "olt", "ole", "one", "ord", "ueq", "ugt", "uge", "ult", "ule", "une", "uno",
        "true")
CMPI = ("eq", "ne", "slt", "sle", "sgt", "sge", "ult", "ule", "ugt", "uge")


@dataclass
class Buffer:
    name: str
    shape: tuple[int, ...]
    dtype: str
    kind: str  # "input" | "temp"
    index: int = -1  # argument position for inputs

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * ESIZE[self.dtype]


@dataclass(frozen=True)
class View:
    buffer: str
    offset: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    dtype: str


@dataclass
class ScalarProgram:
    """The body of a generic: `ops` are (result, op name, operand names); `yields` the yielded names."""

    args: list[str]
    ops: list[tuple[str, str, list[str]]]
    yields: list[str]
    constants: dict[str, float]


@dataclass
class Access:
    view: View
    iter_strides: tuple[int, ...]  # element stride per iteration dim (0: not indexed = broadcast)


@dataclass
class GenericKernel:
    sizes: tuple[int, ...]
    reduction: bool  # the last iteration dim is a reduction
    inputs: list[Access]
    output: Access
    body: ScalarProgram
    text: str = ""
    origin: tuple[str, str] = ("", "")  # (FX node, nn.Module path) from its MLIR location
    init: float | None = None  # a reduction's initial output value, from a fill folded into it (not loaded)
    # (the graph argument holding a runtime length, the iteration dim it bounds): iterations past that length
    # are padding of a dynamic-shape bucket that nothing reads (`compiler.bound_padded_rows`); None: all
    valid_extent: tuple[int, int] | None = None

    @property
    def reads_output(self) -> bool:
        """A reduction reads its output's initial value, unless a folded fill gave it (`init`)."""
        return self.reduction and self.init is None


@dataclass
class FillKernel:
    output: View
    value: float
    text: str = ""
    origin: tuple[str, str] = ("", "")  # (FX node, nn.Module path) from its MLIR location


@dataclass
class MatmulKernel:
    a: View  # [B?, M, K]
    b: View  # [B?, K, N]
    c: View  # [B?, M, N]
    text: str = ""
    origin: tuple[str, str] = ("", "")  # (FX node, nn.Module path) from its MLIR location
    # the graph argument (a 0-d integer input) holding how many of C's M rows to compute: the rest is padding
    # of a dynamic-shape bucket that nothing reads (`compiler.bound_padded_rows`); None: all M
    valid_rows: int | None = None
    # C's M rows as this many equal segments, valid_rows rows at the start of each (attention's [rep, L] rows
    # of a KV head's query heads: the valid queries of each head)
    row_segments: int = 1


@dataclass
class IotaKernel:
    """output[i] = i (int32), a dense 1-D buffer."""

    output: View
    text: str = ""
    origin: tuple[str, str] = ("", "")  # (FX node, nn.Module path) from its MLIR location


@dataclass
class GatherKernel:
    """output[i..., j] = table[ids[i...], j]: `ids` strides the output's outer dims (int32 row numbers),
    `output` is dense over `sizes`."""

    table: View  # [V, D]
    ids: Access  # iter_strides over `sizes` (0 along the last)
    output: View
    sizes: tuple[int, ...]
    text: str = ""
    origin: tuple[str, str] = ("", "")  # (FX node, nn.Module path) from its MLIR location


@dataclass
class ScatterKernel:
    """dest[indices[i, 0], .., indices[i, k - 1], ...] = updates[i, ...] for the rows i in order, in place
    (`iree_linalg_ext.scatter`, dimension_map [0, k)): `indices` is [N, k] int32, `updates` [N, slice...]
    with the slice the trailing dims of `dest`, contiguous in both."""

    dest: View
    indices: View
    updates: View
    text: str = ""
    origin: tuple[str, str] = ("", "")  # (FX node, nn.Module path) from its MLIR location


Kernel = GenericKernel | FillKernel | MatmulKernel | IotaKernel | GatherKernel | ScatterKernel


@dataclass
class KernelGraph:
    buffers: dict[str, Buffer] = field(default_factory=dict)
    kernels: list[Kernel] = field(default_factory=list)
    results: list[View] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)


def describe(g: KernelGraph) -> str:
    """The kernel graph as text (the `kernels.txt` stage): buffers, then one line per kernel."""
    lines = [f"buffer {b.name}: {b.kind} {b.dtype}{list(b.shape)}" for b in g.buffers.values()]
    for i, k in enumerate(g.kernels):
        if isinstance(k, GenericKernel):
            ins = ", ".join(f"{_v(o.view)} by {list(o.iter_strides)}" for o in k.inputs)
            ops = " ; ".join(f"{r} = {n} {', '.join(a)}" for r, n, a in k.body.ops)
            kind = "reduction" if k.reduction else "elementwise"
            bound = "" if k.valid_extent is None else \
                f" (dim {k.valid_extent[1]} up to the value of argument {k.valid_extent[0]})"
            lines.append(f"{i}: {kind} {list(k.sizes)}{bound} ({ins}) -> {_v(k.output.view)} {{ {ops} }}")
        elif isinstance(k, MatmulKernel):
            bound = "" if k.valid_rows is None else f" (rows up to the value of argument {k.valid_rows}" + (
                f" in each of {k.row_segments} segments)" if k.row_segments > 1 else ")")
            lines.append(f"{i}: matmul {_v(k.a)} @ {_v(k.b)} -> {_v(k.c)}{bound}")
        elif isinstance(k, FillKernel):
            lines.append(f"{i}: fill {k.value} -> {_v(k.output)}")
        elif isinstance(k, GatherKernel):
            lines.append(f"{i}: gather rows of {_v(k.table)} by {_v(k.ids.view)} -> {_v(k.output)}")
        elif isinstance(k, ScatterKernel):
            lines.append(f"{i}: scatter rows of {_v(k.updates)} by {_v(k.indices)} into {_v(k.dest)}")
        else:
            lines.append(f"{i}: iota -> {_v(k.output)}")
    lines.append(f"results: {', '.join(_v(v) for v in g.results)}")
    return "\n".join(lines) + "\n"


def _v(v: View) -> str:
    return f"{v.buffer}[+{v.offset} {list(v.shape)} strides {list(v.strides)} {v.dtype}]"


class LoweringError(UnsupportedError):
    """An MLIR op or layout the CTPU instruction selection cannot lower."""


def _memref(t: ir.Type) -> tuple[tuple[int, ...], str, tuple[int, ...], int]:
    mt = ir.MemRefType(t)
    strides, offset = mt.get_strides_and_offset()
    dtype = str(mt.element_type)
    if dtype not in ESIZE:
        raise LoweringError(f"element type {dtype} is not supported")
    if 0 in mt.shape:  # no element is addressed: MLIR leaves the strides outside a size-0 dim dynamic
        dense = [math.prod(max(d, 1) for d in mt.shape[i + 1:]) for i in range(mt.rank)]
        strides = [s if abs(s) <= 1 << 40 else dense[i] for i, s in enumerate(strides)]
        offset = offset if abs(offset) <= 1 << 40 else 0
    if any(abs(s) > 1 << 40 for s in [*strides, offset]):
        raise LoweringError(f"dynamic layout in {t}")
    return tuple(mt.shape), dtype, tuple(strides), offset


def read_function(module: ir.Module) -> KernelGraph:
    g = KernelGraph()
    func = module.body.operations[0]
    block = func.regions[0].blocks[0]
    state = ir.AsmState(func)  # one naming of the function's values: get_name() alone renumbers the module
    views: dict[str, View] = {}
    constants: dict[str, float] = {}
    for i, arg in enumerate(block.arguments):
        shape, dtype, strides, offset = _memref(arg.type)
        name = arg.get_name(state)
        g.buffers[name] = Buffer(name, shape, dtype, "input", i)
        g.arguments.append(name)
        views[name] = View(name, offset, shape, strides, dtype)
    for op in block.operations:
        first = len(g.kernels)
        _read_op(op, g, views, constants, state)
        origin = location_origin(op.location)
        for k in g.kernels[first:]:
            k.origin = origin
    _fold_transposed_weights(g)
    return g


def location_origin(loc: ir.Location) -> tuple[str, str]:
    """(FX node, module path) from the `loc("node"("module"))` fx_ops gives each op; ("", "") without one."""
    m = _NAME_LOC.fullmatch(str(loc))  # not a file:line:col location (an op the emitter did not write)
    return (m.group(1), m.group(2) or "") if m else ("", "")


_NAME_LOC = re.compile(r'loc\("([^"]*)"(?:\("([^"]*)"\))?\)')


def _read_op(op: ir.Operation, g: KernelGraph, views: dict[str, View], constants: dict[str, float],
             state: ir.AsmState) -> None:
    """One op of the function body: its views, constants and kernels into `g`."""
    name = op.name
    if name == "arith.constant":
        if isinstance(op.results[0].type, ir.ShapedType):
            raise LoweringError(f"tensor constant:\n{op}")
        constants[op.results[0].get_name(state)] = constant_value(op.attributes["value"])
    elif name == "memref.alloc":
        r = op.results[0]
        shape, dtype, strides, offset = _memref(r.type)
        g.buffers[r.get_name(state)] = Buffer(r.get_name(state), shape, dtype, "temp")
        views[r.get_name(state)] = View(r.get_name(state), offset, shape, strides, dtype)
    elif name in ("memref.expand_shape", "memref.collapse_shape", "memref.subview", "memref.cast",
                  "memref.reinterpret_cast"):
        src = views[op.operands[0].get_name(state)]
        r = op.results[0]
        shape, dtype, strides, offset = _memref(r.type)
        views[r.get_name(state)] = View(src.buffer, offset, shape, strides, dtype)
    elif name == "linalg.fill":
        value = constants[op.operands[0].get_name(state)]
        g.kernels.append(FillKernel(views[op.operands[1].get_name(state)], value, _text(op, state)))
    elif name in ("linalg.matmul", "linalg.batch_matmul"):
        a, b, c = (views[o.get_name(state)] for o in op.operands)
        g.kernels.append(MatmulKernel(a, b, c, _text(op, state)))
    elif name == "linalg.generic":
        g.kernels.extend(_generic(op, views, constants, g, state))
    elif name == "memref.copy":
        src, dst = (views[o.get_name(state)] for o in op.operands)
        value = _fill_value(g, src.buffer)
        if value is not None and _whole(g, src):
            g.kernels.append(FillKernel(dst, value, _text(op, state)))  # CSE shared one fill (matmul / reduction inits)
        else:
            body = ScalarProgram(["%in", "%out"], [], ["%in"], {})
            g.kernels.append(GenericKernel(dst.shape, False, [Access(src, src.strides)], Access(dst, dst.strides),
                                           body, _text(op, state)))
    elif name == "iree_linalg_ext.scatter":
        g.kernels.append(_scatter(op, views, state))
    elif name == "func.return":
        g.results = [views[o.get_name(state)] for o in op.operands]
    elif name != "memref.dealloc":
        raise LoweringError(f"MLIR op {name} has no CTPU lowering:\n{op}")


def _fold_transposed_weights(g: KernelGraph) -> None:
    """`x @ W.T` (nn.Linear's weight [out, in]; per batch, `q @ k.transpose(-1, -2)`) reaches the reader as
    a copy of W transposed into a dense temporary, read only as a matmul's B: the matmul reads W itself
    instead, as a B view contiguous along K (isel_matmul loads its rows with `mxu.lwt`), and the copy goes;
    so do the matmuls right after it that read the same copy as B (CSE keeps one copy of a key tile for the
    causal query blocks that share it). Only when nothing writes W between the copy and the matmuls, nothing
    else touches the temporary between them, and what touches it next writes all of it (bufferization reuses
    one temporary for the copies of weights of one shape: k_proj's and v_proj's, both 1024 x 1024, were
    copied on every call)."""
    for mm in [k for k in g.kernels if isinstance(k, MatmulKernel)]:
        tmp = mm.b
        buf = g.buffers.get(tmp.buffer)
        if buf is None or buf.kind != "temp" or not _whole(g, tmp) or not _dense_rows(tmp, 0) \
                or any(v.buffer == tmp.buffer for v in g.results) or mm.a.buffer == tmp.buffer \
                or mm.c.buffer == tmp.buffer:
            continue
        touching = [i for i, k in enumerate(g.kernels) if any(v.buffer == tmp.buffer for v in views_of(k))]
        at = touching.index(next(i for i in touching if g.kernels[i] is mm))
        if at == 0:
            continue
        copy = g.kernels[touching[at - 1]]
        if not isinstance(copy, GenericKernel) or copy.body.ops or copy.body.yields != copy.body.args[:1] \
                or len(copy.inputs) != 1 or copy.reduction or copy.output.view.buffer != tmp.buffer \
                or copy.output.view.offset != tmp.offset \
                or _squeezed(copy.sizes, copy.output.iter_strides) != _squeezed(tmp.shape, tmp.strides):
            continue  # (the copy may have dims of size 1 that the matmul's view does not: a batch of 1)
        readers = at + 1  # the matmuls right after that read the same copy as B (query blocks sharing a key tile)
        while readers < len(touching) and _reads_only_as_b(g.kernels[touching[readers]], tmp):
            readers += 1
        if readers < len(touching):  # the copy's value must die at the matmuls: the next user overwrites it all
            after = g.kernels[touching[readers]]
            views = [v for v in views_of(after) if v.buffer == tmp.buffer]
            if not isinstance(after, GenericKernel) or views != [after.output.view] or not _whole(g, views[0]):
                continue
        src = copy.inputs[0]
        src_strides = iter([st for n, st in zip(copy.sizes, src.iter_strides, strict=True) if n != 1])
        strides = tuple(0 if n == 1 else next(src_strides) for n in tmp.shape)
        K = tmp.shape[-2]
        if src.view.dtype != tmp.dtype or (strides[-2] != 1 and K > 1):
            continue
        if any(written_buffer(k) == src.view.buffer for k in g.kernels[touching[at - 1] + 1:touching[readers - 1]]):
            continue
        for i in touching[at:readers]:
            g.kernels[i].b = View(src.view.buffer, src.view.offset, tmp.shape, strides, tmp.dtype)
        g.kernels.pop(touching[at - 1])
        if at == 1 and readers == len(touching):  # nothing else ever touched the temporary
            del g.buffers[tmp.buffer]


def _squeezed(sizes: tuple[int, ...], strides: tuple[int, ...]) -> list[tuple[int, int]]:
    """(size, stride) of the dims that are not of size 1: one layout, whatever unit dims a view adds."""
    return [(n, st) for n, st in zip(sizes, strides, strict=True) if n != 1]


def _reads_only_as_b(k: Kernel, tmp: View) -> bool:
    return isinstance(k, MatmulKernel) and k.b == tmp and tmp.buffer not in (k.a.buffer, k.c.buffer)


def _text(op: ir.Operation, state: ir.AsmState) -> str:
    """The op as MLIR text, named by the function's `state` (str(op) names the whole module again: quadratic)."""
    out = io.StringIO()
    op.print(state, file=out)
    return out.getvalue()


def views_of(k: Kernel) -> list[View]:
    """Every view a kernel reads or writes."""
    if isinstance(k, GenericKernel):
        return [o.view for o in k.inputs] + [k.output.view]
    if isinstance(k, FillKernel | IotaKernel):
        return [k.output]
    if isinstance(k, GatherKernel):
        return [k.table, k.ids.view, k.output]
    if isinstance(k, ScatterKernel):
        return [k.dest, k.indices, k.updates]
    return [k.a, k.b, k.c]


def _scatter(op: ir.Operation, views: dict[str, View], state: ir.AsmState) -> ScatterKernel:
    """An in-place row scatter (the emitter's `scatter_rows`); anything else it could mean is refused."""
    updates, indices, dest = (views[o.get_name(state)] for o in op.operands)
    depth = indices.shape[-1] if len(indices.shape) == 2 else 0
    dims = list(ir.DenseI64ArrayAttr(op.attributes["dimension_map"]))
    body = op.regions[0].blocks[0]
    yielded = [o.get_name(state) for o in list(body.operations)[-1].operands]
    if (dims != list(range(depth)) or indices.dtype != "i32" or yielded != [body.arguments[0].get_name(state)]
            or updates.shape != (indices.shape[0], *dest.shape[depth:])
            or not _dense_rows(dest, depth) or not _dense_rows(updates, 1)):
        raise LoweringError(f"scatter that is not an in-place copy of dense rows at leading indices:\n{op}")
    return ScatterKernel(dest, indices, updates, _text(op, state).splitlines()[0])


def _dense_rows(v: View, lead: int) -> bool:
    """Whether the dims of `v` from `lead` on are contiguous (row-major, stride 1 last)."""
    return row_major(v.shape[lead:], v.strides[lead:])


def row_major(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether `strides` lay `shape` out densely, row-major (stride 1 last; a dim of size 1 any stride)."""
    expected = 1
    for size, stride in reversed(list(zip(shape, strides, strict=True))):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def constant_value(attr: ir.Attribute) -> float:
    """A scalar constant as the fp32 value of its 32-bit lane pattern (floats: the value itself)."""
    if isinstance(attr, ir.FloatAttr):
        return float(attr.value)
    a = ir.IntegerAttr(attr)
    width = a.type.width if isinstance(a.type, ir.IntegerType) else 32
    bits = (0xFFFFFFFF if a.value else 0) if width == 1 else a.value & 0xFFFFFFFF
    value = float(np.array(bits, dtype=np.uint32).view(np.float32))
    if int(np.array(value, dtype=np.float32).view(np.uint32)) != bits:
        raise LoweringError(f"integer constant {a.value} (its bits are a signalling NaN pattern)")
    return value


def _generic(op: ir.Operation, views: dict[str, View], constants: dict[str, float], g: KernelGraph,
             state: ir.AsmState) -> list[Kernel]:
    maps = [ir.AffineMapAttr(m).value for m in op.attributes["indexing_maps"]]
    iters = [str(i) for i in op.attributes["iterator_types"]]
    rank = len(iters)
    reduction = [("reduction" in i) for i in iters]
    operands = []
    sizes = [0] * rank
    for value, amap in zip(op.operands, maps, strict=True):
        view = views[value.get_name(state)]
        st = [0] * rank
        for res, stride, size in zip(amap.results, view.strides, view.shape, strict=True):
            if isinstance(res, ir.AffineDimExpr):
                st[res.position] += stride
                sizes[res.position] = size
            elif not isinstance(res, ir.AffineConstantExpr) or ir.AffineConstantExpr(res).value != 0:
                raise LoweringError(f"indexing map {amap} is not a projected permutation")
        operands.append(Access(view, tuple(st)))
    if len(op.results) or len(operands) - len(op.regions[0].blocks[0].arguments):
        raise LoweringError("generic with tensor results or a mismatched body")
    body_block = op.regions[0].blocks[0]
    args = [a.get_name(state) for a in body_block.arguments]
    ops: list[tuple[str, str, list[str]]] = []
    yields: list[str] = []
    consts: dict[str, float] = {}
    index_dims: dict[str, int] = {}  # linalg.index results -> iteration dim
    loads: dict[str, tuple[View, list[str]]] = {}  # memref.load results -> (table, index names)
    for inner in body_block.operations:
        names = [o.get_name(state) for o in inner.operands]
        for n in names:
            if n in constants:
                consts[n] = constants[n]
        if inner.name == "linalg.yield":
            yields = names
        elif inner.name == "arith.constant":
            consts[inner.results[0].get_name(state)] = constant_value(inner.attributes["value"])
        elif inner.name == "linalg.index":
            index_dims[inner.results[0].get_name(state)] = ir.IntegerAttr(inner.attributes["dim"]).value
        elif inner.name == "memref.load":
            loads[inner.results[0].get_name(state)] = (views[names[0]], names[1:])
        else:
            ops.append((inner.results[0].get_name(state), _op_name(inner), names))
    n_out = len(yields)
    if n_out != 1:
        raise LoweringError(f"generic with {n_out} outputs")
    prelude: list[Kernel] = []
    inputs, out_arg = list(zip(args[:-1], operands[:-1], strict=True)), args[-1]
    for res, (table, idx) in loads.items():
        prelude += _split_gather(res, table, idx, ops, consts, index_dims, inputs, sizes, g, _text(op, state))
    # a matmul, also of gathered rows (a MoE's tokens routed to the experts' weights)
    contraction = _contraction(sizes, iters, [o for _, o in inputs] + operands[-1:], [a for a, _ in inputs] +
                               [out_arg], ops, yields, consts, g, _text(op, state))
    if contraction is not None:
        return [*prelude, *contraction]
    live = _live(ops, [*yields])
    ops = [o for o in ops if o[0] in live]
    inputs = [(a, o) for a, o in inputs if a in live]
    for res, dim in index_dims.items():
        if res in live:
            view = _temp(g, "iota", (sizes[dim],), "i32")
            prelude.append(IotaKernel(view, f"linalg.index {dim} (iota of {sizes[dim]})"))
            st = tuple(1 if d == dim else 0 for d in range(rank))
            inputs.append((res, Access(view, st)))
    if any(reduction):
        ops = _subtraction_as_addition(ops, yields, out_arg)
    body = ScalarProgram([a for a, _ in inputs] + [out_arg], ops, yields, consts)
    accesses, output = [o for _, o in inputs], operands[-1]
    if any(reduction[:-1]):
        sizes, accesses, output = _reductions_innermost(sizes, reduction, accesses, output, g, prelude)
    return [*prelude, GenericKernel(tuple(sizes), any(reduction), accesses, output, body, _text(op, state))]


def _subtraction_as_addition(ops: list[tuple[str, str, list[str]]], yields: list[str], out_arg: str
                             ) -> list[tuple[str, str, list[str]]]:
    """A reduction yielding `out - v` (the elementwise fusion of sum(-x)) as `out + (-v)`: the same value in
    IEEE arithmetic (signed zeros included), with + the combiner the vector unit reduces with."""
    yielded = [o for o in ops if o[0] == yields[0]]
    if not yielded or yielded[0][1] != "arith.subf" or yielded[0][2][0] != out_arg or yielded[0][2][1] == out_arg:
        return ops
    res, _, (_, v) = yielded[0]
    neg = f"{res}_neg"
    return [o for o in ops if o[0] != res] + [(neg, "arith.negf", [v]), (res, "arith.addf", [neg, out_arg])]


def _reductions_innermost(sizes: list[int], reduction: list[bool], inputs: list[Access], output: Access,
                          g: KernelGraph, prelude: list[Kernel]) -> tuple[list[int], list[Access], Access]:
    """A reduction over any set of iteration dims as one over the innermost dim (what the vector unit
    reduces): the order of iteration is free, so the reduction dims move after the parallel ones and
    merge into one. An input whose strides over them do not nest into one dim of stride 0 or 1 is first
    copied densely (its own parallel dims, then the reduction dims) by a copy kernel over its dims only,
    so a broadcast operand is not copied once per output element."""
    red = [d for d, r in enumerate(reduction) if r]
    par = [d for d, r in enumerate(reduction) if not r]
    red_sizes = [sizes[d] for d in red]

    def merged(a: Access) -> tuple[int, int] | None:
        m = _merge(red_sizes, [a.iter_strides[d] for d in red])
        return m if m is not None and m[1] in (0, 1) else None

    def reordered(a: Access, m: tuple[int, int]) -> Access:
        return Access(a.view, (*(a.iter_strides[d] for d in par), m[1]))

    out: list[Access] = []
    for a in inputs:
        m = merged(a)
        if m is None:
            dims = [d for d in par if a.iter_strides[d]] + red
            shape = tuple(sizes[d] for d in dims)
            dense = _temp(g, "dense", shape, a.view.dtype)
            copy = ScalarProgram(["%in", "%out"], [], ["%in"], {})
            prelude.append(GenericKernel(shape, False, [Access(a.view, tuple(a.iter_strides[d] for d in dims))],
                                         Access(dense, dense.strides), copy, "dense copy of a reduction operand"))
            strides = [0] * len(sizes)
            for d, st in zip(dims, dense.strides, strict=True):
                strides[d] = st
            a = Access(dense, tuple(strides))
            m = merged(a)
            assert m is not None, "a dense copy's trailing dims nest"
        out.append(reordered(a, m))
    m = _merge(red_sizes, [output.iter_strides[d] for d in red])
    if m is None or (m[0] != 1 and m[1] != 0):
        raise LoweringError("a reduction whose output is indexed by a reduction dim")
    return [*(sizes[d] for d in par), math.prod(red_sizes)], out, Access(output.view, (*(
        output.iter_strides[d] for d in par), 0))


def _op_name(op: ir.Operation) -> str:
    if op.name in ("arith.cmpf", "arith.cmpi"):
        names = CMPF if op.name == "arith.cmpf" else CMPI
        return f"{op.name}.{names[ir.IntegerAttr(op.attributes['predicate']).value]}"
    if op.name in ("arith.uitofp", "arith.extui") and str(op.operands[0].type) != "i1":
        raise LoweringError(f"{op.name} from {op.operands[0].type} (only from i1)")
    return op.name


def _live(ops: list[tuple[str, str, list[str]]], roots: list[str]) -> set[str]:
    live = set(roots)
    for res, _, names in reversed(ops):
        if res in live:
            live.update(names)
    return live


def _temp(g: KernelGraph, hint: str, shape: tuple[int, ...], dtype: str) -> View:
    name = f"%{hint}{len(g.buffers)}"
    g.buffers[name] = Buffer(name, shape, dtype, "temp")
    strides, acc = [], 1
    for s in reversed(shape):
        strides.append(acc)
        acc *= s
    return View(name, 0, shape, tuple(reversed(strides)), dtype)


def _split_gather(res: str, table: View, idx: list[str], ops: list[tuple[str, str, list[str]]],
                  consts: dict[str, float], index_dims: dict[str, int], inputs: list[tuple[str, Access]],
                  sizes: list[int], g: KernelGraph, text: str) -> list[Kernel]:
    """Replace `res = memref.load table[index_cast(id), linalg.index(last)]` by a read of a gathered
    temporary (appended to `inputs` under the name `res`). An id the body computes (GPT-2's positions:
    `arange` fused into the lookup) is first written to an int32 temporary by its own kernel."""
    rank = len(sizes)
    producer = {r: (name, names) for r, name, names in ops}
    row = producer.get(idx[0]) if len(idx) == 2 else None
    by_arg = dict(inputs)
    # the column: the last iteration dim, or the constant 0 of a one-column table (canonicalization folds a
    # linalg.index over a dim of size 1; a gathered scalar may also be used across the last dim: an id
    # gathered by one load and used by the next, BERT's token types)
    column = len(idx) == 2 and index_dims.get(idx[1]) == rank - 1 and len(table.shape) == 2 \
        and table.shape[1] == sizes[-1]
    scalar = len(idx) == 2 and consts.get(idx[1]) == 0 and len(table.shape) == 2 and table.shape[1] == 1
    if row is None or row[0] != "arith.index_cast" or not (column or scalar):
        raise LoweringError(f"memref.load that is not a row gather (table[id, last index]):\n{text}")
    prelude: list[Kernel] = []
    ids = by_arg.get(row[1][0])
    if ids is None:
        if any(by_arg[a].iter_strides[-1] for a in _live(ops, [row[1][0]]) if a in by_arg):
            raise LoweringError(f"memref.load that is not a row gather (the id varies along the row):\n{text}")
        ids = _factor_kernel(row[1][0], sizes[:-1], ops, by_arg, consts, g, prelude, index_dims, "i32")
        if ids is None:
            raise LoweringError(f"a gather whose row id is not computable on its own:\n{text}")
        ids = Access(ids.view, (*ids.iter_strides, 0))
    if ids.iter_strides[-1] != 0:
        raise LoweringError(f"memref.load that is not a row gather (the id varies along the row):\n{text}")
    # gathered once per distinct id: over the dims the ids vary along (a gather fused into a matmul is
    # read by every output column; materialized per output element it was E*N times the rows)
    kept = [d for d in range(rank - 1) if ids.iter_strides[d]] or list(range(rank - 1))
    gathered = (*(sizes[d] for d in kept), sizes[-1] if column else 1)
    out = _temp(g, "gather", gathered, table.dtype)
    strides = [0] * rank
    for d, st in zip(kept, out.strides, strict=False):
        strides[d] = st
    strides[-1] = out.strides[-1] if column else 0
    inputs.append((res, Access(out, tuple(strides))))
    ids = Access(ids.view, (*(ids.iter_strides[d] for d in kept), 0))
    return [*prelude, GatherKernel(table, ids, out, gathered, f"gather rows of {table.buffer}: {text}")]


# ---- contractions back to matmuls -----------------------------------------------------------------------
def _contraction(sizes: list[int], iters: list[str], operands: list[Access], args: list[str],
                 ops: list[tuple[str, str, list[str]]], yields: list[str], consts: dict[str, float],
                 g: KernelGraph, text: str) -> list[Kernel] | None:
    """A generic `out += f(..) * g(..)` as a MatmulKernel. Reshape propagation in
    linalg-fuse-elementwise-ops turns a linalg.matmul whose operand was reshaped into such a generic, and
    elementwise fusion may then move producers (rope, a cast) into it: a factor that is not a plain operand
    is first computed by its own elementwise kernel into a dense temporary. Iteration dims are batch (both
    factors and out), M (first factor, out), N (second, out) or K (reductions); each operand's dims of one
    kind merge into one when their strides allow, else it is copied into a dense [batch, M, K] /
    [batch, K, N] buffer."""
    if "reduction" not in " ".join(iters) or len(operands) < 3:
        return None
    producer = {res: (name, names) for res, name, names in ops}
    out_arg = args[-1]
    y = producer.get(yields[0])
    if y is None or y[0] != "arith.addf" or out_arg not in y[1]:
        return None
    prod = producer.get(y[1][1] if y[1][0] == out_arg else y[1][0])
    if prod is None or prod[0] != "arith.mulf" or len(_live(ops, [prod[1][0], prod[1][1]]) & {out_arg}):
        return None
    by_arg = dict(zip(args[:-1], operands[:-1], strict=True))
    prelude: list[Kernel] = []
    factors = []
    for name in prod[1]:
        name = _through_ext(name, producer)
        if name in by_arg:
            factors.append(by_arg[name])
            continue
        # a bf16 value (a truncf: the graph rounded it) is kept in a bf16 temporary: as f32 the matmul would
        # take the fp32 path (6 MXU passes at "highest") for values that are bf16-exact
        p = producer.get(name)
        dtype = "bf16" if p is not None and p[0] == "arith.truncf" else "f32"
        factor = _factor_kernel(name, sizes, ops, by_arg, consts, g, prelude, dtype=dtype)
        if factor is None:
            return None
        factors.append(factor)
    a, b = factors
    c = operands[-1]
    kinds = []
    for d, it in enumerate(iters):
        in_a, in_b = a.iter_strides[d] != 0, b.iter_strides[d] != 0
        kinds.append("k" if "reduction" in it else "m" if in_a and not in_b else "n" if in_b and not in_a
                     else "batch")
    if not _zero_filled(g, c.view.buffer):
        raise LoweringError(f"contraction into a buffer that is not a fresh zero fill:\n{text}")

    def dims(kind: str) -> list[int]:
        return [d for d, k in enumerate(kinds) if k == kind]

    batch, m, n, k = dims("batch"), dims("m"), dims("n"), dims("k")
    if not any(sizes[d] > 1 for d in (*m, *n)) and not prelude:
        return None  # a dot product per output element (rowsum(a * b)): a vector reduction, not 1 x K x 1 matmuls
    av = _matrix(a, [batch, m, k], sizes, g, prelude)
    bv = _matrix(b, [batch, k, n], sizes, g, prelude, transposed=True)
    cv = _matrix(c, [batch, m, n], sizes, g, None)
    if av is None or bv is None or cv is None:
        raise LoweringError(f"contraction whose result is not a dense matrix:\n{text}")
    if not batch:
        av, bv, cv = (View(v.buffer, v.offset, v.shape[1:], v.strides[1:], v.dtype) for v in (av, bv, cv))
    return [*prelude, MatmulKernel(av, bv, cv, text)]


def _factor_kernel(name: str, sizes: list[int], ops: list[tuple[str, str, list[str]]], by_arg: dict[str, Access],
                   consts: dict[str, float], g: KernelGraph, prelude: list[Kernel],
                   index_dims: dict[str, int] | None = None, dtype: str = "f32") -> Access | None:
    """An elementwise kernel computing body value `name` over the iteration dims (of `sizes`) its inputs
    use, into a dense temporary of `dtype`; returns that temporary as an operand. `linalg.index` values it
    needs (`index_dims`) are read from iota kernels."""
    live = _live(ops, [name])
    produced = {res for res, _, _ in ops}
    by_arg = {a: Access(o.view, o.iter_strides[:len(sizes)]) for a, o in by_arg.items()}
    for res, dim in (index_dims or {}).items():
        if res in live and dim < len(sizes):
            view = _temp(g, "iota", (sizes[dim],), "i32")
            prelude.append(IotaKernel(view, f"linalg.index {dim} (iota of {sizes[dim]})"))
            by_arg[res] = Access(view, tuple(1 if d == dim else 0 for d in range(len(sizes))))
    used = [a for a in by_arg if a in live]
    if any(n not in produced and n not in by_arg and n not in consts for n in live):
        return None
    dims = [d for d in range(len(sizes)) if any(by_arg[a].iter_strides[d] != 0 for a in used)]
    dims = _layout_order(dims, [by_arg[a] for a in used])
    shape = tuple(sizes[d] for d in dims)
    temp = _temp(g, "factor", shape, dtype)
    inputs = [Access(by_arg[a].view, tuple(by_arg[a].iter_strides[d] for d in dims)) for a in used]
    body = ScalarProgram([*used, "%out"], [o for o in ops if o[0] in live], [name],
                         {k: v for k, v in consts.items() if k in live})
    prelude.append(GenericKernel(shape, False, inputs, Access(temp, temp.strides), body, f"factor {name}"))
    strides = [0] * len(sizes)
    for d, st in zip(dims, temp.strides, strict=True):
        strides[d] = st
    return Access(temp, tuple(strides))


def _layout_order(dims: list[int], inputs: list[Access]) -> list[int]:
    """The order of a factor's dims: the iteration's, unless the largest input is not contiguous along the
    last of them (P @ V's V as [S, D] read in the contraction's [D, S] order): then that input's layout
    (broadcast dims outermost, then by decreasing stride), so the factor reads rows and does not transpose
    (a DMA pair per column: 67,702 cycles a layer at a 256-token prefill); the matmul takes either
    layout of a B operand (mxu.lwt)."""
    if not inputs or not dims:
        return dims
    lead = max(inputs, key=lambda a: math.prod(a.view.shape))
    if lead.iter_strides[dims[-1]] in (0, 1):
        return dims
    return sorted(dims, key=lambda d: (lead.iter_strides[d] != 0, -abs(lead.iter_strides[d])))


def _zero_filled(g: KernelGraph, buffer: str) -> bool:
    return _fill_value(g, buffer) == 0.0


def _whole(g: KernelGraph, v: View) -> bool:
    """Whether `v` covers all of its buffer."""
    return v.offset == 0 and math.prod(v.shape) == math.prod(g.buffers[v.buffer].shape)


def _fill_value(g: KernelGraph, buffer: str) -> float | None:
    """The value the last kernel writing `buffer` filled it with (following whole identity copies from
    other buffers, which bufferization makes when CSE has shared one fill between several users), or
    None. A copy within the buffer (a circular pad's wrap-around) or of part of it is no fill."""
    writer = next((k for k in reversed(g.kernels) if written_buffer(k) == buffer), None)
    if isinstance(writer, FillKernel) and _whole(g, writer.output):
        return writer.value
    if isinstance(writer, GenericKernel) and not writer.body.ops and len(writer.inputs) == 1 \
            and writer.body.yields == writer.body.args[:1] and _whole(g, writer.output.view) \
            and writer.inputs[0].view.buffer != buffer:
        return _fill_value(g, writer.inputs[0].view.buffer)
    return None


def written_buffer(k: Kernel) -> str:
    """The buffer kernel k writes."""
    if isinstance(k, GenericKernel):
        return k.output.view.buffer
    if isinstance(k, MatmulKernel):
        return k.c.buffer
    if isinstance(k, ScatterKernel):
        return k.dest.buffer
    return k.output.buffer


def _through_ext(name: str, producer: dict[str, tuple[str, list[str]]]) -> str:
    p = producer.get(name)
    return p[1][0] if p is not None and p[0] == "arith.extf" else name


def _merge(sizes: list[int], strides: list[int]) -> tuple[int, int] | None:
    """(size, stride) of dims merged into one, or None when their strides do not nest."""
    size, stride = 1, 0
    for n, st in zip(sizes, strides, strict=True):
        if n == 1:
            continue
        if size != 1 and stride != st * n:
            return None
        size, stride = size * n, st
    return size, (stride if size != 1 else 1)


def _matrix(o: Access, groups: list[list[int]], sizes: list[int], g: KernelGraph,
            prelude: list[Kernel] | None, transposed: bool = False) -> View | None:
    """A 3-D view [g0, g1, g2] of the operand (each group of iteration dims merged), copying it into a
    dense temporary first (when `prelude` is given) if its strides do not allow that. `transposed`: a
    view contiguous along g1 instead of g2 will do (a matmul's B = W.T, which isel loads with mxu.lwt)."""
    merged = [_merge([sizes[d] for d in grp], [o.iter_strides[d] for d in grp]) for grp in groups]
    if all(mg is not None for mg in merged) and (merged[2][1] == 1  # type: ignore[index]
                                                 or (transposed and merged[1][1] == 1)):  # type: ignore[index]
        return View(o.view.buffer, o.view.offset, tuple(mg[0] for mg in merged),  # type: ignore[index]
                    tuple(mg[1] for mg in merged), o.view.dtype)  # type: ignore[index]
    if prelude is None:
        return None
    order = [d for grp in groups for d in grp]
    shape = tuple(sizes[d] for d in order)
    dense = _temp(g, "dense", shape, o.view.dtype)
    body = ScalarProgram(["%in", "%out"], [], ["%in"], {})
    prelude.append(GenericKernel(shape, False, [Access(o.view, tuple(o.iter_strides[d] for d in order))],
                                 Access(dense, dense.strides), body, "dense copy of a matmul operand"))
    n = [math.prod(sizes[d] for d in grp) for grp in groups]
    return View(dense.buffer, 0, tuple(n), (n[1] * n[2], n[2], 1), o.view.dtype)
