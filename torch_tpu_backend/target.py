"""A back end, as the generic compile path sees it: one object that answers every question about it.

    target = dynamo.make_target(options)      # CtpuTarget (sim, rtl) or PtxTarget
    target.fuse_elementwise                   # does it want fx_passes' FusedGroups (PTX), or fuse itself?
    target.unsupported_reason(node)           # None, or why this FX node cannot run there (-> CPU)
    target.refusal_reason(error)              # a compile error that is a refusal: why; None: an internal error
    exe = target.compile(gm, examples, name, dump)      # an executable (plain data for the CTPU)
    outs = target.launch(exe, args, outputs, name)      # list of tensors

`dynamo.GraphCompiler` never switches on a target's name: a new back end is a new class here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.fx

from torch_tpu_backend.dump import GraphDump


@dataclass(frozen=True)
class OutputSpec:
    """What the caller expects of one output: its dtype and the device it lives on (from the FX graph)."""

    dtype: torch.dtype
    device: torch.device


class Target(Protocol):
    name: str
    fuse_elementwise: bool

    def unsupported_reason(self, node: torch.fx.Node) -> str | None: ...

    def refusal_reason(self, error: Exception) -> str | None:
        """`error` (raised by `compile`) as a refusal to lower something: the reason; None when it is an
        internal error."""
        ...

    def compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str, dump: GraphDump) -> Any:
        """An executable for `gm`; raises codegen.UnsupportedError (or anything else, an internal error)
        when it cannot."""
        ...

    def launch(self, executable: Any, args: Sequence[Any], outputs: Sequence[OutputSpec], name: str,
               bumped_after: frozenset[int] = frozenset()) -> list[Any]:
        """Run it. `bumped_after`: the args whose version counter the caller (AOT autograd's wrapper) moves
        after the call, because the graph mutated them."""
        ...
