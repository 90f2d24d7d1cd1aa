"""The backend's decomposition table: what it hands AOT autograd keeps every op's contract.

A decomposition runs below autograd, so the op's own backward reads what the decomposition returns.
torch's rule for `_scaled_dot_product_flash_attention_for_cpu` returned the attention probabilities as
the logsumexp, and compiled training computed wrong gradients from them without a word (issue 15).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch._functorch.aot_autograd import aot_function, make_boxed_func

from fx_passes import decomposition_table
from fx_passes.decompositions import sdpa_flash_for_cpu, sdpa_flash_for_cpu_backward

aten = torch.ops.aten
B, H, L, S, E = 2, 4, 5, 7, 8


def _masked_rows() -> torch.Tensor:
    mask = torch.randn(1, 1, L, S)
    mask[..., 2, :] = -math.inf  # a fully masked query row
    mask[..., 3, 1] = -math.inf
    return mask


# name -> (q, k, v, op keyword arguments)
CASES: dict[str, Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict]]] = {
    "plain": lambda: (torch.randn(B, H, L, E), torch.randn(B, H, S, E), torch.randn(B, H, S, E), {}),
    "causal": lambda: (torch.randn(B, H, L, E), torch.randn(B, H, L, E), torch.randn(B, H, L, E),
                       {"is_causal": True}),
    "causal_fewer_keys": lambda: (torch.randn(B, H, S, E), torch.randn(B, H, L, E), torch.randn(B, H, L, E),
                                  {"is_causal": True}),
    "float_mask_masked_rows": lambda: (torch.randn(B, H, L, E), torch.randn(B, H, S, E), torch.randn(B, H, S, E),
                                       {"attn_mask": _masked_rows()}),
    "gqa_causal": lambda: (torch.randn(B, H, L, E), torch.randn(B, 2, L, E), torch.randn(B, 2, L, E),
                           {"is_causal": True}),
    "negative_scale": lambda: (torch.randn(B, H, L, E), torch.randn(B, H, S, E), torch.randn(B, H, S, E),
                               {"scale": -0.3}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_rule_returns_what_the_op_returns(case: str) -> None:
    """Same output and logsumexp as the CPU kernel (shape, dtype, values; 0 for a fully masked row), and
    the op's backward kernel gives the same gradients from them as from the kernel's own."""
    torch.manual_seed(0)
    q, k, v, kwargs = CASES[case]()
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, **kwargs)
    got_out, got_lse = sdpa_flash_for_cpu(q, k, v, **kwargs)
    assert (got_out.shape, got_lse.shape, got_lse.dtype) == (out.shape, lse.shape, lse.dtype)
    torch.testing.assert_close(got_out, out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_lse, lse, rtol=1e-5, atol=1e-6)
    grad = torch.randn_like(out)
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward
    flags = (0.0, kwargs.get("is_causal", False))
    rest = {"attn_mask": kwargs.get("attn_mask"), "scale": kwargs.get("scale")}
    want = backward(grad, q, k, v, out, lse, *flags, **rest)
    got = backward(grad, q, k, v, got_out, got_lse, *flags, **rest)
    for g, w in zip(got, want, strict=True):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_backward_rule_gives_the_kernels_gradients(case: str) -> None:
    """The backward's decomposition (ops the CTPU lowers) against the CPU backward kernel, from the same
    saved output and logsumexp: masks, a fully masked row (its gradients are 0), GQA, a negative scale."""
    torch.manual_seed(0)
    q, k, v, kwargs = CASES[case]()
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, **kwargs)
    grad = torch.randn_like(out)
    flags = (0.0, kwargs.get("is_causal", False))
    rest = {"attn_mask": kwargs.get("attn_mask"), "scale": kwargs.get("scale")}
    want = aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, *flags, **rest)
    got = sdpa_flash_for_cpu_backward(grad, q, k, v, out, lse, *flags, **rest)
    for g, w, t in zip(got, want, (q, k, v), strict=True):
        assert g.shape == t.shape and g.dtype == t.dtype
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_sdpa_rule_bf16_keeps_an_fp32_logsumexp() -> None:
    q, k, v = (torch.randn(B, H, L, E, dtype=torch.bfloat16) for _ in range(3))
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
    got_out, got_lse = sdpa_flash_for_cpu(q, k, v, is_causal=True)
    assert (got_out.dtype, got_lse.dtype) == (torch.bfloat16, torch.float32)
    torch.testing.assert_close(got_out, out, rtol=3e-2, atol=3e-2)  # bf16 rounding between the ops
    torch.testing.assert_close(got_lse, lse, rtol=1e-2, atol=1e-2)


def test_training_graph_saves_the_logsumexp_for_the_backward() -> None:
    """Through AOT autograd with the table: the backward's flash kernel reads a [B, H, L] logsumexp
    (it was handed the [B, H, L, L] probabilities), and the gradients are eager's."""
    graphs: list[torch.fx.GraphModule] = []

    def keep(gm: torch.fx.GraphModule, _: object) -> Callable[..., object]:
        graphs.append(gm)
        return make_boxed_func(gm)

    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    compiled = aot_function(fn, fw_compiler=keep, bw_compiler=keep, decompositions=decomposition_table())
    torch.manual_seed(0)
    inputs = [torch.randn(B, H, L, E, requires_grad=True) for _ in range(3)]
    grad = torch.randn(B, H, L, E)
    torch.autograd.backward(compiled(*inputs), grad)
    got = [t.grad for t in inputs]
    for t in inputs:
        t.grad = None
    torch.autograd.backward(fn(*inputs), grad)
    for g, t in zip(got, inputs, strict=True):
        torch.testing.assert_close(g, t.grad, rtol=1e-5, atol=1e-6)
    # the backward kernel is decomposed (matmuls and row ops the CTPU lowers) and reads the saved logsumexp
    assert not graphs[1].graph.find_nodes(
        op="call_function", target=aten._scaled_dot_product_flash_attention_for_cpu_backward.default)
    saved = [tuple(n.meta["val"].shape) for n in graphs[1].graph.find_nodes(op="placeholder")]
    assert (B, H, L) in saved, saved


def test_table_is_core_aten_with_the_sdpa_rule_replaced() -> None:
    """core ATen, the SDPA rules, the optimizer's list ops (one op per tensor), pow with a scalar base and an
    MoE's routing ops."""
    from torch._decomp import core_aten_decompositions

    from fx_passes.foreach import foreach_decompositions
    from fx_passes.routing import routing_decompositions

    core, ours = core_aten_decompositions(), decomposition_table()
    routing = routing_decompositions()
    assert {aten.sort.default, aten.topk.default, aten.histc.default, aten._grouped_mm.default} <= set(routing)
    assert not set(routing) & set(core)  # added, none replaced
    backward = aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    foreach = set(foreach_decompositions())
    assert {aten._foreach_add.List, aten._foreach_lerp.Scalar, aten._foreach_addcdiv.ScalarList} <= foreach
    assert aten._foreach_addcdiv.Tensor not in foreach  # its scalars are a tensor's values
    assert set(ours) == set(core) | {backward, aten.pow.Scalar} | foreach | set(routing)
    assert ours[aten._scaled_dot_product_flash_attention_for_cpu.default] is sdpa_flash_for_cpu
    assert ours[backward] is sdpa_flash_for_cpu_backward
    assert ours[aten.silu.default] is core[aten.silu.default]
