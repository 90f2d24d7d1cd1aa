"""A graph with symbolic sizes, run as padded static programs (fx_passes.dynamic), one per bucket.

At each call the symbols' values are read from the SymInt inputs and the tensor inputs' sizes; their
bucket (fx_passes.dynamic.choose_bounds) names the program variant, compiled on first use and cached.
Inputs with symbolic dims are copied into zero-padded buffers, the valid lengths are passed as 0-d int64
inputs, outputs are narrowed to their real sizes, and an input the graph mutates gets its real part back.
Outputs that are views of an input or of another output are replayed on the real tensors (HostView).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch

from torch_tpu_backend import stats as exec_stats

log = logging.getLogger("ctpu.backend")


class DynamicGraph:
    """The callable GraphCompiler returns for a graph with symbolic sizes (boxed: called with a list)."""

    def __init__(self, gm: torch.fx.GraphModule, plan: Any, compile_variant: Callable[[torch.fx.GraphModule,
                 list[Any]], Callable[..., Any]], name: str, default_max: int) -> None:
        self.gm, self.plan, self.compile_variant, self.name = gm, plan, compile_variant, name
        self.default_max = default_max
        self.variants: dict[tuple[int, ...], Callable[..., Any]] = {}
        self._boxed_call = True

    def symbol_values(self, args: Sequence[Any]) -> dict[sympy.Symbol, int]:
        values: dict[sympy.Symbol, int] = {}
        for i, expr in self.plan.sym_inputs.items():
            if isinstance(expr, sympy.Symbol):
                values[expr] = int(args[i])
        for arg, shape in zip(args, self.plan.input_shapes, strict=True):
            for size, expr in zip(arg.shape if shape is not None else (), shape or (), strict=True):
                if isinstance(expr, sympy.Symbol):
                    values.setdefault(expr, int(size))
        missing = [s for s in self.plan.symbols if s not in values]
        if missing:
            raise RuntimeError(f"ctpu: {self.name}: the symbols {missing} are no input's size")
        return values

    def variant(self, bounds: dict[sympy.Symbol, int]) -> Callable[..., Any]:
        from fx_passes.dynamic import specialize

        key = tuple(bounds[s] for s in self.plan.symbols)
        if key not in self.variants:
            static = specialize(self.gm, self.plan, bounds)
            examples = [n.meta["val"] for n in static.graph.find_nodes(op="placeholder")]
            log.info("ctpu: %s: program variant for %s", self.name,
                     ", ".join(f"{s} <= {b}" for s, b in bounds.items()))
            self.variants[key] = self.compile_variant(static, examples)
            exec_stats.record_variant()
        return self.variants[key]

    def __call__(self, args: list[Any]) -> Any:
        from fx_passes.dynamic import choose_bounds, evaluate

        args = list(args)
        values = self.symbol_values(args)
        bounds = choose_bounds(self.plan, values, default_max=self.default_max)
        program = self.variant(bounds)
        inputs, padded = [], {}
        for i, (arg, shape) in enumerate(zip(args, self.plan.input_shapes, strict=True)):
            if i in self.plan.sym_inputs:
                continue
            if shape is not None and any(e.free_symbols for e in shape):
                full = [evaluate(e, bounds) for e in shape]
                buffer = arg.new_zeros(full)
                buffer[tuple(slice(0, n) for n in arg.shape)] = arg
                padded[i] = buffer
                arg = buffer
            inputs.append(arg)
        device = next((a.device for a in inputs if isinstance(a, torch.Tensor)), torch.device("cpu"))
        inputs += [torch.tensor(evaluate(e, values), dtype=torch.int64, device=device) for e in self.plan.valid_exprs]
        outs = program(inputs)
        outs = list(outs) if isinstance(outs, (tuple, list)) else [outs]
        for i in self.plan.mutated_inputs:
            if i in padded:
                args[i].copy_(padded[i][tuple(slice(0, n) for n in args[i].shape)])
        results: list[Any] = []
        for j in range(len(self.plan.output_shapes)):
            if j in self.plan.sym_outputs:
                results.append(evaluate(self.plan.sym_outputs[j], values))
                continue
            if j in self.plan.host_views:
                results.append(None)  # replayed below, once the outputs it may view are there
                continue
            out, shape = outs.pop(0), self.plan.output_shapes[j]
            if shape is not None and any(e.free_symbols for e in shape):
                # contiguous, as eager returns it: a narrowed view's strides would fail dynamo's stride
                # guards when the output comes back as an input (a KV cache), one more graph per model
                out = out[tuple(slice(0, evaluate(e, values)) for e in shape)].contiguous()
            results.append(out)
        for j, view in self.plan.host_views.items():
            kind, index = view.root
            results[j] = view.replay(args[index] if kind == "input" else results[index], values)
        return results
