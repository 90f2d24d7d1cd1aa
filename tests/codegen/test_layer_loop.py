"""Layer loops (codegen/layer_loop.py): a run of kernel sequences equal but for their buffers compiles to
ONE body that runs once per repetition over a per-repetition address table, so program size does not grow
with depth. Parity with eager is the point; the kernel-graph tests pin the search and its slots."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from codegen_helpers import capture, run_with_poisoned_vmem

import fx_passes
from codegen import compile_graph
from codegen.compiler import _same_buffer
from codegen.kernel_graph import (
    Access,
    Buffer,
    FillKernel,
    GenericKernel,
    IotaKernel,
    KernelGraph,
    ScalarProgram,
    View,
)
from codegen.layer_loop import Loop, find_loops, hoist_invariant_kernels, sink_fills
from device_sim.executable import Executable, run_fresh
from device_sim.runners import SimulatorRunner


def _compile(fn, *inputs: torch.Tensor, config: str = "small", **options) -> tuple[Executable, list[np.ndarray]]:
    gm, args = capture(fn, *inputs)
    gm, _ = fx_passes.run_passes(gm, args)
    exe = compile_graph(fx_passes.inline_fused_kernels(gm), args, config, **options)
    return exe, [(a.float() if a.is_floating_point() else a).detach().numpy() for a in args]


def _llama(layers: int, dtype: torch.dtype = torch.float32, hidden: int = 64, heads: int = 4, kv_heads: int = 2,
           vocab: int = 128, positions: int = 64) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                      max_position_embeddings=positions, use_cache=False)
    return LlamaForCausalLM(cfg).eval().to(dtype)


def _llama_logits(layers: int, **kw) -> tuple[Executable, np.ndarray, np.ndarray, list[np.ndarray]]:
    model = _llama(layers)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    exe, args = _compile(lambda ids: model(ids).logits, ids, matmul_precision="highest", **kw)
    outs, _ = run_fresh(exe, args, SimulatorRunner(exe.config))
    with torch.no_grad():
        ref = model(ids).logits.numpy()
    return exe, outs[0], ref, args


def test_llama_program_size_does_not_grow_with_depth() -> None:
    """8 identical layers compile to the size of 3, logits equal eager's. Every layer is in the loop: the
    kernels that read nothing the layers compute (the causal mask's iotas, which MLIR's CSE leaves to layer 0)
    run before it (`hoist_invariant_kernels`); before, the loop ran 7 times and layer 0's first half and
    layer 7's second half were code of their own. 2 layers are not looped where they fit imem unrolled
    (the loop's headers and lost prefetch cost more than one layer's code)."""
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    model = _llama(2)
    unrolled = _compile(lambda ids: model(ids).logits, ids, matmul_precision="highest")[0]
    two, out2, ref2, _ = _llama_logits(3)
    eight, out8, ref8, _ = _llama_logits(8)
    assert not unrolled.summary["loops"] and len(unrolled.program) > 1.5 * len(two.program)
    np.testing.assert_allclose(out2, ref2, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(out8, ref8, rtol=1e-4, atol=1e-4)
    (loop,) = eight.summary["loops"]
    assert loop["runs"] == 8
    assert abs(len(eight.program) - len(two.program)) <= 0.05 * len(two.program)
    kernels = eight.summary["kernels"]
    first, last = loop["kernels"]
    body = last - first + 1
    assert all(k["runs"] == 8 and (k["bundles"] > 0) != ("chained_into" in k) for k in kernels[first:last + 1])
    assert all(k["bundles"] == 0 and k["same_code_as"] == first + (k["index"] - first) % body
               for k in kernels[last + 1:first + 8 * body])


@pytest.mark.slow  # CI time (77 s); in CI looped programs match eager: test_large_bf16_llama_layers_loop, generate
def test_llama_loop_is_the_unrolled_program() -> None:
    """The same 4-layer graph with and without the loop: the same bits (the loop runs the same kernels over
    the same addresses), also on vmem poisoned at every kernel start (the window and cursor survive)."""
    looped, out, _, args = _llama_logits(4)
    unrolled, out_unrolled, _, _ = _llama_logits(4, layer_loops=False)
    assert looped.summary["loops"] and not unrolled.summary["loops"]
    np.testing.assert_array_equal(out, out_unrolled)
    (poisoned,) = run_with_poisoned_vmem(looped, args)
    np.testing.assert_array_equal(poisoned, out)


class _Block(torch.nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.linear, self.norm = torch.nn.Linear(n_in, n_out), torch.nn.LayerNorm(n_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(torch.relu(self.linear(x)))


def block_stack(widths: list[int]) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*(_Block(a, b) for a, b in itertools.pairwise(widths))).eval()


def test_stack_of_equal_blocks_loops() -> None:
    """Not a Llama: 6 x (Linear + ReLU + LayerNorm) of equal size loop too, and match eager."""
    model = block_stack([32] * 7)
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    exe, args = _compile(model, x, matmul_precision="highest")
    (out,), _ = run_fresh(exe, args, SimulatorRunner(exe.config))
    with torch.no_grad():
        np.testing.assert_allclose(out, model(x).numpy(), rtol=1e-4, atol=1e-4)
    (loop,) = exe.summary["loops"]
    assert loop["runs"] >= 5
    assert "run" in exe.stages["kernels.txt"].splitlines()[-1]
    # the body's last kernels are one chain (bias + ReLU, LayerNorm): the loop's footer still follows them
    # (it once did not, and the loop ran once: a silent wrong answer)
    assert exe.summary["kernels"][loop["kernels"][1]].get("chained_into") is not None


def test_blocks_of_different_shapes_do_not_loop() -> None:
    """Blocks whose widths all differ are no repetition: no loop, still eager's numbers."""
    model = block_stack([32, 40, 48, 24, 16, 8])
    x = torch.randn(16, 32, generator=torch.Generator().manual_seed(3))
    exe, args = _compile(model, x, matmul_precision="highest")
    (out,), _ = run_fresh(exe, args, SimulatorRunner(exe.config))
    with torch.no_grad():
        np.testing.assert_allclose(out, model(x).numpy(), rtol=1e-4, atol=1e-4)
    assert exe.summary["loops"] == [] and exe.address_table == []


