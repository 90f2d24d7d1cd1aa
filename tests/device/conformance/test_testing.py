"""Conformance with torch_openreg's tests/test_testing.py: a PrivateUse1 test class that opts in with
`bypass_device_restrictions = True` runs the tests PyTorch gates with @onlyCUDA / @onlyOn(["cuda"]) on ctpu."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests, onlyCUDA, onlyOn
from torch.testing._internal.common_utils import TestCase


class BypassDeviceRestrictions(TestCase):
    ran: ClassVar[set[str]] = set()

    def setUp(self) -> None:
        self.bypass_device_restrictions = True  # the opt-in (PrivateUse1TestBase defaults it to False)
        super().setUp()

    @onlyCUDA
    def test_only_cuda(self, device: str) -> None:
        type(self).ran.add("only_cuda")
        assert torch.device(device).type == "ctpu"

    @onlyOn(["cuda"])
    def test_only_on(self, device: str) -> None:
        type(self).ran.add("only_on")
        assert torch.device(device).type == "ctpu"

    def test_z_both_ran(self, device: str) -> None:  # "z": pytest runs a class's tests in definition order
        assert type(self).ran == {"only_cuda", "only_on"}


instantiate_device_type_tests(BypassDeviceRestrictions, globals(), only_for="privateuse1")
