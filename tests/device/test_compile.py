"""Compiled graphs with ctpu inputs run on the device: inputs read in place from HBM, outputs left there."""

from __future__ import annotations

import pytest
import torch

import torch_tpu_backend.stats as ctpu_stats


def test_compiled_graph_reads_ctpu_inputs_in_place(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch_tpu_backend import ctpu_target

    def no_copies(*_: object) -> None:
        raise AssertionError("an input was copied into HBM: ctpu tensors must be read in place")

    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x * y) + 1.0

    torch._dynamo.reset()
    x, y = torch.randn(16, 8), torch.randn(16, 8)
    xd, yd = x.to("ctpu"), y.to("ctpu")
    monkeypatch.setattr(ctpu_target, "pack_input", no_copies)
    ctpu_stats.reset()
    out = torch.compile(f, backend="ctpu", options={"cache": False})(xd, yd)
    assert out.device.type == "ctpu"
    torch.testing.assert_close(out.cpu(), f(x, y), rtol=1e-5, atol=1e-6)
    s = ctpu_stats.last()
    assert s.kernels_launched == 1 and not s.fallback_ops


def test_cpu_inputs_still_work_and_return_cpu_tensors() -> None:
    torch._dynamo.reset()
    x = torch.randn(8, 8)
    out = torch.compile(lambda t: t * 2.0 - 1.0, backend="ctpu", options={"cache": False})(x)
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, x * 2.0 - 1.0)


def test_non_contiguous_ctpu_input_gives_a_ctpu_output() -> None:
    """A strided ctpu input is copied for the launch, but the result stays where eager puts it: on ctpu."""
    torch._dynamo.reset()
    x = torch.randn(8, 16)
    xd = x.to("ctpu").t()
    assert not xd.is_contiguous()
    out = torch.compile(lambda t: t * 2.0 + 1.0, backend="ctpu", options={"cache": False})(xd)
    assert out.device.type == "ctpu"
    torch.testing.assert_close(out.cpu(), x.t() * 2.0 + 1.0)


def test_a_cpu_result_of_a_ctpu_graph_is_a_cpu_tensor() -> None:
    """`(x + 1).cpu() * 2` compiled as one graph: the result is on the CPU, as in eager."""
    torch._dynamo.reset()
    x = torch.randn(4, 8)
    out = torch.compile(lambda t: (t + 1).cpu() * 2, backend="ctpu", fullgraph=True,
                        options={"cache": False})(x.to("ctpu"))
    assert out.device.type == "cpu"
    torch.testing.assert_close(out, (x + 1) * 2)


def test_an_empty_ctpu_input_is_read_in_place() -> None:
    """An empty ctpu tensor has no storage (a null data pointer): its argument address is 0, where the program
    reads nothing (it was the pointer minus HBM's base, a negative address the argument table refused;
    the tiny Llama's backward under autocast has two such inputs)."""
    torch._dynamo.reset()
    ctpu_stats.reset()
    x, y = torch.empty(0, device="ctpu"), torch.arange(3.0).to("ctpu")
    doubled, total = torch.compile(lambda a, b: (a * 2, b.sum() + a.sum()), backend="ctpu",
                                   options={"cache": False})(x, y)
    assert doubled.shape == (0,) and doubled.device.type == "ctpu"
    assert total.item() == 3.0 and not ctpu_stats.last().fallback_ops


def test_a_graph_compiled_for_another_config_returns_its_results() -> None:
    """ctpu tensors live on one device's HBM (`small` here); a graph compiled with config "large" runs on a
    large device, and its ctpu outputs must land in the HBM the tensors live in (they were written into the
    large device's HBM at the new tensor's address: the caller read zeros, silently)."""
    torch._dynamo.reset()
    x = torch.randn(8, 16)
    out = torch.compile(lambda t: t * 2.0 + 1.0, backend="ctpu", options={"config": "large", "cache": False})(
        x.to("ctpu"))
    assert out.device.type == "ctpu"
    torch.testing.assert_close(out.cpu(), x * 2.0 + 1.0)
