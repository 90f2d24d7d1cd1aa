"""The runtime: one CTPU device per configuration (its HBM arena, its allocator, the runners launches run
on) and the launch of an `Executable` on it.

Device memory IS the simulated HBM: `CtpuDevice.hbm` is the numpy byte array the simulator's DMA reads and
writes. Everything that lives on the device (ctpu tensors, a compiled graph's workspace) is allocated in
it by `HbmAllocator`, and a launch passes HBM addresses to the program (device_sim.executable's argument
table), so a launch reads and writes tensors in place. Tensors in and out: torch_tpu_backend.ctpu_target.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from device_sim.config import HardwareConfig, get_config
from device_sim.executable import Executable, launch
from device_sim.profile import analyze, write_trace
from device_sim.runners import Runner, SimulatorRunner
from device_sim.simulator import RunStats
from torch_tpu_backend import stats as exec_stats
from torch_tpu_backend.resident import ResidentCopies

TARGETS = ("sim", "rtl", "ptx")
ALIGN = 256  # bytes; every HBM allocation starts on this boundary (DMA rows stay aligned)


def default_target() -> str:
    target = os.environ.get("CTPU_TARGET", "sim")
    if target not in TARGETS:
        raise ValueError(f"CTPU_TARGET={target!r}: expected one of {', '.join(TARGETS)}")
    return target


def default_config() -> str:
    return os.environ.get("CTPU_CONFIG", "small")


def _torch_out_of_memory() -> type[RuntimeError]:
    import torch  # here, not at the top: the rest of this module imports torch where it is used

    return torch.OutOfMemoryError


class HbmOutOfMemory(_torch_out_of_memory()):  # type: ignore[misc]
    """No free HBM range is large enough. Carries the sizes for the message.

    A `torch.OutOfMemoryError` (itself a RuntimeError), so that running out of HBM reads the same whether a
    ctpu tensor's allocation or a compiled launch's inputs and workspace hit it, as on any PyTorch device."""


class HbmAllocator:
    """First-fit allocator over [reserved, size) with coalescing frees. Addresses are HBM byte offsets.

    Thread-safe, and re-entrant in the one way that happens: a garbage collection inside `alloc` or `release`
    (any new tuple can start one) can free a ctpu tensor on the same thread, which calls `release` again
    while the free list is half changed; such a release is deferred until the change in progress is done.
    """

    def __init__(self, size: int, reserved: int = ALIGN) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(reserved, size - reserved)]  # (start, length), sorted
        self.used: dict[int, int] = {}
        self.allocated = 0
        self.peak = 0
        self.ooms = 0
        self._lock = threading.RLock()
        self._busy = False  # the free list is being changed (only ever true for the thread holding _lock)
        self._deferred: list[int] = []

    def alloc(self, nbytes: int) -> int:
        length = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            if self._busy:  # a finalizer run by a garbage collection inside alloc/release allocated HBM
                raise RuntimeError("ctpu: HBM allocation while this thread is changing the free list (from a "
                                   "finalizer run by a garbage collection inside an allocation or a free)")
            self._busy = True
            try:
                return self._take(nbytes, length)
            finally:
                self._end_change()

    def _end_change(self) -> None:
        """Carry out the releases deferred while the free list was changing (more may come meanwhile)."""
        try:
            while self._deferred:
                self._release(self._deferred.pop())
        finally:
            self._busy = False

    def _take(self, nbytes: int, length: int) -> int:
        for i, (start, free_len) in enumerate(self.free):
            if free_len >= length:
                if free_len == length:
                    del self.free[i]
                else:
                    self.free[i] = (start + length, free_len - length)
                self.used[start] = length
                self.allocated += length
                self.peak = max(self.peak, self.allocated)
                return start
        self.ooms += 1
        largest = max((f[1] for f in self.free), default=0)
        raise HbmOutOfMemory(f"CTPU out of memory: tried to allocate {nbytes} bytes; {self.allocated} bytes "
                             f"allocated of {self.size} HBM bytes, largest free block {largest} bytes")

    def uncount_oom(self) -> None:
        """The last out-of-memory is being answered by freeing cached HBM and trying again: the retry's
        outcome counts, not this one (num_ooms counts what callers see)."""
        with self._lock:
            self.ooms -= 1

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.allocated

    def snapshot(self) -> dict[str, int]:
        """A consistent view: bytes allocated, peak, live blocks, the largest free block, failed allocations."""
        with self._lock:
            return {"allocated": self.allocated, "peak": self.peak, "blocks": len(self.used),
                    "largest_free": max((n for _, n in self.free), default=0), "size": self.size,
                    "ooms": self.ooms}

    def release(self, addr: int) -> None:
        with self._lock:
            if self._busy:  # mid-change on this very thread (a garbage collection): free when it is done
                self._deferred.append(addr)
                return
            self._busy = True
            try:
                self._release(addr)
            finally:
                self._end_change()

    def _release(self, addr: int) -> None:
        length = self.used.pop(addr)
        self.allocated -= length
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
class CtpuDevice:
    """A CTPU: configuration, HBM arena + allocator, and the runners launches run on (the simulator owns
    the HBM array; the RTL runner copies it in and out)."""

    config: HardwareConfig
    simulator: SimulatorRunner = field(init=False)
    allocator: HbmAllocator = field(init=False)
    resident: ResidentCopies = field(init=False)  # host tensors' HBM copies, kept across launches
    lock: threading.Lock = field(default_factory=threading.Lock)
    profiled: int = 0  # launches profiled so far (numbers their traces)

    def __post_init__(self) -> None:
        self.simulator = SimulatorRunner(self.config)
        self.allocator = HbmAllocator(self.config.hbm_bytes)
        self.resident = ResidentCopies(self.allocator)

    @property
    def hbm(self) -> np.ndarray:
        return self.simulator.hbm

    def runner(self, target: str) -> Runner:
        if target == "sim":
            return self.simulator
        if target == "rtl":
            from device_sim.rtl.runner import RtlRunner

            return RtlRunner(self.config)
        raise ValueError(f"target {target!r} does not run CTPU binaries (ptx kernels launch on a GPU)")

    def launch(self, exe: Executable, input_addrs: Sequence[int], arena_addr: int, target: str = "sim",
               name: str = "kernel", max_cycles: int | None = None, profile_dir: str | None = None
               ) -> tuple[list[np.ndarray], RunStats]:
        """Run `exe` on `target` with its inputs at `input_addrs` and its arena at `arena_addr` (HBM is
        read and written in place); returns its outputs and statistics, and counts the launch. With
        `profile_dir` (target sim), the launch is profiled: its trace is written there as NAME_N.json and its
        Profile kept in the launch's statistics record."""
        profile = None
        with self.lock:
            if profile_dir is None:
                outputs, run_stats = launch(exe, self.runner(target), self.hbm, input_addrs, arena_addr, max_cycles)
            else:
                if target != "sim":
                    raise ValueError(f"profiling needs target 'sim' (the simulator records the trace), not {target!r}")
                sim = self.simulator.simulator
                sim.profile = True
                try:
                    outputs, run_stats = launch(exe, self.simulator, self.hbm, input_addrs, arena_addr, max_cycles)
                finally:
                    sim.profile = False
                assert sim.recording is not None
                profile = analyze(sim.recording, exe.summary.get("kernels"))
                self.profiled += 1
                folder = Path(profile_dir)
                folder.mkdir(parents=True, exist_ok=True)
                write_trace(profile, folder / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}_{self.profiled}.json")
        exec_stats.record_launch(exec_stats.LaunchRecord(name, target, run_stats, profile))
        return outputs, run_stats


