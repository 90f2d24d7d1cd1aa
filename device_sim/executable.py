"""What the compiler hands the runtime: a program plus how to lay out its launch, as plain data.

    exe = codegen.compile_graph(gm, examples, config="small")        # an Executable
    outputs, stats = run_fresh(exe, [x, w], SimulatorRunner("small"))  # numpy in, numpy out

Launch ABI: one launch register, s1 = the HBM byte address of the *arena*, which holds every intermediate
and every output (at their buffers' offsets) and starts with the *argument table*: the HBM addresses of the
I inputs (in order) and of the arena itself, the values of the V `value_inputs` (runtime sizes), then the
words of `address_table` (the layer loops' per-repetition buffer addresses), all uint32. The program's entry
copies the first I + 1 + V words to vmem; each kernel loads the entries it uses.

Everything here is numpy: packing inputs into the bits the program expects, the argument table, reading
outputs back through their views. The runtime, the CLI and the tests all launch through `launch`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_sim import numerics
from device_sim.config import HardwareConfig, get_config
from device_sim.program import Program
from device_sim.runners import Runner
from device_sim.simulator import CtpuTrap, RunStats

ARENA_REGISTER = 1  # s1
ALIGN = 64  # bytes: buffers in the arena and inputs of a fresh HBM image start on this boundary
NUMPY_DTYPES: dict[str, Any] = {"f32": np.float32, "bf16": np.uint16, "i32": np.int32, "i1": np.int32}


@dataclass(frozen=True)
class ArgSpec:
    """A graph input as the program reads it: a dense row-major tensor of `dtype` ("f32", "bf16" (bits),
    "i32" (int64 narrowed), "i1" (bools as 0 / ~0 words))."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class OutputView:
    """A graph output: `shape` elements at `offset` with element `strides` in an input (`input` = its index)
    or in the arena (`input` = None, `base` = the buffer's byte offset in the arena)."""

    shape: tuple[int, ...]
    strides: tuple[int, ...]
    offset: int
    dtype: str
    nbytes: int
    input: int | None = None
    base: int = 0


@dataclass
class Executable:
    """One compiled graph: its program, its launch layout, and (for dumps and reports) the text of every
    compiler stage and a summary. Plain data: nothing here calls back into the compiler."""

    config: str
    program: Program
    inputs: list[ArgSpec]
    outputs: list[OutputView]
    arena_bytes: int
    stages: dict[str, str] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    mutated_inputs: list[int] = field(default_factory=list)  # inputs the program writes in place (by index)
    # words after the argument table, each the address (argument-table entry's address + byte offset) of a
    # buffer: the per-repetition address tables of the program's layer loops
    address_table: list[tuple[int, int]] = field(default_factory=list)
    # inputs (0-d integers: the valid lengths of a dynamic-shape bucket) whose values follow the arena's
    # entry in the argument table, read by kernels whose row counts are runtime values
    value_inputs: list[int] = field(default_factory=list)

    @property
    def hardware(self) -> HardwareConfig:
        return get_config(self.config)


class InputRangeError(ValueError):
    """An input's values cannot be represented as the program reads them (int64 beyond int32), or an index
    among them is out of range (the program trapped on the poison address its check gave the index)."""


def pack_input(spec: ArgSpec, x: Any) -> np.ndarray:
    """An input as the bits the program expects in HBM (fp32; bf16 as uint16; integers narrowed to int32;
    bools as 0 / ~0 int32 masks), flat bytes."""
    x = np.asarray(x)
    if tuple(x.shape) != spec.shape:
        raise ValueError(f"input {spec.name}: shape {tuple(x.shape)}, the program was compiled for {spec.shape}")
    if spec.dtype == "i1":
        bits = np.where(x != 0, -1, 0).astype(np.int32)
    elif spec.dtype == "i32":
        if x.size and (x.max() > np.iinfo(np.int32).max or x.min() < np.iinfo(np.int32).min):
            raise InputRangeError(f"input {spec.name}: integer values do not fit int32 (the CTPU narrows "
                                  "int64 tensors to int32)")
        bits = np.ascontiguousarray(x, dtype=np.int32)
    elif spec.dtype == "bf16":
        bits = np.ascontiguousarray(x) if x.dtype == np.uint16 else \
            numerics.f32_to_bf16_bits(np.ascontiguousarray(x, dtype=np.float32))
    else:
        bits = np.ascontiguousarray(x, dtype=np.float32)
    return bits.reshape(-1).view(np.uint8)


