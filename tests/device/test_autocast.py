"""torch.autocast("ctpu"): torch's cast policies on the ctpu device (csrc/ctpu/autocast.cpp). Matmuls run in
bf16 (the default autocast dtype: the MXU's), numerically sensitive ops in fp32, other ops unchanged; eager,
compiled, and through a training step's backward (fp32 master weights get fp32 gradients)."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
from torch._subclasses import FakeTensorMode
from torch.overrides import TorchFunctionMode


def _pair(seed: int, *shape: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)


def test_default_dtype_is_bf16() -> None:
    assert torch.get_autocast_dtype("ctpu") == torch.bfloat16
    with torch.autocast("ctpu"):
        assert torch.is_autocast_enabled("ctpu")


def test_policies_eager() -> None:
    a, b = _pair(0, 8, 16)
    x, y = a.to("ctpu"), b.to("ctpu")
    with torch.autocast("ctpu", dtype=torch.bfloat16):
        mm = x @ y.T
        lin = torch.nn.functional.linear(x, y)
        bmm = torch.bmm(x[None], y.T[None])
        soft = torch.softmax(x.bfloat16(), -1)  # fp32 policy: a bf16 input is computed in fp32
        norm = torch.nn.functional.layer_norm(x.bfloat16(), (16,))
        added = x + y  # no policy: unchanged
    assert (mm.dtype, lin.dtype, bmm.dtype) == (torch.bfloat16,) * 3
    assert (soft.dtype, norm.dtype, added.dtype) == (torch.float32,) * 3
    expected = (a.bfloat16() @ b.bfloat16().T)  # autocast's meaning: the inputs cast, then the op
    torch.testing.assert_close(mm.cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(lin.cpu(), expected, rtol=0, atol=0)
    torch.testing.assert_close(soft.cpu(), torch.softmax(a.bfloat16().float(), -1))
    with torch.autocast("ctpu", enabled=False):
        assert (x @ y.T).dtype == torch.float32


def test_compiled_function_under_autocast() -> None:
    a, b = _pair(1, 16, 32)

    def f(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.autocast("ctpu", dtype=torch.bfloat16):
            h = torch.nn.functional.linear(x, w)
            return h, torch.softmax(h, -1)

    torch._dynamo.reset()
    h, p = torch.compile(f, backend="ctpu", options={"cache": False})(a.to("ctpu"), b.to("ctpu"))
    assert (h.dtype, p.dtype) == (torch.bfloat16, torch.float32)
    ref = a.bfloat16() @ b.bfloat16().T
    torch.testing.assert_close(h.cpu(), ref, rtol=0, atol=0)
    torch.testing.assert_close(p.cpu(), torch.softmax(ref.float(), -1))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_training_step_keeps_fp32_master_weights(compiled: bool) -> None:
    torch.manual_seed(2)
    cpu = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    dev = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    dev.load_state_dict(cpu.state_dict())
    dev = dev.to("ctpu")
    x, target = _pair(3, 8, 16)[0], torch.randn(8, 4)
    step = torch.compile(dev, backend="ctpu", options={"cache": False}) if compiled else dev
    torch._dynamo.reset()
    with torch.autocast("ctpu", dtype=torch.bfloat16):
        loss = torch.nn.functional.mse_loss(step(x.to("ctpu")).float(), target.to("ctpu"))
    loss.backward()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss = torch.nn.functional.mse_loss(cpu(x).float(), target)
    ref_loss.backward()
    torch.testing.assert_close(loss.cpu(), ref_loss, rtol=2e-2, atol=1e-3)
    for p, q in zip(dev.parameters(), cpu.parameters(), strict=True):
        assert p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad.cpu(), q.grad, rtol=5e-2, atol=5e-3)


def test_autocast_float16_casts() -> None:
    # torch only honours an autocast dtype the device module lists; with bf16 alone, autocast(dtype=float16)
    # warned and ran in float32
    a, b = torch.randn(8, 16), torch.randn(16, 4)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*Autocast only supports")
        with torch.autocast("ctpu", dtype=torch.float16):
            mm = torch.mm(a.to("ctpu"), b.to("ctpu"))
    assert mm.dtype == torch.float16
    torch.testing.assert_close(mm.cpu(), a.half() @ b.half())


class _OutputDtypes(TorchFunctionMode):
    """Records each torch function's name and the dtypes of its float outputs (after autocast's casts)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, tuple[torch.dtype, ...]]] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        leaves = torch.utils._pytree.tree_leaves(out)
        dtypes = tuple(t.dtype for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point())
        if dtypes:
            self.calls.append((getattr(func, "__name__", str(func)), dtypes))
        return out


def test_tiny_llama_gets_the_same_dtypes_under_cpu_autocast() -> None:
    """bf16 training's reference (`ctpu train --autocast bf16 --check`, test_training.py) is eager under
    autocast("cpu"). CPU's cast policy is not CUDA's (softmax, layer_norm, exp, sum have no fp32 rule there),
    but the Llama asks for fp32 itself where it matters (RMSNorm, rotary tables, softmax, the loss upcasts
    its logits): every torch function of its forward gets the same output dtypes on both devices, its
    linears and attention bf16. Traced with fake tensors (autocast casts in dispatch, before any kernel)."""
    from torch_tpu_backend.llama_demo import tiny_llama
    from torch_tpu_backend.train import USE_CACHE

    model, ids = tiny_llama().train(), torch.randint(0, 128, (2, 16))
    calls = {}
    for device in ("cpu", "ctpu"):
        with FakeTensorMode() as fake:
            state = {n: fake.from_tensor(t).to(device) for n, t in [*model.named_parameters(), *model.named_buffers()]}
            x, recorder = fake.from_tensor(ids).to(device), _OutputDtypes()
            inputs = {"input_ids": x, "labels": x, "use_cache": USE_CACHE}
            with torch.autocast(device, dtype=torch.bfloat16), recorder:
                out = torch.func.functional_call(model, state, (), inputs)
            assert (out.logits.dtype, out.loss.dtype) == (torch.bfloat16, torch.float32)
        calls[device] = recorder.calls
    assert calls["ctpu"] == calls["cpu"]
    bf16 = [name for name, dtypes in calls["ctpu"] if dtypes == (torch.bfloat16,)]
    assert bf16.count("linear") == 15 and bf16.count("scaled_dot_product_attention") == 2  # 7 a layer, lm_head
    assert [dtypes for name, dtypes in calls["ctpu"] if name == "rsqrt"] == [(torch.float32,)] * 5  # RMSNorms
