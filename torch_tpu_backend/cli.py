"""The `ctpu` command line: assemble, disassemble, run programs on a target, the demo.

    ctpu asm FILE.s -o FILE.bin          assemble
    ctpu disasm FILE.bin [-o FILE.s]     disassemble
    ctpu run PROGRAM [--target sim|rtl] [--config small|large] [--max-cycles N] [--json]
                                         run a .s or binary; a manifest beside it (PROGRAM.toml) supplies
                                         inputs and checks outputs against their numpy references
                                         (exit 1 if a check fails)
    ctpu demo                            the main job: the shipped GEMM, checked, with its MXU utilization,
                                         then the tiny Llama compiled with backend="ctpu", checked vs eager
    ctpu llama [--target sim] [--dtype float32|bfloat16] [--layers 2] [--hidden 64] [--vocab 128] [--tokens 8]
                                         a Llama (random weights) compiled with backend="ctpu", checked vs eager
    ctpu generate [--model DIR] [--prompt-ids 1,2,3 | --prompt TEXT] [--max-new-tokens 8] [--batch N]
                  [--dtype float32|bfloat16] [--config small|large] [--target sim|rtl] [--check] [--json]
                                         greedy generation with a Llama (default: the tiny random one; DIR: a
                                         local Hugging Face checkpoint), forward compiled with backend="ctpu" and
                                         a static KV cache; streams tokens, then prefill / decode figures
                                         (--check: exit 1 unless the tokens are eager PyTorch's)
    ctpu profile [--decode] [--config small|large] [--dtype float32|bfloat16] [--layers 2] [--hidden 64]
                 [--vocab 128] [--tokens 8] [--out trace.json] [--top N] [--json]
                                         profile a Llama (default: the tiny one) on the simulator: its prefill, or
                                         with --decode one decode step; writes a Chrome / Perfetto trace (a track
                                         per slot, the DMA channel, the MXU's ports, kernels named after their FX
                                         nodes, layers, stalls by cause) and prints the per-kernel roofline table
    ctpu train [--steps 10] [--optimizer sgd|adamw] [--lr LR] [--autocast bf16] [--check] [--plot FILE.png]
               [--json]
                                         trains the tiny Llama (forward and backward compiled with
                                         backend="ctpu") on a synthetic token stream: loss and CTPU cycles per
                                         step (--check: exit 1 unless every step's loss is eager's, relative
                                         1e-5, 2^-9 with --autocast bf16; --plot: the loss curve as a PNG)
    ctpu bench [--models-only]           benchmarks (JSON): compiled GEMM utilization vs the hand-written one,
                                         bundles / cycles / ops per bundle per graph, whole models (Llama)
    ctpu bench --llama 1b|1b-2l|mini|qwen3-0.6b|qwen3-0.6b-2l [--prompt 17 | --context 4096] [--top N]
                                         a bf16 Llama on large: decode cycles / token against the HBM
                                         roofline, prefill MXU utilization (JSON)
    ctpu bench --llama GEOMETRY --dynamic 17,33,129
                                         dynamic-shape overhead: each length's cycles compiled with the
                                         sequence dynamic (one program a bucket) against dynamic=False (JSON)
    ctpu bench --train [--config small] [--autocast bf16]
                                         the tiny Llama's training step (SGD, 2 steps, the second measured):
                                         cycles, kernels and MXU utilization of forward, backward, optimizer
    ctpu isa                             the instruction table, as markdown

Bad input (a file that is missing, a directory or not text, malformed assembly, a broken binary or manifest,
a trap, HBM exhausted) is one line on stderr naming the file (and line or bundle), exit status 2; never a
traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

PROGRAMS_DIR = Path(__file__).resolve().parent.parent / "device_sim" / "programs"


def _cmd_asm(args: argparse.Namespace) -> int:
    from device_sim.asm import assemble_file

    program = assemble_file(args.file)
    out = Path(args.output or Path(args.file).with_suffix(".bin"))
    out.write_bytes(program.to_bytes())
    print(f"{args.file}: {len(program)} bundles -> {out}")
    return 0


def _cmd_disasm(args: argparse.Namespace) -> int:
    from device_sim.asm import disassemble, load_program

    text = disassemble(load_program(args.file))
    if args.output:
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from device_sim.manifest import run_manifest

    result = run_manifest(args.program, target=args.target, config=args.config, max_cycles=args.max_cycles)
    if args.json:
        print(json.dumps(result.as_dict(), indent=2))
    else:
        print(result.summary())
    return 0 if result.passed else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    """The hand-written GEMM program (the MXU yardstick), then the tiny Llama through torch.compile."""
    import torch

    from device_sim.manifest import run_manifest
    from torch_tpu_backend import llama_demo

    gemm = run_manifest(str(PROGRAMS_DIR / "gemm.s"), target=args.target)
    if not args.json:
        print(gemm.summary(), flush=True)
    llama = llama_demo.run(target=args.target, dtype=torch.float32)
    if args.json:
        print(json.dumps({"gemm": gemm.as_dict(), "llama": llama}, indent=2))
    else:
        print(llama_demo.summary(llama))
    return 0 if gemm.passed and llama["passed"] else 1


def _cmd_llama(args: argparse.Namespace) -> int:
    import torch

    from torch_tpu_backend import llama_demo

    result = llama_demo.run(target=args.target, config=args.config, dtype=getattr(torch, args.dtype),
                            tokens=args.tokens, precision=args.precision, layers=args.layers, hidden=args.hidden,
                            vocab=args.vocab)
    print(json.dumps(result, indent=2) if args.json else llama_demo.summary(result))
    return 0 if result["passed"] else 1


def _cmd_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers.utils import logging as hf_logging

    from torch_tpu_backend import generate

    hf_logging.disable_progress_bar()  # stderr carries one bar (generation's) or the one-line error

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    result = generate.run(model_dir=args.model, prompt_ids=args.prompt_ids, prompts=args.prompt,
                          max_new_tokens=args.max_new_tokens, dtype=getattr(torch, args.dtype), config=args.config,
                          target=args.target, batch=args.batch, check=args.check,
                          write=None if args.json else write)
    print(json.dumps(result, indent=2) if args.json else generate.summary(result))
    return 1 if result["check"] is not None and not result["check"]["passed"] else 0


def _cmd_profile(args: argparse.Namespace) -> int:
    import logging

    import torch

    from torch_tpu_backend import profiler

    def progress(text: str) -> None:
        print(f"ctpu profile: {text}", file=sys.stderr, flush=True)

    handler = logging.StreamHandler(sys.stderr)  # the compiler's progress (kernels compiled) on long compiles
    handler.setFormatter(logging.Formatter("ctpu profile: %(message)s"))
    backend_log = logging.getLogger("ctpu.backend")
    backend_log.addHandler(handler)
    level = backend_log.level
    backend_log.setLevel(logging.INFO)
    try:
        result = profiler.run(args.out, decode=args.decode, config=args.config, dtype=getattr(torch, args.dtype),
                              tokens=args.tokens, layers=args.layers, hidden=args.hidden, vocab=args.vocab,
                              precision=args.precision, progress=progress)
    finally:
        backend_log.removeHandler(handler)
        backend_log.setLevel(level)
    result.pop("profile")
    print(json.dumps(result, indent=2) if args.json else profiler.summary(result, args.top))
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from torch_tpu_backend import train

    on_step, close = (None, None) if args.json else train.progress_printer(args.steps)
    try:
        result = train.run(steps=args.steps, optimizer=args.optimizer, lr=args.lr, check=args.check,
                           config=args.config, target=args.target, precision=args.autocast, progress=on_step)
    finally:
        if close is not None:
            close()
    if args.plot:
        from torch_tpu_backend.png import write_line_plot

        series = {"ctpu": [r["loss"] for r in result["steps"]]}
        if args.check:
            series["eager"] = [r["eager_loss"] for r in result["steps"]]
        write_line_plot(args.plot, series)
        result["plot"] = args.plot
    print(json.dumps(result, indent=2) if args.json else train.summary(result))
    if args.plot and not args.json:
        print(f"loss curve: {args.plot}")
    return 1 if result["check"] is not None and not result["check"]["passed"] else 0


def _cmd_bench(args: argparse.Namespace) -> int:
    from codegen import bench
    from torch_tpu_backend import model_bench

    if args.llama is not None:
        from torch_tpu_backend import llama_bench

        if args.dynamic is not None:
            print(f"ctpu bench: {args.llama}, forwards of {args.dynamic} tokens, dynamic against static on large "
                  "(compiling)", file=sys.stderr)
            result = llama_bench.run_dynamic(args.llama, args.dynamic)
        elif args.context is not None:
            print(f"ctpu bench: {args.llama}, one decode step at context {args.context} on large (compiling)",
                  file=sys.stderr)
            result = llama_bench.run_context(args.llama, args.context, top=args.top)
        else:
            print(f"ctpu bench: {args.llama}, a prefill and one decode step on large (compiling)",
                  file=sys.stderr)
            result = llama_bench.run(args.llama, prompt=args.prompt, top=args.top)
        print(json.dumps(result, indent=2))
        return 0
    if args.train:
        from torch_tpu_backend import train

        print(f"ctpu bench: training the tiny Llama on {args.config}, 2 steps (compiling)", file=sys.stderr)
        trained = train.run(steps=2, config=args.config, precision=args.autocast)
        print(json.dumps({key: trained[key] for key in ("model", "optimizer", "batch", "length", "config",
                                                        "autocast")}
                         | {"step": trained["steps"][-1]}, indent=2))
        return 0
    result: dict[str, object] = {"config": args.config}
    if not args.models_only:
        result |= bench.collect(args)

    def progress(name: str) -> None:
        print(f"ctpu bench: {name}", file=sys.stderr)

    result["models"] = model_bench.run(args.config, progress)
    result["generation"] = model_bench.generation(args.config, progress=progress)
    print(json.dumps(result, indent=2))
    return 0


def _cmd_isa(args: argparse.Namespace) -> int:
    from device_sim import isa

    print("| mnemonic | opcode | unit | operands | latency | semantics |")
    print("| --- | --- | --- | --- | --- | --- |")
    for i in isa.INSTRUCTIONS:
        ops = ", ".join(f"{o.field}:{o.kind.value}" for o in i.operands)
        print(f"| `{i.mnemonic}` | 0x{i.opcode:02x} | {i.unit.value} | {ops} | {i.latency} | {i.semantics} |")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ctpu", description="ctpu: assemble, disassemble and run CTPU programs")
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("asm", help="assemble a .s file into a binary")
    a.add_argument("file")
    a.add_argument("-o", "--output")
    a.set_defaults(fn=_cmd_asm)

    d = sub.add_parser("disasm", help="disassemble a binary")
    d.add_argument("file")
    d.add_argument("-o", "--output")
    d.set_defaults(fn=_cmd_disasm)

    r = sub.add_parser("run", help="run a program (.s or binary) on a target")
    r.add_argument("program")
    r.add_argument("--target", choices=["sim", "rtl"], default="sim")
    r.add_argument("--config", choices=["small", "large"], default=None, help="default: the manifest's, else small")
    r.add_argument("--max-cycles", type=_positive, default=None,
                   help="the cycle limit (default: max_cycles in the manifest, else 20,000 cycles a bundle of the "
                   "program, at least 1,000,000)")
    r.add_argument("--json", action="store_true", help="print the statistics and checks as JSON")
    r.set_defaults(fn=_cmd_run)

    m = sub.add_parser("demo", help="the shipped GEMM program (checked, with its MXU utilization), then the tiny "
                       "Llama compiled with backend='ctpu' (logits checked against eager)")
    m.add_argument("--target", choices=["sim", "rtl"], default="sim")
    m.add_argument("--json", action="store_true")
    m.set_defaults(fn=_cmd_demo)

    ll = sub.add_parser("llama", help="compile and run the tiny Llama with backend='ctpu', checked against eager")
    ll.add_argument("--target", choices=["sim", "rtl", "ptx"], default="sim")
    ll.add_argument("--config", choices=["small", "large"], default="small")
    ll.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ll.add_argument("--tokens", type=int, default=8)
    ll.add_argument("--layers", type=int, default=2)
    ll.add_argument("--hidden", type=int, default=64, help="a multiple of 32 (head dim 16, GQA 2:1)")
    ll.add_argument("--vocab", type=int, default=128)
    ll.add_argument("--precision", choices=["highest", "high", "medium"], default="highest")
    ll.add_argument("--json", action="store_true")
    ll.set_defaults(fn=_cmd_llama)

    g = sub.add_parser("generate", help="greedy generation with a Llama compiled with backend='ctpu' (static KV "
                       "cache), tokens streamed, then prefill / decode cycles per token, tokens/s, host bytes")
    g.add_argument("--model", metavar="DIR", help="a local Hugging Face checkpoint (config.json + safetensors); "
                   "default: the tiny random-weight Llama. Nothing is downloaded")
    g.add_argument("--prompt-ids", type=_token_ids, action="append", metavar="1,2,3",
                   help="a prompt as token ids (repeat for several prompts)")
    g.add_argument("--prompt", action="append", metavar="TEXT", help="a prompt as text (needs the checkpoint's "
                   "tokenizer; repeat for several prompts)")
    g.add_argument("--max-new-tokens", type=_positive, default=8)
    g.add_argument("--batch", type=_positive, default=1, help="rows, cycling through the prompts; rows of "
                   "different lengths are left-padded")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    g.add_argument("--config", choices=["small", "large"], default="small")
    g.add_argument("--target", choices=["sim", "rtl"], default="sim")
    g.add_argument("--check", action="store_true", help="compare the tokens with eager PyTorch's (exit 1 if not equal)")
    g.add_argument("--json", action="store_true", help="print the tokens and figures as JSON (no streaming)")
    g.set_defaults(fn=_cmd_generate)

    pr = sub.add_parser("profile", help="profile a Llama's prefill (or --decode: one decode step) on the "
                        "simulator: a Chrome / Perfetto trace and a per-kernel roofline table")
    pr.add_argument("--decode", action="store_true", help="one decode step of greedy generation with a static KV "
                    "cache (after a --tokens prefill), instead of the prefill")
    pr.add_argument("--config", choices=["small", "large"], default="small")
    pr.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    pr.add_argument("--tokens", type=_positive, default=8, help="prompt tokens")
    pr.add_argument("--layers", type=_positive, default=2)
    pr.add_argument("--hidden", type=_positive, default=64, help="a multiple of 32 (head dim 16, GQA 2:1)")
    pr.add_argument("--vocab", type=_positive, default=128)
    pr.add_argument("--precision", choices=["highest", "high", "medium"], default="highest")
    pr.add_argument("--out", default="trace.json", help="the trace file (default trace.json)")
    pr.add_argument("--top", type=_positive, default=None, help="only the N kernels with the most cycles")
    pr.add_argument("--json", action="store_true", help="print the figures and the roofline table as JSON")
    pr.set_defaults(fn=_cmd_profile)
    t = sub.add_parser("train", help="train the tiny Llama (forward and backward compiled with backend='ctpu') on "
                       "a synthetic token stream: loss and CTPU cycles per step")
    t.add_argument("--steps", type=_positive, default=10)
    t.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    t.add_argument("--lr", type=float, default=None, help="default: 0.05 for sgd, 3e-3 for adamw")
    t.add_argument("--config", choices=["small", "large"], default="small")
    t.add_argument("--target", choices=["sim", "rtl"], default="sim")
    t.add_argument("--autocast", choices=["bf16"], help="mixed precision: the forward under torch.autocast('ctpu', "
                   "bf16), fp32 master weights (default: fp32 at 'highest')")
    t.add_argument("--check", action="store_true", help="train an eager copy alongside; exit 1 unless every step's "
                   "loss matches (relative 1e-5; with --autocast bf16: 2^-9, bf16's unit roundoff, against eager "
                   "under autocast('cpu'))")
    t.add_argument("--plot", metavar="FILE.png", help="write the loss curve as a PNG")
    t.add_argument("--json", action="store_true", help="print the figures as JSON")
    t.set_defaults(fn=_cmd_train)

    b = sub.add_parser("bench", help="compiler benchmarks, printed as JSON: the compiled GEMM's MXU utilization "
                       "against the hand-written one, small graphs, pipelining, whole models through torch.compile")
    b.add_argument("--size", type=int, default=512, help="GEMM size (cubed)")
    b.add_argument("--config", choices=["small", "large"], default="small")
    b.add_argument("--skip-gemm", action="store_true")
    b.add_argument("--models-only", action="store_true", help="only the torch.compile graphs (Llama included)")
    b.add_argument("--llama", metavar="GEOMETRY",
                   choices=["1b", "1b-2l", "mini", "qwen3-0.6b", "qwen3-0.6b-2l"],
                   help="only this bf16 Llama-family model on large (1b: Llama-3.2-1B; qwen3-0.6b: Qwen3-0.6B; -2l: "
                   "two of its layers, a small vocab): decode cycles per token against the HBM roofline, prefill MXU "
                   "utilization")
    b.add_argument("--train", action="store_true", help="only the tiny Llama's training step: cycles, kernels and "
                   "MXU utilization of its forward, backward and optimizer (JSON)")
    b.add_argument("--autocast", choices=["bf16"], help="with --train: the step under torch.autocast('ctpu', bf16)")
    b.add_argument("--prompt", type=int, default=17, help="prompt tokens (--llama)")
    b.add_argument("--context", type=_positive, help="with --llama: only one decode step, at the last of this many "
                   "cached positions (random keys and values; no prefill)")
    b.add_argument("--top", type=int, help="with --llama: profile the decode step, its N longest kernels")
    b.add_argument("--dynamic", type=_lengths, metavar="N,N,...", help="with --llama: forwards of these prompt "
                   "lengths compiled with the sequence dynamic and with dynamic=False: cycles and their ratio")
    b.set_defaults(fn=_cmd_bench)

    i = sub.add_parser("isa", help="print the instruction table as markdown")
    i.set_defaults(fn=_cmd_isa)
    return p


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(x) for x in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of lengths") from None
    if min(lengths) < 2:
        raise argparse.ArgumentTypeError(f"{text}: prompt lengths of at least 2 (dynamo specializes 0 and 1)")
    return lengths


def _positive(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not a positive number")
    return value


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token ids") from None
    if not ids:
        raise argparse.ArgumentTypeError("an empty prompt")
    return ids


def _bad_input(err: Exception) -> bool:
    """What the user's input caused (reported in one line), as against a bug in ctpu (a traceback)."""
    from device_sim.asm import AsmError
    from device_sim.program import BinaryFormatError
    from device_sim.simulator import CtpuTrap

    kinds: tuple[type[Exception], ...] = (AsmError, BinaryFormatError, CtpuTrap, OSError, ValueError)
    torch = sys.modules.get("torch")  # imported by the commands that run models; `ctpu asm` never imports it
    if torch is not None:
        kinds += (torch.OutOfMemoryError,)
    return isinstance(err, kinds)


def _message(err: Exception) -> str:
    if isinstance(err, OSError) and err.filename is not None:
        text = f"{err.filename}: {(err.strerror or str(err)).lower()}"
    else:
        text = str(err)
    return "; ".join([text, *getattr(err, "__notes__", ())])


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except Exception as e:
        if not _bad_input(e):
            raise
        print(f"ctpu {args.command}: error: {_message(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
