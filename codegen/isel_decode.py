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
at the end. A stream whose first two iterations were prefetched (into two slots, below) runs a ring of
three regions: those two iterations load the third one's tiles (and the fourth's first few) a tile every
second command, as fast as the channel takes them, and the rest runs one iteration ahead as above.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from dataclasses import dataclass

from codegen.isel_common import Flag, KernelContext, Region, Resident, emit_apart, first_wait
from codegen.isel_vector import KernelChain
from codegen.kernel_graph import (
    FillKernel,
    GatherKernel,
    GenericKernel,
    IotaKernel,
    Kernel,
    MatmulKernel,
    ScatterKernel,
    views_of,
    written_buffer,
)
from codegen.mir import Block, MInstr, Reg
from device_sim.config import HardwareConfig
from device_sim.isa import DMA_SHAPE_ROWS_SHIFT

MAX_RING_ROWS = 16384  # at most half of `large`'s vmem for the ring
# W's bf16 loaded raw, two to a vmem word, and unpacked by the MXU (`mxu.lwt.lo` / `.hi`): a weight takes
# half the vmem, so a slot holds twice the weights (docs/architecture.md, "Why the weight port reads packed")
PACKED = True
LEAVE_C_ROW = True  # a stream leaves its C row in vmem for the kernel after (`lower_decode_matmul`)


@dataclass(frozen=True)
class DecodePlan:
    """A stream's shape in *units*: a k-tile of an n-tile, or when `packed` two k-tiles (2k, 2k + 1) of it,
    one DMA into L vmem rows and two weight loads. "Tiles" below are units."""

    KT: int  # k-units of an n-tile
    NT: int  # n-tiles
    U: int  # n-tiles per iteration (two groups)
    G: int  # units per group
    packed: bool = False

    @property
    def iterations(self) -> int:
        return self.NT // self.U

    @property
    def k_tiles(self) -> int:  # the A row's vmem rows
        return self.KT * _tiles_per_unit(self.packed)


def _tiles_per_unit(packed: bool) -> int:
    """k-tiles a stream's unit holds: two when W's bf16 are packed two to a vmem word."""
    return 2 if packed else 1


