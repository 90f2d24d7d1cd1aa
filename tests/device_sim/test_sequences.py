"""The transcendental sequences of device_sim/sequences.py: their accuracy (ulp, measured against float64
rounded by ulp_error), their special values, and that the simulator computes them bit for bit like the
numpy model (the same op list, run as a straight-line CTPU program)."""

from __future__ import annotations

import numpy as np
import pytest

from device_sim import isa, sequences
from device_sim.asm import assemble
from device_sim.sequences import SeqBuilder
from device_sim.simulator import Simulator

RNG = np.random.default_rng(1234)


def _normal_floats(n: int, lo_bits: int = 0x00800000, hi_bits: int = 0x7F800000) -> np.ndarray:
    """n random positive fp32 values with uniformly random bit patterns in [lo_bits, hi_bits)."""
    return RNG.integers(lo_bits, hi_bits, n, dtype=np.int64).astype(np.uint32).view(np.float32)


def test_ops_are_ctpu_vector_instructions() -> None:
    for fn in (sequences.exp, sequences.reciprocal, sequences.rsqrt):
        for op in fn.builder.ops:
            assert isa.BY_MNEMONIC[op.mnemonic].unit is isa.Unit.VECTOR


def test_exp_within_1_ulp_over_dense_sweep() -> None:
    x = np.linspace(-87.0, 88.0, 2_000_001).astype(np.float32)  # step ~8.8e-5: every binade's rounding cases
    x = np.concatenate([x, np.linspace(-1, 1, 200_001).astype(np.float32), _normal_floats(100_000, 0, 0x3F000000)])
    err = sequences.ulp_error(sequences.exp(x), np.exp(x.astype(np.float64)))
    assert err.max() < 1.0, f"max {err.max():.3f} ulp at x = {x[err.argmax()]!r}"


def test_exp_subnormal_and_overflow_ranges() -> None:
    x = np.linspace(-104.0, -87.0, 200_001).astype(np.float32)  # results in the subnormal range
    err = sequences.ulp_error(sequences.exp(x), np.exp(x.astype(np.float64)))
    assert err.max() < 1.0  # in ulps of the (subnormal) result: a single rounding
    x = np.linspace(88.0, 89.0, 10_001).astype(np.float32)
    with np.errstate(over="ignore"):
        err = sequences.ulp_error(sequences.exp(x), np.exp(x.astype(np.float64)))
    assert err.max() < 1.0  # includes the switch to +inf at 88.7228


def test_exp_special_values() -> None:
    x = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 89.0, 1e30, -104.0, -1e30], np.float32)
    y = sequences.exp(x)
    assert np.isnan(y[0]) and y.view(np.uint32)[0] == 0x7FC00000
    assert list(y[1:]) == [np.inf, 0.0, 1.0, 1.0, np.inf, np.inf, 0.0, 0.0]


def test_reciprocal_within_1p3_ulp_over_normal_range() -> None:
    d = np.concatenate([_normal_floats(2_000_000, 0x00800000, 0x7E800000),
                        np.arange(0x3F800000, 0x40000000, 16, dtype=np.uint32).view(np.float32)])
    for sign in (1, -1):
        err = sequences.ulp_error(sequences.reciprocal(sign * d), sign / d.astype(np.float64))
        assert err.max() < 1.3, f"max {err.max():.3f} ulp at d = {d[err.argmax()]!r}"


def test_reciprocal_exact_on_powers_of_two_and_special_values() -> None:
    p = np.float32(2.0) ** np.arange(-126, 127, dtype=np.float32)
    assert np.array_equal(sequences.reciprocal(p), (1 / p.astype(np.float64)).astype(np.float32))
    d = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 2.0**127], np.float32)
    y = sequences.reciprocal(d)
    assert list(y[:4]) == [np.inf, -np.inf, 0.0, 0.0] and np.signbit(y[3])
    assert np.isnan(y[4]) and y[5] == 0.0  # |d| > 2^126: the subnormal result flushes to zero (documented)


