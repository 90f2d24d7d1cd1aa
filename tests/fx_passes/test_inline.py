"""inline_fused_kernels undoes fuse_elementwise: same computation, plain core-ATen nodes, meta kept."""

from __future__ import annotations

import torch
from fx_helpers import aot_trace, run_graph

from fx_passes import FusedGroup, inline_fused_kernels, run_passes


def test_inlining_restores_aten_nodes_with_meta() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.cumsum(torch.exp(x * 2.0 + y), dim=1) * 3.0 - torch.arange(8.0)

    x, y = torch.randn(4, 8), torch.randn(8)
    traced = aot_trace(f, x, y)
    gm, _ = run_passes(traced.gm, traced.inputs)
    assert any(isinstance(m, FusedGroup) for m in gm.modules())
    expected = run_graph(gm, traced.inputs)
    inline_fused_kernels(gm)
    assert not any(n.op == "call_module" for n in gm.graph.nodes)
    assert all("val" in n.meta for n in gm.graph.nodes if n.op == "call_function")
    torch.testing.assert_close(run_graph(gm, traced.inputs), expected)
