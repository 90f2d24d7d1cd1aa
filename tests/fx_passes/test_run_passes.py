"""run_passes as a whole: the report, fusion_groups, the backend-style call, metadata, robustness."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from fx_helpers import aot_trace, passes_verified, run_graph
from torch._functorch.aot_autograd import aot_module_simplified
from torch.fx.experimental.proxy_tensor import make_fx

from fx_passes import CtpuDynamicShapeError, decomposition_table, fusion_groups, run_passes
from fx_passes.graph_utils import refresh_meta
from fx_passes.rewrite import Rewrite, RewritePass

aten = torch.ops.aten
PASS_ORDER = ["normalize", "attention", "norms", "softmax", "rope", "swiglu", "linear", "cleanup", "fuse"]


def block(x, norm_weight, w):
    h = norm_weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    return F.silu(h @ w), torch.exp(x * 2 + 1)


def block_inputs():
    return torch.randn(2, 3, 16), torch.randn(16), torch.randn(16, 8)


def test_report_says_what_each_pass_did() -> None:
    traced = aot_trace(block, *block_inputs())
    report = passes_verified(traced)
    assert list(report.changes) == PASS_ORDER
    assert report.changes["norms"] == {"rms_norm": 1} and report.changes["linear"] == {"linear": 1}
    assert report.changes["fuse"] == {"elementwise": 1}
    assert report.fusions == {"rms_norm": 1, "linear": 1, "elementwise": 1}
    assert report.fallback_ops == []
    summary = report.summary()
    assert "norms: rms_norm x1" in summary and "softmax: no change" in summary
    assert "fallback to CPU: none" in summary


def test_fusion_groups_list_every_fused_node_in_order() -> None:
    traced = aot_trace(block, *block_inputs())
    passes_verified(traced)
    groups = fusion_groups(traced.gm)
    assert [g.kind for g in groups] == ["rms_norm", "linear", "elementwise"]
    norm, linear, kernel = groups
    x, weight = norm.inputs
    assert (x.op, weight.op, norm.attrs) == ("placeholder", "placeholder", {"eps": 1e-6})
    assert linear.inputs[0] is norm.node and linear.inputs[2:] == (None, None)
    assert linear.attrs == {"act": "silu"} and linear.outputs == (linear.node,)
    assert kernel.subgraph is not None and kernel.inputs == (x,)
    order = list(traced.gm.graph.nodes)
    assert [order.index(g.node) for g in groups] == sorted(order.index(g.node) for g in groups)


def ctpu_like_backend(gm, example_inputs):
    """What torch_tpu_backend does with the passes (minus code generation): run the fused graph."""

    def fw_compiler(fw_gm, fake_inputs):
        fused, _ = run_passes(fw_gm, fake_inputs, strict=True)
        return fused

    return aot_module_simplified(
        gm, example_inputs, fw_compiler=fw_compiler, decompositions=decomposition_table()
    )


def test_inside_a_dynamo_backend() -> None:
    args = block_inputs()
    torch._dynamo.reset()
    with torch.no_grad():
        got = torch.compile(block, backend=ctpu_like_backend, dynamic=False)(*args)
    for g, e in zip(got, block(*args), strict=True):
        torch.testing.assert_close(g, e)


def test_dynamic_shapes_are_refused_naming_the_node() -> None:
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: torch.relu(x) * 2, backend=ctpu_like_backend, dynamic=True)
    failed = torch._dynamo.exc.BackendCompilerFailed
    with pytest.raises(failed, match=r"node arg0_1 .* symbolic size s\d+") as info:
        compiled(torch.randn(5))
    assert isinstance(info.value.inner_exception, CtpuDynamicShapeError)


def test_graph_without_metadata_gets_it_from_example_inputs() -> None:
    args = block_inputs()
    gm = make_fx(block)(*args)
    for node in gm.graph.nodes:
        node.meta.pop("val", None)
    _, report = run_passes(gm, list(args), strict=True)
    assert report.fusions["rms_norm"] == 1
    for got, expected in zip(run_graph(gm, args), block(*args), strict=True):
        torch.testing.assert_close(got, expected)


def broken_rule(node, ctx) -> Rewrite | None:
    raise RuntimeError("bug in a rule")


def test_a_failing_rule_is_skipped_and_logged_unless_strict(caplog: pytest.LogCaptureFixture) -> None:
    gm = make_fx(lambda x: x * 2)(torch.randn(3))
    broken = RewritePass("broken", (broken_rule,))
    with caplog.at_level(logging.WARNING, logger="ctpu.fusion"):
        assert broken.run(gm) == {}
    assert "rule broken_rule failed at node mul; skipped" in caplog.text
    with pytest.raises(RuntimeError, match="bug in a rule"):
        broken.run(gm, strict=True)


def test_refresh_meta_repairs_a_view_that_lost_its_layout() -> None:
    fn = lambda x: aten.view.default(aten.permute.default(x, [1, 0]), [12])
    gm = make_fx(fn)(torch.randn(3, 4).t())  # permute makes the transposed input contiguous again
    # The same graph fed a contiguous input (as after a fusion): the view is not viewable any more.
    gm.graph.find_nodes(op="placeholder")[0].meta["val"] = torch.empty(4, 3)
    assert refresh_meta(gm, torch._subclasses.FakeTensorMode()) == 1
    gm.recompile()
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert targets == ["aten.permute.default", "aten.clone.default", "aten.view.default"]
    x = torch.randn(4, 3)
    torch.testing.assert_close(gm(x), x.t().reshape(12))
