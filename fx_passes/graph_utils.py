"""Small helpers over FX nodes of a core-ATen graph: argument access, metadata, fake propagation.

Every node of a graph that the passes see carries `meta["val"]`: a FakeTensor (or a tuple of them, or
a Python scalar) with static sizes. `refresh_meta` recomputes these values after a rewrite.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch._ops import OpOverload
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.fx import GraphModule, Node
from torch.fx.node import map_arg

from .errors import CtpuPassError

aten = torch.ops.aten

# Views whose result must be viewable from the input's strides; refresh_meta repairs them.
_STRIDE_SENSITIVE = (aten.view.default, aten._unsafe_view.default)


def is_call(node: object, *targets: object) -> bool:
    """node is a call_function node of one of targets (or of any target when none are given)."""
    if not isinstance(node, Node) or node.op != "call_function":
        return False
    return not targets or node.target in targets


def op_arg(node: Node, name: str) -> Any:
    """The value of the schema argument `name` of an ATen call, whether given positionally, by keyword,
    or left to its default."""
    schema = node.target._schema  # type: ignore[union-attr]
    for index, argument in enumerate(schema.arguments):
        if argument.name != name:
            continue
        if not argument.kwarg_only and index < len(node.args):
            return node.args[index]
        if name in node.kwargs:
            return node.kwargs[name]
        return argument.default_value if argument.has_default_value() else None
    raise KeyError(f"{node.target} has no argument {name!r}")


def val(node: object) -> Any:
    return node.meta.get("val") if isinstance(node, Node) else None


def tensor_val(node: object) -> torch.Tensor | None:
    value = val(node)
    return value if isinstance(value, torch.Tensor) else None


def shape(node: object) -> tuple[int, ...] | None:
    value = tensor_val(node)
    return tuple(int(s) for s in value.shape) if value is not None else None


def dtype(node: object) -> torch.dtype | None:
    value = tensor_val(node)
    return value.dtype if value is not None else None


def number(value: object) -> float | None:
    """A Python int/float argument (not bool, not a tensor) as float, else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return None


def operand_orders(node: Node) -> Iterator[tuple[Any, Any]]:
    """Both orders of the two operands of a commutative binary op."""
    a, b = node.args[0], node.args[1]
    yield a, b
    yield b, a


def normalize_dims(dims: object, ndim: int) -> tuple[int, ...] | None:
    """A reduction's dim argument as sorted non-negative ints; None for 'all dims' or non-int input."""
    if dims is None:
        return None
    if isinstance(dims, int):
        dims = [dims]
    if not isinstance(dims, Sequence) or not all(isinstance(d, int) for d in dims):
        return None
    return tuple(sorted(d % ndim for d in dims))


def get_attr_value(gm: GraphModule, target: str) -> Any:
    value: Any = gm
    for part in target.split("."):
        value = getattr(value, part)
    return value


def find_fake_mode(gm: GraphModule) -> FakeTensorMode | None:
    for node in gm.graph.nodes:
        value = val(node)
        if isinstance(value, FakeTensor):
            return value.fake_mode
    return None


def run_node_fake(gm: GraphModule, node: Node, args: tuple, kwargs: dict) -> Any:
    """Evaluate one node on fake arguments (the caller holds the fake mode)."""
    if node.op == "call_function":
        return node.target(*args, **kwargs)  # type: ignore[operator]
    if node.op == "call_module":
        return gm.get_submodule(str(node.target))(*args, **kwargs)
    raise CtpuPassError(f"node {node.name}: cannot evaluate a {node.op} node")


def refresh_meta(gm: GraphModule, fake_mode: FakeTensorMode | None = None) -> int:
    """Recompute meta["val"] of every node from the placeholders' values, in one fake mode.

    A fused op returns a contiguous tensor where the ops it replaced may have produced another layout;
    an `aten.view` downstream that is no longer viewable gets a contiguous `clone` inserted before it.
    Returns the number of views so repaired. Another node whose fake evaluation fails keeps the value it
    had; one that has none raises CtpuPassError naming it.
    """
    fake_mode = fake_mode or find_fake_mode(gm)
    if fake_mode is None:
        raise CtpuPassError("refresh_meta: no placeholder carries a fake value; run ensure_meta first")
    repaired = 0
    env: dict[Node, Any] = {}
    for node in list(gm.graph.nodes):
        if node.op == "placeholder":
            node.meta["val"] = env[node] = to_fake_mode(val(node), fake_mode)
            continue
        if node.op == "output":
            continue
        if node.op == "get_attr":
            node.meta["val"] = env[node] = to_fake_mode(get_attr_value(gm, str(node.target)), fake_mode)
            continue
        args = map_arg(node.args, lambda n: env[n])
        kwargs = map_arg(node.kwargs, lambda n: env[n])
        with fake_mode:
            try:
                value = run_node_fake(gm, node, args, kwargs)
            except Exception as error:
                if node.target in _STRIDE_SENSITIVE:
                    value = _repair_view(gm, node, env)
                    repaired += 1
                elif "val" in node.meta:
                    # An op we never touched whose fake kernel fails now: its traced value still holds.
                    value = node.meta["val"]
                else:
                    raise CtpuPassError(f"node {node.name} ({node.format_node()}) fails: {error}") from error
        node.meta["val"] = env[node] = value
    return repaired


