"""FX -> MLIR emitter and the upstream pass pipeline: golden checks on the IR text."""

from __future__ import annotations

import torch
from codegen_helpers import trace

from codegen.fx_to_mlir import emit_module
from codegen.kernels import GenericKernel, MatmulKernel, read_function
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