def test_rsqrt_within_1p3_ulp_including_subnormals() -> None:
    x = np.concatenate([_normal_floats(2_000_000, 1, 0x7F800000),
                        np.arange(0x3F800000, 0x40800000, 16, dtype=np.uint32).view(np.float32)])
    err = sequences.ulp_error(sequences.rsqrt(x), 1 / np.sqrt(x.astype(np.float64)))
    assert err.max() < 1.3, f"max {err.max():.3f} ulp at x = {x[err.argmax()]!r}"


def test_rsqrt_special_values() -> None:
    x = np.array([0.0, -0.0, np.inf, -1.0, -np.inf, np.nan, 4.0, 0.25], np.float32)
    y = sequences.rsqrt(x)
    assert list(y[[0, 1, 2, 6, 7]]) == [np.inf, -np.inf, 0.0, 0.5, 2.0]
    assert np.isnan(y[3:6]).all() and (y[3:6].view(np.uint32) == 0x7FC00000).all()


def test_ulp_measures() -> None:
    one = np.float32(1.0)
    assert sequences.ulp_distance(one, np.nextafter(one, np.float32(2))) == 1
    assert sequences.ulp_distance(np.float32(-0.0), np.float32(0.0)) == 0
    assert sequences.ulp_distance(np.float32(np.nan), np.float32(np.nan)) == 0
    assert sequences.ulp_error(np.float32(1.0), 1.0 + 2.0**-24) == pytest.approx(0.5)


# ---- the simulator runs the same op list bit for bit ---------------------------------------------
def _straight_line(b: SeqBuilder, out: str) -> str:
    """A CTPU program: x from vmem rows 0..7, the sequence one op per bundle with its latency waited
    out, the result to rows 8..15. Constants are built with li/lih/vbcast; vregs are reused after a
    value's last read."""
    lines, regs = [], {}
    free = list(range(31, -1, -1))
    for name, bits in b.consts.items():
        regs[name] = free.pop()
        lines += [f"li s1, {bits & 0xFFFF}", f"lih s1, {bits >> 16}", f"vbcast v{regs[name]}, s1", "nop"]
    regs["x"] = free.pop()
    lines += [f"vld v{regs['x']}, s0, 0", "nop"]
    last = {s: i for i, op in enumerate(b.ops) for s in op.srcs}
    for i, op in enumerate(b.ops):
        srcs = [f"v{regs[s]}" for s in op.srcs]
        for s in set(op.srcs):
            if last[s] == i and s not in b.consts and s != out:
                free.append(regs[s])
        regs[op.dst] = free.pop()
        lines.append(f"{op.mnemonic} v{regs[op.dst]}, " + ", ".join(srcs))
        lines += ["nop"] * (isa.BY_MNEMONIC[op.mnemonic].latency - 1)
    lines += [f"vst v{regs[out]}, s0, 8", "halt"]
    return "\n".join(lines)


@pytest.mark.parametrize("fn", [sequences.exp, sequences.reciprocal, sequences.rsqrt],
                         ids=["exp", "reciprocal", "rsqrt"])
def test_simulator_matches_numpy_model(fn) -> None:
    b = fn.builder
    program = assemble(_straight_line(b, b.ops[-1].dst), "sequence.s")
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, -1.0, 2.0**-149, 2.0**-126, 2.0**127,
                         88.7, -103.9, 3e38, -3e38, 0.5, 1e-30], np.float32)
    values = np.concatenate([specials, RNG.normal(0, 30, 48).astype(np.float32),
                             _normal_floats(64, 1, 0x7F800000), -_normal_floats(64, 1, 0x7F800000)])
    for chunk in values.reshape(-1, 8, 8):
        sim = Simulator("small")
        sim.load(program)
        sim.vmem[0:8] = chunk.view(np.uint32)
        sim.run()
        got = sim.vmem[8:16].copy()
        assert np.array_equal(got, fn(chunk).view(np.uint32)), chunk
