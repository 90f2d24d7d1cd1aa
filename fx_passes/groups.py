"""`fusion_groups(gm)`: every fused node of a graph as one list, for the back ends to walk."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.fx import GraphModule, Node

from .fuse import FusedGroup
from .ops import is_ctpu_op


@dataclass(frozen=True)
class FusionGroup:
    """One fused node.

    kind: the ctpu op name ("rms_norm", "attention", ...) or the FusedGroup kind ("elementwise",
    "reduction"). inputs: the tensor operands, in schema order for ctpu ops (None for an absent
    optional tensor such as a missing bias) and in call order for FusedGroups. outputs: the nodes
    that carry the group's results (the fused node itself). attrs: the non-tensor arguments of a ctpu
    op by schema name (eps, act, causal, scale, dim), or {"target": submodule name} for a FusedGroup.
    subgraph: the FusedGroup's core-ATen sub-GraphModule; None for ctpu ops.
    """

    kind: str
    node: Node
    inputs: tuple[Node | None, ...]
    outputs: tuple[Node, ...]
    attrs: dict[str, Any] = field(default_factory=dict)
    subgraph: GraphModule | None = None


def _is_tensor_type(schema_type: Any) -> bool:
    if isinstance(schema_type, torch.OptionalType):
        schema_type = schema_type.getElementType()
    return isinstance(schema_type, torch.TensorType)


def _ctpu_group(node: Node) -> FusionGroup:
    schema = node.target._schema  # type: ignore[union-attr]
    inputs: list[Node | None] = []
    attrs: dict[str, Any] = {}
    for index, argument in enumerate(schema.arguments):
        if index < len(node.args):
            value = node.args[index]
        else:  # a left-out argument with a default (ctpu::attention's safe) means its default
            value = node.kwargs.get(argument.name, argument.default_value)
        if _is_tensor_type(argument.type):
            inputs.append(value)
        else:
            attrs[argument.name] = value
    return FusionGroup(node.target._opname, node, tuple(inputs), (node,), attrs)  # type: ignore[union-attr]


def fusion_groups(gm: GraphModule) -> list[FusionGroup]:
    """Every ctpu-op node and FusedGroup call_module of gm, in topological (graph) order."""
    groups = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_ctpu_op(node.target):
            groups.append(_ctpu_group(node))
        elif node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if isinstance(module, FusedGroup):
                attrs = {"target": str(node.target)}
                inputs = tuple(node.args)
                groups.append(FusionGroup(module.kind, node, inputs, (node,), attrs, module.subgraph))
    return groups
