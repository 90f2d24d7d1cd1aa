"""Partitioning: which nodes the CTPU runs and which fall back to the CPU.

Supported on the CTPU: the ctpu ops (ops.py), FusedKernel call_modules (fuse.py), the core-ATen ops of
op_sets.CTPU_SUPPORTED (elementwise, reductions, views/permute/reshape/expand/cat/slice, mm/bmm/addmm,
dtype conversion, full/arange/zeros..., embedding), getitem of a supported multi-output node, and the
trailing `copy_` of input mutations. Anything else (including any op this module has never heard of)
runs on the CPU: it never makes the passes fail.

`partition(gm)` labels every compute node with meta["ctpu_placement"] ("ctpu" or "cpu"), cuts the
graph into segments (maximal runs of consecutive compute nodes with one placement, in graph order, for
the runtime to execute one after the other), and emits exactly one CtpuFallbackWarning naming the
unsupported op targets when there are any.
"""

from __future__ import annotations

import operator
import warnings
from collections import Counter
from dataclasses import dataclass, field

from torch.fx import GraphModule, Node

from .errors import CtpuFallbackWarning
from .fuse import FusedKernel
from .op_sets import CTPU_SUPPORTED
from .ops import is_ctpu_op

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


def is_supported(node: Node, gm: GraphModule) -> bool:
    """Can the CTPU run this compute node?"""
    if node.op == "call_module":
        return isinstance(gm.get_submodule(str(node.target)), FusedKernel)
    if node.op != "call_function":
        return False
    if node.target is operator.getitem:
        source = node.args[0]
        return isinstance(source, Node) and is_supported(source, gm)
    return is_ctpu_op(node.target) or node.target in CTPU_SUPPORTED


def partition(gm: GraphModule, *, warn: bool = True) -> Partition:
    """Label and segment gm's compute nodes; warn once (CtpuFallbackWarning) if any run on the CPU."""
    result = Partition()
    for node in gm.graph.nodes:
        if node.op in _STRUCTURAL:
            continue
        placement = CTPU if is_supported(node, gm) else CPU
        node.meta["ctpu_placement"] = placement
        if result.segments and result.segments[-1].placement == placement:
            result.segments[-1].nodes.append(node)
        else:
            result.segments.append(Segment(placement, [node]))
    if warn and result.fallback:
        counts = Counter(target_name(n) for n in result.fallback if n.target is not operator.getitem)
        listed = ", ".join(f"{name} (x{n})" if n > 1 else name for name, n in sorted(counts.items()))
        warnings.warn(
            f"ctpu: {len(counts)} op type(s) not supported on the CTPU run on the CPU: {listed}",
            CtpuFallbackWarning,
            stacklevel=3,
        )
    return result
