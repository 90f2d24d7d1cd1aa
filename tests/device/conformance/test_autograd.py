"""Conformance with torch_openreg's tests/test_autograd.py: a backward on ctpu starts the autograd engine's
device thread (`pt_autograd_<index>`) for every device the accelerator reports.

openreg lists threads with psutil; this reads /proc directly (Linux only, as openreg's check is).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names are read from /proc (Linux)")
def test_backward_starts_device_autograd_threads() -> None:
    torch.ones(2, requires_grad=True, device="ctpu").sum().backward()
    tasks = Path(f"/proc/{os.getpid()}/task")
    thread_names = {(task / "comm").read_text().strip() for task in tasks.iterdir()}
    assert torch.accelerator.device_count() == 1
    for index in range(torch.accelerator.device_count()):
        assert f"pt_autograd_{index}" in thread_names
