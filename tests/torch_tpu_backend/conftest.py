"""The state every compile test starts from: a compile cache of its own, no graphs dynamo compiled before,
zeroed statistics, a fixed seed, torch's default fp32 matmul precision restored after, no downloads."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import torch_tpu_backend.device as ctpu_device
import torch_tpu_backend.stats as ctpu_stats

ctpu_device.register()  # tests/codegen's conftest turns torch's autoload off for the whole session


@pytest.fixture
def fresh_compile(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("CTPU_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    precision = torch.get_float32_matmul_precision()
    torch._dynamo.reset()
    ctpu_stats.reset()
    torch.manual_seed(0)
    yield
    torch.set_float32_matmul_precision(precision)
