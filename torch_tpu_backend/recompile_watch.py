"""Calls dynamo stops handing to the ctpu backend, made visible (issue 11, item 5).

When a function compiled with backend="ctpu" recompiles past `torch._dynamo.config.recompile_limit` (each
generated token with a growing DynamicCache and dynamic=False is a new shape), dynamo marks its code "run
only": from then on a call whose guards match no compiled graph runs eagerly, on the CPU, without calling any
backend or hook. The only signal torch 2.13 gives is a warning it logs at that moment (convert_frame's "hit
config.recompile_limit"); no later call can be observed. This module listens for that record, and when the
frame was being compiled for ctpu: warns once per function (a CtpuFallbackWarning naming the cause and the
remedy) and counts the call in `stats.uncompiled_calls`.
"""

from __future__ import annotations

import logging
import sys
import threading
import warnings
from types import CodeType, FrameType
from typing import Any

from torch_tpu_backend import stats as exec_stats

LOGGER = "torch._dynamo.convert_frame"
_BACKEND_MODULES = ("torch_tpu_backend.backend_entry", "torch_tpu_backend.dynamo")  # by name: they import us
_installed = False
_lock = threading.Lock()
_warned: set[CodeType] = set()


def install() -> None:
    """Listen to dynamo's recompile-limit warning (idempotent)."""
    global _installed
    with _lock:
        if not _installed:
            logging.getLogger(LOGGER).addHandler(_LimitHandler(logging.WARNING))
            _installed = True


def reset_warnings() -> None:
    """Warn again for functions that have already warned (for tests)."""
    _warned.clear()


class _LimitHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        try:
            if isinstance(record.msg, str) and record.msg.startswith("torch._dynamo hit config."):
                _limit_hit(str(record.args[0]) if record.args else "recompile_limit")  # type: ignore[index]
        except Exception:  # a listener must never break dynamo's compile path
            self.handleError(record)


def _limit_hit(limit: str) -> None:
    compile_frame = _dynamo_compile_frame(sys._getframe())
    if compile_frame is None or not _is_ctpu(compile_frame.f_locals.get("compiler_fn")):
        return
    code = compile_frame.f_locals.get("code")
    where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})" if isinstance(code, CodeType) else "?"
    exec_stats.record_uncompiled_call(where)
    if code in _warned:
        return
    _warned.add(code)
    from torch._dynamo import config

    from fx_passes import CtpuFallbackWarning

    value = getattr(config, limit, "?")
    warnings.warn(
        f"ctpu: {where} recompiled {value} times (torch._dynamo.config.{limit}); dynamo no longer calls the ctpu "
        "backend for it: this call and every later one whose shapes have no compiled graph run eagerly ON THE CPU, "
        "uncounted (only this call is in ctpu stats.uncompiled_calls). Keep shapes fixed: for generation use a "
        "static KV cache, model.generate(..., cache_implementation=\"static\"); raising the limit compiles every "
        "new shape (seconds each).", CtpuFallbackWarning, stacklevel=2)


def _dynamo_compile_frame(frame: FrameType | None) -> FrameType | None:
    """The frame of convert_frame._compile on this thread's stack (it holds the code and the backend)."""
    while frame is not None:
        if frame.f_code.co_name == "_compile" and frame.f_globals.get("__name__") == LOGGER:
            return frame
        frame = frame.f_back
    return None


def _is_ctpu(compiler_fn: Any) -> bool:
    """Is dynamo's compiler function (possibly wrapped) the ctpu backend?"""
    seen = 0
    fn = compiler_fn
    while fn is not None and seen < 16:  # wrappers: _TorchCompileWrapper, partials, dynamo's backend wrappers
        if getattr(fn, "compiler_name", None) == "ctpu" or (getattr(fn, "__name__", None) == "ctpu_backend" and
                getattr(fn, "__module__", None) in _BACKEND_MODULES):
            return True
        fn = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None) or \
            getattr(fn, "func", None)
        seen += 1
    return False
