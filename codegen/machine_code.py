"""Machine IR -> loop passes -> scheduled bundles -> physical registers -> assembly text -> `Program`.

A compiled graph is a sequence of kernels that share no virtual register: `compile_functions` runs the
passes below on each kernel alone and assembles them into one program.

Passes, in order: `loops.hoist_invariants` (loop-invariant constants to the preheader), `modulo.pipeline_loops`
(software pipelining of counted loops: pre-scheduled prologue / kernel / epilogue blocks), list scheduling
of the other blocks, linear-scan allocation. The driver loops schedule + allocate until allocation succeeds
(each round spills the values linear scan gave up on); spills are inserted into list-scheduled blocks only,
so when a value of a pipelined loop would have to spill, the whole function is compiled again without
pipelining (logged). Then it encodes the bundles into a `Program` (and prints them as assembly, a dump).
With `verify=True` (tests) every pass's result is checked by `verify.py`, loops across their back edge.
"""

from __future__ import annotations

import dataclasses
import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from codegen.errors import CapacityError, ProgramTooLargeError
from codegen.loops import hoist_invariants
from codegen.mir import Function, MInstr, Reg
from codegen.modulo import REGISTER_BUDGET, PipelinedLoop, max_live, pipeline_loops
from codegen.regalloc import allocate, insert_spills
from codegen.schedule import schedule_block
from codegen.verify import ScheduleError, verify_allocation, verify_loop_block, verify_pipelined, verify_schedule
from device_sim.isa import EncodingError, Kind, encode_bundle
from device_sim.program import Program

MAX_SPILL_ROUNDS = 32
PIPELINE_RETRIES = 6  # recompilations with lower register budgets for pipelined loops that spilled
PIPELINE_BUDGET_STEP = 1  # below the register count of the schedule that spilled


@dataclass
class MachineCode:
    func: Function  # after spill insertion, virtual registers
    bundles: dict[str, list[list[MInstr]]]  # scheduled, virtual registers
    assignment: dict[Reg, Reg]
    assembly: str
    program: Program
    spilled: int
    pipelined: list[PipelinedLoop] = field(default_factory=list)
    log: list[str] = field(default_factory=list)  # why loops were or were not pipelined, fallbacks
    function_bundles: list[int] = field(default_factory=list)  # program bundles of each compiled function

    def scheduled_text(self) -> str:
        lines = []
        for blk in self.func.blocks:
            lines.append(f"{blk.label}:")
            for t, bundle in enumerate(self.bundles[blk.label]):
                lines.append(f"  [{t:4d}] " + " ; ".join(_plain(i) for i in bundle) if bundle else f"  [{t:4d}] nop")
        return "\n".join(lines) + "\n"


def _plain(ins: MInstr) -> str:
    return str(dataclasses.replace(ins, comment=""))


def _physical(ins: MInstr, assignment: dict[Reg, Reg]) -> MInstr:
    def m(r: Reg) -> Reg:
        return r if r.phys else assignment[r]
    return dataclasses.replace(ins, dst=m(ins.dst) if ins.dst else None, uses=tuple(m(r) for r in ins.uses))


def schedule_function(func: Function) -> dict[str, list[list[MInstr]]]:
    """List-schedule every block, except pre-scheduled (pipelined) ones, which keep their bundles."""
    return {blk.label: blk.bundles if blk.bundles is not None else schedule_block(blk.instrs)
            for blk in func.blocks}


class _PipelineSpill(Exception):
    def __init__(self, loops: dict[str, int]) -> None:
        super().__init__(f"values of pipelined loops {sorted(loops)} would spill")
        self.loops = loops  # label -> the vector registers its schedule needs by the pipeliner's count


def compile_function(func: Function, next_id: int, source_name: str = "<ctpu>", pipeline: bool = True,
                     verify: bool = False) -> MachineCode:
    """Compile `func` (modified in place) to a `MachineCode`: `pipeline` software-pipelines counted loops,
    `verify` runs every verifier of verify.py on the result."""
    return compile_functions([func], next_id, source_name, pipeline, verify)


