"""Calls dynamo stops handing to the ctpu backend, made visible (issue 11, item 5).

When a function compiled with backend="ctpu" recompiles past `torch._dynamo.config.recompile_limit` (each
generated token with a growing DynamicCache and dynamic=False is a new shape), dynamo marks its code "run
only": from then on a call whose guards match no compiled graph runs eagerly, on the CPU, without calling any
backend or hook. The only signal torch 2.13 gives is a warning it logs at that moment (convert_frame's "hit
config.recompile_limit"). This module listens for that record, and when the frame was being compiled for
ctpu: warns once per function (a CtpuFallbackWarning naming the cause and the remedy) and from then on counts
every eager run of that code in `stats.uncompiled_calls`. An eager run is the only way that code object
executes (a call dynamo serves runs its transformed code), so a profile hook (sys.setprofile, installed only
once a limit is hit; one dict lookup per Python call) sees exactly the uncompiled calls. Where another
profiler already holds the hook, only the call that hit the limit is counted (the warning says so).
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
_watched: dict[CodeType, str] = {}  # code dynamo runs eagerly past its limit -> its name for stats
_running = threading.local()  # .frames: ids of the watched frames this thread is executing


def install() -> None:
    """Listen to dynamo's recompile-limit warning (idempotent)."""
    global _installed
    with _lock:
        if not _installed:
            logging.getLogger(LOGGER).addHandler(_LimitHandler(logging.WARNING))
            _installed = True


def reset_warnings() -> None:
    """Warn again for functions that have already warned, and stop counting their eager calls (for tests)."""
    _warned.clear()
    _watched.clear()
    if sys.getprofile() is _on_profile_event:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]


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
    counted = isinstance(code, CodeType) and _watch(code, where)
    if not counted:  # no hook: at least this call
        exec_stats.record_uncompiled_call(where)
    if code in _warned:
        return
    _warned.add(code)
    from torch._dynamo import config

    from fx_passes import CtpuFallbackWarning

    value = getattr(config, limit, "?")
    counting = ("each is counted in ctpu stats.uncompiled_calls" if counted else
                "uncounted (another profiler holds sys.setprofile: only this call is in ctpu stats.uncompiled_calls)")
    warnings.warn(
        f"ctpu: {where} recompiled {value} times (torch._dynamo.config.{limit}); dynamo no longer calls the ctpu "
        "backend for it: this call and every later one whose shapes have no compiled graph run eagerly ON THE CPU, "
        f"{counting}. Keep shapes fixed: for generation use a static KV cache, "
        "model.generate(..., cache_implementation=\"static\"); raising the limit compiles every new shape "
        "(seconds each).", CtpuFallbackWarning, stacklevel=2)


def _watch(code: CodeType, where: str) -> bool:
    """Count every eager run of `code` from now on; False when the profile hook is another profiler's."""
    current = sys.getprofile()
    if current is not None and current is not _on_profile_event:
        return False
    _watched[code] = where
    sys.setprofile(_on_profile_event)  # this thread (the frame about to run eagerly included)...
    threading.setprofile(_on_profile_event)  # ...and threads started later
    return True


def _on_profile_event(frame: FrameType, event: str, _arg: Any) -> None:
    """A run of watched code in dynamo's run-only mode is an uncompiled call (a direct call of the original
    function, an eager reference, runs without dynamo's callback); nested runs count once."""
    try:
        frames = getattr(_running, "frames", None)
        if frames is None:
            frames = _running.frames = set()
        if event == "call":
            where = _watched.get(frame.f_code)
            if where is not None and not frames and _run_only() and not _reset_by_dynamo(frame.f_code):
                frames.add(id(frame))
                exec_stats.record_uncompiled_call(where)
        elif event == "return" and frames:
            frames.discard(id(frame))
    except Exception:  # at interpreter exit the module's globals are gone; a hook must never raise
        pass


def _run_only() -> bool:
    """Is dynamo running this frame eagerly because its code is marked run-only? (Its callback is then False.)"""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    return get_eval_frame_callback() is False


def _reset_by_dynamo(code: CodeType) -> bool:
    """torch._dynamo.reset() drops a code's graphs and its run-only mark: it compiles again, stop counting."""
    from torch._C._dynamo.eval_frame import _debug_get_cache_entry_list

    if _debug_get_cache_entry_list(code):
        return False
    del _watched[code]
    return True


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
