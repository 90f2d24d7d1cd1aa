"""Shared helpers for the fx_passes tests: trace through AOT autograd, verify graphs between passes."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._functorch.aot_autograd import aot_module_simplified
from torch.fx import GraphModule

from fx_passes import PassReport, decomposition_table, run_passes
from fx_passes.ops import is_ctpu_op

# Tolerances of a fused graph against the unfused one: fp32 to rounding; bf16 patterns compute in fp32
# inside the fused op, where the unfused graph rounds intermediates to bf16.
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}


@dataclass
class Traced:
    """The AOT forward graph of a function, the real tensors it was called with, and eager outputs."""

    gm: GraphModule
    inputs: list[Any]
    eager: Any


def aot_trace(fn: Callable[..., Any], *args: Any, keep_input_mutations: bool = False) -> Traced:
    """Trace fn the way the ctpu backend sees it: dynamo, then aot_module_simplified with the backend's
    decomposition table (core ATen; inference, static shapes)."""
    captured: dict[str, Any] = {}

    def fw_compiler(gm: GraphModule, fake_inputs: Sequence[Any]) -> Callable[..., Any]:
        captured["gm"] = gm

        def run(*flat: Any) -> Any:
            captured.setdefault("inputs", [clone(x) for x in flat])
            return gm(*flat)

        return run

    def backend(gm: GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        return aot_module_simplified(
            gm,
            example_inputs,
            fw_compiler=fw_compiler,
            decompositions=decomposition_table(),
            keep_inference_input_mutations=keep_input_mutations,
        )

    torch._dynamo.reset()
    with torch.no_grad():
        eager = fn(*[clone(a) for a in args])
        torch.compile(fn, backend=backend, fullgraph=True, dynamic=False)(*args)
    return Traced(captured["gm"], captured["inputs"], eager)


def clone(x: Any) -> Any:
    return x.clone() if isinstance(x, torch.Tensor) else x


def run_graph(gm: GraphModule, inputs: Sequence[Any]) -> list[torch.Tensor]:
    """Run gm on copies of inputs (graphs may mutate their inputs); outputs as a list."""
    with torch.no_grad():
        out = gm(*[clone(x) for x in inputs])
    return list(out) if isinstance(out, (tuple, list)) else [out]


def assert_outputs_close(actual: Sequence[Any], expected: Sequence[Any], what: str) -> None:
    assert len(actual) == len(expected), what
    for index, (a, e) in enumerate(zip(actual, expected, strict=True)):
        if not isinstance(e, torch.Tensor):
            assert a == e, f"{what}: output {index}"
            continue
        atol, rtol = TOLERANCE.get(e.dtype, (1e-5, 1e-5))
        torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=True, msg=lambda m: f"{what}: {m}")


@dataclass
class GraphVerifier:
    """run_passes(verify=...) hook: after every pass, lint the graph and re-run it on CPU; it must give
    what it gave before the pass, and what the original graph gave."""

    inputs: Sequence[Any]
    original: list[torch.Tensor]
    previous: list[torch.Tensor] = field(default_factory=list)
    passes: list[str] = field(default_factory=list)

    def __call__(self, name: str, gm: GraphModule) -> None:
        gm.graph.lint()
        out = run_graph(gm, self.inputs)
        assert_outputs_close(out, self.previous or self.original, f"after pass {name} (vs before it)")
        assert_outputs_close(out, self.original, f"after pass {name} (vs the original graph)")
        self.previous = out
        self.passes.append(name)


def passes_verified(traced: Traced) -> PassReport:
    """run_passes on the traced graph in strict mode, verifying after every pass, placed by the CTPU's
    code generator (codegen.unsupported_reason)."""
    import codegen

    verifier = GraphVerifier(traced.inputs, run_graph(traced.gm, traced.inputs))
    _, report = run_passes(traced.gm, traced.inputs, strict=True, verify=verifier,
                           unsupported_reason=codegen.unsupported_reason)
    assert verifier.passes == list(report.changes), "every pass was verified"
    return report


def ctpu_ops(gm: GraphModule) -> list[str]:
    """Names of the ctpu ops called by gm, in graph order."""
    return [n.target._opname for n in gm.graph.nodes if n.op == "call_function" and is_ctpu_op(n.target)]


def count(gm: GraphModule, name: str) -> int:
    return ctpu_ops(gm).count(name)


def aten_targets(gm: GraphModule) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def fuse(fn: Callable[..., Any], *args: Any) -> tuple[GraphModule, PassReport]:
    """Trace, run the passes with verification after each; the result must still match eager."""
    traced = aot_trace(fn, *args)
    report = passes_verified(traced)
    eager = traced.eager if isinstance(traced.eager, tuple) else (traced.eager,)
    assert_outputs_close(run_graph(traced.gm, traced.inputs), eager, "fused graph vs eager")
    return traced.gm, report


def ctpu_node(gm: GraphModule, name: str) -> torch.fx.Node:
    (node,) = [n for n in gm.graph.nodes if str(n.target) == f"ctpu.{name}.default"]
    return node
