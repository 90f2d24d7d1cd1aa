"""Generic fusion: maximal groups of elementwise ops and reductions become `FusedGroup` call_modules.

Before: a graph after pattern fusion. After: every group of at least two fusible nodes (op_sets.py
ELEMENTWISE and REDUCTIONS with one tensor output; `_to_copy` only when it converts the dtype alone) is
one call_module node whose target is a `FusedGroup` holding the group as a sub-GraphModule of core-ATen
nodes.

Groups grow from a root (a fusible node, visiting consumers first) towards its producers. A producer
joins when every one of its users is already in the group: single-consumer chains, and values that
the group broadcasts against others (x and amax(x) in x - amax(x)). So only the root's value leaves a
group, and a group is convex (no path leaves it and comes back). Reductions in one group must reduce
the same input shape over the same dims, so that a back end can emit one loop nest. Everything that
stops a group from growing is logged on "ctpu.fusion" at debug level.
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch.fx import Graph, GraphModule, Node

from .graph_utils import is_call, normalize_dims, op_arg, shape, tensor_val
from .matchers import cast_dtype
from .op_sets import ELEMENTWISE, REDUCTIONS
from .rewrite import fusion_log, why_no_fuse

aten = torch.ops.aten
_MIN_GROUP = 2


class FusedGroup(torch.nn.Module):
    """A fused group of elementwise ops / reductions: `subgraph` (placeholders = the group's inputs, in
    the order of the call_module node's args; one output = the group's value), `kind` ("elementwise"
    or "reduction"). Calling it runs the subgraph, so the fused graph still runs on CPU."""

    def __init__(self, kind: str, subgraph: GraphModule) -> None:
        super().__init__()
        self.kind = kind
        self.subgraph = subgraph

    @property
    def inputs(self) -> list[Node]:
        return [n for n in self.subgraph.graph.nodes if n.op == "placeholder"]

    @property
    def outputs(self) -> list[Node]:
        output = next(n for n in self.subgraph.graph.nodes if n.op == "output")
        return list(output.args[0]) if isinstance(output.args[0], (tuple, list)) else [output.args[0]]

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.subgraph(*args)

    def extra_repr(self) -> str:
        ops = [str(n.target) for n in self.subgraph.graph.nodes if n.op == "call_function"]
        return f"kind={self.kind}, ops=[{', '.join(ops)}]"


def _fusible(node: Node) -> bool:
    if node.op != "call_function" or node.target not in ELEMENTWISE | REDUCTIONS:
        return False
    if tensor_val(node) is None:
        return False
    # A _to_copy that moves device or layout is a transfer, not arithmetic.
    return not is_call(node, aten._to_copy.default) or cast_dtype(node) is not None


def _reduction_key(node: Node) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """(input shape, reduced dims): reductions in one group must agree on it."""
    source = shape(node.args[0])
    ndim = len(source or ())
    if "dim" in [a.name for a in node.target._schema.arguments]:  # type: ignore[union-attr]
        dims = normalize_dims(op_arg(node, "dim"), ndim) if ndim else ()
    else:
        dims = None
    return source, dims if dims is not None else tuple(range(ndim))


def _grow(root: Node, assigned: set[Node]) -> list[Node]:
    members = {root}
    reductions = {_reduction_key(root)} if root.target in REDUCTIONS else set()
    changed = True
    while changed:
        changed = False
        for member in list(members):
            for producer in member.all_input_nodes:
                if producer in members or producer in assigned or not _fusible(producer):
                    continue
                outside = [u for u in producer.users if u not in members]
                if outside:
                    continue  # may join later, once its other users are in
                if producer.target in REDUCTIONS:
                    key = _reduction_key(producer)
                    if reductions and key not in reductions:
                        why_no_fuse(
                            "reduction fusion", producer, "reduces %s over %s, unlike the group", *key
                        )
                        continue
                    reductions.add(key)
                members.add(producer)
                changed = True
    if len(members) > 1 and fusion_log.isEnabledFor(logging.DEBUG):
        for member in members:
            for producer in member.all_input_nodes:
                if producer not in members and _fusible(producer) and producer not in assigned:
                    users = ", ".join(u.name for u in producer.users if u not in members)
                    reason = "stays out of %s's group: used by %s"
                    why_no_fuse("generic fusion", producer, reason, root.name, users)
    order = {n: i for i, n in enumerate(root.graph.nodes)}
    return sorted(members, key=order.__getitem__)


def _outline(gm: GraphModule, members: list[Node], name: str) -> Node:
    """Replace members (in graph order, last = root) by call_module(name) of a FusedGroup."""
    root = members[-1]
    member_set = set(members)
    inputs: list[Node] = []
    for member in members:
        for node in member.all_input_nodes:
            if node not in member_set and node not in inputs:
                inputs.append(node)
    subgraph = Graph()
    env: dict[Node, Node] = {}
    for index, node in enumerate(inputs):
        placeholder = subgraph.placeholder(f"in{index}_{node.name}")
        placeholder.meta["val"] = node.meta.get("val")
        env[node] = placeholder
    for member in members:
        env[member] = subgraph.node_copy(member, lambda n: env[n])
    subgraph.output(env[root])
    kind = "reduction" if any(m.target in REDUCTIONS for m in members) else "elementwise"
    gm.add_submodule(name, FusedGroup(kind, GraphModule(torch.nn.Module(), subgraph, class_name=name)))
    with gm.graph.inserting_before(root):
        call = gm.graph.call_module(name, tuple(inputs))
    call.meta.update(root.meta)
    call.meta["ctpu_fused_from"] = [m.name for m in members]
    root.replace_all_uses_with(call)
    for member in reversed(members):
        gm.graph.erase_node(member)
    return call


def fuse_elementwise(gm: GraphModule) -> Counter[str]:
    """Outline every maximal elementwise/reduction group of >= 2 nodes; returns counts by kind."""
    assigned: set[Node] = set()
    groups: list[list[Node]] = []
    for node in reversed(list(gm.graph.nodes)):
        if node in assigned or not _fusible(node):
            continue
        members = _grow(node, assigned)
        assigned.update(members)
        if len(members) >= _MIN_GROUP:
            groups.append(members)
    counts: Counter[str] = Counter()
    taken = {name for name, _ in gm.named_children()}
    index = 0
    for members in groups:
        while f"fused_{index}" in taken:
            index += 1
        call = _outline(gm, members, f"fused_{index}")
        taken.add(f"fused_{index}")
        counts[gm.get_submodule(str(call.target)).kind] += 1
    if groups:
        gm.graph.lint()
        gm.recompile()
    return counts


def inline_fused_kernels(gm: GraphModule) -> GraphModule:
    """The inverse of fuse_elementwise: every FusedGroup call_module becomes its core-ATen nodes again.

    For back ends that fuse by themselves (the CTPU's MLIR pipeline). Node meta (fake values) is kept, and
    constants the subgraphs read (get_attr) move to gm under fresh names. gm is changed in place.
    """
    graph = gm.graph
    changed = False
    for node in list(graph.nodes):
        if node.op != "call_module" or not isinstance(kernel := gm.get_submodule(node.target), FusedGroup):
            continue
        inner = kernel.subgraph
        env: dict[Node, object] = dict(zip(kernel.inputs, node.args, strict=True))
        with graph.inserting_before(node):
            for attr in inner.graph.find_nodes(op="get_attr"):
                name = f"{node.name}_{attr.target}".replace(".", "_")
                setattr(gm, name, getattr(inner, attr.target))
                env[attr] = graph.get_attr(name)
                env[attr].meta = dict(attr.meta)
            result = graph.graph_copy(inner.graph, env)  # type: ignore[arg-type]
        node.replace_all_uses_with(result)
        graph.erase_node(node)
        gm.delete_submodule(node.target)
        changed = True
    if changed:
        graph.lint()
        gm.recompile()
    return gm
