"""One edge-case parity set for the ctpu fused ops, over every back end that claims each op.

The meaning of an op is its reference in fx_passes/ops.py (also its core-ATen decomposition). Each back
end that claims the op must give the reference's values on the edge cases: fully masked attention rows
(0 for SDPA's safe softmax, NaN for a plain softmax, as eager gives), -inf scores, a row with one finite
score, NaN and +inf inputs propagating as in eager, the largest finite values, bf16, and empty dims.

Back ends: "ctpu" (codegen's lowering, run on the simulator, `small`), "ctpu-decomposed" (the op's
core-ATen decomposition lowered node by node: the path of an unfused graph), "ptx" (the kernel is built
and assembled by ptxas here; its values are checked on a Hopper GPU, skipped without one).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch

import ptx_kernels
from codegen import compile_graph
from codegen.fx_ops import CTPU_TABLE
from device_sim.executable import run_fresh
from device_sim.runners import SimulatorRunner
from fx_passes.ops import OP_NAMES, ctpu_op, decomposition

F32, BF16 = torch.float32, torch.bfloat16
INF, NAN, BIG = math.inf, math.nan, torch.finfo(F32).max
TOL = {F32: dict(rtol=2e-5, atol=2e-6), BF16: dict(rtol=2e-2, atol=2e-2)}
HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@dataclass(frozen=True)
class Case:
    op: str
    name: str
    make: Callable[[], tuple]  # the op's arguments, in schema order
    ctpu_differs: str = ""  # a known, named difference of the CTPU lowering (a strict xfail)

    @property
    def id(self) -> str:
        return f"{self.op}-{self.name}"


def _r(*shape: int, dtype: torch.dtype = F32, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _qkv(length: int = 5, keys: int = 6, dtype: torch.dtype = F32, heads: int = 4, kv: int = 2) -> tuple:
    return _r(1, heads, length, 16, dtype=dtype), _r(1, kv, keys, 16, dtype=dtype, seed=1), \
        _r(1, kv, keys, 16, dtype=dtype, seed=2)


def _padded_keep(length: int = 5, keys: int = 6, pad: int = 2) -> torch.Tensor:
    """[1, 1, L, S] causal keep-mask (bottom-right) of a left-padded row: the first `pad` keys are padding,
    so the first queries see no key at all."""
    keep = torch.ones(length, keys, dtype=torch.bool).tril(keys - length)
    keep[:, :pad] = False
    keep[: pad - (keys - length), :] = False
    return keep[None, None]


def _attention_cases() -> list[Case]:
    def masked(dtype: torch.dtype, safe: bool, additive: bool) -> Callable[[], tuple]:
        def make() -> tuple:
            keep = _padded_keep()
            mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, -INF) if additive else keep
            return (*_qkv(dtype=dtype), mask, False, 0.35, safe)
        return make

    def one_finite() -> tuple:
        keep = torch.zeros(1, 1, 5, 6, dtype=torch.bool)
        keep[..., 3] = True  # every row keeps one key
        return (*_qkv(), keep, False, 0.35, True)

    def minus_inf_q() -> tuple:  # no mask, yet every score of row 2 of head 1 is -inf
        q, k, v = _qkv()
        q[0, 1, 2] = torch.tensor([-INF] + [0.0] * 15)
        k[0, 0, :, 0] = 1.0
        return q, k, v, None, False, 0.35, True

    def nan_key(additive: bool) -> Callable[[], tuple]:
        def make() -> tuple:  # a NaN key: rows that keep it are NaN; a keep-mask drops it, -inf + NaN does not
            q, k, v = _qkv()
            k[0, 0, 1, 3] = NAN
            keep = _padded_keep(pad=2)
            mask = torch.zeros(keep.shape).masked_fill(~keep, -INF) if additive else keep
            return q, k, v, mask, False, 0.35, True
        return make

    def plus_inf_score() -> tuple:  # +inf - +inf in the softmax: NaN, as eager
        q, k, v = _qkv()
        q[0, 0, 4, 0], k[0, 0, 2, 0] = 1.0, INF
        return q, k, v, None, True, 0.35, True

    def padded_keys(causal: bool, mask: bool) -> Callable[[], tuple]:
        def make() -> tuple:  # keys past kv_len hold NaN and inf (a bucket's padding): never read
            q, k, v = _qkv(6, 6)
            k[:, :, 4:], v[:, :, 4], v[:, :, 5] = NAN, INF, NAN
            keep = _padded_keep(6, 6, pad=1) if mask else None
            return q, k, v, keep, causal, 0.35, True, torch.tensor(4)
        return make

    def nan_q() -> tuple:
        q, k, v = _qkv()
        q[0, 3, 1, 13] = NAN
        return q, k, v, _padded_keep(), False, 0.35, True

    return [
        Case("attention", "fully-masked-keep-mask-safe", masked(F32, True, False)),
        Case("attention", "fully-masked-keep-mask-plain", masked(F32, False, False)),
        Case("attention", "fully-masked-minus-inf-safe", masked(F32, True, True)),
        Case("attention", "fully-masked-minus-inf-plain", masked(F32, False, True)),
        Case("attention", "fully-masked-bf16-safe", masked(BF16, True, False)),
        Case("attention", "fully-masked-bf16-additive", masked(BF16, True, True)),
        Case("attention", "causal-more-queries-than-keys", lambda: (*_qkv(7, 4), None, True, 0.35, True)),
        Case("attention", "causal-more-queries-than-keys-plain", lambda: (*_qkv(7, 4), None, True, 0.35, False)),
        Case("attention", "one-finite-score", one_finite),
        Case("attention", "minus-inf-q-no-mask", minus_inf_q),
        Case("attention", "nan-key-keep-mask", nan_key(False)),
        Case("attention", "nan-key-additive", nan_key(True)),
        Case("attention", "nan-query", nan_q),
        Case("attention", "padded-keys", padded_keys(False, False)),
        Case("attention", "padded-keys-causal-keep-mask", padded_keys(True, True)),
        Case("attention", "plus-inf-score", plus_inf_score),
        Case("attention", "bf16-causal-gqa", lambda: (*_qkv(6, 6, BF16), None, True, 0.35, True)),
        Case("attention", "no-queries", lambda: (*_qkv(0, 6), None, False, 0.35, True), EMPTY),
        Case("attention", "no-keys", lambda: (*_qkv(5, 0), None, False, 0.35, True), EMPTY),
    ]


def _rows(*rows: list[float], dtype: torch.dtype = F32) -> torch.Tensor:
    return torch.tensor(rows, dtype=F32).to(dtype)


SPECIAL_ROWS = (
    [-INF, -INF, -INF, -INF],  # softmax: NaN (0/0), as torch.softmax
    [-INF, 1.5, -INF, -INF],  # one finite score
    [NAN, 0.0, 1.0, 2.0],
    [INF, 0.0, 1.0, 2.0],
    [BIG, -BIG, BIG, 0.0],
    [0.0, -0.0, 1e-45, -1e-40],  # zeros and subnormals
)


# Known differences of the CTPU lowering from the reference, each a strict xfail (it fails loudly once fixed).
EMPTY = "codegen cannot lay out a size-0 dim (LoweringError at compile time, so the node runs on the CPU)"
OVERFLOW_SAFE = ("a row of +-3.4e38: the lowering's overflow-safe sum of squares (issue 16) gives the true "
                 "norm; the reference (eager) overflows to inf and gives 0 / NaN")
# eager's own answer depends on the CPU: MKL's AVX-512 sgemm gives the true -inf where a row of +-3.4e38
# meets weights of both signs (a column's products overflow to +inf and -inf), the MXU and AVX2 eager NaN
AVX512_OVERFLOW = "eager on an AVX-512 CPU sums overflowing products of both signs to -inf, the MXU to NaN"
BF16_ACTIVATION = ("bf16: the reference rounds gelu_tanh(-9e-41) to bf16 -0 before the product with -inf "
                   "(NaN); the lowering multiplies in fp32 (inf)")


def _rowwise_cases() -> list[Case]:
    x = lambda dtype=F32: _rows(*SPECIAL_ROWS, dtype=dtype)
    g = lambda dtype=F32: _rows([1.0, -2.0, 0.5, 3.0], dtype=dtype)[0]
    return [
        Case("softmax", "specials", lambda: (x(), -1)),
        Case("softmax", "specials-bf16", lambda: (x(BF16), -1)),
        Case("softmax", "empty-rows", lambda: (torch.empty(0, 4), -1)),
        Case("rms_norm", "specials", lambda: (x(), g(), 1e-6), OVERFLOW_SAFE),
        Case("rms_norm", "specials-bf16", lambda: (x(BF16), g(BF16), 1e-6)),
        Case("layer_norm", "specials", lambda: (x(), g(), g() * 0.5, 1e-5), OVERFLOW_SAFE),
        Case("swiglu", "specials", lambda: (x(), x().flip(0), "silu")),
        Case("swiglu", "specials-bf16", lambda: (x(BF16), x(BF16).flip(0), "gelu_tanh"), BF16_ACTIVATION),
        Case("rope", "specials", lambda: (x()[None, None], _r(1, 1, 6, 4), _r(1, 1, 6, 4, seed=3))),
        Case("linear", "specials", lambda: (x(), _r(4, 3), _r(3), "relu", _r(6, 3, seed=4)), AVX512_OVERFLOW),
        Case("linear", "empty-k", lambda: (torch.empty(3, 0), torch.empty(0, 4), _r(4), "none", None)),
    ]


CASES = _attention_cases() + _rowwise_cases()


def _ctpu_params() -> list:
    avx512 = torch.backends.cpu.get_cpu_capability() == "AVX512"
    return [pytest.param(c, id=c.id, marks=[pytest.mark.xfail(strict=True, reason=c.ctpu_differs)]
                         if c.ctpu_differs and (c.ctpu_differs != AVX512_OVERFLOW or avx512) else [])
            for c in CASES]


def _tensor_args(args: tuple) -> list[torch.Tensor]:
    return [a for a in args if isinstance(a, torch.Tensor)]


def _fused_graph(op: str, args: tuple) -> torch.fx.GraphModule:
    """A graph holding one ctpu::op node (tensor arguments as placeholders), built by hand: tracing the
    custom op with make_fx, case after case, left torch's custom-op dispatch corrupted, and a later
    torch.compile in the same process segfaulted inside it (torch 2.13; tests/codegen/test_parity.py or
    tests/torch_tpu_backend/test_compile.py run after this file crashed)."""
    index = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
    graph = torch.fx.Graph()
    values = [graph.placeholder(f"x{i}") for i in index]
    full: list = list(args)
    for i, v in zip(index, values, strict=True):
        full[i] = v
    for v, t in zip(values, _tensor_args(args), strict=True):
        v.meta["val"] = t
    node = graph.call_function(ctpu_op(op), tuple(full))
    node.meta["val"] = ctpu_op(op)(*args)
    graph.output(node)
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _run_ctpu(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> torch.Tensor:
    exe = compile_graph(gm, inputs, "small", matmul_precision="highest")
    (out,), _ = run_fresh(exe, [x.float().numpy() if x.is_floating_point() else x.numpy() for x in inputs],
                          SimulatorRunner("small"))
    return torch.from_numpy(np.asarray(out, dtype=np.float32))


def _assert_parity(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Values within the dtype's tolerance; NaN exactly where the reference is NaN, infinities equal."""
    expected_f = expected.float()
    assert actual.shape == expected_f.shape
    torch.testing.assert_close(actual, expected_f, equal_nan=True, **TOL[expected.dtype])


