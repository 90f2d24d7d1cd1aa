"""The fused RNN cells PyTorch asks of every device but the CPU: `_thnn_fused_lstm_cell`, `_thnn_fused_gru_cell`.

`nn.LSTM` / `nn.GRU` (aten::lstm, aten::gru) call these fused cells for CUDA, XPU and PrivateUse1 inputs, and
the CPU has no kernel for them, so the CPU fallback raised NotImplementedError and every LSTM/GRU on ctpu
failed. Here each cell is its definition written with ordinary ops on the ctpu tensors (which run as CTPU
kernels or on the CPU like any op), registered for both PrivateUse1 and AutogradPrivateUse1: autograd
differentiates the ops themselves, so the fused backward ops (CUDA-only as well) are never needed.

The third LSTM result and the second GRU result are the "workspace" the fused backward would read; nothing
reads them here, but their shapes are the fused kernels' (LSTM: the four activated gates, [B, 4H]; GRU: the
gates and the hidden state, [B, 5H]).
"""

from __future__ import annotations

import torch


def _gates(input_gates: torch.Tensor, hidden_gates: torch.Tensor, input_bias: torch.Tensor | None,
           hidden_bias: torch.Tensor | None) -> torch.Tensor:
    gates = input_gates + hidden_gates
    if input_bias is not None:
        gates = gates + input_bias
    if hidden_bias is not None:
        gates = gates + hidden_bias
    return gates


def lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
              input_bias: torch.Tensor | None = None,
              hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One LSTM step from precomputed gate projections: (hy, cy, workspace). Gate order i, f, g, o."""
    i, f, g, o = _gates(input_gates, hidden_gates, input_bias, hidden_bias).chunk(4, 1)
    i, f, g, o = i.sigmoid(), f.sigmoid(), g.tanh(), o.sigmoid()
    cy = f * cx + i * g
    hy = o * cy.tanh()
    return hy, cy, torch.cat([i, f, g, o], 1)


def gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
             input_bias: torch.Tensor | None = None,
             hidden_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One GRU step from precomputed gate projections: (hy, workspace). Gate order r, z, n; the hidden part of
    n is scaled by r before the sum, so the biases are added per side."""
    if input_bias is not None:
        input_gates = input_gates + input_bias
    if hidden_bias is not None:
        hidden_gates = hidden_gates + hidden_bias
    ir, iz, in_ = input_gates.chunk(3, 1)
    hr, hz, hn = hidden_gates.chunk(3, 1)
    r = (ir + hr).sigmoid()
    z = (iz + hz).sigmoid()
    n = (in_ + r * hn).tanh()
    hy = n + z * (hx - n)
    return hy, torch.cat([r, z, in_, hn, hx], 1)


def register(library: torch.library.Library) -> None:
    """Register both cells on `library` (an aten IMPL library) for PrivateUse1 and AutogradPrivateUse1."""
    for key in ("PrivateUse1", "AutogradPrivateUse1"):
        library.impl("_thnn_fused_lstm_cell", lstm_cell, key)
        library.impl("_thnn_fused_gru_cell", gru_cell, key)
