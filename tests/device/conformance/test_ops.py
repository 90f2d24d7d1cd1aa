"""Conformance with torch_openreg's tests/test_ops.py: factories, copies, views, set_/resize_, out= with
TensorIterator's resize rules, the CPU fallback (scalar, tensor and tensor-list arguments), custom autograd
functions (eager and compiled with aot_eager), quantization. Its SDPA checks (the same as openreg's
tests/test_sdpa.py plus dropout and causal variants) are in test_sdpa.py.

openreg's `torch.ops.openreg.custom_*` ops are its own examples; here the same contract (an autograd
function that returns its input, or a view of it, with gradient 0.5) is an `autograd.Function` on ctpu.
openreg registers `maximum.out`/`minimum.out` through torchgen's structured codegen; ctpu runs them through
its eager kernels or the fallback: the results are what is checked.
"""

from __future__ import annotations

import pytest
import torch

MULTI_DEVICE = "multi-device: ctpu has one device (ctpu:1 does not exist)"
NO_NAMES = "torch 2.13 has no names= on torch.empty (the CPU raises the same TypeError)"
NO_QUANTIZED = ("quantized tensors are not supported on ctpu: no QuantizedPrivateUse1 kernels (the CTPU has no "
                "int8 affine arithmetic; the capability query leaves the quantized dtypes out)")


# factories


def test_empty_zeros_and_empty_tuple() -> None:
    x = torch.empty(3, device="ctpu")
    assert x.device.type == "ctpu" and x.shape == (3,)
    y = torch.zeros(3, device="ctpu")
    assert y.device.type == "ctpu" and y.shape == (3,) and bool((y == 0).all())
    z = torch.tensor((), device="ctpu")
    assert z.device.type == "ctpu" and z.shape == (0,)


@pytest.mark.xfail(reason=NO_NAMES, strict=True, raises=TypeError)
def test_empty_with_names() -> None:
    x = torch.empty([2, 3, 4, 5], device="ctpu", names=["N", "C", "H", "W"])
    assert x.device.type == "ctpu" and x.shape == (2, 3, 4, 5)


def test_empty_under_fake_tensor_mode() -> None:
    with torch._subclasses.fake_tensor.FakeTensorMode():
        z = torch.empty(3, 3, device="ctpu") + torch.empty(3, 3, device="ctpu:0")
        assert z.device.type == "ctpu" and z.shape == (3, 3)


def test_empty_memory_formats_and_strided() -> None:
    x = torch.empty(1, 2, 3, 4, device="ctpu", memory_format=torch.channels_last)
    assert x.device.type == "ctpu" and x.shape == (1, 2, 3, 4)
    assert x.is_contiguous(memory_format=torch.channels_last)
    y = torch.empty(2, 3, 4, device="ctpu", memory_format=torch.contiguous_format)
    assert y.is_contiguous()
    z = torch.empty_strided((3, 4), (4, 1), device="ctpu")
    assert z.device.type == "ctpu" and z.shape == (3, 4) and z.stride() == (4, 1)


def test_ones_full_randn() -> None:
    ones = torch.ones(3, 4, device="ctpu")
    assert ones.device.type == "ctpu" and ones.shape == (3, 4) and bool((ones == 1).all())
    like = torch.ones_like(torch.randn(3, 4, device="ctpu"))
    assert like.device.type == "ctpu" and like.shape == (3, 4) and bool((like == 1).all())
    assert torch.randn(3, 4, device="ctpu").shape == (3, 4)
    full = torch.full((3, 4), 5.0, device="ctpu")
    assert full.device.type == "ctpu" and bool((full == 5.0).all())


# copies


def test_copy_same_device_and_across() -> None:
    a = torch.ones(10, device="ctpu").clone()
    assert torch.equal(a.cpu(), torch.ones(10))
    r = torch.rand(10)
    assert torch.equal(r.to("ctpu").add(2).to("cpu"), r + 2)


@pytest.mark.skip(reason=MULTI_DEVICE)
def test_copy_between_devices() -> None: ...


