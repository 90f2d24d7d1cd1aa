"""Conformance with torch_openreg's tests/test_misc.py: the backend's name and module, the generated
`is_ctpu` / `.ctpu()` methods, the profiler and autograd enum aliases, legacy type strings.

Differences from openreg, by fact not by choice: ctpu has one device, so `device_count()` is 1 and the
`.ctpu(1)` check is skipped. openreg skips its Parameter and storage-method checks ("need to support");
they pass on ctpu and are kept.
"""

from __future__ import annotations

import types
from collections.abc import Iterator

import pytest
import torch
from torch.utils import backend_registration

MULTI_DEVICE = "multi-device: ctpu has one device (ctpu:1 does not exist)"


def test_backend_name_and_rename() -> None:
    assert torch._C._get_privateuse1_backend_name() == "ctpu"
    torch.utils.rename_privateuse1_backend("ctpu")  # the same name again is allowed
    with pytest.raises(RuntimeError, match="has already been set"):
        torch.utils.rename_privateuse1_backend("dev")


def test_profiler_activity_alias() -> None:
    from torch._C._profiler import ProfilerActivity

    assert ProfilerActivity.CTPU == ProfilerActivity.PrivateUse1
    assert repr(ProfilerActivity.CTPU) == "<ProfilerActivity.CTPU: 5>"
    assert str(ProfilerActivity.CTPU) == "ProfilerActivity.CTPU"
    assert ProfilerActivity.CTPU.name == "CTPU"


def test_device_type_alias() -> None:
    from torch._C._autograd import DeviceType

    assert DeviceType.CTPU == DeviceType.PrivateUse1
    assert repr(DeviceType.CTPU) == "<DeviceType.CTPU: 20>"
    assert str(DeviceType.CTPU) == "DeviceType.CTPU"
    assert DeviceType.CTPU.name == "CTPU"


def test_device_module_registration_errors() -> None:
    with pytest.raises(RuntimeError, match="Expected one of cpu"):
        torch._register_device_module("dev", types.ModuleType("fake_module"))
    with pytest.raises(RuntimeError, match="The runtime module of"):
        torch._register_device_module("ctpu", types.ModuleType("fake_module"))


def test_custom_module_functions() -> None:
    for missing in ("func_name_", "non_existent_func"):
        with pytest.raises(RuntimeError, match=r"Try to call torch\.ctpu"):
            backend_registration._get_custom_mod_func(missing)
    device_count = backend_registration._get_custom_mod_func("device_count")
    assert device_count is not None
    assert device_count() == 1  # openreg: 2 (it simulates two devices)


def test_generated_methods() -> None:
    with pytest.raises(RuntimeError, match="The custom device module of"):
        torch.utils.generate_methods_for_privateuse1_backend()  # already generated
    for owner in (torch.Tensor, torch.TypedStorage, torch.UntypedStorage, torch.nn.utils.rnn.PackedSequence):
        assert hasattr(owner, "is_ctpu") and hasattr(owner, "ctpu")
    assert hasattr(torch.nn.Module, "ctpu")


def test_tensor_methods() -> None:
    x = torch.empty(4, 4)
    assert not x.is_ctpu
    for target in (torch.device("ctpu"), torch.device("ctpu:0"), 0):
        y = x.ctpu(target)
        assert y.is_ctpu and y.device.index == 0


@pytest.mark.skip(reason=MULTI_DEVICE)
def test_tensor_method_other_device() -> None: ...


def test_module_method_moves_parameters() -> None:
    class WithParameter(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.x = torch.nn.Parameter(torch.randn(3, 3))

    module = WithParameter()
    assert module.x.device.type == "cpu"
    module.ctpu()
    assert module.x.device.type == "ctpu"
    assert isinstance(module.x, torch.nn.Parameter)


def test_storage_methods() -> None:
    typed = torch.empty(4, 4).storage()
    assert not typed.is_ctpu
    assert typed.ctpu().is_ctpu
    untyped = torch.empty(4, 4).untyped_storage()
    assert not untyped.is_ctpu
    assert untyped.ctpu().is_ctpu


def test_packed_sequence_methods() -> None:
    packed = torch.nn.utils.rnn.PackedSequence(torch.rand(5, 3), torch.tensor([1, 1, 1, 1, 1]))
    assert not packed.is_ctpu
    moved = packed.ctpu()
    assert moved.is_ctpu
    assert moved.data.is_ctpu


def test_tensor_type_strings() -> None:
    expected = {
        torch.bool: "torch.ctpu.BoolTensor", torch.double: "torch.ctpu.DoubleTensor",
        torch.float32: "torch.ctpu.FloatTensor", torch.half: "torch.ctpu.HalfTensor",
        torch.int32: "torch.ctpu.IntTensor", torch.int64: "torch.ctpu.LongTensor",
        torch.int8: "torch.ctpu.CharTensor", torch.short: "torch.ctpu.ShortTensor",
        torch.uint8: "torch.ctpu.ByteTensor",
    }
    for dtype, name in expected.items():
        assert torch.empty(4, 4, dtype=dtype, device="ctpu").type() == name


@pytest.fixture
def custom_float_storage() -> Iterator[None]:
    class CustomFloatStorage:
        @property
        def __module__(self) -> str:  # type: ignore[override]
            return "torch." + torch._C._get_privateuse1_backend_name()

        @property
        def __name__(self) -> str:
            return "FloatStorage"

    torch.ctpu.FloatStorage = CustomFloatStorage()
    try:
        yield
    finally:
        del torch.ctpu.FloatStorage


def test_type_methods_of_tensor_and_storage(custom_float_storage: None) -> None:
    cpu = torch.randn([8]).float()
    assert cpu.type() == "torch.FloatTensor"
    assert cpu.ctpu().type() == "torch.ctpu.FloatTensor"
    assert cpu.storage().type() == "torch.FloatStorage"
    # the storage type name comes from torch.ctpu.<Name>Storage when the module defines one
    assert cpu.ctpu().storage().type() == "torch.ctpu.FloatStorage"
    assert cpu.int().ctpu().storage().type() == "torch.storage.TypedStorage"


def test_storage_type_without_module_class() -> None:
    assert torch.randn([8]).ctpu().storage().type() == "torch.storage.TypedStorage"


def test_storage_device_and_size() -> None:
    t = torch.randn(4, 4, device="ctpu")
    storage = t.storage()
    assert storage.is_ctpu
    assert storage.size() == t.numel()
