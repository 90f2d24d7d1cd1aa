"""VLIW list scheduling of one basic block, with latencies and slots read from `device_sim.isa`.

Before: a `Block` of `MInstr` in program order (virtual registers). After: a list of bundles (one list of
instructions per cycle) such that, with results landing at issue + latency and no interlocks:

- RAW: a read issues at or after its producer's landing;
- WAR: a redefinition lands strictly after every earlier read of the old value;
- WAW: redefinitions land in program order (never in the same cycle: that traps);
- memory: vmem accesses that overlap (per `Mem` rows) keep their order, a store visible before a later load;
- `wait fK` is a memory barrier: earlier memory instructions issue no later than it (commands on fK
  strictly before it), later ones no earlier;
- commands of one asynchronous unit (DMA, MXU) keep their order (their FIFOs are in order);
- the control instruction is last, and every result of the block lands by the time the next block
  issues, so blocks can be scheduled independently (loops included).
"""

from __future__ import annotations

import bisect
import heapq
from collections import defaultdict
from dataclasses import dataclass

from codegen.mir import MInstr, Reg
from device_sim import isa

SLOT_COUNT: dict[isa.Unit, int] = {u: len(s) for u, s in isa.SLOTS_OF_UNIT.items()}
UNIT_INDEX: dict[isa.Unit, int] = {u: j for j, u in enumerate(isa.Unit)}
# Register pressure above which the scheduler only adds instructions that free as many values as they make
PRESSURE_LIMIT = {"s": 20, "v": 24}


@dataclass
class Dep:
    pred: int
    succ: int
    distance: int  # t_succ >= t_pred + distance


def _is_memory(ins: MInstr) -> bool:
    return bool(ins.mem) or ins.is_async or ins.unit in (isa.Unit.VLOAD, isa.Unit.VSTORE)


class _RowMap:
    """The last writer and the readers since of every row of one memory region, as runs of rows that share
    them (a DMA touches thousands of rows: per-row bookkeeping made 29M dependences, 54K of them distinct, on
    one layer of the 1B model)."""

    def __init__(self) -> None:
        self.starts: list[int] = [0]  # run k covers rows [starts[k], starts[k + 1])
        self.writers: list[int | None] = [None]
        self.readers: list[list[int]] = [[]]

    def _split(self, row: int) -> int:
        """The index of the run starting at `row` (made by splitting the run holding it)."""
        k = bisect.bisect_right(self.starts, row) - 1
        if self.starts[k] == row:
            return k
        self.starts.insert(k + 1, row)
        self.writers.insert(k + 1, self.writers[k])
        self.readers.insert(k + 1, list(self.readers[k]))
        return k + 1

    def runs(self, lo: int, hi: int) -> range:
        """The runs covering exactly rows [lo, hi)."""
        first = self._split(lo)
        return range(first, self._split(hi))

    def write(self, lo: int, hi: int, b: int) -> None:
        k = self._split(lo)
        end = self._split(hi)
        self.starts[k:end], self.writers[k:end], self.readers[k:end] = [lo], [b], [[]]


