"""Inference as a user runs it (issue 11, items 2, 4, 5): weights resident in HBM across calls, a forward
under grad mode lowered like one under no_grad, and the calls dynamo stops handing to the backend counted and
warned about."""

from __future__ import annotations

import gc
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

import torch_tpu_backend.stats as ctpu_stats
from torch_tpu_backend import recompile_watch, runtime
from torch_tpu_backend.llama_demo import tiny_llama


@pytest.fixture(autouse=True)
def fresh(fresh_compile: None) -> Iterator[None]:
    torch.set_float32_matmul_precision("highest")  # fresh_compile restores it
    recompile_watch.reset_warnings()
    yield
    torch.ctpu.empty_cache()


def mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.SiLU(), torch.nn.Linear(64, 16)).eval()


def resident_mlp() -> tuple[torch.nn.Module, Callable[..., Any], torch.Tensor, runtime.CtpuDevice]:
    """The MLP compiled and called once: its weights and the input are resident on `small`'s device."""
    model = mlp()
    compiled = torch.compile(model, backend="ctpu")
    x = torch.randn(8, 32)
    with torch.no_grad():
        compiled(x)
    return model, compiled, x, runtime.get_device("small")


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def test_cpu_weights_are_uploaded_once() -> None:
    """The first call uploads weights and input; later calls only their new input; the output comes back."""
    model = mlp()
    compiled = torch.compile(model, backend="ctpu")
    weights = nbytes(*model.parameters())
    with torch.no_grad():
        for call in range(3):
            x = torch.randn(8, 32)
            ctpu_stats.reset()
            y = compiled(x)
            torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-5)
            s = ctpu_stats.last()
            assert s.host_bytes_uploaded == nbytes(x) + (weights if call == 0 else 0), (call, s.as_dict())
            assert s.host_bytes_read_back == nbytes(y)


def test_in_place_weight_update_is_seen() -> None:
    """A weight changed in place between two calls (its version counter moves) is uploaded again."""
    model = mlp()
    compiled = torch.compile(model, backend="ctpu")
    x = torch.randn(8, 32)
    with torch.no_grad():
        before = compiled(x)
        model[0].weight.mul_(2)
        model[2].bias.copy_(torch.randn(16))
        ctpu_stats.reset()
        after = compiled(x)
        torch.testing.assert_close(after, model(x), rtol=1e-5, atol=1e-5)
        assert not torch.allclose(before, after)
        assert ctpu_stats.last().host_bytes_uploaded == nbytes(model[0].weight, model[2].bias)


def test_replaced_storage_is_not_mistaken_for_the_old_one() -> None:
    """`p.data = ...` swaps the storage without moving the version counter; the old storage's copy is freed
    and never read for the new one (even if the new storage reuses the old address)."""
    model, compiled, x, device = resident_mlp()
    with torch.no_grad():
        resident = device.resident.resident_bytes()
        for p in model.parameters():
            p.data = torch.randn_like(p)  # same shape, dtype, version: only the storage differs
        gc.collect()
        assert device.resident.resident_bytes() == nbytes(x)  # the old weights' copies went with them
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        assert device.resident.resident_bytes() == resident
    del x
    gc.collect()
    torch.ctpu.empty_cache()
    assert device.resident.resident_bytes() == 0


def test_ctpu_model_uploads_nothing() -> None:
    """A model moved to ctpu is read in place: no host bytes in, none out (its output stays on ctpu)."""
    model = mlp()
    x = torch.randn(8, 32)
    with torch.no_grad():
        want = model(x)
        dev_model = mlp().to("ctpu")
        dev_model.load_state_dict(model.state_dict())
        compiled = torch.compile(dev_model, backend="ctpu")
        x_dev = x.to("ctpu")
        compiled(x_dev)
        ctpu_stats.reset()
        y = compiled(x_dev)
    s = ctpu_stats.last()
    assert s.kernels_launched == 1 and not s.fallback_ops, s.as_dict()
    assert (s.host_bytes_uploaded, s.host_bytes_read_back) == (0, 0), s.as_dict()
    assert y.device.type == "ctpu"
    torch.testing.assert_close(y.cpu(), want, rtol=1e-5, atol=1e-5)


