"""The hook through which eager ops on ctpu tensors will run on the CTPU instead of the CPU.

The fallback (fallback.py) calls `run(op, args, kwargs)` first for every op without a C++ kernel. With an
eager compiler registered (`set_eager_compiler`), the op is compiled once per `kernel_key` (op, shapes,
strides, dtypes, non-tensor arguments) into a single-op CTPU kernel and launched on the ctpu tensors in
place (their HBM addresses: memory.hbm_address). A compiler returns None for what it cannot do; that
answer is cached too, and the op falls back to the CPU.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch._ops import OpOverload

# A compiled single-op kernel: called with the op's own (ctpu) arguments, returns what the op returns.
EagerKernel = Callable[..., Any]
# (op, args, kwargs) -> a kernel for every call with the same kernel_key, or None (run on the CPU).
EagerCompiler = Callable[[OpOverload, tuple[Any, ...], dict[str, Any]], EagerKernel | None]

_compiler: EagerCompiler | None = None
_cache: dict[Hashable, EagerKernel | None] = {}
_lock = threading.RLock()  # a compiler may itself run ops on ctpu tensors


def set_eager_compiler(compiler: EagerCompiler | None) -> None:
    """Install (or with None remove) the compiler of single-op kernels; clears the kernel cache."""
    global _compiler
    with _lock:
        _compiler = compiler
        _cache.clear()


def get_eager_compiler() -> EagerCompiler | None:
    return _compiler


def kernel_key(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Hashable:
    """What a compiled kernel may depend on: tensors by layout and dtype, everything else by value."""

    def leaf(x: Any) -> Hashable:
        if isinstance(x, torch.Tensor):
            return ("T", tuple(x.shape), tuple(x.stride()), x.storage_offset(), x.dtype, x.device.type)
        if isinstance(x, bool | int | float):  # by type and sign: -0.0 == 0.0 == False as dict keys
            return (type(x), repr(x))
        if isinstance(x, list | tuple):
            return tuple(leaf(v) for v in x)
        return x if isinstance(x, Hashable) else repr(x)

    return (op, leaf(args), tuple(sorted((k, leaf(v)) for k, v in kwargs.items())))


def run(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The op's result computed on the CTPU, or NotImplemented (then the CPU fallback runs it)."""
    compiler = _compiler
    if compiler is None:
        return NotImplemented
    key = kernel_key(op, args, kwargs)
    with _lock:
        if key not in _cache:
            _cache[key] = compiler(op, args, kwargs)
        kernel = _cache[key]
    return NotImplemented if kernel is None else kernel(*args, **kwargs)
