"""Elementwise instruction selection (codegen/isel_vector.py): how the iteration space becomes rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codegen_helpers import run_with_poisoned_vmem, trace

from codegen import compile_graph
from codegen.isel_vector import max_tile_vmem_rows
from device_sim.config import get_config
from device_sim.executable import run_fresh
from device_sim.runners import SimulatorRunner


def test_size_one_dims_do_not_split_rows() -> None:
    """A decode step's q [1, 1, H, D] -> [1, H, 1, D] in bf16 (issue 13): the size-1 dims' strides stopped H
    from merging into rows, so each head was a group of one row with its own load, wait and store: 32 DMA
    latencies (16,983 cycles on `large`) for 8 KiB. As H rows it is one tile, a few latencies."""
    x = torch.randn(1, 1, 32, 64)
    x[0, 0, 3, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40, 3.4e38])

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.permute(0, 2, 1, 3).to(torch.bfloat16)

    exe = compile_graph(trace(f, x), [x], "large")
    (out,), stats = run_fresh(exe, [x.numpy()], SimulatorRunner("large"))
    ref = f(x).float().numpy()
    assert stats.cycles < 4 * get_config("large").dma_latency, stats.cycles
    (poisoned,) = run_with_poisoned_vmem(exe, [x.numpy()])
    nan = np.isnan(ref)
    for got in (out, poisoned):  # the same bits (-0 and subnormals too); NaN is the canonical one
        assert np.isnan(got[nan]).all()
        np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))


def _same_bits(got: np.ndarray, ref: np.ndarray) -> None:
    nan = np.isnan(ref)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))


def test_a_transpose_merges_rows_in_its_input_order_and_pipelines_the_groups() -> None:
    """Attention's output [1, H, L, D] -> [L, H * D] before o_proj (a prefill of 256 tokens, bf16, `large`):
    in the output's order the heads merged into rows and the L positions were groups, one DMA latency each
    (144,121 cycles: 11% of a 1b-2l prefill, twice). In the input's order the positions are the rows (H
    groups), and whole groups share a tile, so the groups' loads overlap: 5,868 cycles for 2 MiB moved."""
    L = 256
    x = torch.randn(1, 32, L, 64).to(torch.bfloat16)
    x[0, 5, 7, :6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-39, 3.3e38])

    def f(x: torch.Tensor) -> torch.Tensor:
        return x.transpose(1, 2).reshape(1, L, 2048) * 2

    exe = compile_graph(trace(f, x), [x], "large")
    (out,), stats = run_fresh(exe, [x.float().numpy()], SimulatorRunner("large"))
    hbm_cycles = 2 * x.numel() * 2 / get_config("large").hbm_bytes_per_cycle
    assert stats.cycles < hbm_cycles + 8 * get_config("large").dma_latency, stats.cycles
    _same_bits(out, f(x).float().numpy())


def test_groups_share_tiles_with_a_partial_last_tile_wide_rows_and_a_column_operand() -> None:
    """Groups as tiles on `small` (8 lanes, 512-row tiles): 7 groups of 40 rows of 20 elements (3 vmem rows
    a row), times a per-row column; 4 groups a tile, so the second tile is partial. Every element's bits
    equal eager's, NaN in the vmem the kernel does not write changes nothing."""
    x = torch.randn(40, 7, 20)
    y = torch.randn(7, 40, 1)
    x[3, 2, :5] = torch.tensor([float("inf"), float("nan"), -0.0, 1e-40, -3.4e38])
    y[6, 39, 0] = float("-inf")

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return x.transpose(0, 1) * y

    exe = compile_graph(trace(f, x, y), [x, y], "small")
    (out,), _ = run_fresh(exe, [x.numpy(), y.numpy()], SimulatorRunner("small"))
    ref = f(x, y).numpy()
    _same_bits(out, ref)
    (poisoned,) = run_with_poisoned_vmem(exe, [x.numpy(), y.numpy()])
    _same_bits(poisoned, ref)


def test_a_prefill_reads_v_in_its_own_layout_not_transposed(monkeypatch) -> None:
    """P @ V's V ([S, Hkv, D] from v_proj, f32) was computed into its bf16 factor in the contraction's
    [D, S] order: a transposed read, one DMA pair per column (67,702 cycles a layer at a 256-token 1b-2l
    prefill). The factor now follows V's layout (the matmul takes B either way). The rope'd K^T factors
    are still transposed copies (their output is [D, S]): 4 of them in the mini geometry's prefill; the
    count may only go down, and the logits stay eager's."""
    import warnings

    from transformers import LlamaConfig, LlamaForCausalLM

    import codegen.isel_vector as isel_vector
    from torch_tpu_backend.llama_bench import GEOMETRIES

    transposed: list[tuple] = []
    materialize = isel_vector._materialize

    def counting(ctx, view, st, sizes):  # type: ignore[no-untyped-def]
        transposed.append((view.shape, view.dtype))
        return materialize(ctx, view, st, sizes)

    monkeypatch.setattr(isel_vector, "_materialize", counting)
    torch.manual_seed(0)
    cfg = LlamaConfig(**{**GEOMETRIES["mini"], "num_hidden_layers": 1}, max_position_embeddings=33)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = model(ids, use_cache=False).logits.float()
        torch._dynamo.reset()
        got = torch.compile(model.forward, backend="ctpu", options={"config": "large", "cache": False})(
            ids, use_cache=False).logits.float()
    assert not [t for t in transposed if t[1] == "f32"], transposed  # V is the f32 one
    assert len(transposed) <= 4, transposed
    assert (got - ref).abs().max() <= 0.02 * ref.abs().max()


