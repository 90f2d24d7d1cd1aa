"""Attention with a flash-attention-style online softmax (one pass over the keys, no [L, S] matrix).

    out[b, h, l] = sum_s softmax_s(scale * q[b, h, l] . k[b, h / G, s] + mask[b, h, l, s]) v[b, h / G, s]

with G = Hq / Hkv (grouped-query attention). One warp per query row when D % 32 == 0, else one half-warp
per query row (D a multiple of 16, up to 256); four warps per CTA; each lane owns D / 32 (D / 16)
consecutive elements of q, of the running output and of every K/V row it reads, so K/V loads are
coalesced aligned vectors. With half-warps the two rows of a warp loop to the larger of their key counts
(keys past a row's own causal limit count as masked) so that every shuffle sees the full warp.
Per key: a warp-reduced dot product, then the online update
m' = max(m, s), l = l e^(m - m') + e^(s - m'), acc = acc e^(m - m') + e^(s - m') v.
Causal rows stop at key l + S - L (the last query sees the last key), so masked keys cost nothing.

This is a CUDA-core kernel: it is the right shape for decode (L = 1, bandwidth bound on K/V) and correct
for prefill, but prefill does not use tensor cores yet (see docs/ptx.md).
"""

from __future__ import annotations

import torch
from pyptx import ptx, reg
from pyptx.reg import Reg
from pyptx.types import pred, u32

from ptx_kernels import mathops as m
from ptx_kernels.core import (
    DTYPE_BYTES,
    DTYPE_NAMES,
    KernelParam,
    PtxKernel,
    Shape,
    TensorArg,
    ceil_div,
    ctaid,
    elem_addr,
    fconst,
    fimm,
    fresh_label,
    global_ptr,
    kernel_name,
    lane_and_group,
    load_chunks,
    load_f32,
    setp,
    store_chunks,
    tid_x,
    trace,
    warp_allreduce,
)

WARPS_PER_CTA = 4


def _mask_strides(mask_shape: Shape, full: Shape) -> tuple[int, ...]:
    """Element strides of a contiguous mask broadcast to `full` ([B, Hq, L, S]); 0 on broadcast dims."""
    padded = (1,) * (4 - len(mask_shape)) + tuple(mask_shape)
    strides, step = [], 1
    for dim, ext in zip(reversed(padded), reversed(full), strict=True):
        if dim not in (1, ext):
            raise ValueError(f"attention mask shape {mask_shape} does not broadcast to {full}")
        strides.append(step if dim != 1 else 0)
        step *= dim
    return tuple(reversed(strides))


