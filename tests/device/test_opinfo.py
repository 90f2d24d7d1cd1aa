"""OpInfo sweep: op_db float32 samples against the CPU, eager on ctpu tensors and through torch.compile.

Eager: each sample is made on the CPU and copied to ctpu, the op runs on both (same seed for random ops).
Compiled: the op runs under torch.compile(backend="ctpu") on the CPU sample; "dynamic": the same with
dynamic=True (symbolic sizes: fx_passes.dynamic's padded programs, or a refused graph on the CPU, a fallback;
a sample that dynamo cannot trace with aot_eager either is skipped). Gradients ("grad", "eager-grad", the
OpInfos that support autograd): the op compiled, or eager on ctpu tensors, then torch.autograd.grad of its
float outputs with a seeded random cotangent w.r.t. the sample's float inputs; outputs and gradients are
compared. The results must agree: an error where the CPU has none is a crash, any difference a mismatch. CI
runs a representative part of each (CI_OPS, COMPILE_CI_OPS, GRAD_CI_OPS, DYNAMIC_CI_OPS); the whole op_db is
marked slow.
The report (JSON, counts by outcome and why):

    .venv/bin/python tests/device/test_opinfo.py --report opinfo_report.json [--mode compile|grad|eager-grad|dynamic]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import torch_tpu_backend.device as ctpu_device
from fx_passes import CtpuFallbackWarning
from torch_tpu_backend import stats

ctpu_device.register()  # a no-op when `import torch` already loaded it

from torch.testing._internal.common_device_type import instantiate_device_type_tests, ops  # noqa: E402  # isort: skip
from torch.testing._internal.common_methods_invocations import op_db  # noqa: E402  # isort: skip
from torch.testing._internal.common_utils import TestCase  # noqa: E402  # isort: skip

# Uninitialised memory: nothing to compare.
SKIP = {
    "empty": "returns uninitialised memory", "empty_like": "returns uninitialised memory",
    "new_empty": "returns uninitialised memory", "new_empty_strided": "returns uninitialised memory",
    "empty_strided": "returns uninitialised memory", "empty_permuted": "returns uninitialised memory",
    "resize_": "grows into uninitialised memory", "resize_as_": "grows into uninitialised memory",
    "tensor_split": "its index tensor must stay on the CPU; this harness moves the whole sample",
    "to_sparse": "sparse tensors are not supported on ctpu",
}
SKIP_PREFIX = {"sparse.": "sparse tensors are not supported on ctpu"}
# On a PrivateUse1 device PyTorch runs scaled_dot_product_attention as its math composite (softmax of the
# full score matrix), the CPU as a fused flash kernel: a different algorithm, compared at this tolerance.
LOOSE = {"nn.functional.scaled_dot_product_attention"}
# Matmuls that run on the matrix unit: "highest" precision (6 bf16 passes) is fp32-accurate per product,
# but sums k-ascending in 8-wide tiles, an order other than the CPU's blocked one; the difference is a few
# ulp of sum_k |x_k w_k| (numerics contract), so an absolute term is needed near cancellations. Where that
# is not enough (ill-conditioned samples: attention over scores of ~1e5, where an ulp of a score moves the
# softmax), the result passes if it is as close to float64 as the CPU's (_as_accurate_as_cpu).
MXU = {"matmul", "__rmatmul__", "mm", "bmm", "addmm", "linear", "einsum", "nn.functional.linear",
       "nn.functional.multi_head_attention_forward", "nn.functional.bilinear", "inner", "matrix_exp", "cov"}
# cov is an mm of the centred rows over w_sum - correction sum(w aweights) / w_sum, which cancels: in OpInfo's
# sample with aweights and correction 2 it keeps 2 of 7 digits, so sums in another order (1 ulp apart) move
# the result by 1.4e-5 relative; the ctpu's is the closer to float64 there (1.9e-2 against the CPU's 4.1e-2).
# pow with a non-integer or large exponent is exp(y log|x|) (fx_ops._pow_general): y log|x|'s absolute error,
# ~|y log x| 2^-24, becomes the result's relative error; OpInfo's samples reach |y log x| ~ 20 (9 ** 9).
POW = {"pow", "__rpow__"}
# A representative part for CI: elementwise, reductions, matmuls, views and indexing, normalisation,
# shape ops, sorting, random ops, in-place and out= heavy paths.
CI_OPS = {
    "add", "sub", "mul", "div", "pow", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "abs", "neg", "clamp",
    "where", "maximum", "lerp", "addcmul", "sum", "mean", "amax", "argmax", "var", "std", "cumsum", "prod",
    "matmul", "mm", "bmm", "addmm", "linear", "einsum", "view", "reshape", "transpose", "permute", "narrow",
    "select", "unfold", "diagonal", "as_strided", "expand", "squeeze", "unsqueeze", "flatten", "index_select",
    "gather", "scatter", "index_put", "masked_fill", "masked_select", "nonzero", "cat", "stack", "split", "chunk",
    "flip", "roll", "sort", "topk", "softmax", "nn.functional.layer_norm", "nn.functional.gelu",
    "nn.functional.silu", "nn.functional.embedding", "nn.functional.conv2d", "nn.functional.dropout",
    "nn.functional.cross_entropy", "tril", "full_like", "zeros_like", "ones_like", "rand_like", "randn_like",
    "clone", "contiguous", "item", "tolist", "to", "copysign", "nan_to_num", "fmod", "remainder", "floor_divide",
}
# The compiled sweep in CI: a smaller part (each sample is a separate compile), the first samples of each.
COMPILE_CI_OPS = {
    "add", "sub", "mul", "div", "exp", "tanh", "sigmoid", "abs", "neg", "maximum", "where", "sum", "mean",
    "amax", "matmul", "mm", "bmm", "addmm", "linear", "transpose", "permute", "reshape", "cat", "cumsum",
    "softmax", "nn.functional.layer_norm", "nn.functional.silu", "nn.functional.gelu",
}
COMPILE_CI_SAMPLES = 2
# Random ops draw from torch.compile's own generator stream: not comparable sample by sample.
COMPILE_SKIP_PREFIX = ("rand", "normal", "bernoulli", "multinomial", "nn.functional.dropout", "uniform",
                       "exponential", "geometric", "cauchy", "log_normal", "randn", "randint")
# The gradient sweeps in CI (compiled, a forward and a backward graph per sample; eager): elementwise,
# reductions, matmuls, normalisation, activations, indexing and scatter, shape ops, scans, selection.
GRAD_CI_OPS = {
    "add", "mul", "div", "exp", "tanh", "sigmoid", "pow", "sum", "mean", "amax", "var", "prod", "matmul",
    "addmm", "nn.functional.linear", "softmax", "log_softmax", "nn.functional.layer_norm", "nn.functional.gelu",
    "nn.functional.silu", "nn.functional.embedding", "gather", "index_select", "scatter_add", "cat", "transpose",
    "reshape", "expand", "cumsum", "where", "clamp", "nn.functional.cross_entropy", "abs", "sign", "amin",
    "nn.functional.softmin",
}
GRAD_CI_SAMPLES = 1
# The compiled sweep with symbolic sizes (dynamic=True, each dim of the sample padded to its bucket) in CI:
# elementwise, masked reductions, contractions over a padded dim, views and slices (outputs aliasing the
# input), cat and indexing, a prefix scan, normalisation, and topk (routing's rank-based rule, masked; sort
# is the same rule at ~60 s of compiles: the full sweep has it).
DYNAMIC_CI_OPS = {
    "add", "mul", "div", "exp", "tanh", "sigmoid", "neg", "maximum", "where", "sum", "mean", "amax", "var",
    "softmax", "log_softmax", "matmul", "mm", "bmm", "addmm", "nn.functional.linear", "view", "reshape",
    "permute", "transpose", "cat", "narrow", "slice", "select", "index_select", "gather", "__getitem__",
    "cumsum", "nn.functional.layer_norm", "nn.functional.embedding", "expand", "hsplit",
}
DYNAMIC_CI_SAMPLES = 2
GRAD_MODES = ("grad", "eager-grad")
COMPILED_MODES = ("compile", "grad", "dynamic", "integer")  # the op under torch.compile on the CPU sample
# "integer": the int64 samples compiled, compared exactly (integer arithmetic on the CTPU must be exact)
INTEGER_CI_OPS = {
    "add", "sub", "mul", "neg", "abs", "eq", "ne", "lt", "ge", "maximum", "minimum", "clamp", "where", "sum",
    "cumsum", "masked_fill", "bitwise_and", "bitwise_or", "bitwise_xor", "bitwise_not", "mm", "cat",
    "index_select", "gather", "amax", "floor_divide",
}
STATUS_ORDER = ("native", "ctpu", "fallback", "skipped", "mismatch", "crash")


def _run(op: Any, sample: Any) -> tuple[Any, BaseException | None]:
    torch.manual_seed(0)  # seeds the CPU and the ctpu generators alike: random ops must agree too
    try:
        return op(sample.input, *sample.args, **sample.kwargs), None
    except Exception as err:  # compared below: the CPU and ctpu must agree on raising too
        return None, err


def _float_leaves(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(tree)[0] if isinstance(t, torch.Tensor) and t.is_floating_point()]


def _with_grads(sample: Any, out: Any, err: BaseException | None) -> tuple[Any, BaseException | None]:
    """`out` (as OpInfo prepares it for autograd) and the gradients of its float outputs, with a random
    cotangent of a fixed seed, w.r.t. the sample's float inputs that require grad (None where unused)."""
    if err is not None:
        return None, err
    try:
        out = sample.output_process_fn_grad(out)
        outputs = [t for t in _float_leaves(out) if t.requires_grad]
        inputs = [t for t in _float_leaves((sample.input, sample.args, sample.kwargs)) if t.requires_grad]
        if not outputs or not inputs:
            return (out, None), None
        seeded = torch.Generator().manual_seed(0)
        # drawn in float32 and cast: the float64 arbiter gets the same cotangent
        cotangents = [torch.randn(o.shape, generator=seeded).to(o.device, o.dtype) for o in outputs]
        return (out, torch.autograd.grad(outputs, inputs, cotangents, allow_unused=True)), None
    except Exception as err:
        return None, err


