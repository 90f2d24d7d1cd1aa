"""The `ctpu` torch.compile backend, found through the `torch_dynamo_backends` entry point.

    model = torch.compile(model, backend="ctpu", options={"target": "sim", "config": "small"})

Dynamo's graph goes through AOT autograd with core-ATen decompositions, then `fx_passes.run_passes`
(normalise, fuse, partition) with the target's answer for each node. Every segment the target runs
becomes one executable (by default the whole graph: one megakernel, launched once); a node the target
cannot run goes to the CPU alone, and the supported nodes on either side still run on the target. One
`CtpuFallbackWarning` per compiled graph names every CPU op with its reason. Options: options.py.
"""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx

from torch_tpu_backend import cache
from torch_tpu_backend import stats as exec_stats
from torch_tpu_backend.ctpu_target import signature
from torch_tpu_backend.dump import GraphDump
from torch_tpu_backend.options import CompileOptions
from torch_tpu_backend.target import OutputSpec, Target

log = logging.getLogger("ctpu.backend")
MAX_FALLBACK_SEARCHES = 32  # per graph: beyond this, a segment that keeps failing runs on the CPU whole


def ctpu_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                 **_: Any) -> Callable[..., Any]:
    """The dynamo backend: AOT autograd with core-ATen decompositions around our graph compiler."""
    from torch._dynamo.backends.common import aot_autograd

    from fx_passes import decomposition_table  # core ATen, with an SDPA rule that keeps what its backward reads
    from torch_tpu_backend import recompile_watch
    from torch_tpu_backend.partition import recompute_partition

    recompile_watch.install()  # calls dynamo stops handing to this backend get a warning and are counted
    opts = CompileOptions.resolve(options)
    compiler = GraphCompiler(opts, make_target(opts))
    # keep_inference_input_mutations: an inference graph writes its mutated inputs itself (trailing
    # `copy_(input, value)` nodes, a KV cache update in place), instead of returning the whole new value
    # for AOT's wrapper to copy back on the CPU every call. recompute_partition: the forward under grad
    # mode saves only its inputs, so it lowers as the inference graph does.
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler.backward, decompositions=decomposition_table(),
                           keep_inference_input_mutations=True, partition_fn=recompute_partition)
    return backend(gm, example_inputs)


def make_target(opts: CompileOptions) -> Target:
    """The back end the options name: the CTPU (sim, rtl) or NVIDIA Hopper (ptx)."""
    if opts.target == "ptx":
        from torch_tpu_backend.ptx_target import PtxTarget

        return PtxTarget(opts)
    from torch_tpu_backend.ctpu_target import CtpuTarget

    return CtpuTarget(opts)


