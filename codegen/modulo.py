"""Software pipelining of single-block counted loops by modulo scheduling.

`pipeline_loops(func, next_id)`. Before: counted-loop blocks (`Block.loop`: a body, then `addi counter, -1 ;
bnz counter`, trip count n known) in a function of unscheduled blocks. After: each loop that qualifies (no
asynchronous, wait or control instruction in its body; at least S - 1 + u iterations) is replaced by

    [peel]      r = (n - S + 1) % u plain iterations (list-scheduled later), so the kernel count is whole;
    prologue    the first S - 1 stages of the flat schedule (pre-scheduled bundles);
    kernel      u * II bundles: u consecutive iterations' worth of every stage, `addi counter ; bnz` in its
                last bundle (the counter starts at K - 1: the branch reads it before the decrement lands);
    epilogue    the last stages, padded until every result has landed (so the exit block is independent);

where the flat schedule gives every body instruction an issue time t (iteration i issues it at t + i * II).
II starts at the resource bound max_unit ceil(ops / slots) (the counter's addi and the branch included) and
grows until every dependence fits: intra-iteration t_b >= t_a + d, loop-carried t_b + II >= t_a + d (from
`schedule.build_deps` on two copies of the body). Modulo variable expansion: a value whose lifetime exceeds
II gets u names (u = the largest number of overlapping lifetimes), used by iteration i as name i % u.
Induction registers (`addi r, r, step` and otherwise only vmem base operands) are not ordered against their
memory uses: the use's immediate is corrected by step times the number of increments it sees early or late.

A loop whose slots bound its II at a fraction (3 scalar ops on 2 slots: 1.5 bundles an iteration, an II of 2)
is first widened: its body becomes w consecutive iterations (`_widened`: values renamed per copy, each
induction register advanced once by w steps), so an II of 3 runs two iterations. It is kept only when its
schedule beats every II the original could reach, the trip count is a static multiple of w, and its slots
alone save MIN_WIDENING_GAIN cycles over the loop (a try is one more schedule).

`verify_pipelined` re-checks the generated code against the body's sequential semantics on a trace of the
whole pipelined loop: every read sees the producer of the sequential order, addresses match, vmem accesses
keep their order, every value lands before the loop's exit, and bundles respect slot counts.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from codegen.mir import ZERO, Block, Function, Mem, MInstr, Reg
from codegen.regalloc import SPILL_REGION, spill_rows
from codegen.schedule import SLOT_COUNT, build_deps
from device_sim import isa

MAX_II_SLACK = 48  # give up pipelining a loop whose II would exceed the resource bound by this much
MEMORY_BASE_OPS = ("vld", "vld.row", "vst")
# registers a pipelined kernel may keep live (the rest: values live around the loop, the allocator's slack)
REGISTER_BUDGET = {"v": 28, "s": 20}
POOL_SLOTS = 16  # spill slots a loop's constant pool may take; the register allocator keeps the others
MAX_WIDTH = 4  # the most iterations a widened body holds
MIN_WIDENING_GAIN = 32  # cycles a widened body must save by its slots before it is scheduled (compile time)


@dataclass
class ModuloSchedule:
    ii: int
    times: list[int]  # issue time of body instruction k in iteration 0
    stages: int
    unroll: int
    copies: dict[Reg, int]  # renameable value -> how many names it needs (a divisor of unroll)
    ivs: dict[Reg, tuple[int, int]]  # induction register -> (index of its addi, step)


@dataclass
class Instance:
    ins: MInstr  # as emitted: renamed registers, corrected immediate
    time: int  # cycle from the start of the pipelined code
    op: int  # index of the body instruction
    iteration: int


def _ivs(body: list[MInstr]) -> dict[Reg, tuple[int, int]]:
    """Induction registers: defined once, by `addi r, r, step`, read otherwise only as vmem bases."""
    out = {}
    defs = Counter(i.dst for i in body if i.dst is not None)
    for k, ins in enumerate(body):
        r = ins.dst
        if ins.op != "addi" or r is None or r.phys or ins.uses != (r,) or defs[r] != 1:
            continue
        ok = all(u != r or (i is ins) or (i.op in MEMORY_BASE_OPS and i.uses[-1] == r and r not in i.uses[:-1])
                 for i in body for u in i.uses)
        if ok:
            out[r] = (k, int(ins.imm or 0))
    return out


def _renameable(body: list[MInstr], used_elsewhere: set[Reg], ivs: dict[Reg, tuple[int, int]]) -> set[Reg]:
    """Values defined once per iteration and read only later in the same iteration."""
    defs = Counter(i.dst for i in body if i.dst is not None)
    seen: set[Reg] = set()
    exposed: set[Reg] = set()
    for ins in body:
        exposed |= {r for r in ins.uses if r not in seen}
        if ins.dst is not None:
            seen.add(ins.dst)
    return {r for r, n in defs.items() if n == 1 and not r.phys and r not in exposed and r not in used_elsewhere
            and r not in ivs}


def _dependences(body: list[MInstr], ivs: dict[Reg, tuple[int, int]], renamed: set[Reg]
                 ) -> list[tuple[int, int, int, int]]:
    """(pred, succ, distance, iterations apart) over the body: two copies through `build_deps`, with
    induction bases hidden (their immediates are corrected instead) and renamed values private to a copy."""
    fresh = {r: Reg(r.kind, -1 - k) for k, r in enumerate(sorted(renamed, key=lambda r: r.n))}

    def copy(ins: MInstr, rename: bool) -> MInstr:
        uses = list(ins.uses)
        if ins.op in MEMORY_BASE_OPS and uses[-1] in ivs:
            uses[-1] = ZERO
        m = (lambda r: fresh.get(r, r)) if rename else (lambda r: r)
        return dataclasses.replace(ins, dst=m(ins.dst) if ins.dst else None, uses=tuple(m(r) for r in uses))

    n = len(body)
    both = [copy(i, False) for i in body] + [copy(i, True) for i in body]
    out = []
    for d in build_deps(both):
        if d.pred < n:
            out.append((d.pred, d.succ % n, d.distance, 0 if d.succ < n else 1))
    return out


def modulo_schedule(body: list[MInstr], used_elsewhere: set[Reg], budget: dict[str, int] | None = None
                    ) -> ModuloSchedule | None:
    """Iterative modulo scheduling in program order (a topological order of the intra-iteration deps): the
    smallest II from the resource bound up whose schedule fits the slots, the dependences and the register
    budget (a larger II overlaps fewer iterations, so fewer values are live at once)."""
    ivs = _ivs(body)
    renameable = _renameable(body, used_elsewhere, ivs)
    deps = _dependences(body, ivs, renameable)
    preds: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    succs: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for p, s, d, it in deps:
        preds[s].append((p, d, it))
        succs[p].append((s, d, it))
    mii = _resource_ii(body)
    sched = None
    for ii in range(mii, mii + MAX_II_SLACK):
        sched = _try_ii(body, ii, preds, succs, ivs, renameable)
        if sched is None:
            continue
        if all(max_live(body, sched, kind) <= limit for kind, limit in (budget or REGISTER_BUDGET).items()):
            return sched
        if sched.stages == 1:
            break  # a larger II overlaps nothing more
    return sched


def _try_ii(body: list[MInstr], ii: int, preds: dict[int, list[tuple[int, int, int]]],
            succs: dict[int, list[tuple[int, int, int]]], ivs: dict[Reg, tuple[int, int]],
            renameable: set[Reg]) -> ModuloSchedule | None:
    placed = _place(body, ii, preds, succs)
    if placed is None:
        return None
    times, mrt = placed
    _sink_loads(body, times, mrt, ii, preds, succs, ivs)
    length = max(t + 1 for t in times)
    stages = -(-length // ii)
    need: dict[Reg, int] = {}
    last = _last_uses(body, times)
    for k, ins in enumerate(body):
        if ins.dst in renameable:
            need[ins.dst] = max(1, (max(last.get(ins.dst, times[k]), times[k]) - times[k] - ins.latency) // ii + 1)
    unroll = max(need.values(), default=1)
    copies = {r: next(d for d in range(q, unroll + 1) if unroll % d == 0) for r, q in need.items()}
    return ModuloSchedule(ii, times, stages, unroll, copies, ivs)


def _last_use(body: list[MInstr], times: list[int], r: Reg, default: int) -> int:
    return max([times[k] for k, ins in enumerate(body) if r in ins.uses] + [default])


def _last_uses(body: list[MInstr], times: list[int]) -> dict[Reg, int]:
    """The latest issue time of a read of each register (`_last_use` of every register at once)."""
    last: dict[Reg, int] = {}
    for k, ins in enumerate(body):
        for r in ins.uses:
            if times[k] > last.get(r, times[k] - 1):
                last[r] = times[k]
    return last


def _sink_loads(body: list[MInstr], times: list[int], mrt: Counter[tuple[isa.Unit, int]], ii: int,
                preds: dict[int, list[tuple[int, int, int]]], succs: dict[int, list[tuple[int, int, int]]],
                ivs: dict[Reg, tuple[int, int]]) -> None:
    """Move instructions that read nothing computed in the body (loads through induction bases, constants)
    as late as their consumers allow: program-order placement issues them early, and every cycle a value
    waits costs a register across the pipelined iterations."""
    defined = {i.dst for i in body if i.dst is not None}
    for k in reversed(range(len(body))):
        ins = body[k]
        if ins.dst is None or any(r in defined and r not in ivs for r in ins.uses) or ins.dst in ivs:
            continue
        late = min((times[s] - d + ii * it for s, d, it in succs[k] if s != k), default=None)
        if late is None or late <= times[k]:
            continue
        early = max([times[p] + d - ii * it for p, d, it in preds[k] if p != k] + [times[k]])
        mrt[(ins.unit, times[k] % ii)] -= 1
        for t in range(late, early - 1, -1):
            if mrt[(ins.unit, t % ii)] < SLOT_COUNT[ins.unit]:
                times[k] = t
                break
        mrt[(ins.unit, times[k] % ii)] += 1


def max_live(body: list[MInstr], sched: ModuloSchedule, kind: str) -> int:
    """Registers of one class the pipelined kernel needs at once: the names of values defined in the body
    (each live from issue to the later of landing and last read) plus values read but defined outside."""
    ii = sched.ii
    cover = [0] * ii
    defined = {i.dst for i in body if i.dst is not None}
    last = _last_uses(body, sched.times)
    for k, ins in enumerate(body):
        r = ins.dst
        if r is None or r.kind != kind or r.phys:
            continue
        if r not in sched.copies:  # loop-carried: one register for the whole loop
            cover = [c + 1 for c in cover]
            continue
        end = max(last.get(r, 0), 0, sched.times[k] + ins.latency)
        for t in range(sched.times[k], end + 1):
            cover[t % ii] += 1
    outside = {r for i in body for r in i.uses if r.kind == kind and not r.phys and r not in defined}
    return max(cover) + len(outside)


def _place(body: list[MInstr], ii: int, preds: dict[int, list[tuple[int, int, int]]],
           succs: dict[int, list[tuple[int, int, int]]]) -> tuple[list[int], Counter[tuple[isa.Unit, int]]] | None:
    mrt: Counter[tuple[isa.Unit, int]] = Counter()
    mrt[(isa.Unit.SCALAR, ii - 1)] += 1  # counter decrement and branch sit in the kernel's last bundle
    mrt[(isa.Unit.CTRL, ii - 1)] += 1
    times: list[int | None] = [None] * len(body)
    for k, ins in enumerate(body):
        early, late = 0, 1 << 30
        for p, d, it in preds[k]:
            tp = times[p]
            if tp is not None:
                early = max(early, tp + d - ii * it)
        for s, d, it in succs[k]:
            ts = times[s]
            if ts is not None and s != k:
                late = min(late, ts - d + ii * it)
        for p, d, it in preds[k]:
            if p == k and d > ii * it:
                return None  # a recurrence on itself longer than II
        for t in range(early, min(late, early + ii - 1) + 1):
            if mrt[(ins.unit, t % ii)] < SLOT_COUNT[ins.unit]:
                mrt[(ins.unit, t % ii)] += 1
                times[k] = t
                break
        else:
            return None
    return [t if t is not None else 0 for t in times], mrt


def _corrected(ins: MInstr, k: int, sched: ModuloSchedule, iteration: int, iterations: int) -> MInstr:
    """Body instruction k of `iteration`, its vmem base immediate corrected for the increments of its
    induction register that have landed when it issues (the pipelined order) instead of the sequential
    count. In the epilogue fewer have landed: there are no increments past the last iteration."""
    if ins.op not in MEMORY_BASE_OPS or ins.uses[-1] not in sched.ivs:
        return ins
    a_index, step = sched.ivs[ins.uses[-1]]
    ahead = (sched.times[k] - sched.times[a_index] - 1) // sched.ii + 1
    assert ahead >= 0, "an induction base read before its first increment could land"
    seen = min(iterations, iteration + ahead)
    intended = iteration + (1 if a_index < k else 0)
    return dataclasses.replace(ins, imm=int(ins.imm or 0) + step * (intended - seen))


@dataclass
class PipelinedLoop:
    """What `verify_pipelined` needs: the body, its schedule, and the generated instances."""

    label: str
    body: list[MInstr]
    sched: ModuloSchedule
    prologue: list[Instance]
    kernel: list[Instance]
    epilogue: list[Instance]
    kernel_runs: int
    epilogue_len: int
    blocks: tuple[str, ...] = ()  # labels of the generated blocks


def expand(body: list[MInstr], sched: ModuloSchedule, iterations: int, kernel_runs: int,
           fresh: Callable[[str], Reg]) -> tuple[list[Instance], list[Instance], list[Instance], int]:
    """Instances of the prologue, one kernel run and the epilogue (times relative to each block), and the
    epilogue's length (until every result has landed). `iterations` = S - 1 + u * kernel_runs."""
    ii, u, S = sched.ii, sched.unroll, sched.stages
    names = {r: [r, *[fresh(r.kind) for _ in range(1, q)]] for r, q in sched.copies.items() if q > 1}

    def inst(k: int, i: int, base: int) -> Instance:
        ins = _corrected(body[k], k, sched, i, iterations)

        def m(r: Reg) -> Reg:
            return names[r][i % len(names[r])] if r in names else r
        ins = dataclasses.replace(ins, dst=m(ins.dst) if ins.dst else None, uses=tuple(m(r) for r in ins.uses))
        return Instance(ins, sched.times[k] + i * ii - base, k, i)

    pro_end, ker_end = (S - 1) * ii, (S - 1 + u) * ii
    epi_start = (S - 1 + u * kernel_runs) * ii
    pro, ker, epi = [], [], []
    for i in range(iterations):
        for k in range(len(body)):
            t = sched.times[k] + i * ii
            if t < pro_end:
                pro.append(inst(k, i, 0))
            elif t < ker_end:
                ker.append(inst(k, i, pro_end))
            elif t >= epi_start:
                epi.append(inst(k, i, epi_start))
    epi_len = max([x.time + max(x.ins.latency, 1) for x in epi]
                  + [x.time + max(x.ins.latency, 1) - u * ii for x in ker] + [0])
    return pro, ker, epi, epi_len