def _copy_sample(sample: Any, device: str, dtype: torch.dtype | None = None) -> Any:
    """The sample's tensors copied to `device` (and float32 ones to `dtype`) as fresh leaves that keep their
    requires_grad (transform runs under no_grad)."""
    def copy(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        to_dtype = dtype if dtype is not None and t.dtype == torch.float32 else t.dtype
        return t.detach().to(device, to_dtype, copy=True).requires_grad_(t.requires_grad)

    return sample.transform(copy)


def _to_device(sample: Any, device: str) -> Any:
    """The sample with its tensors, and a factory's device argument, on `device`."""
    moved = _copy_sample(sample, device)
    is_cpu = lambda v: str(v) == "cpu" and isinstance(v, str | torch.device)
    moved.args = tuple(torch.device(device) if is_cpu(a) else a for a in moved.args)
    if is_cpu(moved.kwargs.get("device")):
        moved.kwargs = {**moved.kwargs, "device": torch.device(device)}
    return moved


def _compiled(op: Any, dynamic: bool = False, backend: str = "ctpu") -> Callable[..., Any]:
    torch._dynamo.reset()  # every sample compiles afresh (no recompile limit, no stale guards)

    def call(*args: Any, **kwargs: Any) -> Any:
        return op(*args, **kwargs)

    return torch.compile(call, backend=backend, dynamic=dynamic)


def check_op(op: Any, device: str, assert_equal: Callable[[Any, Any, str], None], mode: str = "eager",
             max_samples: int | None = None) -> dict[str, Any]:
    """Run the float32 samples of `op` on the CPU and on `device` (eager) or compiled with backend="ctpu",
    with their gradients in the GRAD_MODES; the outcome and why."""
    result: dict[str, Any] = {"op": op.name, "variant": op.variant_test_name, "samples": 0, "fallback_ops": [],
                              "kernels_launched": 0, "mode": mode}
    compiled, gradients = mode in COMPILED_MODES, mode in GRAD_MODES
    if gradients:
        result.update(backward_kernels_launched=0, backward_fallback_ops=[])
    reason = SKIP.get(op.name) or next((r for p, r in SKIP_PREFIX.items() if op.name.startswith(p)), None)
    if compiled and op.name.startswith(COMPILE_SKIP_PREFIX):
        reason = "random op: torch.compile draws from its own generator stream"
    if gradients and not op.supports_autograd:
        reason = "the OpInfo does not support autograd"
    if reason:
        return {**result, "status": "skipped", "reason": reason}
    try:
        dtype = torch.int64 if mode == "integer" else torch.float32
        samples = list(op.sample_inputs("cpu", dtype, requires_grad=gradients))[:max_samples]
    except Exception as err:
        return {**result, "status": "skipped", "reason": f"sample inputs fail on the CPU: {err!r}"[:200]}
    status, reason, fallbacks, backward_fallbacks = "native", "", Counter[str](), Counter[str]()
    refusals = Counter[str]()  # graphs with symbolic sizes refused as a whole (CtpuDynamicShapeError): why
    for sample in samples:
        cpu_sample = _copy_sample(sample, "cpu")
        try:
            dev_sample = _copy_sample(sample, "cpu") if compiled else _to_device(sample, device)
        except torch.OutOfMemoryError as err:
            return {**result, "status": "skipped", "reason": f"sample does not fit in HBM: {err}"[:200]}
        expected, cpu_err = _run(op, cpu_sample)
        stats.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", CtpuFallbackWarning)
            actual, dev_err = _run(_compiled(op, mode == "dynamic") if compiled else op, dev_sample)
        refusals.update(str(w.message).split(": ", 2)[-1][:200] for w in caught
                        if "CtpuDynamicShapeError" in str(w.message))
        forward = stats.last()
        if gradients:
            expected, cpu_err = _with_grads(cpu_sample, expected, cpu_err)
            actual, dev_err = _with_grads(dev_sample, actual, dev_err)
        run = stats.last()  # forward and backward: their graphs launch separately, the counts add up
        fallbacks.update(run.fallback_ops)
        result["samples"] += 1
        result["kernels_launched"] += run.kernels_launched
        if gradients:
            backward_fallbacks.update(run.fallback_ops - forward.fallback_ops)
            result["backward_kernels_launched"] += run.kernels_launched - forward.kernels_launched
        if isinstance(dev_err, torch.OutOfMemoryError):
            return {**result, "status": "skipped", "reason": f"sample does not fit in HBM: {dev_err}"[:200]}
        if mode == "dynamic" and cpu_err is None and dev_err is not None:
            dynamo_err = _run(_compiled(op, True, "aot_eager"), _copy_sample(sample, "cpu"))[1]
            if dynamo_err is not None:  # PyTorch's own dynamic tracing fails: nothing of ctpu's ran
                return {**result, "status": "skipped",
                        "reason": f"dynamo fails with dynamic=True (aot_eager too): {dynamo_err!r}"[:200]}
        if cpu_err is not None or dev_err is not None:
            if cpu_err is None or dev_err is None:
                kind = "crash" if dev_err is not None else "mismatch"
                return {**result, "status": kind, "reason": f"cpu: {cpu_err!r} ctpu: {dev_err!r}"[:300]}
            continue  # both raise: the sample is invalid on the CPU as well
        leaves, _ = tree_flatten(actual)
        home = "cpu" if compiled else "ctpu"
        # a factory sample with no ctpu input and no device argument builds on the default device (CPU)
        sample_leaves, _ = tree_flatten((dev_sample.input, dev_sample.args, dev_sample.kwargs))
        on_device = any(isinstance(v, torch.Tensor | torch.device) and str(getattr(v, "device", v)).startswith(home)
                        for v in sample_leaves)
        off_device = [t.device for t in leaves if isinstance(t, torch.Tensor) and t.device.type != home
                      and on_device]
        if off_device:
            return {**result, "status": "mismatch", "reason": f"result on {off_device[0]}, not {home}"}
        try:
            assert_equal(tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, actual), expected,
                         op.name)
        except AssertionError as err:
            # Backward formulas run decomposed (AOT's, or composites on ctpu) where the CPU runs fused kernels:
            # other roundings. E.g. layer_norm over one element: the normalised value is exactly 0 (ctpu, and
            # the CPU's forward), but the CPU's backward kernel gives the weight -3.7e-5. Float64 arbitrates.
            if not ((op.name in MXU or gradients) and _as_accurate_as_cpu(op, sample, actual, expected, gradients)):
                return {**result, "status": "mismatch", "reason": str(err)[:300]}
        sample_status = "fallback" if run.fallback_ops else "ctpu" if run.kernels_launched else "native"
        status = max(status, sample_status, key=STATUS_ORDER.index)
    result["fallback_ops"] = sorted(fallbacks)
    if refusals:
        result["dynamic_refusals"] = sorted(refusals)
    if gradients:
        result["backward_fallback_ops"] = sorted(backward_fallbacks)
    return {**result, "status": status, "reason": reason}


