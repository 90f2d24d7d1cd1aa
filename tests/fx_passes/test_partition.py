"""Partitioning: the target decides each node (here the CTPU's code generator), reasons are kept, the passes
never warn (the backend warns once per graph), unknown ops never crash."""

from __future__ import annotations

import warnings

import torch
from fx_helpers import aot_trace, passes_verified, run_graph
from torch.fx.experimental.proxy_tensor import make_fx

import codegen
from fx_passes import CtpuFallbackWarning, fallback_reason, fallback_summary, partition, run_passes

# Ops nobody taught fx_passes about (registered once per process, in a test-only namespace).
FAKE_KERNEL_BROKEN = {"flaky": False}
if not hasattr(torch.ops.ctpu_test, "mystery"):

    @torch.library.custom_op("ctpu_test::mystery", mutates_args=())
    def _mystery(x: torch.Tensor) -> torch.Tensor:
        return x.flip(0)

    @_mystery.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    @torch.library.custom_op("ctpu_test::flaky", mutates_args=())
    def _flaky(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @_flaky.register_fake
    def _(x: torch.Tensor) -> torch.Tensor:
        if FAKE_KERNEL_BROKEN["flaky"]:
            raise RuntimeError("fake kernel broken")
        return torch.empty_like(x)


def test_unsupported_ops_are_named_with_their_reasons() -> None:
    def fn(x):
        y = torch.cumprod(x * 2, 0)
        z = torch.cumprod(torch.exp(y), 1)
        return torch.cummax(z, 0).values + 1

    traced = aot_trace(fn, torch.randn(4, 8))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CtpuFallbackWarning)
        report = passes_verified(traced)
    message = fallback_summary(report.partition.fallback)
    assert "aten.cumprod.default (x2): " in message and "aten.cummax.default: " in message
    assert "no CTPU lowering" in message
    assert report.fallback_ops == ["aten.cummax.default", "aten.cumprod.default"]
    placements = [s.placement for s in report.partition.segments]
    assert placements == ["ctpu", "cpu", "ctpu", "cpu", "ctpu"]
    torch.testing.assert_close(run_graph(traced.gm, traced.inputs)[0], traced.eager)


def test_supported_graph_does_not_warn() -> None:
    traced = aot_trace(lambda x, w: torch.relu(x @ w).sum(-1), torch.randn(4, 8), torch.randn(8, 3))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CtpuFallbackWarning)
        report = passes_verified(traced)
    assert report.fallback_ops == [] and [s.placement for s in report.partition.segments] == ["ctpu"]


def test_unknown_op_falls_back_without_crashing() -> None:
    traced = aot_trace(lambda x: torch.ops.ctpu_test.mystery(x * 2) + 1, torch.randn(4, 3))
    report = passes_verified(traced)
    assert report.fallback_ops == ["ctpu_test.mystery.default"]
    node = next(n for n in traced.gm.graph.nodes if "mystery" in str(n.target))
    assert node.meta["ctpu_placement"] == "cpu"
    assert "no CTPU lowering" in fallback_reason(node, traced.gm, codegen.unsupported_reason)


def test_unknown_op_whose_fake_kernel_fails_later_keeps_its_traced_value() -> None:
    traced = aot_trace(lambda x: torch.ops.ctpu_test.flaky(x * 2) * 3, torch.randn(4, 3))
    FAKE_KERNEL_BROKEN["flaky"] = True
    try:
        report = passes_verified(traced)
        assert report.fallback_ops == ["ctpu_test.flaky.default"]
    finally:
        FAKE_KERNEL_BROKEN["flaky"] = False
    torch.testing.assert_close(run_graph(traced.gm, traced.inputs)[0], traced.eager)


def test_partition_labels_every_compute_node() -> None:
    gm = make_fx(lambda x: torch.exp(x).t() @ x)(torch.randn(3, 3))
    part = partition(gm, codegen.unsupported_reason)
    compute = [n for n in gm.graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    assert part.supported == compute and part.fallback == []
    assert {n.meta["ctpu_placement"] for n in compute} == {"ctpu"}


def test_without_a_target_every_node_is_placed_on_it() -> None:
    gm = make_fx(lambda x: torch.cumprod(x, 0))(torch.randn(3))
    _, report = run_passes(gm, [torch.randn(3)])
    assert report.fallback_ops == []
    _, report = run_passes(gm, [torch.randn(3)], unsupported_reason=codegen.unsupported_reason)
    assert report.fallback_ops == ["aten.cumprod.default"]
