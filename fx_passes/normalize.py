"""Normalisation of the functional core-ATen graph that AOT autograd produces.

Before: a graph of `aot_module_simplified(..., decompositions=decomposition_table())` (decompositions.py;
functionalised), every node with a fake `meta["val"]`.

After (`normalize(gm)`):
- static shapes: no node carries a SymInt/SymFloat/SymBool (we specialise; a symbolic size raises
  CtpuDynamicShapeError naming the node, before anything is changed);
- no `alias`/`detach`, no `lift_fresh_copy`, and no `clone`/`_to_copy` that changes nothing (same dtype,
  device and strides), except where dropping the copy would let a graph output alias a graph input or
  constant;
- no no-op view (`view`/`expand` to the same shape, identity `permute`, full `slice`, `squeeze` of a
  non-1 dim); chains of `permute`s are folded into one. Chains of `view`s are kept: the intermediate
  shapes are what the linear pattern reads its [..., K] input from;
- `cat` has no zero-size operand (an empty KV cache) and at least two operands (one becomes its value,
  or a contiguous clone of it);
- no arithmetic identity that is exact (x * 1, x / 1 in any dtype; x + 0, x - 0 for integers);
- at most one `getitem` per (multi-output node, index), none unused;
- input mutations are trailing `copy_(placeholder, value)` nodes, kept explicit: after all other
  computation, just before the output (moved there when no later node reads the input).
The graph computes the same values as before; strides may differ only where no consumer depends on them.
"""

from __future__ import annotations

import operator
from collections import Counter

import torch
from torch.fx import GraphModule, Node

from .errors import CtpuDynamicShapeError, CtpuPassError
from .graph_utils import dtype, is_call, number, op_arg, refresh_meta, shape, tensor_val, val
from .op_sets import VIEW_OPS
from .rewrite import Rewrite, RewriteContext, RewritePass

aten = torch.ops.aten
_SYMBOLIC = (torch.SymInt, torch.SymFloat, torch.SymBool)


def check_static(gm: GraphModule) -> None:
    """Raise CtpuDynamicShapeError naming the first node whose value or size is symbolic."""
    for node in gm.graph.nodes:
        value = val(node)
        values = value if isinstance(value, (tuple, list)) else (value,)
        for item in values:
            sizes = tuple(item.shape) if isinstance(item, torch.Tensor) else (item,)
            symbolic = [s for s in sizes if isinstance(s, _SYMBOLIC)]
            if symbolic:
                raise CtpuDynamicShapeError(
                    f"node {node.name} ({node.format_node()}) has the symbolic size {symbolic[0]}: fx_passes "
                    "compiles static shapes only; compile with torch.compile(..., dynamic=False)"
                )


def _aliases_input_at_output(copy: Node, source: Node) -> bool:
    """Would dropping `copy` (of `source`) make a graph output alias a graph input or constant?"""
    base = source
    while is_call(base, *VIEW_OPS):
        base = base.args[0]  # type: ignore[assignment]
    if base.op not in ("placeholder", "get_attr"):
        return False
    stack = [copy]
    while stack:
        for user in stack.pop().users:
            if user.op == "output":
                return True
            if is_call(user, *VIEW_OPS):
                stack.append(user)
    return False


def _same_layout(a: Node, b: Node) -> bool:
    va, vb = tensor_val(a), tensor_val(b)
    return (
        va is not None
        and vb is not None
        and va.dtype == vb.dtype
        and va.device == vb.device
        and va.shape == vb.shape
        and va.stride() == vb.stride()
    )


def _forward(kind: str, node: Node, value: Node) -> Rewrite:
    return Rewrite(kind, node, {node}, value=value)


