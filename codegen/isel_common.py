"""What every kernel's instruction selection shares: vmem regions, flags, HBM addresses, DMA commands.

A kernel runs with vmem to itself: `KernelContext.begin` resets the region allocator (above the spill
area and the argument table), and `end` waits on every flag the kernel used but its stores' (STORE_FLAGS):
its last stores drain while the next kernel starts, whose first loads queue behind them on the one DMA
channel. HBM order between kernels needs nothing: DMA commands execute in order on one channel. What the
next kernel must not do is write vmem rows those stores still read: `guard_stores_in_flight` makes it wait
on STORE_FLAGS before its first vmem write to those rows, unless a wait on its own DMA comes first (that
covers them). The context keeps the rows the earlier kernels' stores may still read (`_in_flight`), so a
kernel that writes other rows (an iota, the zero rows of a padded weight panel) starts without waiting.

Two exceptions carry vmem rows across a boundary. A decode stream's prefetched weights (`isel_decode`: the
kernels before it stay under a ceiling). And *residents* (`Resident`): rows a kernel leaves for the function
right after it, exactly as a load would bring them, which that kernel then reads in place of the load
(`leave`, `take_resident`): decode's f32 scores from q @ K^T to the softmax chain, and rows a kernel loads
for the chain after it (`preload`: the key mask, whose DMA latency then runs along q @ K^T's work), or
for resident batches after it (their first KV head's keys or values, left in flight: `Preload.in_flight`).

HBM addresses: the program's entry copies the launch's argument table (the HBM addresses of the graph's
inputs and of its arena) into vmem rows `args_row`..; a kernel loads the entries it uses (`vld` + `vext`)
at its start, into ordinary virtual registers. So no register lives from one kernel into the next, and a
graph may have any number of inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from codegen.builder import Builder
from codegen.errors import CapacityError
from codegen.kernel_graph import ESIZE, View
from codegen.mir import ZERO, Block, Function, Mem, MInstr, Reg
from codegen.regalloc import SPILL_SLOTS
from device_sim.config import HardwareConfig
from device_sim.isa import DMA_SHAPE_COLS_MASK, DMA_SHAPE_ROWS_SHIFT, NUM_FLAGS, Unit

SPILL_ROWS = SPILL_SLOTS * 8


class Flag(IntEnum):
    """What each completion flag signals (DMA and MXU commands set one; `wait` blocks on it). A kernel owns
    all NUM_FLAGS and ends waiting on those it used; every role has flags of its own, so two phases of a
    kernel never share one by accident. Roles of width 2 alternate by tile parity (`ctx.flag(role, p)`)."""

    LOAD = 0  # width 2: vector tiles in; matmul B (weight) panels
    STORE = 2  # width 2: tiles out; matmul C tiles out
    MATMUL_A = 4  # width 2: matmul A panels (and, in a pipelined start, the first B panel's k-tiles by group)
    COPY = 6  # a strided copy through HBM scratch (transposes)
    PREFETCH = 7  # a decode stream's first weight groups, issued by the small kernels before it (isel_decode)
    MXU = 8  # width 2: matmul passes done
    INDEX = 10  # gather ids / scatter index rows in
    ROWS = 11  # gathered rows in / scatter update rows in
    OUT = 12  # gather / scatter / iota results out; a matmul C tile's last piece of rows (`isel_matmul._piece_flag`)
    WEIGHTS = 13  # width 2: matmul weight loads (`mxu.lw*`) done: their B panel may be overwritten
    HALF = 15  # the second half of a chain's rows in (`isel_vector.lower_chain`); a layer loop's next address row


STORE_FLAGS = (Flag.STORE, Flag.STORE + 1, Flag.OUT)  # a kernel leaves these DMA stores in flight
FLAG_WIDTH = {Flag.LOAD: 2, Flag.STORE: 2, Flag.MATMUL_A: 2, Flag.MXU: 2, Flag.WEIGHTS: 2}
assert all(f + FLAG_WIDTH.get(f, 1) <= nxt for f, nxt in zip(Flag, [*list(Flag)[1:], NUM_FLAGS], strict=True))
DRAINING_ROWS_SKIPPED = 64  # a kernel's regions start above in-flight stores' rows up to this part of vmem
MAX_SPILL_ROW = 1 << 13  # spill loads / stores address vmem through s0 + imm14 (signed)


def region_rows(rows: int) -> int:
    """The vmem rows a region of `rows` takes (`KernelContext.region`): whole 8-row chunks, at least one."""
    return max(8, -(-rows // 8) * 8)


@dataclass
class Region:
    name: str
    row: int  # first vmem row
    rows: int
    base: int = 0  # its first row's offset in the region `name` was allocated as (`view`)

    def mem(self, lo: int = 0, hi: int | None = None, write: bool = False) -> Mem:
        return Mem(self.name, self.base + lo, self.base + (self.rows if hi is None else hi), write)

    def view(self, offset: int, rows: int) -> Region:
        """Rows [offset, offset + rows) as a region of their own: one DMA can fill several views."""
        return Region(self.name, self.row + offset, rows, self.base + offset)


@dataclass(frozen=True)
class Resident:
    """Elements of a buffer a kernel leaves in its vmem for the next kernel to read there instead of loading
    them: `rows` rows of `cols` elements (row r's from element `base + r * stride`), laid out as a DMA of
    that shape would load them (row r at region row r * ceil(cols / lanes), zero past a row's last element).
    Bit for bit what the load would bring: the kernel also stores them, and ends waiting for what writes them,
    but an `in_flight` preload's DMA (`Preload`), on COPY: the next function waits for it, before it reads
    the rows where it takes them, else at its start."""

    buffer: str
    dtype: str
    base: int
    rows: int
    cols: int
    stride: int
    region: Region
    in_flight: bool = False


@dataclass(frozen=True)
class Preload:
    """Rows a kernel loads for the next one (`KernelContext.preload`), which that one takes as a `Resident`:
    `rows` rows of `cols` elements of `view` (row r's from element `base + r * stride`) in `extent` vmem rows
    (what the reader's own load would fill), issued at the kernel's start, which ends waiting for it; or,
    `in_flight` (a big one: a matmul's first weights), just after the kernel's own first loads, which it
    would hold up, and left in flight for the next function to wait on (`Resident.in_flight`)."""

    view: View
    base: int
    rows: int
    cols: int
    stride: int
    extent: int
    in_flight: bool = False


def _laid_out(lanes: int, buffer: str, dtype: str, base: int, rows: int, cols: int, stride: int) -> tuple:
    """Elements as a `Resident` lays them out: rows of whole vmem rows one after the other in HBM (a
    generic's [H, D] output) are one row (the [1, H * D] row a matmul loads), laid out alike."""
    if cols % lanes == 0 and (stride == cols or rows == 1):
        return buffer, dtype, base, rows * cols
    return buffer, dtype, base, rows, cols, stride


def emit_apart(b: Builder, emit: Callable[[], None]) -> list[MInstr]:
    """The instructions `emit` emits, in a block of their own, for the caller to splice elsewhere in the
    function (a kernel's start, another block): constants cached for the current block are not defined
    there, so they are made anew on both sides."""
    current, scratch = b.block, Block("apart")
    b.new_scope()
    b.block = scratch
    emit()
    b.block = current
    b.new_scope()
    return scratch.instrs


def first_wait(blocks: list[Block]) -> tuple[Block, int]:
    """Where code runs once, before the kernel first waits: the block and index of its first wait outside a
    loop, or the end of the block before the first loop with a wait (a loop that zeroes a panel before the
    loads does not count), or the end of the last block (before a branch that ends it)."""
    index = {blk.label: n for n, blk in enumerate(blocks)}
    looped = [False] * len(blocks)
    for n, blk in enumerate(blocks):
        for ins in blk.instrs:
            head = index.get(str(ins.target)) if ins.target is not None else None
            if head is not None and head <= n:
                looped[head:n + 1] = [True] * (n + 1 - head)
    for n, blk in enumerate(blocks):
        waits = [m for m, ins in enumerate(blk.instrs) if ins.op == "wait"]
        if waits and looped[n]:
            before = blocks[max(m for m in range(n) if not looped[m])]
            return before, _before_branch(before)
        if waits:
            return blk, waits[0]
    return blocks[-1], _before_branch(blocks[-1])


def _before_branch(blk: Block) -> int:
    return len(blk.instrs) - 1 if blk.instrs and blk.instrs[-1].is_control else len(blk.instrs)


def after_first_loads(blocks: list[Block], start: Block, at: int) -> tuple[Block, int]:
    """Just after the last load a kernel issues before it first waits (`first_wait`), or (start, at) when it
    loads nothing before."""
    wait_block, wait_at = first_wait(blocks)
    for blk in blocks[:blocks.index(wait_block) + 1]:
        for m, ins in enumerate(blk.instrs[:wait_at] if blk is wait_block else blk.instrs):
            if ins.unit is Unit.DMA and not ins.op.startswith("dma.st"):
                start, at = blk, m + 1
    return start, at


def wait_for_stores() -> list[MInstr]:
    return [MInstr("wait", flag=f) for f in STORE_FLAGS]


def _writes_vmem(ins: MInstr) -> bool:
    return ins.unit is Unit.VSTORE or (ins.unit is Unit.MXU and ins.op.startswith("mxu.mm")) \
        or any(m.write for m in ins.mem)


def _runs_first(func: Function, stores_cover: bool) -> tuple[list[tuple[Block, int, MInstr]], bool]:
    """The code of `func` (a kernel) that runs before it waits out the earlier kernels' stores: the entry
    block, then the blocks it falls into, up to a wait on one of its own DMA commands (the channel completes
    commands in issue order, so that wait covers the earlier stores) or, `stores_cover`, on all of
    STORE_FLAGS, or up to the first branch (a loop's first block: a runtime count of m-tiles or tiles loads,
    then waits, on its first run as on the others; the branch is the last instruction given). Each
    instruction with its block and index, and whether a wait covered."""
    code: list[tuple[Block, int, MInstr]] = []
    dma_flags: set[int | None] = set()
    waited: set[int | None] = set()
    for blk in func.blocks:
        for i, ins in enumerate(blk.instrs):
            if ins.op == "wait":
                waited.add(ins.flag)
                if ins.flag in dma_flags or (stores_cover and waited >= set(STORE_FLAGS)):
                    return code, True
            elif ins.unit is Unit.DMA:
                dma_flags.add(ins.flag)
            code.append((blk, i, ins))
            if ins.is_control:
                return code, False
    return code, False


def guard_stores_in_flight(func: Function, clashes: Callable[[MInstr], bool] = _writes_vmem) -> bool:
    """Make `func` (a kernel) safe to start while the earlier kernels' stores still read their vmem rows:
    wait on STORE_FLAGS before its first instruction that writes vmem by any unit but the DMA channel (which
    orders itself) and `clashes` with those rows, unless a wait on one of its own DMA commands comes first
    (`_runs_first`); when the code that runs first ends uncovered, the waits go at the entry block's end, or
    before its first clash. Returns whether it waits (nothing to wait for when no instruction of `func`
    clashes)."""
    if not any(ins.unit is not Unit.DMA and clashes(ins) for blk in func.blocks for ins in blk.instrs):
        return False
    entry = func.blocks[0]
    code, covered = _runs_first(func, stores_cover=False)
    for blk, i, ins in code:
        if ins.unit is not Unit.DMA and (clashes(ins) or ins.is_control):
            if blk is entry:
                entry.instrs[i:i] = wait_for_stores()
            else:
                entry.instrs.extend(wait_for_stores())
            return True
    if covered:
        return False
    entry.instrs.extend(wait_for_stores())
    return True


Rows = list[tuple[int, int]] | None  # vmem row ranges [lo, hi); None: not known (any row)


def uncovered_writes(func: Function, rows_of: Callable[[Mem], tuple[int, int] | None]) -> tuple[Rows, bool]:
    """The vmem rows `func` may write (by any unit but the DMA channel) while earlier stores may still read
    theirs, and whether it then waits them out: the code that runs first (`_runs_first`), where a wait on
    all of STORE_FLAGS (a guard's) covers too; after a branch, any row."""
    rows: list[tuple[int, int]] = []
    code, covered = _runs_first(func, stores_cover=True)
    for _, _, ins in code:
        if ins.is_control:
            return None, False
        if ins.unit is not Unit.DMA and _writes_vmem(ins):
            written = [rows_of(m) for m in ins.mem if m.write] or [None]
            if None in written:
                return None, False
            rows += written
    return rows, covered


def _overlaps(rows: Rows, lo: int, hi: int) -> bool:
    return rows is None or any(a < hi and lo < b for a, b in rows)


def stay_in_flight(runs: list[tuple[Function, tuple[Rows, bool]]], rows: Rows) -> bool:
    """Whether stores that read `rows` may stay in flight into functions that run in order, each with `(rows
    it may write uncovered, whether it then covers)` (`uncovered_writes`): none of them writes those rows
    before they are waited out. If so, their spill slots (chosen later, by register allocation) move off
    those rows."""
    ahead = []
    for func, (written, covered) in runs:
        if written is None or any(_overlaps(rows, lo, hi) for lo, hi in written):
            return False
        ahead.append(func)
        if covered:
            break
    else:
        return False
    for func in ahead:
        func.spill_rows = tuple(r for r in func.spill_rows if r < SPILL_ROWS or not _overlaps(rows, r, r + 8))
    return True


def rows_within(rows: Rows, bound: Rows) -> bool:
    """Whether every row of `rows` lies in a range of `bound`."""
    if bound is None:
        return True
    return rows is not None and all(any(lo <= a and b <= hi for lo, hi in bound) for a, b in rows)


def table_rows(entries: int, lanes: int) -> int:
    """vmem rows the argument table takes: whole groups of 8, so a `vld` of its rows reads nothing else."""
    return -(-entries // (8 * lanes)) * 8


@dataclass
class KernelContext:
    b: Builder
    config: HardwareConfig
    buffers: dict[str, tuple[int, int]]  # buffer -> (argument table entry, byte offset)
    scratch: tuple[int, int]  # HBM scratch area for materialized operands (table entry, byte offset)
    args_row: int  # first vmem row of the argument table
    matmul_precision: str = "highest"
    table_entries: int = 0  # vmem argument-table entries to reserve beyond those `buffers` names (layer loops)
    prefetch: Any = None  # the kernel's part in a decode stream's prefetch (isel_decode.Prefetch), set per kernel
    # where a kernel that issues its own loads over its run wants the next stream's prefetch tiles
    # (`isel_decode.issue_prefetch`; else before its first wait): after this instruction
    prefetch_after: MInstr | None = None
    values: dict[int, int] = field(default_factory=dict)  # graph argument -> the table entry holding its value
    hbm_base: dict[str, tuple[Reg, int]] = field(default_factory=dict)  # this kernel's scratch views
    _base_row: int = SPILL_ROWS
    _next_row: int = SPILL_ROWS
    _ceiling: int = 0  # the first vmem row the kernel may allocate no region from
    _top: int = 0  # the first it may not use at all (rows above hold a prefetch)
    _regions: int = 0
    _flags_used: set[int] = field(default_factory=set)
    _args: dict[int, Reg] = field(default_factory=dict)
    _named: dict[str, Region] = field(default_factory=dict)  # this kernel's regions by name
    _in_flight: Rows = field(default_factory=list)  # rows the earlier kernels' stores may still read
    uncovered: tuple[Rows, bool] = ([], True)  # the last function's `uncovered_writes`
    resident: tuple[Resident, ...] = ()  # what the function before this one left in vmem (`take_resident`)
    _leaving: list[Resident] = field(default_factory=list)  # what this one leaves (`leave`)
    _preloaded: list[tuple[int, int]] = field(default_factory=list)  # the rows of its preloads (`preload`)
    taken: list[tuple[int, int]] = field(default_factory=list)  # rows it reads where the kernel before left them
    _scratch_used: int = 0
    scratch_peak: int = 0

    def __post_init__(self) -> None:
        entries = max(self.table_entries, 1 + max([j for j, _ in self.buffers.values()] + [self.scratch[0]]))
        self._base_row = self.args_row + table_rows(entries, self.config.lanes)

    @property
    def lanes(self) -> int:
        return self.config.lanes

    @property
    def base_row(self) -> int:
        """The first vmem row a kernel's regions take (above the spill area and the argument table)."""
        return self._base_row

    def begin(self, kernel: str) -> None:
        self._ceiling = self.prefetch.ceiling if self.prefetch is not None else self.config.vmem_rows
        self._top = self._ceiling
        self._next_row = self._base_row
        # a few rows at the bottom still read by the stores in flight (a small kernel's output tile): start
        # above them, so that the kernel's own writes need not wait for those stores
        window = self._base_row + self.config.vmem_rows // DRAINING_ROWS_SKIPPED
        top = max((hi for lo, hi in self._in_flight or () if lo < window), default=0)
        if top and top <= min(window, self._ceiling // 2):
            self._next_row = -(-top // 8) * 8
        self._flags_used = set()
        self._scratch_used = 0
        self._args = {}
        self._named = {}
        self.hbm_base = {}
        self.kernel = kernel
        self.prefetch_after = None
        # only the function just before: a loop's init, header or footer in between leaves nothing
        self.resident, self._leaving, self.taken, self._preloaded = tuple(self._leaving), [], [], []

    @property
    def stores_in_flight(self) -> Rows:
        """The vmem rows that stores the functions emitted so far may leave in flight may still read."""
        return None if self._in_flight is None else list(self._in_flight)

    def assume_stores(self, rows: Rows) -> None:
        """The next function may also run after code whose stores in flight read at most `rows` (a loop's
        header after its footer, which waits for them where they read more: `layer_loop.emit_footer`)."""
        self._in_flight = None if rows is None or self._in_flight is None else self._in_flight + rows

    def end(self) -> None:
        func, before = self.b.func, self._in_flight
        if any(r.in_flight and (r.region.row, r.region.row + r.region.rows) not in self.taken for r in self.resident):
            func.blocks[0].instrs.insert(0, MInstr("wait", flag=Flag.COPY))  # its rows are this function's
        waits = guard_stores_in_flight(func, self._clashes)
        for f in sorted(self._flags_used - set(STORE_FLAGS)):
            self.b.emit("wait", flag=f)
        # the kernel's spill slots: the reserved area at the bottom of vmem, then the rows above its regions
        # that no earlier kernel's store may still read
        top = min(self._ceiling, MAX_SPILL_ROW) // 8 * 8
        above = range(top - 8, -(-self._next_row // 8) * 8 - 1, -8)
        func.spill_rows = tuple(range(0, SPILL_ROWS, 8)) + tuple(r for r in above if not _overlaps(before, r, r + 8))
        self.uncovered = uncovered_writes(func, self._rows)  # for a layer loop's footer
        # what the next kernel's guard must know: this kernel's stores, and the earlier ones unless this kernel
        # waited on them (its guard) or on a DMA of its own issued after them (its last waits)
        loads = {ins.flag for blk in func.blocks for ins in blk.instrs
                 if ins.unit is Unit.DMA and not ins.op.startswith("dma.st")} & self._flags_used
        stores = [self._rows(m) for blk in func.blocks for ins in blk.instrs if ins.op.startswith("dma.st")
                  for m in (ins.mem or (None,)) if m is None or not m.write]
        mine: Rows = None if None in stores else stores
        if not (waits or loads):  # the earlier stores may still be in flight too
            mine = None if mine is None or before is None else mine + before
        self._in_flight = mine

    def _rows(self, m: Mem | None) -> tuple[int, int] | None:
        if m is not None and m.region == "args" and m.hi is not None:  # the argument table (a loop's windows)
            return self.args_row + m.lo, self.args_row + m.hi
        region = self._named.get(m.region) if m is not None else None
        if region is None:
            return None
        return region.row + m.lo, region.row + (region.rows if m.hi is None else m.hi)

    def _clashes(self, ins: MInstr) -> bool:
        """Whether `ins` may write vmem rows that earlier kernels' stores still read."""
        if not _writes_vmem(ins):
            return False
        written = [self._rows(m) for m in ins.mem if m.write] or [None]
        return any(r is None or _overlaps(self._in_flight, *r) for r in written)

    def region(self, rows: int, hint: str) -> Region:
        rows = region_rows(rows)
        if self._next_row + rows > self._ceiling:
            need = self._next_row + rows
            raise CapacityError(f"{self.kernel}: vmem exhausted ({need} > {self._ceiling} rows)")
        self._regions += 1
        r = Region(f"{hint}{self._regions}", self._next_row, rows)
        self._named[r.name] = r
        self._next_row += rows
        return r

    def leave(self, resident: Resident) -> None:
        """`resident` stays in vmem for the next function (its rows are not written after this call)."""
        self._leaving.append(resident)

    def preload(self, p: Preload) -> None:
        """After the kernel is lowered: load `p` for the next kernel and leave it there (`leave`), in rows at the
        top of what the kernel left free (none: nothing), on COPY, issued where its latency runs along the
        kernel's work (see `Preload`)."""
        view = p.view
        need = region_rows(p.extent)
        row = self._free_above(need)
        if row is None:
            if self.vmem_free() < need:
                return
            self._ceiling -= need
            row = self._ceiling
        self._preloaded.append((row, row + need))
        self._regions += 1
        region = Region(f"preload{self._regions}", row, need)
        self._named[region.name] = region  # its DMA waits only for stores in flight on these rows
        instrs = emit_apart(self.b, lambda: self.dma(True, view.dtype, self.hbm_addr(view, p.base), region, 0,
                                                     p.rows, p.cols, p.stride, Flag.COPY, in_flight=p.in_flight))
        # found after it was emitted: the DMA's address may have added argument loads (`argument`)
        block, at = self.b.func.blocks[0], 2 * len(self._args)
        if p.in_flight:
            block, at = after_first_loads(self.b.func.blocks, block, at)
        block.instrs[at:at] = instrs
        self.leave(Resident(view.buffer, view.dtype, p.base, p.rows, p.cols, p.stride, region, p.in_flight))

    def _free_above(self, rows: int) -> int | None:
        """The first of the highest `rows` rows between the ceiling and the top that hold nothing this kernel
        reads or loads (what it took, its preloads; a resident it did not take is dead), if any: a preload
        there does not lower the ceiling the next kernel finds (where the kernel took a row just under its top,
        the next took its preload below that, and rows above it went unused)."""
        cursor = self._top
        for lo, hi in sorted(self.taken + self._preloaded, reverse=True):
            if hi <= cursor - rows:
                break
            cursor = min(cursor, lo)
        return cursor - rows if cursor - rows >= self._ceiling else None

    def take_resident(self, buffer: str, dtype: str, base: int, rows: int, cols: int, stride: int) -> Region | None:
        """The region where the kernel before left exactly these elements (see `Resident`), kept out of this
        kernel's own regions: below them (the allocator starts above it) or above (the ceiling comes down to
        it), whichever keeps more rows, or where they are when they lie above the rows it allocates from (a
        ceiling an earlier resident lowered); None when it did not leave them, or when they lie where this
        kernel may not keep them (above its top: a prefetch's slots; among regions it allocated already)."""
        want = _laid_out(self.lanes, buffer, dtype, base, rows, cols, stride)
        for r in self.resident:
            lo, hi = r.region.row, r.region.row + r.region.rows
            if _laid_out(self.lanes, r.buffer, r.dtype, r.base, r.rows, r.cols, r.stride) != want \
                    or lo < self._base_row \
                    or hi > self._top or (self._named and lo < self._next_row):
                continue
            if lo < self._ceiling:  # among the rows it allocates from (not above a ceiling an earlier one lowered)
                if hi - self._next_row <= self._ceiling - lo:
                    self._next_row = max(self._next_row, -(-hi // 8) * 8)
                else:
                    self._ceiling = lo
            self.taken.append((lo, hi))
            if r.in_flight:  # marked used: the kernel ends waiting for it, and waits before it reads it
                self.flag(Flag.COPY)
            return r.region
        return None

    def vmem_free(self) -> int:
        return self._ceiling - self._next_row

    def flag(self, role: Flag, parity: int = 0) -> int:
        """The flag number of `role` (of tile parity `parity` for width-2 roles), marked used by this kernel."""
        if not 0 <= parity < FLAG_WIDTH.get(role, 1):
            raise ValueError(f"flag {role.name} has no parity {parity}")
        f = role + parity
        self._flags_used.add(f)
        return f

    def scratch_bytes(self, nbytes: int) -> tuple[Reg, int]:
        off = self.scratch[1] + self._scratch_used
        self._scratch_used += -(-nbytes // 64) * 64
        self.scratch_peak = max(self.scratch_peak, self._scratch_used)
        return self.argument(self.scratch[0]), off

    # ---- addresses and DMA --------------------------------------------------------------------------
    def argument(self, entry: int) -> Reg:
        """A register holding argument table entry `entry` (an HBM address), loaded at the kernel's start."""
        if entry not in self._args:
            row, lane = divmod(entry, self.lanes)
            group = row // 8 * 8
            v, s = self.b.vreg(), self.b.sreg()
            load = [MInstr("vld", v, (ZERO,), imm=self.args_row + group, mem=(Mem("args", group, group + 8),),
                           comment=f"argument {entry}"),
                    MInstr("vext", s, (v,), imm=(row - group) * self.lanes + lane)]
            entry_block = self.b.func.blocks[0]
            entry_block.instrs[2 * len(self._args):2 * len(self._args)] = load
            self._args[entry] = s
        return self._args[entry]

    def value(self, argument: int) -> Reg:
        """A register holding the value of graph argument `argument` (a runtime size), loaded at the kernel's
        start from its argument-table entry."""
        return self.argument(self.values[argument])

    def valid_count(self, argument: int, most: int, unit: int = 1) -> Reg:
        """A fresh register holding the value of `argument` (a dynamic-shape bucket's valid length) clamped to
        [1, most] (a bogus count never loops on nothing), times `unit` rows per unit of it."""
        b = self.b
        count = b.sreg()
        b.emit("max", count, (self.value(argument), b.const(1)))
        b.emit("min", count, (count, b.const(most)))
        if unit > 1:
            b.emit("mul", count, (count, b.const(unit)))
        return count

    def hbm_addr(self, view: View, element_offset: int) -> Reg:
        """A register holding the byte address of element `element_offset` of `view`'s buffer."""
        if view.buffer in self.hbm_base:
            base, off = self.hbm_base[view.buffer]
        else:
            entry, off = self.buffers[view.buffer]
            base = self.argument(entry)
        return self.b.offset_reg(base, off + element_offset * ESIZE[view.dtype])

    def dma(self, load: bool, dtype: str, hbm: Reg, region: Region, row: int, rows: int, cols: int,
            stride: int, flag: Flag, parity: int = 0, base: Reg = ZERO, rows_reg: Reg | None = None,
            in_flight: bool = False) -> None:
        """One 2-D DMA: `rows` x `cols` elements, HBM row stride `stride` elements, at vmem region row `row`
        (+ `base`, a loop register of vmem rows). Rows wider than the shape register's 16-bit column field
        (`large`: a 128256-entry logits row) move one row and one piece of whole vmem rows at a time.
        `rows_reg`: the row count at run time (at most `rows`). `in_flight`: the kernel does not end waiting
        for it (a later function waits on `flag`)."""
        b = self.b
        p = -(-cols // self.lanes)
        if rows > DMA_SHAPE_COLS_MASK:
            raise CapacityError(f"{self.kernel}: a DMA of {rows} rows (at most {DMA_SHAPE_COLS_MASK})")
        if cols > DMA_SHAPE_COLS_MASK:
            assert rows_reg is None  # a runtime row count moves rows that fit the column field
            piece = DMA_SHAPE_COLS_MASK // self.lanes * self.lanes
            for r in range(rows):
                for c0 in range(0, cols, piece):
                    at = b.offset_reg(hbm, (r * stride + c0) * ESIZE[dtype])
                    self.dma(load, dtype, at, region, row + r * p + c0 // self.lanes, 1, min(piece, cols - c0),
                             stride, flag, parity, base, in_flight=in_flight)
            return
        op = ("dma.ld" if load else "dma.st") + (".bf16" if dtype == "bf16" else "")
        shape = b.const(rows << DMA_SHAPE_ROWS_SHIFT | cols) if rows_reg is None else self.dma_shape(rows_reg, cols)
        vrow = b.const(region.row + row) if base == ZERO else b.offset_reg(*b.vmem_address(base, region.row + row))
        f = flag + parity if in_flight else self.flag(flag, parity)
        b.emit(op, None, (hbm, vrow, shape, b.const(stride)), flag=f,
               mem=(row_mem(region, base, row, rows * p, write=load),))

    def dma_shape(self, rows: Reg, cols: int) -> Reg:
        """A DMA shape register of `rows` (a register) x `cols`."""
        shifted = self.b.sreg()
        self.b.emit("shli", shifted, (rows,), imm=DMA_SHAPE_ROWS_SHIFT)
        return self.b.emit("or", self.b.sreg(), (shifted, self.b.const(cols)))


# ---- loops over vmem rows ----------------------------------------------------------------------------
def chunk_loop(b: Builder, count: int, body: Callable[[Reg], None], hint: str, start: Reg = ZERO,
               step: int = 8, ivs: dict[Reg, int] | None = None, wanted: Reg | None = None) -> None:
    """body(off) for off = start, start + step, ... (`count` times): one run inline, more as a counted loop
    whose offset register is an induction variable (`addi off, off, step` ends the body), which the back
    end software-pipelines. Callers unroll short runs themselves when constant addresses pay. `ivs`: other
    registers the body advances by the given step; `wanted`: the runs needed at run time, at most `count`
    (`Builder.counted_loop`)."""
    if count <= 0:
        return
    if count == 1:
        body(start)
        return
    off = b.sreg()
    b.emit("addi", off, (start,), imm=0)

    def step_body() -> None:
        body(off)
        b.emit("addi", off, (off,), imm=step)

    b.counted_loop(count, step_body, hint, {off: step, **(ivs or {})}, wanted)


def row_mem(region: Region, base: Reg, row: int, rows: int, write: bool = False) -> Mem:
    """The rows an access at `base + region.row + row` touches: exact for constant addresses, the whole
    region when the base is a loop register."""
    if base == ZERO:
        return region.mem(row, row + rows, write)
    return region.mem(0, region.rows, write)
