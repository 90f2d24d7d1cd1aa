"""`ctpu train`: the tiny Llama trained for a few steps on the CTPU, on a synthetic token stream (seeded,
nothing downloaded): parameters and optimizer state live in HBM (device "ctpu"), the forward and backward
are compiled with backend="ctpu", and so is the optimizer step (`torch.compile(opt.step)`: one program).

    ctpu train [--steps 10] [--optimizer sgd|adamw] [--lr 0.05] [--autocast bf16] [--check] [--plot loss.png]
               [--json]

Each step prints its loss, the CTPU cycles of its launches (forward, backward, optimizer) and the ops that
ran on the CPU; `--json` has each phase's cycles, kernels and MXU utilization (`ctpu bench --train`: the
second step's). `--check` trains an eager copy of the same model alongside and compares every step's loss
(relative 1e-5, fp32 at "highest"). `--plot FILE.png` writes the loss curve (a PNG written by png.py, no
plotting library needed).

`--autocast bf16`: mixed precision. The forward runs under `torch.autocast("ctpu", dtype=torch.bfloat16)`
(compiled: the linears and attention's matmuls in bf16 on the MXU, norms, softmax and the loss in fp32), the
backward follows the forward's dtypes, the parameters, their gradients and the optimizer state stay fp32
(master weights). The eager copy of `--check` runs under `torch.autocast("cpu", dtype=torch.bfloat16)`:
for this model CPU's cast policy gives every op the dtype ctpu's (CUDA's) gives (tests/device/
test_autocast.py); the two differ by where bf16 roundings fall, so the loss is checked to bf16's unit
roundoff (LOSS_RTOL).
"""

from __future__ import annotations

import sys
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch

AUTOCAST_DTYPES = {"bf16": torch.bfloat16}
# fp32 at "highest": the compiled step differs from eager by summation order only. bf16 autocast: the loss
# comes from bf16 logits, and the CTPU and eager round to bf16 in different places (the CPU's bf16 attention
# kernel rounds its probabilities, ctpu's attention keeps them fp32; fusion keeps fp32 between ops that
# eager rounds); a loss within bf16's unit roundoff (2^-9, 1.95e-3 relative) of eager's differs from it by
# bf16 rounding. Measured: 6.1e-5 at most over 5 steps (`ctpu train --steps 5 --autocast bf16 --check`).
LOSS_RTOL = {None: 1e-5, "bf16": 2.0**-9}
# Without a cache, transformers looks for packed sequences in the position ids (a cumsum over the batch dim
# and advanced indexing: they lower now, the forward has no CPU op, but training that way is not tested);
# with one it does not, and the graphs run on the CTPU whole.
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


def autocast(device: str, precision: str | None) -> torch.autocast:
    """torch.autocast on `device` to the dtype `precision` names ("bf16"); disabled for None (fp32)."""
    if precision is not None and precision not in AUTOCAST_DTYPES:
        raise ValueError(f"unknown autocast {precision!r} (bf16)")
    return torch.autocast(device, dtype=AUTOCAST_DTYPES[precision or "bf16"], enabled=precision is not None)


def run(steps: int = 10, optimizer: str = "sgd", lr: float | None = None, batch: int = 2, length: int = 16,
        check: bool = False, config: str = "small", target: str = "sim", precision: str | None = None,
        progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train; the per-step figures and the check as a JSON-able dict. `precision`: None (fp32) or "bf16"
    (autocast, fp32 master weights)."""
    from torch_tpu_backend.llama_demo import tiny_llama

    if precision not in LOSS_RTOL:
        raise ValueError(f"unknown autocast {precision!r} (bf16)")

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
                loss, forward = _measured(lambda d=on_device: _loss(compiled, d, autocast("ctpu", precision)))
                phases = {"forward": forward, "backward": _measured(loss.backward)[1],
                          "optimizer": _measured(opt_step)[1]}
            warned.update(str(w.message)[:300] for w in caught if "ctpu" in str(w.message))
            record: dict[str, Any] = {
                "step": step, "loss": loss.item(), **{key: sum(p[key] for p in phases.values())
                                                      for key in ("cycles", "kernels", "cpu_ops")},
                "phases": phases, "seconds": time.perf_counter() - started}
            if eager is not None and eager_opt is not None:
                eager_opt.zero_grad(set_to_none=True)
                want = _loss(eager, ids, autocast("cpu", precision))
                want.backward()
                eager_opt.step()
                record["eager_loss"] = want.item()
                record["rel_err"] = abs(record["loss"] - want.item()) / abs(want.item())
            records.append(record)
            if progress is not None:
                progress(record)
    finally:
        torch.set_float32_matmul_precision(previous)
    rtol = LOSS_RTOL[precision]
    passed = all(r["rel_err"] <= rtol for r in records) if check else None
    return {"model": "tiny LlamaForCausalLM (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 128)",
            "optimizer": optimizer, "lr": lr, "batch": batch, "length": length, "target": target,
            "config": config, "autocast": precision, "steps": records,
            "check": None if not check else {"passed": passed, "rtol": rtol}, "warnings": sorted(warned)}


def _loss(model: Callable[..., Any], ids: torch.Tensor, cast: torch.autocast) -> torch.Tensor:
    """The language-model loss of `ids` (the labels are the inputs: the model shifts them), under `cast`."""
    with cast:
        return model(input_ids=ids, labels=ids, use_cache=USE_CACHE).loss


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
    amp = f", autocast {result['autocast']} (fp32 master weights)" if result["autocast"] else ""
    lines = [f"ctpu train: {result['model']}, {result['optimizer']} lr {result['lr']}{amp}, "
             f"{len(steps)} steps of {result['batch']}x{result['length']} tokens"]
    if steps:
        lines.append(f"loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}; "
                     f"{steps[-1]['cycles']:,} CTPU cycles per step, {steps[-1]['cpu_ops']} CPU ops per step")
    if result["check"] is not None:
        worst = max((r["rel_err"] for r in steps), default=0.0)
        verdict = "matches" if result["check"]["passed"] else "DIFFERS FROM"
        lines.append(f"check: every step's loss {verdict} eager (worst relative error {worst:.2e}, "
                     f"limit {result['check']['rtol']:.2g})")
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
