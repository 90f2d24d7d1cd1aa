"""A one-row matmul (a decode step's projection: x[1, K] @ W.T, W [N, K] bf16 row-major) as a weight
stream at HBM speed.

At one row every weight tile is used once: the MXU's weight port and the DMA channel both move a tile in
the time HBM delivers it (`large`: 32 cycles per 128 x 128 bf16 tile, docs/architecture.md), so the kernel
is as fast as the weight stream has no bubble. The general matmul loads B by n-tile panel and waits for a
whole panel before its first weight load: the last DMA of the next panel, issued along the current one's
MXU commands, lands a DMA latency (500 cycles) after it, a bubble per n-tile as long as the panel's work.

Here the tiles (n-tile major, k-tile minor: C row nt accumulates over k with `mxu.mms` then `mxu.mmas`, the
general path's order, so the bits are the same) stream through a ring of two halves in vmem. A half holds
two *groups* of G tiles; group g's DMAs complete on flag LOAD(g % 2). Iteration i (U n-tiles, the two
groups of half i % 2) waits for its group, then issues per tile `mxu.lwt` + mm and one DMA of iteration
i + 1's tile into the other half (freed by iteration i - 1, whose weight loads are waited for on WEIGHTS),
so the DMA stream runs one iteration ahead: a group's last DMA lands a group's work (G tiles) after it was
issued, which G is chosen to cover (`plan`). C is NT vmem rows, row nt = C[0, nt*N : nt*N + N]: one store
at the end.
"""

from __future__ import annotations

from dataclasses import dataclass

from codegen.isel_common import Flag, KernelContext
from codegen.kernel_graph import MatmulKernel
from codegen.mir import Reg
from device_sim.config import HardwareConfig
from device_sim.isa import DMA_SHAPE_ROWS_SHIFT

MAX_RING_ROWS = 16384  # at most half of `large`'s vmem for the ring


@dataclass(frozen=True)
class DecodePlan:
    KT: int  # k-tiles
    NT: int  # n-tiles
    U: int  # n-tiles per iteration (two groups)
    G: int  # tiles per group

    @property
    def iterations(self) -> int:
        return self.NT // self.U


