"""Conformance with torch_openreg's tests/test_rnn.py: nn.LSTM on ctpu (one and several layers,
bidirectional, batch_first, an initial state, packed sequences) and its parity with the CPU; also the GRU
and both cells' gradients, which take the same fused-cell path (torch_tpu_backend/device/rnn_cells.py).

What is checked is the device layer (the fused cells PyTorch asks of a non-CPU device, results on ctpu),
so in CI the cells' ops run on the CPU path (`eager.set_eager_compiler(None)`): compiled, the ~20 distinct
elementwise kernels per shape cost ~2 minutes on the simulator. The `slow` parity test runs them compiled.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from torch_tpu_backend.device import eager

INPUT, HIDDEN, SEQ, BATCH = 10, 20, 5, 2


@pytest.fixture(autouse=True)
def _ops_on_cpu_path(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("slow"):
        yield
        return
    compiler = eager.get_eager_compiler()
    eager.set_eager_compiler(None)
    try:
        yield
    finally:
        eager.set_eager_compiler(compiler)


@pytest.mark.parametrize("layers, bidirectional", [(1, False), (3, False), (2, True)])
def test_lstm_shapes_and_device(layers: int, bidirectional: bool) -> None:
    lstm = nn.LSTM(INPUT, HIDDEN, num_layers=layers, bidirectional=bidirectional).to("ctpu")
    out, (h, c) = lstm(torch.randn(SEQ, BATCH, INPUT, device="ctpu"))
    directions = 2 if bidirectional else 1
    assert out.device.type == h.device.type == c.device.type == "ctpu"
    assert out.shape == (SEQ, BATCH, HIDDEN * directions)
    assert h.shape == c.shape == (layers * directions, BATCH, HIDDEN)


def test_lstm_batch_first() -> None:
    lstm = nn.LSTM(INPUT, HIDDEN, batch_first=True).to("ctpu")
    out, _ = lstm(torch.randn(BATCH, SEQ, INPUT, device="ctpu"))
    assert out.device.type == "ctpu" and out.shape == (BATCH, SEQ, HIDDEN)


def test_lstm_initial_state() -> None:
    lstm = nn.LSTM(INPUT, HIDDEN).to("ctpu")
    h0, c0 = torch.randn(1, BATCH, HIDDEN, device="ctpu"), torch.randn(1, BATCH, HIDDEN, device="ctpu")
    out, (h, c) = lstm(torch.randn(SEQ, BATCH, INPUT, device="ctpu"), (h0, c0))
    assert out.device.type == h.device.type == c.device.type == "ctpu"


def test_lstm_packed_sequence() -> None:
    lstm = nn.LSTM(INPUT, HIDDEN).to("ctpu")
    packed = nn.utils.rnn.pack_sequence([torch.randn(n, INPUT) for n in (5, 3, 1)], enforce_sorted=True)
    out, (h, c) = lstm(packed.to("ctpu"))
    assert out.data.device.type == h.device.type == c.device.type == "ctpu"


def lstm_cpu_parity() -> None:
    lstm = nn.LSTM(8, 16, num_layers=2, bidirectional=True)
    x = torch.randn(4, 3, 8)
    out_cpu, (h_cpu, c_cpu) = lstm(x)
    out, (h, c) = lstm.to("ctpu")(x.to("ctpu"))
    torch.testing.assert_close(out.cpu(), out_cpu)
    torch.testing.assert_close(h.cpu(), h_cpu)
    torch.testing.assert_close(c.cpu(), c_cpu)


def test_lstm_cpu_parity() -> None:
    lstm_cpu_parity()


@pytest.mark.slow  # the cells' ops compiled to CTPU kernels: ~1 min on the simulator
def test_lstm_cpu_parity_on_ctpu_kernels() -> None:
    from torch_tpu_backend import stats

    lstm_cpu_parity()
    assert stats.last().kernels_launched > 0  # the cells ran as CTPU kernels


def test_gru_cpu_parity_and_gradients() -> None:
    # not in openreg's file: the GRU takes the same fused-cell path (_thnn_fused_gru_cell) as the LSTM
    gru = nn.GRU(8, 16, num_layers=2, bidirectional=True)
    x = torch.randn(4, 3, 8, requires_grad=True)
    out_cpu, h_cpu = gru(x)
    out_cpu.sum().backward()
    grad_cpu, weight_grad_cpu = x.grad.clone(), gru.weight_hh_l0.grad.clone()
    gru.zero_grad()
    x_dev = x.detach().to("ctpu").requires_grad_(True)
    gru_dev = gru.to("ctpu")
    out, h = gru_dev(x_dev)
    out.sum().backward()
    torch.testing.assert_close(out.detach().cpu(), out_cpu.detach())
    torch.testing.assert_close(h.detach().cpu(), h_cpu.detach())
    torch.testing.assert_close(x_dev.grad.cpu(), grad_cpu)
    torch.testing.assert_close(gru_dev.weight_hh_l0.grad.cpu(), weight_grad_cpu)


def test_lstm_gradients_match_cpu() -> None:
    lstm = nn.LSTM(8, 16)
    x = torch.randn(4, 3, 8, requires_grad=True)
    lstm(x)[0].sum().backward()
    grad_cpu, bias_grad_cpu = x.grad.clone(), lstm.bias_ih_l0.grad.clone()
    lstm.zero_grad()
    x_dev = x.detach().to("ctpu").requires_grad_(True)
    lstm_dev = lstm.to("ctpu")
    lstm_dev(x_dev)[0].sum().backward()
    torch.testing.assert_close(x_dev.grad.cpu(), grad_cpu)
    torch.testing.assert_close(lstm_dev.bias_ih_l0.grad.cpu(), bias_grad_cpu)
