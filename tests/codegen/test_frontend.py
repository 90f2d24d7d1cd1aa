"""FX -> MLIR emitter and the upstream pass pipeline: golden checks on the IR text."""

from __future__ import annotations

import torch
from codegen_helpers import trace

from codegen.fx_ops import emit_module
from codegen.kernel_graph import GatherKernel, GenericKernel, IotaKernel, MatmulKernel, read_function
from codegen.mlir_pipeline import run_pipeline


def _stages(fn, *xs):
    text, _, _ = emit_module(trace(fn, *xs), list(xs))
    return text, run_pipeline(text)


def test_emitter_writes_linalg_for_each_op() -> None:
    text, _ = _stages(lambda x, w, b: torch.relu(x @ w + b).sum(-1), torch.randn(4, 8), torch.randn(8, 3),
                      torch.randn(3))
    assert "linalg.matmul" in text
    assert text.count("linalg.generic") == 3  # add, relu, sum
    assert '"reduction"' in text
    assert "affine_map<(d0, d1) -> (d1)>" in text  # the bias broadcast is an indexing map


def test_fusion_pass_really_fuses_elementwise_chains() -> None:
    _, res = _stages(lambda x, y: torch.exp(x * y + 1.0) - y, torch.randn(4, 8), torch.randn(4, 8))
    before = dict(res.stages)["input"]
    after = dict(res.stages)["linalg-fuse-elementwise-ops"]
    assert before.count("linalg.generic") == 4
    assert after.count("linalg.generic") == 1
    assert "math.exp" in after


def test_permute_becomes_an_indexing_map_of_its_consumer() -> None:
    _, res = _stages(lambda x: x.transpose(0, 1) * 2.0, torch.randn(4, 8))
    after = dict(res.stages)["linalg-fuse-elementwise-ops"]
    assert after.count("linalg.generic") == 1
    assert "(d1, d0)" in after


def test_bufferization_gives_kernels_over_hbm_views() -> None:
    _, res = _stages(lambda x, w: (x @ w) + 1.0, torch.randn(5, 12), torch.randn(12, 7))
    final = res.stages[-1][1]
    assert "memref.alloc" in final and "tensor<" not in final
    with res.context:
        g = read_function(res.module)
    kinds = [type(k).__name__ for k in g.kernels]
    assert kinds.count("MatmulKernel") == 1
    mm = next(k for k in g.kernels if isinstance(k, MatmulKernel))
    assert mm.a.shape == (5, 12) and mm.b.strides == (7, 1)
    assert any(isinstance(k, GenericKernel) for k in g.kernels)


def _kernels(fn, *xs):
    _, res = _stages(fn, *xs)
    with res.context:
        return res, read_function(res.module)


def test_every_fused_op_has_a_lowering() -> None:
    from codegen.fx_ops import CTPU_TABLE
    from fx_passes.ops import OP_NAMES

    assert set(OP_NAMES) <= set(CTPU_TABLE)


def test_reshaped_matmul_becomes_a_contraction_generic_and_back_a_matmul_kernel() -> None:
    import fx_passes.ops  # noqa: F401  (registers torch.ops.ctpu)

    def f(x, w):  # the attention output [B, H, L, D] -> [B, L, H*D] @ w: an o_proj
        return torch.ops.ctpu.linear(x.permute(0, 2, 1, 3).reshape(1, 8, 64), w, None, "none", None)

    res, g = _kernels(f, torch.randn(1, 4, 8, 16), torch.randn(64, 32))
    fused = dict(res.stages)["linalg-fuse-elementwise-ops"]
    assert "linalg.matmul" not in fused and '"reduction", "reduction"' in fused  # reshape propagation did it
    kinds = [type(k).__name__ for k in g.kernels]
    assert kinds.count("MatmulKernel") == 1
    assert not any(isinstance(k, GenericKernel) and k.reduction for k in g.kernels)


