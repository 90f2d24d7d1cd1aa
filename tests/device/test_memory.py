"""Memory: allocated/peak/stats, out-of-memory errors that name sizes and keep tensors, frees."""

from __future__ import annotations

import gc

import pytest
import torch

from torch_tpu_backend.runtime import ALIGN


def test_allocated_peak_and_stats() -> None:
    gc.collect()
    base = torch.ctpu.memory_allocated()
    torch.ctpu.reset_peak_memory_stats()
    assert torch.ctpu.max_memory_allocated() == base
    t = torch.empty(1000, device="ctpu")  # 4000 bytes, rounded up to the HBM alignment
    assert torch.ctpu.memory_allocated() == base + 4096
    del t
    assert torch.ctpu.memory_allocated() == base
    assert torch.ctpu.max_memory_allocated() == base + 4096
    stats = torch.ctpu.memory_stats()
    assert stats["allocated_bytes.all.current"] == base
    assert stats["allocated_bytes.all.peak"] == base + 4096
    assert stats["hbm_bytes"] == torch.ctpu.hbm_device().config.hbm_bytes
    torch.ctpu.reset_peak_memory_stats()
    assert torch.ctpu.max_memory_allocated() == base
    torch.ctpu.empty_cache()


def test_allocate_free_loops_return_to_baseline() -> None:
    gc.collect()
    base = torch.ctpu.memory_allocated()
    for n in (1, 100, 10_000, 3, 77_777):
        a = torch.randn(n, device="ctpu")
        b = (a * 2).sum()
        del a, b
    assert torch.ctpu.memory_allocated() == base


def test_out_of_memory_names_sizes_and_keeps_tensors() -> None:
    keep = torch.arange(64, dtype=torch.float32, device="ctpu")
    hbm = torch.ctpu.hbm_device().config.hbm_bytes
    base = torch.ctpu.memory_allocated()
    with pytest.raises(torch.OutOfMemoryError, match=rf"tried to allocate {hbm} bytes.*of {hbm} HBM bytes"):
        torch.empty(hbm // 4, device="ctpu")
    assert torch.ctpu.memory_allocated() == base
    assert torch.equal(keep.cpu(), torch.arange(64, dtype=torch.float32))
    assert torch.ctpu.memory_stats()["num_ooms"] >= 1
    assert isinstance(torch.OutOfMemoryError("x"), RuntimeError)


def test_filling_hbm_then_freeing_recovers() -> None:
    gc.collect()
    base = torch.ctpu.memory_allocated()
    blocks = []
    with pytest.raises(torch.OutOfMemoryError):
        while True:
            blocks.append(torch.empty(1 << 18, dtype=torch.uint8, device="ctpu"))
    assert len(blocks) > 4
    blocks.clear()
    assert torch.ctpu.memory_allocated() == base
    assert torch.empty(1 << 18, dtype=torch.uint8, device="ctpu").numel() == 1 << 18


def test_zero_size_tensors_take_no_hbm() -> None:
    base = torch.ctpu.memory_allocated()
    z = torch.empty(0, 5, device="ctpu")
    assert torch.ctpu.memory_allocated() == base and z.data_ptr() == 0
    assert ALIGN > 0
