"""Print the ptxas figures table of docs/ptx.md: `python scripts/ptx_figures.py` (no GPU needed)."""

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from ptx_kernels import assemble, kernel_for, kernel_for_subgraph

B, F = torch.bfloat16, torch.float32
cases = [
    ("rms_norm bf16 [16384,4096]", "ctpu::rms_norm", [(16384, 4096), (4096,)], [B, B], {}),
    ("rms_norm f32 [2,40000] (streamed)", "ctpu::rms_norm", [(2, 40000), (40000,)], [F, F], {}),
    ("layer_norm bf16 [4,4096]", "ctpu::layer_norm", [(4, 4096), (4096,), (4096,)], [B, F, F], {}),
    ("softmax bf16 [4,32000]", "ctpu::softmax", [(4, 32000)], [B], {}),
    ("swiglu silu bf16 [16384,11008]", "ctpu::swiglu", [(16384, 11008)] * 2, [B, B], {"act": "silu"}),
    ("swiglu gelu f32 [7,13]", "ctpu::swiglu", [(7, 13)] * 2, [F, F], {"act": "gelu"}),
    (
        "rope bf16 [1,32,128,128]",
        "ctpu::rope",
        [(1, 32, 128, 128), (1, 1, 128, 128), (1, 1, 128, 128)],
        [B, F, F],
        {},
    ),
    (
        "attention bf16 D=64 prefill causal GQA 8/2",
        "ctpu::attention",
        [(2, 8, 77, 64), (2, 2, 77, 64), (2, 2, 77, 64), None],
        [B, B, B, None],
        {"causal": True},
    ),
    (
        "attention f32 D=128 decode S=300",
        "ctpu::attention",
        [(2, 8, 1, 128), (2, 8, 300, 128), (2, 8, 300, 128), None],
        [F, F, F, None],
        {},
    ),
    (
        "attention bf16 D=128 bool mask",
        "ctpu::attention",
        [(1, 4, 16, 128), (1, 4, 16, 128), (1, 4, 16, 128), (1, 1, 16, 16)],
        [B, B, B, torch.bool],
        {},
    ),
    ("mm 4096^3 w [K,N] (BN=256)", "aten::mm", [(4096, 4096), (4096, 4096)], [B, B], {"w_layout": "kn"}),
    ("mm 100x72x200 w [K,N] (BN=128)", "aten::mm", [(100, 200), (200, 72)], [B, B], {"w_layout": "kn"}),
    (
        "linear 74x200x512 bias+gelu+residual",
        "ctpu::linear",
        [(2, 37, 512), (512, 200), (200,), (2, 37, 200)],
        [B] * 4,
        {"act": "gelu"},
    ),
    ("mm f32 4096^3 SIMT w [K,N]", "aten::mm", [(4096, 4096), (4096, 4096)], [F, F], {"w_layout": "kn"}),
    (
        "linear f32 SIMT 74x200x96 bias+silu+residual",
        "ctpu::linear",
        [(2, 37, 96), (96, 200), (200,), (2, 37, 200)],
        [F] * 4,
        {"act": "silu"},
    ),
    ("mm bf16 16x16x13 (K % 8 != 0: SIMT)", "aten::mm", [(16, 13), (13, 16)], [B, B], {}),
    (
        "attention f32 D=16 prefill causal GQA 4/2",
        "ctpu::attention",
        [(1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16), None],
        [F, F, F, None],
        {"causal": True},
    ),
    (
        "attention bf16 D=240 decode S=300",
        "ctpu::attention",
        [(1, 8, 1, 240), (1, 8, 300, 240), (1, 8, 300, 240), None],
        [B, B, B, None],
        {},
    ),
    (
        "linear 4096x4096x4096 no epilogue (nk)",
        "ctpu::linear",
        [(4096, 4096), (4096, 4096), None, None],
        [B, B, None, None],
        {},
    ),
]


def _row(label, r, k) -> str:
    spills = f"{r.spill_stores}/{r.spill_loads}"
    return f"| {label} | {r.registers} | {spills} | {k.smem_bytes} | {k.grid} x {k.block[0]} |"


def main() -> None:
    print("| kernel | registers | spill st/ld (bytes) | dyn. smem (bytes) | grid x block |")
    print("| --- | --- | --- | --- | --- |")
    for label, op, s, d, a in cases:
        k = kernel_for(op, s, d, a)
        r = assemble(k)
        print(_row(label, r, k))

    def rms(x, w):
        v = x.float()
        return (v * torch.rsqrt((v * v).mean(-1, keepdim=True) + 1e-6) * w).to(torch.bfloat16)

    def sm(x):
        e = torch.exp(x - x.amax(-1, keepdim=True))
        return e / e.sum(-1, keepdim=True)

    for label, fn, shapes, dts in [
        ("generated: rmsnorm graph bf16 [3,100]", rms, [(3, 100), (100,)], [B, F]),
        ("generated: softmax graph f32 [5,70]", sm, [(5, 70)], [F]),
        (
            "generated: gelu(x+b) f32 [4,33]",
            lambda x, b: torch.nn.functional.gelu(x + b),
            [(4, 33), (33,)],
            [F, F],
        ),
    ]:
        gm = make_fx(fn)(*[torch.zeros(s, dtype=t) for s, t in zip(shapes, dts, strict=False)])
        k = kernel_for_subgraph(gm, shapes, dts)
        r = assemble(k)
        print(_row(label, r, k))
    for dtype in (F, B):
        print(f"\n### tiny Llama, {dtype}: every kernel of torch.compile(target='ptx')\n")
        print("| kernel | registers | spill st/ld (bytes) | dyn. smem (bytes) | grid x block |")
        print("| --- | --- | --- | --- | --- |")
        for k in tiny_llama_kernels(dtype):
            print(_row(k.kernel.name, k.report, k.kernel))


def tiny_llama_kernels(dtype: torch.dtype) -> list:
    """The distinct kernels the ptx target builds for the tiny Llama of the tests (needs transformers)."""
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    from ptx_kernels import PtxLaunchError
    from torch_tpu_backend import ptx_target

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128, max_position_embeddings=64)
    model = LlamaForCausalLM(config).eval().to(dtype)
    seen: dict[str, object] = {}
    original = ptx_target.build_kernels

    def capture(gm):
        kernels, uncovered = original(gm)
        if uncovered:
            raise RuntimeError(f"uncovered nodes: {uncovered}")
        for k in kernels:
            seen.setdefault(k.kernel.name, k)
        return kernels, uncovered

    ptx_target.build_kernels = capture
    try:
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="ctpu", options={"target": "ptx", "cache": False})
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            try:
                compiled(torch.randint(0, 128, (1, 8)))
            except PtxLaunchError:
                pass  # no GPU: the kernels were built and checked before the launch
    finally:
        ptx_target.build_kernels = original
    return list(seen.values())


if __name__ == "__main__":
    main()