def build_deps(instrs: list[MInstr]) -> list[Dep]:
    """All ordering constraints of a block (see the module docstring), as (pred, succ, distance), one per
    ordered pair (the largest distance)."""
    distance: dict[tuple[int, int], int] = {}

    def dep(a: int, b: int, d: int) -> None:
        if distance.get((a, b), d - 1) < d:
            distance[(a, b)] = d

    last_def: dict[Reg, int] = {}
    uses_since: dict[Reg, list[int]] = defaultdict(list)
    rows: dict[str, _RowMap] = defaultdict(_RowMap)
    mem_since_wait: list[int] = []
    last_wait: int | None = None
    last_async: dict[isa.Unit, int] = {}
    for b, ins in enumerate(instrs):
        lat_b = ins.latency
        for r in ins.uses:
            if r in last_def:
                a = last_def[r]
                dep(a, b, instrs[a].latency)
        if ins.dst is not None:
            r = ins.dst
            for a in uses_since[r]:
                if a != b:
                    dep(a, b, 1 - lat_b)
            if r in last_def:
                a = last_def[r]
                dep(a, b, instrs[a].latency - lat_b + 1)
        for r in ins.uses:
            uses_since[r].append(b)
        if ins.dst is not None:
            last_def[ins.dst] = b
            uses_since[ins.dst] = []
        # memory order through rows
        for m in ins.mem:
            assert m.hi is not None, f"{ins}: memory rows must be known"
            if m.hi <= m.lo:
                continue
            region = rows[m.region]
            runs = region.runs(m.lo, m.hi)
            writers = {region.writers[k] for k in runs} - {None, b}
            if m.write:
                for w in writers:
                    dep(w, b, 1)
                for a in {a for k in runs for a in region.readers[k]} - {b}:
                    dep(a, b, 1 if ins.is_async or instrs[a].is_async else 0)
                region.write(m.lo, m.hi, b)
            else:
                for w in writers:
                    dep(w, b, max(1, instrs[w].latency))  # type: ignore[index]
                for k in runs:
                    region.readers[k].append(b)
        if ins.is_async:
            prev = last_async.get(ins.unit)
            if prev is not None:
                dep(prev, b, 1)
            last_async[ins.unit] = b
        if ins.op == "wait":
            for a in mem_since_wait:
                same_flag = instrs[a].is_async and instrs[a].flag == ins.flag
                dep(a, b, 1 if same_flag else 0)
            if last_wait is not None:
                dep(last_wait, b, 1)
            mem_since_wait, last_wait = [], b
        elif _is_memory(ins):
            if last_wait is not None:
                dep(last_wait, b, 0)
            mem_since_wait.append(b)
    # the control instruction closes the block
    if instrs and instrs[-1].is_control:
        t = len(instrs) - 1
        for a in range(t):
            dep(a, t, max(0, instrs[a].latency - 1))
    return [Dep(a, b, d) for (a, b), d in distance.items()]


def schedule_block(instrs: list[MInstr]) -> list[list[MInstr]]:
    """List-schedule a block into bundles (critical-path priority, program order to break ties).

    Two rounds: the second releases instructions without predecessors (constants: li, vbcast, viota) and
    spill reloads only a few cycles before their first consumer issued in the first round (a reload chain
    from its end backwards), so they do not sit in registers: a reload issued early would be as long-lived
    as the value it replaces, and the allocator would spill it again."""
    if not instrs:
        return []
    deps = build_deps(instrs)
    first, times = _list_schedule(instrs, deps, [0] * len(instrs))
    has_pred = {d.succ for d in deps}
    late = [i not in has_pred or instrs[i].reload for i in range(len(instrs))]
    succs: dict[int, list[Dep]] = defaultdict(list)
    for d in deps:
        succs[d.pred].append(d)
    release = [0] * len(instrs)
    for i in reversed(range(len(instrs))):  # successors come later in program order: their release is known
        if late[i] and succs[i]:
            release[i] = max(0, min((release[d.succ] if late[d.succ] and succs[d.succ] else times[d.succ])
                                    - d.distance - 2 for d in succs[i]))
    second, _ = _list_schedule(instrs, deps, release)
    return second if len(second) <= len(first) + len(first) // 8 + 2 else first


