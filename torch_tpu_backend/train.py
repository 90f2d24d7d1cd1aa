"""`ctpu train`: the tiny Llama trained for a few steps on the CTPU, on a synthetic token stream (seeded,
nothing downloaded): parameters and optimizer state live in HBM (device "ctpu"), the forward and backward
are compiled with backend="ctpu", and so is the optimizer step (`torch.compile(opt.step)`: one program).

    ctpu train [--steps 10] [--optimizer sgd|adamw] [--lr 0.05] [--check] [--plot loss.png] [--json]

Each step prints its loss, the CTPU cycles of its launches (forward, backward, optimizer) and the ops that
ran on the CPU; `--json` has each phase's cycles, kernels and MXU utilization (`ctpu bench --train`: the
second step's). `--check` trains an eager copy of the same model alongside and compares every step's loss
(relative 1e-5, fp32 at "highest"). `--plot FILE.png` writes the loss curve (a PNG written by png.py, no
plotting library needed).
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

LOSS_RTOL = 1e-5  # fp32 at "highest": the compiled step differs from eager by summation order only
# Without a cache, transformers looks for packed sequences in the position ids (a cumsum and advanced
# indexing that have no CTPU lowering yet); with one it does not, and the graphs run on the CTPU whole.
USE_CACHE = True


def token_stream(vocab: int, batch: int, length: int, seed: int = 0) -> Iterator[torch.Tensor]:
    """Endless batches [batch, length] of a learnable synthetic language: each sequence counts up by a
    stride of its own from a random start, modulo the vocabulary (the next token follows from the last two)."""
    gen = torch.Generator().manual_seed(seed)
    positions = torch.arange(length)
    while True:
        start = torch.randint(0, vocab, (batch, 1), generator=gen)
        stride = torch.randint(1, 4, (batch, 1), generator=gen)
        yield (start + stride * positions) % vocab


def make_optimizer(name: str, params: Any, lr: float) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    raise ValueError(f"unknown optimizer {name!r} (sgd or adamw)")


def run(steps: int = 10, optimizer: str = "sgd", lr: float | None = None, batch: int = 2, length: int = 16,
        check: bool = False, config: str = "small", target: str = "sim",
        progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train; the per-step figures and the check as a JSON-able dict."""
    from torch_tpu_backend.llama_demo import tiny_llama

    lr = lr if lr is not None else (0.05 if optimizer == "sgd" else 3e-3)
    model = tiny_llama().train().to("ctpu")
    eager = tiny_llama().train() if check else None
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    torch._dynamo.reset()
    options = {"target": target, "config": config}
    compiled = torch.compile(model, backend="ctpu", options=options)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    opt_step = torch.compile(opt.step, backend="ctpu", options=options)
    eager_opt = make_optimizer(optimizer, eager.parameters(), lr) if eager is not None else None
    data = token_stream(model.config.vocab_size, batch, length)
    records: list[dict[str, Any]] = []
    warned: set[str] = set()
    try:
        for step in range(1, steps + 1):
            ids = next(data)
            started = time.perf_counter()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                opt.zero_grad(set_to_none=True)
                on_device = ids.to("ctpu")
                loss, forward = _measured(lambda d=on_device: compiled(input_ids=d, labels=d,
                                                                        use_cache=USE_CACHE).loss)
                phases = {"forward": forward, "backward": _measured(loss.backward)[1],
                          "optimizer": _measured(opt_step)[1]}
            warned.update(str(w.message)[:300] for w in caught if "ctpu" in str(w.message))
            record: dict[str, Any] = {
                "step": step, "loss": loss.item(), **{key: sum(p[key] for p in phases.values())
                                                      for key in ("cycles", "kernels", "cpu_ops")},
                "phases": phases, "seconds": time.perf_counter() - started}
            if eager is not None and eager_opt is not None:
                eager_opt.zero_grad(set_to_none=True)
                want = eager(input_ids=ids, labels=ids, use_cache=USE_CACHE).loss
                want.backward()
                eager_opt.step()
                record["eager_loss"] = want.item()
                record["rel_err"] = abs(record["loss"] - want.item()) / abs(want.item())
            records.append(record)
            if progress is not None:
                progress(record)
    finally:
        torch.set_float32_matmul_precision(previous)
    passed = all(r["rel_err"] <= LOSS_RTOL for r in records) if check else None
    return {"model": "tiny LlamaForCausalLM (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 128)",
            "optimizer": optimizer, "lr": lr, "batch": batch, "length": length, "target": target,
            "config": config, "steps": records, "check": None if not check else {"passed": passed,
                                                                                "rtol": LOSS_RTOL},
            "warnings": sorted(warned)}


def _measured(fn: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """fn() and what its launches cost on the CTPU: cycles, kernels, MXU utilization, CPU ops."""
    import torch_tpu_backend.stats as ctpu_stats

    ctpu_stats.reset()
    out = fn()
    s = ctpu_stats.last()
    return out, {"cycles": s.cycles, "kernels": s.kernels_launched, "mxu_utilization": round(s.mxu_utilization, 4),
                 "cpu_ops": sum(n for op, n in s.fallback_ops.items() if "getitem" not in op)}


def summary(result: dict[str, Any]) -> str:
    steps = result["steps"]
    lines = [f"ctpu train: {result['model']}, {result['optimizer']} lr {result['lr']}, "
             f"{len(steps)} steps of {result['batch']}x{result['length']} tokens"]
    if steps:
        lines.append(f"loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}; "
                     f"{steps[-1]['cycles']:,} CTPU cycles per step, {steps[-1]['cpu_ops']} CPU ops per step")
    if result["check"] is not None:
        worst = max((r["rel_err"] for r in steps), default=0.0)
        verdict = "matches" if result["check"]["passed"] else "DIFFERS FROM"
        lines.append(f"check: every step's loss {verdict} eager (worst relative error {worst:.2e}, "
                     f"limit {result['check']['rtol']:.0e})")
    return "\n".join(lines)


def step_line(record: dict[str, Any]) -> str:
    line = f"step {record['step']:3d}  loss {record['loss']:.6f}  {record['cycles']:>11,} cycles"
    if "eager_loss" in record:
        line += f"  eager {record['eager_loss']:.6f} (rel {record['rel_err']:.1e})"
    return line + (f"  {record['cpu_ops']} CPU ops" if record["cpu_ops"] else "")


def progress_printer(total: int) -> tuple[Callable[[dict[str, Any]], None], Callable[[], None]]:
    """(on each step: a progress bar step on stderr and the step's line on stdout, close)."""
    from tqdm import tqdm

    bar = tqdm(total=total, desc="ctpu train", unit="step", file=sys.stderr, leave=False)

    def on_step(record: dict[str, Any]) -> None:
        bar.write(step_line(record), file=sys.stdout)
        bar.update(1)

    return on_step, bar.close