def _as_accurate_as_cpu(op: Callable[..., Any], sample: Any, actual: Any, expected: Any,
                        gradients: bool = False) -> bool:
    """Is every float result (with `gradients`: outputs and gradients, as _with_grads gives them) as close to
    the float64 result as the CPU's float32 one: within twice the CPU's own error, or 1e-5 of the largest
    |value|? NaNs and everything else must match exactly."""
    s64 = _copy_sample(sample, "cpu", torch.float64)
    reference, err = _run(op, s64)
    if gradients:
        reference, err = _with_grads(s64, reference, err)
    if err is not None:
        return False
    (a_leaves, a_spec), (e_leaves, e_spec), (r_leaves, r_spec) = map(tree_flatten, (actual, expected, reference))
    if not a_spec == e_spec == r_spec:
        return False
    for a, e, r in zip(a_leaves, e_leaves, r_leaves, strict=True):
        if isinstance(a, torch.Tensor) != isinstance(e, torch.Tensor):
            return False
        if not isinstance(e, torch.Tensor) or not e.is_floating_point():
            if not (torch.equal(a.cpu(), e) if isinstance(e, torch.Tensor) else a == e):
                return False
            continue
        a, e, r = a.detach().cpu().double(), e.detach().double(), r.detach().double()
        if a.shape != e.shape or r.shape != e.shape or not torch.equal(a.isnan(), e.isnan()):
            return False
        a, e, r = (t.nan_to_num(0.0) for t in (a, e, r))
        if a.numel() and (a - r).abs().max() > max(2 * (e - r).abs().max(), 1e-5 * r.abs().max()):
            return False
    return True


