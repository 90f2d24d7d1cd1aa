"""bf16 GEMM for Hopper: TMA loads into a 4-stage mbarrier ring, wgmma (warpgroup MMA), fp32 accumulate,
and a fused epilogue (bias, activation, residual) storing straight from the accumulator fragments.

    out[b, m, n] = act(sum_k a[b, m, k] * w[b, k, n] + bias[n]) + residual[b, m, n]

CTA = 3 warpgroups (384 threads). Warpgroup 0 is the producer: one thread issues the TMA copies of the A and
B tiles of each K step into the stage's buffers and arms the stage's `full` mbarrier with the byte count.
Warpgroups 1 and 2 are consumers, each owning 64 rows of the 128-row tile: wait `full`, four
m64nBNk16 wgmmas (BK = 64), wait for them, arrive on the stage's `empty` mbarrier so the producer can
refill it. Register budgets move to the consumers with setmaxnreg.

Tails: TMA zero-fills box elements outside the tensor, so partial M/N/K tiles multiply zeros; the
epilogue guards its stores with m < M and n < N. TMA needs 16-byte aligned row strides: K % 8 == 0
(and N % 8 == 0 when w is a contiguous [K, N]).

Operand B layouts (`w_layout`):
- "nk": w is a transposed view of a contiguous [N, K] (nn.Linear's weight): K-major, like A.
- "kn": w is a contiguous [K, N]: N-major, read by wgmma with the transpose bit, in 64-column stripes.

Shared-memory layouts are the canonical 128-byte-swizzle GMMA layouts (the TMA box inner extent is
64 bf16 = 128 bytes, and TMA writes with the same 128B swizzle that the descriptors declare):
- K-major tile [rows, 64]: 8-row groups of 1024 bytes, SBO = 1024, a k16 step moves the start 32 bytes.
- N-major tile [64 k, 64 n] per stripe: SBO = 1024 (8 k-rows), LBO = 8192 (next 64-column stripe), a k16
  step moves the start 16 rows = 2048 bytes.
"""

from __future__ import annotations

import torch
from pyptx import ptx, reg
from pyptx.ir.nodes import AddressOperand
from pyptx.reg import Reg
from pyptx.types import b32, b64, f32, pred, u32, u64

from ptx_kernels.core import (
    DTYPE_NAMES,
    KernelParam,
    PtxKernel,
    TensorArg,
    TmaSpec,
    ceil_div,
    ctaid,
    fimm,
    fresh_label,
    kernel_name,
    setp,
    smem_base,
    tid_x,
    trace,
)
from ptx_kernels.epilogue import Epilogue, add_epilogue_args, check_options, name_tags

BM, BK, STAGES = 128, 64, 4
THREADS = 384
PRODUCER_REGS, CONSUMER_REGS = 40, 232
SWIZZLE_128B = 1  # descriptor layout_type field value


def pick_bn(n: int, loads_in_epilogue: bool = False) -> int:
    """256 columns per tile (the m64n256 wgmma, 128 accumulators per thread) unless N is small.

    ptxas budgets registers for the launch size (65536 / 384 = 168 per thread; setmaxnreg does not raise
    its allocation limit), and 128 accumulators plus the address and value registers of a bias/residual
    epilogue spill there, so epilogues that load use 128-column tiles (64 accumulators).
    """
    return 256 if n > 128 and not loads_in_epilogue else 128


