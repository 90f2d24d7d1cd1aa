"""Trap kinds shared by the simulator and the RTL, and the loader's whole-program check.

The RTL reports a trap as a code (`TRAP_CODES` in sv_package.py: what `trap_code_o` carries); the
simulator raises `CtpuTrap` with a message. `classify` maps a simulator trap to the same code name, so
tests compare (kind, pc) pairs. Races with in-flight commands are a simulator-only trap ("RACE"): the RTL
is only required to match on race-free programs (docs/architecture.md, "Asynchronous commands").

`loader_trap` is the host-side loader of docs/architecture.md ("Traps: where they are raised"): it checks
every bundle's encoding and branch target before the core is released, exactly as `Simulator.load` does,
so an illegal bundle traps at its pc even when it would never be fetched. The core still traps at fetch
on an illegal bundle it reaches (tests run it with the loader bypassed).
"""

from __future__ import annotations

from dataclasses import dataclass

from device_sim import isa
from device_sim.program import Program
from device_sim.simulator import CtpuTrap

RACE = "RACE"  # simulator only

# substrings of the simulator's trap messages (simulator.py, semantics.py, async_units.py) -> trap code
_MESSAGES: tuple[tuple[str, str], ...] = (
    ("illegal encoding", "ILLEGAL"),
    ("branch target", "PC_END"),
    ("pc ran past the end", "PC_END"),
    ("cycle limit", "CYCLE_LIMIT"),
    ("a race", RACE),
    ("rows would overlap", "STORE_OVERLAP"),
    ("overlap its input rows", "MM_OVERLAP"),
    ("rows and cols must be >= 1", "ZERO_SHAPE"),
    ("mxu.mm streams", "ZERO_SHAPE"),
    ("not aligned", "MISALIGNED"),
    ("HBM bytes", "HBM_OOB"),
    ("vmem rows", "VMEM_OOB"),
    ("two results would land", "WRITE_CONFLICT"),
    ("vext lane", "LANE_RANGE"),
)


@dataclass(frozen=True)
class TrapKind:
    code: str  # a TRAP_CODES name, or RACE
    pc: int
    cycle: int

    def __str__(self) -> str:
        return f"{self.code} at bundle {self.pc}, cycle {self.cycle}"


def classify(trap: CtpuTrap) -> TrapKind:
    """The trap code of a simulator trap (ValueError for a message this table does not know)."""
    for text, code in _MESSAGES:
        if text in trap.reason:
            return TrapKind(code, trap.pc, trap.cycle)
    raise ValueError(f"unclassified simulator trap: {trap}")


def loader_trap(program: Program) -> TrapKind | None:
    """The first bundle the loader rejects (illegal encoding, branch target outside the program), if any."""
    n = len(program)
    for pc, words in enumerate(program.bundles):
        for slot, word in zip(isa.SLOTS, words, strict=True):
            try:
                ins, values = isa.decode_slot(word, slot)
            except isa.EncodingError:
                return TrapKind("ILLEGAL", pc, 0)
            if ins.mnemonic in ("jmp", "bnz", "bz") and not 0 <= values["imm"] < n:
                return TrapKind("PC_END", pc, 0)
    return None