def plan(config: HardwareConfig, k: MatmulKernel, free_rows: int) -> DecodePlan | None:
    """The stream's shape, or None when the matmul is not a one-row bf16 x W.T with whole tiles (or no
    group size fits): the general path then runs it."""
    a, bm, c = k.a, k.b, k.c
    L = config.lanes
    if len(c.shape) != 2 or a.shape[0] != 1 or a.dtype != "bf16" or bm.dtype != "bf16":
        return None
    K, Nn = bm.shape
    if bm.strides[0] != 1 or bm.strides[1] < K or K % L or Nn % L or a.strides[-1] != 1:
        return None  # not W.T with W row-major, or partial tiles
    KT, NT = K // L, Nn // L
    tile = max(config.mxu_weight_cycles, -(-L * L * 2 // config.hbm_bytes_per_cycle), -(-L // config.vmem_port_rows))
    g_min = -(-(config.dma_latency + tile) // tile) + 1  # a group's work covers its last DMA's latency
    budget = min(MAX_RING_ROWS, free_rows - KT - NT - 16)
    if KT >= g_min:  # a group is a whole n-tile's k-tiles, or half of them
        G = KT // 2 if KT % 2 == 0 and KT // 2 >= g_min else KT
        U = 2 * G // KT
    else:  # a group is gn whole n-tiles
        gn = -(-g_min // KT)
        while gn <= NT and NT % (2 * gn):
            gn += 1
        G, U = gn * KT, 2 * gn
    if NT % U or 4 * G * L > budget:
        return None
    return DecodePlan(KT, NT, U, G)


def lower_decode_matmul(ctx: KernelContext, k: MatmulKernel, p: DecodePlan) -> None:
    b, L = ctx.b, ctx.lanes
    a, bm, c = k.a, k.b, k.c
    ws = bm.strides[1]  # W's row stride in elements
    half = 2 * p.G * L  # vmem rows of a half of the ring
    ring = [ctx.region(half, "ring"), ctx.region(half, "ring")]
    a_reg, c_reg = ctx.region(p.KT, "a"), ctx.region(p.NT, "c")
    ring_mem = tuple(r.mem(write=True) for r in ring)
    ring_read = tuple(r.mem() for r in ring)
    shape = b.const(L << DMA_SHAPE_ROWS_SHIFT | L)
    stride = b.const(ws)
    step_bytes = p.U * L * ws * 2  # HBM bytes of one iteration's n-tiles
    ctx.dma(True, "bf16", ctx.hbm_addr(a, a.offset), a_reg, 0, 1, p.KT * L, p.KT * L, Flag.MATMUL_A)
    w0 = ctx.hbm_addr(bm, bm.offset)

    def tile_dma(h: Reg, row: Reg, j: int, q: int) -> None:
        """Tile j (n-tile j // KT, k-tile j % KT) of the iteration whose W starts at h, to ring row `row`."""
        u, kt = divmod(j, p.KT)
        at = b.offset_reg(h, (u * L * ws + kt * L) * 2)
        b.emit("dma.ld.bf16", None, (at, b.offset_reg(row, j * L), shape, stride), flag=ctx.flag(Flag.LOAD, q),
               mem=ring_mem)

    # the first iteration's two groups, then (below) each iteration issues the next one's along its commands
    first = b.sreg()
    b.emit("li", first, imm=ring[0].row)
    for j in range(2 * p.G):
        tile_dma(w0, first, j, j // p.G)
    b.emit("wait", flag=ctx.flag(Flag.MATMUL_A))
    cur, nxt, h_next, c_row = b.sreg(), b.sreg(), b.sreg(), b.sreg()
    b.emit("li", cur, imm=ring[0].row)
    b.emit("li", nxt, imm=ring[1].row)
    b.emit("addi", h_next, (b.offset_reg(w0, step_bytes),), imm=0)
    b.emit("li", c_row, imm=c_reg.row)
    rows = b.const(1)
    a_mem, c_mem = a_reg.mem(), c_reg.mem(write=True)

    def iteration(prefetch: bool) -> None:
        for j in range(2 * p.G):
            q = j // p.G
            if j % p.G == 0:
                b.emit("wait", flag=ctx.flag(Flag.LOAD, q))
                if prefetch:  # the other half's group q was read by the previous iteration's weight loads
                    b.emit("wait", flag=ctx.flag(Flag.WEIGHTS, q))
            u, kt = divmod(j, p.KT)
            b.emit("mxu.lwt", None, (b.offset_reg(cur, j * L),), flag=ctx.flag(Flag.WEIGHTS, q), mem=ring_read)
            b.emit("mxu.mms" if kt == 0 else "mxu.mmas", None,
                   (b.const(a_reg.row + kt), b.offset_reg(c_row, u), rows), flag=ctx.flag(Flag.MXU), mem=(a_mem, c_mem))
            if prefetch:
                tile_dma(h_next, nxt, j, q)
        b.addi(c_row, p.U, c_row)
        if prefetch:
            b.addi(h_next, step_bytes, h_next)
            swap = b.sreg()
            b.emit("addi", swap, (cur,), imm=0)
            b.emit("addi", cur, (nxt,), imm=0)
            b.emit("addi", nxt, (swap,), imm=0)

    if p.iterations > 1:
        b.counted_loop(p.iterations - 1, lambda: iteration(True), "wstream")
    iteration(False)
    b.emit("wait", flag=ctx.flag(Flag.MXU))
    ctx.dma(False, c.dtype, ctx.hbm_addr(c, c.offset), c_reg, 0, 1, p.NT * L, c.strides[-2], Flag.STORE)
    ctx.end()