def drop_alias(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """alias(x), detach(x) -> x: views that change nothing in a functional graph."""
    if is_call(node, aten.alias.default, aten.detach.default):
        return _forward("alias", node, node.args[0])  # type: ignore[arg-type]
    return None


def drop_copy(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """lift_fresh_copy / clone / _to_copy whose result equals its input in dtype, device and strides."""
    if not is_call(node, aten.lift_fresh_copy.default, aten.clone.default, aten._to_copy.default):
        return None
    source = node.args[0]
    assert isinstance(source, Node)
    if is_call(node, aten._to_copy.default) and op_arg(node, "pin_memory"):
        return None
    if node.target is not aten.lift_fresh_copy.default and not _same_layout(node, source):
        return None
    if _aliases_input_at_output(node, source):
        return None
    return _forward("copy", node, source)


def drop_identity_cast(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """convert_element_type(x, x's dtype) -> x (dynamic=True casts a float64 scalar input to float64)."""
    if is_call(node, torch.ops.prims.convert_element_type.default) and isinstance(node.args[0], Node) \
            and dtype(node.args[0]) == node.args[1]:
        return _forward("copy", node, node.args[0])
    return None


def drop_noop_view(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """View ops whose result has the input's shape and strides."""
    views = (aten.view.default, aten._unsafe_view.default, aten.reshape.default, aten.expand.default)
    source = node.args[0] if node.args else None
    if not isinstance(source, Node) or shape(source) is None:
        return None
    src_shape = shape(source)
    if is_call(node, *views):
        noop = shape(node) == src_shape
    elif is_call(node, aten.permute.default):
        noop = list(node.args[1]) == list(range(len(src_shape)))  # type: ignore[arg-type, union-attr]
    elif is_call(node, aten.slice.Tensor):
        dim = op_arg(node, "dim") % len(src_shape)
        start, end, step = op_arg(node, "start"), op_arg(node, "end"), op_arg(node, "step")
        noop = start in (None, 0) and (end is None or end >= src_shape[dim]) and step == 1
    elif is_call(node, aten.squeeze.dim, aten.squeeze.dims, aten.squeeze.default):
        noop = shape(node) == src_shape
    else:
        return None
    return _forward("noop_view", node, source) if noop else None


def fold_permute_chain(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """permute(permute(x, a), b) -> permute(x, a[b]) (or x when that is the identity)."""
    if not is_call(node, aten.permute.default) or not is_call(node.args[0], aten.permute.default):
        return None
    inner = node.args[0]
    base, first = inner.args[0], list(inner.args[1])  # type: ignore[union-attr, arg-type]
    order = [first[d] for d in node.args[1]]  # type: ignore[union-attr]
    if order == list(range(len(order))):
        return _forward("permute_chain", node, base)  # type: ignore[arg-type]
    return Rewrite("permute_chain", node, {node}, aten.permute.default, (base, order))


def drop_empty_cat_operands(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """cat drops zero-size operands (an empty KV cache); a single operand becomes the value itself."""
    if not is_call(node, aten.cat.default):
        return None
    tensors = list(node.args[0])  # type: ignore[arg-type]
    sizes = [tensor_val(t) for t in tensors]
    if any(s is None for s in sizes):
        return None
    kept = [t for t, s in zip(tensors, sizes, strict=True) if s.numel() > 0]  # type: ignore[union-attr]
    if not kept or (len(kept) == len(tensors) and len(kept) > 1):
        return None
    if len(kept) > 1:
        return Rewrite("cat", node, {node}, aten.cat.default, (kept, *node.args[1:]), dict(node.kwargs))
    single = kept[0]
    single_val = tensor_val(single)
    if single_val.is_contiguous() and not _aliases_input_at_output(node, single):  # type: ignore[union-attr]
        return _forward("cat", node, single)
    contiguous = {"memory_format": torch.contiguous_format}
    return Rewrite("cat", node, {node}, aten.clone.default, (single,), contiguous)


def drop_arith_identity(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """x * 1 and x / 1 (exact in every dtype); x + 0 and x - 0 (exact for integers and bool only:
    -0.0 + 0 is +0.0)."""
    ones = (aten.mul.Tensor, aten.mul.Scalar, aten.div.Tensor, aten.div.Scalar)
    zeros = (aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar)
    if not is_call(node, *ones, *zeros) or len(node.args) != 2 or node.kwargs:
        return None
    source, scalar = node.args
    out, src = tensor_val(node), tensor_val(source)
    if out is None or src is None or out.dtype != src.dtype or out.shape != src.shape:
        return None
    if node.target in ones and number(scalar) != 1.0:
        return None
    exact_zero = not (src.dtype.is_floating_point or src.dtype.is_complex)
    if node.target in zeros and (number(scalar) != 0.0 or not exact_zero):
        return None
    if _aliases_input_at_output(node, source):  # type: ignore[arg-type]
        return None
    return _forward("identity", node, source)  # type: ignore[arg-type]


def dedupe_getitem(node: Node, ctx: RewriteContext) -> Rewrite | None:
    """Two getitem(m, i) of the same multi-output node m become the first of them."""
    if not is_call(node, operator.getitem):
        return None
    source, index = node.args
    twins = {u for u in source.users if u is not node and is_call(u, operator.getitem) and u.args[1] == index}
    if not twins:
        return None
    current = source.next  # type: ignore[union-attr]
    while current is not node:
        if current in twins:
            return _forward("getitem", node, current)
        current = current.next
    return None


NORMALIZE = RewritePass(
    "normalize",
    (
        drop_alias,
        drop_copy,
        drop_identity_cast,
        drop_noop_view,
        fold_permute_chain,
        drop_empty_cat_operands,
        drop_arith_identity,
        dedupe_getitem,
    ),
)


def order_input_mutations(gm: GraphModule) -> int:
    """Move every `copy_(placeholder, value)` just before the output; returns how many moved.

    AOT autograd emits input mutations (keep_inference_input_mutations=True) as trailing copy_ nodes;
    a copy_ elsewhere is moved only when no later node reads the mutated input, otherwise it raises
    CtpuPassError naming the node.
    """
    output = next(n for n in gm.graph.nodes if n.op == "output")
    moved = 0
    for node in list(gm.graph.nodes):
        if not is_call(node, aten.copy_.default):
            continue
        target = node.args[0]
        if not isinstance(target, Node) or target.op != "placeholder":
            raise CtpuPassError(f"node {node.name} ({node.format_node()}): copy_ into a non-input")
        later = _nodes_after(node)
        if all(n.op == "output" or is_call(n, aten.copy_.default) for n in later):
            continue
        # Readers of the input, or of the copy_'s own result (the mutated input as a value).
        readers = [
            n.name
            for n in later
            if not is_call(n, aten.copy_.default) and ({target, node} & set(n.all_input_nodes))
        ]
        if readers:
            raise CtpuPassError(
                f"node {node.name} ({node.format_node()}) mutates {target.name} before {readers[0]} reads it"
            )
        output.prepend(node)
        moved += 1
    return moved


def _nodes_after(node: Node) -> list[Node]:
    later = []
    current = node.next
    while current.op != "root":
        later.append(current)
        current = current.next
    return later


def normalize(gm: GraphModule, *, strict: bool = False) -> Counter[str]:
    """Normalise gm in place (see the module docstring). Returns the rewrites made, by kind."""
    check_static(gm)
    refresh_meta(gm)  # one fake mode for all values, so that rewrites can be checked in it
    gm.graph.eliminate_dead_code()
    counts = NORMALIZE.run(gm, strict=strict)
    moved = order_input_mutations(gm)
    if moved:
        counts["input_mutation_moved"] += moved
        gm.graph.lint()
        gm.recompile()
    return counts