def compile_functions(funcs: list[Function], next_id: int, source_name: str = "<ctpu>",
                      pipeline: bool = True, verify: bool = False,
                      progress: Callable[[int, int], None] | None = None,
                      max_bundles: int | None = None, compact: bool = False) -> MachineCode:
    """Compile functions that run one after another into ONE program: the kernels of a megakernel. No
    virtual register may live from one function into the next (each kernel starts from its launch registers
    and ends with its commands waited for), so each is scheduled and allocated on its own: a kernel that
    spills or retries costs only itself. Virtual registers must be unique across `funcs` (one `Builder`);
    `next_id` must exceed every one of them. `progress(done, total)` is called after each function.
    `max_bundles`: imem; ProgramTooLargeError as soon as the functions compiled so far exceed it (the rest
    is not compiled). `compact`: imem is tight, so no loop's pipelining takes more code to save cycles
    (`modulo._constants_placed`)."""
    parts: list[_Allocated] = []
    bundles_so_far = 0
    for k, func in enumerate(funcs):
        try:
            with _collector_paused():
                part = _compile_retrying(func, next_id, pipeline, verify, compact)
        except CapacityError as e:
            raise CapacityError(f"{func.name}: {e}" if func.name else str(e)) from e
        next_id = max(next_id, part.func.max_reg_id()) + 1
        parts.append(part)
        bundles_so_far += sum(len(part.bundles[b.label]) for b in part.func.blocks)
        if max_bundles is not None and bundles_so_far > max_bundles:
            raise ProgramTooLargeError(f"program of over {bundles_so_far} bundles after {k + 1} of {len(funcs)} "
                                       f"kernels does not fit imem ({max_bundles} bundles)")
        if progress is not None:
            progress(k + 1, len(funcs))
    merged = Function(pinned=funcs[0].pinned if funcs else ())
    bundles: dict[str, list[list[MInstr]]] = {}
    assignment: dict[Reg, Reg] = {}
    for part in parts:
        merged.blocks += part.func.blocks
        bundles |= part.bundles
        assignment |= part.assignment
    text, program = emit_program(merged, bundles, assignment, source_name)
    return MachineCode(merged, bundles, assignment, text, program, sum(p.spilled for p in parts),
                       [loop for p in parts for loop in p.pipelined], [line for p in parts for line in p.log],
                       [sum(len(part.bundles[b.label]) for b in part.func.blocks) for part in parts])


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while one function is scheduled and allocated: the scheduler
    makes millions of short-lived lists, and each collection they trigger walks every object the compile
    holds (MLIR, FX, the kernel graph): 58% of the 1B model's scheduling time. Nothing of a function's
    compile is cyclic garbage worth collecting before it ends."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@dataclass
class _Allocated:
    func: Function  # after spill insertion
    bundles: dict[str, list[list[MInstr]]]
    assignment: dict[Reg, Reg]
    spilled: int
    pipelined: list[PipelinedLoop]
    log: list[str]


def _compile_retrying(func: Function, next_id: int, pipeline: bool, verify: bool, compact: bool = False
                      ) -> _Allocated:
    """Schedule and allocate `func`; pipelined loops that would spill get a lower register budget and, in
    the end, no pipelining."""
    if not pipeline:
        return _compile(func, next_id, False, verify, {})
    cuts: dict[str, int] = {}
    notes: list[str] = []
    for _ in range(PIPELINE_RETRIES):
        try:
            part = _compile(func.clone(), next_id, True, verify, cuts, compact)  # `func` stays as it was for a retry
            part.log += notes
            return part
        except _PipelineSpill as e:
            notes.append(f"retry: {e}; their register budget is lowered")
            for label, live in e.loops.items():  # below what the spilled schedule counted
                cuts[label] = max(cuts.get(label, 0), REGISTER_BUDGET["v"] - live) + PIPELINE_BUDGET_STEP
        except ScheduleError as e:  # a pipelined loop whose trace breaks the body's order: never run it
            if verify:
                raise  # a compiler bug: verified compiles (tests) report it instead of hiding it
            notes.append(f"pipelined loop rejected by its trace check: {e}")
            break
    part = _compile(func, next_id, False, verify, {})
    part.log += [*notes, "pipelining undone"]
    return part


