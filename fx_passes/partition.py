"""Partitioning: which nodes the target runs and which fall back to the CPU, and why.

The target decides, node by node: `unsupported_reason(node) -> str | None` (for the CTPU, codegen's own
lowering table and argument checks, so placement and lowering never disagree). A FusedGroup call_module
runs where all its inner nodes can; a getitem goes with its producer. Without a target's answer every
compute node is placed on the target.

`partition(gm, unsupported_reason)` labels every compute node with meta["ctpu_placement"] ("ctpu" or
"cpu") and, for CPU nodes, meta["ctpu_fallback_reason"], and cuts the graph into segments (maximal runs
of consecutive compute nodes with one placement, in graph order, for the runtime to execute one after
the other). It does not warn: the backend warns once per compiled graph, after the last fallback is known.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from torch.fx import GraphModule, Node

from .fuse import FusedGroup

UnsupportedReason = Callable[[Node], "str | None"]

CTPU = "ctpu"
CPU = "cpu"
_STRUCTURAL = ("placeholder", "get_attr", "output")


@dataclass
class Segment:
    """Consecutive compute nodes that run on one placement."""

    placement: str
    nodes: list[Node]


@dataclass
class Partition:
    segments: list[Segment] = field(default_factory=list)

    @property
    def supported(self) -> list[Node]:
        return [n for s in self.segments if s.placement == CTPU for n in s.nodes]

    @property
    def fallback(self) -> list[Node]:
        return [n for s in self.segments if s.placement == CPU for n in s.nodes]

    @property
    def fallback_targets(self) -> list[str]:
        """Sorted names of the op targets that run on the CPU (a getitem goes with its producer)."""
        return sorted({target_name(n) for n in self.fallback if n.target is not operator.getitem})


def target_name(node: Node) -> str:
    """'aten.cumsum.default', 'ctpu.rms_norm.default', a call_module's target, a method's name."""
    target = node.target
    if isinstance(target, str):
        return target
    return str(target) if hasattr(target, "_schema") else getattr(target, "__qualname__", repr(target))


def fallback_reason(node: Node, gm: GraphModule, unsupported_reason: UnsupportedReason | None) -> str | None:
    """Why this compute node cannot run on the target (None: it can)."""
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        if not isinstance(module, FusedGroup):
            return f"module {node.target} ({type(module).__name__})"
        inner = (fallback_reason(n, module.subgraph, unsupported_reason) for n in module.subgraph.graph.nodes
                 if n.op not in _STRUCTURAL)
        return next((r for r in inner if r is not None), None)
    if node.op != "call_function":
        return f"op kind {node.op}"
    if node.target is operator.getitem:
        source = node.args[0]
        return fallback_reason(source, gm, unsupported_reason) if isinstance(source, Node) else None
    return unsupported_reason(node) if unsupported_reason is not None else None


def fallback_summary(nodes: list[Node]) -> str:
    """'aten.floor.default (x2): <reason>; ...' for the CPU nodes of a graph (getitems go with their producer)."""
    counts = Counter(target_name(n) for n in nodes if n.target is not operator.getitem)
    reasons = {target_name(n): n.meta.get("ctpu_fallback_reason", "") for n in nodes}
    return "; ".join(f"{name}" + (f" (x{k})" if k > 1 else "") + (f": {reasons[name]}" if reasons[name] else "")
                     for name, k in sorted(counts.items()))


def partition(gm: GraphModule, unsupported_reason: UnsupportedReason | None = None,
              forced: dict[Node, str] | None = None) -> Partition:
    """Label and segment gm's compute nodes. `forced` places more nodes on the CPU, with their reasons
    (what the backend learns when a segment fails to compile)."""
    result = Partition()
    for node in gm.graph.nodes:
        if node.op in _STRUCTURAL:
            continue
        reason = (forced or {}).get(node) or fallback_reason(node, gm, unsupported_reason)
        placement = CTPU if reason is None else CPU
        node.meta["ctpu_placement"] = placement
        if reason is None:
            node.meta.pop("ctpu_fallback_reason", None)
        else:
            node.meta["ctpu_fallback_reason"] = reason
        if result.segments and result.segments[-1].placement == placement:
            result.segments[-1].nodes.append(node)
        else:
            result.segments.append(Segment(placement, [node]))
    return result
