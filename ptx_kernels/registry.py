"""`kernel_for`: the PTX kernel for one fused node of docs/fused_ops.md (or a plain mm/bmm), by static shapes.

Arguments follow each op's schema order; an absent optional tensor (`Tensor?`) is passed as shape None.
Non-tensor schema arguments (eps, dim, act, causal, scale, ...) come in `attrs`. Kernels are cached per
specialisation, so asking twice costs a dict lookup.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ptx_kernels import attention, elementwise, gemm, gemm_simt, rowwise
from ptx_kernels.core import PtxKernel, Shape, numel

_CACHE: dict[tuple, PtxKernel] = {}


def _opt(shapes: Sequence[Shape | None], dtypes: Sequence[torch.dtype | None], i: int) -> torch.dtype | None:
    return dtypes[i] if len(shapes) > i and shapes[i] is not None else None


def _any_gemm(m_: int, n_: int, k_: int, a_dtype, w_dtype, **kw: Any) -> PtxKernel:
    """wgmma + TMA for bf16 operands with 16-byte row strides; the SIMT fp32-accumulate kernel otherwise
    (fp32 operands = matmul precision "highest", or bf16 with K % 8 != 0)."""
    for dt in (a_dtype, w_dtype):
        if dt not in (torch.float32, torch.bfloat16):
            raise NotImplementedError(f"ptx linear/mm: operand dtype {dt} (fp32 or bf16)")
    tma_ok = k_ % 8 == 0 and (kw.get("w_layout") != "kn" or n_ % 8 == 0)
    if a_dtype == w_dtype == torch.bfloat16 and tma_ok:
        return gemm.gemm(m_, n_, k_, **kw)
    return gemm_simt.gemm_simt(m_, n_, k_, a_dtype=a_dtype, w_dtype=w_dtype, **kw)


def _linear(shapes, dtypes, attrs) -> PtxKernel:
    x, w = tuple(shapes[0]), tuple(shapes[1])
    k_, n_ = w[-2], w[-1]
    if x[-1] != k_:
        raise ValueError(f"linear: x {x} and w {w} disagree on K")
    return _any_gemm(
        numel(x) // k_,
        n_,
        k_,
        dtypes[0],
        dtypes[1],
        w_layout=attrs.get("w_layout", "nk"),
        out_dtype=dtypes[0],
        bias_dtype=_opt(shapes, dtypes, 2),
        act=attrs.get("act", "none"),
        residual_dtype=_opt(shapes, dtypes, 3),
    )


def _mm(shapes, dtypes, attrs) -> PtxKernel:
    a, b = tuple(shapes[0]), tuple(shapes[1])
    batch = a[0] if len(a) == 3 else 1
    return _any_gemm(
        a[-2], b[-1], a[-1], dtypes[0], dtypes[1], batch=batch, w_layout=attrs.get("w_layout", "kn"),
        out_dtype=dtypes[0],
    )


def _builders() -> dict[str, Any]:
    return {
        "rms_norm": lambda s, d, a: rowwise.rms_norm(
            tuple(s[0]), d[0], _opt(s, d, 1), float(a.get("eps", 1e-6))
        ),
        "layer_norm": lambda s, d, a: rowwise.layer_norm(
            tuple(s[0]), d[0], _opt(s, d, 1), _opt(s, d, 2), float(a.get("eps", 1e-5))
        ),
        "softmax": lambda s, d, a: rowwise.softmax(tuple(s[0]), d[0], int(a.get("dim", -1))),
        "swiglu": lambda s, d, a: _swiglu(s, d, a),
        "rope": lambda s, d, a: elementwise.rope(tuple(s[0]), d[0], tuple(s[1]), tuple(s[2]), d[1]),
        "attention": lambda s, d, a: _no_kv_len(s) or attention.attention(
            tuple(s[0]),
            tuple(s[1]),
            d[0],
            causal=bool(a.get("causal", False)),
            safe=bool(a.get("safe", True)),
            scale=float(a["scale"]) if a.get("scale") is not None else tuple(s[0])[-1] ** -0.5,
            mask_shape=tuple(s[3]) if len(s) > 3 and s[3] is not None else None,
            mask_dtype=_opt(s, d, 3),
        ),
        "linear": _linear,
        "mm": _mm,
        "bmm": _mm,
    }


def _no_kv_len(shapes) -> None:
    if len(shapes) > 4 and shapes[4] is not None:
        raise NotImplementedError("ptx attention: kv_len (a key dim padded for dynamic shapes)")


def _swiglu(shapes, dtypes, attrs) -> PtxKernel:
    if tuple(shapes[0]) != tuple(shapes[1]):
        raise NotImplementedError(f"ptx swiglu: gate {shapes[0]} and up {shapes[1]} must have one shape")
    return elementwise.swiglu(tuple(shapes[0]), dtypes[0], dtypes[1], attrs.get("act", "silu"))


def kernel_for(
    op_name: str,
    arg_shapes: Sequence[Shape | None],
    arg_dtypes: Sequence[torch.dtype | None],
    attrs: dict[str, Any] | None = None,
) -> PtxKernel:
    """The kernel for `op_name` ('ctpu::rms_norm', 'rms_norm', 'aten::mm', 'bmm', 'aten.bmm.default' (an
    OpOverload's str), ...) at these shapes."""
    attrs = dict(attrs or {})
    parts = op_name.split("::")[-1].split(".")
    short = parts[1] if len(parts) > 1 and parts[0] in ("aten", "ctpu") else parts[0]
    builders = _builders()
    if short not in builders:
        raise NotImplementedError(f"no PTX kernel for op {op_name!r} (have {sorted(builders)})")
    if any(s is not None and numel(s) == 0 for s in arg_shapes):
        # A size-0 dim gives a zero grid (an invalid launch) or a division by zero in the builders;
        # refused, the node runs on the CPU.
        raise NotImplementedError(f"ptx {short}: a size-0 tensor among {list(arg_shapes)}")
    key = (
        short,
        tuple(None if s is None else tuple(s) for s in arg_shapes),
        tuple(arg_dtypes),
        tuple(sorted((k, repr(v)) for k, v in attrs.items())),
    )
    if key not in _CACHE:
        _CACHE[key] = builders[short](list(arg_shapes), list(arg_dtypes), attrs)
    return _CACHE[key]


def supported_ops() -> list[str]:
    return sorted(_builders())