@pytest.mark.parametrize("perm, shape, op", [
    ((1, 0, 2), (9, 37, 20), "sum"),  # groups of 9 rows, a partial last tile; rows 3 vmem rows wide
    ((2, 0, 1), (5, 6, 70), "amax"),  # the reduced dim strided: copied into row order first
    ((1, 0, 2), (6, 40, 11), "map"),  # in the input's order: 6 groups of 40 rows, all in one tile
    ((0, 2, 1), (40, 6, 11), "map"),  # the row dim strided: copied into row order first
])
def test_reordered_rows_and_group_tiles_give_eager_bits(perm: tuple[int, ...], shape: tuple[int, ...],
                                                        op: str) -> None:
    """Permuted views through maps and last-dim reductions (with a reduction's initial value, NaN, inf and
    -0 among the data), compiled on `small`: the reordered rows and the groups run as tiles give eager's
    bits, on a zeroed and on a NaN-poisoned vmem."""
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=g)
    x.view(-1)[:5] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 1e-40])
    y = torch.randn((*x.permute(perm).shape[:-1], 1), generator=g)

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        v = x.permute(perm)
        if op == "sum":
            return v.sum(-1) + y[..., 0]
        if op == "amax":
            return v.amax(-1) * y[..., 0]
        return v * y + 1

    exe = compile_graph(trace(f, x, y), [x, y], "small")
    (out,), _ = run_fresh(exe, [x.numpy(), y.numpy()], SimulatorRunner("small"))
    ref = f(x, y).numpy()
    if op == "sum":  # a sum's order of additions differs from eager's: values, not bits
        np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5, equal_nan=True)
        return
    _same_bits(out, ref)
    (poisoned,) = run_with_poisoned_vmem(exe, [x.numpy(), y.numpy()])
    _same_bits(poisoned, ref)


