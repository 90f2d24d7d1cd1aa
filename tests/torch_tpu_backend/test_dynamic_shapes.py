"""torch.compile(backend="ctpu") with symbolic sizes: one dynamo graph, one padded program per bucket.

CI runs a small attention-like module (linear, softmax over the dynamic dim, a matmul contracting it, a mean
over it) at lengths of one bucket and of two; the tiny Llama at 5, 9, 17, 33 tokens is `slow`."""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable

import pytest
import torch

import torch_tpu_backend.stats as ctpu_stats
from fx_passes import CtpuDynamicShapeError
from torch_tpu_backend.llama_demo import TOLERANCE, tiny_llama


class Mixer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [n, 8]
        h = self.proj(x)
        weights = torch.softmax(h @ h.t(), dim=-1)  # over the dynamic dim
        mixed = weights.t() @ h  # contracts it
        return mixed + h.mean(0, keepdim=True)  # a mean over it


def _run(model: torch.nn.Module, lengths: list[int], make: object, options: dict | None = None,
         dim: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ctpu", options={"cache": False, **(options or {})})
    results = []
    with torch.no_grad():
        for n in lengths:
            x = make(n)  # type: ignore[operator]
            torch._dynamo.mark_dynamic(x, dim)
            results.append((compiled(x), model(x)))
    return results


def test_one_graph_one_program_per_bucket() -> None:
    ctpu_stats.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        results = _run(Mixer(), [5, 9, 16, 17], lambda n: torch.randn(n, 8, generator=torch.Generator().manual_seed(n)))
    for got, ref in results:
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    stats = ctpu_stats.last()
    assert stats.graphs_compiled == 1
    assert stats.program_variants == 2  # 5, 9, 16 share the bucket of 16; 17 is in the bucket of 32
    assert not stats.fallback_ops


def test_a_size_above_the_bound_is_a_clear_error() -> None:
    with pytest.raises(CtpuDynamicShapeError, match=r"= 40 is above its bound 32"):
        _run(Mixer(), [5, 40], lambda n: torch.randn(n, 8), {"dynamic_max": 32})


VIEW_OUTPUTS = {  # an output aliasing an input or another output, with symbolic view arguments
    "select_at_symbolic_index": (lambda x, i: x.select(1, i), (2,)),
    "expand_of_input": (lambda x, i: x[:, :1].expand(x.shape[0], 6), (0,)),
    "diagonal": (lambda x, i: x.diagonal(), (0,)),
    "split": (lambda x, i: x.split(2, 1), (0,)),
    "view_of_an_output": (lambda x, i: (lambda y: (y, y[i:].t()))(x * 2), (2,)),
}


@pytest.mark.parametrize("name", VIEW_OUTPUTS)
def test_views_of_inputs_and_outputs_are_real_views(name: str) -> None:
    """AOT rebuilds an output that aliases an input (or an output) from the backend's result's storage offset
    and strides when the views have symbolic arguments; a fresh program output has neither: x.select(1, i)
    read x[0, :] (the sweep's `select`), an expand read past the input's storage. They are replayed on the host."""
    fn, extra = VIEW_OUTPUTS[name]
    x = torch.randn(5, 6, generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ctpu", dynamic=True, options={"cache": False})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # some of these graphs are refused: the CPU is right too
        torch.testing.assert_close(compiled(x, *extra), fn(x, *extra), rtol=0, atol=0)


def test_attention_over_a_padded_key_dim_is_one_fused_op(tmp_path) -> None:
    """The tiny Llama (1 layer) with a symbolic sequence length: the attention whose keys are padded to the
    bucket fuses into ctpu::attention with kv_len (the keys that are there), eager's logits at 9 and 16
    tokens, and the padded program costs at most 5% more cycles than the static one at the bucket's size
    (with the masks between bmm, softmax and bmm unfused: 6.6%)."""
    import json

    model = tiny_llama(layers=1)
    cycles = {}
    for mode in ("static", "dynamic"):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="ctpu", dynamic=None if mode == "dynamic" else False,
                                 options={"cache": False, "dump_dir": str(tmp_path / mode)})
        for n in (16, 9) if mode == "dynamic" else (16,):
            ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
            if mode == "dynamic":
                torch._dynamo.mark_dynamic(ids, 1)
            ctpu_stats.reset()
            with torch.no_grad():
                torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
            assert not ctpu_stats.last().fallback_ops
            cycles.setdefault(mode, ctpu_stats.last().cycles)
    (summary,) = (tmp_path / "dynamic").glob("*/summary.json")
    assert json.loads(summary.read_text())["fusions"]["attention"] == 1
    assert cycles["dynamic"] <= 1.05 * cycles["static"], cycles


@pytest.mark.parametrize(("dims", "calls", "variants"), [
    ((1,), ((2, 5), (2, 9)), 1),  # bucket 16 of the sequence
    pytest.param((0, 1), ((2, 5), (3, 9), (2, 17)), 2, marks=pytest.mark.slow),  # buckets (16, 16), (16, 32)
], ids=["sequence", "batch_and_sequence"])
def test_a_batch_of_sequences_with_symbolic_sizes(dims: tuple[int, ...], calls: tuple[tuple[int, int], ...],
                                                  variants: int) -> None:
    """The tiny Llama at batch > 1 with a symbolic sequence length (and batch): its linear layers view
    [b, s, h] as [b * s, h], each batch's padding inside the merged dim (fx_passes.dynamic: interleaved
    dims). Before, that view was refused and the whole model ran on the CPU. Eager's logits, one graph,
    one program per bucket, nothing on the CPU."""
    model = tiny_llama(layers=1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ctpu", options={"cache": False})
    ctpu_stats.reset()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")  # no fallback warning
        for b, n in calls:
            ids = torch.randint(0, 128, (b, n), generator=torch.Generator().manual_seed(n))
            for d in dims:
                torch._dynamo.mark_dynamic(ids, d)
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
    stats = ctpu_stats.last()
    assert not stats.fallback_ops
    assert (stats.graphs_compiled, stats.program_variants) == (1, variants)


def test_dynamic_true_on_a_hugging_face_model_runs_on_the_ctpu() -> None:
    """dynamic=True passes the model's float attributes (RMSNorm's eps, RoPE's attention scaling) as float64
    0-d inputs read through casts to float32: narrowed at the launch, they run on the CTPU (9 casts ran on
    the CPU and split the graph into 6 launches)."""
    model = tiny_llama(layers=1)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ctpu", dynamic=True, options={"cache": False})
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        for n in (9, 20):
            ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
            ctpu_stats.reset()
            with torch.no_grad():
                torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=1e-4, atol=1e-5)
            assert ctpu_stats.last().kernels_launched == 1 and not ctpu_stats.last().fallback_ops


def test_float64_arithmetic_stays_on_the_cpu() -> None:
    x, s = torch.randn(8, dtype=torch.float64), torch.tensor(1.0 + 2**-40, dtype=torch.float64)
    torch._dynamo.reset()
    with pytest.warns(UserWarning, match="float64 arithmetic"):
        got = torch.compile(lambda a, b: ((a * b) - a).float() * 2, backend="ctpu", options={"cache": False})(x, s)
    assert torch.equal(got, ((x * s) - x).float() * 2)  # 2^-40 x survives only in float64


@pytest.mark.parametrize("mark", [pytest.param(True, id="mark_dynamic"),  # ~30 s in CI
                                  pytest.param(False, id="automatic", marks=pytest.mark.slow)])
def test_llama_at_lengths_that_are_not_multiples_of_a_tile(mark: bool) -> None:
    """The tiny Llama (2 layers) with a symbolic sequence length at 5, 9, 17, 33 tokens: eager's logits,
    nothing on the CPU, at most 2 dynamo graphs (automatic dynamic shapes: the first call is static), one
    program per bucket (16, 32, 64)."""
    model = tiny_llama()
    ctpu_stats.reset()
    lengths = [5, 9, 17, 33]
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ctpu", options={"cache": False})
    rtol, atol = TOLERANCE[torch.float32]
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, 128, (1, n), generator=torch.Generator().manual_seed(n))
            if mark:
                torch._dynamo.mark_dynamic(ids, 1)
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=rtol, atol=atol)
    stats = ctpu_stats.last()
    print(f"graphs {stats.graphs_compiled}, program variants {stats.program_variants}")
    assert not stats.fallback_ops
    assert stats.graphs_compiled == (1 if mark else 2)
    assert stats.program_variants == 3  # buckets 16, 32, 64 (automatic: 5 is the static first graph)


