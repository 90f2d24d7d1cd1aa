"""fp32 GEMM on CUDA cores (SIMT FFMA), with the same fused epilogue as the wgmma GEMM.

    out[b, m, n] = act(sum_k a[b, m, k] * w[b, k, n] + bias[n]) + residual[b, m, n]

Why SIMT and not 3xbf16/3xtf32 on tensor cores: this is the `float32_matmul_precision="highest"` path,
so the product must be fp32-accurate. fp32 FFMA gives exactly that with no operand splitting; a 3-way
split on wgmma is ~3x faster on H100 for large shapes but needs a conversion pass (hi/lo bf16 or tf32
operands in shared memory, which TMA cannot produce) and is not bit-for-bit fp32. The graphs that reach
this kernel today are small fp32 models; bf16 models take the wgmma path.

CTA tile 64 x 64 x 16, 256 threads as 16 x 16; thread (tx, ty) owns the 4 x 4 outputs at rows ty + 16 i,
columns tx + 16 j (strided so that shared-memory reads are broadcasts / distinct banks). Each K step every
thread loads 4 elements of A and 4 of B (guarded: any M, N, K, no alignment rule), stores them k-major in
shared memory (rows padded to 65 floats against bank conflicts), then 16 x 16 FFMAs. Inputs may be fp32
or bf16 (widened on load), so this is also the fallback for bf16 shapes the TMA path refuses (K % 8 != 0).
"""

from __future__ import annotations

import torch
from pyptx import ptx, reg
from pyptx.reg import Reg
from pyptx.types import f32, pred, u32, u64

from ptx_kernels.core import (
    DTYPE_BYTES,
    DTYPE_NAMES,
    KernelParam,
    PtxKernel,
    TensorArg,
    ceil_div,
    ctaid,
    fconst,
    fresh_label,
    global_ptr,
    kernel_name,
    load_f32,
    setp,
    smem_base,
    tid_x,
    trace,
)
from ptx_kernels.epilogue import Epilogue, add_epilogue_args, check_options, name_tags

TILE, BK, THREADS, PER = 64, 16, 256, 4
PAD = TILE + 1  # floats per shared-memory k-row


def gemm_simt(
    m_: int,
    n_: int,
    k_: int,
    *,
    batch: int = 1,
    w_layout: str = "nk",
    a_dtype: torch.dtype = torch.float32,
    w_dtype: torch.dtype = torch.float32,
    out_dtype: torch.dtype = torch.float32,
    bias_dtype: torch.dtype | None = None,
    act: str = "none",
    residual_dtype: torch.dtype | None = None,
) -> PtxKernel:
    """[batch, M, K] x [batch, K, N] with fp32 accumulation; w_layout as in `gemm.gemm`."""
    check_options(w_layout, act)
    k_tiles = ceil_div(k_, BK)
    name = kernel_name(
        "ctpu_gemm_simt", batch, m_, n_, k_, w_layout, DTYPE_NAMES[a_dtype], DTYPE_NAMES[w_dtype],
        DTYPE_NAMES[out_dtype], act, *name_tags(bias_dtype, residual_dtype),
    )

    def body() -> None:
        tid = tid_x()
        tx, ty = reg.scalar(u32), reg.scalar(u32)
        ptx.inst.and_.b32(tx, tid, 15)
        ptx.inst.shr.u32(ty, tid, 4)
        n0, m0, bz = reg.scalar(u32), reg.scalar(u32), ctaid("z")
        ptx.inst.mul.lo.u32(n0, ctaid("x"), TILE)
        ptx.inst.mul.lo.u32(m0, ctaid("y"), TILE)
        a_s = smem_base()
        b_s = reg.scalar(u32)
        ptx.inst.add.u32(b_s, a_s, BK * PAD * 4)
        a_p, w_p = global_ptr("a"), global_ptr("w")

        # Loader r of this thread: A element (row ty + 16 r, k tx) of the tile, B likewise for "nk";
        # for "kn" the 16 x 64 tile is read row by row: (k = idx / 64, n = idx % 64), idx = tid + 256 r.
        a_loads, b_loads = [], []
        for r in range(PER):
            a_loads.append(_loader(a_p, bz, m0, ty, tx, r, m_, k_, a_dtype, a_s))
            if w_layout == "nk":
                b_loads.append(_loader(w_p, bz, n0, ty, tx, r, n_, k_, w_dtype, b_s))
            else:
                b_loads.append(_kn_loader(w_p, bz, n0, tid, r, n_, k_, w_dtype, b_s))

        acc = [[fconst(0.0) for _ in range(PER)] for _ in range(PER)]
        kt = reg.scalar(u32)
        ptx.inst.mov.u32(kt, 0)
        k_pos = reg.scalar(u32)  # k of this thread's loads in the current tile (k-minor index)
        top, done = fresh_label("k_loop"), fresh_label("k_done")
        ptx.label(top)
        ptx.bra(done, pred=setp("ge", kt, k_tiles))
        for ld in (*a_loads, *b_loads):
            ptx.inst.mad.lo.u32(k_pos, kt, BK, ld.k_local)
            ok = reg.scalar(pred)
            ptx.inst.setp.lt.and_.u32(ok, k_pos, k_, ld.in_range)
            value = load_f32(ld.addr, ld.dtype, ok)
            ptx.inst.st.shared.f32(ptx.addr(ld.smem), value)
            ptx.inst.add.u64(ld.addr, ld.addr, ld.step)
        ptx.inst.bar.sync(0)
        a_row, b_row = reg.scalar(u32), reg.scalar(u32)  # &As[0][ty], &Bs[0][tx]
        ptx.inst.mad.lo.u32(a_row, ty, 4, a_s)
        ptx.inst.mad.lo.u32(b_row, tx, 4, b_s)
        av = [reg.scalar(f32) for _ in range(PER)]
        bv = [reg.scalar(f32) for _ in range(PER)]
        for kk in range(BK):
            for i in range(PER):
                ptx.inst.ld.shared.f32(av[i], ptx.addr(a_row, 4 * (kk * PAD + 16 * i)))
                ptx.inst.ld.shared.f32(bv[i], ptx.addr(b_row, 4 * (kk * PAD + 16 * i)))
            for i in range(PER):
                for j in range(PER):
                    ptx.inst.fma.rn.f32(acc[i][j], av[i], bv[j], acc[i][j])
        ptx.inst.bar.sync(0)
        ptx.inst.add.u32(kt, kt, 1)
        ptx.bra(top)
        ptx.label(done)

        epilogue = Epilogue(m_, n_, out_dtype, bias_dtype, act, residual_dtype)
        for i in range(PER):
            row = reg.scalar(u32)
            ptx.inst.add.u32(row, m0, ty)
            ptx.inst.add.u32(row, row, 16 * i)
            out_row = epilogue.row(bz, row)
            for j in range(PER):
                c = reg.scalar(u32)
                ptx.inst.add.u32(c, n0, tx)
                ptx.inst.add.u32(c, c, 16 * j)
                epilogue.store(acc[i][j], out_row, c)
        ptx.ret()

    params = [KernelParam("a", "ptr", "a"), KernelParam("w", "ptr", "w")]
    inputs = [
        TensorArg("a", (batch, m_, k_), a_dtype),
        TensorArg("w", (batch, k_, n_), w_dtype, (k_ * n_, 1, k_) if w_layout == "nk" else None),
    ]
    add_epilogue_args(params, inputs, batch, m_, n_, bias_dtype, residual_dtype)
    return trace(
        name,
        body,
        params,
        grid=(ceil_div(n_, TILE), ceil_div(m_, TILE), batch),
        block=(THREADS, 1, 1),
        smem_bytes=2 * BK * PAD * 4,
        inputs=inputs,
        outputs=[TensorArg("out", (batch, m_, n_), out_dtype)],
        notes={"kind": "gemm_simt", "tile": (TILE, TILE, BK), "w_layout": w_layout},
    )


