"""The ctpu random generator: `torch.ctpu.manual_seed`, `get_rng_state`, `set_rng_state`, ...

The generator is a C++ CPUGeneratorImpl labelled ctpu (csrc/ctpu/hooks.cpp): random ops run as CPU kernels
with its state (see fallback.py), so randn on ctpu is deterministic under manual_seed and equals randn on
the CPU under the same seed.

The state functions run eagerly, never traced by dynamo (torch.cuda's are in its skip list): OpInfo's
freeze_rng_state calls set_rng_state inside no_dispatch(), where dynamo cannot fake the state tensor.
(The seeding functions are left alone: decorating them would import dynamo on every torch.manual_seed.)
"""

from __future__ import annotations

import torch
from torch import _disable_dynamo

from torch_tpu_backend.device import _C
from torch_tpu_backend.device.memory import DeviceLike, _check_device


def default_generator(device: DeviceLike = None) -> torch.Generator:
    _check_device(device)
    return _C._default_generator(0)


def manual_seed(seed: int) -> None:
    default_generator().manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)  # one device


def seed() -> None:
    default_generator().seed()


def seed_all() -> None:
    seed()


def initial_seed() -> int:
    return default_generator().initial_seed()


@_disable_dynamo
def get_rng_state(device: DeviceLike = "ctpu") -> torch.Tensor:
    return default_generator(device).get_state()


@_disable_dynamo
def set_rng_state(new_state: torch.Tensor, device: DeviceLike = "ctpu") -> None:
    default_generator(device).set_state(new_state)


@_disable_dynamo
def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state()]


@_disable_dynamo
def set_rng_state_all(new_states: list[torch.Tensor]) -> None:
    (state,) = new_states
    set_rng_state(state)


# A device module's generator API also has get_offset / set_offset (Philox generators such as CUDA's count
# an offset into their stream). ctpu's generator is the CPU's mt19937, which has none: say so plainly, as
# torch_openreg does, rather than an AttributeError on torch.ctpu.
def get_offset() -> int:
    raise RuntimeError("ctpu: the generator does not support get_offset (it is the CPU's mt19937, no offset)")


def set_offset(offset: int) -> None:
    raise RuntimeError("ctpu: the generator does not support set_offset (it is the CPU's mt19937, no offset)")


def _is_in_bad_fork() -> bool:
    return False  # no driver state that a fork could break
