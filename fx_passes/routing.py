"""Mixture-of-experts routing as ops the CTPU lowers: `sort`, `topk`, `histc`, integer floor division and the
experts' grouped matmul, written with compares, sums, gathers and batched matmuls of static shape.

Why decompositions: each op's result depends on the data only through values, never through shapes, so
all of them have a fixed-size form: an element's place in a sorted row is the number of elements that sort
before it (a compare matrix summed along a row), a histogram bin is the number of bin edges at or below the
value, and a grouped matmul is every expert's matmul over every row with each row kept from its own expert.
The cost is where the data-dependent form would skip work: sort and topk do n^2 compares for a row of n
(an MoE router's rows are n = experts; the expert sort's is tokens x top-k), and the grouped matmul does
`experts` times the MACs of the rows' own experts (the group sizes are data; the MXU's tiles are fixed at
compile time). Every rule returns NotImplemented (the op stays, and runs on the CPU with the fallback
warning) for a case it does not reproduce exactly.

The orders: sort is stable (equal keys keep their index order; torch's CPU sort with stable=False gives
some order of equal keys, a stable order is one of them), NaN sorts as the largest value as torch's does,
-0.0 equals 0.0. topk returns the k largest (smallest) in order, ties by the lower index.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

aten = torch.ops.aten
_SORTABLE = (torch.float32, torch.bfloat16, torch.int64, torch.int32)
_INTEGER = (torch.int64, torch.int32)


def routing_decompositions() -> dict[Any, Callable[..., Any]]:
    table: dict[Any, Callable[..., Any]] = {
        aten.sort.default: sort_by_rank, aten.sort.stable: sort_stable_by_rank, aten.topk.default: topk_by_rank,
        aten.histc.default: histc_by_edges, aten.div.Tensor_mode: integer_divide, aten._grouped_mm.default: grouped_mm,
    }
    transformers_op = getattr(getattr(torch.ops, "transformers", None), "grouped_mm_fallback", None)
    if transformers_op is not None:  # Hugging Face's grouped matmul for dtypes torch's op does not take
        table[transformers_op.default] = grouped_mm
    return table


# ---- sort and topk ------------------------------------------------------------------------------------
def _before(x: Tensor, descending: bool) -> Tensor:
    """[..., n, n]: element j (last dim) sorts before element i (the dim before it)."""
    n = x.shape[-1]
    a, b = x.unsqueeze(-1), x.unsqueeze(-2)
    earlier = torch.arange(n, device=x.device).unsqueeze(0) < torch.arange(n, device=x.device).unsqueeze(-1)
    ahead, equal = (b > a, b == a) if descending else (b < a, b == a)
    if x.is_floating_point():  # NaN is the largest value; NaNs are equal to each other
        nan_a, nan_b = a.isnan(), b.isnan()
        ahead = ahead | ((nan_b & ~nan_a) if descending else (nan_a & ~nan_b))
        equal = equal | (nan_a & nan_b)
    return ahead | (equal & earlier)


def _ranked(x: Tensor, k: int, descending: bool) -> tuple[Tensor, Tensor]:
    """The first k (values, indices) of the stable sort of x's last dim."""
    n = x.shape[-1]
    rank = _before(x, descending).sum(-1)  # [..., n]: where each element goes
    places = torch.arange(k, device=x.device).unsqueeze(-1)
    lands = rank.unsqueeze(-2) == places  # [..., k, n]: element i lands at place r
    indices = torch.where(lands, torch.arange(n, device=x.device), 0).sum(-1)
    return torch.gather(x, -1, indices), indices


def _sortable(x: Tensor, dim: int) -> bool:
    return x.dtype in _SORTABLE and x.dim() > 0 and x.shape[dim] > 0


def sort_by_rank(x: Tensor, dim: int = -1, descending: bool = False) -> tuple[Tensor, Tensor]:
    return sort_stable_by_rank(x, stable=True, dim=dim, descending=descending)


def sort_stable_by_rank(x: Tensor, *, stable: bool | None = None, dim: int = -1,
                        descending: bool = False) -> tuple[Tensor, Tensor]:
    if not _sortable(x, dim):
        return NotImplemented  # type: ignore[return-value]
    values, indices = _ranked(x.movedim(dim, -1), x.shape[dim], descending)
    return values.movedim(-1, dim), indices.movedim(-1, dim)


def topk_by_rank(x: Tensor, k: int, dim: int = -1, largest: bool = True,
                 sorted: bool = True) -> tuple[Tensor, Tensor]:
    if not _sortable(x, dim) or not 0 < k <= x.shape[dim]:
        return NotImplemented  # type: ignore[return-value]
    values, indices = _ranked(x.movedim(dim, -1), k, largest)
    return values.movedim(-1, dim), indices.movedim(-1, dim)


