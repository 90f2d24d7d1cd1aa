"""The rewrite engine: a named pass is a list of small rules, run over the graph until nothing changes.

A rule looks at one node (the anchor, the last node of a pattern) and returns a `Rewrite` describing
what replaces it, or None for "no match". The engine, not the rule, edits the graph, and only after it
checked that the rewrite is legal:
- every matched node except the anchor is used only inside the match (otherwise fusing would duplicate
  work, or drop a value someone else needs);
- the replacement computes a value of the anchor's shape and dtype (checked in fake mode).
Rejected rewrites are logged on the "ctpu.fusion" logger at debug level, like Inductor's WhyNoFuse;
rules log their own near misses through `why_no_fuse`.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from .graph_utils import ConstantFolder, find_fake_mode, refresh_meta, tensor_val

fusion_log = logging.getLogger("ctpu.fusion")

# Node metadata copied onto a replacement, so dumps and error messages still point at the user's code.
_KEPT_META = ("stack_trace", "nn_module_stack", "source_fn_stack", "ctpu_padding")  # dynamic.PADDING_META


def why_no_fuse(kind: str, node: Node, reason: str, *args: object) -> None:
    """Log why `kind` does not fuse at `node` (debug level on "ctpu.fusion"); returns None so a rule
    can `return why_no_fuse(...)`."""
    if fusion_log.isEnabledFor(logging.DEBUG):
        fusion_log.debug("no %s at %s: %s", kind, node.name, reason % args if args else reason)


@dataclass
class Rewrite:
    """Replace `anchor` by `target(*args, **kwargs)`, or by the existing node `value` when target is None.

    `nodes` holds every node whose computation the rewrite takes over, the anchor included. Inputs that
    a rule only looked through (an upcast, a view) need not be listed: they stay while others use them.
    """

    kind: str
    anchor: Node
    nodes: set[Node]
    target: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    value: Node | None = None


@dataclass
class RewriteContext:
    """What a rule may consult besides the node: the module (for constants) and a constant folder."""

    gm: GraphModule
    fake_mode: FakeTensorMode | None
    constants: ConstantFolder


Rule = Callable[[Node, RewriteContext], "Rewrite | None"]


@dataclass(frozen=True)
class RewritePass:
    """A named list of rules. `reverse` visits consumers before producers, so that the largest pattern
    (anchored at its last node) is tried before its pieces; normalisation rules go forward."""

    name: str
    rules: tuple[Rule, ...]
    reverse: bool = False
    max_sweeps: int = 10

    def run(self, gm: GraphModule, *, strict: bool = False) -> Counter[str]:
        """Apply the rules until a sweep changes nothing. Returns how many rewrites of each kind were
        made (plus "layout_repair": views that needed a contiguous clone afterwards, see refresh_meta).
        A rule that raises is logged and skipped unless strict (tests run strict)."""
        ctx = RewriteContext(gm, find_fake_mode(gm), ConstantFolder(gm))
        counts: Counter[str] = Counter()
        for _ in range(self.max_sweeps):
            made = self._sweep(ctx, counts, strict)
            if not made:
                break
        if counts:
            gm.graph.eliminate_dead_code()
            if ctx.fake_mode is not None:
                repaired = refresh_meta(gm, ctx.fake_mode)
                if repaired:
                    counts["layout_repair"] += repaired
            gm.graph.lint()
            gm.recompile()
        return counts

    def _sweep(self, ctx: RewriteContext, counts: Counter[str], strict: bool) -> int:
        nodes = list(ctx.gm.graph.nodes)
        if self.reverse:
            nodes.reverse()
        erased: set[Node] = set()
        made = 0
        for node in nodes:
            if node in erased or node.op != "call_function" or not node.users:
                continue
            for rule in self.rules:
                rewrite = _try_rule(rule, node, ctx, strict)
                if rewrite is None:
                    continue
                legal, value = _check(rewrite, ctx)
                if not legal:
                    continue
                erased |= _apply(ctx, rewrite, value)
                counts[rewrite.kind] += 1
                made += 1
                break
        return made


def _try_rule(rule: Rule, node: Node, ctx: RewriteContext, strict: bool) -> Rewrite | None:
    try:
        return rule(node, ctx)
    except Exception:
        if strict:
            raise
        fusion_log.warning("rule %s failed at node %s; skipped", rule.__name__, node.name, exc_info=True)
        return None


def _check(rewrite: Rewrite, ctx: RewriteContext) -> tuple[bool, torch.Tensor | None]:
    """Is the rewrite legal (module docstring)? Also returns the replacement's fake value, if known."""
    anchor = rewrite.anchor
    for node in rewrite.nodes:
        if node is anchor:
            continue
        outside = [user.name for user in node.users if user not in rewrite.nodes]
        if outside:
            why_no_fuse(rewrite.kind, anchor, "%s is also used by %s", node.name, ", ".join(outside))
            return False, None
    consumed: list[Node] = []
    inputs = rewrite.args, rewrite.kwargs, rewrite.value
    map_arg(inputs, lambda n: consumed.append(n) if n in rewrite.nodes else None)  # type: ignore[arg-type]
    if consumed:
        why_no_fuse(rewrite.kind, anchor, "the replacement would read the replaced node %s", consumed[0].name)
        return False, None
    new_value = tensor_val(rewrite.value)
    if rewrite.target is not None and ctx.fake_mode is not None:
        args = map_arg(rewrite.args, lambda n: n.meta.get("val"))
        kwargs = map_arg(rewrite.kwargs, lambda n: n.meta.get("val"))
        try:
            with ctx.fake_mode:
                new_value = rewrite.target(*args, **kwargs)
        except Exception as error:  # a replacement that cannot even trace is not applied
            why_no_fuse(rewrite.kind, anchor, "the replacement fails on the matched shapes: %s", error)
            return False, None
    old_value = tensor_val(anchor)
    if isinstance(new_value, torch.Tensor) and old_value is not None:
        if new_value.shape != old_value.shape or new_value.dtype != old_value.dtype:
            new, old = (new_value.dtype, tuple(new_value.shape)), (old_value.dtype, tuple(old_value.shape))
            why_no_fuse(rewrite.kind, anchor, "the result would be %s %s, not %s %s", *new, *old)
            return False, None
    return True, new_value if isinstance(new_value, torch.Tensor) else None


