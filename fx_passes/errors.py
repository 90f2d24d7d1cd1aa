"""Errors and warnings raised by fx_passes; each message names the FX node it is about."""

from __future__ import annotations


class CtpuFallbackWarning(UserWarning):
    """Some ops are not supported on the CTPU and run on the CPU instead (compiled graphs and eager ops)."""


class CtpuPassError(RuntimeError):
    """A graph that the passes cannot handle (the message names the node and why)."""


class CtpuDynamicShapeError(CtpuPassError):
    """A symbolic (dynamic) size reached fx_passes, which compiles for static shapes only."""
