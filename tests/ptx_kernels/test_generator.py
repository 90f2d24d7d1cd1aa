"""The fusion generator lowers distinct FX subgraphs (make_fx core-ATen and symbolic_trace) to valid PTX."""

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ptx_kernels import assemble, kernel_for_subgraph


def bias_gelu(x, b):
    return torch.nn.functional.gelu(x + b)


def rmsnorm(x, w):
    v = x.float()
    return (v * torch.rsqrt((v * v).mean(-1, keepdim=True) + 1e-6) * w).to(torch.bfloat16)


def softmax_and_max(x):
    mx = x.amax(-1, keepdim=True)
    e = torch.exp(x - mx)
    return e / e.sum(-1, keepdim=True), mx


def select(x, y, c):
    return torch.where(c, torch.maximum(x, y), torch.tanh(y) ** 2 - torch.abs(x))


def logsig(x, y):
    return torch.log(torch.sigmoid(x) + 1.0) * torch.sqrt(torch.relu(y)) / (-y + 3.0)


def minmax_scale(x):
    lo = x.amin(-1, keepdim=True)
    return (x - lo) / (x.amax(-1, keepdim=True) - lo + 1e-5)


F32, BF16 = torch.float32, torch.bfloat16
CASES = [
    (bias_gelu, [(4, 33), (33,)], [F32, F32], "elementwise"),
    (rmsnorm, [(3, 100), (100,)], [BF16, F32], "reduction"),
    (softmax_and_max, [(5, 70)], [F32], "reduction"),
    (select, [(2, 3, 5), (3, 1), (2, 3, 5)], [F32, F32, torch.bool], "elementwise"),
    (logsig, [(1000,), (1000,)], [BF16, BF16], "elementwise"),
    (minmax_scale, [(6, 300)], [F32], "reduction"),
]


def _inputs(shapes, dtypes):
    return [torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)]


@pytest.mark.parametrize("fn,shapes,dtypes,kind", CASES, ids=[c[0].__name__ for c in CASES])
@pytest.mark.parametrize("tracer", ["make_fx", "symbolic_trace"])
def test_subgraph_assembles(fn, shapes, dtypes, kind, tracer):
    gm = make_fx(fn)(*_inputs(shapes, dtypes)) if tracer == "make_fx" else torch.fx.symbolic_trace(fn)
    kernel = kernel_for_subgraph(gm, shapes, dtypes)
    assert kernel.notes["kind"] == kind
    report = assemble(kernel)
    assert report.spill_stores == 0 and report.spill_loads == 0


def test_outputs_follow_graph_dtypes():
    gm = make_fx(rmsnorm)(*_inputs([(3, 100), (100,)], [BF16, F32]))
    kernel = kernel_for_subgraph(gm, [(3, 100), (100,)], [BF16, F32])
    assert [(o.shape, o.dtype) for o in kernel.outputs] == [((3, 100), BF16)]


def test_each_op_emits_instructions():
    """Not a fixed template: a longer graph gives a longer kernel."""
    short = make_fx(lambda x: torch.exp(x))(torch.zeros(64))
    longer = make_fx(lambda x: torch.exp(torch.exp(x) * 2.0))(torch.zeros(64))
    assert len(kernel_for_subgraph(longer, [(64,)], [F32]).ptx) > len(
        kernel_for_subgraph(short, [(64,)], [F32]).ptx
    )


def test_unsupported_op_names_the_node():
    gm = make_fx(lambda x: torch.cumsum(x, -1))(torch.zeros(4, 8))
    with pytest.raises(NotImplementedError, match="cumsum"):
        kernel_for_subgraph(gm, [(4, 8)], [F32])


def test_non_last_dim_reduction_is_refused():
    gm = make_fx(lambda x: x.sum(0))(torch.zeros(4, 8))
    with pytest.raises(NotImplementedError, match="last dim"):
        kernel_for_subgraph(gm, [(4, 8)], [F32])
