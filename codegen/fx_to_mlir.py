"""FX (core ATen) -> MLIR on tensors: linalg.generic / linalg.matmul / tensor reshapes, in one func.

The emitter walks the graph once and writes each node as linalg on tensors:

- elementwise ops -> `linalg.generic` (all parallel) with an arith/math body; broadcasting is in the
  indexing maps (a size-1 or missing input dim maps to the constant 0 or is dropped);
- reductions over the last dim (sum, amax, mean) -> `linalg.fill` of the identity + `linalg.generic`
  with a trailing reduction iterator;
- mm / bmm / addmm -> `linalg.matmul` / `linalg.batch_matmul` on a zero fill (+ an epilogue generic);
- permute/transpose/t and expand -> a copy `linalg.generic` with a permuted / broadcasting map, which the
  fusion pass folds into its consumers; view/reshape/(un)squeeze -> `tensor.collapse_shape` +
  `tensor.expand_shape`; slice -> `tensor.extract_slice`;
- composite core-ATen ops (_softmax, native_layer_norm, gelu) and the `ctpu::*` fused ops are written
  as their decomposition into the above.

The module text is parsed (and so verified) by the MLIR Python bindings (`iree.compiler.ir`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx

from codegen.errors import UnsupportedError
from device_sim.config import SMALL, HardwareConfig

DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.int32: "i32", torch.int64: "i32", torch.bool: "i1"}
FLOATS = ("f32", "bf16")
SLICED_REDUCTION_MAX = 16  # reductions over at most this many outer slices run as one elementwise op
# int64 tensors are narrowed to int32 (the lane width) at the graph boundary; bool tensors are i1 in MLIR
# and 0 / ~0 lane masks (32-bit words) in vmem and HBM.


class UnsupportedOp(UnsupportedError):
    """An FX node the CTPU code generator cannot lower (names the node)."""


@dataclass(frozen=True)
class TValue:
    """An SSA tensor value of the function being built."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def type(self) -> str:
        dims = "x".join(str(d) for d in self.shape)
        return f"tensor<{dims}x{self.dtype}>" if self.shape else f"tensor<{self.dtype}>"


ValueOrScalar = TValue | float
Body = Callable[[list[str], "BodyWriter"], str]


class BodyWriter:
    """Writes scalar ops inside a linalg region; every method returns the SSA name of its result."""

    def __init__(self, emitter: MlirEmitter, dtype: str) -> None:
        self.e, self.dtype, self.lines = emitter, dtype, []

    def op(self, name: str, *args: str, dtype: str | None = None) -> str:
        r = self.e.fresh()
        self.lines.append(f"{r} = {name} {', '.join(args)} : {dtype or self.dtype}")
        return r

    def const(self, value: float, dtype: str | None = None) -> str:
        r, dtype = self.e.fresh(), dtype or self.dtype
        self.lines.append(f"{r} = arith.constant {_float_literal(value, dtype)} : {dtype}")
        return r

    def cast(self, x: str, src: str, dst: str) -> str:
        """Convert a scalar between f32, bf16, i32 (truncating, like torch) and i1 (nonzero)."""
        if src == dst:
            return x
        if src in FLOATS and dst in FLOATS:
            return self._conv("arith.extf" if dst == "f32" else "arith.truncf", x, src, dst)
        if dst == "i1":
            zero = self.const(0.0, src) if src in FLOATS else self.const_int(0, src)
            return self._cmp("une" if src in FLOATS else "ne", x, zero, src)
        if src in ("i32", "i1") and dst in FLOATS:
            f = self._conv("arith.sitofp" if src == "i32" else "arith.uitofp", x, src, "f32")
            return self.cast(f, "f32", dst)
        if src in FLOATS and dst == "i32":
            return self._conv("arith.fptosi", self.cast(x, src, "f32"), "f32", "i32")
        if src == "i1" and dst == "i32":
            return self._conv("arith.extui", x, "i1", "i32")
        raise UnsupportedOp(f"conversion {src} -> {dst}")

    def _conv(self, kind: str, x: str, src: str, dst: str) -> str:
        r = self.e.fresh()
        self.lines.append(f"{r} = {kind} {x} : {src} to {dst}")
        return r

    def _cmp(self, pred: str, a: str, b: str, dtype: str) -> str:
        r = self.e.fresh()
        kind = "arith.cmpf" if dtype in FLOATS else "arith.cmpi"
        self.lines.append(f"{r} = {kind} {pred}, {a}, {b} : {dtype}")
        return r

    def cmp(self, pred: str, a: str, b: str, dtype: str = "f32") -> str:
        """An i1 comparison: pred in oeq/one/olt/ole/ogt/oge/une (floats), eq/ne/slt/sle/sgt/sge (ints)."""
        return self._cmp(pred, a, b, dtype)

    def const_int(self, value: int, dtype: str = "i32") -> str:
        r = self.e.fresh()
        self.lines.append(f"{r} = arith.constant {_literal(value, dtype)}")
        return r

    def select(self, cond: str, a: str, b: str, dtype: str = "f32") -> str:
        r = self.e.fresh()
        self.lines.append(f"{r} = arith.select {cond}, {a}, {b} : {dtype}")
        return r

    def index(self, dim: int) -> str:
        """The iteration index along `dim`, as i32."""
        i = self.e.fresh()
        self.lines.append(f"{i} = linalg.index {dim} : index")
        return self._conv("arith.index_cast", i, "index", "i32")


