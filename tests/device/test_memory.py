"""Memory: allocated/peak/stats, out-of-memory errors that name sizes and keep tensors, frees."""

from __future__ import annotations

import gc
import itertools
from typing import Any

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


def test_a_compiled_launch_out_of_hbm_raises_torch_out_of_memory() -> None:
    gc.collect()
    f = torch.compile(lambda t: t * 2.0 + 1.0, backend="ctpu")
    x = torch.randn(64, 64)  # a CPU input: the launch copies it into HBM
    torch.testing.assert_close(f(x), x * 2.0 + 1.0)
    ooms = torch.ctpu.memory_stats()["num_ooms"]
    blocks = []
    for size in (1 << 16, ALIGN):  # fill HBM to the last aligned block
        with pytest.raises(torch.OutOfMemoryError):
            while True:
                blocks.append(torch.empty(size, dtype=torch.uint8, device="ctpu"))
    with pytest.raises(torch.OutOfMemoryError, match="CTPU out of memory: tried to allocate"):
        f(x)
    assert torch.ctpu.memory_stats()["num_ooms"] == ooms + 3  # the two fills and the launch
    blocks.clear()
    torch.testing.assert_close(f(x), x * 2.0 + 1.0)


def test_frees_made_by_a_garbage_collection_inside_the_allocator_wait_for_it() -> None:
    """A collection can start inside alloc or release (at any new tuple) and free a ctpu tensor on the same
    thread: that release must wait until the free-list change in progress is done (inside release it used
    to run in the middle of it, and the block being released was lost)."""
    from torch_tpu_backend.runtime import HbmAllocator

    allocator = HbmAllocator(1 << 20)
    addrs = [allocator.alloc(ALIGN) for _ in range(6)]
    finalized = [addrs[1], addrs[3]]  # what a finalizer run by the collector gives back

    class CollectingList(list[tuple[int, int]]):
        """The free list, with a collection (that frees one block) where the allocator changes it."""

        def _collect(self) -> None:
            if finalized:
                allocator.release(finalized.pop())

        def append(self, item: tuple[int, int]) -> None:  # release's change
            self._collect()
            super().append(item)

        def __setitem__(self, index: Any, item: Any) -> None:  # alloc's changes
            self._collect()
            super().__setitem__(index, item)

        def __delitem__(self, index: Any) -> None:
            self._collect()
            super().__delitem__(index)

    allocator.free = CollectingList(allocator.free)
    allocator.release(addrs[0])
    allocator.free = CollectingList(allocator.free)
    extra = allocator.alloc(ALIGN)
    assert not finalized
    live = sorted([extra, addrs[2], *addrs[4:]])
    assert allocator.used == dict.fromkeys(live, ALIGN) and allocator.allocated == len(live) * ALIGN
    spans = sorted([(a, ALIGN) for a in live] + list(allocator.free))
    assert all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))  # no overlap
    assert sum(n for _, n in spans) == (1 << 20) - ALIGN  # every byte but the reserved block accounted for
