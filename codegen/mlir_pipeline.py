"""The upstream MLIR passes, run one by one through `iree.compiler.passmanager`, with a dump after each.

Before: linalg on tensors as the emitter wrote it (one generic per ATen op). After:
- `canonicalize`, `cse`: folded constants and reshapes, shared duplicate values;
- `linalg-fuse-elementwise-ops`: producer generics fused into consumers (elementwise chains become one
  generic; elementwise producers of a reduction move into its body; permute/broadcast copies become
  indexing maps of their consumers);
- `one-shot-bufferize` (function boundaries, identity layouts at the boundary): memrefs; every tensor
  result becomes a `memref.alloc` (the buffers memory planning places in HBM) and reshapes/slices become
  `memref.collapse_shape` / `expand_shape` / `subview` views with static strided layouts;
- `canonicalize`, `cse` again on the buffer form.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from iree.compiler import ir, passmanager

PIPELINE: tuple[tuple[str, str], ...] = (
    ("canonicalize", "builtin.module(canonicalize)"),
    ("cse", "builtin.module(cse)"),
    ("linalg-fuse-elementwise-ops", "builtin.module(func.func(linalg-fuse-elementwise-ops))"),
    ("canonicalize-2", "builtin.module(canonicalize)"),
    ("cse-2", "builtin.module(cse)"),
    ("one-shot-bufferize", "builtin.module(one-shot-bufferize{bufferize-function-boundaries "
                           "function-boundary-type-conversion=identity-layout-map})"),
    ("canonicalize-3", "builtin.module(canonicalize)"),
    ("cse-3", "builtin.module(cse)"),
)


@dataclass
class PipelineResult:
    context: ir.Context
    module: ir.Module
    stages: list[tuple[str, str]] = field(default_factory=list)  # (name, IR after it), starting with "input"


def run_pipeline(text: str, passes: tuple[tuple[str, str], ...] = PIPELINE) -> PipelineResult:
    ctx = ir.Context()
    with ctx:
        module = ir.Module.parse(text)
        result = PipelineResult(ctx, module, [("input", str(module))])
        for name, spec in passes:
            passmanager.PassManager.parse(spec).run(module.operation)
            result.stages.append((name, str(module)))
    return result


def count_ops(ir_text: str, name: str) -> int:
    return sum(1 for line in ir_text.splitlines() if f" {name} " in f" {line.strip()} " or
               line.strip().startswith(name))