# ---- histc --------------------------------------------------------------------------------------------
def histc_by_edges(x: Tensor, bins: int = 100, min: float = 0, max: float = 0) -> Tensor:
    """torch.histc for float32 with a fixed range: bin b counts the values v in [min, max] with
    bin(v) = b, where the CPU computes bin(v) = trunc((v - min) * bins / (max - min)) in float32 (max itself
    in the last bin). That is monotone in v, so bin(v) >= b exactly when v >= edge_b, the least float32 for
    which it holds: the edges are found at compile time by bisection over float32, and a value's bin is the
    number of edges at or below it, exact where a division on the CTPU (a few ulp) would move values at a
    bin's boundary. A range from the data (min == max) is left to the op."""
    lo, hi = np.float32(min), np.float32(max)
    with np.errstate(over="ignore"):
        span = np.float32(np.float32(hi - lo) * np.float32(bins))
    if x.dtype != torch.float32 or bins < 1 or not (lo < hi and np.isfinite(span)):
        return NotImplemented  # type: ignore[return-value]
    # built from fills: a tensor constant in a decomposition would not be functional
    edges = torch.cat([torch.full((1,), _least_with_bin(b, bins, lo, hi), dtype=torch.float32, device=x.device)
                       for b in range(1, bins)] or [torch.empty(0, device=x.device)])
    v = x.reshape(-1)
    inside = (v >= float(lo)) & (v <= float(hi))
    bin_of = (v.unsqueeze(-1) >= edges).sum(-1)
    hit = (bin_of == torch.arange(bins, device=x.device).unsqueeze(-1)) & inside  # [bins, n]
    return hit.sum(-1).to(torch.float32)


def _cpu_bin(v: np.float32, bins: int, lo: np.float32, hi: np.float32) -> int:
    pos = int((np.float32(v - lo) * np.float32(bins)) / np.float32(hi - lo))
    return bins - 1 if pos == bins else pos


def _least_with_bin(b: int, bins: int, lo: np.float32, hi: np.float32) -> float:
    """The least float32 v in [lo, hi] with _cpu_bin(v) >= b (bisection over float32's order)."""
    magnitude = lambda f: int(np.abs(np.float32(f)).view(np.int32))
    key = lambda f: -magnitude(f) if np.signbit(f) else magnitude(f)  # float32's order as integers
    value = lambda k: np.copysign(np.int32(abs(k)).view(np.float32), np.float32(k))
    low, high = key(lo), key(hi)  # bin(lo) = 0 < b <= bin(hi) = bins - 1
    while high - low > 1:  # invariant: bin(value(low)) < b <= bin(value(high))
        mid = (low + high) // 2
        low, high = (low, mid) if _cpu_bin(value(mid), bins, lo, hi) >= b else (mid, high)
    return float(value(high))


# ---- integer floor division ---------------------------------------------------------------------------
def integer_divide(a: Tensor, d: Any, *, rounding_mode: str | None = None) -> Tensor:
    """a // d and trunc(a / d) of an integer tensor by a nonzero integer constant (an MoE's slot -> token,
    `perm // top_k`), exact: a float quotient (a few ulp off) is corrected by the quotient of the exact integer
    remainder, three times (each shrinks the error by ~2^22: all of int64 on the CPU), then by one to the
    remainder's range for the rounding. On the CTPU the integer steps are exact integer ops (int32) and the
    float quotients f32. A tensor divisor (a zero raises on the CPU) is left to the op."""
    if rounding_mode not in ("floor", "trunc") or not isinstance(a, Tensor) or a.dtype not in _INTEGER \
            or isinstance(d, bool) or not isinstance(d, int) or d == 0:
        return NotImplemented  # type: ignore[return-value]
    q = torch.zeros_like(a)
    for _ in range(3):
        q = q + ((a - q * d).to(torch.float32) / d).to(a.dtype)
    r = a - q * d  # floor: r in [0, d) for d > 0, in (d, 0] for d < 0
    low, high = (r < 0, r >= d) if d > 0 else (r > 0, r <= d)
    q = q + high.to(a.dtype) - low.to(a.dtype)
    if rounding_mode == "trunc":  # one more than the floor where the quotient is negative and inexact
        r = a - q * d
        q = q + ((r != 0) & ((a < 0) if d > 0 else (a > 0))).to(a.dtype)
    return q


# ---- grouped matmul ------------------------------------------------------------------------------------
def grouped_mm(x: Tensor, w: Tensor, offs: Tensor | None = None, bias: Tensor | None = None,
               out_dtype: torch.dtype | None = None) -> Tensor:
    """Rows [offs[e-1], offs[e]) of x [S, K] times w[e] [K, N] (x sorted by expert), rows past offs[-1]
    zero: every expert's matmul over all rows (one matmul on the MXU), each row gathered from its own
    expert's product. The (2-D, 3-D) form with offsets only."""
    if offs is None or bias is not None or out_dtype not in (None, x.dtype) or x.dim() != 2 or w.dim() != 3 \
            or offs.dim() != 1 or offs.shape[0] != w.shape[0] or x.shape[1] != w.shape[1]:
        return NotImplemented  # type: ignore[return-value]
    (s, k), (e, _, n) = x.shape, w.shape
    rows = torch.arange(s, device=x.device)
    group = (offs.unsqueeze(0) <= rows.unsqueeze(-1)).sum(-1)  # [S]: e for the rows of expert e, E past the end
    expert = group.clamp(max=e - 1)
    if w.stride() == (n * k, 1, k):  # W^T of [E, N, K] weights (nn.Linear's layout): one linear over all experts,
        # x @ [W_0; ...; W_E-1]^T, reads them in place and each row of x once; row r, expert e is row r E + e
        products = (x @ w.transpose(-2, -1).reshape(e * n, k).t()).reshape(s * e, n)
        picked = products[rows * e + expert]
    else:
        products = torch.bmm(x.unsqueeze(0).expand(e, s, k), w).reshape(e * s, n)
        picked = products[expert * s + rows]
    return torch.where((group < e).unsqueeze(-1), picked, torch.zeros((), dtype=x.dtype, device=x.device))
