"""Repeated kernel sequences (identical decoder layers, any stack of equal blocks) found in a kernel graph.

`find_loops(graph)` returns runs `kernels[first + i * period + j]` (0 <= i < repeats, 0 <= j < period,
repeats >= 2) whose kernels are equal but for the buffers they name: same kinds, shapes, strides, view
offsets, dtypes, body ops and constants (MLIR text and SSA names ignored), and the same aliasing among
one kernel's own views. The compiler emits such a run ONCE, as a body that runs `repeats` times over a
per-repetition address table. That is exact because a kernel's code depends on its buffers only through
their HBM addresses (`KernelContext.buffers`), which the body reads from the table: `Loop.slots[i][j]` is
the buffer repetition i uses as the body's slot j. A slot is a class of view occurrences in the body that
name one buffer in every repetition, so a buffer all repetitions share (a RoPE table, a mask) is one slot
with the same name in every row, and a repetition where bufferization reused one buffer for two roles
simply has that buffer in two slots.

The search takes the run that saves most kernels, then searches what is left before and after it.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from codegen.builder import f32_bits
from codegen.isel_common import Flag, KernelContext, Region, wait_for_stores
from codegen.kernel_graph import (
    Access,
    FillKernel,
    GatherKernel,
    GenericKernel,
    IotaKernel,
    Kernel,
    KernelGraph,
    MatmulKernel,
    ScalarProgram,
    ScatterKernel,
    View,
    views_of,
    written_buffer,
)
from codegen.mir import ZERO, Mem, Reg

NEXT_ROW = Flag.HALF  # the next repetition's address row: no kernel leaves a DMA in flight on it
MIN_SAVED = 4  # kernels a loop must save to pay for its header and footer (run once per repetition)


@dataclass(frozen=True)
class Loop:
    first: int  # index of the body's first kernel
    period: int  # kernels in the body
    repeats: int
    slots: tuple[tuple[str, ...], ...]  # [repetition][slot] -> buffer name


def signature(k: Kernel, graph: KernelGraph) -> tuple[Any, ...]:
    """`k` as a hashable structure, buffer names replaced by their order of first appearance in `k`."""
    return _canon(k, graph, {})


def _canon(x: Any, graph: KernelGraph, names: dict[str, int]) -> Any:
    if isinstance(x, View):
        slot = names.setdefault(x.buffer, len(names))
        return ("view", slot, graph.buffers[x.buffer].dtype, x.offset, x.shape, x.strides, x.dtype)
    if isinstance(x, ScalarProgram):
        return _canon_body(x)
    if dataclasses.is_dataclass(x):
        return (type(x).__name__, *(_canon(getattr(x, f.name), graph, names)
                                    for f in dataclasses.fields(x) if f.name not in ("text", "origin")))
    if isinstance(x, list | tuple):
        return tuple(_canon(e, graph, names) for e in x)
    if isinstance(x, float):
        return constant_key(x)
    return x


def constant_key(x: float) -> Any:
    """A constant as a hashable key: -0.0 differs from 0.0, and NaNs by their 32-bit lane pattern, which is
    how an integer constant travels (`kernel_graph.constant_value`: -16 is the NaN 0xfffffff0; keyed on its
    float value alone, the causal masks of a prefill's key tiles, which differ only by that offset, looked
    identical and ran as a loop of one tile's mask: issue 12's silent wrong answer at 2048 tokens)."""
    return x.hex() if x == x else ("nan", f32_bits(x))


def _canon_body(p: ScalarProgram) -> tuple[Any, ...]:
    """A generic's body with SSA names replaced by their order of definition, constants by their value."""
    local: dict[str, int] = {}

    def ref(n: str) -> Any:
        if n in p.constants:
            return ("const", constant_key(float(p.constants[n])))
        return local.setdefault(n, len(local))

    args = tuple(ref(a) for a in p.args)
    ops = tuple((ref(r), name, tuple(ref(o) for o in operands)) for r, name, operands in p.ops)
    return ("body", args, ops, tuple(ref(y) for y in p.yields))