def test_every_claimed_op_has_edge_cases() -> None:
    """A back end's claims are ops of fx_passes/ops.py, and each claimed op has cases here."""
    with_cases = {c.op for c in CASES}
    for backend, claimed in (("ctpu", set(CTPU_TABLE)), ("ptx", set(ptx_kernels.supported_ops()) & set(OP_NAMES))):
        assert claimed <= set(OP_NAMES), backend
        assert claimed <= with_cases, f"{backend} claims {sorted(claimed - with_cases)} without edge cases"


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_reference_equals_its_decomposition(case: Case) -> None:
    args = case.make()
    expected = ctpu_op(case.op)(*args)
    actual = decomposition(case.op, *args)(*_tensor_args(args))
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, equal_nan=True)  # the same ATen ops


@pytest.mark.parametrize("case", _ctpu_params())
def test_ctpu(case: Case) -> None:
    args = case.make()
    expected = ctpu_op(case.op)(*args)
    _assert_parity(_run_ctpu(_fused_graph(case.op, args), _tensor_args(args)), expected)


DECOMPOSED = [c for c in CASES if c.op in ("attention", "softmax") and c.ctpu_differs != EMPTY]


@pytest.mark.parametrize("case", DECOMPOSED, ids=lambda c: c.id)
def test_ctpu_decomposed(case: Case) -> None:
    """The op's core-ATen decomposition lowered node by node (an unfused graph's path) gives the same."""
    args = case.make()
    expected = ctpu_op(case.op)(*args)
    _assert_parity(_run_ctpu(decomposition(case.op, *args), _tensor_args(args)), expected)


