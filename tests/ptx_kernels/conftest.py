"""Markers for the PTX tests: `gpu` tests need an NVIDIA Hopper GPU and cuda-python; they skip elsewhere."""

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA Hopper GPU (sm_90) with CUDA and cuda-python")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
        return
    reason = "needs an NVIDIA Hopper GPU (sm_90) with CUDA; none here (CI checks the PTX with ptxas instead)"
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))
