"""Fixtures of the ctpu device tests: the device registered, fallback warnings and statistics reset."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import torch_tpu_backend.device as ctpu_device
from torch_tpu_backend import stats
from torch_tpu_backend.device.fallback import reset_fallback_warnings

ctpu_device.register()  # a no-op when the torch.backends entry point already loaded it


@pytest.fixture(autouse=True)
def _fresh_fallback_state() -> Iterator[None]:
    reset_fallback_warnings()
    stats.reset()
    yield