def _bundles(instances: list[Instance], length: int) -> list[list[MInstr]]:
    out: list[list[MInstr]] = [[] for _ in range(length)]
    for x in instances:
        out[x.time].append(x.ins)
    return out


def pipeline_loop(func: Function, index: int, log: list[str], fresh: Callable[[str], Reg],
                  budget: dict[str, int] | None = None, uses: Counter[Reg] | None = None, compact: bool = False
                  ) -> PipelinedLoop | None:
    """Replace the counted loop at `func.blocks[index]` by peel / prologue / kernel / epilogue blocks.
    `uses` (optional) counts the register reads of every block of `func`; it is kept up to date here, so a
    caller pipelining many loops does not rescan the whole function for each."""
    loop = func.blocks[index]
    assert loop.loop is not None
    n, counter = loop.loop.trip_count, loop.loop.counter
    body = loop.instrs[:-2]
    if not _schedulable(body, counter):
        log.append(f"{loop.label}: not pipelined (asynchronous, wait or control instruction in the body)")
        return None
    pre = func.blocks[index - 1]
    init = _counter_init(pre, counter)
    if len(init) != 1:
        log.append(f"{loop.label}: not pipelined (no counter initialization in the preheader)")
        return None
    if uses is None:
        used_elsewhere = {r for b in func.blocks if b is not loop for i in b.instrs for r in i.uses}
    else:  # only the loop's own registers are ever asked about
        used_elsewhere = _read_outside(loop.instrs, uses)
    budget = budget or REGISTER_BUDGET
    sched = modulo_schedule(body, used_elsewhere, budget)
    if uses is not None:
        body, sched = _constants_placed(func, loop, pre, body, sched, uses, budget, log, fresh, compact)
    if sched is None:
        log.append(f"{loop.label}: not pipelined (no II within the slack)")
        return None
    S, u, ii = sched.stages, sched.unroll, sched.ii
    live = {kind: max_live(body, sched, kind) for kind in budget}
    if any(n_live > budget[kind] for kind, n_live in live.items()):
        log.append(f"{loop.label}: not pipelined (II={ii}: {live} registers live > budget {budget})")
        return None
    if n < S - 1 + u:
        log.append(f"{loop.label}: not pipelined ({n} iterations < {S - 1 + u} stages + copies)")
        return None
    peel = (n - S + 1) % u
    runs = (n - peel - S + 1) // u
    divide = None  # x // u for the runtime trip count: a shift, else a multiplicative reciprocal (s, m)
    if loop.loop.wanted is not None and u & (u - 1):
        divide = _reciprocal(u, runs * u + u)
        if divide is None:
            log.append(f"{loop.label}: not pipelined (no reciprocal of {u} for its runtime trip count)")
            return None
    pro, ker, epi, epi_len = expand(body, sched, S - 1 + u * runs, runs, fresh)
    init[0].imm = runs - 1
    if loop.loop.wanted is not None:  # the same code with fewer kernel runs (its steady state repeats each run)
        clamp = next(i for i, ins in enumerate(pre.instrs) if ins.op == "min" and ins.dst == counter)
        start = _runtime_runs(counter, loop.loop.wanted, n - runs * u, u, runs, divide, fresh)
        if uses is not None:
            uses.subtract(pre.instrs[clamp].uses)
            uses.update(r for ins in start for r in ins.uses)
        pre.instrs[clamp:clamp + 1] = start
    blocks: list[Block] = []
    if peel:
        blocks.append(Block(f"{loop.label}_peel", [dataclasses.replace(i) for _ in range(peel) for i in body]))
    kernel = Block(f"{loop.label}_kernel")
    kernel_bundles = _bundles(ker, u * ii)
    kernel_bundles[-1] += [MInstr("addi", counter, (counter,), imm=-1),
                           MInstr("bnz", None, (counter,), target=kernel.label)]
    for blk, bundles in ((Block(f"{loop.label}_prologue"), _bundles(pro, (S - 1) * ii)), (kernel, kernel_bundles),
                         (Block(f"{loop.label}_epilogue"), _bundles(epi, epi_len))):
        blk.bundles = bundles
        blk.instrs = [i for b in bundles for i in b]
        blocks.append(blk)
    blocks[0].label = loop.label
    func.blocks[index:index + 1] = blocks
    if uses is not None:
        uses.subtract(r for i in loop.instrs for r in i.uses)
        uses.update(r for blk in blocks for i in blk.instrs for r in i.uses)
    log.append(f"{loop.label}: pipelined, II={ii} stages={S} copies={u} peel={peel} kernel runs={runs} "
               f"(body {len(body)} instructions)")
    return PipelinedLoop(loop.label, body, sched, pro, ker, epi, runs, epi_len, tuple(b.label for b in blocks))