_INTEGER_OPS = {"arith.addf": "arith.addi", "arith.subf": "arith.subi", "arith.mulf": "arith.muli"}
_INTEGER_PREDICATES = {"oeq": "eq", "ueq": "eq", "one": "ne", "une": "ne", "olt": "slt", "ult": "slt", "ole": "sle",
                       "ule": "sle", "ogt": "sgt", "ugt": "sgt", "oge": "sge", "uge": "sge"}


class IntegerBodyWriter(BodyWriter):
    """A body written once for f32 (every aten op's lowering) run on i32 values exactly: add, sub, mul, neg,
    abs, min/max, compares and selects become integer ops (`vadd.i`, `vcmp.lt.i`, ...). Through f32 an
    integer above 2^24 lost its low bits silently (`x + 1` of 2^24 + 1 gave 2^24); an op with no exact integer
    form (a division, exp, ...) raises UnsupportedOp, and the node runs on the CPU. i32 wraps where torch's
    int64 would not (above 2^31)."""

    def op(self, name: str, *args: str, dtype: str | None = None) -> str:
        if dtype not in (None, "f32", "i32"):
            return super().op(name, *args, dtype=dtype)  # i1 logic
        if name in _INTEGER_OPS:
            return super().op(_INTEGER_OPS[name], *args, dtype="i32")
        if name in ("arith.addi", "arith.subi", "arith.muli", "arith.andi", "arith.ori", "arith.xori", "arith.shli",
                    "arith.shrsi"):
            return super().op(name, *args, dtype="i32")
        if name in ("arith.maximumf", "arith.maxnumf", "arith.minimumf", "arith.minnumf"):
            a, b = args
            return self.select(self.cmp("ogt" if "max" in name else "olt", a, b), a, b)
        if name == "arith.negf":
            return super().op("arith.subi", self.const_int(0), args[0], dtype="i32")
        if name == "math.absf":
            return self.op("arith.maximumf", args[0], self.op("arith.negf", args[0]))
        raise UnsupportedOp(f"{name} of integers (only through f32, which is exact below 2^24)")

    def const(self, value: float, dtype: str | None = None) -> str:
        if dtype not in (None, "f32", "i32"):
            return super().const(value, dtype)
        if not math.isfinite(value) or value != int(value) or abs(value) >= 2**31:
            raise UnsupportedOp(f"the constant {value} in integer arithmetic")
        return self.const_int(int(value))

    def cast(self, x: str, src: str, dst: str) -> str:
        return super().cast(x, "i32" if src == "f32" else src, "i32" if dst == "f32" else dst)

    def cmp(self, pred: str, a: str, b: str, dtype: str = "f32") -> str:
        if dtype in ("f32", "i32"):
            return self._cmp(_INTEGER_PREDICATES.get(pred, pred), a, b, "i32")
        return self._cmp(pred, a, b, dtype)

    def select(self, cond: str, a: str, b: str, dtype: str = "f32") -> str:
        return super().select(cond, a, b, "i32" if dtype == "f32" else dtype)


