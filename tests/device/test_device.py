"""The device: availability, index, guard, moving tensors, loading through the torch.backends entry point."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import pytest
import torch

import torch_tpu_backend.device as ctpu_device


def test_available_and_counted() -> None:
    assert torch.ctpu.is_available()
    assert torch.ctpu.device_count() == 1
    assert torch.ctpu.current_device() == 0
    assert torch.accelerator.current_accelerator() == torch.device("ctpu")
    assert torch.accelerator.device_count() == 1


def test_device_index_and_set_device() -> None:
    assert torch.randn(2, device="ctpu").device == torch.device("ctpu", 0)
    assert torch.ones(1, device="ctpu:0").device.index == 0
    torch.ctpu.set_device(0)
    torch.ctpu.set_device("ctpu:0")
    with pytest.raises(ValueError, match="ctpu:0"):
        torch.ctpu.set_device(1)
    with pytest.raises(RuntimeError, match="invalid device index"):
        torch.empty(1, device="ctpu:1")


def test_device_guard_and_default_device() -> None:
    with torch.device("ctpu"):
        t = torch.zeros(3)
    assert t.device.type == "ctpu"
    with torch.accelerator.device_index(0):
        assert torch.accelerator.current_device_index() == 0
    torch.ctpu.synchronize()
    torch.accelerator.synchronize()


def test_to_and_from() -> None:
    cpu = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    dev = cpu.to("ctpu")
    assert dev.is_ctpu and dev.device.type == "ctpu"
    assert torch.equal(dev.cpu(), cpu)
    assert torch.equal(cpu.ctpu().cpu(), cpu)  # generated Tensor.ctpu()
    assert torch.equal(dev.to("ctpu").cpu(), cpu)
    assert torch.equal(dev.to(torch.float64).cpu(), cpu.double())  # dtype conversion on the device
    assert torch.equal(dev.t().contiguous().cpu(), cpu.t().contiguous())  # strided device -> device copy
    assert torch.equal(dev.t().cpu(), cpu.t())  # strided device -> host copy
    assert torch.nn.Linear(4, 2).ctpu().weight.device.type == "ctpu"  # generated Module.ctpu()


def test_register_is_idempotent() -> None:
    ctpu_device.register()
    ctpu_device.register()
    assert torch._C._get_privateuse1_backend_name() == "ctpu"


def test_import_torch_alone_loads_ctpu() -> None:
    code = "import torch; x = torch.randn(2, device='ctpu'); print(x.device, torch.ctpu.device_count())"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=True)
    assert out.stdout.split() == ["ctpu:0", "1"]


def test_a_broken_device_never_breaks_import(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise ImportError("no extension")

    monkeypatch.setattr(ctpu_device, "register", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ctpu_device._autoload()
    assert any("not available" in str(w.message) for w in caught)


@pytest.mark.parametrize("first", ["fx_passes", "fx_passes.ops", "codegen", "torch_tpu_backend.llama_demo"])
def test_device_loads_whichever_package_is_imported_first(first: str) -> None:
    """`import torch` loads the ctpu device through its entry point, also when torch is first imported from
    inside one of our packages (the device once imported the half-initialized fx_passes package and was
    silently left out: `device="ctpu"` then failed for the whole process)."""
    code = f"import {first}\nimport torch\nprint(torch.empty(2, device='ctpu').device)"
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}  # codegen's tests set it
    done = subprocess.run([sys.executable, "-W", "error::RuntimeWarning", "-c", code], capture_output=True,
                          text=True, env=env, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ctpu:0", done.stderr[-2000:]
