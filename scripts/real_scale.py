"""Real geometries on `large`: `model.generate()` with a static cache, forward compiled with backend="ctpu", bf16,
random weights; prints per compiled graph the compile seconds (wall and CPU), program bundles, layer loops and
the HBM the program needs, then parity with eager, CPU ops, cycles per launch and peak host memory as JSON.
Where a token differs from eager's, "divergence" says whether it is a near tie: at the first differing step,
both tokens' logits in eager bf16, in the CTPU's, and in an fp32 forward of the same prefix (the arbiter), and
the largest |CTPU - eager| logit difference of the step. "eager_top2_gaps": per step, eager's top logit minus its
second (a gap within bf16 rounding is a near tie).

    python scripts/real_scale.py llama 16 128256 3 17   # Llama-3.2-1B: layers, vocab, new tokens, prompt
    python scripts/real_scale.py qwen 4 2048 3 17       # Qwen3-0.6B geometry, 4 layers, vocab 2048
    python scripts/real_scale.py llama 16 128256 3 17 --inductor   # and Inductor's compile of the same forward
    python scripts/real_scale.py qwen 28 151936 16 17 --seed 6     # another prompt (its generator's seed; 1)
    python scripts/real_scale.py llama 16 128256 1 2048 --max-cycles 1000000000   # 2048-token prefill (~2 h, own core)

Set CTPU_CACHE=0 to measure compiles. The full 1B needs ~6 GB of host memory (model + simulator HBM).
`--inductor` then compiles the same forward with Inductor (CPU, fresh caches) in the same process and
reports its compile seconds beside ctpu's: the first generate (dynamo, AOT and Inductor for the prefill and
decode graphs, then the run) minus a second one (the run alone); aot_eager the same way gives what dynamo
and AOT autograd take, which ctpu's backend compile (`ctpu_backend_compile_s`) comes on top of.
"""

import json
import os
import resource
import sys
import tempfile
import time

if "--inductor" in sys.argv:  # cold Inductor compiles: its caches in a fresh folder, before torch is imported
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="ctpu_inductor_")
    os.environ["TORCHINDUCTOR_FX_GRAPH_CACHE"] = "0"

import torch

import codegen
import torch_tpu_backend.stats as ctpu_stats
from torch_tpu_backend import llama_bench


