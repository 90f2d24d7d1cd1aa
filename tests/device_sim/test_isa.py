"""The instruction table's invariants, and encode -> decode -> encode round trips generated from it."""

from __future__ import annotations

import random

import pytest

from device_sim.isa import (
    BY_OPCODE,
    FORMATS,
    INSTRUCTIONS,
    NOP,
    NUM_FLAGS,
    NUM_SREGS,
    NUM_VREGS,
    OPCODE_LO,
    SLOTS,
    SLOTS_OF_UNIT,
    EncodingError,
    Instr,
    Kind,
    Operand,
    Unit,
    decode_slot,
    encode_slot,
)

REAL = [ins for ins in INSTRUCTIONS if ins is not NOP]
REGISTER_COUNT = {Kind.SREG: NUM_SREGS, Kind.VREG: NUM_VREGS, Kind.FLAG: NUM_FLAGS}


def legal_range(ins: Instr, op: Operand) -> tuple[int, int]:
    """The values the table allows for one operand (registers by number)."""
    f = ins.fmt.field(op.field)
    if op.kind in REGISTER_COUNT:
        return 0, min(REGISTER_COUNT[op.kind], f.max + 1) - 1
    return ins.imm_range or (f.min, f.max)


def random_values(ins: Instr, rng: random.Random) -> dict[str, int]:
    out = {}
    for op in ins.operands:
        lo, hi = legal_range(ins, op)
        out[op.field] = rng.choice([lo, hi, rng.randint(lo, hi)])
    return out


def test_mnemonics_and_opcodes_are_unique() -> None:
    assert len({i.mnemonic for i in INSTRUCTIONS}) == len(INSTRUCTIONS)
    assert len({i.opcode for i in INSTRUCTIONS}) == len(INSTRUCTIONS)
    assert NOP.opcode == 0


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
def test_format_fields_fit_and_do_not_overlap(fmt) -> None:
    taken = 0xFF << OPCODE_LO
    for f in fmt.fields:
        assert 0 <= f.lo <= f.hi < OPCODE_LO, f"{fmt.name}.{f.name} overlaps the opcode or is out of the word"
        mask = f.mask << f.lo
        assert taken & mask == 0, f"{fmt.name}.{f.name} overlaps another field"
        taken |= mask
    assert len({f.name for f in fmt.fields}) == len(fmt.fields)


@pytest.mark.parametrize("ins", INSTRUCTIONS, ids=lambda i: i.mnemonic)
def test_operands_map_to_fields(ins: Instr) -> None:
    names = {f.name for f in ins.fmt.fields}
    fields = [op.field for op in ins.operands]
    assert set(fields) <= names
    assert len(set(fields)) == len(fields), "two operands share a field"
    assert SLOTS_OF_UNIT.get(ins.unit), "unit without a slot"
    if ins.writes is not None:
        assert ins.dest_kind in REGISTER_COUNT
    for op in ins.operands:
        lo, hi = legal_range(ins, op)
        f = ins.fmt.field(op.field)
        assert f.min <= lo <= hi <= f.max


@pytest.mark.parametrize("ins", REAL, ids=lambda i: i.mnemonic)
def test_encode_decode_round_trip(ins: Instr) -> None:
    rng = random.Random(ins.opcode)
    for _ in range(50):
        values = random_values(ins, rng)
        word = encode_slot(ins, values)
        for slot in SLOTS_OF_UNIT[ins.unit]:
            decoded, got = decode_slot(word, slot)
            assert decoded is ins
            assert {k: got[k] for k in values} == values
            assert all(v == 0 for k, v in got.items() if k not in values)
            assert encode_slot(decoded, got) == word


def test_nop_decodes_in_every_slot() -> None:
    for slot in SLOTS:
        assert decode_slot(0, slot) == (NOP, {})


def test_decode_rejects_unknown_opcodes() -> None:
    unknown = [op for op in range(256) if op not in BY_OPCODE]
    assert unknown
    for op in unknown:
        with pytest.raises(EncodingError, match=f"unknown opcode 0x{op:02x}"):
            decode_slot(op << OPCODE_LO, SLOTS[0])


@pytest.mark.parametrize("ins", REAL, ids=lambda i: i.mnemonic)
def test_decode_rejects_wrong_slot(ins: Instr) -> None:
    word = encode_slot(ins, {})
    for slot in SLOTS:
        if slot.unit is not ins.unit:
            with pytest.raises(EncodingError, match=f"belongs to the {ins.unit.value} unit"):
                decode_slot(word, slot)


@pytest.mark.parametrize("ins", REAL, ids=lambda i: i.mnemonic)
def test_decode_rejects_reserved_bits(ins: Instr) -> None:
    slot = SLOTS_OF_UNIT[ins.unit][0]
    word = encode_slot(ins, {})
    operand_bits = 0
    for op in ins.operands:
        f = ins.fmt.field(op.field)
        operand_bits |= f.mask << f.lo
    for bit in range(OPCODE_LO):
        if not operand_bits >> bit & 1:
            # Includes format fields this instruction has no operand for (e.g. d of jmp).
            with pytest.raises(EncodingError, match="reserved bits"):
                decode_slot(word | 1 << bit, slot)


def test_encode_rejects_out_of_range_and_unused_fields() -> None:
    add = next(i for i in INSTRUCTIONS if i.mnemonic == "add")
    with pytest.raises(EncodingError, match="field d=32 out of range"):
        encode_slot(add, {"d": 32})
    jmp = next(i for i in INSTRUCTIONS if i.mnemonic == "jmp")
    with pytest.raises(EncodingError, match="no operand in field d"):
        encode_slot(jmp, {"d": 1, "imm": 0})


def test_imm_range_is_checked_both_ways() -> None:
    viota = next(i for i in INSTRUCTIONS if i.imm_range is not None)
    hi = (viota.imm_range or (0, 0))[1]
    with pytest.raises(EncodingError):
        encode_slot(viota, {"d": 0, "imm": hi + 1})
    word = (viota.opcode << OPCODE_LO) | (hi + 1)
    with pytest.raises(EncodingError, match="not in"):
        decode_slot(word, SLOTS_OF_UNIT[viota.unit][0])


def test_every_unit_has_instructions() -> None:
    assert {i.unit for i in REAL} == set(Unit)