def to_fake_mode(value: Any, fake_mode: FakeTensorMode) -> Any:
    """value as a FakeTensor of fake_mode (graphs traced by make_fx may mix modes); non-tensors as is."""
    if not isinstance(value, torch.Tensor):
        return value
    if not isinstance(value, FakeTensor):
        return fake_mode.from_tensor(value)
    if value.fake_mode is fake_mode:
        return value
    with fake_mode:
        return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device=value.device)


def _repair_view(gm: GraphModule, view: Node, env: dict[Node, Any]) -> Any:
    source = view.args[0]
    assert isinstance(source, Node)
    with gm.graph.inserting_before(view):
        copy = gm.graph.call_function(
            aten.clone.default, (source,), {"memory_format": torch.contiguous_format}
        )
    copy.meta["val"] = env[copy] = aten.clone.default(env[source], memory_format=torch.contiguous_format)
    view.replace_input_with(source, copy)
    return view.target(env[copy], *view.args[1:])  # type: ignore[operator]


def ensure_meta(gm: GraphModule, example_inputs: Sequence[Any]) -> None:
    """Give every node a fake meta["val"], all of one fake mode; placeholders without a value take it
    from example_inputs (real or fake tensors)."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    missing = [n for n in placeholders if "val" not in n.meta]
    if missing and len(placeholders) != len(example_inputs):
        raise CtpuPassError(
            f"graph has {len(placeholders)} inputs but {len(example_inputs)} example inputs were given"
        )
    fake_mode = find_fake_mode(gm)
    if fake_mode is None:
        fakes = [x for x in example_inputs if isinstance(x, FakeTensor)]
        fake_mode = fakes[0].fake_mode if fakes else FakeTensorMode(allow_non_fake_inputs=True)
    for node, example in zip(placeholders, example_inputs, strict=False):
        if node in missing:
            node.meta["val"] = example
    refresh_meta(gm, fake_mode)


class ConstantFolder:
    """Evaluates nodes that depend on no graph input (only get_attr constants and creation ops), on
    real CPU tensors, memoised. Used to recognise masks built inside the graph (e.g. a causal mask).

    A graph of a model on a device creates its constants there (`arange(.., device="ctpu")`): they are
    evaluated on the CPU all the same, since the values are compared with CPU references at compile
    time, and running them on the device would be eager work (and host copies) at every compile."""

    MAX_ELEMENTS = 1 << 24

    def __init__(self, gm: GraphModule) -> None:
        self.gm = gm
        self._memo: dict[Node, Any] = {}

    def value(self, node: object) -> Any:
        """The node's concrete value, or None when it depends on an input or is not cheap to compute."""
        if not isinstance(node, Node):
            return node
        if node in self._memo:
            return self._memo[node]
        # Iterative post-order walk over the ancestors: graphs are deep, recursion is not an option.
        order: list[Node] = []
        seen: set[Node] = set()
        stack: list[tuple[Node, bool]] = [(node, False)]
        while stack:
            current, expanded = stack.pop()
            if expanded:
                order.append(current)
                continue
            if current in seen or current in self._memo:
                continue
            seen.add(current)
            if not self._foldable(current):
                self._memo[node] = None
                return None
            stack.append((current, True))
            stack.extend((n, False) for n in current.all_input_nodes)
        with unset_fake_temporarily():
            for current in order:
                self._memo[current] = self._evaluate(current)
        return self._memo[node]

    def _foldable(self, node: Node) -> bool:
        if node.op == "get_attr":
            return True
        if node.op != "call_function":
            return False
        if isinstance(node.target, OpOverload):
            if torch.Tag.nondeterministic_seeded in node.target.tags or node.target._schema.is_mutable:
                return False
        elif node.target is not operator.getitem:
            return False
        out = tensor_val(node)
        return out is None or out.numel() <= self.MAX_ELEMENTS

    def _evaluate(self, node: Node) -> Any:
        if node.op == "get_attr":
            value = get_attr_value(self.gm, str(node.target))
            if isinstance(value, FakeTensor):
                return None
            return value.cpu() if isinstance(value, torch.Tensor) else value
        inputs = {n: self._memo.get(n) for n in node.all_input_nodes}
        if any(v is None for v in inputs.values()):
            return None
        args = map_arg(node.args, lambda n: inputs[n])
        kwargs = map_arg(node.kwargs, lambda n: inputs[n])
        if kwargs.get("device") is not None:  # created on the CPU (class docstring)
            kwargs = {**kwargs, "device": torch.device("cpu")}
        try:
            return node.target(*args, **kwargs)  # type: ignore[operator]
        except Exception:  # an op that cannot run eagerly is simply not a constant
            return None


def extract_subgraph(gm: GraphModule, nodes: Sequence[Node]) -> GraphModule:
    """`nodes` (in graph order) as a graph of their own: values from outside become placeholders (with their
    meta), values used outside (or by the graph's output) become the outputs, as a tuple."""
    inside = set(nodes)
    graph = torch.fx.Graph()
    env: dict[Node, Node] = {}

    def outer(n: Node) -> Node:
        if n not in env:
            env[n] = graph.placeholder(n.name)
            env[n].meta = dict(n.meta)
        return env[n]

    for n in nodes:
        env[n] = graph.node_copy(n, outer)
    graph.output(tuple(env[n] for n in nodes if any(u not in inside for u in n.users)))
    return GraphModule(gm, graph)
