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
    """First-fit allocator over [reserved, size) with coalescing frees. Addresses are HBM byte offsets.

    Thread-safe, and re-entrant in the one way that happens: a garbage collection inside `alloc` can free
    a ctpu tensor on the same thread; such a release is deferred until the allocation is done.
    """

    def __init__(self, size: int, reserved: int = ALIGN) -> None:
        self.size = size
        self.free: list[tuple[int, int]] = [(reserved, size - reserved)]  # (start, length), sorted
        self.used: dict[int, int] = {}
        self.allocated = 0
        self.peak = 0
        self._lock = threading.RLock()
        self._busy = False
        self._deferred: list[int] = []

    def alloc(self, nbytes: int) -> int:
        length = max(ALIGN, -(-nbytes // ALIGN) * ALIGN)
        with self._lock:
            self._busy = True
            try:
                return self._take(nbytes, length)
            finally:
                self._busy = False
                while self._deferred:
                    self._release(self._deferred.pop())

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
        largest = max((f[1] for f in self.free), default=0)
        raise HbmOutOfMemory(f"CTPU out of memory: tried to allocate {nbytes} bytes; {self.allocated} bytes "
                             f"allocated of {self.size} HBM bytes, largest free block {largest} bytes")

    def reset_peak(self) -> None:
        with self._lock:
            self.peak = self.allocated

    def snapshot(self) -> dict[str, int]:
        """A consistent view: bytes allocated, peak, live blocks and the largest free block."""
        with self._lock:
            return {"allocated": self.allocated, "peak": self.peak, "blocks": len(self.used),
                    "largest_free": max((n for _, n in self.free), default=0), "size": self.size}

    def release(self, addr: int) -> None:
        with self._lock:
            if self._busy:  # mid-allocation on this very thread: free when it is done
                self._deferred.append(addr)
            else:
                self._release(addr)

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
                result.raise_if_trapped()
                self.sim.hbm[:] = result.hbm
                stats = result.stats
            else:
                raise ValueError(f"target {target!r} does not run CTPU binaries (ptx kernels launch on a GPU)")
        from torch_tpu_backend import stats as exec_stats

        exec_stats.record_launch(LaunchRecord(name, target, stats))
        return stats


def require_gpu() -> None:
    """The `ptx` target launches on a CUDA GPU; say clearly when there is none."""
    import torch

    import ptx_kernels

    if not torch.cuda.is_available():
        raise ptx_kernels.PtxLaunchError(ptx_kernels.NO_GPU)


def launch_ptx(kernel: Any, inputs: Sequence[Any]) -> list[Any]:
    """Launch one PTX kernel on CUDA tensors (the `ptx` target's launch), counted in the statistics."""
    import ptx_kernels
    from torch_tpu_backend import stats as exec_stats

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


def to_numpy_bits(array: Any) -> np.ndarray:
    """A contiguous numpy copy of a CPU tensor or array, bf16 as uint16 bits (numpy has no bf16)."""
    import torch

    if isinstance(array, torch.Tensor):
        t = array.detach().cpu().contiguous()  # copy out first: .contiguous() on a ctpu tensor is an eager op
        return t.view(torch.uint16).numpy() if t.dtype == torch.bfloat16 else t.numpy()
    return np.ascontiguousarray(array)


def run_compiled(compiled: Any, tensors: Sequence[Any], target: str, config: str, name: str,
                 out_dtypes: Sequence[Any] | None = None) -> list[Any]:
    """Launch a codegen.CompiledGraph. ctpu tensors already in this device's HBM are read in place (their
    addresses are the kernel arguments); other inputs are copied into HBM for the launch. The graph's arena
    is allocated for the launch and freed after. Outputs are ctpu tensors, written in HBM, when any input
    was a ctpu tensor, else CPU tensors."""
    import torch

    device = get_device(config)
    allocations: list[int] = []
    on_device = False
    try:
        input_addrs = []
        for placement, tensor in zip(compiled.inputs, tensors, strict=True):
            addr = _in_place_address(device, placement, tensor)
            if addr is None:
                bits = compiled.input_bits(placement, to_numpy_bits(tensor))
                addr = device.allocator.alloc(bits.nbytes)
                allocations.append(addr)
                device.hbm[addr : addr + bits.nbytes] = bits.reshape(-1).view(np.uint8)
            else:
                on_device = True
            input_addrs.append(addr)
        arena = device.allocator.alloc(max(compiled.arena_bytes, 1))
        allocations.append(arena)
        device.launch(compiled.program, compiled.launch(device.hbm, input_addrs, arena), target=target, name=name)
        arrays = compiled.read_outputs(device.hbm, input_addrs, arena)
    finally:
        for addr in allocations:
            device.allocator.release(addr)
    dtypes = list(out_dtypes) if out_dtypes is not None else [torch.float32] * len(arrays)
    if on_device:
        return [_device_tensor(device, a, d) for a, d in zip(arrays, dtypes, strict=True)]
    return [torch.from_numpy(a).to(d) for a, d in zip(arrays, dtypes, strict=True)]


_DTYPES = {"f32": "float32", "bf16": "bfloat16"}


def _in_place_address(device: CtpuDevice, placement: Any, tensor: Any) -> int | None:
    """The HBM address of a ctpu tensor the program can read as it is (same device, dtype, contiguous)."""
    if getattr(tensor, "device", None) is None or tensor.device.type != "ctpu":
        return None
    from torch_tpu_backend.device import memory

    if memory.hbm_device() is not device or not tensor.is_contiguous():
        return None
    if str(tensor.dtype).removeprefix("torch.") != _DTYPES.get(placement.dtype):
        return None
    return memory.hbm_address(tensor)


def _device_tensor(device: CtpuDevice, values: np.ndarray, dtype: Any) -> Any:
    """A new ctpu tensor holding `values` (fp32), written straight into its HBM bytes."""
    import torch

    from device_sim import numerics
    from torch_tpu_backend.device import memory

    out = torch.empty(values.shape, dtype=dtype, device="ctpu")
    if dtype == torch.bfloat16:
        bits = numerics.f32_to_bf16_bits(values)
    else:
        bits = np.ascontiguousarray(values).astype(str(dtype).removeprefix("torch."), copy=False)
    addr = memory.hbm_address(out)
    device.hbm[addr : addr + bits.nbytes] = bits.reshape(-1).view(np.uint8)
    return out