def test_a_bf16_factor_of_a_contraction_stays_bf16() -> None:
    """A bf16 Llama's down_proj: the SwiGLU (fused into the contraction, computed by its own kernel) rounds
    to bf16, so its temporary is bf16 and the matmul takes one bf16 MXU pass; as an f32 temporary it took
    the fp32 path (6 passes at "highest") for bf16-exact values: 6x the MXU work of a decode step's MLP."""
    import fx_passes.ops  # noqa: F401  (registers torch.ops.ctpu)

    def f(gate, up, w):
        return torch.ops.ctpu.linear(torch.ops.ctpu.swiglu(gate, up, "silu"), w.permute(1, 0), None, "none", None)

    bf = torch.bfloat16
    _, g = _kernels(f, torch.randn(1, 3, 64, dtype=bf), torch.randn(1, 3, 64, dtype=bf), torch.randn(32, 64, dtype=bf))
    (mm,) = [k for k in g.kernels if isinstance(k, MatmulKernel)]
    factors = [k for k in g.kernels if isinstance(k, GenericKernel) and k.output.view.buffer == mm.a.buffer]
    assert len(factors) == 1 and mm.a.dtype == "bf16" and mm.b.dtype == "bf16"


def test_embedding_is_a_gather_kernel_feeding_its_consumer() -> None:
    res, g = _kernels(lambda w, ids: torch.nn.functional.embedding(ids, w) * 2.0, torch.randn(10, 12),
                      torch.tensor([[3, 1, 7]]))
    final = res.stages[-1][1]
    assert "memref.load" in final and "arith.index_cast" in final  # the lookup was fused into the multiply
    gathers = [k for k in g.kernels if isinstance(k, GatherKernel)]
    assert len(gathers) == 1 and gathers[0].output.shape == (1, 3, 12) and gathers[0].ids.view.dtype == "i32"
    consumer = g.kernels[-1]
    assert isinstance(consumer, GenericKernel)
    assert [o.view.buffer for o in consumer.inputs] == [gathers[0].output.buffer]


def test_linalg_index_becomes_an_iota_operand() -> None:
    res, g = _kernels(lambda x: torch.where(torch.ones(4, 8, dtype=torch.bool).tril(), x, 0.0), torch.randn(4, 8))
    assert "linalg.index" in res.stages[-1][1]
    iotas = [k for k in g.kernels if isinstance(k, IotaKernel)]
    assert sorted(k.output.shape for k in iotas) == [(4,), (8,)]
    generic = g.kernels[-1]
    assert isinstance(generic, GenericKernel)
    assert "arith.cmpi.sle" in [op for _, op, _ in generic.body.ops]
    strides = sorted(o.iter_strides for o in generic.inputs if o.view.dtype == "i32")
    assert strides == [(0, 1), (1, 0)]


def test_cat_is_insert_slice_then_copies_into_subviews() -> None:
    text, res = _stages(lambda x: torch.cat([x, x * 2.0], -1), torch.randn(4, 8))
    assert text.count("tensor.insert_slice") == 2
    final = res.stages[-1][1]
    assert "memref.subview" in final and "memref.copy" in final


def test_kernels_name_the_fx_node_and_module_they_came_from() -> None:
    """Each op carries loc("node"("module")); a fused generic keeps its consumer's, a gather split out of a
    generic its generic's, and ops the emitter did not write have no origin."""
    from codegen_helpers import capture

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(16, 8)
            self.proj = torch.nn.Linear(8, 8, bias=False)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return torch.exp(self.proj(self.emb(ids)) * 2.0)

    gm, args = capture(Block(), torch.tensor([[1, 3, 5]]))
    text, _, _ = emit_module(gm, args)
    assert 'loc("' in text and '("emb"))' in text and '("proj"))' in text
    res = run_pipeline(text)
    with res.context:
        g = read_function(res.module)
    origins = [(type(k).__name__, k.origin) for k in g.kernels]
    nodes = {n.name: n for n in gm.graph.nodes}
    assert all(node in nodes for _, (node, _) in origins)  # every kernel names a node of the graph
    # the lookup fused into the projection's contraction generic: the gather split out of it is the mm's too,
    # and what remains is a matmul of the gathered rows
    assert origins[-3:] == [("GatherKernel", ("mm", "proj")), ("MatmulKernel", ("mm", "proj")),
                            ("GenericKernel", ("exp", ""))]  # exp(.. * 2): one generic, named after its consumer
    assert nodes["mm"].target == torch.ops.aten.mm.default and nodes["exp"].target == torch.ops.aten.exp.default
