"""Random numbers: manual_seed determinism, state save/restore, generators of the device."""

from __future__ import annotations

import torch


def test_manual_seed_is_deterministic() -> None:
    torch.ctpu.manual_seed(123)
    a = torch.randn(16, device="ctpu")
    torch.ctpu.manual_seed(123)
    b = torch.randn(16, device="ctpu")
    torch.ctpu.manual_seed(124)
    c = torch.randn(16, device="ctpu")
    assert torch.equal(a.cpu(), b.cpu()) and not torch.equal(a.cpu(), c.cpu())


def test_torch_manual_seed_seeds_ctpu_like_the_cpu() -> None:
    torch.manual_seed(7)  # reaches torch.ctpu.manual_seed_all
    dev = torch.randn(5, 5, device="ctpu")
    torch.manual_seed(7)
    cpu = torch.randn(5, 5)
    assert torch.equal(dev.cpu(), cpu)  # the generator is the CPU's, labelled ctpu


def test_state_save_and_restore() -> None:
    state = torch.ctpu.get_rng_state()
    assert state.dtype == torch.uint8 and state.device.type == "cpu"
    a = torch.rand(8, device="ctpu")
    torch.ctpu.set_rng_state(state)
    assert torch.equal(torch.rand(8, device="ctpu").cpu(), a.cpu())
    torch.ctpu.set_rng_state_all(torch.ctpu.get_rng_state_all())


def test_ctpu_generators() -> None:
    g = torch.Generator(device="ctpu")
    assert g.device.type == "ctpu"
    g.manual_seed(3)
    x = torch.randn(4, device="ctpu", generator=g)
    g.manual_seed(3)
    assert torch.equal(torch.randn(4, device="ctpu", generator=g).cpu(), x.cpu())
    assert torch.ctpu.default_generator().device == torch.device("ctpu", 0)
    torch.ctpu.manual_seed(5)
    assert torch.ctpu.initial_seed() == 5


def test_seeded_ops_without_generator_argument_use_the_ctpu_generator() -> None:
    x = torch.ones(64, device="ctpu")
    torch.ctpu.manual_seed(0)
    a = torch.nn.functional.dropout(x, 0.5)
    torch.ctpu.manual_seed(0)
    b = torch.nn.functional.dropout(x, 0.5)
    assert torch.equal(a.cpu(), b.cpu())


def test_rng_state_calls_are_not_traced_by_dynamo() -> None:
    # freeze_rng_state (OpInfo's wrapper_set_seed) restores torch.ctpu's state inside no_dispatch(); if dynamo
    # compiled that frame it would fake the state tensor there and fail. Like torch.cuda's, they run eagerly.
    from torch.testing._utils import wrapper_set_seed

    torch._dynamo.reset()
    f = torch.compile(lambda t: wrapper_set_seed(torch.Tensor.item, t), backend="ctpu", dynamic=False)
    assert f(torch.tensor(2.5)) == 2.5
    state = torch.ctpu.get_rng_state()
    torch.compile(lambda s: torch.ctpu.set_rng_state(s), backend="ctpu", dynamic=False)(state)
    assert torch.equal(torch.ctpu.get_rng_state(), state)