def test_generate_static_cache_with_layer_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """generate() with a static KV cache (per-layer cache inputs scattered into in place): prefill and
    decode both loop over the 4 layers, the tokens are eager's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import codegen

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=64, use_cache=True)
    model = LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    exes: list[Executable] = []
    compile_graph_ = codegen.compile_graph

    def recording(*args, **kwargs) -> Executable:  # type: ignore[no-untyped-def]
        exes.append(compile_graph_(*args, **kwargs))
        return exes[-1]

    monkeypatch.setattr(codegen, "compile_graph", recording)

    def generate() -> torch.Tensor:
        return model.generate(ids, max_new_tokens=4, do_sample=False, cache_implementation="static", use_cache=True)

    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        with torch.no_grad():
            expected = generate()
            torch._dynamo.reset()
            model.forward = torch.compile(model.forward, backend="ctpu", options={"cache": False})
            out = generate()
    finally:
        torch.set_float32_matmul_precision(previous)
    assert out.tolist() == expected.tolist()
    assert len(exes) == 2 and all(exe.summary["loops"] for exe in exes)
    assert all(exe.mutated_inputs for exe in exes)  # the caches are written in place, inside the loop


def test_large_bf16_llama_layers_loop() -> None:
    """A realistic shape on `large`: 4 bf16 layers of hidden 1024, head dim 64, 16 heads over 8 kv heads.
    All four layers run in the loop: the program is the 1-layer program's size (+ the loop's code)."""
    ids = torch.randint(0, 256, (1, 5), generator=torch.Generator().manual_seed(2))
    sizes = {}
    for layers in (1, 4):
        model = _llama(layers, torch.bfloat16, hidden=1024, heads=16, kv_heads=8, vocab=256)
        exe, args = _compile(lambda ids, model=model: model(ids).logits, ids, config="large")
        (out,), _ = run_fresh(exe, args, SimulatorRunner(exe.config))
        with torch.no_grad():
            ref = model(ids).logits.float().numpy()
        np.testing.assert_allclose(out, ref, rtol=3e-2, atol=3e-2)
        sizes[layers] = len(exe.program)
        if layers == 4:
            (loop,) = exe.summary["loops"]
            assert loop["runs"] == 4
            body = sum(k["bundles"] for k in exe.summary["kernels"][loop["kernels"][0]:loop["kernels"][1] + 1])
    assert sizes[4] <= 1.05 * sizes[1] and body > 0.5 * sizes[1], (sizes, body)


def test_a_prefills_causal_masks_per_key_tile_are_not_a_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 12's silent wrong answer (the 1B geometry's 2048-token prefill, 8 key tiles of 256): the layers
    share one causal mask per key tile, `j <= i - 256 t`, kernels that differ only by their integer offset,
    which travels as the NaN bit pattern of its i32 lanes. Keyed on their float value, the 7 masks after the
    first looked equal and ran as a loop of the second tile's mask. Here the same structure at 127 tokens in
    8 tiles of 16 keys (bf16, head dim 64, `large`): the masks stay apart and the logits are eager's."""
    import codegen.attention

    monkeypatch.setattr(codegen.attention, "key_tile", lambda cfg, rows, keys: min(keys, 16))
    model = _llama(2, torch.bfloat16, hidden=256, heads=4, kv_heads=2, vocab=256, positions=128)
    ids = torch.randint(0, 256, (1, 127), generator=torch.Generator().manual_seed(1))
    exe, args = _compile(lambda ids: model(ids).logits, ids, config="large")
    masks = [line for line in exe.stages["kernels.txt"].splitlines() if "arith.cmpi.sle" in line]
    assert len(masks) == 8 and exe.summary["loops"] == [], exe.summary["loops"]
    (out,), _ = run_fresh(exe, args, SimulatorRunner(exe.config))
    with torch.no_grad():
        ref = model(ids).logits.float().numpy()
    np.testing.assert_allclose(out, ref, rtol=3e-2, atol=3e-2)


