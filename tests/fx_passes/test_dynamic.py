"""fx_passes.dynamic: symbolic sizes as padded programs whose padding is unobservable.

Each graph is dynamo's symbolic AOT graph of a small function; its variant for a bucket runs on the CPU
with the padding filled with NaN / inf garbage and must give eager's answer at the real size. The same
variant without the masking pass gives a wrong answer (the masks are what makes it right)."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd

from fx_passes import CtpuDynamicShapeError, decomposition_table
from fx_passes.dynamic import (
    PADDING_META,
    DynamicPlan,
    choose_bounds,
    copy_graph_module,
    evaluate,
    mask_padding,
    specialize,
)


def symbolic_graph(fn: Callable[..., torch.Tensor], *args: torch.Tensor) -> torch.fx.GraphModule:
    """AOT's forward graph of fn with dim 0 of every argument dynamic."""
    graphs = []

    def keep(gm: torch.fx.GraphModule, _: object) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    for a in args:
        torch._dynamo.mark_dynamic(a, 0)
    backend = aot_autograd(fw_compiler=keep, decompositions=decomposition_table(), keep_inference_input_mutations=True)
    torch.compile(fn, backend=backend, fullgraph=True)(*args)
    torch._dynamo.reset()
    return graphs[0]


def run_padded(gm: torch.fx.GraphModule, plan: DynamicPlan, args: list[torch.Tensor], garbage: float,
               poison_marked: bool = False) -> list[torch.Tensor]:
    """The variant of gm for args' bucket, run with every padded element = garbage, outputs narrowed.
    poison_marked: also overwrite, after each node marked with PADDING_META, its padding with garbage (what a
    back end that leaves those positions unwritten may leave there)."""
    values = {}
    for arg, shape in zip(_with_syms(gm, plan, args), plan.input_shapes, strict=True):
        for size, expr in zip(arg.shape if shape else (), shape or (), strict=True):
            if expr.free_symbols:
                values[expr] = int(size)
    bounds = choose_bounds(plan, values)
    static = specialize(gm, plan, bounds)
    inputs = []
    for arg, shape in zip(_with_syms(gm, plan, args), plan.input_shapes, strict=True):
        if shape is None:
            continue
        full = [evaluate(e, bounds) for e in shape]
        buffer = torch.full(full, garbage, dtype=arg.dtype)
        buffer[tuple(slice(0, n) for n in arg.shape)] = arg
        inputs.append(buffer)
    inputs += [torch.tensor(evaluate(e, values)) for e in plan.valid_exprs]
    outs = iter(_Poisoned(static, garbage).run(*inputs) if poison_marked else static(*inputs))
    results = [None if j in plan.host_views else next(outs)[tuple(slice(0, evaluate(e, values)) for e in shape)]
               for j, shape in enumerate(plan.output_shapes) if shape is not None]
    for j, view in plan.host_views.items():  # as the runtime: views of an input or output on the real tensor
        kind, index = view.root
        results[j] = view.replay(_with_syms(gm, plan, args)[index] if kind == "input" else results[index], values)
    return results


class _Poisoned(torch.fx.Interpreter):
    """Runs a bucket's program with the padding of every node marked PADDING_META overwritten by garbage."""

    def __init__(self, gm: torch.fx.GraphModule, garbage: float) -> None:
        super().__init__(gm)
        self.garbage, self.inputs = garbage, {}
        self.poisoned = 0

    def run_node(self, n: torch.fx.Node) -> object:
        out = super().run_node(n)
        if n.op == "placeholder":
            self.inputs[n.name] = out
        marks = n.meta.get(PADDING_META, {})
        if marks and isinstance(out, torch.Tensor):
            out = out.clone()
            for dim, name in marks.items():
                index = [slice(None)] * out.dim()
                index[dim] = slice(int(self.inputs[name]), None)
                out[tuple(index)] = self.garbage if out.is_floating_point() else True if out.dtype == torch.bool \
                    else 1 << 30
            self.poisoned += 1
        return out


