"""The PNG line plot `ctpu train --plot` writes without a plotting library: a valid file (chunks, CRCs,
zlib stream) whose pixels show the series."""

from __future__ import annotations

import struct
import zlib
from pathlib import Path

import pytest

from torch_tpu_backend.png import COLORS, SIGNATURE, write_line_plot


def _decode(data: bytes) -> tuple[int, int, list[bytes]]:
    assert data[:8] == SIGNATURE
    pos, idat, size = 8, b"", (0, 0)
    kinds = []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos: pos + 4])
        kind, body = data[pos + 4: pos + 8], data[pos + 8: pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length: pos + 12 + length])
        assert crc == zlib.crc32(kind + body), kind
        kinds.append(kind)
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
            assert body[8:10] == b"\x08\x02"  # 8-bit RGB
        idat += body if kind == b"IDAT" else b""
        pos += 12 + length
    assert kinds[0] == b"IHDR" and kinds[-1] == b"IEND"
    raw = zlib.decompress(idat)
    width, height = size
    rows = [raw[r * (3 * width + 1): (r + 1) * (3 * width + 1)] for r in range(height)]
    assert all(row[0] == 0 for row in rows) and len(raw) == height * (3 * width + 1)
    return width, height, [row[1:] for row in rows]


def test_line_plot_is_a_valid_png_showing_each_series(tmp_path: Path) -> None:
    path = tmp_path / "loss.png"
    write_line_plot(path, {"ctpu": [4.9, 4.2, 3.1, 3.0], "eager": [4.9, 4.2, 3.1, 2.5]}, width=200, height=120)
    width, height, rows = _decode(path.read_bytes())
    assert (width, height) == (200, 120)
    pixels = {bytes(row[3 * x: 3 * x + 3]) for row in rows for x in range(width)}
    assert {bytes(COLORS[0]), bytes(COLORS[1]), b"\xff\xff\xff"} <= pixels


def test_a_flat_or_single_point_series_plots_and_an_empty_one_is_refused(tmp_path: Path) -> None:
    write_line_plot(tmp_path / "flat.png", {"loss": [2.0, 2.0]})
    write_line_plot(tmp_path / "one.png", {"loss": [0.0]})
    assert _decode((tmp_path / "one.png").read_bytes())[:2] == (640, 400)
    with pytest.raises(ValueError, match="nothing to plot"):
        write_line_plot(tmp_path / "none.png", {"loss": []})
