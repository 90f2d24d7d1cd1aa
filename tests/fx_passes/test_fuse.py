"""Generic fusion: elementwise / reduction groups become FusedGroup call_modules."""

from __future__ import annotations

import logging

import pytest
import torch
from fx_helpers import aot_trace, passes_verified

from fx_passes import FusedGroup, fusion_groups
from fx_passes.op_sets import ELEMENTWISE, REDUCTIONS


def fused(fn, *args):
    traced = aot_trace(fn, *args)
    report = passes_verified(traced)
    return traced.gm, report


def kernels(gm) -> list[tuple[str, list[str]]]:
    """(kind, ops of the subgraph) of every FusedGroup, in graph order."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(node.target)
            assert isinstance(module, FusedGroup)
            ops = [str(n.target) for n in module.subgraph.graph.nodes if n.op == "call_function"]
            out.append((module.kind, ops))
    return out


def test_elementwise_chain_is_one_kernel() -> None:
    gm, report = fused(lambda x, y: torch.exp(x * 2 + y).neg(), torch.randn(4, 8), torch.randn(8))
    assert kernels(gm) == [
        ("elementwise", ["aten.mul.Tensor", "aten.add.Tensor", "aten.exp.default", "aten.neg.default"])
    ]
    assert report.changes["fuse"] == {"elementwise": 1}
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "placeholder", "call_module", "output"]


def test_value_used_outside_ends_a_group(caplog: pytest.LogCaptureFixture) -> None:
    def fn(x):
        a = torch.sigmoid(x * 3)
        return torch.exp(a) + 1, a.sum(-1)

    with caplog.at_level(logging.DEBUG, logger="ctpu.fusion"):
        gm, _ = fused(fn, torch.randn(4, 8))
    assert sorted(kernels(gm)) == [
        ("elementwise", ["aten.exp.default", "aten.add.Tensor"]),
        ("elementwise", ["aten.mul.Tensor", "aten.sigmoid.default"]),
    ]
    assert "stays out of add's group: used by sum_1" in caplog.text


def test_reduction_with_broadcast_is_one_kernel() -> None:
    gm, report = fused(lambda x: (x - x.amax(-1, keepdim=True)).exp().sum(-1), torch.randn(4, 8))
    ((kind, ops),) = kernels(gm)
    assert kind == "reduction" and ops[0] == "aten.amax.default" and ops[-1] == "aten.sum.dim_IntList"
    assert report.fusions["reduction"] == 1


def test_reductions_over_different_dims_stay_apart(caplog: pytest.LogCaptureFixture) -> None:
    def fn(x):
        return (x.sum(-1, keepdim=True) * x.amax(0, keepdim=True)).exp()

    with caplog.at_level(logging.DEBUG, logger="ctpu.fusion"):
        gm, _ = fused(fn, torch.randn(4, 8))
    assert len(kernels(gm)) == 1
    assert "unlike the group" in caplog.text


def test_kernel_subgraph_is_core_aten_and_runs() -> None:
    gm, _ = fused(lambda x: torch.tanh(x) * 0.5 + torch.rsqrt(x.abs() + 1), torch.randn(4, 8))
    (group,) = fusion_groups(gm)
    assert group.kind == "elementwise" and group.subgraph is not None
    for node in group.subgraph.graph.nodes:
        assert node.op in ("placeholder", "output") or node.target in ELEMENTWISE | REDUCTIONS
    module = gm.get_submodule(group.attrs["target"])
    x = torch.randn(4, 8)
    torch.testing.assert_close(module(x), torch.tanh(x) * 0.5 + torch.rsqrt(x.abs() + 1))
    assert [p.meta["val"].shape for p in module.inputs] == [torch.Size([4, 8])]
    assert len(module.outputs) == 1


def test_single_ops_and_non_elementwise_ops_are_not_kernels() -> None:
    gm, report = fused(lambda x: torch.cumsum(torch.exp(x), 0).t(), torch.randn(4, 8))
    assert kernels(gm) == [] and report.changes["fuse"] == {}
