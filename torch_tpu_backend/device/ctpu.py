"""`torch.ctpu`: the device module of the ctpu device (registered by torch_tpu_backend.device.register()).

    torch.ctpu.is_available(), device_count(), current_device(), set_device(0), synchronize()
    with torch.ctpu.device(0): ...                        # what torch.load / pickle enter to move storages
    torch.ctpu.manual_seed(0), get_rng_state(), set_rng_state(state)
    torch.ctpu.memory_allocated(), max_memory_allocated(), reset_peak_memory_stats(), memory_stats()
    torch.ctpu.stats.last(), torch.ctpu.stats.reset()    # execution statistics (torch_tpu_backend.stats)
"""

from __future__ import annotations

from types import TracebackType

import torch

from torch_tpu_backend import stats
from torch_tpu_backend.device import _C
from torch_tpu_backend.device.fallback import CtpuFallbackWarning
from torch_tpu_backend.device.memory import (
    DeviceLike,
    _check_device,
    empty_cache,
    hbm_address,
    hbm_device,
    max_memory_allocated,
    memory_allocated,
    memory_stats,
    reset_peak_memory_stats,
)
from torch_tpu_backend.device.random import (
    _is_in_bad_fork,
    default_generator,
    get_offset,
    get_rng_state,
    get_rng_state_all,
    initial_seed,
    manual_seed,
    manual_seed_all,
    seed,
    seed_all,
    set_offset,
    set_rng_state,
    set_rng_state_all,
)

__all__ = [
    "CtpuFallbackWarning", "_is_in_bad_fork", "current_device", "default_generator", "device", "device_count",
    "empty_cache", "get_amp_supported_dtype", "get_offset", "get_rng_state", "get_rng_state_all", "hbm_address",
    "hbm_device", "initial_seed", "is_available", "is_initialized", "manual_seed", "manual_seed_all",
    "max_memory_allocated", "memory_allocated", "memory_stats", "reset_peak_memory_stats", "seed", "seed_all",
    "set_device", "set_offset", "set_rng_state", "set_rng_state_all", "stats", "synchronize",
]


def is_available() -> bool:
    return True  # the simulator needs nothing but the CPU


def is_initialized() -> bool:
    return True


def device_count() -> int:
    return _C._device_count()


def current_device() -> int:
    return _C._current_device()


def set_device(device: DeviceLike) -> None:
    _check_device(device)


class device:
    """Context manager making a ctpu device current, like `torch.cuda.device` (the device-module contract:
    torch.load and unpickling enter `torch.ctpu.device(location)` to move a storage here). None or a
    negative index is a no-op."""

    def __init__(self, device: DeviceLike) -> None:
        if isinstance(device, int | None):
            self.idx = -1 if device is None else device
        else:
            d = torch.device(device)
            if d.type != "ctpu":
                raise ValueError(f"expected a ctpu device, got {d}")
            self.idx = -1 if d.index is None else d.index
        self.prev_idx = -1

    def __enter__(self) -> None:
        if self.idx >= 0:
            self.prev_idx = _C._current_device()
            _C._set_device(self.idx)  # checks the index

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.prev_idx >= 0:
            _C._set_device(self.prev_idx)


def synchronize(device: DeviceLike = None) -> None:
    """Wait for a launch in flight on another thread; launches are synchronous, so that is all there is."""
    _check_device(device)
    with hbm_device().lock:
        pass


def get_amp_supported_dtype() -> list[torch.dtype]:
    # bf16 is the MXU's input type and autocast's default here; fp16 is accepted as on any device (torch
    # otherwise warns and silently runs autocast(dtype=float16) in float32): fp16 tensors are supported,
    # their ops run where codegen takes fp16 and on the CPU fallback elsewhere.
    return [torch.bfloat16, torch.float16]