def _runtime_runs(counter: Reg, wanted: Reg, fixed: int, u: int, runs: int, divide: tuple[int, int] | None,
                  fresh: Callable[[str], Reg]) -> list[MInstr]:
    """`counter` = the kernel runs that cover `wanted` iterations, less one (its start): ceil((wanted -
    fixed) / u) clamped to [1, runs], where `fixed` = peel + S - 1 iterations run outside the kernel; the
    division a shift (u a power of two), else (x * m) >> s with `divide` = (s, m) (`_reciprocal`)."""
    x, q, low, high = fresh("s"), fresh("s"), fresh("s"), fresh("s")
    code = [MInstr("addi", x, (wanted,), imm=u - 1 - fixed), MInstr("li", low, imm=u),
            MInstr("max", x, (x, low))]  # x / u >= 1
    if divide is None:
        code.append(MInstr("srai", q, (x,), imm=u.bit_length() - 1))
    else:
        s, m = divide
        magic = fresh("s")
        code += [MInstr("li", magic, imm=m), MInstr("mul", q, (x, magic)), MInstr("srai", q, (q,), imm=s)]
    return [*code, MInstr("li", high, imm=runs), MInstr("min", q, (q, high)), MInstr("addi", counter, (q,), imm=-1)]


def _reciprocal(u: int, most: int) -> tuple[int, int] | None:
    """(s, m) with (x * m) >> s == x // u for 0 <= x <= most, m within li's immediate and x * m in 31 bits."""
    for s in range(1, 31):
        m = -(-(1 << s) // u)
        if m >= 1 << 18 or most * m >= 1 << 31:
            break
        if all((x * m) >> s == x // u for x in range(most + 1)):
            return s, m
    return None


def _resource_ii(body: list[MInstr], width: int = 1) -> int:
    """The II the slots allow (the kernel's counter decrement and branch included); `width`: of the body
    widened to that many iterations (`_widened`: every instruction that many times but the induction
    increments, once)."""
    ivs = _ivs(body) if width > 1 else {}
    units = Counter(i.unit for i in body for _ in range(1 if i.dst in ivs else width))
    units[isa.Unit.SCALAR] += 1  # the kernel's counter decrement
    units[isa.Unit.CTRL] += 1  # its branch
    return max(-(-c // SLOT_COUNT[u]) for u, c in units.items())


def _schedulable(body: list[MInstr], counter: Reg) -> bool:
    """Whether a loop body may be modulo scheduled: no asynchronous, wait or control instruction, and no
    use of the loop's counter."""
    return not any(i.is_async or i.is_control or i.op == "wait" or counter in i.regs() for i in body)


def _counter_init(pre: Block, counter: Reg) -> list[MInstr]:
    """The preheader's `li` instructions of the loop's counter (one where the loop qualifies)."""
    return [i for i in pre.instrs if i.op == "li" and i.dst == counter]


def _widened(body: list[MInstr], width: int, fresh: Callable[[str], Reg]) -> list[MInstr]:
    """`width` consecutive iterations of `body` as one body. Copy j defines fresh registers and reads copy
    j - 1's (copy 0 reads the original names: the previous run's last copy); the last copy keeps the original
    names, so what the loop carries or leaves behind is where it was. An induction register is advanced once,
    by `width` steps, where the last copy advanced it; a vmem base it serves gets the steps the original would
    have taken by then as an immediate."""
    ivs = _ivs(body)
    out: list[MInstr] = []
    current: dict[Reg, Reg] = {}
    for j in range(width):
        last = j == width - 1
        for k, ins in enumerate(body):
            if ins.dst in ivs:
                if last:
                    out.append(dataclasses.replace(ins, imm=ivs[ins.dst][1] * width))
                continue
            imm = ins.imm
            if ins.op in MEMORY_BASE_OPS and ins.uses[-1] in ivs:
                at, step = ivs[ins.uses[-1]]
                taken = j + (at < k)  # the increments the original order has applied
                landed = width if last and at < k else 0  # the widened increment's, by then
                imm = int(imm or 0) + step * (taken - landed)
            operands = tuple(current.get(r, r) for r in ins.uses)
            dst = ins.dst
            if dst is not None and not dst.phys:
                current[dst] = dst if last else fresh(dst.kind)
                dst = current[dst]
            out.append(dataclasses.replace(ins, dst=dst, uses=operands, imm=imm))
    return out


def _widen(func: Function, index: int, uses: Counter[Reg], budget: dict[str, int], fresh: Callable[[str], Reg],
           log: list[str]) -> None:
    """Widen the counted loop at `func.blocks[index]` in place when its slots bound it at a fraction of a
    bundle and a widened body pipelines faster per iteration than any II the original could reach."""
    loop = func.blocks[index]
    assert loop.loop is not None
    n, counter = loop.loop.trip_count, loop.loop.counter
    body = loop.instrs[:-2]
    if loop.loop.wanted is not None or not _schedulable(body, counter):
        return
    init = _counter_init(func.blocks[index - 1], counter)
    best = _resource_ii(body)
    slots = {w: _resource_ii(body, w) for w in range(2, MAX_WIDTH + 1) if n % w == 0}
    width = min((w for w, ii in slots.items() if (best - ii / w) * n >= MIN_WIDENING_GAIN),
                key=lambda w: (slots[w] / w, w), default=None)
    if width is None or len(init) != 1:
        return
    wide = _widened(body, width, fresh)
    sched = modulo_schedule(wide, _read_outside(loop.instrs, uses), budget)
    if sched is None or sched.ii >= best * width or n // width < sched.stages - 1 + sched.unroll or \
            any(max_live(wide, sched, kind) > limit for kind, limit in budget.items()):
        return
    init[0].imm = n // width
    uses.subtract(r for i in body for r in i.uses)
    uses.update(r for i in wide for r in i.uses)
    loop.instrs = wide + loop.instrs[-2:]
    loop.loop = dataclasses.replace(loop.loop, trip_count=n // width)
    log.append(f"{loop.label}: widened to {width} iterations a body (slots: II {best} an iteration -> "
               f"{sched.ii} for {width})")


def _read_outside(instrs: list[MInstr], uses: Counter[Reg]) -> set[Reg]:
    """The registers of `instrs` that other instructions read too (`uses`: the function's reads)."""
    here = Counter(r for i in instrs for r in i.uses)
    return {r for i in instrs for r in i.regs() if uses[r] > here[r]}


@dataclass
class _Placement:
    """Where a loop's invariant values live: a body, its schedule, the change to the code it needs, and the
    instructions that change adds to the preheader."""

    body: list[MInstr]
    sched: ModuloSchedule
    apply: Callable[[], None]
    note: str
    preheader: list[MInstr] = dataclasses.field(default_factory=list)


def _constants_placed(func: Function, loop: Block, pre: Block, body: list[MInstr], sched: ModuloSchedule | None,
                      uses: Counter[Reg], budget: dict[str, int], log: list[str], fresh: Callable[[str], Reg],
                      compact: bool = False) -> tuple[list[MInstr], ModuloSchedule | None]:
    """(body, schedule) of the loop with its invariant values where they run it in the fewest cycles: as
    given (hoisted into registers, which the whole loop holds), back inside (a vbcast a use: a vector slot),
    or in a vmem pool (a vld a use: the load slot, mostly idle). The other two are tried when the registers,
    not the slots, bound the II, the pool also when invariant code is left in the body (a decode softmax's
    exp: II 25 -> 17; SwiGLU: 79 -> 38)."""
    assert loop.loop is not None
    n = loop.loop.trip_count

    def cycles(m: ModuloSchedule, preheader: Sequence[MInstr] = ()) -> int:  # n iterations, fill and drain, setup
        return m.ii * (n + m.stages - 1) + (_resource_ii(list(preheader)) if preheader else 0)

    def fits(p: _Placement) -> bool:  # pipelines: the registers and the iterations suffice
        return n >= p.sched.stages - 1 + p.sched.unroll and \
            all(max_live(p.body, p.sched, kind) <= budget[kind] for kind in budget)

    bound = sched is None or sched.ii > _resource_ii(body)  # by the registers, or nothing within the slack
    options = [p for p in (_constants_back(loop, pre, body, uses, budget) if bound else None,
                           _constant_pool(func, loop, pre, body, sched, uses, budget, fresh))
               if p is not None and fits(p)]
    def code(m: ModuloSchedule, preheader: Sequence[MInstr] = ()) -> int:  # bundles: prologue, kernel, epilogue
        return (2 * (m.stages - 1) + m.unroll) * m.ii + len(preheader)

    if compact:  # no more code than the given schedule: the driver retries so when a program overflows imem
        options = [p for p in options if sched is None or code(p.sched, p.preheader) <= code(sched)]
    best = min(options, key=lambda p: cycles(p.sched, p.preheader), default=None)
    if best is None or (sched is not None and cycles(best.sched, best.preheader) >= cycles(sched)):
        return body, sched
    best.apply()
    log.append(f"{loop.label}: {best.note} (registers bound the II)")
    return best.body, best.sched


def _constants_back(loop: Block, pre: Block, body: list[MInstr], uses: Counter[Reg], budget: dict[str, int]
                    ) -> _Placement | None:
    """The loop with its hoisted constants back inside (a vbcast a use costs a slot, but holds no register
    across the whole loop), moved out of the preheader."""
    back = _hoisted_back(loop, pre, uses)
    if not back:
        return None
    inside = back + body
    other = modulo_schedule(inside, _read_outside(back + loop.instrs, uses), budget)
    if other is None:
        return None

    def apply() -> None:
        moved = {id(i) for i in back}
        pre.instrs = [i for i in pre.instrs if id(i) not in moved]
        loop.instrs = back + loop.instrs
        loop.hoisted = []
    return _Placement(inside, other, apply, f"{len(back)} hoisted instructions moved back")


def _constant_pool(func: Function, loop: Block, pre: Block, body: list[MInstr], sched: ModuloSchedule | None,
                   uses: Counter[Reg], budget: dict[str, int], fresh: Callable[[str], Reg]) -> _Placement | None:
    """The loop with a `vld` before each use of its invariant vector values and of the values it loads more
    than once (a register each only from its load to its use). The invariant values go to a vmem pool: the
    preheader computes each one (the invariant code left in the body moves there too) and stores it to a
    spill slot. A loaded value is loaded again for its later readers (`_loaded_again`); the fewest-used
    constants are pooled first, while the loads fit the II the other slots allow and POOL_SLOTS last."""
    here = Counter(r for i in loop.instrs for r in i.uses)
    invariant, values = _body_invariants(body, _hoisted_back(loop, pre, uses), uses, here)
    moved = {id(i) for i in invariant}
    rest = [i for i in body if id(i) not in moved]
    readers = Counter(r for i in rest for r in set(i.uses))
    ivs = _ivs(rest)
    again = _loaded_again(rest, ivs, readers, uses, here)
    room = _resource_ii([i for i in rest if i.unit is not isa.Unit.VLOAD]) - sum(i.unit is isa.Unit.VLOAD for i in rest)
    rows = spill_rows(func)[:POOL_SLOTS]
    pooled: dict[Reg, int] = {}
    reloaded: set[Reg] = set()
    for r in sorted(again, key=lambda r: r.n):
        if readers[r] - 1 <= room:
            reloaded.add(r)
            room -= readers[r] - 1
    constants = sorted((r for r in readers if r in values and r.kind == "v"), key=lambda r: (readers[r], r.n))
    for r in constants:
        if readers[r] > room or len(pooled) == len(rows):
            break
        pooled[r] = rows[len(pooled)]
        room -= readers[r]
    if not pooled and not reloaded:
        return None
    zero = Reg("s", 0, True)
    new_body: list[MInstr] = []
    first: set[Reg] = set()  # loaded values whose first reader, which keeps the first load, has been seen
    for k, ins in enumerate(rest):
        operands = list(ins.uses)
        for r in dict.fromkeys(ins.uses):
            if r in pooled:
                load = MInstr("vld", fresh("v"), (zero,), imm=pooled[r],
                              mem=(Mem(SPILL_REGION, pooled[r], pooled[r] + 8),), comment="pool")
            elif r in reloaded and r in first:  # less the step of an increment of its base in between
                original = rest[again[r]]
                at, step = ivs[original.uses[-1]]
                load = dataclasses.replace(original, dst=fresh("v"),
                                           imm=int(original.imm or 0) - (step if again[r] < at < k else 0))
            else:
                continue
            new_body.append(load)
            operands = [load.dst if u == r else u for u in operands]
        first |= {r for r in ins.uses if r in reloaded}
        new_body.append(dataclasses.replace(ins, uses=tuple(operands)))
    stores = [MInstr("vst", None, (r, zero), imm=row, mem=(Mem(SPILL_REGION, row, row + 8, True),), comment="pool")
              for r, row in pooled.items()]
    if sched is not None and sched.ii <= _resource_ii(new_body):
        return None
    pooled_sched = modulo_schedule(new_body, _read_outside(new_body, uses), budget)
    if pooled_sched is None:
        return None

    def apply() -> None:  # the invariant code left in the body moves out too, pooled or not
        pre.instrs = pre.instrs + invariant + stores
        uses.update(r for i in invariant + stores for r in i.uses)  # `loop.instrs` still counts the moved reads
        loop.hoisted = []
    note = f"{len(pooled)} constants in a vmem pool, {len(reloaded)} values loaded again"
    return _Placement(new_body, pooled_sched, apply, note, invariant + stores)


def _body_invariants(body: list[MInstr], hoisted: list[MInstr], uses: Counter[Reg], here: Counter[Reg]
                     ) -> tuple[list[MInstr], set[Reg]]:
    """The invariant code left in `body` (pure scalar or vector instructions over values defined outside the
    body or by other invariant code, whose values nothing outside the loop reads (`uses` against `here`, the
    loop's reads) and no body instruction reads before them), and every invariant value: theirs and the
    hoisted code's."""
    defined = Counter(i.dst for i in body if i.dst is not None)
    invariant: list[MInstr] = []
    values: set[Reg] = {i.dst for i in hoisted if i.dst is not None}
    read: set[Reg] = set()
    for ins in body:  # program order: an operand's invariant definition comes first
        if (ins.unit in (isa.Unit.SCALAR, isa.Unit.VECTOR) and not ins.mem and ins.dst is not None
                and not ins.dst.phys and defined[ins.dst] == 1 and uses[ins.dst] == here[ins.dst]
                and ins.dst not in read and all(defined[r] == 0 or r in values for r in ins.uses)):
            invariant.append(ins)
            values.add(ins.dst)
        read.update(ins.uses)
    return invariant, values


def _loaded_again(body: list[MInstr], ivs: dict[Reg, tuple[int, int]], readers: Counter[Reg], uses: Counter[Reg],
                  here: Counter[Reg]) -> dict[Reg, int]:
    """The values `body` loads through an induction base and reads in more than one instruction, which a load
    each may serve (value -> index of its load): defined once, read by nothing outside the loop and nothing
    before their load, from rows no store of the body writes."""
    stored = [m for i in body if i.op == "vst" for m in i.mem]
    seen: set[Reg] = set()
    exposed: set[Reg] = set()  # read before any definition in the body
    for ins in body:
        exposed |= {r for r in ins.uses if r not in seen}
        if ins.dst is not None:
            seen.add(ins.dst)
    defined = Counter(i.dst for i in body if i.dst is not None)
    return {i.dst: k for k, i in enumerate(body) if i.op == "vld" and i.uses[-1] in ivs and readers[i.dst] > 1
            and defined[i.dst] == 1 and uses[i.dst] == here[i.dst] and i.dst not in exposed
            and not any(m.overlaps(w) for m in i.mem for w in stored)}


def _hoisted_back(loop: Block, pre: Block, uses: Counter[Reg]) -> list[MInstr]:
    """The instructions hoisted out of `loop` that are still at the end of its preheader and whose values
    nothing but the loop (and each other) reads: what may move back into the body."""
    hoisted = loop.hoisted
    n = len(hoisted)
    if not n or len(pre.instrs) < n:
        return []
    if any(a is not b for a, b in zip(pre.instrs[-n:], hoisted, strict=True)):
        return []
    reads = Counter(r for i in hoisted + loop.instrs for r in i.uses)
    if any(i.dst is None or uses[i.dst] != reads[i.dst] for i in hoisted):
        return []
    return list(hoisted)


def pipeline_loops(func: Function, next_id: int, cuts: dict[str, int] | None = None, compact: bool = False
                   ) -> tuple[list[PipelinedLoop], list[str], int]:
    """Software-pipeline every qualifying counted loop of `func`. Returns the pipelined loops, why each
    loop was or was not pipelined, and the next free register id. `cuts[label]` lowers a loop's vector
    register budget (the driver's answer to a pipelined loop that still spilled). `compact`: no placement
    of a loop's constants takes more code than its given schedule (imem is tight)."""
    cuts = cuts or {}
    log: list[str] = []
    done: list[PipelinedLoop] = []
    ids = itertools.count(next_id + 1)

    def fresh(kind: str) -> Reg:
        return Reg(kind, next(ids))

    uses: Counter[Reg] = Counter(r for blk in func.blocks for i in blk.instrs for r in i.uses)
    index = 0
    while index < len(func.blocks):
        blk = func.blocks[index]
        if blk.loop is not None and blk.bundles is None and index > 0:
            cut = cuts.get(blk.label, 0)
            budget = {"v": REGISTER_BUDGET["v"] - cut, "s": REGISTER_BUDGET["s"] - cut // 2}
            if budget["v"] > 8 and not compact:
                _widen(func, index, uses, budget, fresh, log)
            p = pipeline_loop(func, index, log, fresh, budget, uses, compact) if budget["v"] > 8 else None
            if p is not None:
                done.append(p)
        index += 1
    return done, log, next(ids)
