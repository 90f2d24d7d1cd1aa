"""Conformance with torch_openreg's tests/test_sdpa.py (and the SDPA checks of its tests/test_ops.py):
`_fused_sdp_choice`, the overrideable fused attention forward and backward, SDPA with dropout and causal
masks on ctpu.

openreg's shapes (batch 4, 2 heads, 256 tokens, head dim 128) are smaller here; the dtype (float16) is kept.
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend

# ctpu registers no SDPA kernel: _fused_sdp_choice goes to the CPU fallback, which answers the CPU's choice
# (flash attention for the CPU), so eager SDPA runs as one CPU op, and compiled SDPA is decomposed into the
# matmuls and softmax the CTPU compiler lowers. An overrideable fused kernel would only be another CPU op.
SDPA_MATH = ("ctpu has no fused SDPA kernel to override with: eager SDPA takes the CPU's choice through the "
             "fallback, compiled SDPA decomposes into CTPU matmuls/softmax")


def device_rand(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.rand(*shape, dtype=dtype).to("ctpu")


SHAPE = (2, 2, 16, 8)


@pytest.mark.xfail(reason=SDPA_MATH, strict=True)
def test_fused_sdp_choice_is_overrideable() -> None:
    q, k, v = (device_rand(*SHAPE, dtype=torch.float16) for _ in range(3))
    assert torch._fused_sdp_choice(q, k, v) == SDPBackend.OVERRIDEABLE.value
    mask = device_rand(SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[2], dtype=torch.float16)
    assert torch._fused_sdp_choice(q, k, v, mask) == SDPBackend.OVERRIDEABLE.value


def test_fused_sdp_choice_is_the_cpus() -> None:
    q, k, v = (device_rand(*SHAPE) for _ in range(3))
    assert torch._fused_sdp_choice(q, k, v) == torch._fused_sdp_choice(q.cpu(), k.cpu(), v.cpu())


@pytest.mark.xfail(reason=SDPA_MATH, strict=True, raises=NotImplementedError)
def test_fused_attention_overrideable_forward_backward() -> None:
    q, k, v = (device_rand(*SHAPE, dtype=torch.float16) for _ in range(3))
    mask = device_rand(SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[2], dtype=torch.float16)
    outs = torch.ops.aten._scaled_dot_product_fused_attention_overrideable(q, k, v, attn_bias=mask)
    grads = torch.ops.aten._scaled_dot_product_fused_attention_overrideable_backward(
        device_rand(*SHAPE, dtype=torch.float16), q, k, v, mask, [True, True, True, True], *outs[:6],
        dropout_p=0.0, is_causal=False, philox_seed=outs[6], philox_offset=outs[7])
    assert len(grads) == 4


@pytest.mark.parametrize("dropout_p, is_causal", [(0.0, False), (0.1, False), (0.0, True)])
def test_sdpa_runs_on_device(dropout_p: float, is_causal: bool) -> None:
    q, k, v = (device_rand(*SHAPE, dtype=torch.float16) for _ in range(3))
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=is_causal)
    assert out.device.type == "ctpu" and out.shape == SHAPE
    if dropout_p == 0.0:
        ref = torch.nn.functional.scaled_dot_product_attention(
            q.cpu().float(), k.cpu().float(), v.cpu().float(), is_causal=is_causal)
        torch.testing.assert_close(out.cpu().float(), ref, atol=2e-3, rtol=2e-3)