def _tolerance(name: str) -> dict[str, float]:
    if name in LOOSE:
        return {"atol": 2e-4, "rtol": 1e-3}
    if name in MXU:
        return {"atol": 1e-4, "rtol": 1e-5}
    if name in POW:
        return {"atol": 1e-5, "rtol": 4 * 20 * 2**-24}
    return {}


def _assert_equal(case: TestCase, actual: Any, expected: Any, name: str) -> None:
    case.assertEqual(actual, expected, exact_dtype=True, **_tolerance(name))


class _OpInfoCheck(TestCase):
    def _check(self, device: str, op: Any, mode: str = "eager", max_samples: int | None = None) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CtpuFallbackWarning)
            outcome = check_op(op, device, lambda a, e, name: _assert_equal(self, a, e, name), mode, max_samples)
        if outcome["status"] == "skipped":
            self.skipTest(outcome["reason"])
        self.assertNotIn(outcome["status"], ("crash", "mismatch"), outcome["reason"])


class TestOpInfoCI(_OpInfoCheck):
    @ops([op for op in op_db if op.name in CI_OPS], allowed_dtypes=(torch.float32,))
    def test_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op)


@pytest.mark.slow
class TestOpInfoFull(_OpInfoCheck):
    @ops(op_db, allowed_dtypes=(torch.float32,))
    def test_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op)


