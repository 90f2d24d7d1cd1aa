"""`ctpu generate`: greedy generation with a Llama-architecture model whose forward is compiled with
backend="ctpu" (static KV cache: one prefill graph, one decode graph), tokens streamed as they come, then
the prefill and decode figures: CTPU cycles per token, simulated tokens/s at the configuration's clock, the
simulator's wall tokens/s, host <-> HBM bytes, CPU ops; with `check`, whether the tokens are eager's.

The model is the tiny random-weight Llama (llama_demo.tiny_llama) or a local Hugging Face checkpoint
(config.json + safetensors, as save_pretrained writes it); nothing is ever downloaded.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

import torch_tpu_backend.stats as ctpu_stats


@dataclass
class Phase:
    """The figures of the forward calls of one phase (prefill: the first call; decode: the others)."""

    calls: int = 0
    tokens: int = 0  # tokens the calls processed (batch rows x positions)
    cycles: int = 0
    kernels: int = 0
    cpu_ops: int = 0  # op calls that ran on the CPU (compiled graphs' CPU segments, eager fallbacks)
    uncompiled_calls: int = 0  # calls dynamo ran without the backend
    host_bytes_uploaded: int = 0
    host_bytes_read_back: int = 0
    sim_seconds: float = 0.0  # the simulator's (or the RTL's) wall time in launches
    wall_seconds: float = 0.0  # the calls' wall time (compiles included)
    clock_mhz: int = 0
    figures: dict[str, float | None] = field(default_factory=dict)

    def add(self, tokens: int, s: ctpu_stats.ExecutionStats, wall: float) -> None:
        self.calls += 1
        self.tokens += tokens
        self.cycles += s.cycles
        self.kernels += s.kernels_launched
        self.cpu_ops += sum(s.fallback_ops.values())
        self.uncompiled_calls += sum(s.uncompiled_calls.values())
        self.host_bytes_uploaded += s.host_bytes_uploaded
        self.host_bytes_read_back += s.host_bytes_read_back
        self.sim_seconds += sum(r.stats.wall_seconds for r in s.launches)
        self.wall_seconds += wall

    def finish(self) -> dict[str, Any]:
        per_token = self.cycles / self.tokens if self.tokens else None
        self.figures = {
            "cycles_per_token": per_token,
            "simulated_tokens_per_second": self.clock_mhz * 1e6 / per_token if per_token else None,
            "simulator_tokens_per_second": self.tokens / self.sim_seconds if self.sim_seconds else None,
            "host_bytes_per_call": (self.host_bytes_uploaded + self.host_bytes_read_back) / self.calls
            if self.calls else None,
        }
        return asdict(self)


def load_model(model_dir: str | None, dtype: torch.dtype, **shape: int) -> tuple[torch.nn.Module, Any, str]:
    """(model in eval mode, its tokenizer or None, a description). A checkpoint loads from disk only; without
    one, the random-weight Llama of `llama_demo.tiny_llama(**shape)` (layers, hidden, vocab)."""
    from torch_tpu_backend.llama_demo import tiny_llama

    if model_dir is None:
        model = tiny_llama(dtype, **shape)
        return model, None, f"Llama (random weights, seed 0{''.join(f', {k} {v}' for k, v in shape.items())})"
    path = Path(model_dir)
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"{model_dir}: not a Hugging Face checkpoint directory (no config.json)")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True, dtype=dtype).eval()
    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError, TypeError):  # no tokenizer files in the checkpoint
        tokenizer = None
    return model, tokenizer, f"{type(model).__name__} from {model_dir}"


def make_batch(model: torch.nn.Module, tokenizer: Any, prompt_ids: Sequence[Sequence[int]] | None,
               prompts: Sequence[str] | None, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) of `batch` rows cycling through the prompts, left-padded to one length."""
    vocab = model.config.vocab_size
    if prompts:
        if tokenizer is None:
            raise ValueError("--prompt needs a tokenizer, and the model has none (give --model a checkpoint with "
                             "tokenizer files, or use --prompt-ids)")
        rows = [tokenizer(p)["input_ids"] for p in prompts]
    elif prompt_ids:
        rows = [list(r) for r in prompt_ids]
    else:
        rows = [torch.randint(0, vocab, (8,), generator=torch.Generator().manual_seed(1)).tolist()]
    if batch < 1:
        raise ValueError(f"--batch {batch}: at least 1")
    rows = [rows[i % len(rows)] for i in range(batch)]
    for r in rows:
        if not r:
            raise ValueError("a prompt has no tokens")
        bad = [t for t in r if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary (0 .. {vocab - 1})")
    width = max(len(r) for r in rows)
    pad = pad_token_id(model)
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def pad_token_id(model: torch.nn.Module) -> int:
    gen = model.generation_config
    for value in (gen.pad_token_id, gen.eos_token_id, 0):
        if isinstance(value, list):
            value = value[0] if value else None
        if value is not None:
            return int(value)
    return 0


class TokenStreamer:
    """transformers' streamer API (put / end): shows each step's new tokens (ids, or text for one row with a
    tokenizer) and moves the progress bar."""

    def __init__(self, total: int, tokenizer: Any, write: Callable[[str], None] | None) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=total, desc="ctpu generate", unit="tok", file=sys.stderr, leave=False)
        self.tokenizer, self.write = tokenizer, write
        self.prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # the first put is the prompt
            self.prompt_seen = True
            return
        ids = value.reshape(-1).tolist()
        self.bar.update(1)
        if self.write is not None:
            if self.tokenizer is not None and len(ids) == 1:
                self.write(self.tokenizer.decode(ids))
            else:
                self.write(" ".join(map(str, ids)) + ("\n" if len(ids) > 1 else " "))

    def end(self) -> None:
        self.bar.close()
        if self.write is not None:
            self.write("\n")


