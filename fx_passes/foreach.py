"""Decompositions of ATen's `_foreach_*` ops (what `torch.optim`'s foreach steps call) into one op per tensor.

A compiled optimizer step (`torch.compile(opt.step, backend="ctpu")`) traces to `_foreach_add`,
`_foreach_lerp`, `_foreach_addcdiv`, ... over lists of parameters, gradients and state; core ATen keeps them
whole, and no back end lowers a list op. `_foreach_<op>.<overload>(lists..., scalars...)` is, by its
definition, `<op>` applied to the i-th element of every list argument, with every other argument as it is:
`[aten.<op>(self[i], other[i], alpha=alpha) for i]`. The per-tensor ops then decompose further as usual, so
a step of N parameters is N elementwise chains in one graph (which the MLIR pipeline fuses).

Left whole (a list op the CTPU does not run falls back with the warning, as any op): the `.Tensor`
overloads of addcmul / addcdiv (their scalars are the values of a tensor: a capturable optimizer's) and
`_foreach_powsum` (no per-tensor op).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload

aten = torch.ops.aten
_PREFIX = "aten::_foreach_"


def foreach_decompositions() -> dict[OpOverload, Callable[..., Any]]:
    """A rule for every functional `_foreach_*` overload that has a per-tensor op."""
    table: dict[OpOverload, Callable[..., Any]] = {}
    names = {n.split("::")[1].split(".")[0] for n in torch._C._dispatch_get_all_op_names() if n.startswith(_PREFIX)}
    for name in sorted(names):
        base = name.removeprefix("_foreach_")
        if name.endswith("_") or not hasattr(aten, base):  # in place: functionalization leaves the functional form
            continue
        packet = getattr(aten, name)
        for overload in packet.overloads():
            op = getattr(packet, overload)
            rule = _rule(op, base)
            if rule is not None:
                table[op] = rule
    return table


def _rule(op: OpOverload, base: str) -> Callable[..., Any] | None:
    schema = op._schema
    if any(a.is_out for a in schema.arguments):
        return None
    if base in ("addcmul", "addcdiv") and op._overloadname == "Tensor":
        return None
    per_tensor = getattr(aten, base)
    lists = [str(a.type) in ("List[Tensor]", "List[number]", "List[Scalar]") for a in schema.arguments]
    names = [a.name for a in schema.arguments]
    keyword = [a.kwarg_only for a in schema.arguments]
    if base in ("addcmul", "addcdiv"):  # the scale is `value=` (keyword only) of the per-tensor op
        names[3], keyword[3] = "value", True
    if base == "norm":  # ord and dtype: linalg_vector_norm's
        per_tensor = aten.linalg_vector_norm
        keyword[2] = True

    def decomposed(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        values = [*args, *(kwargs.get(a.name, a.default_value) for a in schema.arguments[len(args):])]
        count = next(len(v) for v, is_list in zip(values, lists, strict=True) if is_list)
        results = []
        for i in range(count):
            element = [v[i] if is_list else v for v, is_list in zip(values, lists, strict=True)]
            positional = [v for v, kw in zip(element, keyword, strict=True) if not kw]
            named = {n: v for n, v, kw in zip(names, element, keyword, strict=True) if kw and v is not None}
            results.append(per_tensor(*positional, **named))
        return results

    return decomposed
