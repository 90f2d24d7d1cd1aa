"""CTPU assembler and disassembler (docs/architecture.md, "Assembly").

Everything about instructions comes from the table in `isa.py`: mnemonics, operand kinds and order, field
ranges, and which slots a unit owns. This file only knows the text syntax:

    # comment
    .equ NAME, expr          named constant (may use labels and other constants, defined before or after)
    label:                   names the next bundle's address; may precede a bundle on the same line
    add s1, s2, s3 ; vld v1, s2, 0      one bundle per line, instructions separated by ';'
    { ... }                  one bundle over several lines
    nop                      an empty bundle (a nop next to other instructions is ignored)

Assembly is two passes: the first splits the text into bundles and records labels and constants, the
second evaluates operands, so labels may be used before they are defined. Every error of a file is
collected and reported together as one AsmError.

The disassembler prints one bundle per line in slot order, with labels for branch targets; assembling its
output gives back the same bundles whenever each unit's instructions sit in that unit's first slots, which
is how the assembler (and so the compiler) always places them.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from os import PathLike
from pathlib import Path

from device_sim.asm_expr import FUNCTIONS, ExprError, evaluate_int
from device_sim.isa import (
    BY_MNEMONIC,
    NOP,
    NUM_FLAGS,
    NUM_SREGS,
    NUM_VREGS,
    SLOTS,
    SLOTS_OF_UNIT,
    EncodingError,
    Instr,
    Kind,
    Operand,
    Slot,
    Unit,
    decode_slot,
    encode_bundle,
)
from device_sim.program import MAGIC, Bundle, Program

__all__ = [
    "AsmError", "assemble", "assemble_file", "decode_bundle", "disassemble", "format_bundle",
    "format_instruction", "load_program",
]

MAX_REPORTED_ERRORS = 50

_LABEL = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*:")
_EQU = re.compile(r"\.equ\s+([A-Za-z_][A-Za-z0-9_]*)\s*,\s*(.+)")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_REGISTER = re.compile(r"([svf])(\d+)")
_GENERATED_LABEL = re.compile(r"L(\d+)")

# Register operand kinds: the prefix, how many the machine has, and a word for messages.
_REGISTERS: dict[Kind, tuple[str, int, str]] = {
    Kind.SREG: ("s", NUM_SREGS, "scalar"),
    Kind.VREG: ("v", NUM_VREGS, "vector"),
    Kind.FLAG: ("f", NUM_FLAGS, "flag"),
}


class AsmError(ValueError):
    """Assembly errors, all of a file: `errors` holds one 'file:line: message' string per error."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        shown = errors[:MAX_REPORTED_ERRORS]
        more = len(errors) - len(shown)
        super().__init__("\n".join(shown + ([f"... and {more} more errors"] if more > 0 else [])))


class _Poisoned(Exception):
    """An operand uses a constant whose own definition failed; that error is already reported."""


@dataclass
class _Stmt:
    text: str
    line: int


@dataclass
class _PendingBundle:
    line: int
    stmts: list[_Stmt] = field(default_factory=list)


def _operand_spelling(op: Operand) -> str:
    if op.kind in _REGISTERS:
        return _REGISTERS[op.kind][0] + op.field
    return "target" if op.kind is Kind.TARGET else "imm"


def _usage(ins: Instr) -> str:
    return " ".join([ins.mnemonic, ", ".join(_operand_spelling(op) for op in ins.operands)]).strip()


def _reserved_name(name: str) -> str | None:
    """Why `name` cannot be a label or constant, or None when it can."""
    if name in FUNCTIONS:
        return "it is a function name"
    if _REGISTER.fullmatch(name):
        return "it is a register name"
    return None


