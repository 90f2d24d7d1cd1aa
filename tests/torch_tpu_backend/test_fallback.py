"""Fallback granularity: a node the target cannot run goes to the CPU alone; the nodes on either side still
run on the CTPU; one CtpuFallbackWarning per compiled graph names every CPU op with its reason."""

from __future__ import annotations

import warnings

import pytest
import torch

import codegen
import fx_passes
import torch_tpu_backend.stats as ctpu_stats
from fx_passes import CtpuFallbackWarning
from torch_tpu_backend.dynamo import GraphCompiler


def _compile(fn, *xs: torch.Tensor, **options):
    torch._dynamo.reset()
    ctpu_stats.reset()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad():
            out = torch.compile(fn, backend="ctpu", options={"cache": False, **options})(*xs)
    return out, [w for w in caught if issubclass(w.category, CtpuFallbackWarning)]


def test_one_unsupported_op_costs_only_itself() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 8)).eval()

    def f(x: torch.Tensor) -> torch.Tensor:
        return model[1](torch.floor(model[0](x)))

    x = torch.randn(4, 16)
    out, warns = _compile(f, x)
    with torch.no_grad():
        torch.testing.assert_close(out, f(x), rtol=1e-5, atol=1e-5)
    s = ctpu_stats.last()
    assert s.kernels_launched == 2, s.as_dict()  # one program on each side of the floor
    assert dict(s.fallback_ops) == {"aten.floor.default": 1}
    assert len(warns) == 1
    assert "aten.floor.default" in str(warns[0].message) and "no CTPU lowering" in str(warns[0].message)


def test_two_unsupported_kinds_give_one_warning() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.floor(x * 2.0) + torch.ceil(x)

    x = torch.randn(4, 8)
    out, warns = _compile(f, x)
    torch.testing.assert_close(out, f(x))
    assert len(warns) == 1
    text = str(warns[0].message)
    assert all(op in text for op in ("floor", "ceil")), text
    assert ctpu_stats.last().kernels_launched >= 1


def test_a_late_refusal_is_found_and_costs_only_its_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """A node codegen accepts alone but whose graph fails to compile (here: a refusal injected for tanh)
    is located by bisection; only it goes to the CPU."""
    real = codegen.compile_graph

    def refuse_tanh(gm, *args, **kwargs):
        if any(n.target is torch.ops.aten.tanh.default for n in gm.graph.nodes):
            raise codegen.UnsupportedError("tanh refused for the test")
        return real(gm, *args, **kwargs)

    monkeypatch.setattr(codegen, "compile_graph", refuse_tanh)

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.exp(torch.tanh(x * 3.0) + 1.0) * 2.0

    x = torch.randn(4, 8)
    out, warns = _compile(f, x)
    torch.testing.assert_close(out, f(x), rtol=1e-5, atol=1e-6)
    s = ctpu_stats.last()
    assert dict(s.fallback_ops) == {"aten.tanh.default": 1} and s.kernels_launched == 2
    assert len(warns) == 1 and "tanh refused for the test" in str(warns[0].message)


