"""Symbolic sizes as padded static programs: `mask_padding` (once per graph) and `specialize` (per bucket).

A graph with symbolic sizes (dynamo's SymInts) compiles, per bucket of its symbols' values, into an
ordinary static program in which every dim of symbolic size e(s) is padded to e(B), B the bucket's bound
of s (`choose_bounds`: the next power of two, at least MIN_BOUND, two an octave above FINE_BUCKETS_ABOVE, at
most the symbol's declared maximum).
The real sizes are runtime values: one 0-d int64 input per size expression (`DynamicPlan.valid_exprs`,
computed on the host at each call), so one program serves every size of its bucket.

Invariant (the padded layout): every tensor holds its real value at the origin, each dim of symbolic size
e(s) padded at its end, the padding arbitrary (NaN, inf). Elementwise ops, views that keep a padded dim
leading within its group of merged dims, slices with a static start, prefix scans and gathers keep it.
Before `mask_padding` the graph is AOT's core-ATen graph with symbolic metas; after it, every op that
could observe padding reads it through a select `where(iota < valid_len, x, neutral)`:
- reductions and scans over a padded dim that are not prefix-safe (sum, mean, amax, any, softmax, ...):
  the neutral element of the reduction; a mean divides by the valid count, not the bound;
- contractions over a padded dim (mm, bmm, addmm): both operands with 0 (0 * NaN garbage is NaN);
- index tensors: their padded positions index 0, and a negative index into a padded dim is wrapped with
  the valid length (torch counts it from the real end, the program would count from the bound);
- a symbolic size used as a value (`arange + past`, `x * s`): the runtime value, not the bound.
Anything else that reads a padded dim (sort, flip, a cat or slice at a symbolic offset, ...) raises
CtpuDynamicShapeError naming the node: the graph then runs on the CPU, counted. Never a guess.

Interleaved dims: a view that merges dims with a padded one inside ([b, s, h] -> [b * s, h], a linear
layer's input at batch > 1, b static or padded too) gives a dim whose padding is interleaved (each of
the b runs of s has its own padded tail), not at its end. Ops that treat such a dim as independent rows
keep it: elementwise ops, copies, a matmul's M dim, reductions and softmax over other dims; the view
that splits it back into the same dims restores the padded layout. Anything else on an interleaved dim
(a reduction over it, an index, a graph output) is refused.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, Node

from .errors import CtpuDynamicShapeError
from .graph_utils import is_call, op_arg, refresh_meta, val

aten = torch.ops.aten
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)
MIN_BOUND = 16  # the smallest bucket: sizes 2 .. 16 share one program
# above this size, buckets come two an octave (384, 512, 768, 1024, ...): attention's cost grows with the
# square of its padded length, and at one an octave 300 tokens ran 1.11x its static program's cycles
FINE_BUCKETS_ABOVE = 256
DEFAULT_MAX = 1 << 16  # a symbol without a declared maximum
# node.meta key: {dim (negative, from the last): name of the placeholder holding its valid length} for each
# padded dim of the node's value whose padding nothing reads (the invariant): the back end may leave those
# positions unwritten (codegen/compiler.py reads it under the same name: codegen never imports fx_passes)
PADDING_META = "ctpu_padding"


def expr_of(size: Any) -> sympy.Expr:
    """A size (int or SymInt) as a sympy expression."""
    return size.node.expr if isinstance(size, _SYMBOLIC) else sympy.Integer(int(size))


def is_dynamic(gm: GraphModule) -> bool:
    """Does any node of gm have a symbolic value or size?"""
    for node in gm.graph.nodes:
        values = val(node)
        for item in values if isinstance(values, (tuple, list)) else (values,):
            sizes = tuple(item.shape) if isinstance(item, torch.Tensor) else (item,)
            if any(isinstance(s, _SYMBOLIC) for s in sizes):
                return True
    return False


@dataclass
class DynamicPlan:
    """What the runtime needs to call the variants of a masked graph.

    symbols: every free symbol, sorted by name; ranges: each symbol's (min, max or None) from the ShapeEnv;
    guards: the ShapeEnv's guards, checked at a bucket's bounds; valid_exprs: one trailing int64 0-d
    input each, in order; sym_inputs: placeholder index -> its symbolic value (a SymInt input);
    input_shapes / output_shapes: sympy sizes of tensor placeholders / outputs (None: not a tensor);
    sym_outputs: output index -> the expression the host evaluates (a symbolic size returned)."""

    symbols: tuple[sympy.Symbol, ...] = ()
    ranges: dict[sympy.Symbol, tuple[int, int | None]] = field(default_factory=dict)
    guards: tuple[sympy.Expr, ...] = ()
    valid_exprs: list[sympy.Expr] = field(default_factory=list)
    sym_inputs: dict[int, sympy.Expr] = field(default_factory=dict)
    input_shapes: list[tuple[sympy.Expr, ...] | None] = field(default_factory=list)
    output_shapes: list[tuple[sympy.Expr, ...] | None] = field(default_factory=list)
    sym_outputs: dict[int, sympy.Expr] = field(default_factory=dict)
    mutated_inputs: list[int] = field(default_factory=list)  # placeholder indices written by a copy_
    dim_exprs: set[sympy.Expr] = field(default_factory=set)  # every symbolic size: none may shrink when padded
    host_views: dict[int, HostView] = field(default_factory=dict)  # output index -> views the host replays


CHAIN = "<the previous value of a view chain>"  # the tensor argument of a HostView step


@dataclass(frozen=True)
class HostView:
    """An output that is a chain of views of a graph input or of another output, replayed on the host on
    the real tensor. AOT gives an output aliasing an input (or an intermediate it returns) the storage
    offset and strides of what the backend returns whenever the views have symbolic arguments
    (`x.select(0, i)`, `x[:, :n]`, `x.view(s, 4)`); a fresh padded program output has neither.

    root: ("input", placeholder index) or ("output", output index); steps: (op, args, kwargs) in order,
    CHAIN standing for the previous value and sympy expressions for symbolic sizes."""

    root: tuple[str, int]
    steps: tuple[tuple[Any, tuple[Any, ...], dict[str, Any]], ...]

    def replay(self, base: torch.Tensor, values: Mapping[sympy.Symbol, int]) -> Any:
        def concrete(arg: Any, previous: Any) -> Any:
            if isinstance(arg, (list, tuple)):
                return type(arg)(concrete(a, previous) for a in arg)
            if isinstance(arg, str) and arg == CHAIN:
                return previous
            return evaluate(arg, values) if isinstance(arg, sympy.Expr) else arg

        value: Any = base
        for op, args, kwargs in self.steps:
            value = op(*concrete(args, value), **{k: concrete(v, value) for k, v in kwargs.items()})
        return value


def evaluate(expr: sympy.Expr, values: Mapping[sympy.Symbol, int]) -> int:
    return int(expr.xreplace({s: sympy.Integer(v) for s, v in values.items()}))


def bucket_bound(value: int, minimum: int = MIN_BOUND) -> int:
    """The bucket of a size: the next power of two (at least `minimum`), or above FINE_BUCKETS_ABOVE the next
    of 2^k and 3 * 2^(k-1)."""
    power = max(1 << max(value - 1, 0).bit_length(), minimum)
    if power > FINE_BUCKETS_ABOVE and value <= power * 3 // 4:
        return power * 3 // 4
    return power


def choose_bounds(plan: DynamicPlan, values: Mapping[sympy.Symbol, int], minimum: int = MIN_BOUND,
                  default_max: int = DEFAULT_MAX) -> dict[sympy.Symbol, int]:
    """Each symbol's bucket bound (`bucket_bound` of its value), capped by its declared maximum; a value above
    that maximum raises CtpuDynamicShapeError. Where the bounds break a shape guard or make some padded size
    smaller than its real size, the values themselves (an unpadded variant)."""
    bounds = {}
    for sym in plan.symbols:
        value = values[sym]
        low, high = plan.ranges.get(sym, (0, None))
        cap = high if high is not None else default_max
        if value > cap:
            raise CtpuDynamicShapeError(f"size {sym} = {value} is above its bound {cap} "
                                        "(torch._dynamo.mark_dynamic(..., max=) or the option dynamic_max)")
        bounds[sym] = max(min(bucket_bound(value, minimum), cap), value, low)
    point = {s: sympy.Integer(v) for s, v in bounds.items()}
    if not all(bool(guard.xreplace(point)) for guard in plan.guards) or any(
            evaluate(e, bounds) < evaluate(e, values) for e in plan.dim_exprs):
        # A guard that the bounds break, or a size that shrinks as a symbol grows (20 - s): a program of
        # these exact sizes (no padding), which the guards and sizes of this call hold for.
        return {s: values[s] for s in plan.symbols}
    return bounds


# ---- the masking pass --------------------------------------------------------------------------------

_NEG, _POS = "-inf", "+inf"
# reduction -> the neutral element its input's padding is replaced with
_REDUCTIONS: dict[Any, Any] = {
    aten.sum.dim_IntList: 0, aten.sum.default: 0, aten.mean.dim: 0, aten.mean.default: 0,
    aten.prod.dim_int: 1, aten.prod.default: 1,
    aten.amax.default: _NEG, aten.amin.default: _POS, aten.max.dim: _NEG, aten.min.dim: _POS,
    aten.max.default: _NEG, aten.min.default: _POS, aten.argmax.default: _NEG, aten.argmin.default: _POS,
    aten.any.dim: False, aten.any.dims: False, aten.any.default: False,
    aten.all.dim: True, aten.all.dims: True, aten.all.default: True,
    aten._softmax.default: _NEG, aten._log_softmax.default: _NEG, aten.logsumexp.default: _NEG,
}
_CONTRACTIONS = {aten.mm.default: (1, 0), aten.bmm.default: (2, 1)}  # (dim of a, dim of b) contracted
_PREFIX_SAFE = {aten.cumsum.default, aten.cumprod.default, aten.tril.default, aten.triu.default}
_POSITIONAL = {  # ops that move no element along a padded dim (or whose special cases are checked below)
    aten.permute.default, aten.transpose.int, aten.t.default, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.clone.default, aten._to_copy.default, aten.alias.default,
    aten.detach.default, aten.lift_fresh_copy.default, aten.copy.default, aten.copy_.default,
    aten.full_like.default, aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
}
_CREATION = {aten.full.default, aten.zeros.default, aten.ones.default, aten.empty.memory_format,
             aten.empty_strided.default, aten.scalar_tensor.default, aten.new_zeros.default,
             aten.new_ones.default, aten.new_empty.default, aten.new_full.default}
_ARANGES = {aten.arange.default, aten.arange.start, aten.arange.start_step}
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
_SAME_DIMS = {aten.clone.default, aten._to_copy.default, aten.alias.default, aten.detach.default}  # keep every dim
# (op, argument) where a symbolic size means a size: at the bound in the padded program
_SIZE_ARGS = {(op, "size") for op in (*_VIEWS, aten.expand.default, aten.full.default, aten.zeros.default,
                                      aten.ones.default, aten.empty.memory_format, aten.empty_strided.default,
                                      aten.new_zeros.default, aten.new_ones.default, aten.new_empty.default,
                                      aten.new_full.default)}
_SIZE_ARGS |= {(aten.view.default, "size"), (aten.reshape.default, "shape"), (aten.empty_strided.default, "stride"),
               (aten.slice.Tensor, "end"), (aten.arange.default, "end"), (aten.arange.start, "end"),
               (aten.arange.start_step, "end")}
# (op, argument) where a symbolic position is handled by the op's rule in visit (or refused there)
_POSITION_ARGS = {(aten.slice.Tensor, "start"), (aten.select.int, "index")}
_ARITHMETIC = {"add", "sub", "mul", "div", "eq", "ne", "lt", "le", "gt", "ge", "remainder", "floor_divide",
               "maximum", "minimum"}
_DROPPED = {aten._assert_scalar.default, aten.sym_constrain_range_for_size.default,
            aten.sym_constrain_range.default, aten._assert_async.msg}


def _padded(value: Any) -> dict[int, sympy.Expr]:
    """dim -> valid length, for the symbolic dims of a tensor value."""
    if not isinstance(value, torch.Tensor):
        return {}
    return {d: expr_of(s) for d, s in enumerate(value.shape) if expr_of(s).free_symbols}


def _refuse(node: Node, why: str) -> CtpuDynamicShapeError:
    return CtpuDynamicShapeError(f"node {node.name} ({node.format_node()}): {why}; the graph runs on the CPU")


class _Masker:
    def __init__(self, gm: GraphModule, plan: DynamicPlan) -> None:
        self.gm, self.graph, self.plan = gm, gm.graph, plan
        self.valid: dict[sympy.Expr, Node] = {}
        self.interleaved: dict[Node, dict[int, tuple[sympy.Expr, ...]]] = {}  # node -> dim -> the dims merged
        self.masks: set[Node] = set()  # nodes whose padding holds a value (a neutral element) read downstream
        self.placeholders = list(self.graph.find_nodes(op="placeholder"))
        self.fake_mode = next((v.fake_mode for n in self.placeholders
                               if isinstance(v := val(n), torch.Tensor) and hasattr(v, "fake_mode")), None)

    def valid_len(self, expr: sympy.Expr) -> Node:
        """The trailing int64 0-d input holding expr's value at run time."""
        expr = sympy.simplify(expr)
        if expr not in self.valid:
            last = list(self.graph.find_nodes(op="placeholder"))[-1]
            with self.graph.inserting_after(last):
                node = self.graph.placeholder(f"valid_len_{len(self.valid)}")
            if self.fake_mode is not None:
                with self.fake_mode:
                    node.meta["val"] = torch.empty((), dtype=torch.int64)
            self.valid[expr] = node
            self.plan.valid_exprs.append(expr)
        return self.valid[expr]

    def call(self, target: Any, args: tuple, kwargs: dict | None = None, like: Any = None) -> Node:
        node = self.graph.call_function(target, args, kwargs or {})
        if like is not None:
            node.meta["val"] = like
        return node

    def iota(self, x: Node, dim: int) -> Node:
        """arange(size of x along dim), shaped to broadcast along dim of x (inserted where the graph is)."""
        value = val(x)
        size = self.call(aten.sym_size.int, (x, dim), like=value.shape[dim])
        iota = self.call(aten.arange.default, (size,), {"dtype": torch.int64, "device": value.device})
        shape = [size] + [1] * (value.dim() - dim - 1)
        return self.call(aten.view.default, (iota, shape)) if len(shape) > 1 else iota

    def mask(self, x: Node, dim: int, fill: Any, before: Node) -> Node:
        """where(iota(dim) < valid_len, x, fill): x with its padding along dim replaced by fill."""
        value = val(x)
        expr = expr_of(value.shape[dim])
        with self.graph.inserting_before(before):
            keep = self.call(aten.lt.Tensor, (self.iota(x, dim), self.valid_len(expr)))
            if value.dtype == torch.bool and fill in (False, _NEG):  # any(): and with the mask
                masked = self.call(aten.logical_and.default, (x, keep), like=value)
            elif value.dtype == torch.bool:  # all(): or with the mask's complement
                drop = self.call(aten.logical_not.default, (keep,))
                masked = self.call(aten.logical_or.default, (x, drop), like=value)
            else:
                if fill in (_NEG, _POS):
                    fill = _extreme(value.dtype, fill == _POS)
                neutral = self.call(aten.scalar_tensor.default, (fill,), {"dtype": value.dtype,
                                                                          "device": value.device})
                masked = self.call(aten.where.self, (keep, x, neutral), like=value)
        self.masks.add(masked)
        return masked

    def mark_padding(self) -> None:
        """PADDING_META on every node whose padding is at the end of its dims and read by nothing: all but
        the masks (their padding holds the neutral element a reduction or contraction reads) and nodes with
        interleaved padding. Valid lengths come from the placeholders the masks made, or a new one for a
        plain symbol."""
        for node in list(self.graph.nodes):
            value = val(node)
            if node.op != "call_function" or node in self.interleaved or node in self.masks:
                continue
            dims = {d - value.dim(): sympy.simplify(e) for d, e in _padded(value).items()}
            named = {d: self.valid_len(e).name for d, e in dims.items() if e in self.valid or e.is_Symbol}
            if named:
                node.meta[PADDING_META] = named

    def mask_dims(self, node: Node, arg: Node, dims: Any, fill: Any) -> None:
        """Replace node's input arg by arg masked along each of its padded dims in dims."""
        masked = arg
        for d in sorted(dims):
            if d in _padded(val(arg)):
                masked = self.mask(masked, d, fill, node)
        if masked is not arg:
            node.replace_input_with(arg, masked)

    def run(self) -> None:
        for node in list(self.graph.nodes):
            if node.op == "call_function":
                self.visit(node)
            elif node.op == "output":
                for r in node.all_input_nodes:
                    if r in self.interleaved:
                        raise _refuse(r, "a graph output with interleaved padding (a merged batch and padded dim)")

    def visit(self, node: Node) -> None:
        if isinstance(val(node), _SYMBOLIC) or node.target in _DROPPED:
            return  # size arithmetic: evaluated at the bounds (or on the host for outputs)
        if not isinstance(node.target, torch._ops.OpOverload):
            if node.target is operator.getitem:
                if node.args[0] in self.interleaved:
                    raise _refuse(node, "an item of an op over an interleaved dim")
                return
            raise _refuse(node, "a call of a non-ATen function on symbolic sizes")
        self.runtime_values(node)
        if any(n in self.interleaved for n in node.all_input_nodes):
            self.visit_interleaved(node)
            return
        inputs = [n for n in node.all_input_nodes if isinstance(val(n), torch.Tensor)]
        padded_in = any(_padded(val(n)) for n in inputs)
        target = node.target
        if target in _REDUCTIONS:
            self.reduction(node)
        elif target in _CONTRACTIONS:
            a, b = node.args[0], node.args[1]
            da, db = _CONTRACTIONS[target]
            if da in _padded(val(a)):
                self.mask_dims(node, a, [da], 0)
                self.mask_dims(node, b, [db], 0)
        elif target is aten.addmm.default:
            if 1 in _padded(val(node.args[1])):
                self.mask_dims(node, node.args[1], [1], 0)
                self.mask_dims(node, node.args[2], [0], 0)
        elif target in (aten.embedding.default, aten.index.Tensor, aten.gather.default, aten.index_select.default):
            self.indexing(node)
        elif target in _VIEWS:
            self.check_view(node)
        elif target is aten.expand.default:
            src, out = _padded(val(node.args[0])), _padded(val(node))
            offset = val(node).dim() - val(node.args[0]).dim()
            if any(out.get(d + offset) != e for d, e in src.items()):
                raise _refuse(node, "an expand of a padded dim")
        elif target is aten.slice.Tensor:
            dim = op_arg(node, "dim") % val(node.args[0]).dim()
            start = op_arg(node, "start")
            if dim in _padded(val(node.args[0])) and not (start is None or (isinstance(start, int) and start >= 0)):
                if expr_of(val(node).shape[dim]) != 1 or op_arg(node, "step") != 1:
                    raise _refuse(node, "a slice of a padded dim at a negative or symbolic start (longer than 1)")
                self.pick(node, dim, start, keepdim=True)
                return
            if isinstance(start, Node):
                raise _refuse(node, "a slice of a static dim at a symbolic start")
            if op_arg(node, "step") != 1 and dim in _padded(val(node)):
                raise _refuse(node, "a strided slice of a padded dim")
        elif target is aten.select.int:
            dim, index = op_arg(node, "dim") % val(node.args[0]).dim(), op_arg(node, "index")
            if dim in _padded(val(node.args[0])) and not (isinstance(index, int) and index >= 0):
                self.pick(node, dim, index, keepdim=False)
                return
            if isinstance(index, Node):
                raise _refuse(node, "a select of a static dim at a symbolic index")
        elif target is aten.cat.default:
            tensors, dim = node.args[0], op_arg(node, "dim") % val(node).dim()
            if any(dim in _padded(val(t)) for t in tensors[:-1]):
                if len(tensors) != 2 or expr_of(val(tensors[1]).shape[dim]) != 1:
                    raise _refuse(node, "a cat after an operand of symbolic size (its runtime offset), other than "
                                        "cat([x, one row]) (a KV cache's append)")
                self.append_row(node, dim)
        elif target is aten.constant_pad_nd.default:
            pad = list(op_arg(node, "pad"))
            padded = _padded(val(node.args[0]))
            rank = val(node).dim()
            if any(rank - 1 - i // 2 in padded and i % 2 == 1 and pad[i] != 0 for i in range(len(pad))):
                raise _refuse(node, "a pad after the end of a padded dim")
        elif target is aten.repeat.default:
            reps = list(node.args[1])
            offset = len(reps) - val(node.args[0]).dim()
            if any(reps[d + offset] != 1 for d in _padded(val(node.args[0]))):
                raise _refuse(node, "a repeat along a padded dim")
        elif target in _ARANGES or target in _CREATION or target in _POSITIONAL or target in _PREFIX_SAFE:
            pass
        elif torch.Tag.pointwise in target.tags:
            pass
        elif padded_in or _padded(val(node)):
            raise _refuse(node, f"{target} is not known to keep padded elements unobservable")

    def pick(self, node: Node, dim: int, index: Any, keepdim: bool) -> None:
        """x[index] along a padded dim, index negative (from the real end) or symbolic: the one element at
        the runtime position r, as amax(where(iota == r, x, lowest)) over dim: exact (max(v, -inf) is v,
        -0.0 and NaN included)."""
        x = node.args[0]
        value, length = val(x), expr_of(val(x).shape[dim])
        real = length + index if isinstance(index, int) else expr_of(val(index))
        if not isinstance(index, int) and not isinstance(val(index), torch.SymInt):
            raise _refuse(node, "a select or slice at a non-integer position")
        if not isinstance(index, int):  # torch counts a negative symbolic index from the end too
            real = sympy.Piecewise((real + length, real < 0), (real, True))
        fill = _extreme(value.dtype, False)
        with self.graph.inserting_before(node):
            at = self.call(aten.eq.Tensor, (self.iota(x, dim), self.valid_len(real)))
            if value.dtype == torch.bool:
                chosen = self.call(aten.logical_and.default, (x, at), like=value)
                out = self.call(aten.any.dim, (chosen, dim, keepdim), like=val(node))
            else:
                lowest = self.call(aten.scalar_tensor.default, (fill,), {"dtype": value.dtype, "device": value.device})
                chosen = self.call(aten.where.self, (at, x, lowest), like=value)
                out = self.call(aten.amax.default, (chosen, [dim], keepdim), like=val(node))
            self.masks.add(chosen)
        node.replace_all_uses_with(out)
        self.graph.erase_node(node)

    def append_row(self, node: Node, dim: int) -> None:
        """cat([x, row]) along a padded dim of x (valid length n): the row belongs at n, not at x's bound:
        where(iota < n, cat, row) puts it there (and repeats it over the padding)."""
        x, row = node.args[0]
        users = list(node.users)
        valid = self.valid_len(expr_of(val(x).shape[dim]))
        with self.graph.inserting_before(node.next):  # in order, after the cat
            keep = self.call(aten.lt.Tensor, (self.iota(node, dim), valid))
            out = self.call(aten.where.self, (keep, node, row), like=val(node))
        for user in users:
            user.replace_input_with(node, out)

    def reduction(self, node: Node) -> None:
        x = node.args[0]
        rank = val(x).dim()
        dims = _reduced_dims(node, rank)
        padded = [d for d in dims if d in _padded(val(x))]
        if not padded:
            return
        if node.target in (aten.argmax.default, aten.argmin.default) and op_arg(node, "dim") is None:
            raise _refuse(node, "a flat index over a padded tensor")
        self.mask_dims(node, x, padded, _REDUCTIONS[node.target])
        if node.target in (aten.mean.dim, aten.mean.default):
            count = math.prod(expr_of(val(x).shape[d]) for d in dims)
            keepdim = node.target is aten.mean.dim and bool(op_arg(node, "keepdim"))
            dtype = op_arg(node, "dtype")
            with self.graph.inserting_after(node):
                total = self.call(aten.sum.dim_IntList, (node.args[0], list(dims), keepdim),
                                  {"dtype": dtype} if dtype is not None else {}, like=val(node))
            with self.graph.inserting_after(total):
                mean = self.call(aten.div.Tensor, (total, self.valid_len(count)), like=val(node))
            node.replace_all_uses_with(mean)
            self.graph.erase_node(node)

    def indexing(self, node: Node) -> None:
        """Index tensors: padded positions index 0; negative indices into a padded dim wrap at the valid length."""
        src = _padded(val(node.args[0]))
        if node.target is aten.embedding.default:
            self.mask_dims(node, node.args[1], _padded(val(node.args[1])), 0)
            return
        if node.target is aten.index.Tensor:
            node = self.drop_zero_index(node)
            if node.target is not aten.index.Tensor:
                return  # an identity gather became a view
            src = _padded(val(node.args[0]))
            pairs = [(d, i) for d, i in enumerate(node.args[1]) if isinstance(i, Node)]
        else:
            pairs = [(op_arg(node, "dim") % val(node.args[0]).dim(), node.args[2])]
        for dim, idx in pairs:
            end = _arange_end(idx)
            if end is not None and (end == expr_of(val(node.args[0]).shape[dim]) or not end.free_symbols):
                continue  # values 0 .. end - 1 at every size: in range, never negative, padding included
            if val(idx).dtype == torch.bool:
                if _padded(val(idx)):
                    raise _refuse(node, "a boolean mask index with padded dims")
                continue
            fixed = idx
            with self.graph.inserting_before(node):
                if dim in src:
                    valid = self.valid_len(src[dim])
                    neg = self.call(aten.lt.Scalar, (fixed, 0))
                    wrapped = self.call(aten.add.Tensor, (fixed, valid))
                    fixed = self.call(aten.where.self, (neg, wrapped, fixed), like=val(idx))
            for d in sorted(_padded(val(idx))):
                fixed = self.mask(fixed, d, 0, node)
            if fixed is not idx:
                node.replace_input_with(idx, fixed)

    def drop_zero_index(self, node: Node) -> Node:
        """x[i0, i1, ...] with i0 = arange(0, 1) (all zeros, shape of ones, no more dims than i1): x[0][i1, ...].
        Hugging Face's mask builder indexes the batch dim so; codegen lowers one index tensor."""
        x, indices = node.args[0], list(node.args[1])
        if len(indices) < 2 or not all(isinstance(i, Node) for i in indices[:2]):
            return node
        first, rest = val(indices[0]), val(indices[1])
        if _arange_end(indices[0]) != 1 or any(s != 1 for s in first.shape) or first.dim() > rest.dim():
            return node
        if any(isinstance(i, Node) and val(i).dim() < rest.dim() for i in indices[1:]) or None in indices[1:]:
            return node
        with self.graph.inserting_before(node):
            row = self.call(aten.select.int, (x, 0, 0), like=val(x)[0])
            if len(indices) == 2 and val(x).dim() == 2 and _is_identity_index(indices[1], expr_of(val(x).shape[1])):
                sizes = [self.call(aten.sym_size.int, (indices[1], d), like=n) if isinstance(n, torch.SymInt)
                         else int(n) for d, n in enumerate(val(indices[1]).shape)]  # the result's shape
                new = self.call(aten.view.default, (row, sizes), like=val(node))
                node.replace_all_uses_with(new)
                self.graph.erase_node(node)
                return new
            if val(x).dim() == 2 and len(indices) == 2:  # codegen gathers rows of a 2-D tensor: x[0][:, None]
                column = self.call(aten.unsqueeze.default, (row, 1), like=val(x)[0][:, None])
                flat = self.call(aten.view.default, (indices[1], [-1]), like=val(indices[1]).reshape(-1))
                rows = self.call(aten.index.Tensor, (column, [flat]), like=val(node).reshape(-1, 1))
                sizes = [self.call(aten.sym_size.int, (indices[1], d), like=n) if isinstance(n, torch.SymInt)
                         else int(n) for d, n in enumerate(val(indices[1]).shape)]  # the result's shape
                new = self.call(aten.view.default, (rows, sizes), like=val(node))
            else:
                new = rows = self.call(aten.index.Tensor, (row, indices[1:]), like=val(node))
        node.replace_all_uses_with(new)
        self.graph.erase_node(node)
        return rows

    def check_view(self, node: Node) -> None:
        """A view keeps the layout when, in each group of dims it merges or splits, only the group's
        outermost dim of size > 1 is symbolic (row-major offsets then agree between real and padded). Any
        other group merged into one dim makes it interleaved; a group that splits an interleaved dim back
        into the dims it merged restores the layout."""
        src = [expr_of(s) for s in val(node.args[0]).shape]
        out = [expr_of(s) for s in val(node).shape]
        if not any(e.free_symbols for e in (*src, *out)):
            return
        inter = self.interleaved.get(node.args[0], {})
        made: dict[int, tuple[sympy.Expr, ...]] = {}
        i = j = 0
        for group_src, group_out in _groups(src, out):
            src_dims, out_dims = range(i, i + len(group_src)), range(j, j + len(group_out))
            i, j = i + len(group_src), j + len(group_out)
            big_src = [e for e in group_src if e != 1]
            big_out = [(d, e) for d, e in zip(out_dims, group_out, strict=True) if e != 1]
            merged = [inter[d] for d in src_dims if d in inter]
            if merged:  # an interleaved dim: kept as it is, or split back into the dims it merged
                if len(big_out) == 1 and big_src == [big_out[0][1]]:
                    made[big_out[0][0]] = merged[0]
                    continue
                if len(big_src) == 1 and tuple(e for _, e in big_out) == merged[0]:
                    continue
                raise _refuse(node, f"a view of an interleaved dim {group_src} -> {group_out} other than back "
                                    f"into {list(merged[0])}")
            if not any(e.free_symbols for e in big_src[1:]) and not any(e.free_symbols for _, e in big_out[1:]):
                continue
            if len(big_out) == 1:
                made[big_out[0][0]] = tuple(big_src)  # dims merged, padded ones among the inner ones
                continue
            raise _refuse(node, f"a view that merges or splits padded dims {group_src} -> {group_out}")
        if made:
            self.interleaved[node] = made

    def visit_interleaved(self, node: Node) -> None:
        """An op with an operand that has an interleaved dim: allowed where the dim is only a row index."""
        target, value = node.target, val(node)
        rank = value.dim() if isinstance(value, torch.Tensor) else 0
        if target in _VIEWS:
            self.check_view(node)
            return
        out: dict[int, tuple[sympy.Expr, ...]] = {}
        if target in _CONTRACTIONS or target is aten.addmm.default:
            a, b = (node.args[1], node.args[2]) if target is aten.addmm.default else node.args[:2]
            m = val(a).dim() - 2  # the M dim (batch dims of a bmm included in none)
            inter_a = self.interleaved.get(a, {})
            if b in self.interleaved or set(inter_a) != {m} or (target is aten.addmm.default
                                                               and node.args[0] in self.interleaved):
                raise _refuse(node, "a matmul over an interleaved dim other than its rows")
            out = {rank - 2: inter_a[m]}
        elif target in _REDUCTIONS:
            x = node.args[0]
            inter = self.interleaved.get(x, {})
            dims = _reduced_dims(node, val(x).dim())
            if set(dims) & set(inter) or any(n in self.interleaved for n in node.all_input_nodes if n is not x):
                raise _refuse(node, "a reduction over an interleaved dim")
            self.reduction(node)  # masks its padded reduced dims, none of them interleaved
            keeps = target in (aten._softmax.default, aten._log_softmax.default) or bool(op_arg(node, "keepdim"))
            out = {d if keeps else d - sum(r < d for r in dims): e for d, e in inter.items()}
        elif torch.Tag.pointwise in target.tags or target in _SAME_DIMS:
            for n in node.all_input_nodes:  # operands broadcast right-aligned: their layouts must agree
                v = val(n)
                if not isinstance(v, torch.Tensor):
                    continue
                inter = self.interleaved.get(n, {})
                for d in range(v.dim()):
                    o = d + rank - v.dim()
                    if inter.get(d) is not None:
                        if out.get(o, inter[d]) != inter[d]:
                            raise _refuse(node, "operands interleaved differently")
                        out[o] = inter[d]
            for n in node.all_input_nodes:
                v = val(n)
                if isinstance(v, torch.Tensor):
                    inter = self.interleaved.get(n, {})
                    for d, size in enumerate(v.shape):
                        if d + rank - v.dim() in out and d not in inter and expr_of(size) != 1:
                            raise _refuse(node, "an operand with interleaved padding beside one without")
        else:
            raise _refuse(node, f"{target} on an interleaved dim (a merged batch and padded dim)")
        if out:
            self.interleaved[node] = out

    def runtime_values(self, node: Node) -> None:
        """A symbolic size used as a value (not a size) reads its runtime value."""
        schema = node.target._schema
        for i, arg in enumerate(schema.arguments):
            value = op_arg(node, arg.name)
            items = value if isinstance(value, (list, tuple)) else [value]
            sym = [n for n in items if isinstance(n, Node) and isinstance(val(n), _SYMBOLIC)]
            if not sym or (node.target, arg.name) in _SIZE_ARGS | _POSITION_ARGS:
                continue
            if node.target in _ARANGES and arg.name == "start":
                self.arange_from(node)
                return
            arithmetic = node.target.overloadpacket.__name__ in _ARITHMETIC
            overload = getattr(node.target.overloadpacket, "Tensor", None) if arithmetic else None
            if overload is None or i > 1 or not isinstance(value, Node) or not isinstance(val(value), torch.SymInt):
                raise _refuse(node, f"the symbolic {arg.name} = {val(sym[0])} is used as a value")
            runtime = self.valid_len(expr_of(val(value)))
            args = list(node.args)
            args[i] = runtime
            node.args = tuple(args)
            node.target = overload
            expected = val(node)
            other = val(node.args[1 - i]) if isinstance(node.args[1 - i], Node) else None
            if isinstance(expected, torch.Tensor) and isinstance(other, torch.Tensor) and other.dim() == 0:
                raise _refuse(node, "a symbolic size combined with a 0-d tensor (type promotion would change)")

    def arange_from(self, node: Node) -> None:
        """arange(start, end, step) with a symbolic start: arange(0, length * step, step) + start at run time."""
        start = op_arg(node, "start")
        step = op_arg(node, "step") if node.target is aten.arange.start_step else 1
        if not isinstance(step, int) or step <= 0 or not isinstance(val(start), torch.SymInt):
            raise _refuse(node, "an arange with a symbolic start and a non-constant step")
        value = val(node)
        with self.graph.inserting_after(node):
            size = self.call(aten.sym_size.int, (node, 0), like=value.shape[0])
        with self.graph.inserting_after(size):
            stop = self.call(operator.mul, (size, step), like=value.shape[0] * step)
        with self.graph.inserting_after(stop):
            kwargs = {k: v for k, v in node.kwargs.items() if k in ("dtype", "device", "layout", "pin_memory")}
            zero_based = self.call(aten.arange.start_step, (0, stop, step), kwargs, like=value)
        with self.graph.inserting_after(zero_based):
            shifted = self.call(aten.add.Tensor, (zero_based, self.valid_len(expr_of(val(start)))), like=value)
        node.replace_all_uses_with(shifted, delete_user_cb=lambda user: user is not size)


_SHAPE_ONLY = {aten.unsqueeze.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
               aten.expand.default, aten.permute.default, aten.clone.default, aten.alias.default,
               aten.squeeze.dim, aten.squeeze.dims}


_ROW_MAJOR = {aten.unsqueeze.default, aten.view.default, aten._unsafe_view.default, aten.clone.default}


def _is_full_slice(node: Node) -> bool:
    """slice(x, d, 0, end >= size, 1): x itself."""
    return (is_call(node, aten.slice.Tensor) and op_arg(node, "start") in (0, None) and op_arg(node, "step") == 1
            and [expr_of(n) for n in val(node).shape] == [expr_of(n) for n in val(node.args[0]).shape])


def _is_passthrough(node: Node, ops: set[Any]) -> bool:
    return is_call(node, *ops) or _is_full_slice(node) or (
        is_call(node, aten.add.Tensor, aten.sub.Tensor) and node.args[1] == 0)


def _arange_end(idx: Node) -> sympy.Expr | None:
    """end when idx is arange(0, end) seen through shape-only ops (its values 0 .. end - 1), else None."""
    while _is_passthrough(idx, _SHAPE_ONLY):
        idx = idx.args[0]  # type: ignore[assignment]
    if not is_call(idx, *_ARANGES):
        return None
    start = op_arg(idx, "start") if idx.target is not aten.arange.default else 0
    step = op_arg(idx, "step") if idx.target is aten.arange.start_step else 1
    if start != 0 or step != 1:
        return None
    return expr_of(val(idx).shape[0])


def _finite(bound: Any) -> int | None:
    """A value range's bound as an int, None when infinite (sympy's oo or torch's int_oo)."""
    try:
        return int(bound)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None


def _is_identity_index(idx: Node, size: sympy.Expr) -> bool:
    """idx holds 0 .. size - 1 in row-major order: arange(0, size) through unsqueezes and views only."""
    numel = math.prod(expr_of(n) for n in val(idx).shape)
    while _is_passthrough(idx, _ROW_MAJOR):
        idx = idx.args[0]  # type: ignore[assignment]
    return _arange_end(idx) == size and sympy.simplify(numel - size) == 0 and is_call(idx, *_ARANGES)


def _extreme(dtype: torch.dtype, high: bool) -> float | int | bool:
    if dtype.is_floating_point:
        return math.inf if high else -math.inf
    if dtype == torch.bool:
        return high
    info = torch.iinfo(dtype)
    return info.max if high else info.min


def _reduced_dims(node: Node, rank: int) -> list[int]:
    names = [a.name for a in node.target._schema.arguments]
    dims = op_arg(node, "dim") if "dim" in names else None
    if dims is None or dims == []:
        return list(range(rank))
    dims = dims if isinstance(dims, (list, tuple)) else [dims]
    return sorted({d % max(rank, 1) for d in dims})


def _groups(src: list[sympy.Expr], out: list[sympy.Expr]) -> list[tuple[list[sympy.Expr], list[sympy.Expr]]]:
    """Split two shapes of equal numel into minimal groups of equal products (compared at a generic point:
    every symbol a distinct large prime)."""
    symbols = sorted(set().union(*(e.free_symbols for e in (*src, *out))), key=str)
    point = {s: sympy.Integer(p) for s, p in zip(symbols, (1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049),
                                                    strict=False)}
    a = [int(e.xreplace(point)) for e in src]
    b = [int(e.xreplace(point)) for e in out]
    groups, i, j = [], 0, 0
    while i < len(a) or j < len(b):
        gs: list[sympy.Expr] = []
        go: list[sympy.Expr] = []
        ps = po = 1
        while i < len(a) or j < len(b):
            if (ps <= po or j >= len(b)) and i < len(a):
                gs.append(src[i])
                ps *= a[i]
                i += 1
            else:
                go.append(out[j])
                po *= b[j]
                j += 1
            if ps == po and gs and go:
                break
        groups.append((gs, go))
    return groups


def _is_view(node: Node) -> bool:
    """An ATen op whose result aliases its first argument (its schema says so), or getitem of one."""
    if is_call(node, operator.getitem):
        return isinstance(node.args[0], Node) and _is_view(node.args[0])
    if not is_call(node) or not isinstance(node.target, torch._ops.OpOverload):
        return False
    returns = node.target._schema.returns
    return bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write


def _host_view(out: Any, placeholders: list[Node], results: Any) -> HostView | None:
    """out as views of a placeholder or of another output (HostView), or None when it is no such chain."""
    chain: list[Node] = []
    node = out
    while isinstance(node, Node) and _is_view(node):
        chain.append(node)
        node = node.args[0]
    if not chain or not isinstance(val(node), torch.Tensor):
        return None
    if node in placeholders:
        root = ("input", placeholders.index(node))
    elif node in results:
        root = ("output", list(results).index(node))
    else:
        return None

    def plain(arg: Any, previous: Node) -> Any:
        if isinstance(arg, (list, tuple)):
            return type(arg)(plain(a, previous) for a in arg)
        if arg is previous:
            return CHAIN
        if isinstance(arg, Node):
            if not isinstance(val(arg), torch.SymInt):
                raise _refuse(arg, "a view of an output with a tensor argument")
            return expr_of(val(arg))
        return arg

    steps = []
    for step in reversed(chain):
        previous = step.args[0]
        steps.append((step.target, plain(step.args, previous),
                      {k: plain(v, previous) for k, v in step.kwargs.items()}))
    return HostView(root, tuple(steps))


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A copy of gm with its own graph (node metas shared shallowly)."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    return GraphModule(gm, graph)


def mask_padding(gm: GraphModule) -> DynamicPlan:
    """Rewrite gm (with symbolic metas) in place so that padding is unobservable (module docstring);
    returns the plan the runtime calls its variants with. Raises CtpuDynamicShapeError naming a node it
    cannot prove safe, before the caller runs anything."""
    plan = DynamicPlan()
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    symbols: set[sympy.Symbol] = set()
    shape_env = None
    for node in gm.graph.nodes:
        values = val(node)
        for item in values if isinstance(values, (tuple, list)) else (values,):
            sizes = tuple(item.shape) if isinstance(item, torch.Tensor) else (item,)
            for s in sizes:
                if isinstance(s, _SYMBOLIC):
                    symbols |= s.node.expr.free_symbols
                    shape_env = s.node.shape_env
                    if isinstance(s, torch.SymInt) and isinstance(item, torch.Tensor):
                        plan.dim_exprs.add(s.node.expr)
    plan.symbols = tuple(sorted(symbols, key=str))
    for i, node in enumerate(placeholders):
        value = val(node)
        if isinstance(value, torch.SymInt):
            plan.sym_inputs[i] = expr_of(value)
        elif isinstance(value, _SYMBOLIC):
            raise _refuse(node, "a symbolic float or bool input")
        plan.input_shapes.append(tuple(expr_of(s) for s in value.shape) if isinstance(value, torch.Tensor) else None)
    bindable = {e for e in plan.sym_inputs.values() if isinstance(e, sympy.Symbol)}
    bindable |= {d for shape in plan.input_shapes if shape for d in shape if isinstance(d, sympy.Symbol)}
    if set(plan.symbols) - bindable:  # data-dependent sizes (item(), nonzero): no input tells their value
        raise CtpuDynamicShapeError(f"the sizes {sorted(map(str, set(plan.symbols) - bindable))} are no input's "
                                    "size (data-dependent); the graph runs on the CPU")
    if shape_env is not None:
        for sym in plan.symbols:
            vr = shape_env.var_to_range.get(sym)
            plan.ranges[sym] = (_finite(vr.lower) or 0, _finite(vr.upper)) if vr is not None else (0, None)
        plan.guards = tuple(g.expr for g in shape_env.guards if g.expr.free_symbols <= symbols)
    for node in gm.graph.nodes:
        if is_call(node, aten.copy_.default) and node.args[0] in placeholders:
            plan.mutated_inputs.append(placeholders.index(node.args[0]))
    output = next(iter(gm.graph.find_nodes(op="output")))
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    for i, r in enumerate(results):
        value = val(r) if isinstance(r, Node) else r
        if isinstance(value, _SYMBOLIC):
            plan.sym_outputs[i] = expr_of(value)
        plan.output_shapes.append(tuple(expr_of(s) for s in value.shape) if isinstance(value, torch.Tensor) else None)
    for i, r in enumerate(results):
        view = _host_view(r, placeholders, results) if i not in plan.sym_outputs else None
        if view is not None:
            plan.host_views[i] = view
    masker = _Masker(gm, plan)
    masker.run()
    masker.mark_padding()
    gm.graph.lint()
    gm.recompile()
    return plan


# ---- specialisation ----------------------------------------------------------------------------------

def specialize(gm: GraphModule, plan: DynamicPlan, bounds: Mapping[sympy.Symbol, int]) -> GraphModule:
    """A static copy of the masked gm: every symbolic size at its bound, SymInt inputs and symbolic outputs
    removed (the runtime passes and returns those itself), fake metas of the padded shapes."""
    graph = copy_graph_module(gm).graph
    sym_values = {s: sympy.Integer(v) for s, v in bounds.items()}

    def at_bound(node: Node) -> Any:
        value = val(node)
        expr = value.node.expr.xreplace(sym_values)
        return bool(expr) if isinstance(value, torch.SymBool) else int(expr) if isinstance(
            value, torch.SymInt) else float(expr)

    output = next(iter(graph.find_nodes(op="output")))
    results = output.args[0]
    if isinstance(results, (tuple, list)):
        output.args = (tuple(r for i, r in enumerate(results) if i not in plan.sym_outputs
                             and i not in plan.host_views),)
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _DROPPED:
            graph.erase_node(node)
    for node in list(graph.nodes):
        if node.op in ("placeholder", "call_function") and isinstance(val(node), _SYMBOLIC):
            node.replace_all_uses_with(at_bound(node))  # type: ignore[arg-type]
    for node in reversed(list(graph.nodes)):
        if node.op in ("placeholder", "call_function") and isinstance(val(node), _SYMBOLIC) and not node.users:
            graph.erase_node(node)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
    with fake_mode:
        for node in graph.find_nodes(op="placeholder"):
            value = val(node)
            if isinstance(value, torch.Tensor):
                shape = [evaluate(expr_of(s), bounds) for s in value.shape]
                if _padded(value):
                    node.meta["val"] = torch.empty(shape, dtype=value.dtype, device=value.device)
                else:
                    node.meta["val"] = torch.empty_strided(shape, value.stride(), dtype=value.dtype,
                                                           device=value.device)
    graph.eliminate_dead_code()
    new = GraphModule(gm, graph)
    for node in new.graph.nodes:
        if node.op != "placeholder":
            node.meta.pop("val", None)
    refresh_meta(new, fake_mode)
    new.graph.lint()
    new.recompile()
    return new

