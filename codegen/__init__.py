"""codegen: FX graphs -> MLIR (upstream passes) -> CTPU machine code. See docs/compiler.md."""

from codegen.compiler import CompiledGraph, compile_graph
from codegen.errors import CapacityError, UnsupportedError

__all__ = ["CapacityError", "CompiledGraph", "UnsupportedError", "compile_graph"]