def _literal(value: float, dtype: str) -> str:
    """The text after `arith.constant` for a scalar of `dtype`."""
    if dtype == "i1":
        return "true" if value else "false"
    if dtype == "i32":
        return f"{int(value)} : i32"
    return f"{_float_literal(value, dtype)} : {dtype}"


def _float_literal(value: float, dtype: str) -> str:
    """Infinities and NaN as hex bits of the type's width (bf16: the upper half of the fp32 pattern)."""
    if math.isfinite(value):
        return format(float(value), ".17e")
    bits = 0x7FC00000 if math.isnan(value) else 0xFF800000 if value < 0 else 0x7F800000
    return f"0x{bits:08X}" if dtype == "f32" else f"0x{bits >> 16:04X}"


def affine_map(rank: int, results: Sequence[str] | None = None) -> str:
    """`affine_map<(d0, .., d{rank-1}) -> (results)>`; without results, the identity."""
    results = results if results is not None else [f"d{i}" for i in range(rank)]
    dims = ", ".join(f"d{i}" for i in range(rank))
    return f"affine_map<({dims}) -> ({', '.join(results)})>"


def _leading(dims: int, rank: int) -> str:
    """The reassociation that merges the first `dims` of `rank` dims: [[0, .., dims - 1], [dims], ..]."""
    return "[" + ", ".join([f"[{', '.join(str(i) for i in range(dims))}]",
                            *(f"[{i}]" for i in range(dims, rank))]) + "]"