def _compile(func: Function, next_id: int, pipeline: bool, verify: bool, cuts: dict[str, int],
             compact: bool = False) -> _Allocated:
    hoist_invariants(func)
    pipelined: list[PipelinedLoop] = []
    log: list[str] = []
    if pipeline:
        pipelined, log, next_id = pipeline_loops(func, next_id, cuts, compact)
    spilled = 0
    before_spills: Function | None = None
    for spread in (False, True):  # spill slots first-fit; where that does not converge, least recently freed
        for _ in range(MAX_SPILL_ROUNDS):
            bundles = schedule_function(func)
            assignment, spills = allocate(func, bundles)
            if not spills:
                break
            spilled_set = set(spills)
            loops = {p.label: max_live(p.body, p.sched, "v") for p in pipelined for b in func.blocks if b.bundles
                     is not None and b.label in p.blocks and any(spilled_set & set(i.regs()) for i in b.instrs)}
            if loops:
                raise _PipelineSpill(loops)
            if before_spills is None:
                before_spills = func.clone()
            spilled += len(spills)
            next_id = insert_spills(func, spills, next_id + 1000, spread)
        else:
            assert before_spills is not None
            func, spilled = before_spills, 0
            log.append("spill rounds did not converge with first-fit slots: again, slots least recently freed")
            continue
        break
    else:
        raise CapacityError("register allocation did not converge")
    if verify:
        verify_function(func, bundles, assignment, pipelined)
    else:  # always (a few kernel runs): modulo expansion and allocation have given loops silently wrong values
        for loop in pipelined:
            verify_pipelined(loop, assignment, max_runs=loop.sched.stages + 2)
    return _Allocated(func, bundles, assignment, spilled, pipelined, log)


def verify_function(func: Function, bundles: dict[str, list[list[MInstr]]], assignment: dict[Reg, Reg],
                    pipelined: list[PipelinedLoop]) -> None:
    """Every check of verify.py: list-scheduled blocks (and their loops across the back edge), pipelined
    loops as traces, on virtual and then on physical registers."""
    for blk in func.blocks:
        if blk.bundles is not None:
            continue
        verify_schedule(blk.instrs, bundles[blk.label])
        verify_allocation(blk.instrs, bundles[blk.label], assignment)
        if blk.instrs and blk.instrs[-1].target == blk.label:
            verify_loop_block(blk.label, blk.instrs, bundles[blk.label])
    for loop in pipelined:
        verify_pipelined(loop)
        verify_pipelined(loop, assignment)


def emit_program(func: Function, bundles: dict[str, list[list[MInstr]]], assignment: dict[Reg, Reg],
                 source_name: str = "<ctpu>") -> tuple[str, Program]:
    """The program, encoded straight from the scheduled bundles (physical registers), and its assembly text
    (one bundle per line): a dump to read, which `device_sim.asm` assembles to the same words."""
    addresses: dict[str, int] = {}
    at = 0
    for blk in func.blocks:
        addresses[blk.label] = at
        at += len(bundles[blk.label])
    lines = ["# generated by codegen (ctpu compiler): one bundle per line"]
    words: list[tuple[int, ...]] = []
    source_lines: list[int] = []
    for blk in func.blocks:
        lines.append(f"{blk.label}:")
        for bundle in bundles[blk.label]:
            phys = [_physical(i, assignment) for i in bundle]
            try:
                words.append(encode_bundle([(i.info, _fields(i, addresses)) for i in phys]))
            except EncodingError as e:
                raise CapacityError(f"{source_name}: {blk.label} bundle {len(words)}: {e}") from e
            notes = "; ".join(i.comment for i in bundle if i.comment)
            text = " ; ".join(_plain(i) for i in phys) or "nop"
            lines.append(f"    {text}" + (f"    # {notes}" if notes else ""))
            source_lines.append(len(lines))
    return "\n".join(lines) + "\n", Program(words, dict(addresses), source_lines, source_name)


def _fields(ins: MInstr, addresses: dict[str, int]) -> dict[str, int]:
    """The instruction's encoding fields, in the ISA table's operand order (as `MInstr.__str__` prints it)."""
    info, values = ins.info, {}
    uses = iter(ins.uses)
    for operand in info.operands:
        if operand.field == info.writes:
            values[operand.field] = ins.dst.n
        elif operand.kind in (Kind.SREG, Kind.VREG):
            values[operand.field] = next(uses).n
        elif operand.kind is Kind.FLAG:
            values[operand.field] = ins.flag
        elif operand.kind is Kind.TARGET:
            values[operand.field] = addresses[str(ins.target)]
        else:
            values[operand.field] = ins.imm
    return values
