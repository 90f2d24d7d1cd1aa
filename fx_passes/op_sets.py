"""Declarative op tables for generic fusion: which core-ATen overloads are elementwise, which are
reductions, which only change the view of a tensor. `fuse.py` groups ELEMENTWISE and REDUCTIONS into
`FusedGroup`s. What a target can run is not listed here: the target answers it (partition.py).
Overloads are resolved at import, so a misspelt name fails loudly here, not in a pass.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable

import torch
from torch._ops import OpOverload

aten = torch.ops.aten


def _resolve(names: Iterable[str]) -> frozenset[OpOverload]:
    """'add.Tensor' -> aten.add.Tensor; 'neg' -> aten.neg.default."""
    ops = set()
    for name in names:
        packet, _, overload = name.partition(".")
        ops.add(getattr(getattr(aten, packet), overload or "default"))
    return frozenset(ops)


# Pointwise ops: one output element from the same-index (broadcast) input elements.
ELEMENTWISE = _resolve(
    """
    abs neg exp exp2 expm1 log log1p log2 sqrt rsqrt reciprocal sigmoid tanh sin cos erf relu gelu silu
    sign floor ceil round trunc logical_not bitwise_not isnan isinf clamp clamp.Tensor _to_copy
    pow.Tensor_Scalar pow.Tensor_Tensor pow.Scalar
    add.Tensor add.Scalar sub.Tensor sub.Scalar mul.Tensor mul.Scalar div.Tensor div.Scalar div.Tensor_mode
    maximum minimum remainder.Tensor remainder.Scalar fmod.Tensor fmod.Scalar
    eq.Scalar eq.Tensor ne.Scalar ne.Tensor lt.Scalar lt.Tensor le.Scalar le.Tensor gt.Scalar gt.Tensor
    ge.Scalar ge.Tensor logical_and logical_or logical_xor
    bitwise_and.Tensor bitwise_or.Tensor bitwise_xor.Tensor where.self
    """.split()
)

# Reductions with one tensor output (var_mean and max.dim return two and stay unfused).
REDUCTIONS = _resolve(
    """
    sum.dim_IntList sum.default mean.dim amax amin any.dim any.dims any all.dim prod.dim_int prod
    var.correction argmax argmin
    """.split()
)

# Ops that only reinterpret or move data (DMA / address arithmetic on the CTPU).
LAYOUT = _resolve(
    """
    view _unsafe_view reshape permute expand unsqueeze squeeze squeeze.dim squeeze.dims slice.Tensor
    select.int cat clone alias detach t transpose.int split.Tensor split_with_sizes
    slice_scatter select_scatter copy copy_ constant_pad_nd lift_fresh_copy
    """.split()
)

# Ops whose output is a view of (or the same values as) their first input; used to see whether a value
# reaches the graph output as an alias.
VIEW_OPS = _resolve(
    """
    view _unsafe_view reshape permute expand unsqueeze squeeze squeeze.dim squeeze.dims slice.Tensor
    select.int alias detach t transpose.int
    """.split()
)

GETITEM = operator.getitem
