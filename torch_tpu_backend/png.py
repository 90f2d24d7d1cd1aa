"""A line plot written as a PNG with zlib alone (no plotting library is a dependency): `ctpu train --plot`.

    write_line_plot("loss.png", {"ctpu": [4.9, 4.1, 3.6], "eager": [4.9, 4.1, 3.6]})

White background, light grid (5 x 5), axes, one colored polyline per series (2 px wide), each point marked;
the y range is the data's, padded by 5%. No text: the numbers are what `ctpu train` prints.
"""

from __future__ import annotations

import itertools
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path

SIGNATURE = b"\x89PNG\r\n\x1a\n"
COLORS = [(31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40)]
Pixel = tuple[int, int, int]


class Canvas:
    def __init__(self, width: int, height: int) -> None:
        self.width, self.height = width, height
        self.rows = [bytearray(b"\xff" * (3 * width)) for _ in range(height)]

    def dot(self, x: int, y: int, color: Pixel, radius: int = 1) -> None:
        for yy in range(y - radius + 1, y + radius):
            for xx in range(x - radius + 1, x + radius):
                if 0 <= xx < self.width and 0 <= yy < self.height:
                    self.rows[yy][3 * xx: 3 * xx + 3] = bytes(color)

    def line(self, x0: int, y0: int, x1: int, y1: int, color: Pixel, radius: int = 1) -> None:
        steps = max(abs(x1 - x0), abs(y1 - y0), 1)
        for i in range(steps + 1):
            self.dot(round(x0 + (x1 - x0) * i / steps), round(y0 + (y1 - y0) * i / steps), color, radius)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(row) for row in self.rows)  # filter type 0 (none) per scanline

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        header = struct.pack(">IIBBBBB", self.width, self.height, 8, 2, 0, 0, 0)  # 8-bit RGB
        return SIGNATURE + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


def write_line_plot(path: str | Path, series: Mapping[str, Sequence[float]], width: int = 640,
                    height: int = 400) -> None:
    """The series (each against its index) on shared axes, written to `path` as a PNG."""
    values = [v for s in series.values() for v in s]
    if not values:
        raise ValueError("nothing to plot")
    lo, hi = min(values), max(values)
    pad = (hi - lo) * 0.05 or abs(hi) * 0.05 or 1.0
    lo, hi = lo - pad, hi + pad
    n = max(len(s) for s in series.values())
    left, right, top, bottom = 40, width - 20, 20, height - 30
    c = Canvas(width, height)
    for k in range(6):
        x = left + (right - left) * k // 5
        y = top + (bottom - top) * k // 5
        c.line(x, top, x, bottom, (230, 230, 230))
        c.line(left, y, right, y, (230, 230, 230))
    c.line(left, bottom, right, bottom, (0, 0, 0))
    c.line(left, top, left, bottom, (0, 0, 0))

    def at(i: int, v: float) -> tuple[int, int]:
        x = left + (right - left) * (i / (n - 1) if n > 1 else 0.5)
        return round(x), round(bottom - (bottom - top) * (v - lo) / (hi - lo))

    for color, s in zip(COLORS * (len(series) // len(COLORS) + 1), series.values(), strict=False):
        points = [at(i, v) for i, v in enumerate(s)]
        for (x0, y0), (x1, y1) in itertools.pairwise(points):
            c.line(x0, y0, x1, y1, color)
        for x, y in points:
            c.dot(x, y, color, radius=3)
    Path(path).write_bytes(c.png())
