"""`model.generate()` with a static KV cache and the forward compiled with backend="ctpu": the cache update
(index_copy_ at the runtime cache positions) runs on the CTPU in place, so the prefill and every decode step
are ONE kernel launch each with 0 ops on the CPU, and the greedy tokens are eager's."""

from __future__ import annotations

import pytest
import torch

import torch_tpu_backend.stats as ctpu_stats
from torch_tpu_backend import dynamo

NEW_TOKENS = 16


def _llama(dtype: torch.dtype, kv_heads: int, hidden: int = 64, layers: int = 2, heads: int = 4,
           vocab: int = 128, seed: int = 0) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=128, use_cache=True)
    return LlamaForCausalLM(cfg).to(dtype).eval()


def _generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    return model.generate(ids, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static",
                          use_cache=True)


def _compiled_generate(model: torch.nn.Module, ids: torch.Tensor, new_tokens: int, monkeypatch: pytest.MonkeyPatch,
                       options: dict | None = None) -> tuple[torch.Tensor, int, ctpu_stats.ExecutionStats]:
    """(tokens, backend graph compilations, execution statistics of the generation)."""
    graphs = []
    call = dynamo.GraphCompiler.__call__

    def counting(self, gm, examples):  # type: ignore[no-untyped-def]
        graphs.append(gm)
        return call(self, gm, examples)

    monkeypatch.setattr(dynamo.GraphCompiler, "__call__", counting)
    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend="ctpu", options=options or {})
    ctpu_stats.reset()
    out = _generate(model, ids, new_tokens)
    return out, len(graphs), ctpu_stats.last()


# CI runs MHA in bf16; the other three pairs are `slow` (CI time: GQA fp32 took 65 s). In CI the README's
# generate() example (tests/test_repo.py) runs the tiny Llama, GQA in fp32, against eager's tokens
@pytest.mark.parametrize(("kv_heads", "dtype"), [
    pytest.param(2, torch.float32, id="gqa-fp32", marks=pytest.mark.slow),
    pytest.param(4, torch.bfloat16, id="mha-bf16"),
    pytest.param(4, torch.float32, id="mha-fp32", marks=pytest.mark.slow),
    pytest.param(2, torch.bfloat16, id="gqa-bf16", marks=pytest.mark.slow)])
def test_generate_static_cache_every_step_one_ctpu_launch(kv_heads: int, dtype: torch.dtype,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    model = _llama(dtype, kv_heads)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.no_grad():
            expected = _generate(model, ids, NEW_TOKENS)
            out, compilations, stats = _compiled_generate(model, ids, NEW_TOKENS, monkeypatch)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert out.tolist() == expected.tolist()
    assert compilations == 2  # prefill and decode, once each
    assert dict(stats.fallback_ops) == {}  # no op of any step ran on the CPU
    assert len(stats.launches) == NEW_TOKENS == stats.kernels_launched  # one program a step
    decode = stats.launches[1:]
    assert len({r.stats.cycles for r in decode}) == 1  # every decode step runs the same program, same work


def test_generate_llama_large_shape_decode(monkeypatch: pytest.MonkeyPatch) -> None:
    """A Llama-shaped layer on `large`: head dim 64, hidden 1024, 16 heads over 8 kv heads, odd prompt; in CI
    (about 25 s): greedy tokens = eager's, prefill and each decode step one program, nothing on the CPU."""
    model = _llama(torch.bfloat16, kv_heads=8, hidden=1024, layers=1, heads=16, vocab=256)
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        expected = _generate(model, ids, 3)
        out, compilations, stats = _compiled_generate(model, ids, 3, monkeypatch, {"config": "large"})
    assert out.tolist() == expected.tolist()
    assert compilations == 2
    assert dict(stats.fallback_ops) == {}  # its linears' tiles sit past vmem row 8191 (vst's reach): issue 12
    assert len(stats.launches) == 3 == stats.kernels_launched


# CI time: fp32 (46 s) is slow; test_generate_static_cache_every_step_one_ctpu_launch generates in fp32
@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=pytest.mark.slow), torch.bfloat16],
                         ids=["fp32", "bf16"])
def test_generate_with_the_model_on_the_device(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """`model.to("ctpu")`: the graphs create their masks on the device. The prefill and every decode step
    are one CTPU program each with 0 ops on the CPU (the attention rule once failed on the device's causal
    mask, leaving the masked-row guard's any / full_like to the CPU), and the tokens are eager's. Counted
    around each forward call: generate()'s own loop runs eager ops on ctpu tensors, not the backend's."""
    from torch_tpu_backend.llama_demo import tiny_llama

    model = tiny_llama(dtype)
    ids = torch.randint(0, 128, (1, 7), generator=torch.Generator().manual_seed(1))
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.no_grad():
            expected = _generate(model, ids, 6)
            model.to("ctpu")
            graphs = []
            call = dynamo.GraphCompiler.__call__
            monkeypatch.setattr(dynamo.GraphCompiler, "__call__",
                                lambda self, gm, ex: graphs.append(gm) or call(self, gm, ex))
            torch._dynamo.reset()
            compiled = torch.compile(model.forward, backend="ctpu")
            steps = []

            def forward(*args, **kwargs):  # type: ignore[no-untyped-def]
                before = ctpu_stats.last()
                out = compiled(*args, **kwargs)
                after = ctpu_stats.last()
                steps.append((dict(after.fallback_ops - before.fallback_ops),
                              after.kernels_launched - before.kernels_launched))
                return out

            model.forward = forward
            ctpu_stats.reset()
            out = _generate(model, ids.to("ctpu"), 6)
    finally:
        torch.set_float32_matmul_precision(previous)
    assert out.device.type == "ctpu" and out.cpu().tolist() == expected.tolist()
    assert len(graphs) == 2  # prefill and decode
    assert steps == [({}, 1)] * 6  # each step: one program, nothing on the CPU
