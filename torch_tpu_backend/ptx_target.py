"""The `ptx` target: every fused group of the FX passes becomes a pyptx kernel for Hopper (sm_90a).

At compile time each kernel is generated and checked with `ptxas -arch=sm_90a` (warnings fail the
check; registers and spills are reported), on any machine. At run time the graph executes on CUDA:
fused nodes launch their kernels, the remaining nodes (views, ops without a PTX kernel) run as torch CUDA
ops. Without a CUDA device a launch raises `PtxLaunchError` saying so.
"""

from __future__ import annotations

import warnings
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx

from torch_tpu_backend import runtime
from torch_tpu_backend.dump import GraphDump


@dataclass
class PtxGroupKernel:
    node: torch.fx.Node
    kernel: Any  # ptx_kernels.PtxKernel
    inputs: tuple[torch.fx.Node, ...]
    report: Any  # ptx_kernels.PtxasReport


# Nodes that only change a tensor's metadata (shape, strides, offset) and move no data: they run as torch
# views at run time (no CUDA kernel is launched for them). Everything else gets a PTX kernel.
METADATA_ONLY = {
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "unsqueeze", "squeeze", "expand",
    "alias", "slice", "select", "detach", "as_strided", "split", "split_with_sizes", "unbind", "getitem",
}
_MATMULS = (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)


def _op_name(node: torch.fx.Node) -> str:
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(node.target, "__name__", str(node.target))


def is_metadata_only(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and _op_name(node) in METADATA_ONLY


def _shape_dtype(node: torch.fx.Node | None) -> tuple[tuple[int, ...] | None, torch.dtype | None]:
    if node is None:
        return None, None
    val = node.meta["val"]
    return tuple(val.shape), val.dtype


def _w_layout(node: torch.fx.Node) -> str | None:
    """'nk' when the right operand is the transposed view of a contiguous [.., N, K], 'kn' when it is
    contiguous, None when it must be copied first (then it is made contiguous: 'kn')."""
    val = node.meta["val"]
    if val.is_contiguous():
        return "kn"
    k_, n_ = val.shape[-2], val.shape[-1]
    if val.stride()[-2:] == (1, k_) and (val.dim() == 2 or val.stride()[0] == k_ * n_):
        return "nk"
    return None


def _subgraph(node: torch.fx.Node) -> tuple[torch.fx.GraphModule, list[torch.fx.Node]]:
    """`node` plus the metadata-only views between it and the tensors it reads, as a graph for the generator
    (views fuse into its index math, so strided operands need no copy)."""
    graph, env, inputs = torch.fx.Graph(), {}, []

    def pull(n: torch.fx.Node) -> torch.fx.Node:
        if n not in env:
            if is_metadata_only(n) and _op_name(n) != "getitem":
                env[n] = graph.node_copy(n, pull)
            else:
                env[n] = graph.placeholder(f"in{len(inputs)}")
                inputs.append(n)
        return env[n]

    graph.output(graph.node_copy(node, pull))
    return torch.fx.GraphModule(torch.nn.Module(), graph), inputs


def _generated(node: torch.fx.Node) -> PtxGroupKernel:
    import ptx_kernels

    sub, inputs = _subgraph(node)
    shapes, dtypes = zip(*(_shape_dtype(n) for n in inputs), strict=True) if inputs else ((), ())
    kernel = ptx_kernels.kernel_for_subgraph(sub, list(shapes), list(dtypes))
    return PtxGroupKernel(node, kernel, tuple(inputs), ptx_kernels.assemble(kernel))


def build_kernels(gm: torch.fx.GraphModule) -> tuple[list[PtxGroupKernel], list[str]]:
    """(kernels for every compute node: fused groups, matmuls, generated kernels for the other ops and copy
    kernels for strided operands; names of nodes left to torch). Only METADATA_ONLY nodes have no kernel."""
    import fx_passes
    import ptx_kernels

    kernels, uncovered = [], []
    covered: set[torch.fx.Node] = set()

    def add(node: torch.fx.Node, build: Any) -> None:
        covered.add(node)
        try:
            kernels.append(build())
        except (NotImplementedError, ptx_kernels.SubgraphError) as e:
            uncovered.append(f"{node.name} ({_op_name(node) if node.op == 'call_function' else node.target}: {e})")

    def grouped(group: Any) -> PtxGroupKernel:
        shapes, dtypes = zip(*(_shape_dtype(n) for n in group.inputs), strict=True) if group.inputs else ((), ())
        attrs = dict(group.attrs)
        if group.kind == "linear":
            attrs["w_layout"] = _w_layout(group.inputs[1]) or "kn"
        if group.subgraph is not None:
            kernel = ptx_kernels.kernel_for_subgraph(group.subgraph, list(shapes), list(dtypes))
        else:
            kernel = ptx_kernels.kernel_for(group.kind, shapes, dtypes, attrs)
        present = tuple(n for n in group.inputs if n is not None)
        return PtxGroupKernel(group.node, kernel, present, ptx_kernels.assemble(kernel))

    def matmul(node: torch.fx.Node) -> PtxGroupKernel:
        args = node.args[:2]
        shapes, dtypes = zip(*(_shape_dtype(a) for a in args), strict=True)
        attrs = {"w_layout": _w_layout(args[1]) or "kn"}
        kernel = ptx_kernels.kernel_for(str(node.target), shapes, dtypes, attrs)
        return PtxGroupKernel(node, kernel, tuple(args), ptx_kernels.assemble(kernel))

    for group in fx_passes.fusion_groups(gm):
        add(group.node, lambda group=group: grouped(group))
    for node in gm.graph.nodes:
        if node.op != "call_function" or node in covered or is_metadata_only(node):
            continue
        add(node, (lambda node=node: matmul(node)) if node.target in _MATMULS else (lambda node=node: _generated(node)))
    # Operands a kernel reads with other strides than it wants (permuted views, ...) get a copy kernel.
    for k in list(kernels):
        for arg, n in zip(k.kernel.inputs, k.inputs, strict=True):
            if n.op == "call_function" and is_metadata_only(n) and n not in covered and not _strides_ok(arg, n):
                add(n, lambda n=n: _generated(n))
    return kernels, uncovered


def _strides_ok(arg: Any, node: torch.fx.Node) -> bool:
    val = node.meta["val"]
    if arg.strides is None:
        return val.is_contiguous()
    return tuple(val.stride()) == tuple(arg.strides[len(arg.strides) - val.dim():])


class PtxTarget:
    """NVIDIA Hopper through pyptx: every compute node of a graph gets a PTX kernel (fused groups from
    fx_passes' FusedGroups and ctpu ops), views run as torch views; nothing falls back to the host."""

    name = "ptx"
    fuse_elementwise = True  # the generator compiles fx_passes' fused groups, one kernel each

    def __init__(self, opts: Any) -> None:
        self.opts = opts

    def unsupported_reason(self, node: torch.fx.Node) -> str | None:
        return None  # a node without a kernel still runs on the GPU, as a torch CUDA op

    def refusal_reason(self, error: Exception) -> str | None:
        """ptx_kernels refuses an op, dtype or shape with NotImplementedError (SubgraphError is one); anything
        else (a PtxasError, a bad shape) is an internal error."""
        return str(error) if isinstance(error, NotImplementedError) else None

    def compile(self, gm: torch.fx.GraphModule, example_inputs: Any, name: str, dump: GraphDump) -> PtxGraph:
        import fx_passes

        kernels, uncovered = build_kernels(gm)
        for k in kernels:
            dump.stage(f"ptx_{k.kernel.name}", k.kernel.ptx, "ptx")
        figures = {k.kernel.name: {"registers": k.report.registers, "spill_stores": k.report.spill_stores,
                                   "spill_loads": k.report.spill_loads} for k in kernels}
        fusions = Counter(group.kind for group in fx_passes.fusion_groups(gm))
        dump.summary({"target": "ptx", "kernels": figures, "torch_ops": uncovered, "fusions": dict(fusions)})
        if uncovered:
            warnings.warn("ctpu ptx target: no PTX kernel for " + "; ".join(uncovered) +
                          " (they run as torch CUDA ops)", stacklevel=2)
        return PtxGraph(gm, {k.node: k for k in kernels}, figures)

    def launch(self, graph: PtxGraph, args: Any, outputs: Any, name: str,
               bumped_after: frozenset[int] = frozenset()) -> list[Any]:
        result = graph(*args)
        return list(result) if isinstance(result, (tuple, list)) else [result]


def _as_node_shape(out: torch.Tensor, node: torch.fx.Node) -> torch.Tensor:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor) and tuple(val.shape) != tuple(out.shape) and val.numel() == out.numel():
        return out.view(val.shape)
    return out


