"""The CTPU numerics contract (docs/architecture.md, "Numerics contract"), as numpy functions.

Written once and shared by the simulator, the programs' references, the RTL's scoreboards and the
compiler's tests. All functions take and return numpy arrays; fp32 values travel as float32 or as their
uint32 bit patterns, bf16 values as uint16 bit patterns.
"""

from __future__ import annotations

import numpy as np

CANONICAL_NAN_F32 = 0x7FC00000
CANONICAL_NAN_BF16 = 0x7FC0
INT32_MIN = -(1 << 31)
INT32_MAX = (1 << 31) - 1


def canonicalize_nan(a: np.ndarray) -> np.ndarray:
    """float32 array with every NaN replaced by the canonical quiet NaN (in place when possible)."""
    nan = np.isnan(a)
    if nan.any():
        a = np.array(a, dtype=np.float32, copy=True)
        a.view(np.uint32)[nan] = CANONICAL_NAN_F32
    return a


def f32_to_bf16_bits(a: np.ndarray) -> np.ndarray:
    """Round fp32 to bf16, nearest-even on the bit pattern (subnormals kept, overflow -> inf, NaN -> canonical)."""
    a = np.asarray(a, dtype=np.float32)
    bits = a.view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    return np.where(np.isnan(a), np.uint16(CANONICAL_NAN_BF16), rounded)


def bf16_bits_to_f32(b: np.ndarray) -> np.ndarray:
    """Widen bf16 bit patterns to fp32 (exact)."""
    return (np.asarray(b, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(a: np.ndarray) -> np.ndarray:
    """fp32 -> nearest bf16 value, kept in fp32 (what `vcvt.bf` and the MXU inputs do)."""
    return bf16_bits_to_f32(f32_to_bf16_bits(a))


def f32_to_i32(a: np.ndarray) -> np.ndarray:
    """`vcvt.f2i`: truncate toward zero, NaN -> 0, saturate at the int32 range."""
    a = np.asarray(a, dtype=np.float32)
    t = np.trunc(np.nan_to_num(a.astype(np.float64), nan=0.0, posinf=INT32_MAX, neginf=INT32_MIN))
    return np.clip(t, INT32_MIN, INT32_MAX).astype(np.int32)


def fmax(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`vmax.f`: b > a ? b : a, canonical NaN if either is NaN."""
    return _pick(np.greater(b, a), a, b)


def fmin(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """`vmin.f`: b < a ? b : a, canonical NaN if either is NaN."""
    return _pick(np.less(b, a), a, b)


def _pick(take_b: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    r = np.where(take_b, b, a).astype(np.float32, copy=False)
    nan = np.isnan(a) | np.isnan(b)
    if nan.any():
        r.view(np.uint32)[nan] = CANONICAL_NAN_F32
    return r


def tree_reduce(x: np.ndarray, axis: int, op: str) -> np.ndarray:
    """Pairwise-halves reduction along `axis` (size a power of two), result broadcast along it.

    With w the width: x[i] = op(x[i], x[i + w/2]) for i < w/2, then w = w/2, until w = 1.
    """
    x = np.swapaxes(np.asarray(x, dtype=np.float32), axis, -1)
    width = w = x.shape[-1]
    # max: b > a ? b : a at each level, and NaN where the reduced values hold one (NaN wins every level)
    nan = np.isnan(x).any(axis=-1, keepdims=True) if op != "sum" else None
    with np.errstate(all="ignore"):
        while w > 1:
            h = w // 2
            lo, hi = x[..., :h], x[..., h:w]
            x = (lo + hi) if op == "sum" else np.where(hi > lo, hi, lo)
            w = h
    if nan is not None and nan.any():
        x = np.where(nan, np.float32(np.nan), x)
    out = np.empty((*x.shape[:-1], width), np.float32)
    out[...] = canonicalize_nan(x)
    return np.swapaxes(out, axis, -1)


def mxu_matmul(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """The MXU's arithmetic for one pass: p = sum_k bf16(x[:, k]) * bf16(w[k, :]), k ascending, fp32 RNE.

    x: [rows, N] fp32, w: [N, N] fp32 (rounded to bf16 here; already-rounded values are unchanged).
    """
    return mxu_matmul_bf16(round_to_bf16(x), round_to_bf16(w))


def mxu_matmul_bf16(xb: np.ndarray, wb: np.ndarray) -> np.ndarray:
    """As mxu_matmul, for operands that are already bf16 values in fp32 containers."""
    p = np.zeros((xb.shape[0], wb.shape[1]), dtype=np.float32)
    columns = np.ascontiguousarray(xb.T, dtype=np.float32)[:, :, None]  # x[:, k] as a contiguous column
    product = np.empty_like(p)
    with np.errstate(all="ignore"):
        for k in range(wb.shape[0]):
            np.multiply(columns[k], wb[k], out=product)
            p += product
    return canonicalize_nan(p)