def argument_table(exe: Executable, input_addrs: Sequence[int], arena_addr: int, hbm: np.ndarray) -> np.ndarray:
    """The argument table's bytes (written at the start of the arena), followed by the address table. The
    value inputs' words are read from `hbm`, where the inputs already are."""
    if len(input_addrs) != len(exe.inputs):
        raise ValueError(f"the program has {len(exe.inputs)} inputs, {len(input_addrs)} addresses were given")
    values = [int(hbm[input_addrs[i]: input_addrs[i] + 4].view(np.uint32)[0]) for i in exe.value_inputs]
    entries = [*input_addrs, arena_addr, *values]
    return np.array([*entries, *(entries[e] + off for e, off in exe.address_table)], dtype=np.uint32).view(np.uint8)


def read_output(hbm: np.ndarray, view: OutputView, input_addrs: Sequence[int], arena_addr: int) -> np.ndarray:
    """One output from HBM bytes: fp32 (bf16 widened exactly), int32, or bool."""
    base = input_addrs[view.input] if view.input is not None else arena_addr + view.base
    flat = hbm[base : base + view.nbytes].view(NUMPY_DTYPES[view.dtype])
    if view.dtype == "bf16":
        flat = numerics.bf16_bits_to_f32(flat)
    item = flat.itemsize
    strided = np.lib.stride_tricks.as_strided(flat[view.offset:], view.shape, tuple(s * item for s in view.strides))
    out = np.array(strided)
    return np.asarray(out != 0) if view.dtype == "i1" else out  # a 0-d compare gives a numpy scalar


def launch(exe: Executable, runner: Runner, hbm: np.ndarray, input_addrs: Sequence[int], arena_addr: int,
           max_cycles: int | None = None) -> tuple[list[np.ndarray], RunStats]:
    """Run `exe` on `runner` over `hbm` (the device's bytes, read and written in place), its inputs already
    at `input_addrs`, its arena at `arena_addr`; returns (outputs, statistics). The one launch path."""
    table = argument_table(exe, input_addrs, arena_addr, hbm)
    hbm[arena_addr : arena_addr + table.nbytes] = table
    try:
        stats = runner.run(exe.program, hbm, {ARENA_REGISTER: arena_addr}, max_cycles)
    except CtpuTrap as e:
        if e.index_range:
            raise InputRangeError(f"an index out of range ({e})") from e
        raise
    return [read_output(hbm, v, input_addrs, arena_addr) for v in exe.outputs], stats


def stage(exe: Executable, inputs: Sequence[Any]) -> tuple[np.ndarray, list[int], int, dict[int, int]]:
    """A fresh HBM image for one launch: inputs packed from address 0, the arena after them with its
    argument table. Returns (HBM bytes, input addresses, arena address, launch registers)."""
    data = [pack_input(spec, x) for spec, x in zip(exe.inputs, inputs, strict=True)]
    addrs, end = [], 0
    for d in data:
        addrs.append(end)
        end += -(-d.nbytes // ALIGN) * ALIGN
    hw = exe.hardware
    if end + exe.arena_bytes > hw.hbm_bytes:
        raise MemoryError(f"the program needs {end + exe.arena_bytes} bytes of HBM; {hw.name} has {hw.hbm_bytes}")
    hbm = np.zeros(hw.hbm_bytes, dtype=np.uint8)
    for a, d in zip(addrs, data, strict=True):
        hbm[a : a + d.nbytes] = d
    table = argument_table(exe, addrs, end, hbm)
    hbm[end : end + table.nbytes] = table
    return hbm, addrs, end, {ARENA_REGISTER: end}


def run_fresh(exe: Executable, inputs: Sequence[Any], runner: Runner,
              max_cycles: int | None = None) -> tuple[list[np.ndarray], RunStats]:
    """Launch on a fresh HBM image (see `stage`): numpy inputs in, numpy outputs and statistics out."""
    hbm, addrs, arena, _ = stage(exe, inputs)
    return launch(exe, runner, hbm, addrs, arena, max_cycles)