def _with_syms(gm: torch.fx.GraphModule, plan: DynamicPlan, args: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """args in the graph's input order, None in the places of its SymInt inputs."""
    it = iter(args)
    return [None if i in plan.sym_inputs else next(it) for i in range(len(plan.input_shapes))]


def _unmasked_plan(gm: torch.fx.GraphModule) -> DynamicPlan:
    """A plan for gm without its masks: the pass run on a copy, whose plan has no valid lengths."""
    plan = mask_padding(copy_graph_module(gm))
    plan.valid_exprs = []
    return plan


CASES: dict[str, tuple[Callable[..., torch.Tensor], list[tuple[int, ...]]]] = {
    "sum": (lambda x: x.sum(0), [(5, 3)]),
    "mean": (lambda x: x.mean(0, keepdim=True), [(5, 3)]),
    "amax": (lambda x: x.amax(0), [(5, 3)]),
    "softmax": (lambda x: torch.softmax(x.t(), -1), [(5, 3)]),
    "log_softmax": (lambda x: torch.log_softmax(x.t(), -1), [(5, 3)]),
    "matmul": (lambda x, y: x.t() @ y, [(5, 3), (5, 4)]),
    "bmm": (lambda x, y: torch.bmm(x.permute(1, 2, 0), y.permute(1, 0, 2)), [(5, 2, 3), (5, 2, 4)]),
    "any": (lambda x: (x > 0).any(0), [(5, 3)]),
    "all": (lambda x: (x > 0).all(0), [(5, 3)]),
}


@pytest.mark.parametrize("garbage", [math.nan, math.inf, -math.inf, 3.0e38])
@pytest.mark.parametrize("name", CASES)
def test_padding_is_unobservable(name: str, garbage: float) -> None:
    fn, shapes = CASES[name]
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=gen) for s in shapes]
    if name in ("any", "all"):  # an all-True / all-False valid part: garbage must not flip it
        args = [torch.ones(*s) if name == "all" else -torch.ones(*s) for s in shapes]
    gm = symbolic_graph(fn, *args)
    masked = copy_graph_module(gm)
    plan = mask_padding(masked)
    got = run_padded(masked, plan, args, garbage)[0]
    torch.testing.assert_close(got, fn(*args), equal_nan=True)




def _w() -> torch.Tensor:
    """A weight of static sizes made in the graph (a global tensor would be lifted to an input)."""
    return (torch.arange(12.0).reshape(3, 4) - 5.5) / 7
MARKED = {  # graphs whose intermediate values have padding: marked nodes, the masks' inputs among them
    "linear_softmax_mix": (lambda x: (lambda h: torch.softmax(h @ h.t(), -1) @ h + h.mean(0))(x @ _w()), [(5, 3)]),
    "matmul_then_sum": (lambda x: (x @ _w()).relu().sum(0), [(5, 3)]),
    "rowwise_then_max": (lambda x: torch.softmax(x @ _w(), -1).amax(0), [(5, 3)]),
}


@pytest.mark.parametrize("garbage", [math.nan, math.inf, 3.0e38])
@pytest.mark.parametrize("name", [*CASES, *MARKED])
def test_padding_left_unwritten_where_marked_is_unobservable(name: str, garbage: float) -> None:
    """mask_padding's PADDING_META says which nodes' padding nothing reads: a back end may leave it unwritten
    (codegen's matmuls compute only the valid rows). Every marked node's padding overwritten with garbage as
    the program runs: eager's answer still; a mark on a mask (whose padding a reduction or contraction reads)
    would show."""
    fn, shapes = {**CASES, **MARKED}[name]
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(*s, generator=gen) for s in shapes]
    if name in ("any", "all"):
        args = [torch.ones(*s) if name == "all" else -torch.ones(*s) for s in shapes]
    gm = symbolic_graph(fn, *args)
    masked = copy_graph_module(gm)
    plan = mask_padding(masked)
    marked = [n for n in masked.graph.nodes if PADDING_META in n.meta]
    assert marked if name in MARKED else True
    assert not any(n.target is torch.ops.aten.where.self and n.args[2].target is torch.ops.aten.scalar_tensor.default
                   for n in marked)  # no mask is marked
    got = run_padded(masked, plan, args, garbage, poison_marked=True)[0]
    torch.testing.assert_close(got, fn(*args), equal_nan=True)


def test_the_padding_mark_is_the_one_codegen_reads_and_fusion_keeps() -> None:
    from codegen.compiler import PADDING_META as READ
    from fx_passes.rewrite import _KEPT_META

    assert READ == PADDING_META and PADDING_META in _KEPT_META