def _split_operands(text: str) -> list[str]:
    """Split on commas outside parentheses (function calls may one day take several arguments)."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += c == "("
        depth -= c == ")"
        if c == "," and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    last = text[start:].strip()
    if parts or last:
        parts.append(last)
    return parts


class _Assembler:
    def __init__(self, source_name: str) -> None:
        self.source_name = source_name
        self.errors: list[tuple[int, str]] = []
        self.labels: dict[str, tuple[int, int]] = {}  # name -> (address, line)
        self.equs: dict[str, tuple[str, int]] = {}  # name -> (expression text, line)
        self.equ_values: dict[str, int | None] = {}  # evaluated constants; None: its definition failed
        self.resolving: set[str] = set()
        self.pending: list[_PendingBundle] = []

    def error(self, line: int, message: str) -> None:
        self.errors.append((line, message))

    # ---- pass 1: lines -> bundles, labels, constants ---------------------------------------------

    def define(self, name: str, line: int, what: str) -> bool:
        reason = _reserved_name(name)
        if reason:
            self.error(line, f"{name!r} cannot be a {what}: {reason}")
            return False
        if name in self.labels or name in self.equs:
            first = self.labels[name][1] if name in self.labels else self.equs[name][1]
            self.error(line, f"duplicate {what} {name!r} (first defined at line {first})")
            return False
        return True

    def split_stmts(self, text: str, line: int) -> list[_Stmt]:
        return [_Stmt(s.strip(), line) for s in text.split(";") if s.strip()]

    def read(self, text: str) -> None:
        open_bundle: _PendingBundle | None = None
        for lineno, raw in enumerate(text.splitlines(), 1):
            line = raw.split("#", 1)[0].strip()
            while m := _LABEL.match(line):
                if open_bundle is not None:
                    self.error(lineno, f"label {m.group(1)!r} inside the bundle opened at line "
                                       f"{open_bundle.line}")
                elif self.define(m.group(1), lineno, "label"):
                    self.labels[m.group(1)] = (len(self.pending), lineno)
                line = line[m.end():].strip()
            if not line:
                continue
            if line.startswith("."):
                self.directive(line, lineno, open_bundle)
                continue
            if open_bundle is None:
                if line.startswith("{"):
                    open_bundle = _PendingBundle(lineno)
                    self.pending.append(open_bundle)
                    line = line[1:]
                elif "{" in line or "}" in line:
                    self.error(lineno, "unbalanced braces: '}' without '{'" if line.startswith("}")
                               else "'{' must start a line (it opens a bundle)")
                    continue
                else:
                    self.pending.append(_PendingBundle(lineno, self.split_stmts(line, lineno)))
                    continue
            if "{" in line:
                self.error(lineno, "unbalanced braces: '{' inside the bundle opened at line "
                                   f"{open_bundle.line}")
                line = line.replace("{", " ")
            body, closed, rest = line.partition("}")
            open_bundle.stmts += self.split_stmts(body, lineno)
            if closed:
                open_bundle = None
                if rest.strip():
                    self.error(lineno, f"unexpected {rest.strip()!r} after '}}'")
        if open_bundle is not None:
            self.error(open_bundle.line, "unbalanced braces: '{' is never closed")

    def directive(self, line: str, lineno: int, open_bundle: _PendingBundle | None) -> None:
        if line.split()[0] != ".equ":
            self.error(lineno, f"unknown directive {line.split()[0]!r} (the assembler knows .equ)")
        elif open_bundle is not None:
            self.error(lineno, f".equ inside the bundle opened at line {open_bundle.line}")
        elif (m := _EQU.fullmatch(line)) is None:
            self.error(lineno, "expected '.equ NAME, expression'")
        elif self.define(m.group(1), lineno, "constant"):
            self.equs[m.group(1)] = (m.group(2), lineno)

    # ---- symbols --------------------------------------------------------------------------------

    def lookup(self, name: str) -> int:
        if name in self.labels:
            return self.labels[name][0]
        if name in self.equs:
            return self.constant(name)
        known = list(self.labels) + list(self.equs)
        close = difflib.get_close_matches(name, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ExprError(f"undefined label or constant {name!r}{hint}")

    def constant(self, name: str) -> int:
        """Value of a .equ constant, evaluated on first use so it may refer to names defined later."""
        if name in self.equ_values:
            value = self.equ_values[name]
            if value is None:
                raise _Poisoned
            return value
        if name in self.resolving:
            raise ExprError(f"constant {name!r} is defined in terms of itself")
        text, line = self.equs[name]
        self.resolving.add(name)
        try:
            value = evaluate_int(text, self.lookup)
        except ExprError as e:
            self.error(line, str(e))
            self.equ_values[name] = None
            raise _Poisoned from None
        except _Poisoned:
            self.equ_values[name] = None
            raise
        finally:
            self.resolving.discard(name)
        self.equ_values[name] = value
        return value

    # ---- pass 2: operands and slots -------------------------------------------------------------

    def operand(self, ins: Instr, index: int, op: Operand, text: str) -> int:
        what = f"operand {index + 1} of {ins.mnemonic}"
        reg = _REGISTER.fullmatch(text)
        if op.kind in _REGISTERS:
            prefix, count, word = _REGISTERS[op.kind]
            count = min(count, ins.fmt.field(op.field).max + 1)
            if reg is None or reg.group(1) != prefix:
                expected = f"a {word} register {prefix}0..{prefix}{count - 1}"
                raise ExprError(f"{what} must be {expected}, got {text!r}")
            number = int(reg.group(2))
            if number >= count:
                raise ExprError(f"register {text} out of range: the CTPU has {prefix}0..{prefix}{count - 1}")
            return number
        noun = "a branch target" if op.kind is Kind.TARGET else "an immediate"
        if reg is not None:
            raise ExprError(f"{what} must be {noun}, got register {text}")
        value = evaluate_int(text, self.lookup)
        f = ins.fmt.field(op.field)
        lo, hi = ins.imm_range or (f.min, f.max)
        if not lo <= value <= hi:
            if ins.imm_range:
                raise ExprError(f"immediate {value} out of range for {ins.mnemonic}: {lo}..{hi}")
            sign = "signed" if f.signed else "unsigned"
            noun = noun.split(" ", 1)[1]
            raise ExprError(f"{noun} {value} does not fit {ins.mnemonic}'s {f.width}-bit {sign} field "
                            f"({lo}..{hi})")
        return value

    def instruction(self, stmt: _Stmt) -> tuple[Instr, dict[str, int]] | None:
        mnemonic, *rest_list = stmt.text.split(None, 1)
        rest = rest_list[0] if rest_list else ""
        ins = BY_MNEMONIC.get(mnemonic)
        if ins is None:
            close = [repr(m) for m in difflib.get_close_matches(mnemonic.lower(), BY_MNEMONIC, n=2)]
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            if mnemonic.lower() in BY_MNEMONIC:
                hint = f"; mnemonics are lower case: {mnemonic.lower()!r}"
            self.error(stmt.line, f"unknown instruction {mnemonic!r}{hint}")
            return None
        texts = _split_operands(rest)
        if len(texts) != len(ins.operands):
            self.error(stmt.line, f"{ins.mnemonic} takes {len(ins.operands)} operands ({_usage(ins)}), "
                                  f"got {len(texts)}")
            return None
        values: dict[str, int] = {}
        ok = True
        for i, (op, text) in enumerate(zip(ins.operands, texts, strict=True)):
            try:
                if not text:
                    raise ExprError(f"operand {i + 1} of {ins.mnemonic} is empty")
                values[op.field] = self.operand(ins, i, op, text)
            except ExprError as e:
                self.error(stmt.line, str(e))
                ok = False
            except _Poisoned:
                ok = False
        return (ins, values) if ok else None

    def bundle(self, pending: _PendingBundle) -> Bundle:
        by_unit: dict[Unit, list[tuple[_Stmt, Instr, dict[str, int]]]] = {}
        for stmt in pending.stmts:
            parsed = self.instruction(stmt)
            if parsed is not None and parsed[0] is not NOP:
                by_unit.setdefault(parsed[0].unit, []).append((stmt, *parsed))
        placed = []
        for unit, items in by_unit.items():
            slots = SLOTS_OF_UNIT[unit]
            if len(items) > len(slots):
                plural = "s" if len(slots) != 1 else ""
                self.error(items[len(slots)][0].line, f"bundle has {len(items)} {unit.value} instructions; "
                                                      f"the CTPU has {len(slots)} {unit.value} slot{plural}")
            placed += [(ins, values) for _, ins, values in items[:len(slots)]]  # extra items were reported above
        return encode_bundle(placed)

    def run(self, text: str) -> Program:
        self.read(text)
        for name in self.equs:
            try:
                self.constant(name)
            except _Poisoned:
                pass
        bundles = [self.bundle(p) for p in self.pending]
        if self.errors:
            self.errors.sort(key=lambda e: e[0])  # stable: errors of one line keep their order
            raise AsmError([f"{self.source_name}:{line}: {msg}" for line, msg in self.errors])
        return Program(bundles, labels={n: a for n, (a, _) in self.labels.items()},
                       source_lines=[p.line for p in self.pending], source_name=self.source_name)


def assemble(text: str, source_name: str = "<asm>") -> Program:
    """Assemble CTPU assembly text; raises AsmError listing every error with its file and line."""
    return _Assembler(source_name).run(text)


def assemble_file(path: str | PathLike[str]) -> Program:
    """Assemble a file; AsmError names it (errors by line, or text that is not UTF-8). OSError (missing,
    a directory, unreadable) carries the file name."""
    p = Path(path)
    return _assemble_bytes(p, p.read_bytes())


def _assemble_bytes(p: Path, data: bytes) -> Program:
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise AsmError([f"{p}:{line}: not UTF-8 text ({e.reason} at byte {e.start})"]) from None
    return assemble(text, source_name=str(p))


def load_program(path: str | PathLike[str]) -> Program:
    """A program from an assembly file (.s, .asm) or a CTPU binary (recognised by its magic, or named
    .bin / .ctpu so that a damaged one reports what is wrong with its header)."""
    p = Path(path)
    data = p.read_bytes()
    # The suffix wins for assembly: a source may well begin with a label named CTPU.
    if p.suffix in (".s", ".S", ".asm"):
        return _assemble_bytes(p, data)
    if data.startswith(MAGIC) or p.suffix in (".bin", ".ctpu"):
        return Program.from_bytes(data, source_name=str(p))
    raise ValueError(f"{p}: neither a CTPU binary (it does not start with {MAGIC!r}) "
                     f"nor an assembly file (.s or .asm)")


# ---- disassembler ---------------------------------------------------------------------------------


def decode_bundle(bundle: Bundle) -> list[tuple[Slot, Instr, dict[str, int]]]:
    """Every slot of a bundle, decoded, in slot order (nops included); raises EncodingError."""
    return [(slot, *decode_slot(word, slot)) for slot, word in zip(SLOTS, bundle, strict=True)]


def _format(ins: Instr, values: Mapping[str, int], names: Mapping[int, str]) -> str:
    parts = []
    for op in ins.operands:
        v = values[op.field]
        if op.kind in _REGISTERS:
            parts.append(f"{_REGISTERS[op.kind][0]}{v}")
        elif op.kind is Kind.TARGET:
            parts.append(names.get(v, str(v)))
        else:
            parts.append(str(v))
    return f"{ins.mnemonic} {', '.join(parts)}" if parts else ins.mnemonic


def format_instruction(ins: Instr, values: dict[str, int]) -> str:
    """One instruction as assembly, e.g. 'addi s1, s2, -4' (branch targets as numbers)."""
    return _format(ins, values, {})


def _format_decoded(decoded: list[tuple[Slot, Instr, dict[str, int]]], names: Mapping[int, str]) -> str:
    text = [_format(ins, values, names) for _, ins, values in decoded if ins is not NOP]
    return " ; ".join(text) if text else "nop"


def format_bundle(bundle: Bundle) -> str:
    """One bundle as one line of assembly ('nop' when empty); raises EncodingError."""
    return _format_decoded(decode_bundle(bundle), {})


def _label_names(program: Program, targets: set[int]) -> dict[int, str]:
    """Address -> label to print: the program's own label when exactly one usable name marks the address,
    else L<addr>. Every branch target inside the program (or just past its end) gets one."""
    n = len(program.bundles)
    own: dict[int, list[str]] = {}
    for name, addr in program.labels.items():
        generated = _GENERATED_LABEL.fullmatch(name)
        # A name like L7 at another address would collide with the generated name of bundle 7.
        usable = _NAME.fullmatch(name) and not _reserved_name(name) and (not generated or name == f"L{addr}")
        if usable and 0 <= addr <= n:
            own.setdefault(addr, []).append(name)
    wanted = {t for t in targets if 0 <= t <= n} | set(own)
    return {a: own[a][0] if len(own.get(a, [])) == 1 else f"L{a}" for a in sorted(wanted)}


def disassemble(program: Program) -> str:
    """The program as assembly text, one bundle per line; raises EncodingError naming a bad bundle."""
    decoded = []
    for addr, bundle in enumerate(program.bundles):
        try:
            decoded.append(decode_bundle(bundle))
        except EncodingError as e:
            raise EncodingError(f"{program.where(addr)}: bundle {addr}: {e}") from None
    targets = {values[op.field] for bundle in decoded for _, ins, values in bundle
               for op in ins.operands if op.kind is Kind.TARGET}
    names = _label_names(program, targets)
    lines = []
    for addr, bundle in enumerate(decoded):
        if addr in names:
            lines.append(f"{names[addr]}:")
        lines.append("    " + _format_decoded(bundle, names))
    if len(decoded) in names:
        lines.append(f"{names[len(decoded)]}:")
    return "".join(line + "\n" for line in lines)