def attention(
    q_shape: Shape,
    kv_shape: Shape,
    dtype: torch.dtype,
    *,
    causal: bool,
    scale: float,
    safe: bool = True,
    mask_shape: Shape | None = None,
    mask_dtype: torch.dtype | None = None,
) -> PtxKernel:
    """q [B, Hq, L, D], k/v [B, Hkv, S, D] (same dtype), optional additive float / boolean keep mask.
    safe: a row whose scores are all -inf gives 0 (torch._safe_softmax, SDPA), else NaN (torch.softmax),
    as ctpu::attention's `safe` says."""
    b_, hq, l_, d = q_shape
    bk, hkv, s_, dk = kv_shape
    if bk != b_ or dk != d or hq % hkv:
        raise ValueError(f"attention shapes q {q_shape} / kv {kv_shape}: need same B and D, Hq % Hkv == 0")
    if d % 16 or d > 256:
        raise NotImplementedError(f"ptx attention: head dim {d} (need a multiple of 16, at most 256)")
    group = hq // hkv
    width = 32 if d % 32 == 0 else 16  # lanes per query row
    rows_per_warp = 32 // width
    rows_per_cta = WARPS_PER_CTA * rows_per_warp
    per_lane = d // width
    esize = DTYPE_BYTES[dtype]
    full = (b_, hq, l_, s_)
    mstrides = _mask_strides(mask_shape, full) if mask_shape is not None else None
    mask_tag = (
        "none" if mask_shape is None else f"{DTYPE_NAMES[mask_dtype]}_" + "x".join(map(str, mask_shape))
    )
    name = kernel_name(
        "ctpu_attention", DTYPE_NAMES[dtype], *q_shape, "kv", hkv, s_, "c" if causal else "nc", mask_tag,
        "safe" if safe else "plain",
    )

    def body() -> None:
        tid = tid_x()
        lane, slot = lane_and_group(tid, width)
        row = reg.scalar(u32)
        ptx.inst.mad.lo.u32(row, ctaid("x"), rows_per_cta, slot)
        h, b = ctaid("y"), ctaid("z")
        row_ok = None
        if rows_per_warp == 1:
            # No CTA-wide barriers below, so warps past the last row may simply leave.
            ptx.inst.ret(pred=setp("ge", row, l_))
        else:
            # The partner half-warp may have a valid row: compute the last row again, do not store it.
            row_ok = setp("lt", row, l_)
            ptx.inst.min.u32(row, row, l_ - 1)
        hk = reg.scalar(u32)
        ptx.inst.div.u32(hk, h, group)
        col = reg.scalar(u32)
        ptx.inst.mul.lo.u32(col, lane, per_lane)

        q_row = reg.scalar(u32)  # ((b * Hq + h) * L + row) * D + col
        ptx.inst.mad.lo.u32(q_row, b, hq, h)
        ptx.inst.mad.lo.u32(q_row, q_row, l_, row)
        ptx.inst.mad.lo.u32(q_row, q_row, d, col)
        q_p, k_p, v_p, out_p = (global_ptr(n) for n in ("q", "k", "v", "out"))
        q = [m.binary("mul", x, fimm(scale)) for x in load_chunks(elem_addr(q_p, q_row, esize), dtype, per_lane)]
        kv_elem = reg.scalar(u32)  # (b * Hkv + hk) * S * D + col, advanced by D per key
        ptx.inst.mad.lo.u32(kv_elem, b, hkv, hk)
        ptx.inst.mul.lo.u32(kv_elem, kv_elem, s_ * d)
        ptx.inst.add.u32(kv_elem, kv_elem, col)
        k_addr, v_addr = elem_addr(k_p, kv_elem, esize), elem_addr(v_p, kv_elem, esize)

        mask_addr = None
        if mstrides is not None:
            mask_p = global_ptr("mask")
            m_elem = reg.scalar(u32)
            ptx.inst.mul.lo.u32(m_elem, b, mstrides[0])
            ptx.inst.mad.lo.u32(m_elem, h, mstrides[1], m_elem)
            ptx.inst.mad.lo.u32(m_elem, row, mstrides[2], m_elem)
            mask_addr = elem_addr(mask_p, m_elem, DTYPE_BYTES[mask_dtype])

        n_keys = reg.scalar(u32)
        if causal:  # keys 0 .. row + S - L inclusive, clamped to [0, S]
            ptx.inst.add.s32(n_keys, row, s_ - l_ + 1)
            ptx.inst.max.s32(n_keys, n_keys, 0)
            ptx.inst.min.s32(n_keys, n_keys, s_)
        else:
            ptx.inst.mov.u32(n_keys, s_)
        loop_keys = n_keys
        if causal and rows_per_warp > 1:  # the warp loops to the larger key count of its two rows
            other = reg.scalar(u32)
            ptx.inst.shfl.sync.bfly.b32(other, n_keys, 16, 31, -1)
            loop_keys = reg.scalar(u32)
            ptx.inst.max.u32(loop_keys, n_keys, other)

        run_max, run_sum = fconst(float("-inf")), fconst(0.0)
        acc = [fconst(0.0) for _ in range(per_lane)]
        s = reg.scalar(u32)
        ptx.inst.mov.u32(s, 0)
        top, done = fresh_label("key_loop"), fresh_label("key_done")
        ptx.label(top)
        ptx.bra(done, pred=setp("ge", s, loop_keys))
        ks = load_chunks(k_addr, dtype, per_lane)
        score = m.binary("mul", q[0], ks[0])
        for qi, ki in zip(q[1:], ks[1:], strict=True):
            ptx.inst.fma.rn.f32(score, qi, ki, score)
        warp_allreduce(score, "add", width)
        if mask_addr is not None:
            score = _apply_mask(score, mask_addr, mask_dtype)
        if loop_keys is not n_keys:  # keys past this row's causal limit
            ptx.inst.selp.f32(score, fimm(float("-inf")), score, setp("ge", s, n_keys))
        new_max = m.binary("max", run_max, score)
        # While every key so far is masked (max = -inf) subtract 0 instead, so exp gives 0, not NaN.
        is_inf = setp("eq", new_max, fimm(float("-inf")), "f32")
        shift = m.new()
        ptx.inst.selp.f32(shift, fimm(0.0), new_max, is_inf)
        corr = m.exp(m.binary("sub", run_max, shift))
        p = m.exp(m.binary("sub", score, shift))
        ptx.inst.fma.rn.f32(run_sum, run_sum, corr, p)
        vs = load_chunks(v_addr, dtype, per_lane)
        for a, vv in zip(acc, vs, strict=True):
            ptx.inst.mul.rn.f32(a, a, corr)
            ptx.inst.fma.rn.f32(a, p, vv, a)
        ptx.inst.mov.f32(run_max, new_max)
        ptx.inst.add.u64(k_addr, k_addr, d * esize)
        ptx.inst.add.u64(v_addr, v_addr, d * esize)
        if mask_addr is not None and mstrides[3]:
            ptx.inst.add.u64(mask_addr, mask_addr, mstrides[3] * DTYPE_BYTES[mask_dtype])
        ptx.inst.add.u32(s, s, 1)
        ptx.bra(top)
        ptx.label(done)
        # A row with every score -inf has run_sum exactly 0 (else the max's own key adds e^0 = 1, or a NaN
        # score makes it NaN): 0 / 0 = NaN as torch.softmax gives, or 0 (acc is 0) when safe, as SDPA gives.
        inv = m.div(fimm(1.0), run_sum)
        if safe:
            ptx.inst.selp.f32(inv, fimm(0.0), inv, setp("eq", run_sum, fimm(0.0), "f32"))
        outs = [m.binary("mul", a, inv) for a in acc]
        store_chunks(elem_addr(out_p, q_row, esize), outs, dtype, row_ok)
        ptx.ret()

    params = [KernelParam(n, "ptr", n) for n in ("q", "k", "v")]
    inputs = [
        TensorArg("q", q_shape, dtype),
        TensorArg("k", kv_shape, dtype),
        TensorArg("v", kv_shape, dtype),
    ]
    if mask_shape is not None:
        params.append(KernelParam("mask", "ptr", "mask"))
        inputs.append(TensorArg("mask", mask_shape, mask_dtype))
    params.append(KernelParam("out", "ptr", "out"))
    return trace(
        name,
        body,
        params,
        grid=(ceil_div(l_, rows_per_cta), hq, b_),
        block=(32 * WARPS_PER_CTA, 1, 1),
        smem_bytes=0,
        inputs=inputs,
        outputs=[TensorArg("out", q_shape, dtype)],
        notes={"rows_per_cta": rows_per_cta, "lanes_per_row": width, "group": group},
    )


def _apply_mask(score: Reg, addr: Reg, dtype: torch.dtype) -> Reg:
    value = load_f32(addr, dtype)
    if dtype == torch.bool:  # keep-mask: False -> -inf
        keep = reg.scalar(pred)
        ptx.inst.setp.neu.f32(keep, value, fimm(0.0))
        out = m.new()
        ptx.inst.selp.f32(out, score, fimm(float("-inf")), keep)
        return out
    return m.binary("add", score, value)