def test_every_op_the_partitioner_places_on_the_ctpu_lowers() -> None:
    """The partitioner asks codegen: a node it places on the CTPU compiles, one it refuses names why."""
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    cases = [
        (lambda x: torch.floor(x), False), (lambda x: torch.exp(x) + 1.0, True),
        (lambda x: torch.softmax(x, -1), True), (lambda x: x.sum(0), True), (lambda x: x.sum(-1), True),
        (lambda x: torch.cumsum(x, -1), True), (lambda x: torch.sort(x, -1).values, False),
        (lambda x: torch.nn.functional.layer_norm(x, (8,)), True), (lambda x: torch.sign(x), True),
        (lambda x: torch.where(x > 0, x, 0.0), True), (lambda x: x.amax(-1), True),
    ]
    x = torch.randn(4, 8)
    for fn, expected in cases:
        gm = make_fx(fn, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(x)
        gm, report = fx_passes.run_passes(gm, [x], fuse=False, unsupported_reason=codegen.unsupported_reason)
        placed = not report.partition.fallback
        assert placed == expected, (fn, report.summary())
        if placed:
            codegen.compile_graph(gm, [x])  # must not raise
        else:
            assert all(n.meta["ctpu_fallback_reason"] for n in report.partition.fallback)


def test_graph_compiler_asks_the_target_and_never_its_name() -> None:
    """A made-up target that refuses every mul: GraphCompiler places and launches by asking it alone."""
    from torch_tpu_backend.ctpu_target import CtpuTarget
    from torch_tpu_backend.options import CompileOptions

    class NoMul(CtpuTarget):
        def unsupported_reason(self, node: torch.fx.Node) -> str | None:
            return "no muls here" if node.target is torch.ops.aten.mul.Tensor else super().unsupported_reason(node)

    opts = CompileOptions(cache=False)
    compiler = GraphCompiler(opts, NoMul(opts))

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.exp(x) * y + 1.0

    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm = make_fx(f, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(x, y)
    ctpu_stats.reset()
    with pytest.warns(CtpuFallbackWarning, match="no muls here"):
        run = compiler(gm, [x, y])
    out = run([x, y])  # the boxed calling convention: one list of arguments
    torch.testing.assert_close(out, f(x, y))
    assert dict(ctpu_stats.last().fallback_ops) == {"aten.mul.Tensor": 1}
    assert ctpu_stats.last().kernels_launched == 2


def test_int64_values_beyond_int32_run_that_call_on_the_cpu() -> None:
    """The program reads int64 inputs as int32: a call whose values do not fit runs its graph on the CPU
    (eager's answer, one warning for the graph, counted), where it used to raise out of the model (Mixtral's
    router); calls whose values fit still run on the CTPU."""
    def f(x: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        return x * 2.0 + i.float()

    torch._dynamo.reset()
    compiled = torch.compile(f, backend="ctpu", options={"cache": False})
    x, big = torch.randn(3, 4), torch.tensor([1 << 40, -(1 << 35), 7, 0])
    calls = [(torch.arange(4), True, 0), (big, False, 1), (big, False, 0), (torch.arange(4) - 9, True, 0)]
    for i, on_ctpu, warned in calls:
        ctpu_stats.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = compiled(x, i)
        torch.testing.assert_close(out, f(x, i))
        s = ctpu_stats.last()
        assert s.kernels_launched == int(on_ctpu) and bool(s.fallback_ops) != on_ctpu, s.as_dict()
        assert len([w for w in caught if "do not fit int32" in str(w.message)]) == warned


def test_a_program_too_large_for_imem_is_split_not_sent_to_the_cpu() -> None:
    """A segment whose program does not fit imem runs as several programs (cut near the middle until each
    fits), one after the other: no op goes to the CPU for it (the backward graph of the tiny Llama is such
    a segment on `small`)."""
    from codegen.errors import ProgramTooLargeError
    from torch_tpu_backend.ctpu_target import CtpuTarget
    from torch_tpu_backend.options import CompileOptions

    class SmallImem(CtpuTarget):
        def compile(self, gm, example_inputs, name, dump):  # type: ignore[no-untyped-def]
            ops = [n for n in gm.graph.nodes if n.op == "call_function"]
            if len(ops) > 3:
                raise ProgramTooLargeError(f"{len(ops)} ops do not fit the test's imem")
            return super().compile(gm, example_inputs, name, dump)

    opts = CompileOptions(cache=False)

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a = torch.exp(x) * y + 1.0
        b = torch.tanh(a) - x
        return (b * b + a).sum(0) / 3.0

    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    x, y = torch.randn(4, 8), torch.randn(4, 8)
    gm = make_fx(f, decomposition_table=core_aten_decompositions(), tracing_mode="fake")(x, y)
    ctpu_stats.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CtpuFallbackWarning)
        run = GraphCompiler(opts, SmallImem(opts))(gm, [x, y])
    out = run([x, y])
    torch.testing.assert_close(out, f(x, y), rtol=1e-5, atol=1e-6)
    stats = ctpu_stats.last()
    assert not stats.fallback_ops and stats.kernels_launched >= 3, stats.as_dict()


def test_a_copy_within_a_buffer_is_no_fill(caplog: pytest.LogCaptureFixture) -> None:
    """A circular pad copies part of its output buffer into another part of it; kernel_graph's fill
    tracking followed that copy back to the same buffer forever (RecursionError, an "internal compiler
    error" in the OpInfo compile sweep). Every sample of OpInfo's circular pad: eager's values, no error."""
    from torch.testing._internal.common_methods_invocations import op_db

    op = next(o for o in op_db if o.name == "nn.functional.pad" and o.variant_test_name == "circular")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its copies run on the CPU, with the warning
        for sample in op.sample_inputs("cpu", torch.float32):
            torch._dynamo.reset()
            fn = torch.compile(lambda x, s=sample: op(x, *s.args, **s.kwargs), backend="ctpu", dynamic=False,
                               options={"cache": False})
            torch.testing.assert_close(fn(sample.input), op(sample.input, *sample.args, **sample.kwargs))
    assert "internal compiler error" not in caplog.text