EdgeCost = Callable[[int, int], int]  # (first, period) -> what a body with that edge costs, in any unit


def find_loops(graph: KernelGraph, min_saved: int = MIN_SAVED, edge_cost: EdgeCost | None = None) -> list[Loop]:
    """Non-overlapping runs of repeated kernel sequences, in kernel order (see the module docstring). A run
    can often start at any of several kernels (a body of layer i's second half and layer i + 1's first half
    saves as much as a whole layer): `edge_cost` picks the cheapest of those rotations (else the earliest)."""
    local = [signature(k, graph) for k in graph.kernels]
    ids: dict[Any, int] = {}
    sig = [ids.setdefault(s, len(ids)) for s in local]
    return sorted(_search(graph, sig, 0, len(sig), min_saved, edge_cost), key=lambda lp: lp.first)


def _search(graph: KernelGraph, sig: list[int], lo: int, hi: int, min_saved: int,
            edge_cost: EdgeCost | None) -> list[Loop]:
    best = _best_run(graph, sig, lo, hi, min_saved, edge_cost)
    if best is None:
        return []
    end = best.first + best.period * best.repeats
    return [*_search(graph, sig, lo, best.first, min_saved, edge_cost), best,
            *_search(graph, sig, end, hi, min_saved, edge_cost)]


