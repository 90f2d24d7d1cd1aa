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


I64 = torch.int64


def position_freqs(pos, inv_freq):
    return pos[..., None].float() * inv_freq


def causal_mask(pos, keys):
    return torch.where(keys[None, :] <= pos[:, None], 0.0, float("-inf"))


def embed(weight, ids):
    return torch.nn.functional.embedding(ids, weight)


def rope_table(inv_freq):
    t = torch.arange(12).float()
    f = t[:, None] * inv_freq
    e = torch.cat((f, f), -1)
    return e.cos(), e.sin()


def permute_copy(x):
    return x.permute(0, 2, 1, 3).contiguous().view(2, 5, 12)


def slice_select(x, i):
    return x[:, 2:7:2] * 2.0 + (i[:, None] > 3).float() + x[:, 0:1]


def int_arith(a, b):
    return torch.maximum(a * 3 - b, b), (a == b) & (a > 0)


INDEX_CASES = [
    (position_freqs, [(1, 8), (8,)], [I64, F32]),
    (causal_mask, [(6,), (9,)], [I64, I64]),
    (embed, [(128, 64), (1, 8)], [BF16, I64]),
    (rope_table, [(8,)], [F32]),
    (permute_copy, [(2, 3, 5, 4)], [F32]),
    (slice_select, [(4, 9), (4,)], [F32, torch.int32]),
    (int_arith, [(3, 7), (3, 7)], [I64, I64]),
]


@pytest.mark.parametrize("fn,shapes,dtypes", INDEX_CASES, ids=[c[0].__name__ for c in INDEX_CASES])
def test_indexing_and_integer_subgraphs(fn, shapes, dtypes):
    """Integers, bools and index-moving ops (arange, embedding, cat, permute, slice) are generated."""
    gm = make_fx(fn)(*[torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)])
    kernel = kernel_for_subgraph(gm, shapes, dtypes)
    assert kernel.notes["kind"] == "elementwise"
    report = assemble(kernel)
    assert report.spill_stores == 0 and report.spill_loads == 0
    want = fn(*[torch.zeros(s, dtype=d) for s, d in zip(shapes, dtypes, strict=True)])
    want = want if isinstance(want, tuple) else (want,)
    assert [(o.shape, o.dtype) for o in kernel.outputs] == [(tuple(w.shape), w.dtype) for w in want]


def test_different_subgraphs_get_different_names():
    a = make_fx(lambda x: x * 2.0)(torch.zeros(4))
    b = make_fx(lambda x: x * 3.0)(torch.zeros(4))
    assert kernel_for_subgraph(a, [(4,)], [F32]).name != kernel_for_subgraph(b, [(4,)], [F32]).name


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
