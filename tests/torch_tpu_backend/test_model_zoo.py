"""Beyond Llama: small random-weight models of the Hugging Face families users compile, with backend="ctpu"
on the simulator: logits equal eager's, and what runs on the CPU is exactly what the table says (an op
newly lowered, or newly falling back, changes this file on purpose)."""

from __future__ import annotations

import warnings

import pytest
import torch

import torch_tpu_backend.stats as ctpu_stats

transformers = pytest.importorskip("transformers")
VOCAB = 128


def _model(name: str) -> torch.nn.Module:
    t = transformers
    common = {"vocab_size": VOCAB}
    # one layer has every op of a family; Gemma 2 and 3 alternate local and global attention between layers
    layers = 2 if name in ("gemma2", "gemma3") else 1
    if name == "gpt2":
        return t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=layers, n_head=4, n_positions=64, **common))
    if name == "opt":
        return t.OPTForCausalLM(t.OPTConfig(hidden_size=64, num_hidden_layers=layers, ffn_dim=128,
                                            num_attention_heads=4, max_position_embeddings=64,
                                            word_embed_proj_dim=64, **common))
    if name == "qwen3":
        return t.Qwen3ForCausalLM(t.Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                                max_position_embeddings=64, **common))
    if name == "bert":
        return t.BertModel(t.BertConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                        intermediate_size=128, max_position_embeddings=64, **common))
    if name == "gptj":
        return t.GPTJForCausalLM(t.GPTJConfig(n_embd=64, n_layer=layers, n_head=4, rotary_dim=8, n_positions=64,
                                              **common))
    if name == "bloom":
        return t.BloomForCausalLM(t.BloomConfig(hidden_size=64, n_layer=layers, n_head=4, **common))
    llama_like = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
                  "num_key_value_heads": 2, "max_position_embeddings": 64, **common}
    if name in LLAMA_LIKE:
        config, model = LLAMA_LIKE[name]
        extra = {"head_dim": 16} if name.startswith("gemma") else {"pad_token_id": 0} if name == "phi3" else {}
        if name == "phi":
            llama_like.pop("num_key_value_heads")
        if name == "gpt_neox":
            return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                                        num_attention_heads=4, max_position_embeddings=64, **common))
        if name == "falcon":
            return t.FalconForCausalLM(t.FalconConfig(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4,
                                                      **common))
        return getattr(t, model)(getattr(t, config)(**llama_like, **extra))
    if name == "qwen3_moe":
        return t.Qwen3MoeForCausalLM(t.Qwen3MoeConfig(hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                                      num_hidden_layers=layers, num_attention_heads=4,
                                                      num_key_value_heads=2, head_dim=16, num_experts=8,
                                                      num_experts_per_tok=2, max_position_embeddings=64, **common))
    return t.MixtralForCausalLM(t.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                                num_experts_per_tok=2, max_position_embeddings=64, **common))


LLAMA_LIKE = {  # name -> (config class, model class)
    "llama": ("LlamaConfig", "LlamaForCausalLM"), "mistral": ("MistralConfig", "MistralForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "gemma": ("GemmaConfig", "GemmaForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"), "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi": ("PhiConfig", "PhiForCausalLM"), "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM"), "stablelm": ("StableLmConfig", "StableLmForCausalLM"),
    "gpt_neox": ("", ""), "falcon": ("", ""),
}

# model -> the ops that run on the CPU, and why (empty: the whole forward is CTPU programs)
CPU_OPS = {
    "gpt2": {},
    "opt": {},
    "qwen3": {},
    "bert": {},
    "gptj": {},
    "bloom": {},
    **{name: {} for name in LLAMA_LIKE},
    "falcon": {},
    # MoE: the router (topk, the sort by expert, histc, slot -> token) and the experts' grouped matmul too
    # (fx_passes/routing.py)
    "mixtral": {},
    "qwen3_moe": {},
}


@pytest.mark.parametrize("name", CPU_OPS)
def test_model_zoo_forward(name: str) -> None:
    torch.manual_seed(0)
    model = _model(name).eval()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(ids)
        ctpu_stats.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = torch.compile(model, backend="ctpu", options={"cache": False})(ids)
    field = "logits" if hasattr(expected, "logits") else "last_hidden_state"
    torch.testing.assert_close(getattr(got, field), getattr(expected, field), rtol=1e-4, atol=1e-5)
    s = ctpu_stats.last()
    assert s.kernels_launched == 1, s.as_dict()  # the whole forward is one CTPU program
    assert dict(s.fallback_ops) == CPU_OPS[name], s.as_dict()


@pytest.mark.slow
@pytest.mark.parametrize("name", CPU_OPS)
def test_model_zoo_forward_bf16(name: str) -> None:
    """The same models in bf16: the CTPU's logits are as close to the fp32 model's as eager bf16's are (at most
    twice eager's largest error), and the same ops run on the CPU."""
    torch.manual_seed(0)
    model = _model(name).eval()
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(1))
    field = "logits" if name != "bert" else "last_hidden_state"
    torch._dynamo.reset()
    with torch.no_grad():
        exact = getattr(model(ids), field)
        model = model.to(torch.bfloat16)
        eager = getattr(model(ids), field).float()
        ctpu_stats.reset()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = getattr(torch.compile(model, backend="ctpu", options={"cache": False})(ids), field)
    assert got.dtype == torch.bfloat16 and not got.isnan().any()
    eager_error, ctpu_error = (eager - exact).abs().max().item(), (got.float() - exact).abs().max().item()
    assert ctpu_error <= 2 * eager_error + 1e-3, (ctpu_error, eager_error)
    assert dict(ctpu_stats.last().fallback_ops) == CPU_OPS[name]