def gemm(
    m_: int,
    n_: int,
    k_: int,
    *,
    batch: int = 1,
    w_layout: str = "nk",
    out_dtype: torch.dtype = torch.bfloat16,
    bias_dtype: torch.dtype | None = None,
    act: str = "none",
    residual_dtype: torch.dtype | None = None,
) -> PtxKernel:
    """Kernel for a [batch, M, K] x [batch, K, N] bf16 product with the fused epilogue."""
    check_options(w_layout, act)
    if k_ % 8 or (w_layout == "kn" and n_ % 8):
        raise NotImplementedError(
            f"ptx gemm: TMA needs 16-byte row strides (K % 8 == 0, and N % 8 == 0 for a contiguous "
            f"[K, N] w); "
            f"got M={m_} N={n_} K={k_} w_layout={w_layout}"
        )
    bn = pick_bn(n_, bias_dtype is not None or residual_dtype is not None)
    a_bytes, b_bytes = BM * BK * 2, bn * BK * 2
    stage_bytes = a_bytes + b_bytes
    bar_offset = STAGES * stage_bytes
    smem_bytes = 1024 + bar_offset + 2 * STAGES * 8  # +1024: the base is rounded up to 1024 for the swizzle
    k_tiles = ceil_div(k_, BK)
    trans_b = 1 if w_layout == "kn" else 0
    name = kernel_name(
        "ctpu_gemm",
        batch,
        m_,
        n_,
        k_,
        w_layout,
        DTYPE_NAMES[out_dtype],
        act,
        *name_tags(bias_dtype, residual_dtype),
    )

    a_map = TmaSpec("a", torch.bfloat16, (k_, m_, batch), (k_ * 2, m_ * k_ * 2), (BK, BM, 1), 128)
    if w_layout == "nk":
        b_map = TmaSpec("w", torch.bfloat16, (k_, n_, batch), (k_ * 2, n_ * k_ * 2), (BK, bn, 1), 128)
    else:
        b_map = TmaSpec("w", torch.bfloat16, (n_, k_, batch), (n_ * 2, n_ * k_ * 2), (64, BK, 1), 128)

    def body() -> None:
        tid = tid_x()
        wg = reg.scalar(u32)
        ptx.inst.shr.u32(wg, tid, 7)
        n0, m0, bz = _mul(ctaid("x"), bn), _mul(ctaid("y"), BM), ctaid("z")
        base = reg.scalar(u32)
        ptx.inst.add.u32(base, smem_base(), 1023)
        ptx.inst.and_.b32(base, base, -1024)
        full = [_add(base, bar_offset + 8 * s) for s in range(STAGES)]
        empty = [_add(base, bar_offset + 8 * (STAGES + s)) for s in range(STAGES)]

        with ptx.if_(setp("eq", tid, 0)):
            for s in range(STAGES):
                ptx.inst.mbarrier.init.shared__cta.b64(ptx.addr(full[s]), 1)
                ptx.inst.mbarrier.init.shared__cta.b64(ptx.addr(empty[s]), 2)  # one arrive per consumer WG
            ptx.inst.fence.mbarrier_init.release.cluster()
        ptx.inst.bar.sync(0)

        consumer = fresh_label("consumer")
        ptx.bra(consumer, pred=setp("ne", wg, 0))
        # ---- producer warpgroup ---------------------------------------------------------------
        ptx.setmaxnreg(PRODUCER_REGS, inc=False)
        with ptx.if_(setp("eq", tid, 0)):
            tmap_a, tmap_b = _tmap("tmap_a"), _tmap("tmap_w")
            _k_loop(
                k_tiles,
                lambda kt, stage_sel, phase: _produce(
                    kt,
                    stage_sel,
                    phase,
                    base,
                    full,
                    empty,
                    tmap_a,
                    tmap_b,
                    m0,
                    n0,
                    bz,
                    w_layout,
                    bn,
                    stage_bytes,
                ),
            )
        ptx.ret()
        # ---- consumer warpgroups --------------------------------------------------------------
        ptx.label(consumer)
        ptx.setmaxnreg(CONSUMER_REGS, inc=True)
        acc = reg.array(f32, bn // 2)
        # Zeroed once, and every wgmma accumulates (scale-d = 1): K == 0 then stores zeros. (Found on an
        # H200: a scale-d of `kt != 0` on all four k16 wgmmas of a K tile kept only the 4th k16 of K tile 0.)
        for r in acc:
            ptx.inst.mov.f32(r, fimm(0.0))
        accumulate = setp("eq", wg, wg)  # an always-true predicate register (scale-d is a predicate)
        row0 = reg.scalar(u32)  # first row of this consumer's 64
        ptx.inst.mad.lo.u32(row0, wg, 64, -64)
        _k_loop(
            k_tiles,
            lambda kt, stage_sel, phase: _consume(
                stage_sel, phase, base, full, empty, acc, accumulate, row0, tid, bn, trans_b, stage_bytes, a_bytes
            ),
        )
        _epilogue(acc, tid, row0, m0, n0, bz, m_, n_, bn, out_dtype, bias_dtype, act, residual_dtype)
        ptx.ret()

    params = [KernelParam("tmap_a", "tmap", "a", tma=a_map), KernelParam("tmap_w", "tmap", "w", tma=b_map)]
    inputs = [
        TensorArg("a", (batch, m_, k_), torch.bfloat16),
        TensorArg("w", (batch, k_, n_), torch.bfloat16, (k_ * n_, 1, k_) if w_layout == "nk" else None),
    ]
    add_epilogue_args(params, inputs, batch, m_, n_, bias_dtype, residual_dtype)
    return trace(
        name,
        body,
        params,
        grid=(ceil_div(n_, bn), ceil_div(m_, BM), batch),
        block=(THREADS, 1, 1),
        smem_bytes=smem_bytes,
        inputs=inputs,
        outputs=[TensorArg("out", (batch, m_, n_), out_dtype)],
        notes={"BM": BM, "BN": bn, "BK": BK, "stages": STAGES, "w_layout": w_layout},
    )


def _mul(a: Reg, k: int) -> Reg:
    out = reg.scalar(u32)
    ptx.inst.mul.lo.u32(out, a, k)
    return out


def _add(a: Reg, k: int | Reg) -> Reg:
    out = reg.scalar(u32)
    ptx.inst.add.u32(out, a, k)
    return out


def _tmap(param: str) -> Reg:
    """Generic address of a by-value CUtensorMap kernel parameter (what cp.async.bulk.tensor wants)."""
    r = reg.scalar(u64)
    ptx.inst.mov.u64(r, param)
    ptx.inst.cvta.param.u64(r, r)
    return r


def _k_loop(k_tiles: int, step) -> None:
    """Runtime loop over K tiles; step(kt, stage_offset_selector, phase) with stage = kt % STAGES."""
    kt = reg.scalar(u32)
    ptx.inst.mov.u32(kt, 0)
    top, done = fresh_label("k_loop"), fresh_label("k_done")
    ptx.label(top)
    ptx.bra(done, pred=setp("ge", kt, k_tiles))
    stage = reg.scalar(u32)
    ptx.inst.and_.b32(stage, kt, STAGES - 1)
    phase = reg.scalar(u32)
    ptx.inst.bfe.u32(phase, kt, STAGES.bit_length() - 1, 1)  # (kt / STAGES) & 1
    step(kt, stage, phase)
    ptx.inst.add.u32(kt, kt, 1)
    ptx.bra(top)
    ptx.label(done)


def _stage_addr(bars: list[Reg], stage: Reg) -> Reg:
    """Address of bars[stage] (the barriers of one kind are 8 bytes apart)."""
    return _mad(stage, 8, bars[0])


def _mad(a: Reg, k: int, c: Reg) -> Reg:
    out = reg.scalar(u32)
    ptx.inst.mad.lo.u32(out, a, k, c)
    return out


def _wait(bar: Reg, parity: Reg) -> None:
    done = reg.scalar(pred)
    top = fresh_label("mbar_wait")
    ptx.label(top)
    ptx.inst.mbarrier.try_wait.parity.shared__cta.b64(done, ptx.addr(bar), parity)
    ptx.bra(top, pred=~done)


def _tma_load(dst: Reg, tmap: Reg, coords: tuple[Reg | int, ...], bar: Reg) -> None:
    names = ", ".join(c.name if isinstance(c, Reg) else str(c) for c in coords)
    src = AddressOperand(base=tmap.name, offset=f", {{{names}}}")
    ptx.inst.cp.async_.bulk.tensor._3d.shared__cluster.global_.tile.mbarrier__complete_tx__bytes(
        ptx.addr(dst), src, ptx.addr(bar)
    )


def _produce(
    kt, stage, phase, base, full, empty, tmap_a, tmap_b, m0, n0, bz, w_layout, bn, stage_bytes
) -> None:
    # A fresh barrier counts as having completed the phase before phase 0, so waiting on the opposite
    # parity lets the first STAGES iterations through without a special case.
    free_parity = reg.scalar(u32)
    ptx.inst.xor.b32(free_parity, phase, 1)
    _wait(_stage_addr(empty, stage), free_parity)
    full_bar = _stage_addr(full, stage)
    ptx.inst.mbarrier.arrive.expect_tx.shared__cta.b64("_", ptx.addr(full_bar), stage_bytes)
    a_dst = _mad(stage, stage_bytes, base)
    k0 = _mul(kt, BK)
    _tma_load(a_dst, tmap_a, (k0, m0, bz), full_bar)
    b_dst = _add(a_dst, BM * BK * 2)
    if w_layout == "nk":
        _tma_load(b_dst, tmap_b, (k0, n0, bz), full_bar)
        return
    for stripe in range(bn // 64):  # N-major B: one 64-column stripe per box
        col = _add(n0, 64 * stripe)
        _tma_load(_add(b_dst, stripe * 64 * BK * 2), tmap_b, (col, k0, bz), full_bar)


def _descriptor(addr: Reg, lbo: int, sbo: int) -> Reg:
    """wgmma shared-memory matrix descriptor.

    Bits: start>>4 [13:0], LBO>>4 [29:16], SBO>>4 [45:32], layout type (swizzle) [63:62].
    """
    lo = reg.scalar(b32)
    ptx.inst.bfe.u32(lo, addr, 4, 14)
    ptx.inst.or_.b32(lo, lo, (lbo >> 4) << 16)
    hi = reg.scalar(b32)
    ptx.inst.mov.b32(hi, (sbo >> 4) | (SWIZZLE_128B << 30))
    desc = reg.scalar(b64)
    ptx.inst.mov.b64(desc, [lo, hi])
    return desc


def _consume(
    stage, phase, base, full, empty, acc, accumulate, row0, tid, bn, trans_b, stage_bytes, a_bytes
) -> None:
    _wait(_stage_addr(full, stage), phase)
    a_tile = _mad(stage, stage_bytes, base)
    a_rows = _mad(row0, BK * 2, a_tile)  # this consumer's 64 rows: 64 * 128 bytes, 1024-aligned
    b_tile = _add(a_tile, a_bytes)
    ptx.inst.wgmma.fence.sync.aligned()
    for kk in range(BK // 16):
        a_desc = _descriptor(_add(a_rows, kk * 32), 16, 1024)
        if trans_b:
            b_desc = _descriptor(_add(b_tile, kk * 16 * 128), 64 * BK * 2, 1024)
        else:
            b_desc = _descriptor(_add(b_tile, kk * 32), 16, 1024)
        getattr(ptx.inst.wgmma.mma_async.sync.aligned, f"m64n{bn}k16").f32.bf16.bf16(
            list(acc), a_desc, b_desc, accumulate, 1, 1, 0, trans_b
        )
    ptx.inst.wgmma.commit_group.sync.aligned()
    ptx.inst.wgmma.wait_group.sync.aligned(0)
    lane_in_wg = reg.scalar(u32)
    ptx.inst.and_.b32(lane_in_wg, tid, 127)
    is_leader = setp("eq", lane_in_wg, 0)
    ptx.inst.mbarrier.arrive.shared__cta.b64("_", ptx.addr(_stage_addr(empty, stage)), pred=is_leader)


def _epilogue(acc, tid, row0, m0, n0, bz, m_, n_, bn, out_dtype, bias_dtype, act, residual_dtype) -> None:
    """Fragment layout of m64nNk16 f32: thread t (warp w, lane l) holds, for i in [0, N/2), the element at
    row 16w + l/4 + 8*((i/2)%2), column 8*(i/4) + 2*(l%4) + i%2."""
    lane = reg.scalar(u32)
    ptx.inst.and_.b32(lane, tid, 31)
    warp = reg.scalar(u32)
    ptx.inst.bfe.u32(warp, tid, 5, 2)
    row = reg.scalar(u32)
    ptx.inst.shr.u32(row, lane, 2)
    ptx.inst.mad.lo.u32(row, warp, 16, row)
    ptx.inst.add.u32(row, row, row0)
    ptx.inst.add.u32(row, row, m0)
    col = reg.scalar(u32)
    ptx.inst.and_.b32(col, lane, 3)
    ptx.inst.mad.lo.u32(col, col, 2, n0)
    epilogue = Epilogue(m_, n_, out_dtype, bias_dtype, act, residual_dtype)
    for half in range(2):
        out_row = epilogue.row(bz, _add(row, 8 * half))
        for chunk in range(bn // 8):
            for j in range(2):
                epilogue.store(acc[4 * chunk + 2 * half + j], out_row, _add(col, 8 * chunk + j))


__all__ = ["gemm", "pick_bn"]