def test_llama_under_grad_mode_runs_like_no_grad() -> None:
    """An eval model called without no_grad (parameters require grad): the forward that AOT autograd splits
    off the joint graph lowers whole, like under no_grad (it used to save the attention's and norms'
    intermediates, which broke their fusions and sent the mask computation to the CPU); and a backward
    still gets eager's gradients (it recomputes the forward)."""
    model = tiny_llama()
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(1))
    assert all(p.requires_grad for p in model.parameters())
    compiled = torch.compile(model, backend="ctpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        logits = compiled(ids).logits
    s = ctpu_stats.last()
    assert s.kernels_launched == 1 and not s.fallback_ops, s.as_dict()
    assert not [w for w in caught if "ctpu" in str(w.message)]
    want = model(ids).logits
    torch.testing.assert_close(logits, want, rtol=1e-4, atol=1e-4)
    logits.square().mean().backward()
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    want.square().mean().backward()
    for g, p in zip(got, model.parameters(), strict=True):
        assert (g - p.grad).abs().max() <= 1e-5 * p.grad.abs().max()


def test_dropout_keeps_its_mask_for_the_backward() -> None:
    """Random ops are not recomputed in the backward (a new mask would give wrong gradients): the gradient
    of sum(dropout(x) * w) is the forward's own mask, scaled."""
    w = torch.randn(64, 64)

    def fn(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.dropout(x, p=0.5, training=True) * w

    x = torch.randn(64, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        y = torch.compile(fn, backend="ctpu")(x)
        y.sum().backward()
    kept = y.detach() != 0
    assert 0 < kept.sum() < kept.numel()
    torch.testing.assert_close(x.grad, kept * 2.0 * w)


@pytest.mark.parametrize("backend", ["ctpu", "eager"])
def test_recompile_limit_is_one_warning_and_counted(backend: str) -> None:
    """Past dynamo's recompile limit a compiled function runs eagerly on the CPU without calling the backend:
    the user is told once (cause and remedy) and stats count every such call (not the calls dynamo still serves
    from its compiled graphs); another backend's limit is not ours."""
    def scaled_sin(x: torch.Tensor) -> torch.Tensor:
        return torch.sin(x) * 2

    compiled = torch.compile(scaled_sin, backend=backend, dynamic=False)
    if backend == "eager":
        torch.compile(scaled_sin, backend="ctpu")(torch.randn(9))  # the ctpu backend's listener is installed
        torch._dynamo.reset()
    launched, uncompiled = [], []
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(recompile_limit=2):
        warnings.simplefilter("always")
        for n in [1, 2, 3, 4, 5, 1, 4]:
            ctpu_stats.reset()
            x = torch.randn(n)
            torch.testing.assert_close(compiled(x), scaled_sin(x))
            launched.append(ctpu_stats.last().kernels_launched)
            uncompiled.append(sum(ctpu_stats.last().uncompiled_calls.values()))
    ours = [str(w.message) for w in caught if "recompile_limit" in str(w.message) and "ctpu" in str(w.message)]
    if backend == "eager":
        assert (ours, sum(uncompiled)) == ([], 0)
        return
    assert launched == [1, 1, 0, 0, 0, 1, 0]
    assert uncompiled == [0, 0, 1, 1, 1, 0, 1]
    assert len(ours) == 1, ours
    assert "scaled_sin" in ours[0] and 'cache_implementation="static"' in ours[0] and "CPU" in ours[0]
    assert "each is counted" in ours[0]


@pytest.mark.parametrize("how", ["module", "forward"])
def test_uncompiled_calls_of_a_module_are_counted(how: str) -> None:
    """torch.compile(module) and HF's `model.forward = torch.compile(model.forward)` past the recompile limit:
    each call dynamo runs eagerly is counted once (its submodules' forwards are not more calls), and neither
    the calls it still serves nor eager reference calls of the same model are."""
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4)).eval()
    reference = torch.nn.Sequential(*model)  # same parameters, called directly
    if how == "module":
        compiled = torch.compile(model, backend="ctpu", dynamic=False)
    else:
        model.forward = torch.compile(model.forward, backend="ctpu", dynamic=False)
        compiled = model
    counts = []
    with warnings.catch_warnings(), torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
        warnings.simplefilter("ignore")
        for rows in [1, 2, 3, 4, 2, 5]:
            x = torch.randn(rows, 8)
            ctpu_stats.reset()
            torch.testing.assert_close(compiled(x), reference(x), rtol=1e-5, atol=1e-5)
            counts.append(sum(ctpu_stats.last().uncompiled_calls.values()))
    assert counts == [0, 0, 1, 1, 0, 1]


def test_inference_mode_tensors_are_uploaded_every_call() -> None:
    """Tensors made under torch.inference_mode() have no version counter (an in-place write would not be
    seen): they are copied for each launch, never kept."""
    compiled = torch.compile(lambda x, w: x @ w, backend="ctpu")
    with torch.inference_mode():
        x, w = torch.randn(8, 16), torch.randn(16, 8)
        for _ in range(2):
            ctpu_stats.reset()
            torch.testing.assert_close(compiled(x, w), x @ w, rtol=1e-5, atol=1e-5)
            assert ctpu_stats.last().host_bytes_uploaded == nbytes(x, w)
            w.mul_(-1)
    assert runtime.get_device("small").resident.resident_bytes() == 0


def test_full_hbm_drops_resident_copies_first() -> None:
    """Resident copies are a cache: an allocation that finds HBM full frees them before it fails, and the
    next launch uploads again."""
    model, compiled, x, device = resident_mlp()
    with torch.no_grad():
        assert device.resident.resident_bytes() == nbytes(x, *model.parameters())
        ooms = torch.ctpu.memory_stats()["num_ooms"]
        blocks = []
        try:
            with pytest.raises(torch.OutOfMemoryError):
                while True:
                    blocks.append(torch.empty(1 << 16, dtype=torch.uint8, device="ctpu"))
            assert device.resident.resident_bytes() == 0
            assert torch.ctpu.memory_stats()["num_ooms"] == ooms + 1  # the fill's, once
        finally:
            blocks.clear()
        ctpu_stats.reset()
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
        assert ctpu_stats.last().host_bytes_uploaded == nbytes(x, *model.parameters())


def test_cpu_buffer_mutated_in_place_reaches_the_host() -> None:
    """A compiled step writes rows of a CPU cache buffer in place (a KV cache update): the host tensor gets
    the new rows every call (only those cross back: the bytes the program stored), the next call reads them,
    and the cache is not uploaded again (its resident copy is what the program wrote) unless the caller
    changes it."""

    class Step(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(6, 8))

        def forward(self, pos: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
            self.cache.index_copy_(0, pos, row)
            return self.cache.sum(-1)

    step, eager = Step(), Step()
    compiled = torch.compile(step, backend="ctpu")
    with torch.no_grad():
        for t in range(4):
            pos, row = torch.tensor([t]), torch.randn(1, 8)
            ctpu_stats.reset()
            out = compiled(pos, row)
            torch.testing.assert_close(out, eager(pos, row))
            torch.testing.assert_close(step.cache, eager.cache)
            s = ctpu_stats.last()
            assert s.fallback_ops == {} and s.kernels_launched == 1, s.as_dict()
            assert s.host_bytes_read_back == nbytes(out, row), s.as_dict()  # the output and the one new row
            if t:  # the cache's copy is current (the caller's version bump is expected): the new inputs alone
                assert s.host_bytes_uploaded == nbytes(pos.int(), row), s.as_dict()
        step.cache[5].fill_(3.0)  # a change of the caller's own is seen: uploaded again
        eager.cache[5].fill_(3.0)
        pos, row = torch.tensor([4]), torch.randn(1, 8)
        ctpu_stats.reset()
        torch.testing.assert_close(compiled(pos, row), eager(pos, row))
        assert ctpu_stats.last().host_bytes_uploaded == nbytes(pos.int(), row, step.cache)
