"""The ops of training graphs (issue 15, item 2) on the simulator against eager, fp32 at "highest", with edge
values: reductions over any set of dims (the backward of every broadcast sums over batch dims)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from codegen_helpers import compile_and_run

torch.manual_seed(0)


def check(fn, *xs, rtol=1e-5, atol=1e-6):
    outs, refs, cg = compile_and_run(fn, *xs)
    assert len(outs) == len(refs)
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape
        np.testing.assert_allclose(o, r, rtol=rtol, atol=atol)
    return cg


def _edges(*shape: int) -> torch.Tensor:
    x = torch.randn(*shape)
    flat = x.view(-1)
    flat[:6] = torch.tensor([0.0, -0.0, 1e-40, -1e30, 3e38, 5.0])  # no cancellation: sums differ in order
    return x


@pytest.mark.parametrize("dims", [(0,), (1,), (0, 1), (0, 2), (1, 2), (0, 1, 2), ()])
def test_sum_over_any_dims(dims: tuple[int, ...]) -> None:
    x = _edges(3, 5, 20)
    check(lambda x: (x.sum(dims), x.sum(dims, keepdim=True), x.amax(dims), x.mean(dims)), x, atol=2e-5)


def test_reductions_with_inf_and_nan_in_outer_dims() -> None:
    x = torch.randn(4, 6, 9)
    x[1, 2, 3], x[2, 0, 0], x[3, 5, 8] = math.inf, -math.inf, math.nan
    outs, refs, _ = compile_and_run(lambda x: (x.sum(0), x.amax((0, 1)), x.sum((0, 2))), x)
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_sum_of_a_transposed_and_broadcast_operand() -> None:
    """A permute folded into the reduction (its operand strided), and a broadcast operand (stride 0 along
    a reduced dim), reduced over outer dims on the realistic large configuration."""
    x, b = torch.randn(2, 17, 128), torch.randn(128)
    outs, refs, _ = compile_and_run(lambda x, b: ((x.transpose(0, 1) * b).sum((0, 1)), (x + b).sum(1)), x, b,
                                    config="large")
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=5e-5)


def test_a_sum_over_a_few_outer_slices_is_one_elementwise_kernel() -> None:
    """A MoE's combine, `view(T, k, H).sum(1)` (17 tokens, top-2, hidden 1024, on `large`): the slices added
    elementwise (strided views of x), not x copied with rows of k elements and reduced (127K cycles of the
    Mixtral block). From 0.0 as torch: a sum of -0.0s is +0.0; inf and NaN propagate."""
    x = torch.randn(17, 2, 1024)
    x[0, :, 0], x[1, 0, 1], x[2, 1, 2], x[3, :, 3] = -0.0, math.inf, math.nan, torch.tensor([3e38, 3e38])
    outs, refs, cg = compile_and_run(lambda x: (x.sum(1), x.amax(1, keepdim=True)), x, config="large")
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_array_equal(o, r)  # two addends: exact
    assert not np.signbit(outs[0][0, 0])
    assert [k["kind"] for k in cg.summary["kernels"]] == ["elementwise", "elementwise"]
    assert cg.last_stats.cycles < 30_000


def test_integer_and_bool_sums_keep_torch_dtype() -> None:
    x = torch.randn(5, 7)
    outs, refs, _ = compile_and_run(lambda x: ((x > 0).sum(0).float(), (x > 0).sum().float() / 2), x)
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_array_equal(o, r)


def test_slice_scatter_and_constant_pad() -> None:
    x, s = torch.randn(4, 10), torch.randn(4, 3)
    check(lambda x, s: (torch.slice_scatter(x, s, 1, 5, 8), torch.slice_scatter(x, s, 1, -3),
                        torch.slice_scatter(x, x[1:] * 2.0, 0, 1)), x, s, rtol=0, atol=0)
    labels = torch.randint(0, 9, (2, 7))
    check(lambda x, y: (torch.nn.functional.pad(x, (1, 2), value=-math.inf), torch.nn.functional.pad(
        y, (0, 1), value=-100).float()), x, labels.to(torch.int32), rtol=0, atol=0)


def test_slices_and_pads_of_a_tensor_with_a_zero_dim() -> None:
    """The backward of a circular pad over a batch of 0 (OpInfo's gradient sweep): a slice, select, pad or
    slice_scatter of a 0 x n tensor was an MLIR error (an offset into a dimension of size 0), not a kernel."""
    x, s = torch.randn(0, 6), torch.randn(0, 3)
    check(lambda x, s: (x[:, 1:4] * 2.0, x[:, 1] + 1.0, torch.nn.functional.pad(x, (1, 2)) * 3.0,
                        torch.slice_scatter(x, s, 1, 2, 5) * 4.0, torch.cat([x, s], 1) * 5.0), x, s, rtol=0, atol=0)


def test_log_softmax_and_its_backward_with_inf() -> None:
    x = torch.randn(6, 33) * 4
    x[0, 3] = -math.inf
    x[1, :] = -math.inf  # a row of -inf only: NaN in torch
    x[2, 5] = 80.0  # exp overflows without the max subtracted
    g = torch.randn(6, 33)

    def fn(x, g):
        out = torch.log_softmax(x, -1)
        back = torch.ops.aten._log_softmax_backward_data(g, out, 1, torch.float32)
        back0 = torch.ops.aten._log_softmax_backward_data(g, out, 0, torch.float32)
        return out, back, back0

    outs, refs, _ = compile_and_run(fn, x, g)
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5, equal_nan=True)


def test_gather_and_scatter_value_along_any_dim() -> None:
    x = torch.randn(5, 9)
    x[1, 2] = -0.0
    x[3, 0] = math.inf
    idx = torch.tensor([[2], [2], [8], [0], [4]], dtype=torch.int32)
    idx_t = torch.tensor([[4, 0, 1, 2, 3, 3, 2, 1, 0]], dtype=torch.int32)
    check(lambda x, i, j: (torch.gather(x, 1, i), torch.gather(x, 0, j), torch.scatter(x, 1, i, -1.0),
                           torch.scatter(x, 0, j, 2.5)), x, idx, idx_t, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_index_put_accumulate_sums_duplicate_indices(dtype: torch.dtype) -> None:
    """The embedding's backward: rows with repeated (and negative) indices all add up."""
    x, v = torch.randn(7, 20).to(dtype), torch.randn(9, 20).to(dtype)
    idx = torch.tensor([3, 1, 3, 3, 0, 6, -1, 1, 5], dtype=torch.int32)
    outs, _, _ = compile_and_run(lambda x, i, v: torch.index_put(x, (i,), v, accumulate=True), x, idx, v)
    # bf16: the CTPU sums in f32 and rounds once; eager rounds after every add, so compare with f32 sums
    want = torch.index_put(x.float(), (idx,), v.float(), accumulate=True).to(dtype).float().numpy()
    np.testing.assert_allclose(outs[0], want, rtol=1e-5 if dtype == torch.float32 else 2**-8, atol=1e-5)


def test_embedding_backward_on_large() -> None:
    ids = torch.randint(0, 128, (2, 17), dtype=torch.int32)
    ids[0, :5] = 7  # duplicates
    g = torch.randn(2, 17, 64)
    outs, refs, _ = compile_and_run(lambda g, i: torch.ops.aten.embedding_dense_backward(g, i, 128, -1, False),
                                    g, ids, config="large")
    np.testing.assert_allclose(outs[0], refs[0], rtol=1e-5, atol=1e-5)


def test_native_layer_norm_returns_its_statistics() -> None:
    x, w, b = torch.randn(6, 48), torch.randn(48), torch.randn(48)
    x[0] *= 1e25  # the sum of squares overflows: the scaled path
    x[1] = 3.0  # zero variance: rstd = rsqrt(eps)
    fn = lambda x, w, b: torch.native_layer_norm(x, (48,), w, b, 1e-5)
    outs, _, _ = compile_and_run(fn, x, w, b)
    refs = fn(x.double(), w.double(), b.double())  # eager's fp32 overflows to NaN on row 0
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_allclose(o, r.numpy(), rtol=1e-5, atol=1e-5)


def test_graph_inputs_with_an_empty_inner_dim() -> None:
    """A graph input of 1 x 0 x 3 (OpInfo's empty sample, forward and backward of every elementwise op) was a
    "dynamic layout" error: MLIR leaves the strides outside a size-0 dim dynamic; nothing is addressed."""
    x, y = torch.randn(1, 0, 3), torch.randn(3, 0)
    check(lambda x, y: (x.exp() * 2.0 - x, y.neg(), y.sum(1), y.sum(0), x.sum((0, 1)), y.t() + 1.0), x, y,
          rtol=0, atol=0)


@pytest.mark.parametrize("dim", [0, 1])
def test_softmax_and_log_softmax_over_any_dim(dim: int) -> None:
    """softmax / log_softmax over a dim other than the last (softmin's, a softmax over dim 0) ran on the CPU:
    a -inf entry, a line of -inf only (NaN, as torch), a NaN, an entry whose exp overflows unshifted."""
    x = torch.randn(7, 9) * 4
    x[2, 3], x[4, 4], x[5, 5] = -math.inf, math.nan, 90.0
    x[:, 0] = -math.inf
    x[0, :] = -math.inf
    g = torch.randn(7, 9)

    def fn(x, g):
        sm, lsm = torch.softmax(x, dim), torch.log_softmax(x, dim)
        return (sm, lsm, torch.ops.aten._softmax_backward_data(g, sm, dim, torch.float32),
                torch.ops.aten._log_softmax_backward_data(g, lsm, dim, torch.float32))

    outs, refs, _ = compile_and_run(fn, x, g)
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_sign_amin_mean_and_index_select() -> None:
    """sign (NaN and -0.0 give +0.0, as torch), amin (-amax(-x): NaN propagates, -inf), mean over every dim,
    index_select along the last two dims (a 0-d index keeps the dim): backward ops that ran on the CPU."""
    x = torch.randn(4, 6, 5)
    x.view(-1)[:8] = torch.tensor([math.nan, -0.0, 0.0, 1e-45, -1e-45, math.inf, -math.inf, -3.0])
    y = torch.randn(3, 7)
    y[1, 2] = -math.inf
    i = torch.tensor([2, 0, 2, 3], dtype=torch.int32)
    outs, refs, _ = compile_and_run(lambda x, y, i: (
        torch.sign(x), torch.sgn(x), torch.amin(x, (0, 2)), torch.amin(y, 1, keepdim=True), torch.amin(y, 0),
        torch.mean(y), torch.mean(x), torch.index_select(y, 1, i), torch.index_select(x, 1, i[:3]),
        torch.index_select(x, 2, i), torch.index_select(y, 0, i[1])), x, y, i)
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape
        np.testing.assert_allclose(o, r, rtol=1e-6, atol=0, equal_nan=True)
    assert not np.signbit(outs[0]).reshape(-1)[:3].any()  # sign(NaN), sign(-0.0), sign(0.0) are +0.0


def test_index_select_and_index_along_outer_dims() -> None:
    """index_select along any dim of a rank-4 tensor, and x[:, idx] with a 2-D index (negative ones from the
    end): rows of the last dim gathered at ((l * size + idx) * prod(middle) + m); exact bits (NaN, -0.0).
    Along an outer dim the gather of whole blocks was refused, and the op ran on the CPU."""
    x = torch.randn(5, 3, 4, 6)
    x.view(-1)[:3] = torch.tensor([math.nan, -0.0, -math.inf])
    i, k = torch.tensor([4, 0, 4], dtype=torch.int32), torch.tensor([2, 0, 2], dtype=torch.int32)
    j = torch.tensor([[2, -1], [0, 0]])
    outs, refs, _ = compile_and_run(lambda x, i, k, j: (
        torch.index_select(x, 0, i), torch.index_select(x, 1, k), torch.index_select(x, 2, k) * 2.0,
        torch.index_select(x, 3, i), x[:, j] + 1.0, torch.index_select(x, 0, i[0])), x, i, k, j)
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape
        np.testing.assert_array_equal(o, r)
        assert (np.signbit(o) == np.signbit(r)).all()


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_cumsum_and_flip_over_any_dim(dim: int) -> None:
    """cumsum over any dim (float with edge values; int32, through limbs) and flip (row
    gathers at size - 1 - i: exact bits, NaN and -0.0), cumsum's backward flip(cumsum(flip(g))) fused: over an
    outer dim they ran on the CPU."""
    x = torch.randn(4, 6, 5)
    x.view(-1)[:4] = torch.tensor([math.nan, -0.0, math.inf, 1e-40])
    n = torch.randint(-(2**20), 2**20, (4, 6, 5), dtype=torch.int32)  # the harness passes inputs as float32
    pair = (dim, 2) if dim != 2 else (0, 2)
    outs, refs, _ = compile_and_run(lambda x, n: (
        torch.flip(x, (dim,)), torch.flip(x, pair), torch.flip(torch.cumsum(torch.flip(x, (dim,)), dim), (dim,)),
        torch.cumsum(n, dim), torch.flip(n > 0, (dim,))), x, n)
    for k, (o, r) in enumerate(zip(outs, refs, strict=True)):
        assert o.shape == r.shape
        if k == 2:  # float sums, the reduction's pairwise order
            np.testing.assert_allclose(o, r, rtol=1e-5, atol=1e-5, equal_nan=True)
        else:  # exact: moved bits, integer sums
            np.testing.assert_array_equal(o, r)
    assert (np.signbit(outs[0]) == np.signbit(refs[0])).all()


@pytest.mark.parametrize("dim", [0, 1, 2])
def test_max_along_a_dim_and_its_backward_scatter(dim: int) -> None:
    """max.dim: the maximum and the index of its first occurrence (ties), a NaN is the maximum and the first
    NaN's index the index, -inf rows; scatter.src of one position per slice (max.dim's backward): both ran on
    the CPU."""
    x = torch.randn(4, 6, 5).round()  # ties
    x[1, 2, :], x[2, :, 3], x[:, 4, 1] = math.nan, -math.inf, math.nan
    x[3, 1, 2] = math.nan
    g = torch.randn(4, 6, 5)

    def fn(x: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, ...]:
        values, index = torch.max(x, dim)
        kept, kept_index = torch.max(x * 2.0, dim, keepdim=True)
        grad = torch.zeros_like(x).scatter(dim, kept_index, g.narrow(dim, 0, 1))
        return values, index, kept, kept_index, grad

    outs, refs, _ = compile_and_run(fn, x, g)
    for o, r in zip(outs, refs, strict=True):
        assert o.shape == r.shape
        np.testing.assert_array_equal(o, r)


def test_integer_sign_is_exact() -> None:
    x = torch.tensor([-(2**30) - 1, -1, 0, 1, 2**24 + 1, 7], dtype=torch.int32)
    check(lambda x: (torch.sign(x), torch.sign(x) * x), x, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [0, 1, -1])
def test_scatter_add_along_any_dim(dim: int) -> None:
    """gather's backward: duplicates summed, -0.0 of x kept where nothing lands, inf + -inf = NaN, NaN added;
    src larger than the index (its leading part is read)."""
    x = torch.randn(5, 6)
    x[0, 0], x[4, 5] = -0.0, math.inf
    n = 4
    shape = (n, 6) if dim == 0 else (5, n)
    index = torch.randint(0, x.shape[dim], shape, dtype=torch.int32)
    index.view(-1)[:3] = 0  # duplicates
    src = torch.randn(shape[0] + 1, shape[1] + 2)
    src[1, 1], src[2, 0] = -math.inf, math.nan
    outs, refs, _ = compile_and_run(lambda x, i, s: torch.scatter_add(x, dim, i, s) * 1.0, x, index, src)
    np.testing.assert_allclose(outs[0], refs[0], rtol=1e-6, atol=1e-6, equal_nan=True)
    assert (np.signbit(outs[0]) == np.signbit(refs[0])).all()


def test_sum_of_a_negation() -> None:
    """sub's backward sums -grad over the broadcast dims: the elementwise fusion yields `out - x` from the
    reduction, a combiner the vector unit lacked (the node ran on the CPU); -0.0 sums stay as torch's."""
    x, v = _edges(4, 6, 9), _edges(37)
    x[0, 0, :] = -0.0
    check(lambda x, v: ((-x).sum(0), (-x).sum((0, 1)), (-x).sum(2), (-v).sum(0), (-v).sum()), x, v, atol=2e-5)
