"""The one-row weight stream (codegen/isel_decode.py): a decode step's x[1, K] @ W.T.

Issue 13: at one row the general matmul waited for each n-tile's whole weight panel, whose last DMA it
issued along the previous panel's MXU commands: a DMA latency per n-tile, as long as the panel's work on
`large`, so a decode step's projections ran at about half the speed of HBM. The stream must give the
general path's bits (same MXU commands, same accumulation order) and keep the weight port busy.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from codegen_helpers import capture, run_with_poisoned_vmem, trace

import fx_passes
from codegen import compile_graph, isel_decode
from codegen.kernel_graph import MatmulKernel, View
from device_sim.config import get_config
from device_sim.executable import run_fresh
from device_sim.runners import SimulatorRunner

SPECIALS = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 3e-39, -1e-40, 3.3895e38, -3.3895e38]


def _linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, w)


def _compile(x: torch.Tensor, w: torch.Tensor, config: str):
    return compile_graph(trace(_linear, x, w), [x, w], config)


def _bits(config: str, x: torch.Tensor, w: torch.Tensor, monkeypatch: pytest.MonkeyPatch) -> tuple[np.ndarray, ...]:
    """(the stream's output on poisoned vmem, the general path's output): as raw bits."""
    inputs = [x.float().numpy(), w.float().numpy()]
    (streamed,) = run_with_poisoned_vmem(_compile(x, w, config), inputs)
    with monkeypatch.context() as m:
        m.setattr(isel_decode, "plan", lambda *_, **__: None)
        (general,) = run_with_poisoned_vmem(_compile(x, w, config), inputs)
    return streamed.view(np.uint32), general.view(np.uint32)


@pytest.mark.parametrize(("k", "n", "u", "g", "packed"), [
    (64, 64, 2, 8, False),  # a group is an n-tile's 8 k-tiles: 4 iterations of 2 n-tiles
    (128, 24, 1, 8, False),  # a group is half an n-tile: 3 iterations of one n-tile
    (16, 96, 6, 6, False),  # a group is 3 n-tiles of 2 k-tiles: 2 iterations
    (64, 16, 1, 4, False),  # two iterations of half the groups: cheaper than one whose DMAs all issue before the MXU
    (32, 16, 2, 4, False),  # one iteration: no prefetch loop
    # packed (two k-tiles a unit, `mxu.lwt.lo` / `.hi`): groups count units
    (64, 64, 2, 4, True),  # a group is an n-tile's 4 units: 4 iterations of 2 n-tiles
    (128, 24, 1, 4, True),  # a group is half an n-tile: 3 iterations of one n-tile
    (16, 96, 6, 3, True),  # a group is 3 n-tiles of one unit: 2 iterations
    (32, 16, 2, 2, True),  # one iteration
], ids=str)
def test_stream_gives_the_general_paths_bits(k: int, n: int, u: int, g: int, packed: bool,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(isel_decode, "PACKED", packed)
    torch.manual_seed(0)
    x, w = torch.randn(1, k).bfloat16(), torch.randn(n, k).bfloat16()
    kernel = MatmulKernel(View("x", 0, (1, k), (k, 1), "bf16"), View("w", 0, (k, n), (1, k), "bf16"),
                          View("c", 0, (1, n), (n, 1), "f32"))
    p = isel_decode.plan(get_config("small"), kernel, 3800)
    assert p is not None and (p.U, p.G, p.packed) == (u, g, packed)
    streamed, general = _bits("small", x, w, monkeypatch)
    np.testing.assert_array_equal(streamed, general)
    ref = (x.double() @ w.double().T).numpy()
    np.testing.assert_allclose(streamed.view(np.float32), ref, rtol=1e-2, atol=1e-2)  # a bf16 result


@pytest.mark.parametrize("packed", [True, False])
def test_stream_keeps_edge_values(packed: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Infinities, NaN, signed zeros, subnormals and the largest finite bf16 in x and in W (one per row of W,
    so each lands in its own output column): the general path's bits, W's bf16 packed two to a vmem word or
    widened."""
    monkeypatch.setattr(isel_decode, "PACKED", packed)
    torch.manual_seed(1)
    x, w = torch.randn(1, 64).clamp(-3, 3), torch.randn(64, 64)
    for i, value in enumerate(SPECIALS):
        w[3 * i, (5 * i) % 64] = value
        x[0, 40 + i] = value if i >= 3 else x[0, 40 + i]  # finite specials in x (an inf there NaNs every column)
    streamed, general = _bits("small", x.bfloat16(), w.bfloat16(), monkeypatch)
    np.testing.assert_array_equal(streamed, general)
    assert np.isnan(streamed.view(np.float32)).any() and np.isinf(streamed.view(np.float32)).any()