def test_generate_with_the_default_dynamic_cache() -> None:
    """generate() with the default DynamicCache: greedy tokens equal eager's, nothing on the CPU, and the
    graphs stop growing with the number of tokens (the decode graph with a symbolic past serves them all)."""
    model = tiny_llama(layers=1)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
        expected_more = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=True)
        torch._dynamo.reset()
        ctpu_stats.reset()
        model.forward = torch.compile(model.forward, backend="ctpu", options={"cache": False})
        got = model.generate(ids, max_new_tokens=6, do_sample=False, use_cache=True)
        graphs = ctpu_stats.last().graphs_compiled
        more = model.generate(ids, max_new_tokens=12, do_sample=False, use_cache=True)
    stats = ctpu_stats.last()
    print(f"graphs {stats.graphs_compiled}, program variants {stats.program_variants}")
    assert torch.equal(got, expected)
    assert torch.equal(more, expected_more)
    assert not stats.fallback_ops and not stats.uncompiled_calls
    assert stats.graphs_compiled == graphs <= 3  # prefill, first decode (static), decode with a symbolic past


@pytest.mark.slow
def test_llama_head_dim_64_on_large() -> None:
    """A Llama with head dim 64 (hidden 128, 2 heads, 1 KV head) on `large`, symbolic sequence length at 5
    and 40 tokens (buckets 16 and 64): eager's logits, nothing on the CPU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=1, num_attention_heads=2,
                      num_key_value_heads=1, vocab_size=256, max_position_embeddings=128, use_cache=False)
    model = LlamaForCausalLM(cfg).eval()
    ctpu_stats.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ctpu", options={"cache": False, "config": "large"})
    rtol, atol = TOLERANCE[torch.float32]
    with torch.no_grad():
        for n in (5, 40):
            ids = torch.randint(0, 256, (1, n), generator=torch.Generator().manual_seed(n))
            torch._dynamo.mark_dynamic(ids, 1)
            torch.testing.assert_close(compiled(ids).logits, model(ids).logits, rtol=rtol, atol=atol)
    stats = ctpu_stats.last()
    assert not stats.fallback_ops
    assert (stats.graphs_compiled, stats.program_variants) == (1, 2)


class Mlp(torch.nn.Module):
    """A Llama-3.2-1B-shaped MLP slice in bf16: hidden 2048, intermediate 1024 (a quarter, for the test's time)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.gate, self.up = torch.nn.Linear(2048, 1024, bias=False), torch.nn.Linear(2048, 1024, bias=False)
        self.down = torch.nn.Linear(1024, 2048, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x [1, n, 2048]
        return self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x)) + x