# ---- the search, on kernel graphs --------------------------------------------------------------------
def _view(name: str, shape: tuple[int, ...] = (8, 8)) -> View:
    return View(name, 0, shape, (shape[1], 1), "f32")


def _add(a: str, b: str, out: str, const: float = 1.0, op: str = "arith.addf") -> GenericKernel:
    body = ScalarProgram(["%a", "%b", "%o"], [("%0", op, ["%a", "%b"]), ("%1", "arith.mulf", ["%0", "%c"])],
                         ["%1"], {"%c": const})
    return GenericKernel((8, 8), False, [Access(_view(a), (8, 1)), Access(_view(b), (8, 1))],
                         Access(_view(out), (8, 1)), body)


def _graph(kernels: list) -> KernelGraph:
    g = KernelGraph(kernels=kernels)
    for k in kernels:
        for v in [*(o.view for o in getattr(k, "inputs", [])), getattr(k, "output", None)]:
            v = v.view if isinstance(v, Access) else v
            g.buffers.setdefault(v.buffer, Buffer(v.buffer, (8, 8), "f32", "temp"))
    return g


def _layers(n: int, const: float = 1.0) -> list:
    """n layers of 3 different kernels over x_i, w_i, t_i, u_i and one shared buffer (the last one's
    constant is `const`)."""
    out = []
    for i in range(n):
        c = const if i == n - 1 else 1.0
        out += [_add(f"x{i}", f"w{i}", f"t{i}"), _add(f"t{i}", "shared", f"u{i}", op="arith.subf"),
                _add(f"u{i}", f"t{i}", f"x{i + 1}", c, op="arith.maximumf")]
    return out


def test_find_loops_slots() -> None:
    (loop,) = find_loops(_graph(_layers(4)), min_saved=1)
    assert (loop.first, loop.period, loop.repeats) == (0, 3, 4)
    # per repetition: x, w, t, shared, u, x' (the shared buffer has one slot with the same name in every row)
    assert loop.slots[2] == ("x2", "w2", "t2", "shared", "u2", "x3")


def test_find_loops_refuses_a_different_constant() -> None:
    """The last layer scales by 2.0: it is not a repetition (3 repetitions remain)."""
    (loop,) = find_loops(_graph(_layers(4, const=2.0)), min_saved=1)
    assert (loop.first, loop.repeats) == (0, 3)
    assert find_loops(_graph(_layers(4, const=float("nan"))), min_saved=1)[0].repeats == 3


