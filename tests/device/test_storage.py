"""Storage: ctpu tensors live in the simulator's HBM array; a launch (or anyone) writing HBM is seen."""

from __future__ import annotations

import numpy as np
import torch

from torch_tpu_backend.device.memory import hbm_address, hbm_device


def _arena() -> tuple[int, int]:
    hbm = hbm_device().hbm
    return hbm.ctypes.data, hbm.nbytes


def test_data_ptr_is_in_the_hbm_arena() -> None:
    base, size = _arena()
    t = torch.randn(10, 10, device="ctpu")
    assert base < t.data_ptr() and t.data_ptr() + t.nbytes <= base + size
    assert hbm_address(t) == t.data_ptr() - base
    assert hbm_address(t[3]) == hbm_address(t) + 3 * 10 * 4  # views point into the same HBM


def test_writing_hbm_is_visible_in_the_tensor() -> None:
    t = torch.zeros(8, device="ctpu")
    values = np.arange(8, dtype=np.float32)
    hbm_device().simulator.simulator.write_hbm(hbm_address(t), values)  # as a DMA would
    assert torch.equal(t.cpu(), torch.from_numpy(values))


def test_writing_the_tensor_is_visible_in_hbm() -> None:
    t = torch.zeros(4, 4, device="ctpu")
    t[1:3, 1:3] = 7.0
    got = hbm_device().simulator.simulator.read_hbm(hbm_address(t), (4, 4), np.float32)
    expect = np.zeros((4, 4), np.float32)
    expect[1:3, 1:3] = 7.0
    np.testing.assert_array_equal(got, expect)


def test_storage_api() -> None:
    s = torch.UntypedStorage(64, device="ctpu")
    assert s.device.type == "ctpu" and s.nbytes() == 64
    t = torch.arange(4, dtype=torch.float32, device="ctpu")
    storage = t.untyped_storage()
    storage.resize_(32)  # grows in HBM, keeping the bytes
    assert storage.nbytes() == 32
    assert torch.equal(t.cpu(), torch.arange(4.0))  # t follows its storage to the new block
    alias = torch.empty(0, device="ctpu").set_(storage, 1, (3,), (1,))
    assert torch.equal(alias.cpu(), torch.arange(1.0, 4.0))
