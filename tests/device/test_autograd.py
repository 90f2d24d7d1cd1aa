"""Autograd through ctpu tensors: a small MLP's backward on ctpu gives the CPU's gradients."""

from __future__ import annotations

import copy

import torch


def test_mlp_backward_matches_cpu() -> None:
    torch.manual_seed(0)
    cpu_model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    dev_model = copy.deepcopy(cpu_model).to("ctpu")
    x = torch.randn(8, 16)
    target = torch.randint(0, 4, (8,))
    for model, device in ((cpu_model, "cpu"), (dev_model, "ctpu")):
        loss = torch.nn.functional.cross_entropy(model(x.to(device)), target.to(device))
        loss.backward()
    for p_cpu, p_dev in zip(cpu_model.parameters(), dev_model.parameters(), strict=True):
        assert p_dev.grad is not None and p_dev.grad.device.type == "ctpu"
        torch.testing.assert_close(p_dev.grad.cpu(), p_cpu.grad)


def test_grad_of_views_and_inplace() -> None:
    a_cpu = torch.randn(4, 6, requires_grad=True)
    a_dev = a_cpu.detach().to("ctpu").requires_grad_()
    for a in (a_cpu, a_dev):
        b = a * 1.0
        b[:, ::2].mul_(3.0)  # in-place on a view, tracked by autograd
        b.t().sum(0).pow(2).sum().backward()
    torch.testing.assert_close(a_dev.grad.cpu(), a_cpu.grad)


def test_optimizer_step_updates_ctpu_params() -> None:
    model = torch.nn.Linear(3, 1).to("ctpu")
    before = model.weight.detach().cpu().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 3, device="ctpu")).sum().backward()
    opt.step()
    torch.testing.assert_close(model.weight.detach().cpu(), before - 0.1 * 2.0)


def test_zero_gradient_of_sgn() -> None:
    """sgn's backward of a real tensor is an _efficientzerotensor, which has no ctpu kernel: the CPU's ZeroTensor,
    whose storage has no data, was copied to HBM (a segfault); it arrives as zeros."""
    x = torch.randn(4, 5, device="ctpu", requires_grad=True)
    (grad,) = torch.autograd.grad(torch.sgn(x), x, torch.ones(4, 5, device="ctpu"))
    assert grad.device.type == "ctpu"
    torch.testing.assert_close(grad.cpu(), torch.zeros(4, 5))
    torch.testing.assert_close(torch._efficientzerotensor((2, 3), device="ctpu").cpu(), torch.zeros(2, 3))
