"""Conformance with torch_openreg's tests/test_device_type.py: data moved between the CPU and ctpu is
intact (to, copy=True, clone, copy_ both ways, a round trip), arithmetic and dtypes on the device, and
PyTorch's device-type test framework instantiating tests for ctpu (onlyPRIVATEUSE1, skipPRIVATEUSE1If,
onlyNativeDeviceTypes, except_for).

openreg writes its transfer checks as device-type test classes; here they are plain tests on "ctpu", and
one small class goes through `instantiate_device_type_tests` to check the framework's view of the device.
"""

from __future__ import annotations

import torch
from torch.testing import make_tensor
from torch.testing._internal.common_device_type import (
    instantiate_device_type_tests,
    onlyNativeDeviceTypes,
    onlyPRIVATEUSE1,
    skipPRIVATEUSE1If,
)
from torch.testing._internal.common_utils import TestCase


def test_to_device_and_copy_flag() -> None:
    x_cpu = torch.randn(3, 4)
    x = x_cpu.to("ctpu")
    assert x.device.type == "ctpu" and torch.equal(x.cpu(), x_cpu)
    assert x.to("ctpu").data_ptr() == x.data_ptr()
    z = x.to("ctpu", copy=True)
    assert z.data_ptr() != x.data_ptr() and torch.equal(z.cpu(), x_cpu)


def test_clone_and_copy_both_ways() -> None:
    x = torch.randn(3, 4, device="ctpu")
    y = x.clone()
    assert y.device.type == "ctpu" and y.data_ptr() != x.data_ptr() and torch.equal(y.cpu(), x.cpu())
    dst = torch.empty(3, 4, device="ctpu")
    dst.copy_(x)
    assert dst.data_ptr() != x.data_ptr() and torch.equal(dst.cpu(), x.cpu())
    src_cpu = torch.randn(3, 4)
    dst.copy_(src_cpu)
    assert torch.equal(dst.cpu(), src_cpu)
    back = torch.empty(3, 4)
    back.copy_(x)
    assert torch.equal(back, x.cpu())
    original = torch.randn(3, 4)
    assert torch.equal(original.to("ctpu").to("cpu"), original)


def test_arithmetic_matches_cpu() -> None:
    a_cpu, b_cpu = torch.randn(3, 4), torch.randn(3, 4)
    a, b = a_cpu.to("ctpu"), b_cpu.to("ctpu")
    assert torch.equal((a + b).cpu(), a_cpu + b_cpu)
    assert torch.equal((a * b).cpu(), a_cpu * b_cpu)
    assert torch.equal((a - b).cpu(), a_cpu - b_cpu)
    torch.testing.assert_close((a / b).cpu(), a_cpu / b_cpu)


def test_factories_and_dtypes() -> None:
    x = torch.empty((3, 4), device="ctpu", dtype=torch.float32)
    assert x.device.type == "ctpu" and x.shape == (3, 4) and x.dtype == torch.float32
    assert bool((torch.zeros(3, 4, device="ctpu") == 0).all())
    assert bool((torch.ones(3, 4, device="ctpu") == 1).all())
    f = torch.randn(3, 4, device="ctpu")
    assert (f + f).dtype == torch.float32
    d = torch.randn(3, 4, device="ctpu", dtype=torch.float64)
    assert (d * 2).dtype == torch.float64
    z = f.to(dtype=torch.float64)
    assert z.dtype == torch.float64 and z.device.type == "ctpu"
    assert torch.randint(0, 100, (3, 4), device="ctpu", dtype=torch.int64).dtype == torch.int64
    b = torch.zeros(3, 4, device="ctpu", dtype=torch.bool)
    assert b.dtype == torch.bool and bool((~b).all())


class DeviceTypeFramework(TestCase):
    @onlyPRIVATEUSE1
    def test_privateuse1_only(self, device: str) -> None:
        x = make_tensor((2, 2), device=device, dtype=torch.float32)
        assert torch.device(device).type == torch._C._get_privateuse1_backend_name() == "ctpu"
        assert x.device.type == "ctpu"

    @onlyNativeDeviceTypes
    def test_native_device(self, device: str) -> None:
        assert make_tensor((2, 2), device=device, dtype=torch.float32) is not None

    @skipPRIVATEUSE1If(True, "the decorator must skip on ctpu")
    def test_skipped_on_privateuse1(self, device: str) -> None:
        raise AssertionError("skipPRIVATEUSE1If did not skip")


instantiate_device_type_tests(DeviceTypeFramework, globals(), only_for=("privateuse1",))


def test_framework_instantiated_ctpu_class() -> None:
    # named after PrivateUse1TestBase.device_type: "privateuse1", or "ctpu" once a class of it has set up
    assert {"DeviceTypeFrameworkPRIVATEUSE1", "DeviceTypeFrameworkCTPU"} & set(globals())