class _Load:
    """One per-thread global -> shared copy per K step: running address, its step, guards, smem slot."""

    def __init__(self, addr: Reg, step: int, k_local: Reg, in_range: Reg, smem: Reg, dtype: torch.dtype):
        self.addr, self.step, self.k_local, self.in_range, self.smem, self.dtype = (
            addr, step, k_local, in_range, smem, dtype,
        )


def _loader(base, bz, r0, ty, tx, r, rows, k_, dtype, smem):
    """K-major operand ([rows, K] with K contiguous): element (row r0 + ty + 16 r, k tx)."""
    row = reg.scalar(u32)
    ptx.inst.add.u32(row, r0, ty)
    ptx.inst.add.u32(row, row, 16 * r)
    in_range = setp("lt", row, rows)
    esize = DTYPE_BYTES[dtype]
    elem = reg.scalar(u32)  # (bz * rows + row) * K + tx
    ptx.inst.mad.lo.u32(elem, row, k_, tx)
    ptx.inst.mad.lo.u32(elem, bz, rows * k_, elem)
    addr = reg.scalar(u64)
    off = reg.scalar(u64)
    ptx.inst.mul.wide.u32(off, elem, esize)
    ptx.inst.add.u64(addr, base, off)
    slot = reg.scalar(u32)  # &S[tx][ty + 16 r]
    ptx.inst.mad.lo.u32(slot, tx, PAD, ty)
    ptx.inst.add.u32(slot, slot, 16 * r)
    ptx.inst.mad.lo.u32(slot, slot, 4, smem)
    return _Load(addr, BK * esize, tx, in_range, slot, dtype)


def _kn_loader(base, bz, n0, tid, r, n_, k_, dtype, smem):
    """N-major w ([K, N], N contiguous): element (k = idx / 64, n = n0 + idx % 64), idx = tid + 256 r."""
    esize = DTYPE_BYTES[dtype]
    k_local, n_local = reg.scalar(u32), reg.scalar(u32)
    ptx.inst.shr.u32(k_local, tid, 6)
    ptx.inst.add.u32(k_local, k_local, 4 * r)
    ptx.inst.and_.b32(n_local, tid, 63)
    col = reg.scalar(u32)
    ptx.inst.add.u32(col, n0, n_local)
    in_range = setp("lt", col, n_)
    elem = reg.scalar(u32)  # (bz * K + k_local) * N + col
    ptx.inst.mad.lo.u32(elem, bz, k_, k_local)
    ptx.inst.mad.lo.u32(elem, elem, n_, col)
    addr = reg.scalar(u64)
    off = reg.scalar(u64)
    ptx.inst.mul.wide.u32(off, elem, esize)
    ptx.inst.add.u64(addr, base, off)
    slot = reg.scalar(u32)  # &S[k_local][n_local]
    ptx.inst.mad.lo.u32(slot, k_local, PAD, n_local)
    ptx.inst.mad.lo.u32(slot, slot, 4, smem)
    return _Load(addr, BK * n_ * esize, k_local, in_range, slot, dtype)


__all__ = ["gemm_simt"]
