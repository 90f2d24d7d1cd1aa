"""torch.compile(backend="ctpu", options={"target": "ptx"}) covers every compute node with a PTX kernel.

For the tiny Llama (fp32 and bf16) and the project's other graphs (MLP, softmax, RMSNorm, LayerNorm,
attention causal / GQA / masked with head dims 16-128, prefill and decode): no node is left to torch
except metadata-only views (`ptx_target.METADATA_ONLY`), every kernel assembles with ptxas -arch=sm_90a
with 0 spills, and calling the compiled model without a GPU raises PtxLaunchError. No GPU needed.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from ptx_kernels import NO_GPU, PtxLaunchError
from torch_tpu_backend import ptx_target

F32, BF16 = torch.float32, torch.bfloat16


class Captured:
    """Wraps ptx_target.build_kernels to keep what each compiled graph got."""

    def __init__(self) -> None:
        self.graphs: list[tuple[torch.fx.GraphModule, list[Any], list[str]]] = []

    def __call__(self, gm: torch.fx.GraphModule) -> tuple[list[Any], list[str]]:
        kernels, uncovered = ORIGINAL_BUILD(gm)
        self.graphs.append((gm, kernels, uncovered))
        return kernels, uncovered


ORIGINAL_BUILD = ptx_target.build_kernels


def compile_and_check(fn: Callable[..., Any], *args: Any, monkeypatch: pytest.MonkeyPatch) -> Captured:
    captured = Captured()
    monkeypatch.setattr(ptx_target, "build_kernels", captured)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ctpu", options={"target": "ptx", "cache": False})
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error", UserWarning)  # an uncovered node would warn
        if torch.cuda.is_available():  # (test_gpu_parity.py checks the values)
            compiled(*args)
        else:
            with pytest.raises(PtxLaunchError) as info:
                compiled(*args)
            assert str(info.value) == NO_GPU
    assert captured.graphs, "the ptx target was not used"
    for gm, kernels, uncovered in captured.graphs:
        assert uncovered == []
        with_kernel = {k.node for k in kernels}
        for node in gm.graph.nodes:
            if node.op == "call_function" and not ptx_target.is_metadata_only(node):
                assert node in with_kernel, f"{node.name} ({node.target}) has no PTX kernel"
        for k in kernels:
            assert k.report.spill_stores == 0 and k.report.spill_loads == 0, k.report
            assert k.report.registers <= 255
    return captured


def tiny_llama(dtype: torch.dtype) -> tuple[torch.nn.Module, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(config).eval().to(dtype)
    return model, torch.randint(0, 128, (1, 8))


@pytest.mark.parametrize("dtype", [F32, BF16])
def test_tiny_llama(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    model, ids = tiny_llama(dtype)
    captured = compile_and_check(model, ids, monkeypatch=monkeypatch)
    names = {k.kernel.name.split("_")[1] for _, kernels, _ in captured.graphs for k in kernels}
    assert {"gemm", "attention", "rms", "rope", "swiglu", "fused"} <= names
    ops = " ".join(k.kernel.name for _, kernels, _ in captured.graphs for k in kernels)
    assert "embedding" in ops and "arange" in ops
    if dtype == F32:
        assert "gemm_simt" in ops  # fp32 linears: the fp32-exact SIMT GEMM


class Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = torch.nn.Linear(64, 256), torch.nn.Linear(256, 64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x))) + x


def _x(*shape: int, dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.randn(*shape).to(dtype)


GRAPHS: dict[str, Callable[[torch.dtype], tuple[Callable[..., Any], list[torch.Tensor]]]] = {
    "mlp": lambda dt: (Mlp().to(dt), [_x(2, 5, 64, dtype=dt)]),
    "softmax": lambda dt: (lambda x: torch.softmax(x, -1), [_x(4, 100, dtype=dt)]),
    "rms_norm": lambda dt: (torch.nn.RMSNorm(96, eps=1e-6).to(dt), [_x(3, 96, dtype=dt)]),
    "layer_norm": lambda dt: (torch.nn.LayerNorm(80).to(dt), [_x(3, 80, dtype=dt)]),
    # Hugging Face's rotary frequencies, inv_freq[None, :, None] @ position_ids[:, None, :] in fp32: a
    # standalone aten.bmm node with K = 1 (the tiny Llama's graph holds one under torch 2.11)
    "rope_freqs": lambda dt: (lambda f, p: f.float() @ p.float(), [_x(1, 32, 1, dtype=dt), _x(1, 1, 8, dtype=dt)]),
}


@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("name", sorted(GRAPHS))
def test_small_graphs(name: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    fn, args = GRAPHS[name](dtype)
    compile_and_check(fn, *args, monkeypatch=monkeypatch)


def sdpa(causal: bool, gqa: bool, mask: bool) -> Callable[..., torch.Tensor]:
    def fn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *m: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=m[0] if m else None, is_causal=causal, enable_gqa=gqa
        )

    return fn


@pytest.mark.parametrize(
    "head_dim,q_len,kv_len,heads,causal,mask,dtype",
    [
        (16, 8, 8, (4, 2), True, False, F32),  # tiny-Llama prefill
        (16, 1, 9, (4, 2), False, False, BF16),  # decode
        (32, 7, 7, (4, 4), True, False, BF16),
        (64, 1, 40, (8, 2), False, False, F32),
        (64, 6, 6, (4, 4), False, True, F32),  # boolean keep mask
        (128, 12, 12, (8, 2), True, False, BF16),
    ],
)
def test_attention_graphs(head_dim, q_len, kv_len, heads, causal, mask, dtype, monkeypatch) -> None:
    hq, hkv = heads
    q = _x(1, hq, q_len, head_dim, dtype=dtype)
    k, v = _x(1, hkv, kv_len, head_dim, dtype=dtype), _x(1, hkv, kv_len, head_dim, dtype=dtype)
    args = [q, k, v] + ([torch.rand(q_len, kv_len) > 0.3] if mask else [])
    captured = compile_and_check(sdpa(causal, hq != hkv, mask), *args, monkeypatch=monkeypatch)
    assert any("attention" in k.kernel.name for _, ks, _ in captured.graphs for k in ks)
