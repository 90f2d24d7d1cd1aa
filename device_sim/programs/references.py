"""Reference functions the program manifests name (device_sim/manifest.py calls them).

Each takes the manifest's inputs by name (fp32 arrays: bf16 inputs already widened, exactly) plus the
check's params, and returns the expected output as an array. Two kinds:

- bit-exact models (`*_ctpu`, `gemm_mxu_order`): the same fp32 operations in the same order as the
  program, so the program must match them to the bit;
- float64 references (`*_f64`): the mathematical result, checked with a documented tolerance.
"""

from __future__ import annotations

import numpy as np

from device_sim import sequences


def _bf16_products_sum(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One MXU pass: p = sum_k fl32(a[:, k] * b[k, :]), k ascending from +0, every step fp32 RNE.

    a [M, n], b [n, Nc]: bf16 values in fp32 containers (their products are exact fp32 whenever normal).
    """
    p = np.zeros((a.shape[0], b.shape[1]), dtype=np.float32)
    for k in range(a.shape[1]):
        p += a[:, k : k + 1] * b[k : k + 1, :]
    return p


def gemm_mxu_order(inputs: dict[str, np.ndarray], k_tile: int = 8) -> np.ndarray:
    """A @ B as gemm.s computes it: per k-tile an MXU pass (k ascending within the tile), and across the
    k-tiles C = p_0, then C = fl32(C + p_t) for t = 1, 2, ... in ascending order (mxu.mms then mxu.mmas)."""
    a, b = inputs["A"].astype(np.float32), inputs["B"].astype(np.float32)
    with np.errstate(all="ignore"):
        c = _bf16_products_sum(a[:, :k_tile], b[:k_tile])
        for k0 in range(k_tile, a.shape[1], k_tile):
            c += _bf16_products_sum(a[:, k0 : k0 + k_tile], b[k0 : k0 + k_tile])
    return c


def matmul_f64(inputs: dict[str, np.ndarray]) -> np.ndarray:
    return inputs["A"].astype(np.float64) @ inputs["B"].astype(np.float64)


def softmax_ctpu(inputs: dict[str, np.ndarray], lanes: int = 8) -> np.ndarray:
    """softmax.s's exact arithmetic: sequences.softmax_row on each row, one row per vreg."""
    return sequences.softmax_rows(inputs["X"], lanes)


def softmax_f64(inputs: dict[str, np.ndarray]) -> np.ndarray:
    x = inputs["X"].astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def rmsnorm_ctpu(inputs: dict[str, np.ndarray], eps: float, lanes: int = 8) -> np.ndarray:
    """rmsnorm.s's exact arithmetic: sequences.rmsnorm_row on each row, one row per vreg."""
    return sequences.rmsnorm_rows(inputs["X"], inputs["W"], eps, lanes)


def rmsnorm_f64(inputs: dict[str, np.ndarray], eps: float) -> np.ndarray:
    x, w = inputs["X"].astype(np.float64), inputs["W"].astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w