def main() -> None:
    family, layers, vocab, new, prompt = sys.argv[1], *map(int, sys.argv[2:6])  # then --inductor, optionally
    geometry = "1b" if family == "llama" else "qwen3-0.6b"  # seeded as before: 0, right before the weights
    _, m = llama_bench.build(geometry, prompt + new + 8, num_hidden_layers=layers, vocab_size=vocab)
    print("params", sum(p.numel() for p in m.parameters()), flush=True)
    seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 1
    ids = torch.randint(0, vocab, (1, prompt), generator=torch.Generator().manual_seed(seed))
    compiles = []
    compile_graph = codegen.compile_graph

    def recording(gm, args, *a, **k):  # type: ignore[no-untyped-def]
        wall, cpu = time.time(), time.process_time()
        exe = compile_graph(gm, args, *a, **k)
        inputs = sum(x.numel() * x.element_size() for x in args if isinstance(x, torch.Tensor))
        compiles.append({"wall_s": round(time.time() - wall, 1), "cpu_s": round(time.process_time() - cpu, 1),
                         "program_bundles": len(exe.program),
                         "loops": [(lp.get("runs"), lp.get("kernels")) for lp in exe.summary.get("loops", [])],
                         "input_bytes": inputs, "arena_bytes": exe.arena_bytes, "hbm_needed": inputs + exe.arena_bytes,
                         "hbm_bytes": exe.hardware.hbm_bytes})
        print("compiled", compiles[-1], flush=True)
        return exe

    codegen.compile_graph = recording

    def generate() -> torch.Tensor:
        return m.generate(ids, max_new_tokens=new, do_sample=False, cache_implementation="static",
                          output_logits=True, return_dict_in_generate=True)

    with torch.no_grad():
        t = time.time()
        ref = generate()
        eager_s = time.time() - t
        limit = int(sys.argv[sys.argv.index("--max-cycles") + 1]) if "--max-cycles" in sys.argv else None
        m.forward = torch.compile(m.forward, backend="ctpu", options={"config": "large", "cache": False,
                                                                       "max_cycles": limit})
        ctpu_stats.reset()
        t = time.time()
        out = generate()
        ctpu_s = time.time() - t
    st = ctpu_stats.last()
    other_backends = other_backends_compile(m, generate) if "--inductor" in sys.argv else None
    divergence = first_divergence(m, ref, out, prompt)
    gaps = [round(float(d[0] - d[1]), 4) for d in (lg[0].float().topk(2).values for lg in ref.logits)]
    ref, out = ref.sequences, out.sequences
    print(json.dumps({
        "family": family, "layers": layers, "vocab": vocab, "prompt": prompt, "seed": seed, "new": new,
        "equal": out.tolist() == ref.tolist(), "tokens": out[0, prompt:].tolist(),
        "ref_tokens": ref[0, prompt:].tolist(),
        "cpu_ops": dict(st.fallback_ops), "compiles": compiles, "eager_s": round(eager_s, 1),
        "ctpu_total_s": round(ctpu_s, 1), "cycles": [r.stats.cycles for r in st.launches],
        "ctpu_backend_compile_s": round(sum(c["wall_s"] for c in compiles), 1), "other_backends": other_backends,
        "divergence": divergence, "eager_top2_gaps": gaps, "launches": st.kernels_launched,
        "bundles_executed": st.bundles,
        "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}))


def other_backends_compile(m: torch.nn.Module, generate) -> dict:  # type: ignore[no-untyped-def]
    """Compile seconds of the same forward under Inductor (CPU) and under aot_eager (dynamo and AOT autograd
    alone, what ctpu's backend compile comes on top of): for each, the first generate (its compiles and the
    run) minus a second (the run alone)."""
    seconds = {}
    for backend in ("aot_eager", "inductor"):
        torch._dynamo.reset()
        m.forward = torch.compile(m.__class__.forward.__get__(m), backend=backend)
        with torch.no_grad():
            t = time.time()
            generate()
            first = time.time() - t
            t = time.time()
            generate()
            steady = time.time() - t
        seconds[backend] = {"first_generate_s": round(first, 1), "steady_generate_s": round(steady, 1),
                            "compile_s": round(first - steady, 1)}
        print(backend, seconds[backend], flush=True)
    return seconds


def first_divergence(m: torch.nn.Module, ref, out, prompt: int) -> dict | None:  # type: ignore[no-untyped-def]
    """The first step whose token differs: each token's logit in eager, on the CTPU and in fp32 (same prefix)."""
    pairs = zip(ref.sequences[0, prompt:].tolist(), out.sequences[0, prompt:].tolist(), strict=False)
    differ = [i for i, (a, b) in enumerate(pairs) if a != b]
    if not differ:
        return None
    step = differ[0]
    want, got = int(ref.sequences[0, prompt + step]), int(out.sequences[0, prompt + step])
    eager, ctpu = ref.logits[step][0].float(), out.logits[step][0].float()
    m.forward = m.__class__.forward.__get__(m)  # the uncompiled forward, in fp32
    with torch.no_grad():
        fp32 = m.float()(ref.sequences[:, :prompt + step]).logits[0, -1]
    pick = lambda logits: {"eager_token": round(float(logits[want]), 4), "ctpu_token": round(float(logits[got]), 4)}
    return {"step": step, "eager_token": want, "ctpu_token": got, "eager_bf16": pick(eager), "ctpu": pick(ctpu),
            "fp32": {**pick(fp32), "argmax": int(fp32.argmax())},
            "max_abs_logit_diff": round(float((ctpu - eager).abs().max()), 4),
            "logit_range": round(float(eager.max() - eager.min()), 4)}


if __name__ == "__main__":
    main()
