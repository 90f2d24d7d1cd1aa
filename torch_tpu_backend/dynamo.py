"""The `ctpu` torch.compile backend, found through the `torch_dynamo_backends` entry point.

    model = torch.compile(model, backend="ctpu", options={"target": "sim", "config": "small"})

Dynamo's graph goes through AOT autograd with core-ATen decompositions, then `fx_passes.run_passes`
(normalise, fuse, partition). Every segment the CTPU supports becomes one compiled program (by default the
whole graph: one megakernel, launched once); a segment the CTPU cannot run (or that codegen rejects) runs
on the CPU, with one warning naming its ops. Options (or environment variables):

    target            "sim" (default, $CTPU_TARGET), "rtl", or "ptx"
    config            hardware configuration: "small" (default, $CTPU_CONFIG) or "large"
    dump_dir          write every stage of every graph here ($CTPU_DUMP_DIR)
    cache             use the on-disk compile cache (default True; $CTPU_CACHE=0 disables)
    matmul_precision  "highest" | "high" | "medium" (default: torch.get_float32_matmul_precision())
"""

from __future__ import annotations

import json
import logging
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx

from torch_tpu_backend import cache, runtime
from torch_tpu_backend import stats as exec_stats
from torch_tpu_backend.dump import GraphDump, dump_root

log = logging.getLogger("ctpu.backend")
MATMUL_PRECISIONS = ("highest", "high", "medium")


@dataclass(frozen=True)
class CompileOptions:
    target: str = "sim"
    config: str = "small"
    dump_dir: str | None = None
    cache: bool = True
    matmul_precision: str | None = None

    @classmethod
    def resolve(cls, options: dict[str, Any] | None) -> CompileOptions:
        options = dict(options or {})
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"ctpu backend: unknown option(s) {unknown}; known: {sorted(known)}")
        target = options.get("target") or runtime.default_target()
        if target not in runtime.TARGETS:
            raise ValueError(f"ctpu backend: target {target!r}; expected one of {runtime.TARGETS}")
        from device_sim.config import get_config

        config = get_config(options.get("config") or runtime.default_config()).name
        precision = options.get("matmul_precision")
        if precision is not None and precision not in MATMUL_PRECISIONS:
            raise ValueError(f"ctpu backend: matmul_precision {precision!r}; expected one of {MATMUL_PRECISIONS}")
        dump = dump_root(options.get("dump_dir"))
        return cls(target, config, str(dump) if dump else None, bool(options.get("cache", True)), precision)


def ctpu_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict[str, Any] | None = None,
                 **_: Any) -> Callable[..., Any]:
    """The dynamo backend: AOT autograd with core-ATen decompositions around our graph compiler."""
    from torch._decomp import core_aten_decompositions
    from torch._dynamo.backends.common import aot_autograd

    opts = CompileOptions.resolve(options)
    compiler = GraphCompiler(opts)
    backend = aot_autograd(fw_compiler=compiler, bw_compiler=compiler, decompositions=core_aten_decompositions())
    return backend(gm, example_inputs)


@dataclass
class GraphCompiler:
    """Compiles one AOT (core-ATen) graph into a callable running its segments on the CTPU or the CPU."""

    opts: CompileOptions
    graphs: int = field(default=0)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any]) -> Callable[..., Any]:
        import fx_passes

        self.graphs += 1
        dump = GraphDump(_dump_path(self.opts), cache.make_key(str(gm.graph), _signature(example_inputs)))
        dump.stage("fx_aten", gm.print_readable(print_output=False))
        try:
            gm, report = fx_passes.run_passes(gm, example_inputs)
        except Exception as e:  # the passes refuse the graph (a symbolic size) or fail: all of it on the CPU
            log.info("ctpu: fx_passes refused graph %d", self.graphs, exc_info=True)
            warnings.warn(f"ctpu: graph {self.graphs} runs on the CPU: {type(e).__name__}: {str(e)[:300]}",
                          _fallback_warning(), stacklevel=2)
            gm.recompile()  # the passes keep the graph's meaning: whatever they did before failing runs as is
            return CpuSegment(gm)
        dump.stage("fx_after_passes", gm.print_readable(print_output=False))
        dump.stage("fx_passes_report", report.summary())
        if self.opts.target == "ptx":
            from torch_tpu_backend.ptx_target import compile_for_ptx

            return compile_for_ptx(gm, report, self.opts, dump)
        split = split_segments(gm, report.partition)
        kernels: list[dict[str, Any]] = []
        for name, placement in split.placements.items():
            sub = getattr(split.module, name)
            if placement == "ctpu":
                kernel = CtpuKernel.build(sub, self.opts, dump, name)
                if kernel is not None:
                    setattr(split.module, name, kernel)
                    kernels.append({"segment": name, "placement": "ctpu", **kernel.summary})
                    continue
            setattr(split.module, name, CpuSegment(sub))
            kernels.append({"segment": name, "placement": "cpu", "ops": CpuSegment(sub).op_names})
        dump.summary({"target": self.opts.target, "config": self.opts.config, "segments": kernels,
                      "fusions": dict(report.fusions), "fallback_ops": report.fallback_ops})
        split.module.recompile()
        return split.module


def _dump_path(opts: CompileOptions) -> Any:
    return opts.dump_dir and os.fspath(opts.dump_dir)


