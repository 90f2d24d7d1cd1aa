"""The CTPU binary format: round trip and every header error the loader must report."""

from __future__ import annotations

import struct

import pytest

from device_sim.isa import NUM_SLOTS
from device_sim.program import HEADER_BYTES, BinaryFormatError, Program


def sample() -> Program:
    return Program([tuple(range(i, i + NUM_SLOTS)) for i in range(3)])


def test_round_trip() -> None:
    p = sample()
    data = p.to_bytes()
    assert len(data) == HEADER_BYTES + 3 * NUM_SLOTS * 4
    assert Program.from_bytes(data).bundles == p.bundles
    assert Program.from_bytes(Program([]).to_bytes()).bundles == []


def patch(data: bytes, offset: int, fmt: str, value: object) -> bytes:
    out = bytearray(data)
    struct.pack_into(fmt, out, offset, value)
    return bytes(out)


@pytest.mark.parametrize(("data", "message"), [
    (b"CTP", "3 bytes is shorter than the 16-byte header"),
    (patch(sample().to_bytes(), 0, "<4s", b"ELF\x7f"), "bad magic b'ELF\\\\x7f', expected b'CTPU'"),
    (patch(sample().to_bytes(), 4, "<H", 2), "format version 2, this tool reads 1"),
    (patch(sample().to_bytes(), 6, "<H", 8), "8 slots per bundle, expected 9"),
    (sample().to_bytes()[:-1], r"header says 3 bundles \(108 bytes\), file has 107 bytes"),
    (sample().to_bytes() + b"\0" * 36, r"header says 3 bundles \(108 bytes\), file has 144 bytes"),
    (patch(sample().to_bytes(), HEADER_BYTES, "<I", 12345), "CRC mismatch, the binary is corrupt"),
], ids=["short", "magic", "version", "slots", "truncated", "trailing", "crc"])
def test_header_errors(data: bytes, message: str) -> None:
    with pytest.raises(BinaryFormatError, match=f"^prog.bin: {message}$"):
        Program.from_bytes(data, source_name="prog.bin")


def test_bundle_width_is_checked() -> None:
    with pytest.raises(BinaryFormatError, match="bundle 0: 8 slot words, expected 9"):
        Program([(0,) * 8])


def test_where_names_the_source_line() -> None:
    p = Program([(0,) * NUM_SLOTS] * 2, source_lines=[3, 7], source_name="k.s")
    assert p.where(1) == "k.s:7"
    assert p.where(5) == "k.s"