def _cycles_in_one_bucket(fn: Callable[[torch.Tensor], torch.Tensor], inputs: dict[int, torch.Tensor],
                          tol: float) -> dict[int, int]:
    """`fn` compiled for `large` with dim 1 of its input dynamic, called at each length of `inputs`: eager's
    values (NaN where eager's), no fallback warning, one graph and one program variant, nothing on the CPU;
    the cycles of each call."""
    ctpu_stats.reset()
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="ctpu", options={"cache": False, "config": "large"})
    cycles = {}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning
        for n, x in inputs.items():
            torch._dynamo.mark_dynamic(x, 1)
            before = ctpu_stats.last().cycles
            got = compiled(x)
            cycles[n] = ctpu_stats.last().cycles - before
            torch.testing.assert_close(got.float(), fn(x).float(), rtol=tol, atol=tol, equal_nan=True)
    stats = ctpu_stats.last()
    assert stats.graphs_compiled == 1 and stats.program_variants == 1 and not stats.fallback_ops
    return cycles


def _bf16_rows(n: int, width: int) -> torch.Tensor:
    return torch.randn(1, n, width, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)


def test_one_program_computes_only_the_rows_of_each_call() -> None:
    """`large`, bf16, lengths 131 and 250 in one bucket (256): ONE program, whose projections take their row
    count from the argument table (the valid length), so 131 tokens cost fewer cycles than 250 in the same
    program; eager's values at both. Before, every call of the bucket computed all 256 rows."""
    cycles = _cycles_in_one_bucket(Mlp().to(torch.bfloat16), {n: _bf16_rows(n, 2048) for n in (131, 250)}, 2e-2)
    # three projections of 2048 x 1024 (128 weight tiles each) stream 119 rows fewer through the MXU per tile
    assert cycles[250] - cycles[131] >= 3 * 119 * 128 * 3 // 4, cycles