def require_gpu() -> None:
    """The `ptx` target launches on a CUDA GPU; say clearly when there is none."""
    import torch

    import ptx_kernels

    if not torch.cuda.is_available():
        raise ptx_kernels.PtxLaunchError(ptx_kernels.NO_GPU)


def launch_ptx(kernel: Any, inputs: Sequence[Any]) -> list[Any]:
    """Launch one PTX kernel on CUDA tensors (the `ptx` target's launch), counted in the statistics."""
    import ptx_kernels

    require_gpu()
    outs = ptx_kernels.run(kernel, *inputs)
    exec_stats.record_kernel_launch()
    return outs


_DEVICES: dict[str, CtpuDevice] = {}
_DEVICES_LOCK = threading.Lock()


def get_device(config: str | HardwareConfig | None = None) -> CtpuDevice:
    """The process's CTPU device of a configuration (created on first use)."""
    cfg = get_config(config or default_config())
    with _DEVICES_LOCK:
        if cfg.name not in _DEVICES:
            _DEVICES[cfg.name] = CtpuDevice(cfg)
        return _DEVICES[cfg.name]


def devices() -> list[CtpuDevice]:
    """The devices made so far (one per configuration used)."""
    with _DEVICES_LOCK:
        return list(_DEVICES.values())


def to_numpy_bits(array: Any) -> np.ndarray:
    """A contiguous numpy array of a tensor's values, bf16 as uint16 bits (numpy has no bf16). It shares memory
    with a contiguous CPU tensor (copy it to keep the values of a tensor that changes later)."""
    import torch

    if isinstance(array, torch.Tensor):
        t = array.detach().cpu().contiguous()  # copy out first: .contiguous() on a ctpu tensor is an eager op
        return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return np.ascontiguousarray(array)


