"""How AOT autograd splits a joint forward+backward graph for the CTPU: the forward saves only its inputs,
and the backward recomputes what it needs.

A model called under grad mode (parameters that require grad, as in inference without `torch.no_grad()`)
is traced as a joint graph. The default partition makes the forward also return the activations the backward
will read (softmax probabilities, normalised rows, gate products, ...): those extra outputs sit inside the
patterns fx_passes fuses (attention, RMSNorm, SwiGLU), the fusions fail, and parts of the forward no longer
lower (they run on the CPU). Saving only the forward's inputs keeps the forward graph exactly the inference
graph (nothing extra computed or stored when no backward follows); a backward, if one comes, recomputes the
forward from those inputs (full activation checkpointing: one extra forward, no activation memory).

A graph with random ops (dropout) keeps the default partition: recomputing them in the backward would draw
new random numbers and give wrong gradients.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.fx


def recompute_partition(joint_module: torch.fx.GraphModule, joint_inputs: Sequence[Any],
                        **kwargs: Any) -> tuple[torch.fx.GraphModule, torch.fx.GraphModule]:
    """An AOT autograd `partition_fn`: forward and backward modules, the forward saving only its inputs."""
    from torch._functorch import config
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition

    if has_random_ops(joint_module.graph):
        return default_partition(joint_module, joint_inputs, **kwargs)
    with config.patch(activation_memory_budget=0.0):  # budget 0: the saved set is the forward's inputs
        return min_cut_rematerialization_partition(joint_module, joint_inputs, **kwargs)


def has_random_ops(graph: torch.fx.Graph) -> bool:
    """Does a node draw random numbers (recomputing it would not give the same values)?"""
    for node in graph.nodes:
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload) and \
                torch.Tag.nondeterministic_seeded in target.tags:
            return True
    return False
