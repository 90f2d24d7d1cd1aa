"""The fused GEMM epilogue shared by the wgmma GEMM (`gemm.py`) and the SIMT GEMM (`gemm_simt.py`).

    out[b, m, n] = act(acc[m, n] + bias[n]) + residual[b, m, n]

Both kernels keep `acc` in registers and store every element straight from them, guarded by m < M and
n < N; they differ only in which (row, column) each accumulator register holds. This module owns the
kernel interface of the epilogue (its `.param`s, tensors and name tags) and the per-element code.
"""

from __future__ import annotations

import torch
from pyptx import ptx, reg
from pyptx.reg import Reg
from pyptx.types import pred, u32, u64

from ptx_kernels import mathops as m
from ptx_kernels.core import DTYPE_BYTES, KernelParam, TensorArg, global_ptr, load_f32, setp, store_f32


def check_options(w_layout: str, act: str) -> None:
    """Reject a `w_layout` or activation that no GEMM kernel implements."""
    if w_layout not in ("nk", "kn"):
        raise ValueError(f"w_layout must be 'nk' or 'kn', got {w_layout!r}")
    if act not in m.ACTIVATIONS:
        raise NotImplementedError(f"ptx gemm: unknown activation {act!r}")


def name_tags(bias_dtype: torch.dtype | None, residual_dtype: torch.dtype | None) -> tuple[str, str]:
    """The kernel-name parts that say whether bias / residual are fused."""
    return "b" if bias_dtype else "", "r" if residual_dtype else ""


def add_epilogue_args(
    params: list[KernelParam],
    inputs: list[TensorArg],
    batch: int,
    m_: int,
    n_: int,
    bias_dtype: torch.dtype | None,
    residual_dtype: torch.dtype | None,
) -> None:
    """Append the epilogue's `.param`s (bias, residual, out: in this order, after the operands) and inputs."""
    if bias_dtype is not None:
        params.append(KernelParam("bias", "ptr", "bias"))
        inputs.append(TensorArg("bias", (n_,), bias_dtype))
    if residual_dtype is not None:
        params.append(KernelParam("residual", "ptr", "residual"))
        inputs.append(TensorArg("residual", (batch, m_, n_), residual_dtype))
    params.append(KernelParam("out", "ptr", "out"))


def addr64(base: Reg, index: Reg, esize: int) -> Reg:
    """base + index * esize with a 64-bit index (one mad)."""
    out = reg.scalar(u64)
    ptx.inst.mad.lo.u64(out, index, esize, base)
    return out


class Epilogue:
    """Emits the epilogue of one thread: `row()` once per output row it holds, then `store()` per column.

    Construction loads the out / bias / residual pointers (in that order) from the kernel parameters.
    """

    def __init__(
        self,
        m_: int,
        n_: int,
        out_dtype: torch.dtype,
        bias_dtype: torch.dtype | None,
        act: str,
        residual_dtype: torch.dtype | None,
    ) -> None:
        self.m, self.n, self.act = m_, n_, act
        self.out_dtype, self.bias_dtype, self.residual_dtype = out_dtype, bias_dtype, residual_dtype
        self.out_p = global_ptr("out")
        self.bias_p = global_ptr("bias") if bias_dtype is not None else None
        self.res_p = global_ptr("residual") if residual_dtype is not None else None

    def row(self, bz: Reg, row: Reg) -> tuple[Reg, Reg]:
        """(row < M, first element of the row in the [batch * M, N] output) for row `row` of batch `bz`."""
        row_ok = setp("lt", row, self.m)
        flat_row = reg.scalar(u32)
        ptx.inst.mad.lo.u32(flat_row, bz, self.m, row)
        row_elem = reg.scalar(u64)
        ptx.inst.mul.wide.u32(row_elem, flat_row, self.n)
        return row_ok, row_elem

    def store(self, acc: Reg, row: tuple[Reg, Reg], col: Reg) -> None:
        """Finish accumulator `acc` of output (row, col) and store it where row < M and col < N."""
        row_ok, row_elem = row
        ok = reg.scalar(pred)
        ptx.inst.setp.lt.and_.u32(ok, col, self.n, row_ok)
        value = self._value(acc, col, row_elem, ok)
        index = reg.scalar(u64)
        ptx.inst.cvt.u64.u32(index, col)
        ptx.inst.add.u64(index, index, row_elem)
        store_f32(addr64(self.out_p, index, DTYPE_BYTES[self.out_dtype]), value, self.out_dtype, ok)

    def _value(self, v: Reg, col: Reg, row_elem: Reg, ok: Reg) -> Reg:
        if self.bias_p is not None:
            off = reg.scalar(u64)
            ptx.inst.cvt.u64.u32(off, col)
            bias = load_f32(addr64(self.bias_p, off, DTYPE_BYTES[self.bias_dtype]), self.bias_dtype, ok)
            v = m.binary("add", v, bias)
        if self.act != "none":
            v = m.activation(self.act, v)
        if self.res_p is not None:
            idx = reg.scalar(u64)
            ptx.inst.cvt.u64.u32(idx, col)
            ptx.inst.add.u64(idx, idx, row_elem)
            res = load_f32(addr64(self.res_p, idx, DTYPE_BYTES[self.residual_dtype]), self.residual_dtype, ok)
            v = m.binary("add", v, res)
        return v
