"""The layers import one way (device_sim <- codegen <- fx_passes <- torch_tpu_backend; ptx_kernels beside
codegen), no module imports itself back through others, and only the top layer reads the environment.
Every import counts: module level, function-local and TYPE_CHECKING ones."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYER = {"device_sim": 0, "codegen": 1, "ptx_kernels": 1, "fx_passes": 2, "torch_tpu_backend": 3}
# may import: its own package, and the packages of lower layers (ptx_kernels and codegen do not see each other)
ALLOWED = {pkg: {p for p, level in LAYER.items() if (level < LAYER[pkg] and p != "ptx_kernels") or p == pkg}
           for pkg in LAYER}
ALLOWED["torch_tpu_backend"].add("ptx_kernels")
ALLOWED["fx_passes"].discard("ptx_kernels")


def _modules() -> dict[str, Path]:
    mods = {}
    for pkg in LAYER:
        for path in (ROOT / pkg).rglob("*.py"):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            mods[name] = path
    return mods


def _is_module(name: str, mods: dict[str, Path]) -> bool:
    if name in mods:
        return True
    parent, _, leaf = name.rpartition(".")
    return parent in mods and any((ROOT / parent.replace(".", "/")).glob(f"{leaf}.*.so"))  # an extension


def _imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """module -> the modules of ours it imports (`from pkg import submodule` is the submodule)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        is_pkg = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
                    base = base[: len(base) - node.level + 1]
                    module = ".".join([*base, node.module] if node.module else base)
                else:
                    module = node.module or ""
                names = [f"{module}.{a.name}" if _is_module(f"{module}.{a.name}", mods) else module for a in node.names]
            for name in names:
                if name.split(".")[0] not in LAYER:
                    continue
                while name and name not in mods and not _is_module(name, mods):
                    name = name.rpartition(".")[0]
                if name and name != mod:
                    graph[mod].add(name)
    return graph


def test_layers_import_one_way() -> None:
    graph = _imports(_modules())
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets
                    if b.split(".")[0] not in ALLOWED[a.split(".")[0]])
    assert upward == [], "imports against the layering:\n" + "\n".join(upward)


def test_no_import_cycles() -> None:
    graph = _imports(_modules())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(set(graph) | {w for ws in graph.values() for w in ws}):
        if v not in index:
            visit(v)
    assert cycles == [], "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_only_the_top_layer_reads_the_environment() -> None:
    """Configuration is read once, in torch_tpu_backend, and passed down (the RTL tool paths aside)."""
    readers = []
    for mod, path in _modules().items():
        if mod.startswith("torch_tpu_backend") or mod.startswith("device_sim.rtl"):
            continue
        text = path.read_text()
        if "os.environ" in text or "getenv(" in text:
            readers.append(mod)
    assert readers == []
