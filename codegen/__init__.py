"""codegen: FX graphs -> MLIR (upstream passes) -> CTPU machine code. See docs/compiler.md."""

from codegen.compiler import compile_graph
from codegen.errors import CapacityError, UnsupportedError
from codegen.fx_ops import unsupported_reason

__all__ = ["CapacityError", "UnsupportedError", "compile_graph", "unsupported_reason"]
