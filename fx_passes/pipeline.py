"""`run_passes`: normalise -> pattern fusion -> (normalise again) -> [generic fusion] -> partition."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from torch.fx import GraphModule

from .fuse import fuse_elementwise
from .graph_utils import ensure_meta
from .groups import fusion_groups
from .normalize import normalize
from .partition import Partition, UnsupportedReason, partition
from .patterns import PATTERN_PASSES

pass_log = logging.getLogger("ctpu.passes")

Verifier = Callable[[str, GraphModule], None]


@dataclass
class PassReport:
    """What the passes did to one graph.

    changes: for each pass, in run order, what it changed, by kind (e.g. "normalize": {"copy": 3},
    "norms": {"rms_norm": 5}, "fuse": {"elementwise": 2}); a pass that changed nothing maps to an empty
    Counter. fusions: fused nodes in the final graph, by kind (ctpu op name or FusedGroup kind).
    fallback_ops: op targets left to the CPU. partition: the segments for the runtime.
    """

    changes: dict[str, Counter[str]] = field(default_factory=dict)
    fusions: Counter[str] = field(default_factory=Counter)
    fallback_ops: list[str] = field(default_factory=list)
    partition: Partition = field(default_factory=Partition)

    def summary(self) -> str:
        lines = []
        for name, counts in self.changes.items():
            done = ", ".join(f"{kind} x{count}" for kind, count in sorted(counts.items())) or "no change"
            lines.append(f"{name}: {done}")
        lines.append("fallback to CPU: " + (", ".join(self.fallback_ops) or "none"))
        return "\n".join(lines)


def run_passes(
    gm: GraphModule,
    example_inputs: Sequence[Any],
    *,
    strict: bool = False,
    fuse: bool = True,
    unsupported_reason: UnsupportedReason | None = None,
    verify: Verifier | None = None,
) -> tuple[GraphModule, PassReport]:
    """Run the fx_passes pipeline on gm in place and return (gm, report).

    gm is a forward graph from AOT autograd with core-ATen decompositions (static shapes: a SymInt
    raises CtpuDynamicShapeError naming the node). example_inputs (real or fake) only give the
    placeholders fake values when the graph has none. strict re-raises errors inside pattern rules
    instead of skipping the rule. fuse: group elementwise chains into FusedGroups (for back ends that do
not fuse by themselves). unsupported_reason: the target's answer for each compute node (see partition.py);
nothing warns here, the caller warns once per graph. verify, if given, is
    called as verify(pass name, gm) after every pass (tests lint and re-run the graph there).
    """
    ensure_meta(gm, example_inputs)
    Stage = tuple[str, Callable[[], Counter[str]]]
    stages: list[Stage] = [("normalize", partial(normalize, gm, strict=strict))]
    stages += [(p.name, partial(p.run, gm, strict=strict)) for p in PATTERN_PASSES]
    # Fused ops return contiguous values: copies that kept a layout for the replaced ops may now be no-ops.
    stages += [("cleanup", partial(normalize, gm, strict=strict))]
    if fuse:
        stages += [("fuse", partial(fuse_elementwise, gm))]
    report = PassReport()
    for name, stage in stages:
        report.changes[name] = stage()
        if verify is not None:
            verify(name, gm)
    report.partition = partition(gm, unsupported_reason)
    report.fallback_ops = report.partition.fallback_targets
    report.fusions = Counter(group.kind for group in fusion_groups(gm))
    pass_log.debug("fx_passes on %s:\n%s", gm.__class__.__name__, report.summary())
    return gm, report