def _list_schedule(instrs: list[MInstr], deps: list[Dep], release: list[int]) -> tuple[list[list[MInstr]],
                                                                                     list[int]]:
    n = len(instrs)
    preds: list[list[Dep]] = [[] for _ in range(n)]
    succs: list[list[Dep]] = [[] for _ in range(n)]
    for d in deps:
        preds[d.succ].append(d)
        succs[d.pred].append(d)
    height = [0] * n
    for i in reversed(range(n)):
        h = max(1, instrs[i].latency)
        for d in succs[i]:
            h = max(h, d.distance + height[d.succ])
        height[i] = h
    control = n - 1 if instrs[-1].is_control else None
    waiting = [len(p) for p in preds]
    earliest = list(release)
    time: list[int | None] = [None] * n
    ready = [i for i in range(n) if waiting[i] == 0]
    # registers as small integers (hashing Reg dataclasses dominated scheduling time): per instruction its
    # distinct uses with their counts, its destination (-1: none)
    ids: dict[Reg, int] = {}
    regs: list[Reg] = []

    def reg_id(r: Reg) -> int:
        if r not in ids:
            ids[r] = len(regs)
            regs.append(r)
        return ids[r]

    uses = [tuple((reg_id(r), ins.uses.count(r)) for r in dict.fromkeys(ins.uses)) for ins in instrs]
    dsts = [-1 if ins.dst is None else reg_id(ins.dst) for ins in instrs]
    kind_of = [r.kind for r in regs]
    phys = [r.phys for r in regs]
    remaining = [0] * len(regs)
    for u in uses:
        for r, count in u:
            remaining[r] += count
    counted = [False] * len(regs)
    live_regs: dict[str, set[int]] = defaultdict(set)  # the counted values, by kind
    readers: list[set[int]] = [set() for _ in regs]  # per value, the instructions left that read it
    for i, u in enumerate(uses):
        for r, _ in u:
            readers[r].add(i)
    candidate = [False] * n  # ready, or on its way (`pending`)

    def dying(i: int) -> list[int]:
        return [r for r, count in uses[i] if counted[r] and remaining[r] == count]

    def growth(i: int, kind: str) -> int:
        dst = dsts[i]
        grow = 1 if dst >= 0 and kind_of[dst] == kind and remaining[dst] > 0 and not counted[dst] else 0
        for r, count in uses[i]:  # `dying`, inline: asked of every candidate under pressure
            if counted[r] and remaining[r] == count and kind_of[r] == kind:
                grow -= 1
        return grow

    def _reads_live(i: int, kind: str) -> bool:
        """Whether `i` works on a live value of `kind` that is near its end (at most 2 reads left): it
        continues a short chain. (A read of a long-lived base address does not count.)"""
        return any(kind_of[r] == kind and counted[r] and remaining[r] <= 2 for r, _ in uses[i])

    def commit(i: int) -> None:
        for r in dying(i):
            counted[r] = False
            live_regs[kind_of[r]].discard(r)
        for r, count in uses[i]:
            remaining[r] -= count
            readers[r].discard(i)
        dst = dsts[i]
        if dst >= 0 and not phys[dst] and remaining[dst] > 0 and not counted[dst]:
            counted[dst] = True
            live_regs[kind_of[dst]].add(dst)

    def pressure(found: dict[tuple[str, str], bool], what: str, kind: str) -> bool:
        """Whether a candidate (ready, or on its way) frees a live value of `kind` ("frees") or continues a
        chain of it ("continues"). Asked of the live values' last readers, not of every candidate: a value
        is freed by its only reader left and continued by one of its last two (a scan of the candidates
        was 90% of the 1B decode graph's compile)."""
        if (what, kind) not in found:
            if what == "frees":
                found[what, kind] = any(len(readers[r]) == 1 and candidate[i] and growth(i, kind) < 0
                                        for r in live_regs[kind] for i in readers[r])
            else:
                found[what, kind] = any(remaining[r] <= 2 and any(candidate[i] for i in readers[r])
                                        for r in live_regs[kind])
        return found[what, kind]

    # Ready instructions whose earliest cycle has come, per unit (the only ones a cycle looks at), and the
    # others in a heap by earliest cycle. A cycle visits candidates in priority order across units (a merge
    # of the per-unit lists) and drops a unit once its slots are full: the same decisions as one scan of
    # every ready instruction in priority order, without rescanning the ones that cannot issue.
    prio = [(-height[i], i) for i in range(n)]
    # units as small integers (hashing the enum was a tenth of scheduling time)
    units = [UNIT_INDEX[ins.unit] for ins in instrs]
    slot_count = [SLOT_COUNT.get(u, 0) for u in isa.Unit]
    by_unit: dict[int, list[int]] = defaultdict(list)
    pending: list[tuple[int, int]] = []

    def make_ready(i: int, cycle: int) -> None:
        candidate[i] = True
        if earliest[i] > cycle:
            heapq.heappush(pending, (earliest[i], i))
        else:
            by_unit[units[i]].append(i)

    for i in ready:
        make_ready(i, 0)
    bundles: list[list[MInstr]] = []
    placed = 0
    cycle = 0
    while placed < n:
        # the last cycle placed nothing and nothing was on its way: this one would repeat it
        stuck = bool(bundles) and not bundles[-1] and not pending
        while pending and pending[0][0] <= cycle:
            i = heapq.heappop(pending)[1]
            by_unit[units[i]].append(i)
        used = [0] * len(UNIT_INDEX)
        bundle: list[MInstr] = []
        heap = []
        for u, lst in by_unit.items():
            if lst:
                lst.sort(key=prio.__getitem__)
                heap.append((prio[lst[0]], u, 0))
        heapq.heapify(heap)
        # Under pressure (live values of a kind at its limit) a new value of that kind waits while an
        # instruction that frees one is ready or on its way (it comes within a latency: the wait is
        # bounded); a value that starts a new chain (reads no live value of its kind, e.g. a load) also
        # waits while one that continues a chain (`_reads_live`) can go, so chains finish before new ones
        # start.
        # (both asked only while nothing is placed this cycle, so they see the cycle's start, and found once
        # a cycle: a scan of every candidate in every cycle made big blocks quadratic)
        # Waits can block each other across kinds (a spill's vbcast frees a scalar but needs a vector register,
        # and what frees one needs a scalar): a cycle that would repeat an empty one places regardless.
        found: dict[tuple[str, str], bool] = {}
        now = []
        while heap:
            _, unit, j = heapq.heappop(heap)
            lst = by_unit[unit]
            i = lst[j]
            if j + 1 < len(lst):
                heapq.heappush(heap, (prio[lst[j + 1]], unit, j + 1))
            if i == control and placed < n - 1:
                continue
            if used[unit] >= slot_count[unit]:
                continue
            dst = instrs[i].dst
            if (not stuck and dst is not None and len(live_regs[dst.kind]) >= PRESSURE_LIMIT[dst.kind]
                    and growth(i, dst.kind) > 0
                    and (now or pressure(found, "frees", dst.kind)
                         or (not _reads_live(i, dst.kind) and pressure(found, "continues", dst.kind)))):
                continue  # under pressure: at most one new value per cycle (see above)
            used[unit] += 1
            now.append(i)
            commit(i)
            if used[unit] >= slot_count[unit]:  # nothing more of this unit this cycle
                heap = [h for h in heap if h[1] != unit]
                heapq.heapify(heap)
        if now:
            placed_now = set(now)
            for u in {units[i] for i in now}:
                by_unit[u] = [i for i in by_unit[u] if i not in placed_now]
        for i in now:
            time[i] = cycle
            candidate[i] = False
            bundle.append(instrs[i])
            placed += 1
        # successors become ready once every predecessor is placed; distance <= 0 may share this cycle
        for i in now:
            for d in succs[i]:
                earliest[d.succ] = max(earliest[d.succ], cycle + d.distance)
                waiting[d.succ] -= 1
                if waiting[d.succ] == 0:
                    make_ready(d.succ, cycle + 1)
        bundles.append(bundle)
        cycle += 1
    # without a control instruction, pad so every result lands before the next block
    if control is None:
        land = max(t + max(0, instrs[i].latency) for i, t in enumerate(time) if t is not None)
        # a result with latency L issued at t is visible at t + L; the next block starts at len(bundles)
        while len(bundles) < land:
            bundles.append([])
    return bundles, [t if t is not None else 0 for t in time]
