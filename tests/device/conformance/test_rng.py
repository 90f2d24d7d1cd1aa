"""Conformance with torch_openreg's tests/test_rng.py: generators on ctpu, rng state get/set (one device
and all), seeding, and offsets (unsupported: the generator is the CPU's mt19937, as openreg's is).

The generator on `ctpu:1` is skipped (one device).
"""

from __future__ import annotations

import pytest
import torch


def test_generator_on_device() -> None:
    generator = torch.Generator(device="ctpu:0")
    assert generator.device.type == "ctpu" and generator.device.index == 0
    generator.manual_seed(42)
    assert generator.initial_seed() == 42


@pytest.mark.skip(reason="multi-device: ctpu has one device (ctpu:1 does not exist)")
def test_generator_on_device_1() -> None: ...


def test_rng_state_round_trip() -> None:
    state = torch.ctpu.get_rng_state(0)
    torch.ctpu.set_rng_state(state, 0)
    states = torch.ctpu.get_rng_state_all()
    torch.ctpu.set_rng_state_all(states)
    first = torch.randn(4, device="ctpu")
    torch.ctpu.set_rng_state(state, 0)
    assert torch.equal(torch.randn(4, device="ctpu").cpu(), first.cpu())


def test_manual_seed_all_and_seed_all() -> None:
    torch.ctpu.manual_seed_all(42)
    assert torch.ctpu.initial_seed() == 42
    torch.ctpu.seed_all()
    seed1 = torch.ctpu.initial_seed()
    torch.ctpu.seed_all()
    assert torch.ctpu.initial_seed() != seed1


def test_offset_unsupported() -> None:
    with pytest.raises(RuntimeError, match="does not support set_offset"):
        torch.ctpu.set_offset(123)
    with pytest.raises(RuntimeError, match="does not support get_offset"):
        torch.ctpu.get_offset()