def _signature(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((tuple(v.shape), str(v.dtype), tuple(v.stride())) if isinstance(v, torch.Tensor) else repr(v)
                 for v in values)


@dataclass
class SplitGraph:
    module: torch.fx.GraphModule
    placements: dict[str, str]  # submodule name -> "ctpu" | "cpu"


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
    placements = {}
    for i, seg in enumerate(partition.segments):
        if hasattr(module, f"submod_{i}"):
            placements[f"submod_{i}"] = seg.placement
    return SplitGraph(module, placements)


def _example_inputs(sub: torch.fx.GraphModule) -> list[Any]:
    vals = []
    for node in sub.graph.find_nodes(op="placeholder"):
        val = node.meta.get("val")
        if val is None:
            raise ValueError(f"segment input {node.name} has no example value (meta['val'])")
        vals.append(val)
    return vals


class CtpuKernel(torch.nn.Module):
    """A compiled segment: one CTPU program launched through the runtime on the chosen target."""

    def __init__(self, compiled: Any, opts: CompileOptions, name: str, returns_tuple: bool,
                 out_dtypes: list[torch.dtype]) -> None:
        super().__init__()
        self.compiled, self.opts, self.name = compiled, opts, name
        self.returns_tuple, self.out_dtypes = returns_tuple, out_dtypes

    @property
    def summary(self) -> dict[str, Any]:
        return {"bundles": len(self.compiled.program), **{k: self.compiled.summary.get(k)
                                                          for k in ("kernels", "arena_bytes", "spilled")}}

    @classmethod
    def build(cls, sub: torch.fx.GraphModule, opts: CompileOptions, dump: GraphDump, name: str) -> CtpuKernel | None:
        """Compile a segment (through the cache); None if codegen cannot lower it (the caller falls back)."""
        import codegen
        import fx_passes

        examples = _example_inputs(sub)
        output = next(iter(sub.graph.find_nodes(op="output")))
        results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
        out_dtypes = [r.meta["val"].dtype for r in results]
        returns_tuple = isinstance(output.args[0], (tuple, list))
        # the CTPU fuses through MLIR (linalg elementwise fusion): FusedKernel groups go back to ATen nodes
        sub = fx_passes.inline_fused_kernels(sub)
        precision = opts.matmul_precision or torch.get_float32_matmul_precision()
        key = cache.make_key(str(sub.graph), _signature(examples), opts.config, precision, _constants(sub))
        directory = cache.cache_dir() if opts.cache else None
        try:
            compiled, hit = cache.cached(directory, key, lambda: codegen.compile_graph(
                sub, examples, config=opts.config,
                options={"matmul_precision": precision, "progress": _progress_logger(name)}))
        except codegen.UnsupportedError as e:
            ops = ", ".join(CpuSegment(sub).op_names)
            warnings.warn(f"ctpu: segment {name} ({ops}) cannot run on the CTPU and falls back to CPU: {e}",
                          _fallback_warning(), stacklevel=2)
            return None
        except Exception as e:  # a compiler bug must not break the user's model: CPU, loudly
            log.exception("ctpu: internal compiler error on segment %s", name)
            warnings.warn(f"ctpu: internal compiler error on segment {name}; it runs on the CPU. Please report: "
                          f"{type(e).__name__}: {str(e)[:300]}", _fallback_warning(), stacklevel=2)
            return None
        log.info("ctpu: %s compiled (%d bundles, cache %s)", name, len(compiled.program), "hit" if hit else "miss")
        for stage, text in compiled.stages.items():
            stem, _, ext = stage.rpartition(".")
            dump.stage(f"{name}_{stem or ext}", text, ext if stem else "txt")
        dump.stage(f"{name}_program", compiled.program.to_bytes(), "bin")
        dump.stage(f"{name}_summary", json.dumps(compiled.summary, indent=2, default=str), "json")
        return cls(compiled, opts, name, returns_tuple, out_dtypes)

    def forward(self, *args: torch.Tensor) -> Any:
        outs = runtime.run_compiled(self.compiled, args, target=self.opts.target, config=self.opts.config,
                                    name=self.name, out_dtypes=self.out_dtypes)
        return tuple(outs) if self.returns_tuple else outs[0]


def _constants(sub: torch.fx.GraphModule) -> bytes:
    """The bytes of the segment's constant tensors: part of the cache key (weights are not inputs here)."""
    import hashlib

    h = hashlib.sha256()
    for node in sub.graph.find_nodes(op="get_attr"):
        value = getattr(sub, node.target, None)
        if isinstance(value, torch.Tensor):
            h.update(runtime.to_numpy_bits(value).tobytes())
    return h.digest()


def _fallback_warning() -> type[Warning]:
    from fx_passes import CtpuFallbackWarning

    return CtpuFallbackWarning


class CpuSegment(torch.nn.Module):
    """A segment the CTPU does not run: executed eagerly on the CPU, counted in the execution statistics."""

    def __init__(self, sub: torch.fx.GraphModule) -> None:
        super().__init__()
        self.sub = sub
        self.op_names = [str(n.target) for n in sub.graph.nodes if n.op in ("call_function", "call_module")]

    def forward(self, *args: Any) -> Any:
        for op in self.op_names:
            exec_stats.record_fallback(op)
        return self.sub(*args)


def _progress_logger(name: str, every_seconds: float = 5.0) -> Callable[[int, int], None]:
    """A `compile_graph` progress callback: logs (INFO, logger "ctpu.backend") how many kernels of a segment
    are compiled, at most every few seconds, so a long compile shows it is moving."""
    last = time.monotonic()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_seconds or done == total:
            last = now
            log.info("ctpu: %s: %d/%d kernels compiled", name, done, total)
    return report