def test_a_runtime_tile_computes_about_the_rows_it_holds() -> None:
    """An activation (silu(x) * tanh(x), [1, n, 8192] bf16, `large`) at 17 and 32 tokens of one bucket (32):
    one tile of 32 rows, whose software-pipelined loop runs a runtime trip count: the chunks of the valid
    rows, rounded up to whole kernel runs (`isel_vector._over_rows`), so 17 tokens cost about 17 rows' work,
    not 32 (measured 4,605 against 7,245 cycles. SwiGLU's factor silu(x) * x was the body until the
    reciprocal unit made its rows so cheap that fixed costs are most of it: 2,693 against 3,653, 24 rows
    3,141, 64 cycles a row. Before: 4,628 against 7,268 with the exp unit; 10,333 against 18,013 before it;
    12,183 against 18,732 when it computed parts of 4 rows while rows were left; 17,525 against 18,005 when
    every tile computed all its rows). inf, -inf, NaN, -0 and a subnormal in the last valid row come out as
    eager's."""
    def factor(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.silu(x) * torch.tanh(x)

    inputs = {n: _bf16_rows(n, 8192) for n in (17, 32)}
    for n, x in inputs.items():
        x[0, n - 1, :5] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40])
    cycles = _cycles_in_one_bucket(factor, inputs, 1e-2)
    assert cycles[17] < 0.7 * cycles[32], cycles


@pytest.mark.parametrize(("hidden", "short", "long", "ratio"), [(2048, 17, 32, 0.8), (256, 129, 256, 0.7)])
def test_a_norm_computes_only_its_valid_rows(hidden: int, short: int, long: int, ratio: float) -> None:
    """Llama's RMS norm in bf16 ([1, n, hidden], `large`: f32 upcast, mean of squares, rsqrt, weight, bf16),
    whose generics run as one chain of small kernels (`isel_vector.lower_chain`), at two lengths of one
    bucket: the chain moves and computes only the valid rows. Hidden 2048 at 17 and 32 tokens: 2,596
    against 3,311 cycles with the rsqrt once a row (`fx_ops._rms_norm`; 2,885 at 17 when the factor's
    generic computed every row), 4,414 against 6,874 with it inline (6,857 at both when it moved and
    computed every row of the bucket). Hidden 256 at
    129 and 256 tokens, the bucket's size: the generics run over two dims of that size, rows and hidden, and
    the rows' is the one at the padded place of the output (`compiler._at_padded_place`): 7,023 against
    12,246 cycles (12,231 at both when such a generic ran whole). inf, -inf, NaN, -0, subnormals and the
    largest bf16 in the last two valid rows (at the hidden dim's end too, which must not be taken for the
    rows) come out as eager's."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(hidden, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = torch.randn(hidden).to(torch.bfloat16)
    inputs = {n: _bf16_rows(n, hidden) for n in (short, long)}
    for n, x in inputs.items():
        x[0, n - 2, :3] = torch.tensor([float("inf"), -0.0, 1e-40])
        x[0, n - 1, -6:] = torch.tensor([float("-inf"), float("nan"), 3.3895e38, -1e-40, 1.0, 2.0])
    cycles = _cycles_in_one_bucket(norm, inputs, 2e-2)
    assert cycles[short] < ratio * cycles[long], cycles


def test_a_chains_members_with_valid_rows_compute_only_those_beside_members_without() -> None:
    """A chain whose members do not all know the valid rows (rope's cos and sin of head dim 64 in a bucket
    of 64: two dims of the bucket's size, so the generic runs whole) beside an RMS norm that does: the
    norm's members compute only the valid rows (33 tokens 9,594 against 14,308 cycles at 64; 14,244 when the
    whole chain computed every row because one member could not bound its own). inf, NaN, the largest bf16
    and a subnormal in the last valid row come out as eager's."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(2048, eps=1e-5).to(torch.bfloat16)
    norm.weight.data = torch.randn(2048).to(torch.bfloat16)

    def fn(x: torch.Tensor) -> torch.Tensor:
        f = torch.arange(x.shape[1], dtype=torch.float32)[:, None] * torch.linspace(0.1, 1.0, 32)
        cos = torch.cat((f, f), -1).cos().to(torch.bfloat16)  # [n, 64]
        return torch.cat((cos[None], norm(x * cos[:, :1])), -1)

    inputs = {n: _bf16_rows(n, 2048) for n in (33, 64)}
    for n, x in inputs.items():
        x[0, n - 1, :4] = torch.tensor([float("-inf"), float("nan"), 3.3895e38, -1e-40])
    cycles = _cycles_in_one_bucket(fn, inputs, 2e-2)
    assert cycles[33] < 0.8 * cycles[64], cycles


