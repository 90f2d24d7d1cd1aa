"""Eager ops on ctpu tensors as compiled single-op CTPU kernels (plugged into eager.py's hook).

An op is traced alone (make_fx with core-ATen decompositions), compiled by codegen for the device's
configuration, and launched on the ctpu tensors in place; eager.py caches the kernel per op, shapes,
strides and dtypes. Ops the CTPU cannot run (mutating or aliasing ops, integer results, anything codegen
rejects) return None and run on the CPU through the fallback. `CTPU_EAGER=cpu` turns compilation off.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils import _pytree as pytree

log = logging.getLogger("ctpu.eager")
_FLOATS = (torch.float32, torch.bfloat16)


def enabled() -> bool:
    return os.environ.get("CTPU_EAGER", "ctpu") != "cpu"


def _out_names(op: OpOverload) -> list[str]:
    return [a.name for a in op._schema.arguments if a.is_out]


def _compilable(op: OpOverload, leaves: list[Any]) -> bool:
    schema = op._schema
    if not _out_names(op):  # an out= variant is compiled as its functional form, then written to out
        if schema.is_mutable or any(r.alias_info is not None for r in schema.returns):
            return False  # in-place and view ops keep their exact aliasing on the CPU path
        if not schema.returns or any(str(r.type) != "Tensor" for r in schema.returns):
            return False
    tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
    return bool(tensors) and all(t.dtype in _FLOATS and t.device.type == "ctpu" and t.numel() > 0
                                 for t in tensors)


def _fills() -> dict[OpOverload, OpOverload]:
    """In-place fills and their functional forms: `torch.zeros(..., device="ctpu")`, `zeros_like` (an
    optimizer's state) and `fill_` write self from no other tensor, so the functional result copied into
    self is the op (no aliasing to keep)."""
    aten = torch.ops.aten
    return {aten.zero_.default: aten.zero.default, aten.fill_.Scalar: aten.fill.Scalar}


def compile_single_op(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """A kernel running `op` on the CTPU for every call with this layout, or None (the CPU runs it)."""
    if not enabled():
        return None
    functional = _fills().get(op)
    if functional is not None:
        kernel = compile_single_op(functional, args, kwargs) if args and args[0].numel() > 0 else None
        return None if kernel is None else FillKernel(kernel)
    outs = _out_names(op)
    inputs = {k: v for k, v in kwargs.items() if k not in outs}
    leaves, spec = pytree.tree_flatten((args, inputs))
    if not _compilable(op, leaves + [kwargs[k] for k in outs if k in kwargs]):
        return None
    slots = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    functional = op.overloadpacket if outs else op

    def call(*tensors: torch.Tensor) -> Any:
        values = list(leaves)
        for i, t in zip(slots, tensors, strict=True):
            values[i] = t
        a, k = pytree.tree_unflatten(values, spec)
        return functional(*a, **k)

    examples = [torch.empty_strided(leaves[i].shape, leaves[i].stride(), dtype=leaves[i].dtype) for i in slots]
    try:
        from torch._decomp import core_aten_decompositions
        from torch.fx.experimental.proxy_tensor import make_fx

        import codegen

        gm = make_fx(call, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(*examples)
        out_node = next(iter(gm.graph.find_nodes(op="output")))
        out_dtypes = [n.meta["val"].dtype for n in pytree.tree_leaves(out_node.args[0])]
        if any(d not in _FLOATS for d in out_dtypes):
            return None
        from torch_tpu_backend.device import memory

        config = memory.hbm_device().config
        compiled = codegen.compile_graph(gm, examples, config.name)
    except (NotImplementedError, codegen.UnsupportedError) as e:
        log.debug("eager %s stays on the CPU: %s", op, e)
        return None
    except Exception as e:  # a compiler bug must not break the user's op: run it on the CPU, and say so
        _internal_error(op, e)
        return None
    return SingleOpKernel(op, compiled, slots, out_dtypes, config.name, outs)


_reported: set[str] = set()


def _internal_error(op: OpOverload, err: Exception) -> None:
    import warnings

    log.warning("internal compiler error on eager %s (it runs on the CPU): %r", op, err)
    if str(op) not in _reported:
        _reported.add(str(op))
        warnings.warn(f"ctpu: internal compiler error compiling eager {op}; it runs on the CPU. Please report: "
                      f"{type(err).__name__}: {str(err)[:300]}", RuntimeWarning, stacklevel=3)


class SingleOpKernel:
    """Launches one compiled op on ctpu tensors; for an out= variant, writes the results into `out`."""

    def __init__(self, op: OpOverload, compiled: Any, slots: list[int], out_dtypes: list[torch.dtype],
                 config: str, out_names: list[str]) -> None:
        self.op, self.compiled, self.slots, self.out_dtypes = op, compiled, slots, out_dtypes
        self.config, self.out_names = config, out_names

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        from torch_tpu_backend.ctpu_target import launch_executable
        from torch_tpu_backend.target import OutputSpec

        inputs = {k: v for k, v in kwargs.items() if k not in self.out_names}
        leaves = pytree.tree_leaves((args, inputs))
        tensors = [leaves[i] for i in self.slots]
        outputs = [OutputSpec(d, torch.device("ctpu")) for d in self.out_dtypes]
        results = launch_executable(self.compiled, tensors, outputs, "sim", str(self.op))
        if self.out_names:
            targets = [kwargs[k] for k in self.out_names]
            for dst, res in zip(targets, results, strict=True):
                if dst.shape != res.shape:
                    dst.resize_(res.shape)
                dst.copy_(res)
            results = targets
        return results[0] if len(results) == 1 else tuple(results)


class FillKernel:
    """An in-place fill (`_fills`): its functional form's kernel, the result copied into self on the device."""

    def __init__(self, functional: SingleOpKernel) -> None:
        self.functional = functional

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        args[0].copy_(self.functional(*args, **kwargs))
        return args[0]