def test_copy_to_other_dtype_clone_non_blocking() -> None:
    x = torch.randn(3, 4, device="ctpu")
    y = torch.empty(3, 4, dtype=torch.float64, device="ctpu")
    y.copy_(x)
    assert y.dtype == torch.float64 and torch.equal(y.cpu(), x.cpu().double())
    c = x.clone()
    assert c.device.type == "ctpu" and torch.equal(c.cpu(), x.cpu()) and c.data_ptr() != x.data_ptr()
    nb = torch.empty(3, 4, device="ctpu")
    nb.copy_(x, non_blocking=True)
    assert torch.equal(nb.cpu(), x.cpu())


def test_data_swap_with_cpu() -> None:
    x = torch.randn(3, device="ctpu")
    assert torch._has_compatible_shallow_copy_type(x, torch.randn(3))
    cpu = torch.randn(3)
    x.data = cpu
    assert x.device.type == "cpu" and torch.equal(x, cpu)
    y = torch.randn(3)
    y.data = torch.ones(3, device="ctpu")
    assert y.device.type == "ctpu" and torch.equal(y.cpu(), torch.ones(3))
    assert not torch._has_compatible_shallow_copy_type(torch.randn(3, device="ctpu"), torch.randn(3, device="meta"))


# views, resize, set_


def test_masked_select_and_expand() -> None:
    cpu = torch.randn(10)
    x = cpu.to("ctpu")
    assert torch.equal(torch.masked_select(x, x.gt(0)).cpu(), cpu.masked_select(cpu.gt(0)))
    col = torch.tensor([[1], [2], [3]], device="ctpu")
    wide = col.expand(3, 2)
    assert torch.equal(wide.cpu(), torch.tensor([[1, 1], [2, 2], [3, 3]]))
    assert col.data_ptr() == wide.data_ptr()


def test_resize_keeps_storage() -> None:
    t = torch.randn(4, 4).ctpu()
    assert t.size() == (4, 4) and t.storage().size() == 16
    t.resize_(2, 2, 2, 2)
    assert t.size() == (2, 2, 2, 2) and t.storage().size() == 16


def test_view_reshape_as_strided_item() -> None:
    x = torch.randn(2, 3, 4, device="ctpu")
    v = x.view(6, 4)
    assert v.device.type == "ctpu" and v.shape == (6, 4) and v.data_ptr() == x.data_ptr()
    assert x.reshape(6, 4).shape == (6, 4)
    m = torch.randn(3, 4, device="ctpu")
    s = torch.as_strided(m, (2, 2), (4, 1), 1)
    assert s.device.type == "ctpu" and torch.equal(s.cpu(), torch.as_strided(m.cpu(), (2, 2), (4, 1), 1))
    assert torch.tensor([5.0], device="ctpu").item() == 5.0


def test_set_from_tensor_and_storage() -> None:
    x = torch.randn(3, 4, device="ctpu")
    y = torch.empty(3, 4, device="ctpu")
    y.set_(x)
    assert torch.equal(y.cpu(), x.cpu())
    z = torch.empty(3, 4, device="ctpu")
    z.set_(x.storage(), 0, z.size())
    assert torch.equal(z.cpu(), x.cpu())


def test_printing() -> None:
    assert "device='ctpu:0'" in str(torch.ones(20, device="ctpu"))


# abs and out= (openreg's dispatch-stub kernel)


def test_abs_out_resize_rules() -> None:
    x_cpu = torch.randn(2, 2, 3)
    x = x_cpu.to("ctpu")
    assert torch.equal(torch.abs(x).cpu(), torch.abs(x_cpu))
    o_cpu = torch.randn(2, 2, 6)
    o = o_cpu.to("ctpu")
    torch.abs(x_cpu, out=o_cpu[:, :, 0:6:2])  # an out= of the right size: written in place, strided
    torch.abs(x, out=o[:, :, 0:6:2])
    assert torch.equal(o.cpu(), o_cpu)
    torch.abs(x_cpu, out=o_cpu[:, :, 0:6:3])  # the wrong size: resized (and made contiguous)
    torch.abs(x, out=o[:, :, 0:6:3])
    assert torch.equal(o.cpu(), o_cpu)


