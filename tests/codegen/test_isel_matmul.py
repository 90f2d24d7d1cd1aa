"""Matmul instruction selection (codegen/isel_matmul.py) on vmem that earlier kernels left dirty.

The MXU multiplies a whole N x N weight tile: for K % N != 0 the weight rows K .. ceil(K / N) * N are
never written by B's DMA, and A's lanes past K are zero, so those rows must hold zeros (0 x NaN and
0 x inf are NaN). On `large` (N = 128) that is up to 127 rows per tile; issue 16: only the last 8 were
zeroed, and a Llama of hidden 128 gave NaN logits at 1, 2, 4 .. 22, 25 and 26 tokens (attention's
P @ V has K = tokens, Q @ K^T K = head dim 16), depending on what earlier kernels had left in vmem.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codegen_helpers import run_with_poisoned_vmem, trace

from codegen import compile_graph

torch.manual_seed(0)

CASES = [  # (config, A shape, B shape, dtype): K below, between and at multiples of N and of 8
    ("large", (16, 16), (16, 64), torch.float32),
    ("large", (24, 100), (100, 16), torch.float32),
    ("large", (8, 200), (200, 136), torch.float32),
    ("large", (16, 128), (128, 32), torch.float32),
    ("large", (16, 16), (16, 64), torch.bfloat16),
    ("large", (8, 16, 16), (8, 16, 16), torch.float32),  # batched (a batch loop): attention's P @ V
    ("small", (16, 12), (12, 8), torch.float32),
    ("small", (4, 3, 20), (4, 20, 5), torch.float32),
]


@pytest.mark.parametrize(("config", "a_shape", "b_shape", "dtype"), CASES,
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_weight_rows_past_k_are_zero_on_dirty_vmem(config: str, a_shape: tuple[int, ...], b_shape: tuple[int, ...],
                                                    dtype: torch.dtype) -> None:
    a, b = torch.randn(a_shape).to(dtype), torch.randn(b_shape).to(dtype)
    cg = compile_graph(trace(torch.matmul, a, b), [a, b], config, matmul_precision="highest")
    (out,) = run_with_poisoned_vmem(cg, [a.float().numpy(), b.float().numpy()])
    ref = (a.double() @ b.double()).numpy()
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