@pytest.mark.parametrize("name", ["sum", "softmax", "matmul", "mean"])
def test_without_the_masks_the_padding_shows(name: str) -> None:
    fn, shapes = CASES[name]
    args = [torch.randn(*s, generator=torch.Generator().manual_seed(0)) for s in shapes]
    gm = symbolic_graph(fn, *args)
    got = run_padded(gm, _unmasked_plan(gm), args, math.nan)[0]
    assert not torch.allclose(got, fn(*args), equal_nan=True)


@pytest.mark.parametrize("length", [2, 5, 17])
def test_prefix_ops_and_sizes_as_values(length: int) -> None:
    """cat after a static operand, slices at static starts, cumsum, arange + s (a size used as a value),
    a mean that divides by the real length: every length of a bucket gives eager's answer."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        y = torch.cat([x[:1] * 2, x], 0)[1:]  # [n, 3]
        pos = torch.arange(n, dtype=torch.float32) + n  # the size as a value
        return (y.cumsum(0) + pos[:, None]).mean(0) + x[2:].sum(0) * 0 + y.sum(0) / n

    x = torch.randn(length, 3, generator=torch.Generator().manual_seed(length))
    if length < 3:
        x = torch.randn(3, 3)
    gm = symbolic_graph(fn, torch.randn(7, 3))
    masked = copy_graph_module(gm)
    plan = mask_padding(masked)
    torch.testing.assert_close(run_padded(masked, plan, [x], math.nan)[0], fn(x))


def _two_batches(x: torch.Tensor) -> torch.Tensor:
    """[s, 3] -> [2, s, 3]: x and 2x, a static batch before the padded dim."""
    return x.unsqueeze(0) * (torch.arange(2) + 1).view(2, 1, 1)


@pytest.mark.parametrize(("fn", "why"), [
    (lambda x: torch.cat([x, x[:2]], 0).sum(0), "cat after an operand of symbolic size"),
    (lambda x: x.flip(0), "not known to keep padded elements unobservable"),
    (lambda x: x[-2:], "negative or symbolic start"),
    (lambda x: torch.ones(20, 3)[x.shape[0]] + x.sum(0), "static dim at a symbolic index"),
    (lambda x: x.t().reshape(-1).sum(), "reduction over an interleaved dim"),  # [3, s] -> [3s]: not a prefix
    (lambda x: _two_batches(x).reshape(-1, 3) * 2, "graph output with interleaved padding"),
    (lambda x: _two_batches(x).reshape(-1, 3).reshape(-1).sum(), "view of an interleaved dim"),
    (lambda x: _two_batches(x).reshape(-1, 3)[1:].sum(0) * 0 + x.sum(0), "on an interleaved dim"),
])
def test_what_it_cannot_prove_safe_is_refused(fn: Callable[..., torch.Tensor], why: str) -> None:
    gm = symbolic_graph(fn, torch.randn(6, 3))
    with pytest.raises(CtpuDynamicShapeError, match=why):
        mask_padding(gm)


@pytest.mark.parametrize("garbage", [math.nan, math.inf, 3.0e38])
@pytest.mark.parametrize("length", [2, 5, 17])
def test_a_merged_batch_and_padded_dim_is_rows(length: int, garbage: float) -> None:
    """A linear layer at batch > 1: [2, s, 3] -> [2s, 3] (each batch's padded tail inside the merged dim,
    not at its end), a matmul, an elementwise op and a softmax over the other dim on those rows, then back
    to [2, s, 4] and a sum over s (masked there): eager's answer with garbage in the padding."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        w = torch.arange(12.0).view(3, 4).cos()  # made in the graph: AOT lifts a captured tensor to an input
        rows = _two_batches(x).reshape(-1, 3)
        y = torch.softmax((rows @ w).relu() + 1, -1)
        return y.reshape(2, -1, 4).sum(1)

    x = torch.randn(length, 3, generator=torch.Generator().manual_seed(length))
    gm = symbolic_graph(fn, torch.randn(7, 3))
    masked = copy_graph_module(gm)
    plan = mask_padding(masked)
    torch.testing.assert_close(run_padded(masked, plan, [x], garbage)[0], fn(x))


def test_bounds_are_powers_of_two_then_two_an_octave_capped_by_the_declared_max() -> None:
    gm = symbolic_graph(lambda x: x.sum(0), torch.randn(6, 3))
    plan = mask_padding(gm)
    (sym,) = plan.symbols
    sizes = (2, 16, 17, 100, 256, 257, 300, 384, 385, 512, 513, 1000, 4097)
    assert [choose_bounds(plan, {sym: n})[sym] for n in sizes] == [
        16, 16, 32, 128, 256, 384, 384, 384, 512, 512, 768, 1024, 6144]
    plan.ranges[sym] = (2, 40)
    assert choose_bounds(plan, {sym: 33})[sym] == 40
    with pytest.raises(CtpuDynamicShapeError, match=f"{sym} = 41 is above its bound 40"):
        choose_bounds(plan, {sym: 41})


