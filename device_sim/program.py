"""A CTPU program: bundles of slot words, and its binary file format (docs/architecture.md, Binary format)."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass, field

from device_sim.isa import NUM_SLOTS

MAGIC = b"CTPU"
VERSION = 1
_HEADER = struct.Struct("<4sHHII")
HEADER_BYTES = _HEADER.size
Bundle = tuple[int, ...]  # NUM_SLOTS slot words, in SLOTS order


class BinaryFormatError(ValueError):
    """A CTPU binary that cannot be loaded."""


@dataclass
class Program:
    """Bundles plus what the assembler knew: labels and the source line of each bundle (for errors)."""

    bundles: list[Bundle]
    labels: dict[str, int] = field(default_factory=dict)
    source_lines: list[int] | None = None
    source_name: str = "<program>"

    def __post_init__(self) -> None:
        for addr, b in enumerate(self.bundles):
            if len(b) != NUM_SLOTS:
                raise BinaryFormatError(f"bundle {addr}: {len(b)} slot words, expected {NUM_SLOTS}")

    def __len__(self) -> int:
        return len(self.bundles)

    def where(self, pc: int) -> str:
        """'file.s:12' when the source is known, for error messages."""
        if self.source_lines and 0 <= pc < len(self.source_lines):
            return f"{self.source_name}:{self.source_lines[pc]}"
        return self.source_name

    def to_bytes(self) -> bytes:
        body = b"".join(struct.pack(f"<{NUM_SLOTS}I", *b) for b in self.bundles)
        return _HEADER.pack(MAGIC, VERSION, NUM_SLOTS, len(self.bundles), zlib.crc32(body)) + body

    @classmethod
    def from_bytes(cls, data: bytes, source_name: str = "<binary>") -> Program:
        if len(data) < HEADER_BYTES:
            raise BinaryFormatError(f"{source_name}: {len(data)} bytes is shorter than the {HEADER_BYTES}-byte header")
        magic, version, slots, n, crc = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise BinaryFormatError(f"{source_name}: bad magic {magic!r}, expected {MAGIC!r}")
        if version != VERSION:
            raise BinaryFormatError(f"{source_name}: format version {version}, this tool reads {VERSION}")
        if slots != NUM_SLOTS:
            raise BinaryFormatError(f"{source_name}: {slots} slots per bundle, expected {NUM_SLOTS}")
        body = data[HEADER_BYTES:]
        if len(body) != n * NUM_SLOTS * 4:
            raise BinaryFormatError(
                f"{source_name}: header says {n} bundles ({n * NUM_SLOTS * 4} bytes), file has {len(body)} bytes")
        if zlib.crc32(body) != crc:
            raise BinaryFormatError(f"{source_name}: CRC mismatch, the binary is corrupt")
        words = struct.unpack(f"<{n * NUM_SLOTS}I", body)
        bundles = [tuple(words[i * NUM_SLOTS:(i + 1) * NUM_SLOTS]) for i in range(n)]
        return cls(bundles, source_name=source_name)