def _best_run(graph: KernelGraph, sig: list[int], lo: int, hi: int, min_saved: int,
              edge_cost: EdgeCost | None = None) -> Loop | None:
    """The run in kernels [lo, hi) saving most kernels (the shortest period, then the cheapest edge, then the
    earliest on ties)."""
    best: tuple[int, int, int, int] | None = None  # (-saved, period, first, repeats)
    rotations: list[int] = []  # the starts of runs as good as `best`
    for period in range(1, (hi - lo) // 2 + 1):
        # `run` counts the x >= here with sig[x] == sig[x + period]: a run of L such x starting at x gives
        # 1 + L // period repetitions of the period starting at x
        run = 0
        for x in range(hi - period - 1, lo - 1, -1):
            run = run + 1 if sig[x] == sig[x + period] else 0
            repeats = 1 + run // period
            candidate = (-(repeats - 1) * period, period, x, repeats)
            if repeats < 2 or (repeats - 1) * period < min_saved:
                continue
            if best is None or candidate[:2] < best[:2]:
                best, rotations = candidate, [x]
            elif candidate[:2] == best[:2]:
                rotations.append(x)
    if best is None:
        return None
    first = min(rotations, key=lambda x: (edge_cost(x, best[1]) if edge_cost else 0, x))
    return _slots(graph, first, best[1], best[3])  # equal saving and period: equal repeats


def layers_two_at_a_time(graph: KernelGraph, lp: Loop) -> Loop:
    """`lp` as a loop whose body is two of its bodies (of an odd count of repetitions, the last one then
    runs after the loop, unrolled)."""
    return _slots(graph, lp.first, 2 * lp.period, lp.repeats // 2)


def _slots(graph: KernelGraph, first: int, period: int, repeats: int) -> Loop:
    """The run's address slots: view occurrences of the body grouped by the buffer they name in every
    repetition (occurrences that share a buffer in all repetitions share a slot)."""
    reps = []
    for i in range(repeats):
        names: list[str] = []
        for k in graph.kernels[first + i * period: first + (i + 1) * period]:
            names += [v.buffer for v in views_of(k)]
        reps.append(names)
    classes = list(dict.fromkeys(zip(*reps, strict=True)))
    return Loop(first, period, repeats, tuple(zip(*classes, strict=True)))


def sink_fills(kernels: list[Kernel]) -> list[Kernel]:
    """Each fill moved to just before the next kernel that touches its buffer. Bufferization may place the
    fill of one layer's accumulator among an earlier layer's kernels (a shared constant init), which makes
    identical layers look different; a fill that nothing reads or writes in between may run later."""
    out: list[Kernel] = []
    pending: list[FillKernel] = []
    for k in kernels:
        used = {v.buffer for v in views_of(k)}
        keep = []
        for f in pending:
            (out if f.output.buffer in used else keep).append(f)
        pending = keep
        if isinstance(k, FillKernel):  # after the pending fills of its buffer (flushed just above)
            pending.append(k)
        else:
            out.append(k)
    return out + pending


def hoist_invariant_kernels(kernels: list[Kernel], graph: KernelGraph) -> list[Kernel]:
    """Generics and iotas that read nothing computed in the program (graph inputs no kernel writes, or what
    kernels hoisted before them made) moved to the front, in order. MLIR's CSE leaves such a value (a causal
    mask's iotas, a kv_len mask) to the first layer that needs it, which made that layer unlike the others:
    the loop then covered all layers but one (and at 2048 tokens two layers' code passed imem)."""
    writes = [{written_buffer(k)} for k in kernels]
    writers = Counter(b for w in writes for b in w)
    made: set[str] = set()
    touched: set[str] = set()  # buffers the kernels left in place so far read or write
    front, rest = [], []
    for k, w in zip(kernels, writes, strict=True):
        reads = {v.buffer for v in views_of(k)} - w if isinstance(k, GenericKernel | IotaKernel) else None
        if reads is not None and all(writers[b] == 1 for b in w) and not w & touched and all(
                b in made or (graph.buffers[b].kind == "input" and not writers[b]) for b in reads):
            front.append(k)
            made |= w
        else:
            rest.append(k)
            touched |= {v.buffer for v in views_of(k)}
    return front + rest


# ---- the loop's code ------------------------------------------------------------------------------------
# vmem: the argument table (entries 0..), then the *layer window* (the current repetition's slot addresses,
# from entry `window`), then the *next window* (the next repetition's, loaded while the body runs), then one
# row group holding the *cursor* (byte offset of the current repetition's row in its HBM address table). No
# register lives from one function into the next, so the cursor lives in vmem. The table has one row more
# than the loop has repetitions: the last repetition loads it as its next row (the last row again, or the
# addresses of the stream after the loop that the body's last kernels prefetch: `compiler._prefetches`).
@dataclass(frozen=True)
class LoopLayout:
    window: int  # argument-table entry of slot 0
    next_window: int  # argument-table entry of slot 0 of the next repetition
    cursor: int  # argument-table entry of the cursor (first entry of its own row group)
    lanes: int

    @property
    def entries(self) -> int:
        """Table entries to reserve in vmem (through the cursor's row group)."""
        return self.cursor + 8 * self.lanes


def loop_layout(table_entries: int, loops: list[Loop], lanes: int) -> LoopLayout:
    group = 8 * lanes
    window = -(-table_entries // group) * group
    span = -(-max(len(lp.slots[0]) for lp in loops) // group) * group
    return LoopLayout(window, window + span, window + 2 * span, lanes)


def replace_views(k: Kernel, new: Callable[[View], View]) -> Kernel:
    """`k` with every view `v` replaced by `new(v)`, in `views_of` order."""
    def a(acc: Access) -> Access:
        return Access(new(acc.view), acc.iter_strides)

    if isinstance(k, GenericKernel):
        return dataclasses.replace(k, inputs=[a(o) for o in k.inputs], output=a(k.output))
    if isinstance(k, FillKernel | IotaKernel):
        return dataclasses.replace(k, output=new(k.output))
    if isinstance(k, GatherKernel):
        return dataclasses.replace(k, table=new(k.table), ids=a(k.ids), output=new(k.output))
    if isinstance(k, ScatterKernel):
        return dataclasses.replace(k, dest=new(k.dest), indices=new(k.indices), updates=new(k.updates))
    assert isinstance(k, MatmulKernel)
    return dataclasses.replace(k, a=new(k.a), b=new(k.b), c=new(k.c))


SLOT = "@slot"


def slot_name(j: int) -> str:
    return f"{SLOT}{j}"


def slot_index(buffer: str) -> int | None:
    """j where `buffer` is `slot_name(j)`, else None."""
    return int(buffer[len(SLOT):]) if buffer.startswith(SLOT) else None


NEXT_SLOT = "@next"


def next_slot_name(j: int) -> str:
    """Slot j of the next repetition (its address in the next window): what a body's last kernels prefetch for
    the next repetition's first stream reads."""
    return f"{NEXT_SLOT}{j}"


def reads_next_window(k: Kernel) -> bool:
    """Whether a view of `k` names a slot of the next repetition (`next_slot_name`)."""
    return any(v.buffer.startswith(NEXT_SLOT) for v in views_of(k))


def rename_to_slots(k: Kernel, slots: list[int], name: Callable[[int], str] = slot_name) -> Kernel:
    """`k` with its views' buffers renamed to the given slots (`views_of` order; `next_slot_name`: the next
    repetition's)."""
    names = iter(name(j) for j in slots)
    return replace_views(k, lambda v: dataclasses.replace(v, buffer=next(names)))


def occurrence_slots(loop: Loop, graph: KernelGraph) -> list[int]:
    """The slot of every view occurrence of the body, in order (what `rename_to_slots` takes)."""
    reps = [[v.buffer for k in graph.kernels[loop.first + i * loop.period: loop.first + (i + 1) * loop.period]
             for v in views_of(k)] for i in range(loop.repeats)]
    index = {cls: j for j, cls in enumerate(zip(*loop.slots, strict=True))}
    return [index[occ] for occ in zip(*reps, strict=True)]


def emit_init(ctx: KernelContext, layout: LoopLayout, args: Region, arena_entry: int, table_offset: int,
              slots: int) -> None:
    """cursor := 0; the window := the table's first row (waited for: the body's first kernels read it)."""
    b = ctx.b
    row = layout.cursor // layout.lanes
    b.vst(b.vop("vbcast", ZERO), ZERO, args.row + row, Mem(args.name, row, row + 8, write=True))
    at = b.offset_reg(ctx.argument(arena_entry), table_offset)
    ctx.dma(True, "i32", at, args, layout.window // layout.lanes, 1, slots, slots, Flag.LOAD)


def emit_header(ctx: KernelContext, layout: LoopLayout, args: Region, arena_entry: int, table_offset: int,
                slots: int) -> None:
    """The next window := row `cursor` + 1 of the loop's HBM address table (at arena + `table_offset`), left
    in flight on NEXT_ROW: the body runs along its latency, and the footer waits for it."""
    b = ctx.b
    at = b.emit("add", b.sreg(), (ctx.argument(arena_entry), ctx.argument(layout.cursor)))
    assert isinstance(at, Reg)
    ctx.dma(True, "i32", b.offset_reg(at, table_offset + 4 * slots), args, layout.next_window // layout.lanes, 1,
            slots, slots, NEXT_ROW, in_flight=True)


def emit_footer(ctx: KernelContext, layout: LoopLayout, args: Region, loop: Loop, header: str,
                drain: bool = True) -> None:
    """The window := the next window; cursor += one row; back to the header while rows are left. `drain`:
    first wait for the stores in flight (the body's first kernels do not expect them all)."""
    b = ctx.b
    if drain:
        b.block.instrs.extend(wait_for_stores())
    b.emit("wait", flag=NEXT_ROW)
    lanes = layout.lanes
    for entry in range(0, len(loop.slots[0]), 8 * lanes):
        src, dst = (layout.next_window + entry) // lanes, (layout.window + entry) // lanes
        v = b.vld(ZERO, args.row + src, Mem(args.name, src, src + 8))
        b.vst(v, ZERO, args.row + dst, Mem(args.name, dst, dst + 8, write=True))
    row_bytes = 4 * len(loop.slots[0])
    nxt = b.addi(ctx.argument(layout.cursor), row_bytes)
    row = layout.cursor // lanes
    b.vst(b.vop("vbcast", nxt), ZERO, args.row + row, Mem(args.name, row, row + 8, write=True))
    left = b.emit("sub", b.sreg(), (b.const(loop.repeats * row_bytes), nxt))
    b.emit("bnz", None, (left,), target=header)