@pytest.mark.parametrize(("m", "k", "n", "dtype"), [
    (2, 64, 64, torch.bfloat16),  # two rows
    (1, 60, 64, torch.bfloat16),  # a partial k-tile
    (1, 64, 60, torch.bfloat16),  # a partial n-tile
    (1, 64, 64, torch.float32),  # fp32: the split passes
])
def test_stream_only_where_it_applies(m: int, k: int, n: int, dtype: torch.dtype) -> None:
    kernel = MatmulKernel(View("x", 0, (m, k), (k, 1), "bf16" if dtype == torch.bfloat16 else "f32"),
                          View("w", 0, (k, n), (1, k), "bf16"), View("c", 0, (m, n), (n, 1), "f32"))
    assert isel_decode.plan(get_config("small"), kernel, 3800) is None
    x, w = torch.randn(m, k).to(dtype), torch.randn(n, k).to(dtype)
    (out,) = run_with_poisoned_vmem(_compile(x, w, "small"), [x.float().numpy(), w.float().numpy()])
    np.testing.assert_allclose(out, (x.double() @ w.double().T).numpy(), rtol=2e-2, atol=2e-2)


def _stream_over_roofline(n: int, k: int) -> float:
    """x[1, k] @ W.T with W [n, k] bf16 on `large`: simulator cycles over the weight bytes' HBM time."""
    torch.manual_seed(0)
    x, w = torch.randn(1, k).bfloat16(), torch.randn(n, k).bfloat16() / k ** 0.5
    exe = _compile(x, w, "large")
    (out,), stats = run_fresh(exe, [x.float().numpy(), w.float().numpy()], SimulatorRunner("large"))
    np.testing.assert_allclose(out, (x.double() @ w.double().T).numpy(), rtol=1e-2, atol=1e-2)
    return stats.cycles / (w.numel() * 2 / get_config("large").hbm_bytes_per_cycle)


@pytest.mark.slow  # 80 s on a loaded machine (a 32 MiB weight)
def test_stream_runs_at_hbm_speed_on_large() -> None:
    """The 1B's gate projection at one token (x[1, 2048] @ W.T, W [8192, 2048] bf16, 32 MiB) on `large`, in
    simulator counts: within 10% of its bytes / HBM bandwidth (measured 1.094: the first group's DMA latency,
    the last mm's drain and the store's latency). The general path took 1.9x (a DMA latency per n-tile)."""
    ratio = _stream_over_roofline(8192, 2048)
    assert ratio <= 1.10, ratio


def test_stream_on_large_within_its_bound() -> None:
    """CI's check of the stream on `large` (simulator counts): x[1, 1024] @ W.T, W [4096, 1024] bf16 (8 MiB,
    4 iterations of 8 n-tiles). Measured 1.373 x its HBM roofline: the fixed costs (the first group's DMA
    latency, the drain and the store) weigh more than on the 32 MiB projection."""
    ratio = _stream_over_roofline(4096, 1024)
    assert ratio <= 1.40, ratio