class TestOpInfoCompileCI(_OpInfoCheck):
    @ops([op for op in op_db if op.name in COMPILE_CI_OPS], allowed_dtypes=(torch.float32,))
    def test_compiled_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op, "compile", COMPILE_CI_SAMPLES)


@pytest.mark.slow
class TestOpInfoCompileFull(_OpInfoCheck):
    @ops(op_db, allowed_dtypes=(torch.float32,))
    def test_compiled_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op, "compile")


def test_as_accurate_as_cpu_compares_with_float64() -> None:
    from torch.testing._internal.opinfo.core import SampleInput

    sample, op = SampleInput(torch.linspace(-1, 1, 7)), lambda x: (x * 3.1, x.argmax())
    expected = op(sample.input)
    assert _as_accurate_as_cpu(op, sample, (expected[0].nextafter(torch.tensor(9.0)), expected[1]), expected)
    assert not _as_accurate_as_cpu(op, sample, (expected[0] + 1e-3, expected[1]), expected)  # 3e-5 allowed
    assert not _as_accurate_as_cpu(op, sample, (expected[0], expected[1] + 1), expected)  # integers: exact
    assert not _as_accurate_as_cpu(op, sample, (expected[0] * float("nan"), expected[1]), expected)


def test_ill_conditioned_attention_passes_against_float64() -> None:
    # Attention scores of ~1e5 (OpInfo's inputs in [-9, 9]): the CPU's float32 result is 0.046 or 0.023 from
    # float64 (AVX2 or AVX-512 eager) and the ctpu's 0.023 or 0.046, so they differ by more than the MXU
    # tolerance; both are float32-accurate for scores this large: within 5e-5 of the largest |value| (1,448).
    from torch.testing import make_tensor
    from torch.testing._internal.opinfo.core import SampleInput

    torch.manual_seed(181)
    q, k, v, w, b, ow, ob, mask = (make_tensor(s, dtype=torch.float32, device="cpu", low=-9, high=9) for s in
                                   [(3, 2, 4), (5, 2, 4), (5, 2, 4), (12, 4), (12,), (4, 4), (4,), (3, 5)])
    sample = SampleInput(q, args=(k, v, 4, 2, w, b, None, None, False, 0.0, ow, ob), kwargs={"attn_mask": mask})
    op = lambda *a, **kw: torch.nn.functional.multi_head_attention_forward(*a, training=False, **kw)[0]
    expected, _ = _run(op, sample)
    actual, err = _run(op, _to_device(sample, "ctpu"))
    reference, _ = _run(op, _copy_sample(sample, "cpu", torch.float64))
    assert err is None and not actual.isnan().any() and not expected.isnan().any()
    for result in (actual.cpu(), expected):
        assert (result.double() - reference).abs().max() <= 5e-5 * reference.abs().max()