@dataclass
class GraphCompiler:
    """Compiles one AOT (core-ATen) graph into a callable running its segments on the target or the CPU.
    Target-agnostic: everything it needs to know about the back end, it asks the target."""

    opts: CompileOptions
    target: Target
    graphs: int = field(default=0)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any],
                 backward: bool = False) -> Callable[..., Any]:
        import fx_passes.dynamic

        self.graphs += 1
        exec_stats.record_graph_compiled()
        bumped = set() if backward else _bumped_by_caller(gm)
        if fx_passes.dynamic.is_dynamic(gm):
            return self._compile_dynamic(gm, example_inputs, bumped)
        return self._compile_static(gm, example_inputs, bumped)

    def _compile_dynamic(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], bumped: set[str]
                         ) -> Callable[..., Any]:
        """Symbolic sizes: the padding masked once (fx_passes.dynamic), one padded program per bucket."""
        from torch._functorch.aot_autograd import make_boxed_func

        from fx_passes.dynamic import copy_graph_module, mask_padding
        from torch_tpu_backend.dynamic import DynamicGraph

        graph = self.graphs
        try:
            masked = copy_graph_module(gm)  # gm itself stays as traced: the CPU fallback runs it
            plan = mask_padding(masked)
        except Exception as e:  # a node that could observe its padding: all of the graph on the CPU
            log.info("ctpu: graph %d with symbolic sizes is refused", graph, exc_info=True)
            warnings.warn(f"ctpu: graph {graph} runs on the CPU: {type(e).__name__}: {str(e)[:300]}",
                          _fallback_warning(), stacklevel=3)
            gm.recompile()
            return make_boxed_func(CpuSegment(gm))
        log.info("ctpu: graph %d has symbolic sizes %s: one padded program per bucket", graph, plan.symbols)

        def compile_variant(static: torch.fx.GraphModule, examples: list[Any]) -> Callable[..., Any]:
            return self._compile_static(static, examples, bumped, graph)

        return DynamicGraph(masked, plan, compile_variant, f"graph {graph}", self.opts.dynamic_max)

    def _compile_static(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], bumped: set[str],
                        graph: int | None = None) -> Callable[..., Any]:
        from torch._functorch.aot_autograd import make_boxed_func

        import fx_passes

        graph = self.graphs if graph is None else graph
        dump = GraphDump(Path(self.opts.dump_dir) if self.opts.dump_dir else None,
                         cache.make_key(str(gm.graph), signature(example_inputs)))
        dump.stage("fx_aten", gm.print_readable(print_output=False))
        try:
            gm, report = fx_passes.run_passes(gm, example_inputs, fuse=self.target.fuse_elementwise,
                                              unsupported_reason=self.target.unsupported_reason)
        except Exception as e:  # the passes refuse the graph or fail: all of it on the CPU
            log.info("ctpu: fx_passes refused graph %d", graph, exc_info=True)
            warnings.warn(f"ctpu: graph {graph} runs on the CPU: {type(e).__name__}: {str(e)[:300]}",
                          _fallback_warning(), stacklevel=2)
            gm.recompile()  # the passes keep the graph's meaning: whatever they did before failing runs as is
            return make_boxed_func(CpuSegment(gm))
        dump.stage("fx_after_passes", gm.print_readable(print_output=False))
        dump.stage("fx_passes_report", report.summary())
        module, partition, segments = self._compile_segments(gm, report.partition, dump, bumped)
        cpu_nodes = [n for seg in partition.segments if seg.placement == "cpu" for n in seg.nodes]
        if cpu_nodes:
            ops = [n for n in cpu_nodes if n.target is not operator.getitem]
            warnings.warn(f"ctpu: graph {graph}: {len(ops)} op(s) run on the CPU: "
                          f"{fx_passes.fallback_summary(cpu_nodes)}", _fallback_warning(), stacklevel=2)
        dump.summary({"target": self.target.name, "config": self.opts.config, "segments": segments,
                      "fusions": dict(report.fusions), "fallback_ops": fx_passes.fallback_summary(cpu_nodes)})
        return make_boxed_func(module)

    def backward(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        """AOT's bw_compiler: the tracing context's input metadata is the forward's, not this graph's."""
        return self(gm, example_inputs, backward=True)

    def _compile_segments(self, gm: torch.fx.GraphModule, partition: Any, dump: GraphDump, bumped: set[str]
                          ) -> tuple[torch.fx.GraphModule, Any, list[dict[str, Any]]]:
        """Split into segments and compile each target segment. A segment that fails to compile gives up
        only the node that makes it fail (the shortest failing prefix ends with it): that node joins the
        CPU, and the graph is split again."""
        import fx_passes

        forced: dict[torch.fx.Node, str] = {}
        cuts: set[torch.fx.Node] = set()  # nodes that start a new target segment (a program too large)
        compiled: dict[str, Any] = {}  # a segment's graph text -> its executable, across re-splits
        while True:
            partition = cut_segments(partition, cuts)
            split = split_segments(gm, partition)
            failure = None
            summaries = []
            for name, seg_nodes in split.segments.items():
                sub = getattr(split.module, name)
                if split.placements[name] == "cpu":
                    setattr(split.module, name, CpuSegment(sub))
                    summaries.append({"segment": name, "placement": "cpu", "ops": CpuSegment(sub).op_names})
                    continue
                try:
                    exe = self._compile(sub, name, dump, compiled)
                except Exception as e:
                    failure = (seg_nodes, e)
                    break
                setattr(split.module, name, TargetSegment(self.target, exe, name, sub, bumped))
                summaries.append({"segment": name, "placement": self.target.name,
                                  **_executable_summary(exe)})
            if failure is None:
                split.module.recompile()
                return split.module, partition, summaries
            nodes, err = failure
            cut = _middle(nodes) if getattr(err, "splittable", False) else None
            if cut is not None:  # the program is too large, not wrong: two programs, launched one after the other
                log.info("ctpu: a segment of %d nodes is split at %s: %s", len(nodes), cut.name, err)
                cuts.add(cut)
                continue
            if len(forced) >= MAX_FALLBACK_SEARCHES:
                culprits = dict.fromkeys(nodes, _reason(self.target, err))
            else:
                culprits = self._culprit(gm, nodes, err, dump, compiled)
            forced.update(culprits)
            partition = fx_passes.partition(gm, self.target.unsupported_reason, forced)

    def _compile(self, sub: torch.fx.GraphModule, name: str, dump: GraphDump, compiled: dict[str, Any]) -> Any:
        key = str(sub.graph)
        if key not in compiled:
            try:
                compiled[key] = self.target.compile(sub, _example_inputs(sub), name, dump)
            except Exception as e:
                compiled[key] = e
        if isinstance(compiled[key], Exception):
            raise compiled[key]
        return compiled[key]

    def _culprit(self, gm: torch.fx.GraphModule, nodes: list[torch.fx.Node], err: Exception, dump: GraphDump,
                 compiled: dict[str, Any]) -> dict[torch.fx.Node, str]:
        """The node ending the shortest prefix of `nodes` that fails to compile, with the error's reason."""
        from fx_passes.graph_utils import extract_subgraph

        lo, hi, last_error = 1, len(nodes), err
        while lo < hi:
            mid = (lo + hi) // 2
            try:
                self._compile(extract_subgraph(gm, nodes[:mid]), f"search_{mid}", _NO_DUMP, compiled)
                lo = mid + 1
            except Exception as e:
                hi, last_error = mid, e
        culprit = nodes[lo - 1]
        log.info("ctpu: %s (%s) cannot run on the %s: %s", culprit.name, culprit.target, self.target.name,
                 last_error)
        return {culprit: _reason(self.target, last_error)}


_NO_DUMP = GraphDump(None, "")


def _bumped_by_caller(gm: torch.fx.GraphModule) -> set[str]:
    """The graph inputs AOT autograd's wrapper moves the version counter of after each call (inputs the graph
    mutates in place, seen by autograd): their placeholder names. Empty outside an AOT compile."""
    from torch._guards import TracingContext

    meta = getattr(TracingContext.try_get(), "fw_metadata", None)
    indices = getattr(meta, "mutated_graph_handled_indices_seen_by_autograd", None) or ()
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    return {placeholders[i].name for i in indices if i < len(placeholders)}


def _reason(target: Target, err: Exception) -> str:
    """Why a node that failed to compile runs on the CPU. The target classifies its own errors (the PTX target
    needs no CTPU compiler): a refusal (an op or shape it does not lower) or else an internal error."""
    refusal = target.refusal_reason(err)
    if refusal is not None:
        return refusal[:300]
    log.error("ctpu: internal compiler error", exc_info=err)
    return f"internal compiler error, please report: {type(err).__name__}: {str(err)[:300]}"


def _executable_summary(exe: Any) -> dict[str, Any]:
    summary = getattr(exe, "summary", None) or {}
    program = getattr(exe, "program", None)
    return {"bundles": len(program) if program is not None else None,
            **{k: summary.get(k) for k in ("kernels", "arena_bytes", "spilled")}}


@dataclass
class SplitGraph:
    module: torch.fx.GraphModule
    placements: dict[str, str]  # submodule name -> "ctpu" | "cpu"
    segments: dict[str, list[torch.fx.Node]]  # submodule name -> the nodes of gm it holds


def _middle(nodes: list[torch.fx.Node]) -> torch.fx.Node | None:
    """The node to cut a segment at, near its middle: not a getitem (it stays with the node whose tuple it
    reads: a tuple is not a segment's input). None when the segment cannot be cut."""
    for i in [*range(len(nodes) // 2, len(nodes)), *range(len(nodes) // 2 - 1, 0, -1)]:
        if nodes[i].target is not operator.getitem:
            return nodes[i]
    return None


def cut_segments(partition: Any, cuts: Collection[torch.fx.Node]) -> Any:
    """The partition with a new segment (same placement) starting at each node in `cuts`."""
    if not cuts:
        return partition
    segments = []
    for seg in partition.segments:
        start = 0
        for i, node in enumerate(seg.nodes):
            if i > start and node in cuts:
                segments.append(type(seg)(seg.placement, seg.nodes[start:i]))
                start = i
        segments.append(type(seg)(seg.placement, seg.nodes[start:]))
    return type(partition)(segments)


def split_segments(gm: torch.fx.GraphModule, partition: Any) -> SplitGraph:
    """One submodule per partition segment (consecutive nodes with one placement), called in order."""
    from torch.fx.passes.split_module import split_module

    segment_of: dict[torch.fx.Node, int] = {}
    for i, seg in enumerate(partition.segments):
        for node in seg.nodes:
            segment_of[node] = i
    last = 0

    def which(node: torch.fx.Node) -> int:
        nonlocal last
        last = segment_of.get(node, last)  # structural nodes ride with the segment before them
        return last

    module = split_module(gm, None, which, keep_original_order=True)
    _pass_valid_lengths(module)
    placements, segments = {}, {}
    for i, seg in enumerate(partition.segments):
        if hasattr(module, f"submod_{i}"):
            placements[f"submod_{i}"] = seg.placement
            segments[f"submod_{i}"] = seg.nodes
    return SplitGraph(module, placements, segments)


def _pass_valid_lengths(module: torch.fx.GraphModule) -> None:
    """A dynamic-shape bucket's valid lengths that a segment's nodes name in their padding mark
    (fx_passes.dynamic.PADDING_META) become inputs of that segment even where no node reads them as a value
    (split_module keeps only the inputs read): codegen bounds those nodes' matmul rows by them."""
    from fx_passes.dynamic import PADDING_META

    inputs = {n.name: n for n in module.graph.find_nodes(op="placeholder")}
    for call in module.graph.find_nodes(op="call_module"):
        sub = getattr(module, str(call.target))
        placeholders = list(sub.graph.find_nodes(op="placeholder"))
        named = {name for n in sub.graph.nodes for name in n.meta.get(PADDING_META, {}).values()}
        missing = sorted(named - {p.name for p in placeholders} & inputs.keys())
        for name in missing:
            with sub.graph.inserting_after(placeholders[-1] if placeholders else None):
                node = sub.graph.placeholder(name)
            node.meta["val"] = inputs[name].meta.get("val")
            placeholders.append(node)
            call.args = (*call.args, inputs[name])
        if missing:
            sub.recompile()
    module.recompile()


def _example_inputs(sub: torch.fx.GraphModule) -> list[Any]:
    vals = []
    for node in sub.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if val is None:
            raise ValueError(f"segment input {node.name} has no example value (meta['val'])")
        vals.append(val)
    return vals


class TargetSegment(torch.nn.Module):
    """A compiled segment: one executable, launched through its target. Its outputs are made as the FX graph
    says (dtype, device: a ctpu tensor stays on ctpu, a `.cpu()` result is a CPU tensor)."""

    def __init__(self, target: Target, executable: Any, name: str, sub: torch.fx.GraphModule,
                 bumped: Collection[str] = ()) -> None:
        super().__init__()
        self.target, self.executable, self.name, self.sub = target, executable, name, sub
        self.op_names = _op_names(sub)
        self.warned = False
        self.bumped_after = frozenset(i for i, p in enumerate(sub.graph.find_nodes(op="placeholder"))
                                      if p.name in bumped)
        output = next(iter(sub.graph.find_nodes(op="output")))
        results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        self.returns_tuple = isinstance(output.args[0], (tuple, list))
        self.outputs = [OutputSpec(r.meta["val"].dtype, r.meta["val"].device) for r in results]

    def forward(self, *args: Any) -> Any:
        from device_sim.executable import InputRangeError

        try:
            outs = self.target.launch(self.executable, args, self.outputs, self.name, self.bumped_after)
        except InputRangeError as e:  # this call's values, not the graph: this call runs on the CPU
            if not self.warned:
                self.warned = True
                warnings.warn(f"ctpu: {self.name}: {e}; calls with such values run on the CPU",
                              _fallback_warning(), stacklevel=2)
            for op in self.op_names:
                exec_stats.record_fallback(op)
            return self.sub(*args)
        return tuple(outs) if self.returns_tuple else outs[0]


def _op_names(sub: torch.fx.GraphModule) -> list[str]:
    return [str(n.target) for n in sub.graph.nodes if n.op in ("call_function", "call_module")
            and n.target is not operator.getitem]


def _fallback_warning() -> type[Warning]:
    from fx_passes import CtpuFallbackWarning

    return CtpuFallbackWarning


class CpuSegment(torch.nn.Module):
    """A segment the target does not run: executed eagerly on the CPU, counted in the execution statistics."""

    def __init__(self, sub: torch.fx.GraphModule) -> None:
        super().__init__()
        self.sub = sub
        self.op_names = _op_names(sub)

    def forward(self, *args: Any) -> Any:
        for op in self.op_names:
            exec_stats.record_fallback(op)
        return self.sub(*args)