@pytest.mark.parametrize("length", [3, 9, 16])
def test_gathers_on_a_padded_dim(length: int) -> None:
    """Hugging Face's mask builder gathers c[arange(1), arange(n)] (an identity gather: a view now) and an
    index computed from the size (n - 1 - arange(n): values read at run time, padding indexes 0), and a
    negative index counted from the real end, not the bound."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        c = x[:, 0].cumsum(0)[None]  # [1, n]
        same = c[torch.arange(1)[:, None, None], torch.arange(n)[None, :, None][:, 0:]]  # [1, n, 1], a full slice
        reverse = x[n - 1 - torch.arange(n)]
        last = x[torch.full((n,), -1)]
        return same[0] + reverse + last

    x = torch.randn(length, 3, generator=torch.Generator().manual_seed(length))
    gm = symbolic_graph(fn, torch.randn(7, 3))
    masked = copy_graph_module(gm)
    plan = mask_padding(masked)
    assert not any(n.target is torch.ops.aten.index.Tensor and len(n.args[1]) > 1 for n in masked.graph.nodes)
    torch.testing.assert_close(run_padded(masked, plan, [x], math.nan)[0], fn(x))


def test_a_size_that_shrinks_as_the_symbol_grows_is_not_padded() -> None:
    """ones(20 - n).sum(): at the bound 16 the tensor would have 4 elements for n = 5 (real: 15), a silent
    wrong sum; the bounds fall back to the exact sizes."""
    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.ones(20 - x.shape[0]).sum() + x.sum()

    gm = symbolic_graph(fn, torch.randn(7))
    masked = copy_graph_module(gm)
    plan = mask_padding(masked)
    x = torch.randn(5)
    torch.testing.assert_close(run_padded(masked, plan, [x], math.nan)[0], fn(x))


@pytest.mark.parametrize(("length", "garbage"), [(2, math.nan), (9, -math.inf), (16, math.nan)])
def test_kv_append_and_last_row(length: int, garbage: float) -> None:
    """A KV cache's append, cat([past, new]) with past padded: new lands at the real length; the last row
    (x[-1], x[:, -1:] as generate() reads the logits) at the real end; -0.0 and NaN rows come out exact. The
    rows are computed on (* 1): a bare view of an output is replayed on the host (HostView)."""
    def fn(past: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = torch.cat([past, new], 0)  # [n + 1, 3]
        n = past.shape[0]
        return (cache, cache[-1] * 1, cache[None][:, -1:] * 1, (cache > 0)[-1].logical_not(), cache.sum(0),
                cache[n - 1] * 1, cache[n:n + 1] * 1, cache[n - 1])

    past = torch.randn(length, 3, generator=torch.Generator().manual_seed(length))
    new = torch.tensor([[-0.0, math.nan, 2.5]])
    graphs = []

    def keep(gm: torch.fx.GraphModule, _: object) -> torch.fx.GraphModule:
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    example = torch.randn(7, 3)
    torch._dynamo.mark_dynamic(example, 0)
    backend = aot_autograd(fw_compiler=keep, decompositions=decomposition_table())
    torch.compile(fn, backend=backend, fullgraph=True)(example, new)
    masked = copy_graph_module(graphs[0])
    plan = mask_padding(masked)
    got = run_padded(masked, plan, [past, new], garbage)
    for g, r in zip(got, fn(past, new), strict=True):
        torch.testing.assert_close(g, r, equal_nan=True)
        assert torch.equal(torch.signbit(g.nan_to_num()), torch.signbit(r.nan_to_num()))


def test_a_data_dependent_size_is_refused() -> None:
    """nonzero's size is no input's: no bucket can be chosen for it."""
    torch._dynamo.config.capture_dynamic_output_shape_ops = True
    try:
        gm = symbolic_graph(lambda x: torch.nonzero(x).sum(0) + x.shape[0], torch.randn(6))
    finally:
        torch._dynamo.config.capture_dynamic_output_shape_ops = False
    with pytest.raises(CtpuDynamicShapeError, match="data-dependent"):
        mask_padding(gm)