class MlirEmitter:
    """Builds the text of one `func.func @main` from an FX graph; `config` is the configuration it is built
    for (lowerings that tile at the graph level size their tiles from it)."""

    def __init__(self, config: HardwareConfig = SMALL) -> None:
        self.config = config
        self.lines: list[str] = []
        self._n = 0
        self.arguments: list[TValue] = []  # the function's arguments: the only values `copy_` may write
        self.mutations: list[tuple[int, TValue]] = []  # (argument index, its new value), from copy_ nodes
        self.split_from: dict[str, tuple[TValue, int]] = {}  # split_leading's results: (merged value, dims)
        # values later ops take as they are, by key (attention's causal last keys, the same in every layer: one
        # copy, which the layer loop's invariant kernels run once before the layers)
        self.reused: dict[tuple[object, ...], TValue] = {}

    def fresh(self) -> str:
        self._n += 1
        return f"%v{self._n}"

    # ---- building blocks ----------------------------------------------------------------------
    def empty(self, shape: tuple[int, ...], dtype: str) -> TValue:
        v = TValue(self.fresh(), shape, dtype)
        self.lines.append(f"{v.name} = tensor.empty() : {v.type}")
        return v

    def fill(self, value: float, shape: tuple[int, ...], dtype: str) -> TValue:
        e = self.empty(shape, dtype)
        c = self.fresh()
        self.lines.append(f"{c} = arith.constant {_literal(value, dtype)}")
        v = TValue(self.fresh(), shape, dtype)
        self.lines.append(f"{v.name} = linalg.fill ins({c} : {dtype}) outs({e.name} : {e.type}) -> {v.type}")
        return v

    def generic(self, inputs: Sequence[TValue], maps: Sequence[str], init: TValue, iterators: Sequence[str],
                body: Callable[[list[str], BodyWriter], str], writer: type[BodyWriter] = BodyWriter) -> TValue:
        out = TValue(self.fresh(), init.shape, init.dtype)
        w = writer(self, init.dtype)
        args = [self.fresh() for _ in inputs] + [self.fresh()]
        result = body(args, w)
        iters = ", ".join(f'"{i}"' for i in iterators)
        ins = ", ".join(v.name for v in inputs)
        ins_types = ", ".join(v.type for v in inputs)
        arg_decl = ", ".join(f"{a}: {v.dtype}" for a, v in zip(args, [*inputs, init], strict=True))
        head = f"{out.name} = linalg.generic {{indexing_maps = [{', '.join(maps)}], iterator_types = [{iters}]}}"
        if inputs:
            head += f" ins({ins} : {ins_types})"
        self.lines.append(f"{head} outs({init.name} : {init.type}) {{")
        self.lines.append(f"^bb0({arg_decl}):")
        self.lines.extend("  " + ln for ln in w.lines)
        self.lines.append(f"  linalg.yield {result} : {init.dtype}")
        self.lines.append(f"}} -> {out.type}")
        return out

    def elementwise(self, operands: Sequence[ValueOrScalar], fn: Callable[[list[str], BodyWriter], str],
                    dtype: str | None = None, shape: tuple[int, ...] | None = None, result: str = "f32",
                    keep_bool: bool = False) -> TValue:
        """Broadcasting elementwise op; float operands become constants in the body.

        The body computes in f32: float and integer operands arrive converted to f32 (integers exactly up to
        2^24), bool (i1) operands as 0.0 / 1.0, or as i1 with `keep_bool` (selects, logical ops); `fn`
        returns a value of type `result` (f32, or i1 for compares), converted to the output dtype (default:
        the first tensor operand's)."""
        tensors = [o for o in operands if isinstance(o, TValue)]
        out_shape = shape if shape is not None else tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
        out_dtype = dtype or (tensors[0].dtype if tensors else "f32")
        rank = len(out_shape)
        maps = []
        for t in tensors:
            lead = rank - len(t.shape)
            maps.append(affine_map(rank, ["0" if (s == 1 and out_shape[lead + i] != 1) else f"d{lead + i}"
                                       for i, s in enumerate(t.shape)]))
        maps.append(affine_map(rank))
        init = self.empty(out_shape, out_dtype)
        # integers computed as integers (exact), as soon as one is not a bool (0 / 1: exact in f32 too)
        integer = out_dtype in ("i32", "i1") and any(t.dtype == "i32" for t in tensors) \
            and all(t.dtype in ("i32", "i1") for t in tensors) \
            and all(float(o).is_integer() for o in operands if not isinstance(o, TValue))

        def body(args: list[str], w: BodyWriter) -> str:
            it = iter(args)
            vals = []
            for o in operands:
                if isinstance(o, TValue):
                    keep = o.dtype == "i1" and keep_bool
                    vals.append(next(it) if keep else w.cast(next(it), o.dtype, "f32"))
                else:
                    vals.append(w.const(float(o), "f32"))
            w.dtype = "f32"
            r = fn(vals, w)
            return w.cast(r, result, out_dtype)

        return self.generic(tensors, maps, init, ["parallel"] * rank, body,
                            IntegerBodyWriter if integer else BodyWriter)

    def reduce_last(self, x: TValue, kind: str, keepdim: bool) -> TValue:
        """sum or max over the last dim (f32 accumulation)."""
        return self.reduce(x, [len(x.shape) - 1], kind, keepdim)

    def reduce(self, x: TValue, dims: Sequence[int], kind: str, keepdim: bool) -> TValue:
        """sum or max over the dims `dims` (non-negative, any set: the kernel reader makes them innermost),
        f32 accumulation."""
        rank = len(x.shape)
        reduced = set(dims)
        kept = [i for i in range(rank) if i not in reduced]
        identity = 0.0 if kind == "sum" else -math.inf
        op = "arith.addf" if kind == "sum" else "arith.maximumf"
        slices = math.prod(x.shape[d] for d in reduced)
        if 0 in x.shape:  # nothing to read: an empty result, or the identity (a sum over an empty dim is +0.0)
            r = self.fill(identity, tuple(x.shape[i] for i in kept), "f32")
        elif rank - 1 not in reduced and 1 < slices <= SLICED_REDUCTION_MAX:
            r = self._sliced_reduce(x, sorted(reduced), identity, op)
        else:
            def body(args: list[str], w: BodyWriter) -> str:
                return w.op(op, w.cast(args[0], x.dtype, "f32"), args[1], dtype="f32")

            init = self.fill(identity, tuple(x.shape[i] for i in kept), "f32")
            maps = [affine_map(rank), affine_map(rank, [f"d{i}" for i in kept])]
            r = self.generic([x], maps, init, ["reduction" if i in reduced else "parallel" for i in range(rank)],
                             body)
        return self.reshape(r, tuple(1 if i in reduced else s for i, s in enumerate(x.shape))) if keepdim else r

    def _sliced_reduce(self, x: TValue, reduced: list[int], identity: float, op: str) -> TValue:
        """A reduction over a few slices along outer dims (a MoE's top-k sum over [T, k, H]): one elementwise
        op over the slices (strided views), where a reduction would first copy x with the reduced dims
        innermost, rows of k elements."""
        kept_shape = tuple(s for i, s in enumerate(x.shape) if i not in reduced)
        parts = []
        for at in itertools.product(*(range(x.shape[d]) for d in reduced)):
            part = TValue(self.fresh(), kept_shape, x.dtype)
            where = dict(zip(reduced, at, strict=True))
            offs = ", ".join(str(where.get(i, 0)) for i in range(len(x.shape)))
            sizes = ", ".join(str(1 if i in where else s) for i, s in enumerate(x.shape))
            ones = ", ".join("1" for _ in x.shape)
            self.lines.append(f"{part.name} = tensor.extract_slice {x.name}[{offs}] [{sizes}] [{ones}] : "
                              f"{x.type} to {part.type}")
            parts.append(part)

        def combine(v: list[str], w: BodyWriter) -> str:
            acc = w.const(identity, "f32")  # from the identity, as torch: a sum of -0.0s is +0.0
            for value in v:
                acc = w.op(op, acc, value, dtype="f32")
            return acc

        return self.elementwise(parts, combine, dtype="f32")

    def copy_map(self, x: TValue, shape: tuple[int, ...], results: list[str]) -> TValue:
        """out[d...] = x[results(d...)]: permutations and broadcasts, as a fusable copy."""
        rank = len(shape)
        init = self.empty(shape, x.dtype)
        maps = [affine_map(rank, results), affine_map(rank)]
        return self.generic([x], maps, init, ["parallel"] * rank, lambda a, w: a[0])

    def fusion_barrier(self, x: TValue) -> TValue:
        """x copied into a new tensor (bufferized to a memref.copy): elementwise fusion stops here."""
        r = TValue(self.fresh(), x.shape, x.dtype)
        self.lines.append(f"{r.name} = bufferization.alloc_tensor() copy({x.name}) : {x.type}")
        return r

    def reshape(self, x: TValue, shape: tuple[int, ...]) -> TValue:
        """Through the flat 1-d view: collapse to it, expand from it (a 0-d tensor is a rank change of []
        groups: expanded from / collapsed into tensor<1x..>)."""
        shape = tuple(int(s) for s in shape)
        if shape == x.shape:
            return x
        flat = x
        if not x.shape:
            flat = TValue(self.fresh(), (1,), x.dtype)
            self.lines.append(f"{flat.name} = tensor.expand_shape {x.name} [] output_shape [1] : {x.type} into "
                              f"{flat.type}")
        elif len(x.shape) != 1:
            flat = TValue(self.fresh(), (math.prod(x.shape),), x.dtype)
            groups = f"[[{', '.join(str(i) for i in range(len(x.shape)))}]]"
            self.lines.append(f"{flat.name} = tensor.collapse_shape {x.name} {groups} : {x.type} into {flat.type}")
        if len(shape) == 1:
            return flat
        out = TValue(self.fresh(), shape, x.dtype)
        if not shape:
            self.lines.append(f"{out.name} = tensor.collapse_shape {flat.name} [] : {flat.type} into {out.type}")
            return out
        groups = f"[[{', '.join(str(i) for i in range(len(shape)))}]]"
        dims = ", ".join(str(s) for s in shape)
        self.lines.append(f"{out.name} = tensor.expand_shape {flat.name} {groups} output_shape [{dims}] : "
                          f"{flat.type} into {out.type}")
        return out

    def merge_leading(self, x: TValue, dims: int) -> TValue:
        """x with its first `dims` dims merged into one: one `tensor.collapse_shape`, a view of x's buffer."""
        if dims == 1:
            return x
        out = TValue(self.fresh(), (math.prod(x.shape[:dims]), *x.shape[dims:]), x.dtype)
        self.lines.append(f"{out.name} = tensor.collapse_shape {x.name} {_leading(dims, len(x.shape))} : {x.type} "
                          f"into {out.type}")
        return out

    def split_leading(self, x: TValue, shape: tuple[int, ...]) -> TValue:
        """`merge_leading`'s inverse: x's first dim split into the leading dims of `shape`. `copy_` writes
        such a value into an input as the merged value into the same view of the input (`split_from`):
        materialized as it is, it made one-shot-bufferize copy the input, then copy it back."""
        dims = len(shape) - len(x.shape) + 1
        if dims == 1:
            return x
        out = TValue(self.fresh(), shape, x.dtype)
        self.lines.append(f"{out.name} = tensor.expand_shape {x.name} {_leading(dims, len(shape))} output_shape "
                          f"[{', '.join(str(s) for s in shape)}] : {x.type} into {out.type}")
        self.split_from[out.name] = (x, dims)
        return out

    def iota(self, shape: tuple[int, ...], fn: Callable[[list[str], BodyWriter], str], dtype: str) -> TValue:
        """out[i...] = fn(indices as i32): arange, masks; `fn` returns a value of type `dtype`."""
        rank = len(shape)
        init = self.empty(shape, dtype)

        def body(args: list[str], w: BodyWriter) -> str:
            w.dtype = dtype
            return fn([w.index(d) for d in range(rank)], w)

        return self.generic([], [affine_map(rank)], init, ["parallel"] * rank, body)

    def gather_rows(self, table: TValue, ids: TValue) -> TValue:
        """out[i..., j] = table[ids[i...], j] (an embedding lookup: tensor.extract in a generic body)."""
        shape = (*ids.shape, table.shape[-1])
        rank = len(shape)
        init = self.empty(shape, table.dtype)

        def body(args: list[str], w: BodyWriter) -> str:
            row, col = w.e.fresh(), w.e.fresh()
            r = w.e.fresh()
            w.lines.append(f"{row} = arith.index_cast {args[0]} : {ids.dtype} to index")
            w.lines.append(f"{col} = linalg.index {rank - 1} : index")
            w.lines.append(f"{r} = tensor.extract {table.name}[{row}, {col}] : {table.type}")
            return r

        maps = [affine_map(rank, [f"d{i}" for i in range(rank - 1)]), affine_map(rank)]
        return self.generic([ids], maps, init, ["parallel"] * rank, body)

    def scatter_rows(self, dest: TValue, indices: TValue, updates: TValue) -> TValue:
        """dest with dest[indices[i, 0], .., indices[i, k - 1], ...] = updates[i, ...] for every row i
        (`iree_linalg_ext.scatter`, dimension_map [0, k), rows written in order: a repeated index keeps the
        last row). A value like any other: one-shot-bufferize writes dest's buffer in place when nothing
        reads the old value later (else it copies it first), and the kernel reader makes a ScatterKernel."""
        depth = indices.shape[-1]
        dims = ", ".join(str(i) for i in range(depth))
        out = TValue(self.fresh(), dest.shape, dest.dtype)
        u, o = self.fresh(), self.fresh()
        self.lines.append(f"{out.name} = iree_linalg_ext.scatter dimension_map = [{dims}] unique_indices(false) "
                          f"ins({updates.name}, {indices.name} : {updates.type}, {indices.type}) "
                          f"outs({dest.name} : {dest.type}) {{")
        self.lines.append(f"^bb0({u}: {dest.dtype}, {o}: {dest.dtype}):")
        self.lines.append(f"  iree_linalg_ext.yield {u} : {dest.dtype}")
        self.lines.append(f"}} -> {out.type}")
        return out

    def materialize(self, src: TValue, dest: TValue) -> TValue:
        """src written into dest's buffer (`bufferization.materialize_in_destination`): after bufferization
        the result IS dest's buffer, in place when src was computed there, else through a copy."""
        out = TValue(self.fresh(), dest.shape, dest.dtype)
        self.lines.append(f"{out.name} = bufferization.materialize_in_destination {src.name} in {dest.name} : "
                          f"({src.type}, {dest.type}) -> {out.type}")
        return out

    def extract_slice(self, x: TValue, dim: int, start: int, end: int, step: int = 1) -> TValue:
        """x[start:end:step] along `dim` (a strided view after bufferization)."""
        shape = (*x.shape[:dim], -(-(end - start) // step), *x.shape[dim + 1:])
        if 0 in shape:  # nothing to read, and MLIR rejects any offset into a dimension of size 0
            return self.empty(shape, x.dtype)
        out = TValue(self.fresh(), shape, x.dtype)
        offs = ", ".join(str(start if i == dim else 0) for i in range(len(shape)))
        sizes = ", ".join(str(s) for s in shape)
        steps = ", ".join(str(step if i == dim else 1) for i in range(len(shape)))
        self.lines.append(f"{out.name} = tensor.extract_slice {x.name}[{offs}] [{sizes}] [{steps}] : "
                          f"{x.type} to {out.type}")
        return out

    def insert_slice(self, dest: TValue, part: TValue, offsets: Sequence[int]) -> TValue:
        """dest with `part` written at `offsets` (tensor.insert_slice: a copy into a subview)."""
        if 0 in part.shape:  # nothing to write, and MLIR rejects any offset into a dimension of size 0
            return dest
        out = TValue(self.fresh(), dest.shape, dest.dtype)
        offs = ", ".join(str(o) for o in offsets)
        sizes = ", ".join(str(s) for s in part.shape)
        ones = ", ".join("1" for _ in part.shape)
        self.lines.append(f"{out.name} = tensor.insert_slice {part.name} into {dest.name}[{offs}] [{sizes}] "
                          f"[{ones}] : {part.type} into {dest.type}")
        return out

    def concat(self, parts: Sequence[TValue], dim: int) -> TValue:
        """cat along `dim`: tensor.insert_slice of each part into an empty tensor (copies into subviews)."""
        shape = list(parts[0].shape)
        shape[dim] = sum(p.shape[dim] for p in parts)
        acc = self.empty(tuple(shape), parts[0].dtype)
        offset = 0
        for p in parts:
            if p.dtype != acc.dtype:
                p = self.elementwise([p], lambda v, w: v[0], dtype=acc.dtype)
            acc = self.insert_slice(acc, p, [offset if i == dim else 0 for i in range(len(shape))])
            offset += p.shape[dim]
        return acc

    def matmul(self, a: TValue, b: TValue, out_dtype: str) -> TValue:
        if a.dtype not in FLOATS or b.dtype not in FLOATS:
            raise UnsupportedOp(f"a matmul of {a.type} and {b.type} (the MXU multiplies floats)")
        batch = len(a.shape) == 3
        shape = (*a.shape[:-1], b.shape[-1])
        # the CTPU accumulates in fp32 whatever the result type and rounds once when storing
        init = self.fill(0.0, shape, out_dtype)
        op = "linalg.batch_matmul" if batch else "linalg.matmul"
        r = TValue(self.fresh(), shape, out_dtype)
        self.lines.append(f"{r.name} = {op} ins({a.name}, {b.name} : {a.type}, {b.type}) "
                          f"outs({init.name} : {init.type}) -> {r.type}")
        return r

    def module(self, args: list[TValue], results: list[TValue]) -> str:
        """The function text. An argument no copy_ writes is read-only to bufferization: a value built from
        it in place (insert_slice, scatter, a reduction starting from it) gets a copy, and the caller's
        tensor is never written behind its back."""
        mutated = {i for i, _ in self.mutations}
        sig = ", ".join(f"{a.name}: {a.type}" + ("" if i in mutated else " {bufferization.writable = false}")
                        for i, a in enumerate(args))
        rtypes = ", ".join(r.type for r in results)
        body = "\n".join("    " + ln for ln in self.lines)
        rets = ", ".join(r.name for r in results)
        return (f"module {{\n  func.func @main({sig}) -> ({rtypes}) {{\n{body}\n"
                f"    return {rets} : {rtypes}\n  }}\n}}\n")
