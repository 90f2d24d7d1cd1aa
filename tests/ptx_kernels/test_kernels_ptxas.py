"""Every kernel kind, over a few shapes, generates PTX that ptxas -arch=sm_90a accepts with no warnings.

Spill bound: 0 bytes of spill stores/loads for every kernel (docs/ptx.md); ptxas --warn-on-spills would
already turn a spill into a failure, the explicit check keeps the bound visible.
"""

import pytest
import torch

from ptx_kernels import assemble, kernel_for
from ptx_kernels.core import PtxKernel

BF16, F32 = torch.bfloat16, torch.float32
MAX_SPILL_BYTES = 0


def check(kernel: PtxKernel) -> None:
    report = assemble(kernel)
    assert report.spill_stores <= MAX_SPILL_BYTES and report.spill_loads <= MAX_SPILL_BYTES, report
    assert report.registers <= 255
    assert f".entry {kernel.name}(" in kernel.ptx


@pytest.mark.parametrize(
    "shape,dtype", [((4, 4096), BF16), ((3, 1000), F32), ((2, 40000), F32), ((5, 77), BF16)]
)
def test_rowwise(shape, dtype):
    check(kernel_for("ctpu::rms_norm", [shape, shape[-1:]], [dtype, dtype], {"eps": 1e-6}))
    check(kernel_for("ctpu::rms_norm", [shape, None], [dtype, None], {"eps": 1e-6}))
    check(kernel_for("ctpu::layer_norm", [shape, shape[-1:], shape[-1:]], [dtype, F32, F32], {"eps": 1e-5}))
    check(kernel_for("ctpu::softmax", [shape], [dtype], {"dim": -1}))


def test_softmax_other_dim_is_refused():
    with pytest.raises(NotImplementedError, match="last dim"):
        kernel_for("ctpu::softmax", [(4, 8)], [F32], {"dim": 0})


@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("shape,dtype", [((3, 1000), BF16), ((7, 13), F32)])
def test_swiglu(act, shape, dtype):
    check(kernel_for("ctpu::swiglu", [shape, shape], [dtype, dtype], {"act": act}))


@pytest.mark.parametrize(
    "x,cs,dtype", [((1, 4, 9, 64), (1, 1, 9, 64), BF16), ((2, 8, 5, 128), (5, 128), F32)]
)
def test_rope(x, cs, dtype):
    check(kernel_for("ctpu::rope", [x, cs, cs], [dtype, dtype]))


@pytest.mark.parametrize("head_dim", [16, 48, 96, 128, 256])
@pytest.mark.parametrize("dtype", [BF16, F32])
@pytest.mark.parametrize(
    "q_len,kv_len,hq,hkv,causal", [(77, 77, 8, 2, True), (1, 300, 8, 8, False), (1, 129, 4, 1, True)]
)
def test_attention(head_dim, dtype, q_len, kv_len, hq, hkv, causal):
    q, kv = (2, hq, q_len, head_dim), (2, hkv, kv_len, head_dim)
    check(
        kernel_for(
            "ctpu::attention", [q, kv, kv, None], [dtype] * 3 + [None], {"causal": causal, "scale": None}
        )
    )


@pytest.mark.parametrize("mask_shape,mask_dtype", [((1, 1, 16, 16), torch.bool), ((16, 16), F32)])
@pytest.mark.parametrize("head_dim", [16, 64])
def test_attention_masks(mask_shape, mask_dtype, head_dim):
    q = (1, 4, 16, head_dim)
    check(kernel_for("ctpu::attention", [q, q, q, mask_shape], [BF16] * 3 + [mask_dtype], {"causal": False}))


def test_attention_half_warp_layout():
    kernel = kernel_for("ctpu::attention", [(1, 4, 9, 16), (1, 2, 9, 16)] * 1 + [(1, 2, 9, 16), None],
                        [F32] * 3 + [None], {"causal": True})
    assert kernel.notes["lanes_per_row"] == 16 and kernel.grid == (2, 4, 1)


@pytest.mark.parametrize("head_dim", [8, 40, 272])
def test_attention_refuses_other_head_dims(head_dim):
    q = (1, 2, 4, head_dim)
    with pytest.raises(NotImplementedError, match="multiple of 16"):
        kernel_for("ctpu::attention", [q, q, q, None], [F32] * 3 + [None], {"causal": False})


@pytest.mark.parametrize(
    "m,n,k,layout",
    [(4096, 4096, 4096, "nk"), (100, 72, 200, "kn"), (300, 1000, 64, "nk"), (1, 4096, 4096, "kn")],
)
def test_gemm(m, n, k, layout):
    check(kernel_for("aten::mm", [(m, k), (k, n)], [BF16, BF16], {"w_layout": layout}))


@pytest.mark.parametrize("act", ["none", "relu", "silu", "gelu", "gelu_tanh"])
def test_linear_epilogues(act):
    x, w = (2, 37, 512), (512, 200)
    kernel = kernel_for("ctpu::linear", [x, w, (200,), (2, 37, 200)], [BF16] * 4, {"act": act})
    check(kernel)
    assert kernel.grid == (2, 1, 1) and kernel.notes["BN"] == 128


def test_bmm():
    kernel = kernel_for("aten::bmm", [(3, 130, 64), (3, 64, 264)], [BF16, BF16])
    check(kernel)
    assert kernel.grid == (2, 2, 3)


def test_unaligned_bf16_gemm_takes_the_simt_kernel():
    kernel = kernel_for("aten::mm", [(16, 13), (13, 16)], [BF16, BF16])
    check(kernel)
    assert kernel.notes["kind"] == "gemm_simt"


@pytest.mark.parametrize(
    "m,n,k,layout", [(8, 64, 64, "nk"), (100, 72, 200, "kn"), (1, 4096, 4096, "nk"), (129, 33, 7, "kn")]
)
def test_fp32_gemm_simt(m, n, k, layout):
    kernel = kernel_for("aten::mm", [(m, k), (k, n)], [F32, F32], {"w_layout": layout})
    check(kernel)
    assert kernel.notes["kind"] == "gemm_simt" and kernel.grid == (-(-n // 64), -(-m // 64), 1)


@pytest.mark.parametrize("act", ["none", "silu", "gelu_tanh"])
def test_fp32_linear_epilogues(act):
    x, w = (2, 37, 96), (96, 200)
    check(kernel_for("ctpu::linear", [x, w, (200,), (2, 37, 200)], [F32] * 4, {"act": act}))


def test_fp32_bmm():
    kernel = kernel_for("aten::bmm", [(3, 130, 64), (3, 64, 264)], [F32, F32])
    check(kernel)
    assert kernel.grid == (5, 3, 3)


def test_gemm_refuses_integer_operands():
    with pytest.raises(NotImplementedError, match="operand dtype"):
        kernel_for("aten::mm", [(16, 16), (16, 16)], [torch.int64, torch.int64])


def test_unknown_op():
    with pytest.raises(NotImplementedError, match="no PTX kernel"):
        kernel_for("ctpu::conv2d", [(1,)], [F32])


def test_cache_returns_same_kernel():
    args = ("ctpu::softmax", [(2, 64)], [F32], {"dim": -1})
    assert kernel_for(*args) is kernel_for(*args)
