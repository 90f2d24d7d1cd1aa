"""Elementwise instruction selection (codegen/isel_vector.py): how the iteration space becomes rows."""

from __future__ import annotations

import numpy as np
import torch
from codegen_helpers import run_with_poisoned_vmem, trace

from codegen import compile_graph
from device_sim.config import get_config
from device_sim.executable import run_fresh
from device_sim.runners import SimulatorRunner


def test_size_one_dims_do_not_split_rows() -> None:
    """A decode step's q [1, 1, H, D] -> [1, H, 1, D] in bf16 (issue 13): the size-1 dims' strides stopped H
    from merging into rows, so each head was a group of one row with its own load, wait and store: 32 DMA
    latencies (16,983 cycles on `large`) for 8 KiB. As H rows it is one tile, a few latencies."""
    x = torch.randn(1, 1, 32, 64)
    x[0, 0, 3, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40, 3.4e38])

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 1, 3).to(torch.bfloat16)

    exe = compile_graph(trace(f, x), [x], "large")
    (out,), stats = run_fresh(exe, [x.numpy()], SimulatorRunner("large"))
    ref = f(x).float().numpy()
    assert stats.cycles < 4 * get_config("large").dma_latency, stats.cycles
    (poisoned,) = run_with_poisoned_vmem(exe, [x.numpy()])
    nan = np.isnan(ref)
    for got in (out, poisoned):  # the same bits (-0 and subnormals too); NaN is the canonical one
        assert np.isnan(got[nan]).all()
        np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
