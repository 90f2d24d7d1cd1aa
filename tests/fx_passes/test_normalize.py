"""normalize: golden tests (input graph written in ATen ops -> expected ops after) and invalid graphs."""

from __future__ import annotations

import operator

import pytest
import torch
from fx_helpers import aot_trace, run_graph
from torch.fx.experimental.proxy_tensor import make_fx

from fx_passes import CtpuDynamicShapeError, CtpuPassError, normalize

aten = torch.ops.aten


def ops_after_normalize(fn, *args: torch.Tensor) -> list[str]:
    """Trace fn (written in ATen ops) with make_fx, normalise, check the values, list the ops left."""
    gm = make_fx(fn)(*args)
    before = run_graph(gm, args)
    normalize(gm, strict=True)
    gm.graph.lint()
    for got, expected in zip(run_graph(gm, args), before, strict=True):
        torch.testing.assert_close(got, expected, atol=0, rtol=0)
    return [str(n.target).removeprefix("aten.") for n in gm.graph.nodes if n.op == "call_function"]


def test_alias_detach_and_lift_fresh_copy_go() -> None:
    def fn(x):
        constant = torch.tensor([1.0, 2.0, 3.0, 4.0])  # make_fx: get_attr + lift_fresh_copy
        return aten.add.Tensor(aten.detach.default(aten.alias.default(x)), constant)

    assert ops_after_normalize(fn, torch.randn(4)) == ["add.Tensor"]


def test_copies_that_change_nothing_go() -> None:
    def fn(x):
        y = aten.mul.Tensor(x, 2)
        y = aten.clone.default(y)
        y = aten.clone.default(y, memory_format=torch.contiguous_format)
        y = aten._to_copy.default(y, dtype=torch.float32)
        return aten.neg.default(y)

    assert ops_after_normalize(fn, torch.randn(2, 3)) == ["mul.Tensor", "neg.default"]


def test_copies_that_change_something_stay() -> None:
    def fn(x):
        wide = aten.clone.default(aten.expand.default(x, [4, 3]), memory_format=torch.contiguous_format)
        half = aten._to_copy.default(x, dtype=torch.bfloat16)
        return aten.view.default(wide, [12]), half

    ops = ops_after_normalize(fn, torch.randn(1, 3))
    assert ops == ["expand.default", "clone.default", "_to_copy.default", "view.default"]


def test_copy_of_an_input_that_reaches_the_output_stays() -> None:
    # Dropping it would return the caller's own tensor, which the caller may mutate later.
    def fn(x):
        return aten.view.default(aten.clone.default(x), [6]), aten.mul.Tensor(x, 1)

    assert ops_after_normalize(fn, torch.randn(2, 3)) == ["clone.default", "view.default", "mul.Tensor"]


def test_noop_views_go_and_permute_chains_fold() -> None:
    def fn(x):
        y = aten.view.default(x, [2, 3, 4])
        y = aten.expand.default(y, [2, 3, 4])
        y = aten.slice.Tensor(y, 2, 0, 9223372036854775807)
        y = aten.squeeze.dim(y, 1)
        y = aten.permute.default(aten.permute.default(y, [0, 2, 1]), [2, 0, 1])
        z = aten.permute.default(aten.permute.default(x, [1, 0, 2]), [1, 0, 2])
        return aten.add.Tensor(y, 1.0), aten.add.Tensor(z, 1.0)

    ops = ops_after_normalize(fn, torch.randn(2, 3, 4))
    assert ops == ["permute.default", "add.Tensor", "add.Tensor"]


def test_cat_drops_empty_operands() -> None:
    def fn(x, cache):
        y = aten.mul.Tensor(x, 2)
        two = aten.cat.default([cache, y, cache, y], 1)
        one = aten.cat.default([cache, y], 1)
        strided = aten.cat.default([cache, aten.permute.default(y, [0, 2, 1])], 1)
        of_input = aten.cat.default([cache, x], 1)
        return two, one, strided, of_input

    x, empty = torch.randn(2, 3, 3), torch.randn(2, 0, 3)
    ops = ops_after_normalize(fn, x, empty)
    # One operand left: the value itself; a contiguous clone when it is strided, or is the caller's input.
    assert ops == ["mul.Tensor", "cat.default", "permute.default", "clone.default", "clone.default"]


def test_exact_arithmetic_identities_go() -> None:
    def fn(x, i):
        y, j = aten.neg.default(x), aten.neg.default(i)
        kept = aten.add.Tensor(y, 0)  # -0.0 + 0 = +0.0: not an identity for floats
        return aten.mul.Tensor(aten.div.Tensor(y, 1), 1.0), aten.add.Tensor(j, 0), kept

    ops = ops_after_normalize(fn, torch.randn(3), torch.arange(3))
    assert ops == ["neg.default", "neg.default", "add.Tensor"]


def test_duplicate_getitems_merge() -> None:
    def fn(x):
        var, _ = aten.var_mean.correction(x, [0], correction=0)
        return aten.add.Tensor(var, 1), aten.mul.Tensor(var, 2)

    gm = make_fx(fn)(torch.randn(4, 3))
    graph = gm.graph
    first = next(n for n in graph.nodes if n.target is operator.getitem and n.args[1] == 0)
    with graph.inserting_after(first):
        twin = graph.call_function(operator.getitem, (first.args[0], 0))
    twin.meta["val"] = first.meta["val"]
    next(n for n in graph.nodes if n.target is aten.mul.Tensor).replace_input_with(first, twin)
    gm.recompile()
    assert normalize(gm, strict=True)["getitem"] == 1
    assert [n.args[1] for n in graph.nodes if n.target is operator.getitem] == [0]


def test_trailing_input_mutation_stays_explicit() -> None:
    def fn(x, y):
        x.add_(1)
        return y * 2 + x

    traced = aot_trace(fn, torch.randn(4), torch.randn(4), keep_input_mutations=True)
    normalize(traced.gm, strict=True)
    nodes = [n for n in traced.gm.graph.nodes if n.op != "output"]
    assert nodes[-1].target is aten.copy_.default and nodes[-1].args[0].op == "placeholder"
    x, y = traced.inputs
    x_before = x.clone()
    (out,) = traced.gm(x, y)
    torch.testing.assert_close(x, x_before + 1)
    torch.testing.assert_close(out, y * 2 + x_before + 1)


def _graph_with_copy_in_the_middle(read_after: bool):
    def fn(x, y):
        z = aten.mul.Tensor(y, 2)
        aten.copy_.default(x, z)
        return aten.add.Tensor(x if read_after else y, 1)

    return make_fx(fn)(torch.randn(3), torch.randn(3))


def test_mutation_in_the_middle_moves_to_the_end() -> None:
    gm = _graph_with_copy_in_the_middle(read_after=False)
    assert normalize(gm, strict=True)["input_mutation_moved"] == 1
    nodes = [n for n in gm.graph.nodes if n.op != "output"]
    assert nodes[-1].target is aten.copy_.default


def test_mutation_read_afterwards_is_an_error_naming_the_node() -> None:
    gm = _graph_with_copy_in_the_middle(read_after=True)
    with pytest.raises(CtpuPassError, match=r"copy_.* mutates x_1 before add reads it"):
        normalize(gm)


def test_symbolic_size_is_an_error_naming_the_node() -> None:
    gm = make_fx(lambda x: aten.mul.Tensor(x, 2), tracing_mode="symbolic")(torch.randn(5))
    with pytest.raises(CtpuDynamicShapeError, match=r"node x_1 .* symbolic size s\d+: .* static shapes only"):
        normalize(gm)