def run(model_dir: str | None = None, prompt_ids: Sequence[Sequence[int]] | None = None,
        prompts: Sequence[str] | None = None, max_new_tokens: int = 8, dtype: torch.dtype = torch.float32,
        config: str = "small", target: str = "sim", batch: int = 1, check: bool = False,
        write: Callable[[str], None] | None = None, profile: str | None = None, **shape: int) -> dict[str, Any]:
    """Generate greedily with the forward compiled for the CTPU; the figures as a JSON-able dict. `shape`
    (layers, hidden, vocab) sizes the random-weight Llama used without a checkpoint; `profile`: the backend
    option (a folder for one trace per launch)."""
    from device_sim.config import get_config

    if max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens {max_new_tokens}: at least 1")
    model, tokenizer, description = load_model(model_dir, dtype, **shape)
    model.config.use_cache = True  # the tiny Llama's config turns it off; a static cache needs it
    ids, mask = make_batch(model, tokenizer, prompt_ids, prompts, batch)
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and ids.shape[1] + max_new_tokens > limit:
        raise ValueError(f"prompt ({ids.shape[1]} tokens) + {max_new_tokens} new tokens exceed the model's "
                         f"{limit} positions")
    kwargs = {"attention_mask": mask, "max_new_tokens": max_new_tokens, "do_sample": False, "use_cache": True,
              "cache_implementation": "static", "pad_token_id": pad_token_id(model)}
    eager = None
    with torch.no_grad():
        if check:
            eager = model.generate(ids, **kwargs)[:, ids.shape[1]:].tolist()
        clock = get_config(config).clock_mhz
        prefill, decode = Phase(clock_mhz=clock), Phase(clock_mhz=clock)
        options = {"target": target, "config": config} | ({"profile": profile} if profile is not None else {})
        compiled = torch.compile(model.forward, backend="ctpu", options=options)

        @functools.wraps(model.forward)  # generate() reads the forward's signature (logits_to_keep, ...)
        def forward(*args: Any, **kw: Any) -> Any:
            phase = decode if prefill.calls else prefill
            positions = (kw.get("input_ids") if kw.get("input_ids") is not None else args[0]).shape
            ctpu_stats.reset()
            started = time.perf_counter()
            out = compiled(*args, **kw)
            phase.add(positions[0] * positions[1], ctpu_stats.last(), time.perf_counter() - started)
            return out

        model.forward = forward
        started = time.perf_counter()
        try:
            out = model.generate(ids, streamer=TokenStreamer(max_new_tokens, tokenizer, write), **kwargs)
        finally:
            del model.forward  # the instance attribute goes; the class's forward is back
        wall = time.perf_counter() - started
    tokens = out[:, ids.shape[1]:].tolist()
    result: dict[str, Any] = {
        "model": description, "dtype": str(dtype).removeprefix("torch."), "config": config, "target": target,
        "clock_mhz": clock, "batch": batch, "prompt_tokens": int(ids.shape[1]), "new_tokens": len(tokens[0]),
        "prompt_ids": ids.tolist(), "tokens": tokens, "prefill": prefill.finish(), "decode": decode.finish(),
        "wall_seconds": wall, "check": None if eager is None else {"passed": eager == tokens, "eager_tokens": eager},
    }
    if tokenizer is not None:
        result["text"] = [tokenizer.decode(t) for t in tokens]
    return result


def summary(result: dict[str, Any]) -> str:
    """The figures as text."""
    lines = [f"{result['model']}, {result['dtype']}, batch {result['batch']}, {result['prompt_tokens']} prompt + "
             f"{result['new_tokens']} new tokens, on {result['target']} ({result['config']}, "
             f"{result['clock_mhz']} MHz), {result['wall_seconds']:.1f} s"]
    for name in ("prefill", "decode"):
        p = result[name]
        f = p["figures"]
        if not p["calls"]:
            lines.append(f"  {name}: no calls")
            continue
        lines.append(
            f"  {name}: {p['calls']} call(s), {p['tokens']} token(s), {p['kernels']} kernel(s), "
            f"{_num(f['cycles_per_token'])} cycles/token, {_num(f['simulated_tokens_per_second'])} tokens/s "
            f"simulated, {_num(f['simulator_tokens_per_second'])} tokens/s simulator wall, host bytes "
            f"{p['host_bytes_uploaded']} up / {p['host_bytes_read_back']} back, {p['cpu_ops']} CPU op(s)"
            + (f", {p['uncompiled_calls']} call(s) not compiled" if p["uncompiled_calls"] else ""))
    if result["check"] is not None:
        lines.append(f"  tokens equal eager PyTorch's: {'yes' if result['check']['passed'] else 'NO'}")
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}" if x >= 100 else f"{x:.3g}"
