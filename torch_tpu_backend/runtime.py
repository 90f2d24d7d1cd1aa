"""The runtime: one CTPU device (its HBM arena and the target launches run on) and kernel launches.

Device memory IS the simulated HBM: `CtpuDevice.hbm` is the numpy byte array the simulator's DMA reads and
writes. Everything that lives on the device (ctpu tensors, a compiled graph's workspace) is allocated in
it by `HbmAllocator`, and a launch passes HBM addresses to the program as kernel arguments (s1..), so a
launch reads and writes tensors in place.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_sim.config import HardwareConfig, get_config
from device_sim.program import Program
from device_sim.simulator import RunStats, Simulator

TARGETS = ("sim", "rtl", "ptx")
ALIGN = 256  # bytes; every HBM allocation starts on this boundary (DMA rows stay aligned)


def default_target() -> str:
    target = os.environ.get("CTPU_TARGET", "sim")
    if target not in TARGETS:
        raise ValueError(f"CTPU_TARGET={target!r}: expected one of {', '.join(TARGETS)}")
    return target


def default_config() -> str:
    return os.environ.get("CTPU_CONFIG", "small")


class HbmOutOfMemory(RuntimeError):
    """No free HBM range is large enough. Carries the sizes for the message."""


class HbmAllocator:
    """First-fit allocator over [reserved, size) with coalescing frees. Addresses are HBM byte offsets."""

    def __init__(self, size: int, reserved: int = ALIGN) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(reserved, size - reserved)]  # (start, length), sorted
        self.used: dict[int, int] = {}
        self.peak = 0

    @property
    def allocated(self) -> int:
        return sum(self.used.values())

    def alloc(self, nbytes: int) -> int:
        length = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        for i, (start, free_len) in enumerate(self.free):
            if free_len >= length:
                if free_len == length:
                    del self.free[i]
                else:
                    self.free[i] = (start + length, free_len - length)
                self.used[start] = length
                self.peak = max(self.peak, self.allocated)
                return start
        largest = max((f[1] for f in self.free), default=0)
        raise HbmOutOfMemory(f"CTPU out of memory: tried to allocate {nbytes} bytes; {self.allocated} bytes "
                             f"allocated of {self.size} HBM bytes, largest free block {largest} bytes")

    def release(self, addr: int) -> None:
        length = self.used.pop(addr)
        self.free.append((addr, length))
        self.free.sort()
        merged: list[tuple[int, int]] = []
        for start, n in self.free:
            if merged and merged[-1][0] + merged[-1][1] == start:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((start, n))
        self.free = merged


@dataclass
class LaunchRecord:
    name: str
    target: str
    stats: RunStats


@dataclass
class CtpuDevice:
    """A CTPU: configuration, HBM arena + allocator, and the simulator that runs launches on it."""

    config: HardwareConfig
    sim: Simulator = field(init=False)
    allocator: HbmAllocator = field(init=False)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.sim = Simulator(self.config)
        self.allocator = HbmAllocator(self.config.hbm_bytes)

    @property
    def hbm(self) -> np.ndarray:
        return self.sim.hbm

    def launch(self, program: Program, args: dict[int, int], target: str = "sim", name: str = "kernel",
               max_cycles: int | None = None) -> RunStats:
        """Run `program` with kernel arguments in s1.. on `target`; HBM is read and written in place."""
        with self.lock:
            if target == "sim":
                if max_cycles is not None:
                    self.sim.max_cycles = max_cycles
                self.sim.load(program)
                stats = self.sim.run(args=args)
            elif target == "rtl":
                from device_sim.rtl.runner import run_on_rtl

                result = run_on_rtl(program, self.sim.hbm, config=self.config, args=args)
                self.sim.hbm[:] = result.hbm
                stats = result.stats
            else:
                raise ValueError(f"target {target!r} does not run CTPU binaries (ptx kernels launch on a GPU)")
        from torch_tpu_backend import stats as exec_stats

        exec_stats.record_launch(LaunchRecord(name, target, stats))
        return stats


_DEVICES: dict[str, CtpuDevice] = {}
_DEVICES_LOCK = threading.Lock()


def get_device(config: str | HardwareConfig | None = None) -> CtpuDevice:
    """The process's CTPU device of a configuration (created on first use)."""
    cfg = get_config(config or default_config())
    with _DEVICES_LOCK:
        if cfg.name not in _DEVICES:
            _DEVICES[cfg.name] = CtpuDevice(cfg)
        return _DEVICES[cfg.name]


def to_numpy_bits(array: Any) -> np.ndarray:
    """A contiguous numpy copy of a CPU tensor or array, bf16 as uint16 bits (numpy has no bf16)."""
    import torch

    if isinstance(array, torch.Tensor):
        t = array.detach().contiguous().cpu()
        return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return np.ascontiguousarray(array)


def run_compiled(compiled: Any, tensors: Sequence[Any], target: str, config: str, name: str,
                 out_dtypes: Sequence[Any] | None = None) -> list[Any]:
    """Launch a codegen.CompiledGraph on a device: inputs and the graph's arena are allocated in HBM for
    the launch (and freed after), outputs are read back as CPU tensors of the expected dtypes."""
    import torch

    device = get_device(config)
    allocations: list[int] = []
    try:
        input_addrs = []
        for placement, tensor in zip(compiled.inputs, tensors, strict=True):
            bits = compiled.input_bits(placement, to_numpy_bits(tensor))
            addr = device.allocator.alloc(bits.nbytes)
            allocations.append(addr)
            device.hbm[addr : addr + bits.nbytes] = bits.reshape(-1).view(np.uint8)
            input_addrs.append(addr)
        arena = device.allocator.alloc(max(compiled.arena_bytes, 1))
        allocations.append(arena)
        device.launch(compiled.program, compiled.launch_args(input_addrs, arena), target=target, name=name)
        arrays = compiled.read_outputs(device.hbm, input_addrs, arena)
    finally:
        for addr in allocations:
            device.allocator.release(addr)
    outs = [torch.from_numpy(a) for a in arrays]
    if out_dtypes is not None:
        outs = [o.to(d) for o, d in zip(outs, out_dtypes, strict=True)]
    return outs
