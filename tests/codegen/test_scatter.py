"""index_put / index_copy_ as an in-place row scatter (the KV cache update): the graph AOT autograd gives
the backend (keep_inference_input_mutations: a trailing `copy_(input, value)`), compiled and run on the
simulator; the input's HBM bytes after the launch must be eager's, bit for bit, rows not written included."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from codegen_helpers import capture_with_mutations

import codegen
from codegen.kernel_graph import ScatterKernel
from device_sim import numerics
from device_sim.executable import launch, stage
from device_sim.profile import analyze
from device_sim.runners import SimulatorRunner


def _numpy(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()


def _bits(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int16).numpy() if x.dtype == torch.bfloat16 else x.view(torch.int32).numpy()


def _run(fn, cache: torch.Tensor, *rest: torch.Tensor, config: str = "small"
         ) -> tuple[np.ndarray, list[np.ndarray], codegen.Executable]:
    """(the cache's bits in HBM after the launch, the outputs, the executable; the run's `profile` on it)."""
    gm, examples, order = capture_with_mutations(fn, cache, *rest)
    exe = codegen.compile_graph(gm, examples, config, verify=True)
    given = (cache, *rest)
    hbm, addrs, arena, _ = stage(exe, [_numpy(given[order.index(i)]) for i in range(len(given))])
    runner = SimulatorRunner(config)
    runner.simulator.profile = True
    outs, _ = launch(exe, runner, hbm, addrs, arena)
    assert runner.simulator.recording is not None
    exe.profile = analyze(runner.simulator.recording, exe.summary["kernels"])  # type: ignore[attr-defined]
    assert exe.mutated_inputs == [order[0]]
    flat = hbm[addrs[order[0]]: addrs[order[0]] + cache.numel() * cache.element_size()]
    return flat.view(np.int16 if cache.dtype == torch.bfloat16 else np.int32).reshape(cache.shape), outs, exe


def _assign(cache: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    cache[:, :, pos] = vals  # index_put: a negative position counts from the end
    return cache.sum(-1)


def _index_copy(cache: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    cache.index_copy_(2, pos, vals)
    return cache.sum(-1)  # reads the updated cache


@pytest.mark.parametrize("positions", [[0], [10], [7, 2, 9], [3, 0, 10, 5, 1, 8, 6, 4]],
                         ids=["first", "last", "unsorted", "eight"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scatter_writes_exactly_the_new_rows_in_place(positions: list[int], dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(len(positions))
    cache = torch.randn(2, 3, 11, 16, generator=g).to(dtype)  # B=2, H=3 (every leading index is exercised)
    vals = torch.randn(2, 3, len(positions), 16, generator=g).to(dtype)
    vals[0, 0, 0, :6] = torch.tensor([float("inf"), -float("inf"), float("nan"), -0.0, 1e-40, 3.3e38])
    if dtype == torch.float32:  # a NaN with a payload and a subnormal: bits copied, never computed
        vals.view(torch.int32)[1, 2, -1, 3] = 0x7FC12345
    else:
        vals.view(torch.int16)[1, 2, -1, 3] = 0x7FC5
    pos = torch.tensor(positions)
    got, outs, exe = _run(_index_copy, cache, pos, vals)
    expected = cache.clone()
    ref = _index_copy(expected, pos, vals)
    np.testing.assert_array_equal(got, _bits(expected))  # new rows bit-exact, every other row untouched
    np.testing.assert_allclose(outs[0], ref.float().numpy(), rtol=1e-5 if dtype == torch.float32 else 3e-2,
                               equal_nan=True)  # the reader saw the updated cache
    assert len(exe.outputs) == 1 and _kernel_kinds(exe).count("scatter") == 1


def _kernel_kinds(exe: codegen.Executable) -> list[str]:
    return [k["kind"] for k in exe.summary["kernels"]]


@pytest.mark.parametrize("count", [45, 90])
def test_a_prefill_sized_update_runs_as_a_loop_and_keeps_the_last_of_repeated_rows(count: int) -> None:
    """A prefill's KV cache update (B=1, H=2: 2 * count rows, positions with repeats): the rows are written in
    order, in a runtime loop, so a repeated position keeps the last row (as the CPU) and the
    program does not grow with the rows."""
    g = torch.Generator().manual_seed(count)
    cache, vals = torch.randn(1, 2, 64, 16, generator=g), torch.randn(1, 2, count, 16, generator=g)
    pos = torch.randint(0, 64, (count,), generator=g)
    assert len(set(pos.tolist())) < count  # repeats

    got, _, exe = _run(_assign, cache, pos, vals)
    expected = cache.clone()
    _assign(expected, pos, vals)
    np.testing.assert_array_equal(got, _bits(expected))
    assert len(exe.program) < 1400, len(exe.program)  # not unrolled: ~2 bundles a row


def test_a_1b_prefill_update_on_large_is_exact_and_costs_about_two_cycles_a_row() -> None:
    """The 1B geometry's KV cache (8 KV heads, head dim 64, 4096 positions, bf16) takes 2047 rows a head at
    random, distinct positions: bit-exact, in place. Each row's address is computed by vector ops, eight
    rows at a time, and the loop keeps four such groups in flight: the scatter kernel runs at ~2 cycles a
    row (it was ~18 with a scalar check, multiply and add per index component, spilling)."""
    g = torch.Generator().manual_seed(1)
    cache = torch.randn(1, 8, 4096, 64, generator=g).to(torch.bfloat16)
    pos, vals = torch.randperm(4096, generator=g)[:2047], torch.randn(1, 8, 2047, 64, generator=g).to(torch.bfloat16)
    got, _, exe = _run(_index_copy, cache, pos, vals, config="large")
    expected = cache.clone()
    _index_copy(expected, pos, vals)
    np.testing.assert_array_equal(got, _bits(expected))
    scatter = next(k for k in exe.profile.kernels if k.kind == "scatter")  # type: ignore[attr-defined]
    assert scatter.dma_commands >= 8 * 2047
    assert scatter.cycles < 2.5 * 8 * 2047, scatter.cycles


@pytest.mark.parametrize("position", [4096, -4097])
def test_one_bad_position_among_a_large_update_traps(position: int) -> None:
    """A position outside the cache deep in a 1B-sized update (row 1500 of 2047, in the loop) traps."""
    g = torch.Generator().manual_seed(2)
    cache = torch.randn(1, 8, 4096, 64, generator=g).to(torch.bfloat16)
    pos, vals = torch.randperm(4096, generator=g)[:2047], torch.randn(1, 8, 2047, 64, generator=g).to(torch.bfloat16)
    pos[1500] = position
    with pytest.raises(Exception, match="out of bounds"):
        _run(_index_copy, cache, pos, vals, config="large")


@pytest.mark.parametrize("start, count", [(0, 2048), (1, 2047), (-2048, 2048), (-100, 300)],
                         ids=["from-0", "odd-from-1", "negative", "across-0"])
def test_a_1b_update_at_consecutive_positions_moves_a_dma_a_run(start: int, count: int) -> None:
    """The 1B geometry's KV cache (8 KV heads, head dim 64, 4096 positions, bf16) updated at consecutive
    positions, as HF's StaticCache does in a prefill: bit-exact, in place, and each run of 256 rows whose
    positions are consecutive inside one head moves in one DMA (a DMA a row: 26,352 cycles at 2048 positions,
    ~12,000 now). Runs across two heads (2047 positions from 1) or across position 0 (which wraps to the
    end) take a DMA a row, as do the rows after the last whole run."""
    g = torch.Generator().manual_seed(count)
    cache = torch.randn(1, 8, 4096, 64, generator=g).to(torch.bfloat16)
    vals = torch.randn(1, 8, count, 64, generator=g).to(torch.bfloat16)
    pos = torch.arange(start, start + count)
    got, _, exe = _run(_assign, cache, pos, vals, config="large")
    expected = cache.clone()
    _assign(expected, pos, vals)
    np.testing.assert_array_equal(got, _bits(expected))
    scatter = next(k for k in exe.profile.kernels if k.kind == "scatter")  # type: ignore[attr-defined]
    if count % 256 == 0:  # every run in one head: a DMA a run, and the loads
        assert scatter.dma_commands < 8 * count // 256 + 16, scatter.dma_commands
        assert scatter.cycles < 0.8 * 8 * count, scatter.cycles
    elif start > 0:  # the runs across two heads, and the last rows, a DMA a row: 7 of 64 runs, 248 rows
        assert scatter.dma_commands < 8 * count // 4, scatter.dma_commands


@pytest.mark.parametrize("start", [3900, -4200], ids=["past-the-end", "before-the-start"])
def test_consecutive_positions_past_a_head_trap_rather_than_write_the_next_head(start: int) -> None:
    """Row h * S + position of the cache's rows is the next head's for a position past the end: such a
    position's index is a bad one, which breaks its run of consecutive indices, and the rows' path traps."""
    g = torch.Generator().manual_seed(3)
    cache = torch.randn(1, 8, 4096, 64, generator=g).to(torch.bfloat16)
    vals = torch.randn(1, 8, 512, 64, generator=g).to(torch.bfloat16)
    with pytest.raises(Exception, match="out of bounds"):
        _run(_assign, cache, torch.arange(start, start + 512), vals, config="large")


def test_the_cache_is_written_in_place_not_copied() -> None:
    """The only writes to the cache's buffer are the scatter's rows: no kernel copies the whole cache."""
    cache, pos, vals = torch.randn(1, 2, 64, 16), torch.tensor([5]), torch.randn(1, 2, 1, 16)
    gm, examples, order = capture_with_mutations(_index_copy, cache, pos, vals)
    exe = codegen.compile_graph(gm, examples, "small")
    arg = f"%arg{order[0]}"
    lines = exe.stages["kernels.txt"].splitlines()
    assert next(line for line in lines if "scatter rows" in line).split(" into ")[1].startswith(arg)
    assert not any(line.split("->")[-1].strip().startswith(arg) for line in lines if "elementwise" in line)


def test_negative_position_counts_from_the_end_like_torch() -> None:
    cache, pos, vals = torch.randn(1, 2, 11, 16), torch.tensor([-1, -11]), torch.randn(1, 2, 2, 16)
    got, _, _ = _run(_assign, cache, pos, vals)
    expected = cache.clone()
    _assign(expected, pos, vals)
    np.testing.assert_array_equal(got, _bits(expected))


@pytest.mark.parametrize("position", [11, -12])
def test_out_of_range_position_traps_instead_of_writing_elsewhere(position: int) -> None:
    cache, vals = torch.randn(1, 2, 11, 16), torch.randn(1, 2, 1, 16)
    with pytest.raises(Exception, match="out of bounds"):
        _run(_index_copy, cache, torch.tensor([position]), vals)


def test_index_put_on_dim_0_and_a_scalar_counter() -> None:
    """x[idx] = v (dim 0, no leading dims) and an in-place scalar counter (StaticCache's cumulative_length)."""
    def fn(x: torch.Tensor, n: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        x[idx] = v
        n.add_(3)
        return x * 2.0

    given = (torch.randn(6, 8), torch.tensor(4), torch.tensor([4, 1]), torch.randn(2, 8))
    gm, examples, order = capture_with_mutations(fn, *given)
    exe = codegen.compile_graph(gm, examples, "small")
    hbm, addrs, arena, _ = stage(exe, [given[order.index(i)].numpy() for i in range(4)])
    outs, _ = launch(exe, SimulatorRunner("small"), hbm, addrs, arena)
    ex, en = given[0].clone(), given[1].clone()
    ref = fn(ex, en, given[2], given[3])
    x_at, n_at = addrs[order[0]], addrs[order[1]]
    np.testing.assert_array_equal(hbm[x_at: x_at + 6 * 8 * 4].view(np.float32).reshape(6, 8), ex.numpy())
    assert int(hbm[n_at: n_at + 4].view(np.int32)[0]) == 7
    np.testing.assert_array_equal(outs[0], ref.numpy())
    assert sorted(exe.mutated_inputs) == sorted(order[:2])


def test_unsupported_index_put_forms_are_refused_with_a_reason() -> None:
    def two_indices(x: torch.Tensor, idx: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten.index_put.default(x, [idx, idx], v[:, 0])

    x, idx, v = torch.randn(6, 8), torch.tensor([1, 2]), torch.randn(2, 8)
    for fn, reason in ((two_indices, "2 index tensors"),):
        gm = torch.fx.experimental.proxy_tensor.make_fx(fn)(x, idx, v)
        node = next(n for n in gm.graph.nodes if n.target == torch.ops.aten.index_put.default)
        assert reason in (codegen.unsupported_reason(node) or "")


def test_scatter_kernel_reads_iree_scatter_after_bufferization() -> None:
    from codegen.fx_ops import emit_module
    from codegen.kernel_graph import read_function
    from codegen.mlir_pipeline import run_pipeline

    gm, examples, order = capture_with_mutations(_index_copy, torch.randn(1, 2, 11, 16), torch.tensor([3]),
                                   torch.randn(1, 2, 1, 16))
    text, _, outputs = emit_module(gm, examples)
    assert "iree_linalg_ext.scatter" in text and "bufferization.materialize_in_destination" in text
    assert len(outputs) == 1  # the cache's new value is returned after the outputs, as a mutation
    result = run_pipeline(text)
    with result.context:
        g = read_function(result.module)
    (k,) = [k for k in g.kernels if isinstance(k, ScatterKernel)]
    # in place in the cache, one flat row index a row: the cache's rows [B * H * S, D], (b * H + h) * S + position
    assert k.dest.buffer == g.arguments[order[0]] and k.dest.shape == (22, 16)
    assert k.indices.shape == (2, 1) and k.updates.shape == (2, 16)


def test_bf16_rows_move_as_words_so_nan_payloads_survive() -> None:
    assert numerics.f32_to_bf16_bits(np.array([np.float32(np.nan)]))[0] != 0x7FC5  # a bf16 DMA would change it