AUTOGRAD_OPS = [op for op in op_db if op.supports_autograd]
AUTOGRAD_CI_OPS = [op for op in AUTOGRAD_OPS if op.name in GRAD_CI_OPS]


class TestOpInfoGradCI(_OpInfoCheck):
    @ops(AUTOGRAD_CI_OPS, allowed_dtypes=(torch.float32,))
    def test_compiled_grad_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op, "grad", GRAD_CI_SAMPLES)


@pytest.mark.slow
class TestOpInfoGradFull(_OpInfoCheck):
    @ops(AUTOGRAD_OPS, allowed_dtypes=(torch.float32,))
    def test_compiled_grad_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op, "grad")


class TestOpInfoEagerGradCI(_OpInfoCheck):
    @ops(AUTOGRAD_CI_OPS, allowed_dtypes=(torch.float32,))
    def test_grad_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op, "eager-grad", GRAD_CI_SAMPLES)


@pytest.mark.slow
class TestOpInfoEagerGradFull(_OpInfoCheck):
    @ops(AUTOGRAD_OPS, allowed_dtypes=(torch.float32,))
    def test_grad_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op, "eager-grad")


class TestOpInfoDynamicCI(_OpInfoCheck):
    @ops([op for op in op_db if op.name in DYNAMIC_CI_OPS], allowed_dtypes=(torch.float32,))
    def test_dynamic_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op, "dynamic", DYNAMIC_CI_SAMPLES)


@pytest.mark.slow
class TestOpInfoDynamicFull(_OpInfoCheck):
    @ops(op_db, allowed_dtypes=(torch.float32,))
    def test_dynamic_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op, "dynamic")


class TestOpInfoIntegerCI(_OpInfoCheck):
    @ops([op for op in op_db if op.name in INTEGER_CI_OPS], allowed_dtypes=(torch.int64,))
    def test_integer_compiled_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op, "integer", COMPILE_CI_SAMPLES)