class PtxGraph(torch.nn.Module):
    """Runs the fused graph on CUDA: PTX kernels for fused nodes, torch for the rest."""

    def __init__(self, gm: torch.fx.GraphModule, kernels: dict[torch.fx.Node, PtxGroupKernel],
                 figures: dict[str, Any]) -> None:
        super().__init__()
        self.gm, self.kernels, self.ptxas_figures = gm, kernels, figures

    def forward(self, *args: Any) -> Any:
        runtime.require_gpu()
        home = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
        env: dict[torch.fx.Node, Any] = {}
        copies: dict[torch.fx.Node, torch.Tensor] = {}
        self._copies = copies
        placeholders = iter(args)
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                value = next(placeholders)
                env[node] = value.cuda().contiguous() if isinstance(value, torch.Tensor) else value
            elif node.op == "output":
                return torch.fx.node.map_arg(node.args[0], lambda n: env[n].to(home))
            elif node in self.kernels and not is_metadata_only(node):
                env[node] = self._launch(self.kernels[node], env)
            elif node in self.kernels:  # a strided view some kernel reads contiguously: torch view + copy kernel
                args_, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                env[node] = node.target(*args_, **kwargs)
                copies[node] = self._launch(self.kernels[node], env)
            else:
                args_, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: env[n])
                target = getattr(self.gm, node.target) if node.op in ("call_module", "get_attr") else node.target
                env[node] = target if node.op == "get_attr" else target(*args_, **kwargs)
        raise AssertionError("graph without output")

    def _launch(self, k: PtxGroupKernel, env: dict[torch.fx.Node, Any]) -> Any:
        # Inputs are contiguous (or have the strides the kernel declares) by construction: strided views
        # were given copy kernels at compile time; graph inputs are made contiguous on their way to CUDA.
        ins = [self._copies.get(n, env[n]) for n in k.inputs]
        outs = runtime.launch_ptx(k.kernel, ins)
        if len(outs) == 1:
            return _as_node_shape(outs[0], k.node)
        return tuple(outs)
