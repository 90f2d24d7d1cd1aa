"""The `ptx` target: every fused group of the FX passes becomes a pyptx kernel for Hopper (sm_90a).

At compile time each kernel is generated and checked with `ptxas -arch=sm_90a` (warnings fail the
check; registers and spills are reported), on any machine. At run time the graph executes on CUDA:
fused nodes launch their kernels, the remaining nodes (views, ops without a PTX kernel) run as torch CUDA
ops. Without a CUDA device a launch raises `PtxLaunchError` saying so.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from torch_tpu_backend import stats as exec_stats
from torch_tpu_backend.dump import GraphDump


@dataclass
class PtxGroupKernel:
    node: torch.fx.Node
    kernel: Any  # ptx_kernels.PtxKernel
    inputs: tuple[torch.fx.Node, ...]
    report: Any  # ptx_kernels.PtxasReport


def _shape_dtype(node: torch.fx.Node | None) -> tuple[tuple[int, ...] | None, torch.dtype | None]:
    if node is None:
        return None, None
    val = node.meta["val"]
    return tuple(val.shape), val.dtype


def build_kernels(gm: torch.fx.GraphModule) -> tuple[list[PtxGroupKernel], list[str]]:
    """(kernels for every group and matmul the PTX back end covers, names of nodes it leaves to torch)."""
    import fx_passes
    import ptx_kernels

    kernels, uncovered = [], []
    grouped = set()
    for group in fx_passes.fusion_groups(gm):
        grouped.add(group.node)
        shapes, dtypes = zip(*(_shape_dtype(n) for n in group.inputs), strict=True) if group.inputs else ((), ())
        try:
            if group.subgraph is not None:
                kernel = ptx_kernels.kernel_for_subgraph(group.subgraph, list(shapes), list(dtypes))
            else:
                kernel = ptx_kernels.kernel_for(group.kind, shapes, dtypes, group.attrs)
        except (NotImplementedError, ptx_kernels.SubgraphError) as e:
            uncovered.append(f"{group.node.name} ({group.kind}: {e})")
            continue
        present = tuple(n for n in group.inputs if n is not None)
        kernels.append(PtxGroupKernel(group.node, kernel, present, ptx_kernels.assemble(kernel)))
    for node in gm.graph.nodes:
        if node.op == "call_function" and node not in grouped and node.target in (
                torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
            args = node.args[:2]
            shapes, dtypes = zip(*(_shape_dtype(a) for a in args), strict=True)
            try:
                kernel = ptx_kernels.kernel_for(str(node.target), shapes, dtypes)
            except NotImplementedError as e:
                uncovered.append(f"{node.name} ({e})")
                continue
            kernels.append(PtxGroupKernel(node, kernel, tuple(args), ptx_kernels.assemble(kernel)))
    return kernels, uncovered


def compile_for_ptx(gm: torch.fx.GraphModule, report: Any, opts: Any, dump: GraphDump) -> PtxGraph:
    kernels, uncovered = build_kernels(gm)
    for k in kernels:
        dump.stage(f"ptx_{k.kernel.name}", k.kernel.ptx, "ptx")
    figures = {k.kernel.name: {"registers": k.report.registers, "spill_stores": k.report.spill_stores,
                               "spill_loads": k.report.spill_loads} for k in kernels}
    dump.summary({"target": "ptx", "kernels": figures, "torch_ops": uncovered, "fusions": dict(report.fusions)})
    if uncovered:
        warnings.warn("ctpu ptx target: no PTX kernel for " + "; ".join(uncovered) + " (they run as torch CUDA ops)",
                      stacklevel=2)
    return PtxGraph(gm, {k.node: k for k in kernels}, figures)


class PtxGraph(torch.nn.Module):
    """Runs the fused graph on CUDA: PTX kernels for fused nodes, torch for the rest."""

    def __init__(self, gm: torch.fx.GraphModule, kernels: dict[torch.fx.Node, PtxGroupKernel],
                 figures: dict[str, Any]) -> None:
        super().__init__()
        self.gm, self.kernels, self.ptxas_figures = gm, kernels, figures

    def forward(self, *args: Any) -> Any:
        import ptx_kernels

        if not torch.cuda.is_available():
            raise ptx_kernels.PtxLaunchError(ptx_kernels.NO_GPU)
        home = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        env: dict[torch.fx.Node, Any] = {}
        placeholders = iter(args)
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                value = next(placeholders)
                env[node] = value.cuda() if isinstance(value, torch.Tensor) else value
            elif node.op == "output":
                return torch.fx.node.map_arg(node.args[0], lambda n: env[n].to(home))
            elif node in self.kernels:
                k = self.kernels[node]
                outs = ptx_kernels.run(k.kernel, *(env[n].contiguous() for n in k.inputs))
                env[node] = outs[0] if len(outs) == 1 else tuple(outs)
                exec_stats.record_kernel_launch()
            else:
                args_, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                target = getattr(self.gm, node.target) if node.op in ("call_module", "get_attr") else node.target
                env[node] = target if node.op == "get_attr" else target(*args_, **kwargs)
        raise AssertionError("graph without output")
