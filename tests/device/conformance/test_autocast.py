"""Conformance with torch_openreg's tests/test_autocast.py: unsupported autocast dtypes warn, float16
matmuls, the fp32 promotion of mixed-precision ops, the default ("fast") autocast dtype.

ctpu's default autocast dtype is bfloat16 (the MXU's input type), openreg's float16: the check asserts
ctpu's. openreg puts `dot` in its fp32 list; ctpu takes the cast lists CUDA uses (csrc/ctpu/autocast.cpp),
where `dot` is a promote op (the widest input type), so that check is xfailed with the reason. The fp32
policy itself is checked with an op of CUDA's fp32 list.
"""

from __future__ import annotations

import pytest
import torch


def test_unsupported_dtype_warns() -> None:
    with pytest.warns(UserWarning, match="In ctpu autocast, but the target dtype (torch.float32 )?is not supported"):
        with torch.autocast(device_type="ctpu", dtype=torch.float32):
            torch.ones(10)


def test_float16_mm() -> None:
    with torch.amp.autocast(device_type="ctpu", dtype=torch.float16):
        x, y = torch.randn(2, 3, device="ctpu"), torch.randn(3, 3, device="ctpu")
        result = torch.mm(x, y)
    assert result.dtype == torch.float16
    torch.testing.assert_close(result.cpu(), x.cpu().half() @ y.cpu().half())


DOT_POLICY = ("ctpu uses CUDA's autocast lists, where dot is a promote op (float16 inputs stay float16); "
              "openreg lists dot among its fp32 ops")


@pytest.mark.xfail(reason=DOT_POLICY, strict=True)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_promote_to_float32(dtype: torch.dtype) -> None:
    with torch.amp.autocast(device_type="ctpu", dtype=dtype):
        x = torch.randn(2, device="ctpu", dtype=dtype)
        y = torch.randn(2, device="ctpu", dtype=dtype)
        result = torch.dot(x, y)
    assert result.dtype == torch.float32


def test_fast_dtype() -> None:
    assert torch.get_autocast_dtype(device_type="ctpu") == torch.bfloat16  # openreg: torch.half


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_fp32_policy_op(dtype: torch.dtype) -> None:
    with torch.amp.autocast(device_type="ctpu", dtype=dtype):
        x = torch.randn(2, 8, device="ctpu", dtype=dtype)
        result = torch.nn.functional.softmax(x, -1)
    assert result.dtype == torch.float32