def test_abs_contiguous_transposed_out() -> None:
    x = torch.randn(2, 3, device="ctpu")
    for y in (torch.abs(x), torch.abs(x.t())):
        assert y.device.type == "ctpu" and bool((y >= 0).all())
    out = torch.empty_like(x)
    torch.abs(x, out=out)
    assert out.device.type == "ctpu" and bool((out >= 0).all())
    assert torch.equal(out.cpu(), torch.abs(x).cpu())


# the fallback


def test_fallback_scalar_tensor_and_list_arguments() -> None:
    expected = torch.tensor([[0, 0, 0, 1, 1, 2], [0, 1, 2, 1, 2, 2]])
    assert torch.equal(torch.triu_indices(3, 3, device="ctpu").cpu(), expected)
    x = torch.Tensor([[1, 2, 3], [2, 3, 4]]).to("ctpu")
    y = torch.Tensor([1, 0, 2]).to("ctpu")
    assert x.device.type == "ctpu" and not x.is_cpu
    assert torch.equal(torch.sub(x, y).cpu(), torch.Tensor([[0, 2, 1], [1, 3, 2]]))
    idx = torch.Tensor([1, 0]).long().to("ctpu")
    assert torch.equal(x[idx, idx].cpu(), torch.Tensor([3, 1]))
    v = torch.Tensor([1, 2, 3]).to("ctpu")
    z = torch._foreach_add((v, v), (v, v))
    for t in z:
        assert t.device.type == "ctpu" and torch.equal(t.cpu(), torch.Tensor([2, 4, 6]))


def test_binary_ops_and_scalars_stay_on_device() -> None:
    x, y = torch.randn(3, 4, device="ctpu"), torch.randn(3, 4, device="ctpu")
    for r in (torch.add(x, y), torch.mul(x, y), x + 1.0, x * 2.0):
        assert r.device.type == "ctpu"
    out = torch.empty_like(x)
    torch.abs(x, out=out)
    assert out.device.type == "ctpu"


def test_maximum_minimum_functional_and_out() -> None:
    x = torch.tensor([1.0, 5.0, 3.0], device="ctpu")
    y = torch.tensor([4.0, 2.0, 6.0], device="ctpu")
    for op, expected in ((torch.maximum, [4.0, 5.0, 6.0]), (torch.minimum, [1.0, 2.0, 3.0])):
        z = op(x, y)
        assert z.device.type == "ctpu" and torch.equal(z.cpu(), torch.tensor(expected))
        out = torch.empty(3, device="ctpu")
        ret = op(x, y, out=out)
        assert torch.equal(ret.cpu(), torch.tensor(expected)) and torch.equal(out.cpu(), torch.tensor(expected))


# custom autograd functions (openreg: custom_autograd_fn_returns_self / _aliasing)


class ReturnsSelf(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 0.5


class Aliasing(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: torch.Tensor) -> torch.Tensor:
        return grad * 0.5


@pytest.mark.parametrize("fn", [ReturnsSelf, Aliasing], ids=["returns_self", "aliasing"])
def test_custom_autograd_function(fn: type[torch.autograd.Function]) -> None:
    x = torch.randn(4, device="ctpu", requires_grad=True)
    y = fn.apply(x)
    assert torch.equal(y.detach().cpu(), x.detach().cpu()) and y.requires_grad
    y.sum().backward()
    assert x.grad is not None and torch.allclose(x.grad.cpu(), torch.full((4,), 0.5))
    plain = torch.randn(4, device="ctpu")
    assert not fn.apply(plain).requires_grad

    compiled_in = x.detach().clone().requires_grad_(True)
    out = torch.compile(fn.apply, backend="aot_eager")(compiled_in)
    out.sum().backward()
    assert torch.equal(out.detach().cpu(), y.detach().cpu())
    assert torch.equal(compiled_in.grad.cpu(), x.grad.cpu())


# quantization


@pytest.mark.xfail(reason=NO_QUANTIZED, strict=True, raises=NotImplementedError)
def test_quantize_per_tensor() -> None:
    q = torch.quantize_per_tensor(torch.randn(3, 4, 5, device="ctpu"), 0.1, 10, torch.qint8)
    assert q.device == torch.device("ctpu:0") and q.dtype == torch.qint8