class _QKNormProjections(torch.nn.Module):
    """Qwen3's attention inputs at one token: q and k RMS-normed per head of 128 (QK-norm), v as it is."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (torch.nn.Linear(1024, n, bias=False) for n in (2048, 1024, 1024))
        self.q_norm, self.k_norm = torch.nn.RMSNorm(128, eps=1e-6), torch.nn.RMSNorm(128, eps=1e-6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        def norm(t: torch.Tensor, n: torch.nn.RMSNorm) -> torch.Tensor:
            t = t.view(-1, 128).float()
            return n.weight * (t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)

        k = self.k_proj(x)  # also returned, as the model keeps it for the cache: no buffer of v's can reuse it
        return norm(self.q_proj(x), self.q_norm), norm(k, self.k_norm), self.v_proj(x), k


def test_projections_stream_back_to_back(monkeypatch: pytest.MonkeyPatch) -> None:
    """Qwen3-0.6B's q_proj, k_proj and v_proj at one token (hidden 1024, 16 query heads and 8 KV heads of
    128, bf16, `large`) with QK-norm between them: the norms move after the three streams
    (`isel_decode.streams_back_to_back`), which then load each other's first weights. The same bits as in
    the traced order. (What it saves shows in a whole decode step: `test_llama_bench.py`.) Square weights of
    one shape (k_proj's and v_proj's) are read in place: bufferization gave their transposed copies one
    temporary, and both copies stayed, a weight copy a call."""
    torch.manual_seed(0)
    model = _QKNormProjections().bfloat16().eval()
    for n in (model.q_norm, model.k_norm):
        torch.nn.init.normal_(n.weight, 1.0, 0.25)
    x = torch.randn(1, 1024).bfloat16()
    with torch.no_grad():
        expected = model(x)
        gm, args = capture(model, x)
    gm, _ = fx_passes.run_passes(gm, args)
    gm = fx_passes.inline_fused_kernels(gm)
    arrays = [t.detach().float().numpy() for t in args]

    def run() -> tuple[list[str], list[np.ndarray]]:
        exe = compile_graph(gm, args, "large")
        outs, _ = run_fresh(exe, arrays, SimulatorRunner("large"))
        return [k["kind"] for k in exe.summary["kernels"] if k.get("chained_into") is None], outs

    kinds, outs = run()
    with monkeypatch.context() as m:
        m.setattr("codegen.compiler.streams_back_to_back", lambda config, kernels: kernels)
        kinds_traced, outs_traced = run()
    assert "matmul, matmul, matmul" in ", ".join(kinds) and "matmul, matmul, matmul" not in ", ".join(kinds_traced)
    for out, ref in zip(outs, outs_traced, strict=True):
        np.testing.assert_array_equal(out.view(np.uint32), ref.view(np.uint32))
    for out, ref in zip(outs, expected, strict=True):
        np.testing.assert_allclose(out.reshape(ref.shape), ref.float().numpy(), rtol=2e-2, atol=2e-2)
    assert kinds.count("matmul") == 3 and "elementwise" not in kinds  # no weight copies


class _RunThenMLP(torch.nn.Module):
    """Four small matmuls (rank 16: not weight streams), then Qwen3-0.6B's o_proj, gate_proj and down_proj
    shapes: a long run of small kernels loads o_proj whole, and gate_proj finds its first two iterations of
    three in vmem (`ffn`: gate_proj's width, Qwen3's 3072)."""

    def __init__(self, ffn: int = 3072) -> None:
        super().__init__()
        self.small = torch.nn.ParameterList(torch.nn.Parameter(torch.randn(*shape) * scale)
                                            for shape, scale in [((2048, 16), 0.02), ((16, 2048), 0.25)] * 2)
        self.o = torch.nn.Linear(2048, 1024, bias=False)
        self.gate = torch.nn.Linear(1024, ffn, bias=False)
        self.down = torch.nn.Linear(ffn, 1024, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for a, b in zip(self.small[::2], self.small[1::2], strict=True):
            h = torch.relu(h @ a) @ b
        return self.down(torch.relu(self.gate(self.o(x + h))))


def _recorded_plans(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """Each weight stream's (iterations, tiles prefetched), appended as compiles lower them."""
    plans: list[tuple[int, int]] = []
    lower = isel_decode.lower_decode_matmul

    def recording(ctx, k, p):  # type: ignore[no-untyped-def]
        plans.append((p.iterations, ctx.prefetch.prefetched if ctx.prefetch else 0))
        return lower(ctx, k, p)

    monkeypatch.setattr(isel_decode, "lower_decode_matmul", recording)
    return plans


def _one_token(model: torch.nn.Module, width: int) -> tuple[Any, Any, list[torch.Tensor], list[np.ndarray]]:
    """A row of `width` with -0, a subnormal and 1e4 through bf16 `model`: eager's output (a list of them for
    a tuple), the graph after the FX passes, its arguments, and those as float arrays."""
    x = torch.randn(1, width).bfloat16()
    x[0, :3] = torch.tensor([-0.0, 3e-39, 1e4])
    with torch.no_grad():
        out = model(x)
        expected = [o.float().numpy() for o in out] if isinstance(out, tuple) else out.float().numpy()
        gm, args = capture(model, x)
    gm, _ = fx_passes.run_passes(gm, args)
    return expected, gm, args, [t.detach().float().numpy() for t in args]


