"""The MoE routing rules (fx_passes/routing.py) against the ops they replace, on the CPU: exact results at
the values where an approximation would show (bin boundaries, the int32 and int64 ranges, ties, NaN, -0.0),
and the cases each rule leaves to the op."""

from __future__ import annotations

import pytest
import torch

from fx_passes.routing import (
    grouped_mm,
    histc_by_edges,
    integer_divide,
    sort_by_rank,
    sort_stable_by_rank,
    topk_by_rank,
)

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("d", [1, 2, 3, 7, 8, -1, -2, -5, 1_000_003, -65_537, 2**30])
@pytest.mark.parametrize("mode", ["floor", "trunc"])
def test_integer_divide_is_exact_over_the_whole_range(dtype: torch.dtype, d: int, mode: str) -> None:
    info = torch.iinfo(dtype)
    g = torch.Generator().manual_seed(0)
    a = torch.cat([torch.randint(info.min, info.max, (20_000,), generator=g, dtype=dtype),
                   torch.arange(-40, 40, dtype=dtype),
                   torch.tensor([info.max, info.min, info.max - 1, info.min + 1, 2**24 + 1, -(2**24 + 1)],
                                dtype=dtype)])
    if d == -1:
        a = a[a != info.min]  # the CPU's division traps (SIGFPE): min / -1 overflows
    assert torch.equal(integer_divide(a, d, rounding_mode=mode), torch.div(a, d, rounding_mode=mode))


def test_integer_divide_leaves_tensor_divisors_and_floats_to_the_op() -> None:
    a = torch.arange(6)
    assert integer_divide(a, torch.tensor(2), rounding_mode="floor") is NotImplemented  # a zero would raise
    assert integer_divide(a, 0, rounding_mode="floor") is NotImplemented
    assert integer_divide(a.float(), 2, rounding_mode="floor") is NotImplemented
    assert integer_divide(a, 2, rounding_mode=None) is NotImplemented


def _around(points: torch.Tensor) -> torch.Tensor:
    """Each float32 point and its two neighbours."""
    return torch.cat([points, torch.nextafter(points, points + 1), torch.nextafter(points, points - 1)])


@pytest.mark.parametrize(("bins", "lo", "hi"), [(4, 0, 3), (8, 0, 7), (128, 0, 127), (10, -1.0, 1.0), (7, 0.1, 0.9),
                                                (100, -3.3, 1e3), (1, 0, 1), (3, -1e30, 1e30), (5, 1e-40, 1e-38)])
def test_histc_counts_as_the_cpu_at_every_bin_boundary(bins: int, lo: float, hi: float) -> None:
    g = torch.Generator().manual_seed(1)
    edges = (torch.arange(bins + 1, dtype=torch.float64) * (hi - lo) / bins + lo).float()
    x = torch.cat([(torch.rand(4000, generator=g, dtype=torch.float64) * 1.2 - 0.1) * (hi - lo) + lo,
                   torch.linspace(lo, hi, 1001, dtype=torch.float64)]).float()
    x = torch.cat([x, _around(edges), torch.tensor([lo, hi, NAN, INF, -INF, 0.0, -0.0])])
    assert torch.equal(histc_by_edges(x, bins, lo, hi), torch.histc(x, bins, lo, hi))


def test_histc_leaves_a_range_from_the_data_to_the_op() -> None:
    x = torch.randn(10)
    assert histc_by_edges(x, 4) is NotImplemented  # min == max == 0: the data's own range
    assert histc_by_edges(x, 4, 1, 1) is NotImplemented
    assert histc_by_edges(x, 4, -3e38, 3e38) is NotImplemented  # (max - min) * bins overflows
    assert histc_by_edges(x.double(), 4, 0, 1) is NotImplemented


def _keys(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Few distinct keys (many ties), NaNs and both zeros for floats."""
    g = torch.Generator().manual_seed(2)
    x = torch.randint(-2, 3, shape, generator=g).to(dtype)
    if dtype.is_floating_point:
        x.view(-1)[::7] = NAN
        x.view(-1)[3::11] = -0.0
        x.view(-1)[5::13] = -INF
    return x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.int32])
@pytest.mark.parametrize("descending", [False, True])
@pytest.mark.parametrize("dim", [-1, 0])
def test_sort_is_torchs_stable_sort(dtype: torch.dtype, descending: bool, dim: int) -> None:
    for shape in [(1,), (33,), (3, 18)]:
        x = _keys(dtype, shape)
        expected = torch.sort(x, stable=True, dim=dim, descending=descending)
        for got in (sort_by_rank(x, dim, descending), sort_stable_by_rank(x, stable=False, dim=dim,
                                                                          descending=descending)):
            torch.testing.assert_close(got[0], expected[0], equal_nan=True, rtol=0, atol=0)
            assert torch.equal(got[1], expected[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
@pytest.mark.parametrize("largest", [True, False])
def test_topk_values_and_indices(dtype: torch.dtype, largest: bool) -> None:
    g = torch.Generator().manual_seed(3)
    for n in [1, 8, 33]:
        x = torch.randn(5, n, generator=g).to(dtype) if dtype.is_floating_point else \
            torch.stack([torch.randperm(n, generator=g) for _ in range(5)])  # distinct: torch's tie order is its own
        for k in sorted({1, min(2, n), n}):
            got, expected = topk_by_rank(x, k, largest=largest), torch.topk(x, k, largest=largest)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), (n, k)
    ties = torch.tensor([[1.0, 3.0, 3.0, NAN, 3.0, 2.0]])
    values, indices = topk_by_rank(ties, 3)
    assert values.isnan()[0, 0] and values[0, 1:].tolist() == [3.0, 3.0] and indices.tolist() == [[3, 1, 2]]
    assert topk_by_rank(ties, 7) is NotImplemented


def test_grouped_mm_as_hugging_faces_and_torchs() -> None:
    import transformers.integrations.moe  # noqa: F401  registers transformers::grouped_mm_fallback

    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(10, 16, generator=g), torch.randn(4, 16, 8, generator=g)
    for offs in ([2, 2, 7, 9], [0, 0, 0, 10], [10, 10, 10, 10], [3, 5, 6, 6]):  # empty groups, rows past the end
        offs = torch.tensor(offs, dtype=torch.int32)
        expected = torch.ops.transformers.grouped_mm_fallback(x, w, offs)
        torch.testing.assert_close(grouped_mm(x, w, offs), expected, rtol=1e-5, atol=1e-5)
        used = int(offs[-1])  # torch's kernel leaves the rows past the end as they were
        torch.testing.assert_close(grouped_mm(x.bfloat16(), w.bfloat16(), offs)[:used],
                                   torch._grouped_mm(x.bfloat16(), w.bfloat16(), offs=offs)[:used], rtol=0, atol=0)
    assert grouped_mm(x, w, None) is NotImplemented
    assert grouped_mm(x.expand(4, 10, 16), w, offs) is NotImplemented