def plan(config: HardwareConfig, k: MatmulKernel, free_rows: int, prefetched: bool = False) -> DecodePlan | None:
    """The stream's shape, or None when the matmul is not a one-row bf16 x W.T with whole tiles (or no
    group size fits): the general path then runs it. `prefetched`: the kernels before load both groups."""
    L = config.lanes
    tiles = _stream_tiles(config, k)
    if tiles is None:
        return None
    KT, NT, packed = tiles
    tile = _tile_cycles(config, packed)
    budget = min(MAX_RING_ROWS, free_rows - KT * _tiles_per_unit(packed) - NT - 16)
    # an iteration is U whole n-tiles in two groups of G = U * KT / 2 tiles; the fastest that fits
    shapes = [(U, U * KT // 2) for U in range(1, NT + 1) if NT % U == 0 and U * KT % 2 == 0]
    shapes = [(U, G) for U, G in shapes if 4 * G * L <= budget]
    if not shapes:
        return None
    weight = _tile_cycles(config, packed, weights_only=True)
    U, G = min(shapes, key=lambda s: _estimate(config, KT * NT, s[1], tile, weight, prefetched))
    return DecodePlan(KT, NT, U, G, packed)


def _stream_tiles(config: HardwareConfig, k: MatmulKernel) -> tuple[int, int, bool] | None:
    """(k-units, n-tiles, packed) of a one-row bf16 x W.T matmul with W row-major and whole tiles, else None;
    packed when W's k-tiles pair up and its rows start at even elements (whole 32-bit words)."""
    a, bm, c = k.a, k.b, k.c
    L = config.lanes
    if len(c.shape) != 2 or a.shape[0] != 1 or a.dtype != "bf16" or bm.dtype != "bf16":
        return None
    K, Nn = bm.shape
    if bm.strides[0] != 1 or bm.strides[1] < K or K % L or Nn % L or a.strides[-1] != 1:
        return None
    packed = PACKED and K // L % 2 == 0 and bm.strides[1] % 2 == 0 and bm.offset % 2 == 0
    return K // L // _tiles_per_unit(packed), Nn // L, packed


def _is_stream(config: HardwareConfig, k: Kernel) -> bool:
    """Whether `k` is a one-row weight stream's matmul (`_stream_tiles`)."""
    return isinstance(k, MatmulKernel) and _stream_tiles(config, k) is not None


def split_ragged_streams(config: HardwareConfig, kernels: list[Kernel]) -> list[Kernel]:
    """A stream's iterations are whole n-tiles, U of them dividing its n-tiles. When no such U makes a group
    (U * KT / 2 tiles) long enough to cover a DMA latency, every group of the stream waits out a bubble
    (Qwen3-0.6B's lm_head: 1187 n-tiles, a prime, of 8 k-tiles: groups of 4 tiles, 2.5x its bytes' time).
    Such a stream becomes two: the largest multiple of the smallest U that covers it, then the rest (fewer
    than U n-tiles, a stream of its own that the first one prefetches). C's columns are computed as before,
    each n-tile on its own, so the bits are the same."""
    L = config.lanes
    out: list[Kernel] = []
    for k in kernels:
        tiles = _stream_tiles(config, k) if isinstance(k, MatmulKernel) else None
        if tiles is None:
            out.append(k)
            continue
        KT, NT, packed = tiles
        tile = _tile_cycles(config, packed)
        cover = -(-(config.dma_latency + tile) // tile)  # tiles a group needs to hide the next one's latency
        U = next((u for u in range(1, NT + 1) if u * KT % 2 == 0 and u * KT // 2 >= cover), NT)
        fits = [u for u in range(U, NT + 1) if NT % u == 0 and u * KT % 2 == 0 and 2 * u * KT * L <= MAX_RING_ROWS]
        head = NT - NT % U
        if fits or not 0 < head < NT or 2 * U * KT * L > MAX_RING_ROWS:
            out.append(k)
            continue
        bm, c, n = k.b, k.c, head * L
        out.append(dataclasses.replace(k, b=dataclasses.replace(bm, shape=(bm.shape[0], n)),
                                       c=dataclasses.replace(c, shape=(c.shape[0], n))))
        out.append(dataclasses.replace(
            k, b=dataclasses.replace(bm, offset=bm.offset + n * bm.strides[1], shape=(bm.shape[0], bm.shape[1] - n)),
            c=dataclasses.replace(c, offset=c.offset + n * c.strides[1], shape=(c.shape[0], c.shape[1] - n))))
    return out


def streams_back_to_back(config: HardwareConfig, kernels: list[Kernel]) -> list[Kernel]:
    """Each generic just before a one-row weight stream that shares no written buffer with it moves after the
    stream, until none does: Qwen3's q_norm and k_norm ran between q_proj, k_proj and v_proj, three kernels
    each waiting a DMA latency with the channel all but idle. Back to back, each stream loads the next one's
    first weights along its last iteration, and the norms join the run of small kernels after them (a
    chain). Buffers keep the order of their writes and reads, so the results are the same."""
    def independent(a: Kernel, b: Kernel) -> bool:
        return written_buffer(a) not in {v.buffer for v in views_of(b)} and \
            written_buffer(b) not in {v.buffer for v in views_of(a)}

    out = list(kernels)
    moved = True
    while moved:
        moved = False
        for i in range(len(out) - 1):
            if isinstance(out[i], GenericKernel) and _is_stream(config, out[i + 1]) \
                    and independent(out[i], out[i + 1]):
                out[i], out[i + 1] = out[i + 1], out[i]
                moved = True
    return out


def _tile_cycles(config: HardwareConfig, packed: bool = False, weights_only: bool = False) -> int:
    """Cycles of one unit (an N x N bf16 tile, or two packed) through the slowest of the weight port, HBM and
    the DMA's vmem port (`weights_only`: the weight port's)."""
    L, tiles = config.lanes, _tiles_per_unit(packed)
    weights = tiles * config.mxu_weight_cycles
    if weights_only:
        return weights
    return max(weights, -(-tiles * L * L * 2 // config.hbm_bytes_per_cycle), -(-L // config.vmem_port_rows))


def _estimate(config: HardwareConfig, tiles: int, G: int, tile: int, weight: int, prefetched: bool = False) -> int:
    """Cycles of a stream of `tiles` tiles in groups of G. The MXU starts when group 0 has landed and the
    code has issued the first iteration's two groups (issue stalls while the DMA queue is full: a large G
    blocks the MXU behind it); then a tile every `tile` cycles, plus a bubble at each later group whose
    last DMA, issued a group's work ahead, has not landed (G too small to cover the latency). With both
    groups prefetched the channel moves only the other tiles, from the start, and the last group's MXU
    work (`weight` cycles a tile on the weight port) follows its last DMA's latency: larger groups pay (up to
    the slot's size)."""
    lat = config.dma_latency
    bubble = max(0, lat + tile - G * tile)
    if prefetched:
        return lat + (tiles - 2 * G) * tile + bubble * max(0, tiles // G - 2) + G * weight
    start = max(G * tile + lat, (2 * G - config.dma_queue) * tile)
    return start + tiles * tile + bubble * max(0, tiles // G - 2)


def _tile_dma(ctx: KernelContext, p: DecodePlan, ws: int, h: Reg, row: Reg, j: int, flag: int, mem: tuple) -> None:
    """Unit j (n-tile j // KT, k-unit j % KT) of the iteration whose W starts at h, to ring row `row`: L rows
    of W's bf16 widened, or packed of its raw words (2L bf16 a row)."""
    b, L = ctx.b, ctx.lanes
    u, kt = divmod(j, p.KT)
    k0 = kt * L * _tiles_per_unit(p.packed)
    at = b.offset_reg(h, (u * L * ws + k0) * 2)
    shape = b.const(L << DMA_SHAPE_ROWS_SHIFT | L)
    op, stride = ("dma.ld", ws // 2) if p.packed else ("dma.ld.bf16", ws)
    b.emit(op, None, (at, b.offset_reg(row, j * L), shape, b.const(stride)), flag=flag, mem=mem)


def _first_dmas(ctx: KernelContext, k: MatmulKernel, p: DecodePlan, regions: list[Region], tiles: range,
                flag: Callable[[int], int], mem: tuple, first_flag: tuple[int, int] = (0, 0)
                ) -> list[Callable[[], None]]:
    """The DMAs of tiles `tiles` of `k`'s first iterations (tile t of iteration t // 2G) into those
    iterations' ring regions, each a callable that emits it (a stream spreads a prefetch over its MXU
    commands); `flag(q)` for group q of an iteration, but flag f for the first n: first_flag (n, f)."""
    state: dict[int, tuple[Reg, Reg]] = {}
    step = p.U * ctx.lanes * k.b.strides[1]  # W's elements of one iteration's n-tiles

    def dma(n: int, t: int) -> None:
        it, j = divmod(t, 2 * p.G)
        if it not in state:
            state[it] = (ctx.hbm_addr(k.b, k.b.offset + it * step), ctx.b.const(regions[it].row))
        h, row = state[it]
        _tile_dma(ctx, p, k.b.strides[1], h, row, j, first_flag[1] if n < first_flag[0] else flag(j // p.G), mem)

    return [lambda n=n, t=t: dma(n, t) for n, t in enumerate(tiles)]


# ---- cross-kernel prefetch ----------------------------------------------------------------------------
# A stream starts when its first group has landed: G tiles and a DMA latency after its first DMA (~1,000
# cycles on `large`), while the kernels before it leave the DMA channel idle most of the time: the small
# ones (a norm, rope, the softmax pieces) each wait a latency for their own few loads, and a stream, once
# its last tiles are issued, has only its MXU work and its store left. So they load the stream's first ring
# half: a stream just before the run (or just before the next stream) issues groups along its last
# iteration's MXU commands, each small kernel one group right after its own first loads (behind them on the
# in-order channel, so they are not delayed), on flag PREFETCH, which no kernel but the stream waits on.
# The ring half lies in a *slot* at the top of vmem; two slots alternate from stream to stream, so that a
# stream that was prefetched (its first half in one slot) can load the next one's into the other. Every
# kernel from the first issuer to the stream leaves both slots alone (`KernelContext` ceiling). After a
# long run (attention's, before o_proj) the run's later kernels load the stream's second iteration into the
# other slot as well; the stream then loads the next one's first groups into whichever slot its last
# iteration does not read (`next_slot_first`). The slots are sized for that stream's larger groups, so each
# holds two iterations of the others: their first two are loaded, both into one slot, the stream before
# them issuing all but a group for each small kernel between (it fills its last group's latency and its
# MXU drain, where the channel idled).
# they fit their tiles to the vmem they get; so do the matmuls no stream lowers (attention's at one token:
# matmuls of at most SMALL_ROWS rows, so that a prefill's matmuls keep the whole vmem)
SMALL_ROWS = 8
LONG_RUN = 4  # kernels before a stream that leave the channel idle long enough to load its larger groups
PREFETCH_KERNELS = (GenericKernel, FillKernel, IotaKernel, KernelChain, GatherKernel, ScatterKernel)


@dataclass(frozen=True)
class Issue:
    """Tiles `tiles` of `kernel`'s first iterations (laid out by `plan`: tile t of iteration t // 2G), loaded
    into the vmem slots that start at `rows`, one an iteration."""

    kernel: MatmulKernel
    plan: DecodePlan
    tiles: range
    rows: tuple[int, ...]


@dataclass(frozen=True)
class Prefetch:
    """A kernel's part in the prefetches: `ceiling` is the first vmem row it may not use (the slots above);
    `carried` the rows that hold prefetched weights when it starts (kept across the kernel boundary); an
    issuer has `issue`; a stream has `stream`, the plan its prefetch followed (planned under the slots, it
    could group differently than `plan` would), `slots` (the first row of each of its first iterations'
    slots) and `prefetched` (the tiles the kernels before it loaded there)."""

    ceiling: int
    carried: tuple[int, int] | None = None
    issue: Issue | None = None
    prefetched: int = 0
    stream: DecodePlan | None = None
    slots: tuple[int, ...] = ()


def two_ahead(p: DecodePlan) -> bool:
    """Whether a stream may have its first two iterations prefetched, into both slots: it then computes
    them while it loads the rest, in a ring of three regions (`lower_decode_matmul`; with two iterations
    it loads nothing)."""
    return p.iterations >= 2


def slot_holds_two(p: DecodePlan, after_whole: bool) -> bool:
    """Whether a stream's slot gets two of its iterations: of more than two, so that it loads the rest while
    it computes them; of two, only right after a stream loaded whole (Qwen3's k_proj after q_proj), whose
    weight port leaves the channel half its time, time enough for both (elsewhere both cost more than they
    saved: 89,844 cycles of qwen3-0.6b-2l decode at 1024 positions, against 89,035)."""
    return two_ahead(p) and (p.iterations > 2 or after_whole)


def next_slot_first(p: DecodePlan) -> bool:
    """Whether the stream after a two-slot stream takes the slot of its first iteration (else that of its
    second): its last iteration, which loads the next stream's first groups, reads ring region
    (iterations - 1) % 3 (the slots are regions 0 and 1), and must not be reading that slot."""
    return (p.iterations - 1) % 3 == 1


def plan_prefetches(config: HardwareConfig, kernels: list[tuple[Kernel | None, int]], free_rows: int
                    ) -> dict[int, Prefetch]:
    """Which kernels prefetch for which stream. `kernels`: what each kernel lowers to (None: nothing) and its
    segment (a prefetch never crosses a loop's init, header or footer). The issuers of a stream are the
    stream just before its run of small kernels, if any, then the run's first kernels: a group each (both
    when a stream is the only issuer), or after a long run (LONG_RUN kernels or more) a quarter each of
    the stream's first half, planned with groups as large as the slot allows; the long run's later kernels
    (two or more) then load its second iteration into the other slot, free until the stream after it. A
    stream of more than two iterations whose slot holds two has both loaded, into the slot's halves. A run
    that cannot load two iterations in its time loads one, all its kernels a share (`spread`); one that
    loads its stream whole (one iteration) hands its later kernels to the next stream (`whole`, `spare`)."""
    L, V = config.lanes, config.vmem_rows

    def streams(rows: int, both: set[int]) -> dict[int, DecodePlan]:
        out = {}
        for j, (k, _) in enumerate(kernels):
            p = plan(config, k, rows, prefetched=j in both) if isinstance(k, MatmulKernel) else None
            if p is not None and 2 * p.G * L <= V // 4:
                out[j] = p
        return out

    def issues(k: Kernel | None) -> bool:  # a kernel that can issue a prefetch: small, and not a stream
        return isinstance(k, PREFETCH_KERNELS) or (isinstance(k, MatmulKernel) and k.a.shape[-2] <= SMALL_ROWS
                                                   and plan(config, k, free_rows) is None)

    def run(j: int, plans: dict[int, DecodePlan]) -> list[int]:
        """The kernels before stream j that may load its first half: the stream before its run of small
        kernels, if any, then the run's kernels (a chain counts once)."""
        segment = kernels[j][1]
        i = j
        while i > 0 and issues(kernels[i - 1][0]) and kernels[i - 1][1] == segment:
            i -= 1
        units = [m for m in range(i, j) if m == i or kernels[m][0] is not kernels[m - 1][0]]  # a chain is one
        if i > 0 and i - 1 in plans and kernels[i - 1][1] == segment:
            units.insert(0, i - 1)
        return units

    # a stream after a long run of small kernels (attention's, before o_proj), which leave the channel
    # idle, gets larger groups: the run loads twice the weights, the stream moves only the rest
    candidates = streams(free_rows, set())
    both = {j for j in candidates if len([m for m in run(j, candidates) if m not in candidates]) >= LONG_RUN}
    slot = max((2 * p.G * L for p in streams(free_rows, both).values()), default=0)
    # planned with one slot taken: a prefetched stream's first half is its slot, the other half and its
    # operands must fit under both
    plans = {j: p for j, p in streams(free_rows - slot, both).items()
             if 2 * p.G * L + p.k_tiles + p.NT + 16 <= free_rows - 2 * slot}
    ceiling = V - 2 * slot
    order = sorted(plans)
    # a stream its long run loads whole (one iteration: packed, Qwen3's o_proj) leaves the run's later
    # kernels and its own MXU time to the next stream, which is planned to fill its slot with two iterations
    whole = {j for j in both if j in plans and plans[j].iterations == 1 and j != order[-1]}
    for j in whole:
        nxt = order[order.index(j) + 1]
        q = plan(config, kernels[nxt][0], slot + 2 * plans[nxt].k_tiles + plans[nxt].NT + 16, prefetched=True)
        if q is not None and q.iterations > 2:
            plans[nxt] = q

    def capacity(m: int, p: DecodePlan) -> int:
        """Tiles of p that kernel m issues in about the time it takes anyway: a small kernel a DMA latency's
        worth, another stream two latencies' (its last iteration's first wait, `tiles_ahead_of_last`, and its
        tail: the MXU's last results and the store; three cost Qwen3's decode more than they saved), a stream
        loaded whole its MXU time's and the same two latencies' (its wait for its last tiles,
        `tiles_ahead_of_whole_wait`, and its tail: qwen3-0.6b-2l decode at 1024 positions 88,333 cycles
        without them, 88,259 with one, 88,059 with two, 88,061 with three)."""
        if m in whole:
            mxu = 2 * plans[m].G * _tile_cycles(config, plans[m].packed, weights_only=True)
            return (mxu + 2 * config.dma_latency) // _tile_cycles(config, p.packed)
        return _small_capacity(config, p) * (2 if m in plans else 1)

    out: dict[int, Prefetch] = {}
    parity = 0

    def take_slot(p: DecodePlan, take: bool = True, iterations: int = 1) -> tuple[int, int]:
        nonlocal parity  # in turn: consecutive streams differ
        top = V - parity * slot
        parity ^= take
        return top - iterations * 2 * p.G * L, top

    spare: dict[int, list[int]] = {}  # a stream its run loads whole: the kernels of that run left to issue
    for j, p in sorted(plans.items()):
        units = run(j, plans)
        # a slot that holds two of the stream's iterations gets both (`two_ahead`; not all: then the stream
        # would load nothing while it computes): the stream before fills its last group's latency and drain
        after_whole = len(units) == 1 and units[0] in plans and plans[units[0]].iterations == 1
        double = j not in both and slot_holds_two(p, after_whole) and 4 * p.G * L <= slot
        # after a stream loaded whole, the later kernels of its run issue too (into the other slot)
        extra = spare.pop(units[0], []) if units else []
        first_units = extra + units[:LONG_RUN if j in both or double else 2]  # the first ones issue
        if j in whole and units:  # the run's first kernels load it, as many as that takes; the rest are spare
            caps = list(itertools.accumulate(capacity(m, p) for m in units))
            mine = next((n + 1 for n, c in enumerate(caps) if c >= 2 * p.G), len(units))
            first_units, spare[j] = extra + units[:mine], units[mine:]
        # a long run that cannot load two iterations in its time loads one, all its kernels a share
        spread = j in both and j not in whole and not _run_loads_two(config, p, len(units))
        if spread:
            first_units = extra + units
        if not first_units:
            continue
        if first_units[0] in plans and first_units[0] not in out:  # a stream that issues has a slot too
            own = take_slot(plans[first_units[0]])
            out[first_units[0]] = Prefetch(ceiling, own, stream=plans[first_units[0]], slots=(own[0],))
        first = 2 * p.G  # tiles of an iteration
        slots = [take_slot(p, iterations=2 if double else 1)]
        if extra or j in whole or spread:  # by each issuer's capacity
            if double:
                lo, hi = slots[0]
                slots = [(lo, lo + first * L), (lo + first * L, hi)]
            caps = list(itertools.accumulate(capacity(m, p) for m in first_units))
            cut = [0] + [round(first * len(slots) * c / caps[-1]) for c in caps]
            shares = [range(a, z) for a, z in itertools.pairwise(cut)]
        elif double:  # the two halves of the slot; each small kernel a group, the stream before the rest
            lo, hi = slots[0]
            slots = [(lo, lo + first * L), (lo + first * L, hi)]
            small = len(first_units) - (first_units[0] in plans)
            cut = [0] + [2 * first - p.G * (small - q) for q in range(small + 1)] if first_units[0] in plans \
                else [2 * first * q // small for q in range(small + 1)]
            shares = [range(a, z) for a, z in itertools.pairwise(cut)]
        elif len(first_units) == 1 and first_units[0] in plans:  # a stream alone before: along its last iteration
            shares = [range(0, first)]
        else:  # a group each, or (larger groups, after a long run) a quarter each
            share = first // (LONG_RUN if j in both else 2)
            shares = [range(q * share, min(first, (q + 1) * share)) for q in range(len(first_units))]
        issued = dict(zip(first_units, shares, strict=True))
        # not a matmul: its own loads fill the DMA queue, and a prefetch issued behind them stalls its MXU
        later = [m for m in units[LONG_RUN:] if not isinstance(kernels[m][0], MatmulKernel)][:first]
        later = later if j in both and two_ahead(p) and not spread else []
        if len(later) >= 2:  # the second iteration, into the other slot (the next stream's, not yet taken)
            slots.append(take_slot(p, take=False))
            if next_slot_first(p):  # the next stream gets the first iteration's slot, read before the last
                take_slot(p)
            cut = [first + q * first // len(later) for q in range(len(later) + 1)]
            issued |= {m: range(cut[q], cut[q + 1]) for q, m in enumerate(later)}
        rows = tuple(lo for lo, _ in slots)
        span = (min(rows), max(hi for _, hi in slots))
        for m in range(first_units[0], j):
            issue = Issue(kernels[j][0], p, issued[m], rows) if m in issued else None
            if m in out and extra:  # the run's spare kernels and the stream itself keep both slots
                lo, hi = out[m].carried or span
                out[m] = dataclasses.replace(out[m], issue=issue, carried=(min(lo, span[0]), max(hi, span[1])))
            elif m in out:  # the stream before: its own first half stays where it is
                out[m] = dataclasses.replace(out[m], issue=issue)
            else:  # from the first kernel that loads the second slot, both slots are kept
                out[m] = Prefetch(ceiling, span if len(slots) > 1 and (double or m >= later[0]) else slots[0], issue)
        out[j] = Prefetch(ceiling, span, prefetched=sum(len(g) for g in issued.values()), stream=p, slots=rows)
    return out


def _small_capacity(config: HardwareConfig, p: DecodePlan) -> int:
    """Tiles of p a small kernel issues in the time it takes anyway: a DMA latency's worth (it waits that
    long for its own loads)."""
    return config.dma_latency // _tile_cycles(config, p.packed) + 1


def _run_loads_two(config: HardwareConfig, p: DecodePlan, kernels: int) -> bool:
    """Whether a run of `kernels` small kernels has the time to load two iterations of p."""
    return kernels * _small_capacity(config, p) >= 4 * p.G


def loop_edge_cost(config: HardwareConfig, kernels: list[Kernel]) -> Callable[[int, int], int]:
    """What a layer loop's edge costs the prefetch (`layer_loop.find_loops`): no prefetch crosses it, so the
    small kernels at the end of a body, which would load the first stream of the next repetition, leave the
    channel idle (decode's body began at the KV-cache scatters: the rope chains before them, at the body's
    end, loaded nothing, and o_proj's long run lost half its kernels), and a body that starts with a stream
    gets none of its weights early. The cheapest edge follows a stream and precedes a run of small kernels,
    and not a stream the long run before it loads whole (Qwen3's o_proj, two iterations): the channel idles
    through it unless it loads the next stream's weights."""
    stream = [_is_stream(config, k) for k in kernels]

    def loaded_whole(k: Kernel, run: int) -> bool:
        p = plan(config, k, config.vmem_rows, prefetched=True) if isinstance(k, MatmulKernel) else None
        return p is not None and (p.iterations == 1 or (p.iterations == 2 and _run_loads_two(config, p, run)))

    def cost(first: int, period: int) -> int:
        last = first + period - 1
        idle = next((t for t in range(period) if stream[last - t]), period)
        before = idle + 1  # the small kernels before the body's last stream
        while before < period and not stream[last - before]:
            before += 1
        whole = before - idle - 1 >= LONG_RUN and loaded_whole(kernels[last - idle], before - idle - 1)
        return idle + (period if stream[first] else 0) + (LONG_RUN if whole else 0)

    return cost


def issue_prefetch(ctx: KernelContext) -> None:
    """In a small kernel already lowered: its tiles of the stream's prefetch, spliced in after its first
    loads (before its first wait that is not in a loop, or before the first loop that waits), where they keep
    the channel busy while the kernel waits. A chain that waits for nothing before its members (its inputs
    left in vmem by the kernel before) spreads them over its members instead, a share at the start of each
    member's block: 16 tile DMAs at once held a decode softmax ~300 cycles on the full DMA queue."""
    assert ctx.prefetch is not None and ctx.prefetch.issue is not None
    b = ctx.b
    blocks = b.func.blocks
    members = [blk for blk in blocks if blk.label.startswith("chain_member")]
    spread = len(members) >= 2 and not any(ins.op == "wait" for blk in blocks[:blocks.index(members[0])]
                                           for ins in blk.instrs)
    dmas = _issue_dmas(ctx, ctx.prefetch.issue)
    share = max(1, -(-len(dmas) // len(members)) if spread else len(dmas))  # an issuer may have no tiles

    def issue(n: int) -> None:
        for dma in dmas[n:n + share]:
            dma()

    # in order: a share uses the address registers of those before
    shares = [emit_apart(b, lambda n=n: issue(n)) for n in range(0, len(dmas), share)]
    # where they go, found after they were emitted: their argument loads went into the entry block
    points = [(blk, 0) for blk in members] if spread else [_after(blocks, ctx.prefetch_after) or first_wait(blocks)]
    for (block, at), instrs in zip(points, shares, strict=False):
        block.instrs[at:at] = instrs


def _after(blocks: list[Block], ins: MInstr | None) -> tuple[Block, int] | None:
    """The block holding `ins` and the index just after it, if any does."""
    for blk in blocks if ins is not None else ():
        for m, other in enumerate(blk.instrs):
            if other is ins:
                return blk, m + 1
    return None


def _issue_dmas(ctx: KernelContext, issue: Issue, first_flag: tuple[int, int] = (0, 0)
                ) -> list[Callable[[], None]]:
    """The tile DMAs of a prefetch, on flag PREFETCH: not marked used, so the issuer does not wait for them
    at its end (but the first n on flag f, first_flag (n, f): those it does wait for)."""
    slots = [Region(f"ring_prefetched{n}", row, 2 * issue.plan.G * ctx.lanes) for n, row in enumerate(issue.rows)]
    return _first_dmas(ctx, issue.kernel, issue.plan, slots, issue.tiles, lambda _: int(Flag.PREFETCH),
                       tuple(r.mem(write=True) for r in slots), first_flag)


def early_tiles(config: HardwareConfig, p: DecodePlan, prefetched: int, first_loaded: int = 1) -> int:
    """How many tiles of iteration `first_loaded` (the first one a stream loads itself) it issues before its
    first waits, when its first iteration is prefetched: what the channel moves in a DMA latency plus what
    its queue holds (issue stalls no longer than the waits would)."""
    if prefetched < 2 * p.G or p.iterations <= first_loaded:
        return 0
    return min(2 * p.G, config.dma_latency // _tile_cycles(config, p.packed) + config.dma_queue - 1)


def tiles_ahead_of_last(config: HardwareConfig) -> int:
    """How many of the next stream's tiles a stream's last iteration issues before its first wait: that wait
    is for its own last tiles, issued a latency before with nothing queued behind them, so the channel would
    idle through it (Qwen3's k_proj: ~320 cycles). Half the DMA queue: where the wait is short, the issue
    does not stall behind a full queue (the whole queue cost Qwen3's decode more than it saved)."""
    return config.dma_queue // 2


def tiles_ahead_of_whole_wait(config: HardwareConfig) -> int:
    """How many of the next stream's tiles a stream loaded whole (one iteration, prefetched) issues before it
    waits for its own last tiles, a latency through which the channel would idle (Qwen3's o_proj: ~270
    cycles). They go on a flag of their own, its early tiles' (a stream of one iteration has none:
    `early_tiles`), waited for at its end, long after they land: on PREFETCH they would hold that wait.
    Half the DMA queue, as `tiles_ahead_of_last` (2: 80,301 cycles of qwen3-0.6b-2l decode, 4: 80,173, 8:
    80,421; every stream with a prefetch so, on its early tiles' flag: 81,727, against 80,490 with none)."""
    return config.dma_queue // 2


def next_stream_along_slots(two: bool, next_region: int | None) -> bool:
    """Whether a stream whose first two iterations are in vmem (`two`) issues the next stream's tiles along
    them, once it has issued its own third iteration's: where the next stream's slot is none of its ring's
    regions (the stream before it is done with it). Else the channel idles until its last iteration
    (Qwen3's gate_proj: ~460 cycles a layer)."""
    return two and next_region is None


def next_tiles_every_second(in_vmem: bool) -> bool:
    """Whether a stream's last iteration issues the next stream's tiles at one every second tile of its own:
    where its own are in vmem (in its slots, or loaded whole), the weight port moves a tile in half the
    channel's time, and at one a tile the full DMA queue would hold the MXU to HBM's pace (Qwen3's o_proj:
    the channel then idled ~1,060 cycles a layer at its end, ~710 now)."""
    return in_vmem


def lower_decode_matmul(ctx: KernelContext, k: MatmulKernel, p: DecodePlan) -> None:
    b, L = ctx.b, ctx.lanes
    a, bm, c = k.a, k.b, k.c
    # the A row where the kernel before left it (a decode step's attention output: a DMA latency sooner)
    left = ctx.take_resident(a.buffer, a.dtype, a.offset, 1, p.k_tiles * L, p.k_tiles * L)
    ws = bm.strides[1]  # W's row stride in elements
    half = 2 * p.G * L  # vmem rows of an iteration's tiles
    n, G = p.iterations, p.G
    pre = ctx.prefetch  # the first iterations may be loaded already, by the kernels before this one
    prefetched = pre.prefetched if pre is not None else 0
    slots = pre.slots if pre is not None else ()
    # the ring: the slots of the first iterations (loaded by the kernels before, or by itself), else a region
    # of its own, then one more of its own; iteration i reads region i % len(ring)
    ring = [Region(f"ring_prefetched{m}", row, half) for m, row in enumerate(slots)] or [ctx.region(half, "ring")]
    ring.append(ctx.region(half, "ring"))
    two = len(ring) == 3  # iterations 0 and 1 prefetched: they load iteration 2 between them, at half pace
    first_loaded = 2 if two else 1  # the first iteration the stream loads while it computes
    issue = pre.issue if pre is not None else None
    # which ring region holds the slot the next stream's first groups go to (the planner keeps the last
    # iteration off it)
    if issue is not None:
        lo, hi = issue.rows[0], issue.rows[0] + 2 * issue.plan.G * L
        next_region = next((m for m, r in enumerate(ring) if r.row < hi and lo < r.row + r.rows), None)
    else:
        next_region = None
    # those groups, issued along the last iteration's MXU commands (the first few ahead of its first wait:
    # `tiles_ahead_of_last`), or along the iterations in the slots (`next_stream_along_slots`), or the first
    # few ahead of the wait for the prefetch where the stream is loaded whole (`tiles_ahead_of_whole_wait`)
    ahead_of_last = tiles_ahead_of_last(ctx.config)
    loaded_whole = n == 1 and prefetched > 0 and issue is not None and next_region is None
    ahead_of_wait = (tiles_ahead_of_whole_wait(ctx.config), ctx.flag(Flag.MATMUL_A, 1)) if loaded_whole else (0, 0)
    next_groups = _issue_dmas(ctx, issue, ahead_of_wait) if issue is not None else []
    assert next_region is None or next_region != (n - 1) % len(ring), "the last iteration reads the next slot"
    a_reg, c_reg = left or ctx.region(p.k_tiles, "a"), ctx.region(p.NT, "c")
    ring_mem = tuple(r.mem(write=True) for r in ring)
    ring_read = tuple(r.mem() for r in ring)
    step_bytes = p.U * L * ws * 2  # HBM bytes of one iteration's n-tiles
    if left is None:
        ctx.dma(True, "bf16", ctx.hbm_addr(a, a.offset), a_reg, 0, 1, p.k_tiles * L, p.k_tiles * L, Flag.MATMUL_A)
    w0 = ctx.hbm_addr(bm, bm.offset)

    # the tiles of its slots the kernels before did not load: with two slots, on PREFETCH (waited for at
    # the start), else the first iteration's, by group, then (below) each iteration issues the next one's
    # along its commands
    own = (lambda _: int(Flag.PREFETCH)) if two else (lambda q: ctx.flag(Flag.LOAD, q))
    for it in range(first_loaded):  # an iteration's DMAs a block (one block of both runs out of registers)
        tiles = range(max(prefetched, it * 2 * G), (it + 1) * 2 * G)
        if it and tiles:
            b.new_block("wstream_start")
        for dma in _first_dmas(ctx, k, p, ring[:first_loaded], tiles, own, ring_mem):
            dma()
    regions = [b.sreg() for _ in ring]  # regions[0]: the one read, regions[1]: the next
    for reg, region in zip(regions, ring, strict=True):
        b.emit("li", reg, imm=region.row)
    h_next, c_row = b.sreg(), b.sreg()
    b.emit("addi", h_next, (b.offset_reg(w0, first_loaded * step_bytes),), imm=0)
    b.emit("li", c_row, imm=c_reg.row)
    # with the first iteration prefetched the channel would idle while the prefetch's and the A row's last
    # latency run out: the first tiles it loads itself go ahead of those waits, on a flag of their own that
    # the iterations from `first_loaded` on wait on (a no-op after the first of them)
    early = early_tiles(ctx.config, p, prefetched, first_loaded)
    early_flag = ctx.flag(Flag.MATMUL_A, 1) if early else None
    for j in range(early):
        _tile_dma(ctx, p, ws, h_next, regions[first_loaded], j, early_flag, ring_mem)
    if prefetched or two:
        for _ in range(min(len(next_groups), ahead_of_wait[0])):
            next_groups.pop(0)()
        b.emit("wait", flag=int(Flag.PREFETCH))  # not marked used: the next stream's prefetch is on it too
    if left is None:
        b.emit("wait", flag=ctx.flag(Flag.MATMUL_A))
    rows = b.const(1)
    a_mem, c_mem = a_reg.mem(), c_reg.mem(write=True)
    # two slots: iterations 0 and 1 (in vmem) load iteration 2's other tiles and iteration 3's first few, a
    # tile every second command (at one a command the channel's queue would pace the MXU to HBM's speed
    # through tiles already in vmem); iteration 3's go on PREFETCH, so that iteration 2 does not wait for
    # them: iteration 3's wait on its later tiles (LOAD 0, issued after them) covers them
    ahead3 = min(early, G - 1) if two and n > 3 else 0
    sequence = [(2, t) for t in range(early, 2 * G)] + [(3, t) for t in range(ahead3)] if two and n > 2 else []
    spread: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for m, tile in enumerate(sequence):
        spread.setdefault(divmod(2 * m, 2 * G), []).append(tile)
    # after them, the slots' iterations go on with the next stream's groups where its slot is none of the
    # ring's (the stream before is done with it): the channel would idle until the last iteration
    spread_done = max(spread, default=(-1, 0)) if next_stream_along_slots(two, next_region) else (n, 0)

    def spread_dma(it: int, t: int) -> None:
        if it == 2:
            _tile_dma(ctx, p, ws, h_next, b.const(ring[2].row), t, ctx.flag(Flag.LOAD, t // G), ring_mem)
            return
        if t == 0:  # into iteration 0's rows
            b.emit("wait", flag=ctx.flag(Flag.WEIGHTS, 0))
        _tile_dma(ctx, p, ws, b.offset_reg(h_next, step_bytes), b.const(ring[0].row), t, int(Flag.PREFETCH), ring_mem)

    def iteration(i: int | None, issued: int = 0) -> None:
        """Iteration i (None: one the loop runs). Each but the last (and those in the slots) loads the next
        one's tiles along its commands (but its first `issued`, issued already); the last issues the next
        stream's prefetch instead."""
        loads, last = i is None or (2 if two else 0) <= i < n - 1, i == n - 1
        in_slot = two and i is not None and i < 2  # waited for at the start
        cur, nxt = regions[0], regions[1]
        for j in range(2 * G):
            q = j // G
            if j == 0 and last and next_region == (n - 2) % len(ring):  # the next slot was just read
                for g in range(2):
                    b.emit("wait", flag=ctx.flag(Flag.WEIGHTS, g))
            if j == 0 and last and not in_slot:  # ahead of its first wait, which the channel would idle through
                for _ in range(min(len(next_groups), ahead_of_last)):
                    next_groups.pop(0)()
            if j == 0 and early_flag is not None and (i is None or i >= first_loaded):
                b.emit("wait", flag=early_flag)
            if j % G == 0 and not in_slot:
                b.emit("wait", flag=ctx.flag(Flag.LOAD, q))
                if loads:  # the region's group q was read by an earlier iteration's weight loads
                    b.emit("wait", flag=ctx.flag(Flag.WEIGHTS, q))
            u, kt = divmod(j, p.KT)
            weights = (("mxu.lwt.lo", 2 * kt), ("mxu.lwt.hi", 2 * kt + 1)) if p.packed else (("mxu.lwt", kt),)
            for lw, k_tile in weights:
                b.emit(lw, None, (b.offset_reg(cur, j * L),), flag=ctx.flag(Flag.WEIGHTS, q), mem=ring_read)
                b.emit("mxu.mms" if k_tile == 0 else "mxu.mmas", None, (b.const(a_reg.row + k_tile),
                       b.offset_reg(c_row, u), rows), flag=ctx.flag(Flag.MXU), mem=(a_mem, c_mem))
            if loads and j >= issued:
                _tile_dma(ctx, p, ws, h_next, nxt, j, ctx.flag(Flag.LOAD, q), ring_mem)
            elif last and next_groups and (not next_tiles_every_second(in_slot or loaded_whole) or j % 2):
                next_groups.pop(0)()
            for it, t in spread.get((i, j), []) if in_slot else []:
                spread_dma(it, t)
            if in_slot and not last and next_groups and (i, j) > spread_done and j % 2:
                next_groups.pop(0)()
        b.addi(c_row, p.U, c_row)
        if loads or (two and i == 1):
            b.addi(h_next, step_bytes, h_next)
        if not last:  # the regions turn
            first = b.sreg()
            b.emit("addi", first, (regions[0],), imm=0)
            for dst, src in itertools.pairwise(regions):
                b.emit("addi", dst, (src,), imm=0)
            b.emit("addi", regions[-1], (first,), imm=0)

    # the iterations in vmem, or the first when it has early tiles, apart (each its own block: scheduling
    # cost grows faster than a block's length); the rest but the last in a loop
    apart = {0: 0, 1: 0, 2: ahead3} if ahead3 else {0: 0, 1: 0} if two else {0: early} if early else {}
    apart = {i: issued for i, issued in apart.items() if i < n - 1}
    for i, issued in apart.items():
        b.new_block("wstream_first")
        iteration(i, issued)
    if n - 1 - len(apart) > 0:
        b.counted_loop(n - 1 - len(apart), lambda: iteration(None), "wstream")
    iteration(n - 1)
    for dma in next_groups:
        dma()
    b.emit("wait", flag=ctx.flag(Flag.MXU))
    ctx.dma(False, c.dtype, ctx.hbm_addr(c, c.offset), c_reg, 0, 1, p.NT * L, c.strides[-2], Flag.STORE)
    # the A row stays for the next stream of the same input (Qwen3's k_proj and v_proj after q_proj, up_proj
    # after gate_proj), which would wait a DMA latency for it; not where C took A's place in HBM (a buffer
    # reused once its last reader is done)
    if c.buffer != a.buffer or c.offset >= a.offset + p.k_tiles * L or a.offset >= c.offset + p.NT * L:
        ctx.leave(Resident(a.buffer, a.dtype, a.offset, 1, p.k_tiles * L, p.k_tiles * L, a_reg))
    # and the C row for the kernel after (the residual add and norm after o_proj and down_proj), which would
    # wait a DMA latency for what was just stored: f32 in whole vmem rows, what a load of it brings
    if LEAVE_C_ROW and c.dtype == "f32" and c.shape[-1] == p.NT * L:
        ctx.leave(Resident(c.buffer, c.dtype, c.offset, 1, p.NT * L, p.NT * L, c_reg))
