"""Ops that index by data (gather, scatter, index, index_put with accumulate) with an index out of range: the
kernel traps on the poison address its check gives the index, and the launch raises InputRangeError (eager
raises too; the compiled call reruns on the CPU, where torch raises its own error). Never a value: before,
gather and scatter gave NaN and went on. A negative index is valid where torch counts it from the end
(index, index_put) and out of range where torch rejects it (gather, scatter)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from codegen_helpers import compile_and_run, trace

from codegen import compile_graph
from device_sim.executable import InputRangeError, run_fresh
from device_sim.machine import CtpuTrap
from device_sim.runners import SimulatorRunner

HUGE = 2**31 - 1

# name -> (fn(x, i), a valid index, out-of-range values to put at position 1 of the flat index)
CASES = {
    "gather": (lambda x, i: torch.gather(x, 1, i) * 2.0, torch.tensor([[1], [2], [3], [0]]), [4, -1, HUGE, -HUGE]),
    "scatter": (lambda x, i: torch.scatter(x, 1, i, 7.0), torch.tensor([[1], [2], [3], [0]]), [4, -1, HUGE]),
    "index": (lambda x, i: x[:, i] * 2.0, torch.tensor([1, -1, 0]), [4, -5, HUGE]),
    "index_dim0": (lambda x, i: x[i] * 2.0, torch.tensor([1, -1, 0]), [4, -5, HUGE]),
    "index_put_acc": (lambda x, i: torch.index_put(x, (i,), torch.ones(3, 4), accumulate=True),
                      torch.tensor([1, -1, 2]), [4, -5, HUGE]),  # rows untouched keep -0; duplicates: elsewhere
}


def _x() -> torch.Tensor:
    x = torch.randn(4, 4)
    x[0, 1], x[1, 2], x[2, 3] = -0.0, math.inf, math.nan
    return x


@pytest.mark.parametrize("name", CASES)
def test_valid_indices_match_eager_bit_for_bit(name: str) -> None:
    fn, idx, _ = CASES[name]
    outs, refs, _ = compile_and_run(fn, _x(), idx)
    np.testing.assert_array_equal(outs[0], refs[0])


@pytest.mark.parametrize(("name", "bad"), [(n, b) for n, (_, _, bads) in CASES.items() for b in bads])
def test_an_index_out_of_range_traps(name: str, bad: int) -> None:
    fn, idx, _ = CASES[name]
    x = _x()
    bad_idx = idx.clone()
    bad_idx.view(-1)[1] = bad
    with pytest.raises((IndexError, RuntimeError), match="out of bounds"):
        fn(x, bad_idx)  # eager raises
    exe = compile_graph(trace(fn, x, idx), [x, idx], "small")
    with pytest.raises(InputRangeError, match="index out of range") as err:
        run_fresh(exe, [x.numpy(), bad_idx.numpy()], SimulatorRunner("small"))
    assert isinstance(err.value.__cause__, CtpuTrap) and err.value.__cause__.index_range


def test_gather_of_integers_with_a_smaller_index() -> None:
    """BERT's token_type_ids: an int64 buffer gathered at the positions (an index smaller than x off dim)."""
    x, idx = torch.arange(40).reshape(2, 20) * 3 - 7, torch.tensor([[5, 0, 19], [2, 2, 1]])
    outs, refs, _ = compile_and_run(lambda x, i: torch.gather(x, 1, i), x, idx)
    np.testing.assert_array_equal(outs[0], refs[0])


def test_an_embedding_of_gathered_ids() -> None:
    """BERT's token types: ids gathered from an expanded int64 buffer, then looked up; both loads fuse into one
    generic, and the first gathers one-column rows used across the second's row."""
    buf, pos, table = torch.zeros(1, 20, dtype=torch.long), torch.tensor([[0, 3, 19, 3, 1]]), torch.randn(2, 16)
    buf[0, 3] = 1
    table[1, :2] = torch.tensor([-0.0, math.nan])
    outs, refs, _ = compile_and_run(
        lambda t, b, p: torch.nn.functional.embedding(torch.gather(b.expand(1, 20), 1, p), t) * 2.0, table, buf, pos)
    np.testing.assert_array_equal(outs[0], refs[0])


def test_index_on_an_inner_dim_of_a_4d_tensor() -> None:
    """Falcon's rotary cache lookup on an inner dim: x[:, :, idx] of a [B, H, S, D] tensor, negative indices."""
    x, idx = torch.randn(2, 3, 9, 16).to(torch.bfloat16), torch.tensor([[8, 0, -1, 4, -9]])
    x[0, 1, 0, :2] = torch.tensor([-0.0, math.nan])
    outs, refs, _ = compile_and_run(lambda x, i: x[:, :, i], x, idx)
    np.testing.assert_array_equal(outs[0], refs[0])


def test_compiled_call_raises_torchs_error_and_recovers() -> None:
    """Through torch.compile: an index out of range reruns the call on the CPU (one warning), where torch raises
    its own error; the next call with valid indices runs on the CTPU again."""
    import torch_tpu_backend  # noqa: F401  (registers the backend and the device)
    from torch_tpu_backend import stats

    torch._dynamo.reset()
    x, idx = _x(), torch.tensor([[1], [2], [3], [0]])
    f = torch.compile(lambda x, i: torch.gather(x, 1, i) * 2.0, backend="ctpu")
    torch.testing.assert_close(f(x, idx), torch.gather(x, 1, idx) * 2.0, rtol=0, atol=0, equal_nan=True)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(RuntimeError, match="index 4 is out of"):
        warnings.simplefilter("always")
        f(x, torch.tensor([[1], [4], [3], [0]]))
    assert any("index out of range" in str(w.message) for w in caught)
    stats.reset()
    torch.testing.assert_close(f(x, idx), torch.gather(x, 1, idx) * 2.0, rtol=0, atol=0, equal_nan=True)
    assert stats.last().kernels_launched >= 1 and not stats.last().fallback_ops
