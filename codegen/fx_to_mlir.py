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

import math
import operator
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.fx

from codegen.errors import UnsupportedError

DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16"}


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


Operand = TValue | float
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
        r = self.e.fresh()
        self.lines.append(f"{r} = arith.constant {_float_literal(value)} : {dtype or self.dtype}")
        return r

    def cast(self, x: str, src: str, dst: str) -> str:
        if src == dst:
            return x
        r = self.e.fresh()
        kind = "arith.extf" if dst == "f32" else "arith.truncf"
        self.lines.append(f"{r} = {kind} {x} : {src} to {dst}")
        return r


def _float_literal(value: float) -> str:
    if math.isinf(value):
        return "0xFF800000" if value < 0 else "0x7F800000"
    if math.isnan(value):
        return "0x7FC00000"
    return format(float(value), ".17e")


def _affine(rank: int, results: Sequence[str]) -> str:
    dims = ", ".join(f"d{i}" for i in range(rank))
    return f"affine_map<({dims}) -> ({', '.join(results)})>"


class MlirEmitter:
    """Builds the text of one `func.func @main` from an FX graph."""

    def __init__(self) -> None:
        self.lines: list[str] = []
        self._n = 0

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
        self.lines.append(f"{c} = arith.constant {_float_literal(value)} : {dtype}")
        v = TValue(self.fresh(), shape, dtype)
        self.lines.append(f"{v.name} = linalg.fill ins({c} : {dtype}) outs({e.name} : {e.type}) -> {v.type}")
        return v

    def generic(self, inputs: Sequence[TValue], maps: Sequence[str], init: TValue, iterators: Sequence[str],
                body: Callable[[list[str], BodyWriter], str]) -> TValue:
        out = TValue(self.fresh(), init.shape, init.dtype)
        w = BodyWriter(self, init.dtype)
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

    def elementwise(self, operands: Sequence[Operand], fn: Callable[[list[str], BodyWriter], str],
                    dtype: str | None = None, shape: tuple[int, ...] | None = None) -> TValue:
        """Broadcasting elementwise op; float operands become constants in the body."""
        tensors = [o for o in operands if isinstance(o, TValue)]
        out_shape = shape if shape is not None else tuple(torch.broadcast_shapes(*(t.shape for t in tensors)))
        out_dtype = dtype or (tensors[0].dtype if tensors else "f32")
        rank = len(out_shape)
        maps = []
        for t in tensors:
            lead = rank - len(t.shape)
            maps.append(_affine(rank, ["0" if (s == 1 and out_shape[lead + i] != 1) else f"d{lead + i}"
                                       for i, s in enumerate(t.shape)]))
        maps.append(_affine(rank, [f"d{i}" for i in range(rank)]))
        init = self.empty(out_shape, out_dtype)

        def body(args: list[str], w: BodyWriter) -> str:
            it = iter(args)
            vals = []
            for o in operands:
                if isinstance(o, TValue):
                    vals.append(w.cast(next(it), o.dtype, "f32"))
                else:
                    vals.append(w.const(float(o), "f32"))
            w.dtype = "f32"
            r = fn(vals, w)
            return w.cast(r, "f32", out_dtype)

        return self.generic(tensors, maps, init, ["parallel"] * rank, body)

    def reduce_last(self, x: TValue, kind: str, keepdim: bool) -> TValue:
        """sum or max over the last dim (f32 accumulation)."""
        rank = len(x.shape)
        identity = 0.0 if kind == "sum" else -math.inf
        init = self.fill(identity, x.shape[:-1], "f32")
        op = "arith.addf" if kind == "sum" else "arith.maximumf"

        def body(args: list[str], w: BodyWriter) -> str:
            return w.op(op, w.cast(args[0], x.dtype, "f32"), args[1], dtype="f32")

        maps = [_affine(rank, [f"d{i}" for i in range(rank)]), _affine(rank, [f"d{i}" for i in range(rank - 1)])]
        r = self.generic([x], maps, init, ["parallel"] * (rank - 1) + ["reduction"], body)
        return self.reshape(r, (*x.shape[:-1], 1)) if keepdim else r

    def copy_map(self, x: TValue, shape: tuple[int, ...], results: list[str]) -> TValue:
        """out[d...] = x[results(d...)]: permutations and broadcasts, as a fusable copy."""
        rank = len(shape)
        init = self.empty(shape, x.dtype)
        maps = [_affine(rank, results), _affine(rank, [f"d{i}" for i in range(rank)])]
        return self.generic([x], maps, init, ["parallel"] * rank, lambda a, w: a[0])

    def reshape(self, x: TValue, shape: tuple[int, ...]) -> TValue:
        shape = tuple(int(s) for s in shape)
        if shape == x.shape:
            return x
        flat = x
        if len(x.shape) != 1:
            flat = TValue(self.fresh(), (math.prod(x.shape),), x.dtype)
            groups = f"[[{', '.join(str(i) for i in range(len(x.shape)))}]]" if x.shape else "[]"
            self.lines.append(f"{flat.name} = tensor.collapse_shape {x.name} {groups} : {x.type} into {flat.type}")
        if len(shape) == 1:
            return flat
        out = TValue(self.fresh(), shape, x.dtype)
        groups = f"[[{', '.join(str(i) for i in range(len(shape)))}]]" if shape else "[]"
        dims = ", ".join(str(s) for s in shape)
        self.lines.append(f"{out.name} = tensor.expand_shape {flat.name} {groups} output_shape [{dims}] : "
                          f"{flat.type} into {out.type}")
        return out

    def matmul(self, a: TValue, b: TValue, out_dtype: str) -> TValue:
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
        sig = ", ".join(f"{a.name}: {a.type}" for a in args)
        rtypes = ", ".join(r.type for r in results)
        body = "\n".join("    " + ln for ln in self.lines)
        rets = ", ".join(r.name for r in results)
        return (f"module {{\n  func.func @main({sig}) -> ({rtypes}) {{\n{body}\n"
                f"    return {rets} : {rtypes}\n  }}\n}}\n")


def emit_module(gm: torch.fx.GraphModule, example_inputs: Sequence[torch.Tensor]) -> tuple[str, list[TValue],
                                                                                           list[TValue]]:
    """Returns (module text, argument values, result values) for the graph."""
    from codegen.fx_ops import lower_node  # the per-op table

    e = MlirEmitter()
    env: dict[torch.fx.Node, object] = {}
    args: list[TValue] = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node, example in zip(placeholders, example_inputs, strict=True):
        if example.dtype not in DTYPES:
            raise UnsupportedOp(f"input {node.name}: dtype {example.dtype} (supported: float32, bfloat16)")
        v = TValue(f"%arg{len(args)}", tuple(example.shape), DTYPES[example.dtype])
        args.append(v)
        env[node] = v
    results: list[TValue] = []
    for node in gm.graph.nodes:
        if node.op in ("call_function",):
            if node.target is operator.getitem:
                env[node] = env[node.args[0]][node.args[1]]  # type: ignore[index]
                continue
            env[node] = lower_node(e, node, env)
        elif node.op == "output":
            outs = node.args[0] if isinstance(node.args[0], (tuple, list)) else [node.args[0]]
            for o in outs:
                v = env[o]
                if not isinstance(v, TValue):
                    raise UnsupportedOp(f"output {o}: not a tensor")
                results.append(v)
        elif node.op != "placeholder":
            raise UnsupportedOp(f"FX node {node.name}: op kind {node.op} (call_module: lower FusedKernel "
                                f"submodules by inlining them first)")
    return e.module(args, results), args, results