def _apply(ctx: RewriteContext, rewrite: Rewrite, value: torch.Tensor | None) -> set[Node]:
    graph = ctx.gm.graph
    anchor = rewrite.anchor
    if rewrite.target is None:
        assert rewrite.value is not None
        replacement = rewrite.value
    else:
        with graph.inserting_before(anchor):
            replacement = graph.call_function(rewrite.target, rewrite.args, rewrite.kwargs)
        replacement.meta.update({k: anchor.meta[k] for k in _KEPT_META if k in anchor.meta})
        replacement.meta["ctpu_fused_from"] = sorted(n.name for n in rewrite.nodes)
        if value is not None:
            replacement.meta["val"] = value
        if fusion_log.isEnabledFor(logging.DEBUG):
            fusion_log.debug("fused %s at %s from %d nodes", rewrite.kind, anchor.name, len(rewrite.nodes))
    anchor.replace_all_uses_with(replacement)
    return _erase_dead(graph, rewrite.nodes)


def _erase_dead(graph: torch.fx.Graph, nodes: set[Node]) -> set[Node]:
    """Erase the matched nodes nobody uses any more. A rule may match ops FX calls impure because they
    can draw random numbers (sdpa with its dropout_p checked to be 0); mutating ops are never erased."""
    erased: set[Node] = set()
    progress = True
    while progress:
        progress = False
        for node in nodes - erased:
            schema = getattr(node.target, "_schema", None)
            if not node.users and not (schema is not None and schema.is_mutable):
                graph.erase_node(node)
                erased.add(node)
                progress = True
    return erased