@pytest.mark.slow
class TestOpInfoIntegerFull(_OpInfoCheck):
    @ops(op_db, allowed_dtypes=(torch.int64,))
    def test_integer_compiled_matches_cpu(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self._check(device, op, "integer")


def test_gradients_compared_with_float64() -> None:
    from torch.testing._internal.opinfo.core import SampleInput

    sample = SampleInput(torch.linspace(-1, 1, 7, requires_grad=True))
    op = lambda x: (x * 3.1).sin()
    expected, err = _with_grads(sample, *_run(op, sample))
    assert err is None and expected[1][0].shape == (7,)
    (out, (grad,)) = expected
    assert _as_accurate_as_cpu(op, sample, (out, (grad.nextafter(torch.tensor(9.0)),)), expected, gradients=True)
    assert not _as_accurate_as_cpu(op, sample, (out, (grad + 1e-3,)), expected, gradients=True)


for _case in (TestOpInfoCI, TestOpInfoFull, TestOpInfoCompileCI, TestOpInfoCompileFull, TestOpInfoGradCI,
              TestOpInfoGradFull, TestOpInfoEagerGradCI, TestOpInfoEagerGradFull, TestOpInfoDynamicCI,
              TestOpInfoDynamicFull, TestOpInfoIntegerCI, TestOpInfoIntegerFull):
    instantiate_device_type_tests(_case, globals(), only_for="privateuse1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", default="opinfo_report.json", help="where the JSON report goes")
    parser.add_argument("--ci-only", action="store_true", help="only the CI part")
    parser.add_argument("--mode", choices=["eager", "compile", *GRAD_MODES, "dynamic", "integer"], default="eager",
                        help="eager ops on ctpu tensors, or each op under torch.compile(backend='ctpu'); the "
                             "grad modes add the gradients (compiled, or eager on ctpu tensors); dynamic: "
                             "compiled with dynamic=True (symbolic sizes, padded); integer: the int64 samples "
                             "compiled")
    parser.add_argument("--max-samples", type=int, help="the first samples of each OpInfo only")
    parser.add_argument("--positions", default=":", metavar="START:STOP",
                        help="a slice of the selected OpInfos (e.g. 227:450), to split a sweep over processes")
    args = parser.parse_args()
    start_at, stop_at = (int(p) if p else None for p in args.positions.split(":"))
    ci_ops = {"compile": COMPILE_CI_OPS, "grad": GRAD_CI_OPS, "eager-grad": GRAD_CI_OPS,
              "dynamic": DYNAMIC_CI_OPS, "integer": INTEGER_CI_OPS}.get(args.mode, CI_OPS)
    checker = TestCase()
    warnings.simplefilter("ignore", CtpuFallbackWarning)
    start, outcomes = time.time(), []
    dtype = torch.int64 if args.mode == "integer" else torch.float32
    selected = [op for op in op_db if dtype in op.supported_dtypes("cpu") and (not args.ci_only or op.name in ci_ops)
                and (args.mode not in GRAD_MODES or op.supports_autograd)]
    for op in selected[start_at:stop_at]:
        outcomes.append(check_op(op, "ctpu", lambda a, e, name: _assert_equal(checker, a, e, name),
                                 args.mode, args.max_samples))
        print(op.name, op.variant_test_name, outcomes[-1]["status"], outcomes[-1]["reason"][:200],
              file=sys.stderr, flush=True)  # the outcomes so far, while the sweep runs
    counts = Counter(o["status"] for o in outcomes)
    fallback_ops = Counter(name for o in outcomes for name in o["fallback_ops"])
    report = {"torch": torch.__version__, "mode": args.mode, "positions": args.positions,
              "opinfos": len(outcomes), "counts": dict(counts),
              "fallback_with_ctpu_kernels": sum(o["status"] == "fallback" and o["kernels_launched"] > 0
                                                for o in outcomes),
              "seconds": round(time.time() - start, 1),
              "skipped": {f"{o['op']}.{o['variant']}".rstrip("."): o["reason"] for o in outcomes
                          if o["status"] == "skipped"},
              "failed": [o for o in outcomes if o["status"] in ("crash", "mismatch")],
              "aten_ops_on_cpu": dict(fallback_ops.most_common()),
              "dynamic_refusals": Counter(r.split(" (")[0] for o in outcomes for r in o.get("dynamic_refusals", ())
                                          ).most_common(),
              "outcomes": outcomes}
    with open(args.report, "w") as f:
        json.dump(report, f, indent=1, default=str)
    print(json.dumps({k: report[k] for k in ("opinfos", "counts", "fallback_with_ctpu_kernels", "seconds")}))
    for o in report["failed"]:
        print(o["status"], o["op"], o["variant"], o["reason"][:200])


if __name__ == "__main__":
    main()