def test_find_loops_tells_integer_constants_apart() -> None:
    """An integer constant is the float of its 32-bit lane pattern: -16 and -32 are two different NaNs."""
    def layers(offsets: list[int]) -> list:
        out = []
        for i, offset in enumerate(offsets):
            lanes = float(np.array(offset & 0xFFFFFFFF, dtype=np.uint32).view(np.float32))
            out += _layers(i + 1, const=lanes)[-3:]  # layer i of i + 1, constant `lanes`
        return out

    assert find_loops(_graph(layers([-16] * 4)), min_saved=1)[0].repeats == 4
    assert find_loops(_graph(layers([-16, -32, -48, -64])), min_saved=1) == []


def test_find_loops_splits_a_slot_a_repetition_reuses() -> None:
    """Bufferization reused one buffer for two roles in the last layer: the roles keep two slots, which
    that layer's row fills with the same address."""
    kernels = _layers(3)
    kernels[-1] = _add("u2", "t2", "w2", op="arith.maximumf")  # layer 2 writes its result over its weight buffer
    (loop,) = find_loops(_graph(kernels), min_saved=1)
    assert loop.repeats == 3
    assert loop.slots[2][1] == loop.slots[2][-1] == "w2" and loop.slots[0][1] != loop.slots[0][-1]


def test_two_slots_are_one_buffer_where_a_run_names_it_twice() -> None:
    """A kernel loads a row for the chain after it only where it does not write that row's buffer
    (`compiler._preloads`); in a loop's body a written slot and a read slot are one buffer if any
    repetition's row names the same buffer for both (bufferization reused it)."""
    loop = Loop(0, 2, 3, (("a", "b", "c"), ("d", "e", "f"), ("g", "h", "h")))
    assert _same_buffer("@slot1", "@slot2", loop) and not _same_buffer("@slot0", "@slot1", loop)
    assert _same_buffer("x", "x", None) and not _same_buffer("x", "y", None)


def test_sink_fills_moves_a_fill_to_its_first_user() -> None:
    fill = FillKernel(_view("acc"), 0.0)
    other = FillKernel(_view("acc"), 1.0)
    k1, k2 = _add("a", "b", "c"), _add("acc", "c", "d")
    assert sink_fills([fill, k1, k2]) == [k1, fill, k2]
    assert sink_fills([fill, k1, other, k2]) == [k1, fill, other, k2]  # fills of one buffer keep their order


def test_kernels_that_read_nothing_computed_run_before_the_layers() -> None:
    """MLIR's CSE leaves a value every layer reads (a causal mask made from iotas) to layer 0, whose kernels
    then differ from the others': hoisted to the front (an iota, then a generic reading it and a graph input
    no kernel writes), every layer is one loop. A generic reading an input some kernel writes, or a buffer a
    fill also writes (a reduction's initial value), stays where it is."""
    iota = IotaKernel(_view("pos"))
    mask = _add("pos", "lengths", "shared", 3.0, op="arith.mulf")
    layers = _layers(3)
    kernels = [*layers[:1], iota, mask, *layers[1:]]
    g = _graph(kernels)
    g.buffers["lengths"] = Buffer("lengths", (8, 8), "f32", "input")
    assert find_loops(g, min_saved=1)[0].repeats < 3
    g.kernels = hoist_invariant_kernels(g.kernels, g)
    assert g.kernels[:2] == [iota, mask] and g.kernels[2:] == layers
    (loop,) = find_loops(g, min_saved=1)
    assert (loop.first, loop.period, loop.repeats) == (2, 3, 3)
    written = [*layers[:1], _add("lengths", "x0", "z"), mask, *layers[1:]]  # "lengths" is written: not invariant
    g = _graph(written)
    g.buffers["lengths"] = Buffer("lengths", (8, 8), "f32", "input")
    assert hoist_invariant_kernels(g.kernels, g) == written
    filled = [*layers[:1], FillKernel(_view("acc"), 0.0), _add("lengths", "lengths", "acc"), *layers[1:]]
    g = _graph(filled)
    g.buffers["lengths"] = Buffer("lengths", (8, 8), "f32", "input")
    assert hoist_invariant_kernels(g.kernels, g) == filled