def _cycles_with_and_without(monkeypatch: pytest.MonkeyPatch, model: torch.nn.Module, width: int, name: str,
                             off: Callable[..., Any], kinds: list[str] | None = None) -> tuple[int, int]:
    """One token through bf16 `model` on `large` (its row with -0, a subnormal and 1e4), compiled as is and
    with `isel_decode.<name>` replaced by `off`: the same bits both ways, eager's values (to 2% of the
    largest: 1e4 through bf16 projections, eager's roundings differ in the last bits), and the cycles of
    each. kinds: the kernels' kinds, checked."""
    expected, gm, args, arrays = _one_token(model, width)

    def run() -> tuple[int, np.ndarray]:
        exe = compile_graph(gm, args, "large")
        assert kinds is None or [k["kind"] for k in exe.summary["kernels"]] == kinds
        (out,), stats = run_fresh(exe, arrays, SimulatorRunner("large"))
        return stats.cycles, out

    cycles, out = run()
    with monkeypatch.context() as m:
        m.setattr(isel_decode, name, off)
        cycles_off, out_off = run()
    np.testing.assert_array_equal(out.view(np.uint32), out_off.view(np.uint32))
    np.testing.assert_allclose(out.reshape(expected.shape), expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())
    return cycles, cycles_off


def test_a_stream_with_two_iterations_in_vmem_issues_the_next_streams_tiles_along_them(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """gate_proj's first two iterations are in vmem (`_RunThenMLP`, one token on `large`); along them it issues
    its third's tiles, a tile every second command. Then the channel idled until its last iteration began
    (Qwen3's decode: ~460 cycles a layer); now the rest of those iterations issue down_proj's first tiles,
    whose slot o_proj has left (`next_stream_along_slots`): the same bits, in fewer cycles (measured 37,573
    against 37,863)."""
    torch.manual_seed(1)
    plans = _recorded_plans(monkeypatch)
    cycles, cycles_off = _cycles_with_and_without(monkeypatch, _RunThenMLP().bfloat16().eval(), 2048,
                                                  "next_stream_along_slots", lambda two, next_region: False)
    assert plans[-3:] == [(1, 64), (3, 64), (4, 48)], plans  # o_proj whole; gate_proj's two iterations in vmem
    assert cycles < cycles_off - 200, (cycles, cycles_off)


def test_a_stream_loaded_whole_issues_the_next_streams_tiles_before_its_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """o_proj of `_RunThenMLP` is loaded whole by the run before it and first waits for its last tiles, a DMA
    latency through which the channel idled; the first few of gate_proj's tiles now go ahead of that wait, on
    a flag o_proj waits for at its end (`tiles_ahead_of_whole_wait`): the same bits, in fewer cycles (measured
    37,320 against 37,573)."""
    torch.manual_seed(2)
    assert isel_decode.tiles_ahead_of_whole_wait(get_config("large")) > 0
    cycles, cycles_off = _cycles_with_and_without(monkeypatch, _RunThenMLP().bfloat16().eval(), 2048,
                                                  "tiles_ahead_of_whole_wait", lambda config: 0)
    assert cycles < cycles_off - 100, (cycles, cycles_off)


def test_a_stream_in_vmem_issues_the_next_streams_tiles_at_the_channels_pace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """o_proj of `_RunThenMLP` is loaded whole, so its weight port moves a tile in half the time the channel
    takes to load one of gate_proj's (here 1024 -> 2048, whose first 32 tiles o_proj issues): at one DMA a
    tile its full DMA queue held the MXU to HBM's pace, and the channel idled once the DMAs ran out. It now
    issues one every second tile (`next_tiles_every_second`): the same bits, in fewer cycles (measured
    33,567 against 34,008)."""
    torch.manual_seed(3)
    cycles, cycles_off = _cycles_with_and_without(monkeypatch, _RunThenMLP(ffn=2048).bfloat16().eval(), 2048,
                                                  "next_tiles_every_second", lambda in_vmem: False)
    assert cycles < cycles_off - 200, (cycles, cycles_off)


def test_a_stream_of_two_iterations_after_a_stream_loaded_whole_has_both_prefetched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After o_proj (loaded whole, its weight port twice the channel's pace) a 1024 x 1024 projection of two
    iterations (`_RunThenMLP(ffn=1024)`, Qwen3's k_proj after q_proj) has both in its slot: o_proj's MXU
    time loads them (`slot_holds_two`). The same bits, in fewer cycles than with its first alone."""
    torch.manual_seed(4)
    plans = _recorded_plans(monkeypatch)
    cycles, cycles_off = _cycles_with_and_without(
        monkeypatch, _RunThenMLP(ffn=1024).bfloat16().eval(), 2048, "slot_holds_two",
        lambda p, after_whole: isel_decode.two_ahead(p) and p.iterations > 2)
    assert plans[-6:-3] == [(1, 64), (2, 32), (2, 16)], plans  # o_proj whole; the next two both loaded ahead
    assert plans[-3:] == [(1, 64), (2, 16), (2, 16)], plans  # its first alone
    assert cycles < cycles_off - 100, (cycles, cycles_off)


def test_projections_of_one_row_read_it_where_the_first_left_it() -> None:
    """Three projections of the same bf16 row at one token (Qwen3-0.6B's q_proj, k_proj and v_proj shapes on
    `large`, the row with -0, a subnormal and 1e4): the first loads the row, the other two read it where it
    left it (`vmem_resident`), a DMA latency sooner; their values are eager's, also on NaN-poisoned vmem."""
    torch.manual_seed(5)

    class QKV(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q = torch.nn.Linear(1024, 2048, bias=False)
            self.k = torch.nn.Linear(1024, 1024, bias=False)
            self.v = torch.nn.Linear(1024, 1024, bias=False)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
            return self.q(x), self.k(x), self.v(x)

    def check(model: torch.nn.Module, resident: list[bool]) -> None:
        x = torch.randn(1, 1024).bfloat16()
        x[0, :3] = torch.tensor([-0.0, 3e-39, 1e4])
        with torch.no_grad():
            out = model(x)
            expected = [t.float().numpy() for t in (out if isinstance(out, tuple) else (out,))]
            gm, args = capture(model, x)
        gm, _ = fx_passes.run_passes(gm, args)
        exe = compile_graph(gm, args, "large")
        matmuls = [k for k in exe.summary["kernels"] if k["kind"] == "matmul"]
        assert ["vmem_resident" in k for k in matmuls] == resident, matmuls
        arrays = [t.detach().float().numpy() for t in args]
        outs, _ = run_fresh(exe, arrays, SimulatorRunner("large"))
        for out, poisoned, ref in zip(outs, run_with_poisoned_vmem(exe, arrays), expected, strict=True):
            np.testing.assert_array_equal(out.view(np.uint32), poisoned.view(np.uint32))
            np.testing.assert_allclose(out.reshape(ref.shape), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())

    check(QKV().bfloat16().eval(), [False, True, True])
    # a chain of projections reuses its buffers: each writes its output where its input was, so it leaves
    # nothing (the third read the first's input there, and computed from the wrong row)
    chain = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(3))).bfloat16().eval()
    check(chain, [False, False, False])


def test_the_last_iteration_issues_the_next_streams_tiles_before_its_first_wait(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three 1024 x 1024 bf16 projections in a row at one token (Qwen3-0.6B's k_proj shape, `large`): two
    iterations each, the first loaded by the stream before. The middle one's last iteration first waits for
    its own tiles, issued a DMA latency before with nothing queued behind them; the next stream's first
    tiles go ahead of that wait (`tiles_ahead_of_last`), so the channel does not idle through it: the same
    bits, in fewer cycles than with none ahead."""
    torch.manual_seed(1)
    model = torch.nn.Sequential(*(torch.nn.Linear(1024, 1024, bias=False) for _ in range(3))).bfloat16().eval()
    assert isel_decode.tiles_ahead_of_last(get_config("large")) > 0
    cycles, cycles_off = _cycles_with_and_without(monkeypatch, model, 1024, "tiles_ahead_of_last",
                                                  lambda config: 0, kinds=["matmul"] * 3)
    assert cycles < cycles_off - 100, (cycles, cycles_off)


def _scores_then_projection(q: torch.Tensor, k: torch.Tensor, x: torch.Tensor, w: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.bmm(q, k.transpose(1, 2)), torch.nn.functional.linear(x, w)


def test_resident_rounds_issue_the_next_streams_tiles_after_their_last_loads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode step's q @ K^T at 4096 positions (Qwen3's 8 KV heads of 2 query rows, head dim 128: 8 MiB of
    bf16 keys) runs in resident rounds, and the projection after it is a stream whose first tiles it
    prefetches. Issued before its first wait, those tiles went ahead of its own later rounds, and the
    channel idled through its last round's landing and tail (the MXU's last half head and its drain);
    issued before the wait for its last round they fill that time. The same bits both ways, on vmem
    poisoned with NaN too, and eager's values with specials in the last head; fewer cycles (measured 16,833
    against 17,601; 17,872 with the tiles right after the last round's loads, where the full DMA queue held
    the MXU work of the rounds before)."""
    from codegen import isel_matmul

    g = torch.Generator().manual_seed(8)
    q = torch.randn(8, 2, 128, generator=g).bfloat16()
    keys = torch.randn(8, 4096, 128, generator=g).bfloat16()
    keys[7, 4095, 127], keys[7, 2048, 0], keys[0, 0, 0] = float("inf"), float("nan"), -0.0
    x = torch.randn(1, 1024, generator=g).bfloat16()
    x[0, :2] = torch.tensor([-0.0, 3e-39])
    w = torch.randn(3072, 1024, generator=g).bfloat16()
    args = [q, keys, x, w]
    inputs = [t.float().numpy() for t in args]
    plans = _recorded_plans(monkeypatch)

    def run() -> tuple[list[np.ndarray], int]:
        exe = compile_graph(trace(_scores_then_projection, *args), args, "large")
        assert [k["kind"] for k in exe.summary["kernels"]] == ["matmul", "matmul"]
        outs, stats = run_fresh(exe, inputs, SimulatorRunner("large"))
        for poisoned, out in zip(run_with_poisoned_vmem(exe, inputs), outs, strict=True):
            np.testing.assert_array_equal(poisoned.view(np.uint32), out.view(np.uint32))
        return outs, stats.cycles

    (scores, proj), cycles = run()
    assert plans[-1][1] > 0, plans  # the projection was prefetched by q @ K^T
    with monkeypatch.context() as m:
        m.setattr(isel_matmul, "PREFETCH_AFTER_ROUNDS", False)
        (scores_before, proj_before), cycles_before = run()
    np.testing.assert_array_equal(scores.view(np.uint32), scores_before.view(np.uint32))
    np.testing.assert_array_equal(proj.view(np.uint32), proj_before.view(np.uint32))
    ref = (q.double() @ keys.double().transpose(1, 2)).numpy()
    np.testing.assert_array_equal(np.isnan(scores), np.isnan(ref))
    finite = np.isfinite(ref)
    np.testing.assert_allclose(scores[finite], ref[finite], rtol=2e-2, atol=2e-2)
    ref_proj = (x.double() @ w.double().T).numpy()
    np.testing.assert_allclose(proj, ref_proj, rtol=2e-2, atol=2e-2 * np.abs(ref_proj).max())
    assert cycles < cycles_before - 400, (cycles, cycles_before)


class _RunThenNormedMLP(_RunThenMLP):
    """`_RunThenMLP` with Qwen3's residual add and post-attention RMSNorm (one chain) after o_proj."""

    def __init__(self) -> None:
        super().__init__()
        self.residual = torch.nn.Parameter(torch.randn(1, 1024))
        self.norm = torch.nn.RMSNorm(1024, eps=1e-6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x
        for a, b in zip(self.small[::2], self.small[1::2], strict=True):
            h = torch.relu(h @ a) @ b
        return self.down(torch.relu(self.gate(self.norm(self.residual + self.o(x + h)))))


def test_a_chain_after_a_stream_reads_its_rows_in_vmem(monkeypatch: pytest.MonkeyPatch) -> None:
    """The residual add and the norm after a decode projection loaded the projection's output row, which the
    stream had just stored, and the residual row and the norm's weight: a DMA latency with the channel all
    but idle (~490 cycles a layer after o_proj and after down_proj). The stream now leaves its C row in vmem
    (`LEAVE_C_ROW`) and loads the chain's other rows at its start (`PRELOAD_ROWS`), and the chain takes all
    three there, the rows above a ceiling an earlier one lowered too (`KernelContext.take_resident`): here
    o_proj's C row lies mid-vmem and the preloaded rows at the top. The same bits as loading them, on vmem
    poisoned with NaN too, and eager's values (a row with -0, a subnormal and 1e4). Here the chain's own
    wait hides behind the 16 prefetch tiles it issues (37,320 cycles against 37,328); in Qwen3's layer it
    issues 6, and qwen3-0.6b-2l's decode at 1024 positions took 86,643 -> 85,882 cycles."""
    from codegen import isel_vector

    expected, gm, args, arrays = _one_token(_RunThenNormedMLP().bfloat16().eval(), 2048)

    def run() -> tuple[np.ndarray, int, list[Any]]:
        exe = compile_graph(gm, args, "large")
        (out,), stats = run_fresh(exe, arrays, SimulatorRunner("large"))
        (poisoned,) = run_with_poisoned_vmem(exe, arrays)
        np.testing.assert_array_equal(poisoned.view(np.uint32), out.view(np.uint32))
        chain = next(k for k in exe.summary["kernels"] if "rms_norm" in (k.get("node") or ""))
        return out, stats.cycles, chain.get("vmem_resident") or []

    out, cycles, taken = run()
    assert len(taken) == 3, taken  # o_proj's C row, the residual row, the norm's weight
    with monkeypatch.context() as m:
        m.setattr(isel_decode, "LEAVE_C_ROW", False)
        m.setattr(isel_vector, "PRELOAD_ROWS", False)
        out_off, cycles_off, taken_off = run()
    assert taken_off == [], taken_off
    np.testing.assert_array_equal(out.view(np.uint32), out_off.view(np.uint32))
    np.testing.assert_allclose(out.reshape(expected.shape), expected, rtol=2e-2, atol=2e-2 * np.abs(expected).max())
    assert cycles <= cycles_off, (cycles, cycles_off)


class _ProjectionsThenQKNorm(torch.nn.Module):
    """Qwen3's q, k and v projections of one row, then QK-norm over each head (one chain after v_proj)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (torch.nn.Linear(1024, n, bias=False) for n in (2048, 1024, 1024))
        self.q_norm, self.k_norm = torch.nn.RMSNorm(128, eps=1e-6), torch.nn.RMSNorm(128, eps=1e-6)
        with torch.no_grad():
            self.q_norm.weight.uniform_(0.5, 1.5)
            self.k_norm.weight.uniform_(0.5, 1.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = self.q(x), self.k(x), self.v(x)
        return self.q_norm(q.view(16, 128)), self.k_norm(k.view(8, 128)), v


def test_a_decode_chain_finds_its_heads_and_weights_loaded_by_the_stream_before(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """QK-norm after Qwen3's v_proj reads q and k (16 and 8 heads of 128, stored two and one kernels before)
    and its two weights (a row for every head): it waited a DMA latency for them, and the channel idled
    (262 + 105 cycles a layer). v_proj now loads them for it at its start, as its tiles hold them
    (`isel_vector.rows_to_preload`, `KernelContext.preload`; a weight's row once a head, stride 0):
    qwen3-0.6b-2l decode at 1024 positions 85,882 -> 85,144 cycles. The same bits as loading them, on vmem
    poisoned with NaN too, eager's values with -0, a subnormal and 1e4 in the row, and the chain takes its
    four operands in vmem."""
    from codegen import isel_vector

    expected, gm, args, arrays = _one_token(_ProjectionsThenQKNorm().bfloat16().eval(), 1024)

    def run() -> tuple[list[np.ndarray], int, list[Any]]:
        exe = compile_graph(gm, args, "large")
        outs, stats = run_fresh(exe, arrays, SimulatorRunner("large"))
        for poisoned, out in zip(run_with_poisoned_vmem(exe, arrays), outs, strict=True):
            np.testing.assert_array_equal(poisoned.view(np.uint32), out.view(np.uint32))
        chain = next(k for k in exe.summary["kernels"] if "rms_norm" in (k.get("node") or ""))
        return outs, stats.cycles, chain.get("vmem_resident") or []

    outs, cycles, taken = run()
    assert len(taken) == 4, taken  # q, k and the two weights
    with monkeypatch.context() as m:
        m.setattr(isel_vector, "PRELOAD_ROWS", False)
        outs_off, cycles_off, taken_off = run()
    assert taken_off == [], taken_off
    for out, off, ref in zip(outs, outs_off, expected, strict=True):
        np.testing.assert_array_equal(out.view(np.uint32), off.view(np.uint32))
        np.testing.assert_allclose(out.reshape(ref.shape), ref, rtol=2e-2, atol=2e-2 * np.abs(ref).max())
    assert cycles < cycles_off - 300, (cycles, cycles_off)
