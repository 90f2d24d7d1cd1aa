"""Read the bufferized MLIR function into a list of kernels over strided HBM views.

Before: one `func.func @main` on memrefs (after `one-shot-bufferize`): `memref.alloc`s, views
(expand/collapse_shape, subview), `linalg.fill`, `linalg.generic`, `linalg.matmul`, `linalg.batch_matmul`.
After: `KernelGraph` with one `Buffer` per function argument / alloc, every memref value as a `View`
(buffer, element offset, shape, strides: read from its static strided layout), and the kernels in program
order. Generic bodies become `ScalarProgram`s (op name + operand names), constants captured from the
function body included.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from iree.compiler import ir

from codegen.errors import UnsupportedError

ESIZE = {"f32": 4, "bf16": 2}


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
class Operand:
    view: View
    iter_strides: tuple[int, ...]  # element stride per iteration dim (0: not indexed = broadcast)


@dataclass
class GenericKernel:
    sizes: tuple[int, ...]
    reduction: bool  # the last iteration dim is a reduction
    inputs: list[Operand]
    output: Operand
    body: ScalarProgram
    text: str = ""


@dataclass
class FillKernel:
    output: View
    value: float
    text: str = ""


@dataclass
class MatmulKernel:
    a: View  # [B?, M, K]
    b: View  # [B?, K, N]
    c: View  # [B?, M, N]
    text: str = ""


Kernel = GenericKernel | FillKernel | MatmulKernel


@dataclass
class KernelGraph:
    buffers: dict[str, Buffer] = field(default_factory=dict)
    kernels: list[Kernel] = field(default_factory=list)
    results: list[View] = field(default_factory=list)
    arguments: list[str] = field(default_factory=list)


class LoweringError(UnsupportedError):
    """An MLIR op or layout the CTPU instruction selection cannot lower."""


def _memref(t: ir.Type) -> tuple[tuple[int, ...], str, tuple[int, ...], int]:
    mt = ir.MemRefType(t)
    strides, offset = mt.get_strides_and_offset()
    dtype = str(mt.element_type)
    if dtype not in ESIZE:
        raise LoweringError(f"element type {dtype} is not supported")
    if any(abs(s) > 1 << 40 for s in [*strides, offset]):
        raise LoweringError(f"dynamic layout in {t}")
    return tuple(mt.shape), dtype, tuple(strides), offset


def read_function(module: ir.Module) -> KernelGraph:
    g = KernelGraph()
    func = module.body.operations[0]
    block = func.regions[0].blocks[0]
    views: dict[str, View] = {}
    constants: dict[str, float] = {}
    for i, arg in enumerate(block.arguments):
        shape, dtype, strides, offset = _memref(arg.type)
        name = arg.get_name()
        g.buffers[name] = Buffer(name, shape, dtype, "input", i)
        g.arguments.append(name)
        views[name] = View(name, offset, shape, strides, dtype)
    for op in block.operations:
        name = op.name
        if name == "arith.constant":
            constants[op.results[0].get_name()] = float(ir.FloatAttr(op.attributes["value"]).value)
        elif name == "memref.alloc":
            r = op.results[0]
            shape, dtype, strides, offset = _memref(r.type)
            g.buffers[r.get_name()] = Buffer(r.get_name(), shape, dtype, "temp")
            views[r.get_name()] = View(r.get_name(), offset, shape, strides, dtype)
        elif name in ("memref.expand_shape", "memref.collapse_shape", "memref.subview", "memref.cast",
                      "memref.reinterpret_cast"):
            src = views[op.operands[0].get_name()]
            r = op.results[0]
            shape, dtype, strides, offset = _memref(r.type)
            views[r.get_name()] = View(src.buffer, offset, shape, strides, dtype)
        elif name == "linalg.fill":
            value = constants[op.operands[0].get_name()]
            g.kernels.append(FillKernel(views[op.operands[1].get_name()], value, str(op)))
        elif name in ("linalg.matmul", "linalg.batch_matmul"):
            a, b, c = (views[o.get_name()] for o in op.operands)
            g.kernels.append(MatmulKernel(a, b, c, str(op)))
        elif name == "linalg.generic":
            g.kernels.append(_generic(op, views, constants))
        elif name == "memref.copy":
            src, dst = (views[o.get_name()] for o in op.operands)
            body = ScalarProgram(["%in", "%out"], [], ["%in"], {})
            g.kernels.append(GenericKernel(dst.shape, False, [Operand(src, src.strides)], Operand(dst, dst.strides),
                                           body, str(op)))
        elif name == "func.return":
            g.results = [views[o.get_name()] for o in op.operands]
        elif name == "memref.dealloc":
            continue
        else:
            raise LoweringError(f"MLIR op {name} has no CTPU lowering:\n{op}")
    return g


def _generic(op: ir.Operation, views: dict[str, View], constants: dict[str, float]) -> GenericKernel:
    maps = [ir.AffineMapAttr(m).value for m in op.attributes["indexing_maps"]]
    iters = [str(i) for i in op.attributes["iterator_types"]]
    rank = len(iters)
    reduction = [("reduction" in i) for i in iters]
    if any(reduction[:-1]):
        raise LoweringError(f"reduction over a dim other than the innermost:\n{op}")
    operands = []
    sizes = [0] * rank
    for value, amap in zip(op.operands, maps, strict=True):
        view = views[value.get_name()]
        st = [0] * rank
        for res, stride, size in zip(amap.results, view.strides, view.shape, strict=True):
            if isinstance(res, ir.AffineDimExpr):
                st[res.position] += stride
                sizes[res.position] = size
            elif not isinstance(res, ir.AffineConstantExpr):
                raise LoweringError(f"indexing map {amap} is not a projected permutation")
        operands.append(Operand(view, tuple(st)))
    if len(op.results) or len(operands) - len(op.regions[0].blocks[0].arguments):
        raise LoweringError("generic with tensor results or a mismatched body")
    body_block = op.regions[0].blocks[0]
    args = [a.get_name() for a in body_block.arguments]
    ops, yields, consts = [], [], {}
    for inner in body_block.operations:
        names = [o.get_name() for o in inner.operands]
        for n in names:
            if n in constants:
                consts[n] = constants[n]
        if inner.name == "linalg.yield":
            yields = names
        elif inner.name == "arith.constant":
            consts[inner.results[0].get_name()] = float(ir.FloatAttr(inner.attributes["value"]).value)
        else:
            ops.append((inner.results[0].get_name(), inner.name, names))
    n_out = len(yields)
    if n_out != 1:
        raise LoweringError(f"generic with {n_out} outputs")
    return GenericKernel(tuple(sizes), reduction[-1] if rank else False, operands[:-1], operands[-1],
                         ScalarProgram(args, ops, yields, consts), str(op))
