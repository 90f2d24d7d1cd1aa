"""The assembler and disassembler: random-program round trips, golden texts, and error messages."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from device_sim.asm import (
    AsmError,
    assemble,
    assemble_file,
    decode_bundle,
    disassemble,
    format_bundle,
    format_instruction,
    load_program,
)
from device_sim.asm_expr import ExprError, bf16_bits, evaluate
from device_sim.isa import (
    BY_MNEMONIC,
    INSTRUCTIONS,
    NOP,
    NUM_FLAGS,
    NUM_SLOTS,
    NUM_SREGS,
    NUM_VREGS,
    SLOTS_OF_UNIT,
    EncodingError,
    Instr,
    Kind,
    Operand,
    Unit,
    encode_slot,
)
from device_sim.program import BinaryFormatError, Program

REGISTER_COUNT = {Kind.SREG: NUM_SREGS, Kind.VREG: NUM_VREGS, Kind.FLAG: NUM_FLAGS}
BY_UNIT = {u: [i for i in INSTRUCTIONS if i.unit is u and i is not NOP] for u in Unit}
EMPTY = (0,) * NUM_SLOTS


def word(mnemonic: str, **values: int) -> int:
    return encode_slot(BY_MNEMONIC[mnemonic], values)


# ---- random legal programs, generated from the table ----------------------------------------------


def operand_values(ins: Instr, op: Operand, n_bundles: int) -> st.SearchStrategy[int]:
    f = ins.fmt.field(op.field)
    if op.kind in REGISTER_COUNT:
        return st.integers(0, min(REGISTER_COUNT[op.kind], f.max + 1) - 1)
    lo, hi = ins.imm_range or (f.min, f.max)
    if op.kind is Kind.TARGET:  # mostly real bundle addresses (they get labels), sometimes anything
        return st.one_of(st.integers(0, n_bundles), st.integers(lo, hi))
    return st.one_of(st.integers(lo, hi), st.sampled_from([lo, hi, 0, -1 if lo < 0 else 1]))


@st.composite
def programs(draw: st.DrawFn, with_labels: bool = False) -> Program:
    n = draw(st.integers(0, 10))
    bundles = []
    for _ in range(n):
        words = [0] * NUM_SLOTS
        for unit, slots in SLOTS_OF_UNIT.items():
            # The assembler packs a unit's instructions into its first slots; so do legal programs here.
            for slot in slots[:draw(st.integers(0, len(slots)))]:
                ins = draw(st.sampled_from(BY_UNIT[unit]))
                values = {op.field: draw(operand_values(ins, op, n)) for op in ins.operands}
                words[slot.index] = encode_slot(ins, values)
        bundles.append(tuple(words))
    labels = {}
    if with_labels:
        names = st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,6}", fullmatch=True)
        labels = draw(st.dictionaries(names, st.integers(-1, n + 1), max_size=4))
    return Program(bundles, labels=labels)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs())
def test_binary_disassemble_assemble_round_trip(p: Program) -> None:
    data = p.to_bytes()
    text = disassemble(Program.from_bytes(data))
    again = assemble(text)
    assert again.to_bytes() == data
    assert disassemble(again) == text  # canonical


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(programs(with_labels=True))
def test_round_trip_keeps_usable_labels(p: Program) -> None:
    text = disassemble(p)
    again = assemble(text)
    assert again.bundles == p.bundles
    assert disassemble(again) == text
    for name, addr in again.labels.items():
        assert p.labels.get(name, addr) == addr


# ---- golden texts -----------------------------------------------------------------------------------

SOURCE = """\
# every syntax feature once
.equ ROWS, 512                  # a constant
.equ HALF, (ROWS >> 1) - 0x10 + 0b11
.equ LATER, end - start         # labels, even forward ones, are symbols too
start:
    li s1, lo(f32(1.5)) ; li s2, HALF
    lih s1, hi(f32(1.5)) ; addi s3, s0, -(ROWS // 64) % 5
loop: vld v1, s2, 0 ; vadd.f v3, v1, v2 ; addi s2, s2, 8 ; bnz s4, loop
{
    mxu.mms s5, s6, s7, f1
    dma.ld.bf16 s8, s9, s10, s11, f0 ; wait f2
}
    { add s1, s2, s3 ; sub s4, s5, s6 }
    nop
    jmp end ; nop ; li s9, LATER * 2 ^ 1
    li s10, bf16(-2.0) | (1 << 16)
    ori s4, s0, ~0 & 0xff ; halt
end:
"""

DISASSEMBLY = """\
start:
    li s1, 0 ; li s2, 243
    lih s1, 16320 ; addi s3, s0, 2
loop:
    addi s2, s2, 8 ; vadd.f v3, v1, v2 ; vld v1, s2, 0 ; bnz s4, loop
    mxu.mms s5, s6, s7, f1 ; dma.ld.bf16 s8, s9, s10, s11, f0 ; wait f2
    add s1, s2, s3 ; sub s4, s5, s6
    nop
    li s9, 19 ; jmp end
    li s10, 114688
    ori s4, s0, 255 ; halt
end:
"""


def test_golden_program() -> None:
    p = assemble(SOURCE, "golden.s")
    assert p.labels == {"start": 0, "loop": 2, "end": 9}
    assert p.source_lines == [6, 7, 8, 9, 13, 14, 15, 16, 17]
    assert p.where(3) == "golden.s:9"
    assert disassemble(p) == DISASSEMBLY
    assert assemble(DISASSEMBLY).bundles == p.bundles
    assert p.bundles[0][:2] == (word("li", d=1, imm=0x0000), word("li", d=2, imm=243))
    assert p.bundles[2] == (word("addi", d=2, a=2, imm=8), 0, word("vadd.f", d=3, a=1, b=2), 0,
                            word("vld", d=1, a=2, imm=0), 0, 0, 0, word("bnz", d=4, imm=2))
    assert p.bundles[5] == EMPTY


def test_f32_hi_lo_build_a_constant() -> None:
    p = assemble("li s1, lo(f32(-3.25)) ; li s2, f32(0.0)\nlih s1, hi(f32(-3.25))")
    bits = struct.unpack("<I", struct.pack("<f", -3.25))[0]
    assert p.bundles[0][0] == word("li", d=1, imm=bits & 0xFFFF)
    assert p.bundles[1][0] == word("lih", d=1, imm=bits >> 16)


def test_labels_backward_forward_and_alone() -> None:
    p = assemble("a: b:\n jmp c\nc: jmp a\n li s1, b ; bz s1, d\nd:")
    assert p.labels == {"a": 0, "b": 0, "c": 1, "d": 3}
    assert [b[8] for b in p.bundles] == [word("jmp", imm=1), word("jmp", imm=0),
                                         word("bz", d=1, imm=3)]
    # Two names for one address are ambiguous, so the disassembler makes its own.
    assert disassemble(p) == "L0:\n    jmp c\nc:\n    jmp L0\n    li s1, 0 ; bz s1, d\nd:\n"


def test_disassembler_labels_from_bytes_and_out_of_range_targets() -> None:
    p = Program([(0,) * 8 + (word("jmp", imm=2),), (0,) * 8 + (word("bnz", d=3, imm=-7),), EMPTY])
    assert disassemble(p) == "    jmp L2\n    bnz s3, -7\nL2:\n    nop\n"


def test_unpacked_slots_disassemble_to_the_packed_equivalent() -> None:
    # A scalar op alone in slot s1 is a legal encoding; the assembler spells it in s0 (same semantics).
    p = Program([(0, word("add", d=1, a=2, b=3)) + (0,) * 7])
    assert disassemble(p) == "    add s1, s2, s3\n"
    assert assemble(disassemble(p)).bundles == [(word("add", d=1, a=2, b=3),) + (0,) * 8]


def test_format_helpers() -> None:
    assert format_instruction(BY_MNEMONIC["addi"], {"d": 1, "a": 2, "imm": -4}) == "addi s1, s2, -4"
    assert format_instruction(BY_MNEMONIC["bz"], {"d": 5, "imm": 12}) == "bz s5, 12"
    assert format_instruction(NOP, {}) == "nop"
    bundle = assemble("halt ; vmov v1, v2 ; mxu.lw s3, f4").bundles[0]
    assert format_bundle(bundle) == "vmov v1, v2 ; mxu.lw s3, f4 ; halt"
    assert format_bundle(EMPTY) == "nop"
    assert [s.name for s, ins, _ in decode_bundle(bundle) if ins is not NOP] == ["v0", "mxu", "ctrl"]


def test_disassembler_names_an_illegal_bundle() -> None:
    p = Program([EMPTY, (word("halt"),) + (0,) * 8], source_lines=[1, 2], source_name="x.s")
    with pytest.raises(EncodingError, match=r"x\.s:2: bundle 1: slot s0: halt belongs to the ctrl unit"):
        disassemble(p)


@pytest.mark.parametrize(("expr", "value"), [
    ("1 + 2 * 3", 7), ("(1 + 2) * 3", 9), ("-7 // 2", -4), ("-7 % 3", 2), ("1 << 4 | 1", 17),
    ("0xff & ~0x0f", 0xF0), ("6 ^ 3", 5), ("0b1010 >> 1", 5), ("--3", 3), ("hi(0x12345678)", 0x1234),
    ("lo(-1)", 0xFFFF), ("f32(1.0)", 0x3F800000), ("f32(-0.0)", 0x80000000), ("bf16(1.0)", 0x3F80),
    ("f32(1e-45)", 1), ("bf16(1.00390625)", 0x3F80), ("bf16(1.01171875)", 0x3F82),
])
def test_expressions(expr: str, value: int) -> None:
    assert evaluate(expr, lambda name: {"x": 3}[name]) == value


def test_bf16_rounds_once_to_nearest_even() -> None:
    assert bf16_bits(float("nan")) == 0x7FC0
    assert bf16_bits(3.3895313892515355e38) == 0x7F7F  # largest finite bf16
    assert bf16_bits(2.0 ** -133) == 0x0001  # smallest subnormal bf16
    assert bf16_bits(2.0 ** -134) == 0x0000  # a tie, to even
    with pytest.raises(ExprError, match="overflows bf16"):
        bf16_bits(3.4e38)


@pytest.mark.parametrize(("expr", "message"), [
    ("1 +", "ends too early"), ("(1", "ends too early"), ("1 2", "unexpected '2'"), ("3 $ 4", "'\\$'"),
    ("1 // 0", "division by zero"), ("1 << 1000", "shift count 1000"), ("sqrt(4)", "unknown function"),
    ("1.5 & 1", "needs integers"), ("", "empty expression"), ("f32(1e39)", "overflows float32"),
    ("hi", "hi is a function"),
])
def test_bad_expressions(expr: str, message: str) -> None:
    with pytest.raises(ExprError, match=message):
        evaluate(expr, lambda name: 0)


# ---- errors: every one names file:line and a concrete reason ------------------------------------------


def errors_of(text: str) -> list[str]:
    with pytest.raises(AsmError) as e:
        assemble(text, "t.s")
    return e.value.errors


@pytest.mark.parametrize(("text", "expected"), [
    ("nop\n  ad s1, s2, s3", "t.s:2: unknown instruction 'ad'; did you mean 'and' or 'add'?"),
    ("vadd.g v1, v2, v3", "t.s:1: unknown instruction 'vadd.g'; did you mean 'vadd.i' or 'vadd.f'?"),
    ("frobnicate", "t.s:1: unknown instruction 'frobnicate'"),
    ("VMAX.F v1, v2, v3", "t.s:1: unknown instruction 'VMAX.F'; mnemonics are lower case: 'vmax.f'"),
    ("add s1, s2", "t.s:1: add takes 3 operands (add sd, sa, sb), got 2"),
    ("halt s1", "t.s:1: halt takes 0 operands (halt), got 1"),
    ("add s1, v2, s3", "t.s:1: operand 2 of add must be a scalar register s0..s31, got 'v2'"),
    ("vadd.f v1, v2, 5", "t.s:1: operand 3 of vadd.f must be a vector register v0..v31, got '5'"),
    ("add s32, s1, s1", "t.s:1: register s32 out of range: the CTPU has s0..s31"),
    ("wait f16", "t.s:1: register f16 out of range: the CTPU has f0..f15"),
    ("addi s1, s1, s2", "t.s:1: operand 3 of addi must be an immediate, got register s2"),
    ("addi s1, s1, 8192", "t.s:1: immediate 8192 does not fit addi's 14-bit signed field (-8192..8191)"),
    ("lih s1, -1", "t.s:1: immediate -1 does not fit lih's 16-bit unsigned field (0..65535)"),
    ("li s1, f32(1.5)", "t.s:1: immediate 1069547520 does not fit li's 19-bit signed field"),
    ("viota v1, 3", "t.s:1: immediate 3 out of range for viota: 0..2"),
    ("jmp 1 << 20", "t.s:1: branch target 1048576 does not fit jmp's 19-bit signed field"),
    ("li s1, 1.5", "t.s:1: '1.5' is the float 1.5; use f32(...) or bf16(...) for its bits"),
    ("add s1, s2, s3 ; sub s1, s2, s3 ; mul s1, s2, s3",
     "t.s:1: bundle has 3 scalar instructions; the CTPU has 2 scalar slots"),
    ("{\n vld v1, s0, 0\n vld v2, s0, 8\n}",
     "t.s:3: bundle has 2 vload instructions; the CTPU has 1 vload slot"),
    ("loop:\n  jmp lop", "t.s:2: undefined label or constant 'lop' (did you mean 'loop'?)"),
    ("jmp nowhere", "t.s:1: undefined label or constant 'nowhere'"),
    ("a:\nnop\na: nop", "t.s:3: duplicate label 'a' (first defined at line 1)"),
    (".equ N, 1\nN: nop", "t.s:2: duplicate label 'N' (first defined at line 1)"),
    ("s3: nop", "t.s:1: 's3' cannot be a label: it is a register name"),
    (".equ f32, 1", "t.s:1: 'f32' cannot be a constant: it is a function name"),
    ("{\n halt", "t.s:1: unbalanced braces: '{' is never closed"),
    ("halt\n}", "t.s:2: unbalanced braces: '}' without '{'"),
    ("{\n{ halt }", "t.s:2: unbalanced braces: '{' inside the bundle opened at line 1"),
    ("{ halt } halt", "t.s:1: unexpected 'halt' after '}'"),
    ("halt {", "t.s:1: '{' must start a line (it opens a bundle)"),
    ("{\nx: halt\n}", "t.s:2: label 'x' inside the bundle opened at line 1"),
    ("addi s1, s1, (3 +", "t.s:1: expression '(3 +' ends too early"),
    ("addi s1, s1, 3 $ 4", "t.s:1: unexpected character '$' in expression '3 $ 4'"),
    ("add s1,, s2", "t.s:1: operand 2 of add is empty"),
    (".equ A, B + 1\n.equ B, A", "t.s:2: constant 'A' is defined in terms of itself"),
    (".equ X, 1 // 0\nli s1, X", "t.s:1: division by zero"),
    (".org 5", "t.s:1: unknown directive '.org' (the assembler knows .equ)"),
    (".equ X 5", "t.s:1: expected '.equ NAME, expression'"),
    (".equ", "t.s:1: expected '.equ NAME, expression'"),
    (".equs X, 5", "t.s:1: unknown directive '.equs'"),
])
def test_error_messages(text: str, expected: str) -> None:
    errors = errors_of(text)
    assert errors[0].startswith(expected), errors
    assert len(errors) == 1, errors  # one mistake, one message: no cascades


def test_all_errors_of_a_file_are_reported_in_line_order() -> None:
    text = "add s1, s2\nnop\njmp nowhere\nvadd.f v1, v2, v99\n{ halt\n"
    errors = errors_of(text)
    assert [e.split(":")[1] for e in errors] == ["1", "3", "4", "5"]
    assert str(AsmError(errors)) == "\n".join(errors)


def test_many_errors_are_truncated_in_the_message() -> None:
    errors = errors_of("bad\n" * 60)
    assert len(errors) == 60
    assert str(AsmError(errors)).endswith("... and 10 more errors")


def test_syntax_details() -> None:
    p = assemble("  add\ts1,s2 , s3;;halt ;  # comment ; jmp 0\n{ }\n{ nop ; nop }\nnop ; nop")
    assert format_bundle(p.bundles[0]) == "add s1, s2, s3 ; halt"
    assert p.bundles[1:] == [EMPTY] * 3
    assert assemble("").bundles == []
    assert disassemble(assemble("")) == ""


def test_files_and_load_program(tmp_path: Path) -> None:
    src = tmp_path / "k.s"
    src.write_text("start:\n  li s1, 5\n  halt\n")
    p = assemble_file(src)
    assert p.source_name == str(src) and p.where(1) == f"{src}:3"
    binary = tmp_path / "k.ctpu"
    binary.write_bytes(p.to_bytes())
    assert load_program(binary).bundles == load_program(src).bundles == p.bundles
    renamed = tmp_path / "k.out"  # a binary is recognised by its magic, whatever its name
    renamed.write_bytes(p.to_bytes())
    assert load_program(renamed).bundles == p.bundles
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"ELF!" + bytes(40))
    with pytest.raises(BinaryFormatError, match="bad magic"):
        load_program(bad)
    other = tmp_path / "notes.txt"
    other.write_text("hello")
    with pytest.raises(ValueError, match=r"notes\.txt: neither a CTPU binary .* nor an assembly file"):
        load_program(other)
    broken = tmp_path / "broken.s"
    broken.write_text("halt\nhalt s1\n")
    with pytest.raises(AsmError, match=r"broken\.s:2: halt takes 0 operands"):
        load_program(broken)
