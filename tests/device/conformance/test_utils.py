"""Conformance with torch_openreg's tests/test_utils.py: a ctpu tensor through DLPack comes back on ctpu
with the same values."""

from __future__ import annotations

import torch


def test_dlpack_round_trip() -> None:
    x_in = torch.randn(2, 3).to("ctpu")
    x_out = torch.from_dlpack(torch.utils.dlpack.to_dlpack(x_in))
    assert x_out.device == x_in.device
    assert torch.equal(x_in.cpu(), x_out.cpu())
    assert x_out.data_ptr() == x_in.data_ptr()  # zero-copy: the same HBM