def _ptx_kernel(case: Case) -> tuple[ptx_kernels.PtxKernel, list[torch.Tensor]]:
    """The PTX kernel for the case as ptx_target builds it: tensor shapes and dtypes in schema order (None
    for an absent optional tensor), the other arguments by schema name."""
    args = case.make()
    schema = ctpu_op(case.op)._schema
    shapes: list = []
    dtypes: list = []
    attrs: dict = {}
    for argument, value in zip(schema.arguments, args, strict=True):
        if isinstance(value, torch.Tensor) or (value is None and "Tensor" in str(argument.type)):
            shapes.append(None if value is None else tuple(value.shape))
            dtypes.append(None if value is None else value.dtype)
        else:
            attrs[argument.name] = value
    return ptx_kernels.kernel_for(f"ctpu::{case.op}", shapes, dtypes, attrs), _tensor_args(args)


PTX_CASES = [c for c in CASES if c.op in ptx_kernels.supported_ops()]


@pytest.mark.parametrize("case", PTX_CASES, ids=lambda c: c.id)
def test_ptx_assembles(case: Case) -> None:
    try:
        kernel, _ = _ptx_kernel(case)
    except (NotImplementedError, ValueError) as err:  # a refusal is loud: the node stays on the CPU
        pytest.skip(f"the PTX back end refuses this case: {err}")
    report = ptx_kernels.assemble(kernel)
    assert report.spill_stores == 0 and report.spill_loads == 0, report


@pytest.mark.gpu
@pytest.mark.skipif(not HOPPER, reason="needs an NVIDIA Hopper GPU (sm_90); test_ptx_assembles checks the PTX")
@pytest.mark.parametrize("case", PTX_CASES, ids=lambda c: c.id)
def test_ptx(case: Case) -> None:
    try:
        kernel, inputs = _ptx_kernel(case)
    except (NotImplementedError, ValueError) as err:
        pytest.skip(f"the PTX back end refuses this case: {err}")
    expected = ctpu_op(case.op)(*case.make())
    (out,) = ptx_kernels.run(kernel, *[x.cuda() for x in inputs])
    _assert_parity(out.float().cpu(), expected)