def _llama_cycles_on_a_poisoned_arena(monkeypatch, config, lengths: tuple[int, ...],  # type: ignore[no-untyped-def]
                                      macs: dict[int, int] | None = None) -> dict[int, int]:
    """A bf16 Llama of `config` compiled for `large` with the sequence dynamic, called at `lengths` (one
    bucket), with every arena buffer starting as NaN (0xFF bytes), so a padded row that was read would
    show: eager's logits and no NaN at each length, one program, nothing on the CPU; the cycles of each
    (and into `macs`, the MXU's multiply-accumulates of each)."""
    from transformers import LlamaForCausalLM

    from torch_tpu_backend import runtime

    device = runtime.get_device("large")
    alloc = device.allocator.alloc

    def poisoned(nbytes: int) -> int:
        address = alloc(nbytes)
        device.hbm[address:address + nbytes] = 0xFF
        return address

    monkeypatch.setattr(device.allocator, "alloc", poisoned)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ctpu_stats.reset()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="ctpu", options={"cache": False, "config": "large"})
    cycles = {}
    with torch.no_grad():
        for n in lengths:
            ids = torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n))
            torch._dynamo.mark_dynamic(ids, 1)
            before = dataclasses.replace(ctpu_stats.last())
            got = compiled(ids).logits.float()
            cycles[n] = ctpu_stats.last().cycles - before.cycles
            if macs is not None:
                macs[n] = ctpu_stats.last().macs - before.macs
            assert not got.isnan().any()
            torch.testing.assert_close(got, model(ids).logits.float(), rtol=5e-2, atol=5e-2)
    stats = ctpu_stats.last()
    assert stats.program_variants == 1 and not stats.fallback_ops
    return cycles


def test_attention_in_a_bucket_computes_only_its_valid_queries(monkeypatch) -> None:
    """A Llama layer with 8 heads of dim 128 over 2 KV heads (hidden 1024, bf16, `large`) at 390 and 509 tokens
    of one bucket (512): the fused attention's row-wise generics ([KVH, rep, L, keys] scores, their row max
    and sum, the probabilities) run KVH x rep groups of the valid queries only (`compiler._query_dim`,
    `isel_vector._merged_groups`), as do its matmuls (`MatmulKernel.row_segments`): 390 tokens took 639,645
    cycles against 814,245 at 509, 0.786 (651,185 against 818,764 with every row of the matmuls; 717,851
    against 850,246, 0.844, with `_query_dim` disabled too: every query of the bucket; their keys still do).
    The arena is poisoned, so a padded query row that was read would show."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=1024, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=128, num_hidden_layers=1, vocab_size=512, max_position_embeddings=512)
    cycles = _llama_cycles_on_a_poisoned_arena(monkeypatch, config, (509, 390))
    assert cycles[390] < 0.82 * cycles[509], cycles


def test_a_llama_whose_hidden_size_is_the_buckets_computes_only_its_valid_rows(monkeypatch) -> None:
    """The `mini` geometry's layer (hidden 256, 4 heads of dim 64 over one KV head, bf16, `large`) at 129 and
    250 tokens of one bucket (256), the bucket's size equal to the hidden size: its norms, rope and residual
    generics run the rows' dim bounded, never the hidden one, so on the poisoned arena eager's logits and no
    NaN at both, and 129 tokens cost well under 250's (measured 104,955 against 159,862 cycles; 120,949
    against 160,031 when a generic with both dims ran whole)."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=256, intermediate_size=1024, num_attention_heads=4, num_key_value_heads=1,
                         head_dim=64, num_hidden_layers=1, vocab_size=256, max_position_embeddings=256)
    cycles = _llama_cycles_on_a_poisoned_arena(monkeypatch, config, (250, 129))
    assert cycles[129] < 0.7 * cycles[250], cycles