# ---- runtime row counts: a dynamic-shape bucket's padded rows (issue 14) -----------------------------------
def _rms_norm(x: torch.Tensor, w: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * w


def _swiglu(x: torch.Tensor, w: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.silu(x) * w


def _head_rows(x: torch.Tensor, w: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    return x * w  # [H, L, D]: H groups outside the padded L


RUNTIME_ROWS = [  # (config, function, x's shape, w's shape, dtype, valid length)
    ("large", _rms_norm, (1, 517, 2048), (2048,), torch.float32, 300),  # 5 tiles of 128 rows -> 3 (an odd one)
    ("large", _rms_norm, (1, 517, 2048), (2048,), torch.float32, 131),  # -> 2, the second partial
    ("large", _rms_norm, (1, 517, 2048), (2048,), torch.float32, 517),  # every row
    ("large", _swiglu, (1, 600, 1024), (1, 600, 1024), torch.bfloat16, 257),
    ("small", _rms_norm, (40, 20), (20,), torch.float32, 17),
    ("large", _swiglu, (1, 33, 64), (1, 33, 64), torch.float32, 0),  # a count of 0 computes one row
    ("large", _head_rows, (4, 50, 64), (64,), torch.float32, 20),  # 4 short groups share one tile: each bounded
    ("large", _head_rows, (4, 600, 64), (64,), torch.float32, 300),  # 4 groups of a tile each: left whole
    ("large", _head_rows, (32, 50, 64), (64,), torch.float32, 20),  # 32 groups share tiles: each bounded
]


@pytest.mark.parametrize(("config", "fn", "shape", "w_shape", "dtype", "valid"), RUNTIME_ROWS,
                         ids=lambda v: getattr(v, "__name__", str(v).replace("torch.", "")))
def test_runtime_rows_of_a_generic_give_the_static_bits_and_leave_the_padding(config, fn, shape, w_shape, dtype,
                                                                            valid) -> None:
    """Generics whose FX node carries fx_passes' padding mark at the rows (PADDING_META) run their tiles while
    rows of the runtime count are left: the valid rows have the bits of the program compiled without the
    mark (edge values among them; also on a vmem poisoned with NaN at each kernel's start), the output's
    padding rows are never stored (zeros of the fresh arena), and fewer rows cost fewer cycles. Where the
    padded dim is inside the rows ([H, L, D]), the dims outside it are groups, each running its valid rows,
    when they are enough to share tiles in a loop (attention's KVH x rep) or few enough to share one tile
    (a small model's one KV head x rep); a few groups of a tile each, each of which would wait a DMA
    latency, leave the generic whole."""
    g = torch.Generator().manual_seed(shape[-2])
    x = torch.randn(*shape, generator=g).to(dtype)
    w = torch.randn(*w_shape, generator=g).to(dtype)
    x[..., 0, :5] = torch.tensor([float("inf"), -0.0, 1e-39, float("nan"), 3e38])
    rows = max(valid, 1)
    x[..., rows:, ::2], x[..., rows:, 1::2] = float("nan"), float("inf")
    count = torch.tensor(valid, dtype=torch.int32)
    gm = trace(fn, x, w, count)
    static = compile_graph(gm, [x, w, count], config)
    for node in gm.graph.nodes:
        if node.op == "call_function":
            node.meta["ctpu_padding"] = {-2: list(gm.graph.nodes)[2].name}
    dynamic = compile_graph(gm, [x, w, count], config)
    bounded = fn is not _head_rows or shape[0] > 4 or shape[0] * shape[1] <= max_tile_vmem_rows(get_config(config))
    assert dynamic.value_inputs == [2] and static.value_inputs == []
    inputs = [x.float().numpy(), w.float().numpy(), count.numpy()]
    (want,), static_stats = run_fresh(static, inputs, SimulatorRunner(config))
    (got,), stats = run_fresh(dynamic, inputs, SimulatorRunner(config))
    _same_bits(got[..., :rows, :], want[..., :rows, :])
    (poisoned,) = run_with_poisoned_vmem(dynamic, inputs)
    _same_bits(poisoned[..., :rows, :], want[..., :rows, :])
    if bounded:
        np.testing.assert_array_equal(got[..., rows:, :], 0.0)
        if rows < shape[-2]:  # against the bucket with every row valid: a static program can be a tiled chain,
            # which a bucket is not yet (the norm at 300 of 517 rows: 12,853 cycles, static 11,939, all rows 20,952)
            full = [*inputs[:2], np.array(shape[-2], dtype=np.int32)]
            _, full_stats = run_fresh(dynamic, full, SimulatorRunner(config))
            assert stats.cycles < full_stats.cycles, (stats.cycles, full_stats.cycles, static_stats.cycles)
    else:
        _same_bits(got, want)


def test_the_dense_trailing_dims_of_a_strided_elementwise_run_on_whole_vmem_rows(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A causal query block's copy of its queries: x[:, :, 128:384] of a bf16 [8, 4, 512, 64] (rows of 64 at
    a head stride of 512 rows), times a scalar. Its last two dims are dense in every operand, so they run as
    whole vmem rows [128, 128] (`isel_vector._flattened`, FLATTEN_TRAILING); the head dims stay outer. The
    same bits as with rows of 64, fewer cycles, edge values included."""
    from codegen_helpers import compile_and_run

    import codegen.isel_vector

    g = torch.Generator().manual_seed(6)
    x = torch.randn(8, 4, 512, 64, generator=g).bfloat16()
    x.view(-1)[128 * 64: 128 * 64 + 8] = torch.tensor(
        [0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 3.3e38, -3.3e38]).bfloat16()

    def run() -> tuple[np.ndarray, int]:
        outs, refs, exe = compile_and_run(lambda x: x[:, :, 128:384] * 2.0, x, config="large")
        np.testing.assert_array_equal(np.asarray(outs[0], np.float32), np.asarray(refs[0], np.float32))
        return np.asarray(outs[0], np.float32), exe.last_stats.cycles

    wide, cycles = run()
    monkeypatch.setattr(codegen.isel_vector, "FLATTEN_TRAILING", False)
    narrow, cycles_narrow = run()
    np.testing.assert_array_equal(wide.view(np.uint32), narrow.view(np.uint32))
    assert cycles < 0.95 * cycles_narrow, (cycles, cycles_narrow)  # measured 5,618 against 6,130


@pytest.mark.parametrize(("shape", "bound"), [((8192, 1), 2_500), ((4096, 64), 9_500), ((3, 5, 64), 2_000)])
def test_dense_elementwise_with_narrow_rows_runs_on_whole_vmem_rows(shape: tuple[int, ...], bound: int) -> None:
    """An elementwise generic over dense operands whose rows are narrower than a vmem row runs as [n / N, N]
    (`isel_vector._flattened`): attention's [.., L, 1] row values took one vmem row an element (1 / x at
    [8192, 1] on `large`: 17,745 cycles, now ~1,800; x / y + 1 at [4096, 64]: 11,189 -> ~8,500). The same
    values, edge values included; a shape N does not divide keeps its rows."""
    from codegen_helpers import compile_and_run

    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    edge = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40, 3.4e38, -3.4e38, 1.0])
    x.view(-1)[:10] = edge
    outs, refs, exe = compile_and_run(lambda x, y: x / y + 1.0, x, y, config="large")
    np.testing.assert_allclose(outs[0], refs[0], rtol=1e-6, atol=1e-6, equal_nan=True)  # division: a few ulp
    assert np.array_equal(np.isinf(outs[0]), np.isinf(refs[0]))
    assert exe.last_stats.cycles < bound, exe.last_stats.cycles
