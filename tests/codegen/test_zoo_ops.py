"""Ops the model zoo needs beyond Llama: a gather whose row ids the graph computes (GPT-2's positions:
`embedding(wpe, arange)`), `cumsum` (OPT's positions from the attention mask), `repeat` (GPT-J, BLOOM) and
strided slices (GPT-J's `x[..., ::2]`), compiled and run on the simulator, against eager."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codegen_helpers import compile_and_run

import torch_tpu_backend.stats as ctpu_stats


def _equal(fn, *xs: torch.Tensor, config: str = "small") -> None:
    outs, refs, _ = compile_and_run(fn, *xs, config=config)
    for o, r in zip(outs, refs, strict=True):
        np.testing.assert_array_equal(o, r)


@pytest.mark.parametrize("offset", [0, 5])
def test_positions_from_arange_gather_rows(offset: int) -> None:
    table, ids = torch.randn(40, 12), torch.tensor([[3, 1, 7, 0, 39, 2, 2, 11, 5]])
    table[6, :3] = torch.tensor([float("nan"), float("inf"), -0.0])  # rows are copied, never computed

    def fn(t: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(i.shape[1]) + offset
        return torch.nn.functional.embedding(i, t) + torch.nn.functional.embedding(pos.unsqueeze(0), t)

    outs, refs, exe = compile_and_run(fn, table, ids)
    np.testing.assert_array_equal(outs[0], refs[0])
    assert "gather" in " ".join(k["kind"] for k in exe.summary["kernels"])


def test_computed_ids_get_their_own_kernel() -> None:
    """ids = (x * 3 + 1) % ... computed in the graph: an int32 kernel writes them, then the row gather."""
    table, ids = torch.randn(64, 20), torch.tensor([[0, 4, 9], [20, 1, 6]])
    _equal(lambda t, i: torch.nn.functional.embedding(i * 3 + 1, t) * 2.0, table, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool])
def test_cumsum_last_dim(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    if dtype == torch.float32:
        x = torch.randint(-50, 50, (3, 37), generator=g).float() / 4  # exact sums in any order
    elif dtype == torch.int64:
        x = torch.randint(-1000, 1000, (3, 37), generator=g)
    else:
        x = torch.rand(3, 37, generator=g) > 0.4  # OPT: attention_mask.cumsum(-1)
    _equal(lambda v: torch.cumsum(v, -1), x)


def test_cumsum_position_ids_like_opt() -> None:
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
    _equal(lambda m: (torch.cumsum(m, dim=1) * m).long() - 1 + 2, mask)


def test_cumsum_floats_with_specials() -> None:
    x = torch.tensor([[1.0, float("inf"), 2.0, -float("inf"), 3.0], [float("nan"), 1.0, -0.0, 0.0, 5.0]])
    outs, refs, _ = compile_and_run(lambda v: torch.cumsum(v, -1), x)
    np.testing.assert_array_equal(outs[0], refs[0])  # inf, then NaN once -inf joins; NaN from the start


@pytest.mark.parametrize("repeats", [(2, 3), (3, 1, 2), (1, 1)])
def test_repeat(repeats: tuple[int, ...]) -> None:
    _equal(lambda v: v.repeat(*repeats) * 1.5, torch.randn(4, 5))


@pytest.mark.parametrize(("start", "end", "step"), [(0, None, 2), (1, None, 2), (1, 12, 3), (-7, None, 4)])
def test_strided_slice(start: int, end: int | None, step: int) -> None:
    _equal(lambda v: v[..., start:end:step] + 1.0, torch.randn(3, 4, 13))


def test_rotate_every_two_like_gptj() -> None:
    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[:, :, :, ::2], x[:, :, :, 1::2]
        return torch.stack((-x2, x1), dim=-1).flatten(-2)

    _equal(rotate, torch.randn(1, 5, 2, 16))


def test_strided_slice_and_repeat_on_large() -> None:
    x = torch.randn(2, 33, 256)
    _equal(lambda v: v[:, 1::2, ::2].repeat(1, 2, 1) * 2.0, x, config="large")


def test_index_with_one_tensor_on_dim_0() -> None:
    """x[idx] (Falcon's cos[position_ids]): a row gather; negative indices count from the end."""
    x, idx = torch.randn(40, 12), torch.tensor([[3, -1, 0, 39], [-40, 7, 7, 2]])
    _equal(lambda v, i: v[i] * 2.0, x, idx)


@pytest.mark.parametrize("bad", [40, -41])
def test_index_out_of_range_traps(bad: int) -> None:
    from codegen_helpers import trace

    from codegen import compile_graph
    from device_sim.executable import InputRangeError, run_fresh
    from device_sim.runners import SimulatorRunner

    x = torch.randn(40, 12)
    exe = compile_graph(trace(lambda v, i: v[i] * 2.0, x, torch.tensor([1, 2])), [x, torch.tensor([1, 2])], "small")
    with pytest.raises(InputRangeError, match="out of bounds"):
        run_fresh(exe, [x.numpy(), np.array([1, bad])], SimulatorRunner("small"))


@pytest.mark.parametrize("make", ["empty", "empty_like", "new_empty"])
def test_inverse_permutation_into_an_empty_buffer_like_moe_routing(make: str) -> None:
    """Mixtral's grouped-mm routing: `inv = empty(n); inv[perm] = arange(n); out = x[inv]`. The empty buffer is
    made on the CTPU (it came from the CPU with garbage int64 values, and the next layer's segment, checking that
    its int inputs fit int32, ran on the CPU)."""
    x = torch.randn(18, 16)
    x[4, :2] = torch.tensor([float("nan"), -0.0])
    perm = torch.randperm(18, generator=torch.Generator().manual_seed(3))

    def fn(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
        n = p.shape[0]
        inv = {"empty": lambda: torch.empty(n, dtype=torch.long), "empty_like": lambda: torch.empty_like(p),
               "new_empty": lambda: p.new_empty(n)}[make]()
        inv[p] = torch.arange(n)
        return v[inv] * 2.0

    torch._dynamo.reset()
    ctpu_stats.reset()
    got = torch.compile(fn, backend="ctpu", options={"cache": False})(x, perm)
    assert dict(ctpu_stats.last().fallback_ops) == {} and ctpu_stats.last().kernels_launched == 1
    torch.testing.assert_close(got, fn(x, perm), rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("bounds", ["min", "max", "both"])
def test_clamp_with_tensor_bounds(bounds: str) -> None:
    """clamp_min / clamp_max / clamp of tensor bounds (AMSGrad's running max), bit for bit: ±0 (the first of
    equal values), NaN in x or in a bound, ±inf, a subnormal, lo > hi (gives hi), broadcast bounds."""
    edges = [0.0, -0.0, 1.0, -2.0, float("nan"), float("inf"), -float("inf"), 1e-45, 5.0, 3e38]
    x = torch.tensor([edges, edges[::-1], [v * -1 for v in edges]])
    lo = torch.tensor([-0.0, 0.0, float("nan"), -1.0, 0.0, 3.0, -3.0, 0.0, 6.0, -1e-45])
    hi = torch.tensor([[0.0], [float("nan")], [2.0]])
    fns = {"min": lambda a, b, c: torch.clamp_min(a, b), "max": lambda a, b, c: torch.clamp_max(a, c),
           "both": lambda a, b, c: torch.clamp(a, b, c)}
    outs, refs, _ = compile_and_run(fns[bounds], x, lo, hi)
    np.testing.assert_array_equal(outs[0].view(np.int32), refs[0].view(np.int32))


def test_clamp_with_tensor_bounds_at_a_model_shape_on_large() -> None:
    """17 tokens x hidden 2048 with a per-channel bound row, on `large`, edge values in the first row."""
    x, lo = torch.randn(17, 2048), torch.randn(2048) * 0.5
    x[0, :6] = torch.tensor([float("nan"), float("inf"), -float("inf"), 1e-45, -0.0, 3e38])
    lo[:2] = torch.tensor([float("nan"), 0.0])
    outs, refs, _ = compile_and_run(lambda x, lo: torch.clamp(x, lo, lo + 1.0), x, lo, config="large")
    nan = np.isnan(refs[0])
    np.testing.assert_array_equal(np.isnan(outs[0]), nan)  # the NaN column (a NaN bound), any NaN payload
    np.testing.assert_array_equal(outs[0].view(np.int32)[~nan], refs[0].view(np.int32)[~nan])
