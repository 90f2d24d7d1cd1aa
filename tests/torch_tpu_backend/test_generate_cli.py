"""`ctpu generate` (issue 11, item 6): a local checkpoint the test saves with save_pretrained, generated on the
simulator with the forward compiled for the CTPU, checked against eager, figures in JSON; bad input is one
line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from torch_tpu_backend import cli


@pytest.fixture(autouse=True)
def highest(fresh_compile: None) -> None:
    torch.set_float32_matmul_precision("highest")  # fresh_compile restores it


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    """A small random Llama (MHA: as many KV heads as heads), saved as save_pretrained writes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(3)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
    path = tmp_path / "llama"
    LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def test_generate_from_a_checkpoint_matches_eager(checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["generate", "--model", str(checkpoint), "--prompt-ids", "5,9,3,17,40", "--max-new-tokens", "3",
            "--check"]
    assert cli.main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["check"]["passed"] and result["tokens"] == result["check"]["eager_tokens"]
    assert result["prompt_ids"] == [[5, 9, 3, 17, 40]] and len(result["tokens"][0]) == 3
    prefill, decode = result["prefill"], result["decode"]
    assert (prefill["calls"], prefill["tokens"], decode["calls"], decode["tokens"]) == (1, 5, 2, 2)
    assert prefill["kernels"] >= 1 and decode["kernels"] >= 2 and prefill["uncompiled_calls"] == 0
    # the weights cross once, in the prefill; a decode call moves token ids, positions, logits and the
    # CPU-updated cache pieces (until the cache update runs on the CTPU), a fraction of the prefill's bytes
    assert decode["host_bytes_uploaded"] / decode["calls"] < prefill["host_bytes_uploaded"] / 4
    for phase in (prefill, decode):
        f = phase["figures"]
        assert f["cycles_per_token"] == phase["cycles"] / phase["tokens"] > 0
        assert f["simulated_tokens_per_second"] == pytest.approx(1000e6 / f["cycles_per_token"])

    # streaming: the new tokens are printed as they come, before the figures
    assert cli.main(args) == 0
    out = capsys.readouterr().out
    streamed, _, figures = out.partition("LlamaForCausalLM from")
    assert streamed.split() == [str(t) for t in result["tokens"][0]]
    assert "prefill: 1 call(s)" in figures and "tokens equal eager PyTorch's: yes" in figures


@pytest.mark.parametrize(("extra", "message"), [
    (["--prompt", "hello"], "--prompt needs a tokenizer"),
    (["--prompt-ids", "1,2,999"], "token id 999 is outside the vocabulary"),
    (["--max-new-tokens", "40"], "exceed the model's 32 positions"),
])
def test_generate_bad_input_is_one_line(checkpoint: Path, extra: list[str], message: str,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--model", str(checkpoint), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ctpu generate: error:") and message in err and "\n" not in err, err


def test_generate_without_a_checkpoint_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "--model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert "not a Hugging Face checkpoint directory" in err and "\n" not in err, err