def test_attention_matmuls_in_a_bucket_multiply_only_each_query_heads_valid_rows(monkeypatch) -> None:
    """GQA attention (8 heads of dim 64 over 2 KV heads, hidden 512, bf16, `large`) at 129 and 200 tokens of
    one bucket (256): q @ K^T and P @ V run a KV head's [rep, L] query rows, the valid queries of each head a
    segment of them (`MatmulKernel.row_segments`), so with every other matmul bounded to its valid rows the
    bucket's program multiplies exactly as much as the static program of the real length (the MXU works in
    whole tiles: 129 keys take two n-tiles as 256 do). Computing every row of the bucket multiplied 25% more
    at 129 tokens, 7% more at 200 (448,790,528 MACs against 419,430,400); on the poisoned arena a padded row
    that was read would show."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=512, intermediate_size=512, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=64, num_hidden_layers=1, vocab_size=256, max_position_embeddings=256)
    macs: dict[int, int] = {}
    _llama_cycles_on_a_poisoned_arena(monkeypatch, config, (200, 129), macs)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    torch._dynamo.reset()
    static = torch.compile(model, backend="ctpu", dynamic=False, options={"cache": False, "config": "large"})
    with torch.no_grad():
        for n in macs:
            ctpu_stats.reset()
            static(torch.randint(0, config.vocab_size, (1, n), generator=torch.Generator().manual_seed(n)))
            assert macs[n] == ctpu_stats.last().macs, (n, macs[n], ctpu_stats.last().macs)


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_segmented_attention_matmuls_keep_eagers_edge_values(kv_heads: int) -> None:
    """Causal GQA attention (4 heads of dim 64 a KV head, 2 KV heads or one, bf16, `large`) with the sequence
    dynamic, at 200 and 129 tokens of one bucket (256), with inf, -inf, NaN, -0, subnormals and the largest
    bf16 in q, K and V: eager's NaN pattern (a NaN or inf score spreads along its rows), its values elsewhere
    within bf16, nothing on the CPU, and the static program's MACs (each query head's valid rows only; one
    KV head's matmuls are one resident batch for that: they multiplied every row of the bucket)."""
    import torch.nn.functional as F

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def inputs(n: int) -> tuple[torch.Tensor, ...]:
        g = torch.Generator().manual_seed(n)
        q, k, v = (torch.randn(1, heads, n, 64, generator=g).to(torch.bfloat16)
                   for heads in (4 * kv_heads, kv_heads, kv_heads))
        q[0, 1, 3, 5], k[0, 0, 7, 2], v[0, -1, 10, 0] = float("inf"), float("nan"), float("-inf")
        q[0, 2, 4, :4] = torch.tensor([-0.0, 1e-40, 3.3e38, -3.3e38])
        v[0, 0, 20, 1:3] = torch.tensor([1e-40, -0.0])
        return q, k, v

    macs: dict[str, dict[int, int]] = {"dynamic": {}, "static": {}}
    for mode, per_length in macs.items():
        torch._dynamo.reset()
        compiled = torch.compile(attention, backend="ctpu", dynamic=False if mode == "static" else None,
                                 options={"config": "large", "cache": False})
        for n in (200, 129):
            q, k, v = inputs(n)
            if mode == "dynamic":
                for t in (q, k, v):
                    torch._dynamo.mark_dynamic(t, 2)
            ctpu_stats.reset()
            got = compiled(q, k, v).float()
            stats = ctpu_stats.last()
            assert not stats.fallback_ops
            per_length[n] = stats.macs
            want = attention(q.float(), k.float(), v.float()).to(torch.bfloat16).float()
            assert torch.equal(got.isnan(), want.isnan()) and got.isnan().any()
            torch.testing.assert_close(got.nan_to_num(), want.nan_to_num(), rtol=2e-2, atol=2e-2)
    assert macs["dynamic"] == macs["static"], macs


def test_a_llama_bucket_never_reads_the_padding_it_leaves_unwritten(monkeypatch) -> None:
    """A layer of the 1B's proportions at hidden 256 (`ctpu bench --llama mini`, bf16, `large`) at 100 and 77
    tokens, one bucket: the projections, norms, SwiGLU factors, rope and attention's result compute only the
    valid rows (the rest of the bucket is never written), so every buffer of the launch's arena starts as NaN
    (0xFF bytes) here: eager's logits, no NaN, and fewer cycles for fewer tokens in the same program."""
    from transformers import LlamaConfig

    from torch_tpu_backend.llama_bench import GEOMETRIES

    config = LlamaConfig(**GEOMETRIES["mini"] | {"num_hidden_layers": 1}, max_position_embeddings=256)
    cycles = _llama_cycles_on_a_poisoned_arena(monkeypatch, config, (100, 77))
    assert cycles[77] < cycles[100], cycles
