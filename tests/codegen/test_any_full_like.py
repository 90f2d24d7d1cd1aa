"""`any` (a bool reduction over trailing dims, or all) and `full_like` on the CTPU, compiled with
backend="ctpu", against eager on edge values: NaN counts as nonzero and -0 does not, infinities and
subnormals are nonzero, bool, int and bf16 inputs; full_like of NaN, +-inf, -0 in f32 and bf16, bool.
They are the masked-row guard of SDPA's softmax (torch._safe_softmax) and of OPT / BERT / Falcon masks
(issue 16 item 12). `codegen.unsupported_reason` names what stays on the CPU, and the partition obeys it."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

import codegen
import torch_tpu_backend.stats as ctpu_stats
from fx_passes import CtpuFallbackWarning

aten = torch.ops.aten
# each row one case: all zeros (and -0), a NaN, a subnormal, +-inf, a large value, a single one at the end
ROWS = torch.tensor([[0.0, -0.0, 0.0, -0.0], [0.0, math.nan, 0.0, 0.0], [-0.0, 1e-45, 0.0, 0.0],
                     [-math.inf, 0.0, 0.0, 0.0], [0.0, 0.0, math.inf, -0.0], [3e38, 0.0, 0.0, 0.0],
                     [0.0, 0.0, 0.0, 1.0], [-0.0, -0.0, -0.0, -0.0]])


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("CTPU_CACHE_DIR", str(tmp_path / "cache"))
    torch._dynamo.reset()
    ctpu_stats.reset()
    yield


def _compiled(fn: Callable[..., torch.Tensor], *xs: torch.Tensor, config: str = "small") -> torch.Tensor:
    """fn compiled for the CTPU; nothing of it may run on the CPU."""
    torch._dynamo.reset()
    ctpu_stats.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CtpuFallbackWarning)
        out = torch.compile(fn, backend="ctpu", options={"config": config})(*xs)
    assert not ctpu_stats.last().fallback_ops and ctpu_stats.last().kernels_launched == 1
    return out


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Same dtype, shape and values: NaN where NaN, the sign of 0 and of infinities included (a bf16 NaN's
    own bits are the device's: 0xFFFF, as any bf16 NaN result of the CTPU today)."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.bool:
        assert actual.tolist() == expected.tolist()
    else:
        torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)
        numbers = ~expected.isnan()
        assert (torch.signbit(actual[numbers]) == torch.signbit(expected[numbers])).all()


ANY_CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "last": lambda x: x.any(-1),
    "last_keepdim": lambda x: x.any(-1, keepdim=True),
    "all": lambda x: x.any(),
    "dims_all_keepdim": lambda x: aten.any.dims(x, None, True),
    "dims_none": lambda x: aten.any.dims(x, []),  # [] reduces nothing: x != 0
    "bool": lambda x: (x > 0).any(-1),
    "bf16": lambda x: x.bfloat16().any(-1),
    "not_any_not": lambda x: ~(~(x == -math.inf)).any(-1, keepdim=True),  # the guard's form
}


@pytest.mark.parametrize("case", ANY_CASES)
def test_any_edge_values(case: str) -> None:
    fn = ANY_CASES[case]
    _same(_compiled(fn, ROWS), fn(ROWS))


def test_any_of_int32() -> None:
    x = torch.tensor([[0, 0, 0], [0, -3, 0], [0, 0, 1 << 30], [-(1 << 31), 0, 0]], dtype=torch.int32)
    fn = lambda t: t.any(-1)
    _same(_compiled(fn, x), fn(x))


def test_any_over_trailing_dims_of_4d_bool() -> None:
    keep = torch.rand(2, 3, 5, 7, generator=torch.Generator().manual_seed(0)) > 0.93
    keep[1, 2] = False  # a whole [5, 7] block without a True
    for fn in (lambda m: m.any((-2, -1)), lambda m: m.any(-1), lambda m: m.any()):
        _same(_compiled(fn, keep), fn(keep))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf, -0.0, 0.0, 3.5e38 / 2])
def test_full_like_edge_values(value: float, dtype: torch.dtype) -> None:
    fn = lambda x: torch.full_like(x, value)
    x = ROWS.to(dtype)
    _same(_compiled(fn, x), fn(x))


def test_full_like_bool_and_int_in_a_where() -> None:
    def fn(x: torch.Tensor) -> torch.Tensor:
        flags = torch.full_like(x, True, dtype=torch.bool) & (x != 0)
        return torch.where(flags, torch.full_like(x, -math.inf), torch.full_like(x, 2, dtype=torch.int32))

    _same(_compiled(fn, ROWS), fn(ROWS))


WHERE_BOOL: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "tensors": lambda x: torch.where(x > 0, x != x, x < 0),
    "scalar_true": lambda x: torch.where(x != 0, x.abs() == math.inf, True),
    "scalar_false": lambda x: torch.where(x != x, False, x == 0),
    "then_and": lambda x: torch.where(x > 0, x < 1, x == -math.inf) & (x != 3e38),
    "bool_with_int": lambda x: torch.where(x > 0, x < 1, torch.full_like(x, 7, dtype=torch.int32)),
    "bool_with_float": lambda x: torch.where(x > 0, x == 0, x),
}


@pytest.mark.parametrize("case", WHERE_BOOL)
def test_where_of_bools_is_bool(case: str) -> None:
    """where() of bool values is bool, as eager (it was an int32 select, or an MLIR type error: the i1 masks
    were mixed with f32 constants); a bool with an int stays int."""
    fn = WHERE_BOOL[case]
    _same(_compiled(fn, ROWS), fn(ROWS))


def test_safe_softmax_guard_on_large() -> None:
    """torch._safe_softmax's guard (where(~any(~(s == -inf)), full_like(p, 0), p)) over Llama-sized scores
    on `large`: 16 heads, 64 queries, 96 keys, rows fully masked, a NaN row, +inf scores."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(1, 16, 64, 96, generator=g)
    scores[0, :, :5] = -math.inf  # left-padded queries see no key
    scores[0, 2, 7, 11] = math.nan
    scores[0, 3, 9, :] = -math.inf
    scores[0, 4, 9, 1] = math.inf

    def guard(s: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(s, -1)
        return torch.where(~(~(s == -math.inf)).any(-1, keepdim=True), torch.full_like(p, 0.0), p)

    expected = guard(scores)
    actual = _compiled(guard, scores, config="large")
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-7, equal_nan=True)
    assert (actual[0, :, :5] == 0).all() and actual[0, 2, 7].isnan().all()


def test_unsupported_any_is_refused_with_a_reason_and_runs_on_the_cpu() -> None:
    """any over a dim that is not trailing, or over an empty one: the partitioner's reason is the lowering's."""
    x = torch.ones(2, 3, 4)
    for fn, args, reason in ((lambda t: t.any(1), (x,), "only trailing dims"),
                             (lambda t: t.any(-1), (torch.zeros(3, 0),), "any of an empty")):
        gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(*args)
        (node,) = [n for n in gm.graph.nodes if n.target == aten.any.dim]
        assert reason in (codegen.unsupported_reason(node) or "")
    torch._dynamo.reset()
    with pytest.warns(CtpuFallbackWarning, match="only trailing dims"):
        out = torch.compile(lambda t: (t * 2).any(1), backend="ctpu")(x)
    assert out.tolist() == (x * 2).any(1).tolist()
