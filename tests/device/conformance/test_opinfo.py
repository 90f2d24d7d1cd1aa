"""Conformance with torch_openreg's tests/test_opinfo.py: PyTorch's OpInfo samples of the ops openreg
implements (add, mul, empty, zeros, ones) on ctpu: results on the device, `out=` written in place and
returned, non-contiguous inputs giving the contiguous results and gradients.

The whole op_db against the CPU, eager and compiled, is tests/device/test_opinfo.py. In CI the
non-contiguous check runs the ops on the CPU path (`eager.set_eager_compiler(None)`: it checks the device
layer's strides, views and gradients, ~2 s); compiled to CTPU kernels (every sample's layout compiles, ~50 s)
it is `slow`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch
from torch.testing._internal.common_device_type import instantiate_device_type_tests, ops
from torch.testing._internal.common_methods_invocations import op_db
from torch.testing._internal.common_utils import TestCase, first_sample, noncontiguous_like

from torch_tpu_backend.device import eager

OPS = [op for op in op_db if op.name in {"add", "mul", "empty", "zeros", "ones"}]


def on_device(result: Any, device_type: str) -> bool:
    results = result if isinstance(result, tuple | list) else [result]
    return all(r.device.type == device_type for r in results if isinstance(r, torch.Tensor))


def grad_inputs(inp: Any, args: tuple[Any, ...]) -> list[torch.Tensor]:
    items = ((inp,) if isinstance(inp, torch.Tensor) else tuple(inp)) + tuple(args)
    return [t for t in items if isinstance(t, torch.Tensor) and t.requires_grad]


class OpInfoOnCtpu(TestCase):
    @ops(OPS, allowed_dtypes=(torch.float32, torch.float16))
    def test_result_on_device(self, device: str, dtype: torch.dtype, op: Any) -> None:
        sample = first_sample(self, op.sample_inputs(device, dtype))
        assert on_device(op(sample.input, *sample.args, **sample.kwargs), torch.device(device).type)

    @ops([op for op in OPS if op.supports_out], allowed_dtypes=(torch.float32,))
    def test_out_argument(self, device: str, dtype: torch.dtype, op: Any) -> None:
        sample = first_sample(self, op.sample_inputs(device, dtype))
        expected = op(sample.input, *sample.args, **sample.kwargs)
        if not isinstance(expected, torch.Tensor):
            return
        out = torch.empty_like(expected)
        ptr = out.data_ptr()
        result = op(sample.input, *sample.args, **sample.kwargs, out=out)
        assert result is out and out.device.type == torch.device(device).type and out.data_ptr() == ptr
        if op.name not in ("empty",):  # uninitialised memory
            self.assertEqual(out, expected)

    @ops([op for op in OPS if op.name != "empty"], allowed_dtypes=(torch.float32,))
    def test_noncontiguous_samples(self, device: str, dtype: torch.dtype, op: Any) -> None:
        compiler = eager.get_eager_compiler()
        eager.set_eager_compiler(None)
        try:
            self.check_noncontiguous(device, dtype, op)
        finally:
            eager.set_eager_compiler(compiler)

    @pytest.mark.slow
    @ops([op for op in OPS if op.name != "empty"], allowed_dtypes=(torch.float32,))
    def test_noncontiguous_samples_on_ctpu_kernels(self, device: str, dtype: torch.dtype, op: Any) -> None:
        self.check_noncontiguous(device, dtype, op)

    def check_noncontiguous(self, device: str, dtype: torch.dtype, op: Any) -> None:
        if op.is_factory_function:
            self.skipTest(f"{op.name} is a factory function (openreg skips it too)")
        test_grad = dtype in op.supported_backward_dtypes(torch.device(device).type)
        for sample in op.sample_inputs(device, dtype, requires_grad=test_grad):
            noncontig = sample.noncontiguous()
            expected = op(sample.input, *sample.args, **sample.kwargs)
            actual = op(noncontig.input, *noncontig.args, **noncontig.kwargs)
            self.assertEqual(actual, expected)
            if not test_grad:
                continue
            expected = sample.output_process_fn_grad(expected)
            actual = sample.output_process_fn_grad(actual)
            if isinstance(expected, torch.Tensor):
                g_expected: Sequence[torch.Tensor] | torch.Tensor = torch.randn_like(expected)
                g_actual: Sequence[torch.Tensor] | torch.Tensor = noncontiguous_like(g_expected)
            else:
                expected = [t for t in expected if isinstance(t, torch.Tensor) and t.requires_grad]
                actual = [t for t in actual if isinstance(t, torch.Tensor) and t.requires_grad]
                g_expected = [torch.randn_like(t) for t in expected]
                g_actual = [noncontiguous_like(t) for t in g_expected]
            t_in, n_in = grad_inputs(sample.input, sample.args), grad_inputs(noncontig.input, noncontig.args)
            assert len(t_in) == len(n_in)
            t_grads = torch.autograd.grad(expected, t_in, g_expected, allow_unused=True)
            n_grads = torch.autograd.grad(actual, n_in, g_actual, allow_unused=True)
            for t, n in zip(t_grads, n_grads, strict=True):
                self.assertEqual(t, n)


instantiate_device_type_tests(OpInfoOnCtpu, globals(), only_for=("privateuse1",))