def test_find_loops_picks_the_cheapest_rotation() -> None:
    """13 kernels of a 3-kernel layer: 4 repetitions start at kernel 0 or 1. The earliest, unless the edge
    cost says otherwise."""
    kernels = _layers(5)[1:14]
    assert find_loops(_graph(kernels), min_saved=1)[0].first == 0
    (loop,) = find_loops(_graph(kernels), min_saved=1, edge_cost=lambda first, period: first != 1)
    assert (loop.first, loop.period, loop.repeats) == (1, 3, 4)
    assert loop.slots[0][:3] == ("u0", "t0", "x1") and loop.slots[3][:3] == ("u3", "t3", "x4")


def test_a_one_token_forwards_loop_loads_its_addresses_ahead(monkeypatch: pytest.MonkeyPatch) -> None:
    """A one-token forward of 4 bf16 layers of hidden 1024 on `large` (every projection a weight stream): the
    same bits as unrolled. Each repetition loads the next one's addresses while it runs; the header waited
    a DMA latency for them, and the footer waited for the stores in flight. Measured 6,722 cycles more than
    unrolled over the 4 runs (119,542 vs 112,820), 8,718 before; what is left is the prefetch no edge crosses
    (here no body can start after a stream: the layers repeat from the first norm to the last residual add).
    So by default the compiler unrolls this loop, 4 repetitions being too few for two layers a repetition
    (`compiler._crossing_the_loops_edge`): the program with no loop, as fast as unrolled."""
    from codegen import compiler

    model = _llama(4, torch.bfloat16, hidden=1024, heads=16, kv_heads=8, vocab=256)
    ids = torch.tensor([[7]])
    unrolled, args = _compile(lambda ids: model(ids).logits, ids, config="large", layer_loops=False)
    (out_unrolled,), stats_unrolled = run_fresh(unrolled, args, SimulatorRunner(unrolled.config))
    chosen, _ = _compile(lambda ids: model(ids).logits, ids, config="large")
    assert not chosen.summary["loops"]
    (out,), stats = run_fresh(chosen, args, SimulatorRunner(chosen.config))
    np.testing.assert_array_equal(out, out_unrolled)
    assert stats.cycles == stats_unrolled.cycles
    monkeypatch.setattr(compiler, "_crossing_the_loops_edge", lambda *args: None)
    looped, _ = _compile(lambda ids: model(ids).logits, ids, config="large")
    (out,), stats = run_fresh(looped, args, SimulatorRunner(looped.config))
    np.testing.assert_array_equal(out, out_unrolled)
    (loop,) = looped.summary["loops"]
    assert loop["runs"] == 4
    assert stats.cycles - stats_unrolled.cycles <= 1800 * loop["runs"], (stats.cycles, stats_unrolled.cycles)


class _WideBlock(torch.nn.Module):
    """18 Linear + ReLU of 18 different widths in a row: a block whose loop body names more buffers than a
    vmem row group holds."""

    def __init__(self) -> None:
        super().__init__()
        widths = [16 + 8 * i for i in range(18)] + [16]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in itertools.pairwise(widths))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def test_a_body_with_more_slots_than_a_row_group() -> None:
    """On `small` (8 lanes) a row group of the window holds 64 slot addresses; these blocks name more, so the
    footer moves the next window into the window in several groups. Eager's numbers, also on vmem poisoned
    at every kernel start (the window, the next window and the cursor survive)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(_WideBlock() for _ in range(3))).eval()
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(3))
    exe, args = _compile(model, x, matmul_precision="highest")
    (loop,) = exe.summary["loops"]
    assert loop["runs"] == 3 and loop["slots"] > 64, loop
    (out,), _ = run_fresh(exe, args, SimulatorRunner(exe.config))
    with torch.no_grad():
        np.testing.assert_allclose(out, model(x).numpy(), rtol=1e-4, atol=1e-4)
    (poisoned,) = run_with_poisoned_vmem(exe, args)
    np.testing.assert_array_equal(poisoned, out)
