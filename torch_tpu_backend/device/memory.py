"""Device memory: ctpu tensors live in the runtime's HBM arena, allocated by the runtime's HbmAllocator.

The C++ allocator (csrc/ctpu/allocator.cpp) calls `_alloc` / `_free` below for every allocation, so the
runtime's `HbmAllocator` stays the one record of what HBM holds (tensors and compiled graphs' workspaces
alike), and `memory_allocated()` is simply what it reports. Nothing is cached: a freed tensor's bytes go
straight back to the HbmAllocator.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from torch_tpu_backend.runtime import CtpuDevice

DeviceLike = torch.device | str | int | None

_device: CtpuDevice | None = None
_counts = {"num_alloc": 0, "num_free": 0}


def hbm_device() -> CtpuDevice:
    """The CTPU whose HBM holds ctpu tensors: `runtime.get_device()` (configuration from CTPU_CONFIG,
    default `small`). On first use its arena (the simulator's HBM array) is handed to the C++ allocator."""
    global _device
    if _device is None:
        from torch_tpu_backend import runtime
        from torch_tpu_backend.device import _C

        device = runtime.get_device()
        _C._set_arena(device.hbm.ctypes.data, device.hbm.nbytes)
        _device = device
    return _device


def hbm_address(tensor: torch.Tensor) -> int:
    """The HBM byte address of a ctpu tensor's first element (what a kernel launch gets as an argument). An
    empty tensor has no storage (a null data pointer): it gets 0, where a program reads and writes nothing."""
    if tensor.device.type != "ctpu":
        raise ValueError(f"hbm_address needs a ctpu tensor, got one on {tensor.device}")
    if tensor.data_ptr() == 0:
        return 0
    return tensor.data_ptr() - hbm_device().hbm.ctypes.data


def _alloc(nbytes: int) -> int:
    """Called by the C++ allocator (GIL held): an HBM offset for `nbytes`, or runtime.HbmOutOfMemory (a
    torch.OutOfMemoryError)."""
    device = hbm_device()
    try:
        offset = device.allocator.alloc(nbytes)
    except Exception as err:
        from torch_tpu_backend.runtime import HbmOutOfMemory

        # HBM full: the copies compiled launches keep of CPU tensors can go, unless a launch on another
        # thread is reading them (never wait for it here: this runs inside the C++ allocator)
        if not isinstance(err, HbmOutOfMemory) or not device.resident.launch_lock.acquire(blocking=False):
            raise
        try:
            freed = device.resident.evict()
        finally:
            device.resident.launch_lock.release()
        if not freed:
            raise
        device.allocator.uncount_oom()
        offset = device.allocator.alloc(nbytes)
    _counts["num_alloc"] += 1
    return offset


def _free(offset: int) -> None:
    """Called by the C++ allocator when a ctpu storage dies (the allocator defers it if mid-allocation)."""
    hbm_device().allocator.release(offset)
    _counts["num_free"] += 1


def install() -> None:
    from torch_tpu_backend.device import _C

    _C._install_allocator(_alloc, _free, torch.OutOfMemoryError)


def _check_device(device: DeviceLike) -> None:
    if device is None:
        return
    d = torch.device("ctpu", device) if isinstance(device, int) else torch.device(device)
    if d.type != "ctpu" or d.index not in (None, 0):
        raise ValueError(f"expected the ctpu device (ctpu:0), got {d}")


def memory_allocated(device: DeviceLike = None) -> int:
    """HBM bytes in use (allocations are rounded up to runtime.ALIGN bytes)."""
    _check_device(device)
    return hbm_device().allocator.allocated


def max_memory_allocated(device: DeviceLike = None) -> int:
    """The peak of memory_allocated() since the start or the last reset_peak_memory_stats()."""
    _check_device(device)
    return hbm_device().allocator.peak


def reset_peak_memory_stats(device: DeviceLike = None) -> None:
    _check_device(device)
    hbm_device().allocator.reset_peak()


def memory_stats(device: DeviceLike = None) -> dict[str, Any]:
    """CUDA-style keys where they apply: allocated/reserved bytes (current, peak), allocation counts, OOMs."""
    _check_device(device)
    snap = hbm_device().allocator.snapshot()
    return {
        "allocated_bytes.all.current": snap["allocated"],
        "allocated_bytes.all.peak": snap["peak"],
        "reserved_bytes.all.current": snap["size"],  # the whole arena is the device's from the start
        "active.all.current": snap["blocks"],
        "num_alloc": _counts["num_alloc"],
        "num_free": _counts["num_free"],
        "num_ooms": snap["ooms"],  # tensors' and compiled launches' allocations alike
        "hbm_bytes": snap["size"],
        "largest_free_block": snap["largest_free"],
    }


def empty_cache() -> None:
    """Drop the HBM copies compiled launches keep of CPU tensors (a CPU model's weights: uploaded again on
    the next call). Freed ctpu tensors need nothing: their HBM goes straight back to the allocator."""
    from torch_tpu_backend import runtime

    for device in runtime.devices():
        with device.resident.launch_lock:
            device.resident.evict()
