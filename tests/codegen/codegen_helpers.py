"""Shared helpers: trace a function to a core-ATen FX graph, compile it, run it on the simulator."""

from __future__ import annotations

import numpy as np
import torch
from torch._decomp import core_aten_decompositions
from torch.fx.experimental.proxy_tensor import make_fx

from codegen import compile_graph
from device_sim.executable import Executable, run_fresh
from device_sim.runners import SimulatorRunner


def trace(fn, *xs: torch.Tensor) -> torch.fx.GraphModule:
    return make_fx(fn, decomposition_table=core_aten_decompositions())(*xs)


def compile_and_run(fn, *xs: torch.Tensor, config: str = "small", **options) -> tuple[list[np.ndarray],
                                                                                     list[np.ndarray], Executable]:
    gm = trace(fn, *xs)
    cg = compile_graph(gm, list(xs), config, **options)
    outs, stats = run_fresh(cg, [x.float().numpy() for x in xs], SimulatorRunner(config))
    ref = fn(*xs)
    ref = list(ref) if isinstance(ref, (tuple, list)) else [ref]
    cg.last_stats = stats  # type: ignore[attr-defined]
    return outs, [r.float().numpy() for r in ref], cg
