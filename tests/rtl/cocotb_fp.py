"""cocotb bench for ctpu_fp_lanes: the RTL fp32/bf16 functions against device_sim.numerics, and the exp and
reciprocal units against their steps (device_sim.sequences).

Driver: packs LANES operand pairs per call; monitor: reads y_o after the combinational settle; golden
model: numpy float32 (IEEE RNE with subnormals) + device_sim.numerics; checker: bit-exact compare.
Ends asserting zero errors. Vector count: CTPU_FP_VECTORS (default 4096 per op).
"""

from __future__ import annotations

import os

import cocotb
import numpy as np
from cocotb.triggers import Timer

from device_sim import numerics, sequences

LANES = 64
OPS = {"add": 0, "sub": 1, "mul": 2, "bf": 3, "f2i": 4, "i2f": 5, "max": 6, "min": 7, "lt": 8, "eq": 9,
       "bf16": 10, "exp": 11, "rcp": 12, "div": 13}

SPECIALS = np.array([
    0x00000000, 0x80000000, 0x00000001, 0x80000001, 0x007fffff, 0x807fffff, 0x00800000, 0x80800000,
    0x7f7fffff, 0xff7fffff, 0x7f800000, 0xff800000, 0x7fc00000, 0xffc00000, 0x7f800001, 0x7fbfffff,
    0x3f800000, 0xbf800000, 0x3f808000, 0x3f818000, 0x3f807fff, 0x3f808001, 0x7f7f8000, 0x7f7fc000,
    0x00008000, 0x00018000, 0x0000ffff, 0x4f000000, 0xcf000000, 0x4effffff, 0xcf000001, 0x3effffff,
    0x34000000, 0x33800000, 0x1f800000, 0x1f000000, 0x5f800000, 0x60000000, 0x00400000, 0x3f000000,
    0x7fffffff, 0xffffffff, 0x80000000 | 0x00400000, 0x0c000000, 0x8c000000, 0x4b800000, 0x4b000001,
], dtype=np.uint32)


def golden(op: str, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    fa, fb = a.view(np.float32), b.view(np.float32)
    with np.errstate(all="ignore"):
        if op == "add":
            return numerics.canonicalize_nan(fa + fb).view(np.uint32)
        if op == "sub":
            return numerics.canonicalize_nan(fa - fb).view(np.uint32)
        if op == "mul":
            return numerics.canonicalize_nan(fa * fb).view(np.uint32)
        if op == "bf":
            return numerics.round_to_bf16(fa).view(np.uint32)
        if op == "f2i":
            return numerics.f32_to_i32(fa).view(np.uint32)
        if op == "i2f":
            return a.view(np.int32).astype(np.float32).view(np.uint32)
        if op == "max":
            return numerics.fmax(fa, fb).view(np.uint32)
        if op == "min":
            return numerics.fmin(fa, fb).view(np.uint32)
        if op == "lt":
            return (fa < fb).astype(np.uint32)
        if op == "eq":
            return (fa == fb).astype(np.uint32)
        if op == "bf16":
            return numerics.f32_to_bf16_bits(fa).astype(np.uint32)
        if op == "exp":
            return sequences.exp_unit_bits(a)
        if op == "rcp":
            return sequences.rcp_unit_bits(a)
        if op == "div":
            return sequences.div_unit_bits(a, b)
    raise ValueError(op)


def operands(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Corner pairs (every special x every special), random bits, close pairs (cancellation), tiny values."""
    sa, sb = np.meshgrid(SPECIALS, SPECIALS)
    parts_a, parts_b = [sa.ravel()], [sb.ravel()]
    rnd = rng.integers(0, 1 << 32, size=(2, n), dtype=np.uint64).astype(np.uint32)
    parts_a.append(rnd[0])
    parts_b.append(rnd[1])
    close = rng.integers(0, 1 << 32, size=n, dtype=np.uint64).astype(np.uint32)
    delta = rng.integers(-40, 40, size=n).astype(np.int64)
    other = ((close.astype(np.int64) + delta) & 0xFFFFFFFF).astype(np.uint32) ^ np.uint32(0x80000000)
    parts_a.append(close)
    parts_b.append(other)
    tiny = rng.integers(0, 1 << 26, size=(2, n), dtype=np.uint64).astype(np.uint32)
    tiny |= (rng.integers(0, 2, size=(2, n)).astype(np.uint32) << 31)
    parts_a.append(tiny[0])
    parts_b.append(tiny[1])
    # products near the subnormal boundary: exponents summing to ~127
    e = rng.integers(0, 127, size=n).astype(np.uint32)
    m = rng.integers(0, 1 << 23, size=(2, n), dtype=np.uint64).astype(np.uint32)
    pa = (e << 23) | m[0]
    pb = ((np.uint32(127 - 24) - e + rng.integers(0, 26, size=n).astype(np.uint32)) & 0xFF) << 23 | m[1]
    parts_a.append(pa)
    parts_b.append(pb)
    # exp's domain, its subnormal results (below -87.3) and its overflow (above 88.7)
    parts_a.append(np.concatenate([rng.uniform(-110, 95, n), rng.uniform(-104, -86, n // 4),
                                   rng.uniform(88, 89.5, n // 4)]).astype(np.float32).view(np.uint32))
    parts_b.append(np.zeros(parts_a[-1].size, np.uint32))
    a, b = np.concatenate(parts_a), np.concatenate(parts_b)
    pad = (-a.size) % LANES
    return np.concatenate([a, np.zeros(pad, np.uint32)]), np.concatenate([b, np.zeros(pad, np.uint32)])


def pack(words: np.ndarray) -> int:
    return int.from_bytes(words.astype("<u4").tobytes(), "little")


def unpack(value: int) -> np.ndarray:
    return np.frombuffer(value.to_bytes(LANES * 4, "little"), dtype="<u4").astype(np.uint32)


@cocotb.test()
async def fp_lanes_match_numerics(dut) -> None:
    rng = np.random.default_rng(int(os.environ.get("CTPU_FP_SEED", "1")))
    n = int(os.environ.get("CTPU_FP_VECTORS", "4096"))
    a_all, b_all = operands(rng, n)
    errors: list[str] = []
    checked = 0
    for op, code in OPS.items():
        dut.op_i.value = code
        want_all = golden(op, a_all, b_all)
        for i in range(0, a_all.size, LANES):
            a, b = a_all[i:i + LANES], b_all[i:i + LANES]
            dut.a_i.value = pack(a)
            dut.b_i.value = pack(b)
            await Timer(1, "ns")
            got = unpack(int(dut.y_o.value))
            want = want_all[i:i + LANES]
            bad = np.nonzero(got != want)[0]
            checked += LANES
            for j in bad[:3]:
                if len(errors) < 40:
                    errors.append(f"{op}({a[j]:#010x}, {b[j]:#010x}) = {got[j]:#010x}, want {want[j]:#010x}")
            if bad.size > 3:
                errors.append(f"{op}: {bad.size} mismatches in one batch")
    for e in errors:
        dut._log.error(e)
    dut._log.info(f"checked {checked} lane results, {len(errors)} errors")
    assert not errors, f"{len(errors)} fp mismatches; first: {errors[0]}"
