"""The backend's options, read once: `torch.compile(..., options={...})` over the environment.

    target            "sim" (default, $CTPU_TARGET), "rtl", or "ptx"
    config            hardware configuration: "small" (default, $CTPU_CONFIG) or "large"
    dump_dir          write every stage of every graph here ($CTPU_DUMP_DIR)
    cache             use the on-disk compile cache (default True; $CTPU_CACHE=0 disables)
    matmul_precision  "highest" | "high" | "medium" (default: torch.get_float32_matmul_precision())
    pipeline          software-pipeline loops (default True)
    verify            run the compiler's schedule / allocation verifiers on every kernel (default False)
    dynamic_max       the largest value of a symbolic size without a declared maximum (default 65536;
                      `torch._dynamo.mark_dynamic(x, dim, min=, max=)` declares one per dim)
    profile           a folder: each launch on `sim` writes a Chrome / Perfetto trace there (device_sim.profile)
    max_cycles        a launch's cycle limit on `sim` (default 100,000,000: a runaway-program guard; a 16-layer
                      1B-geometry prefill of 2048 tokens takes about 530,000,000)

This is the only place the compile path reads the environment; the layers below get a frozen value.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from torch_tpu_backend import runtime
from torch_tpu_backend.dump import dump_root

MATMUL_PRECISIONS = ("highest", "high", "medium")


@dataclass(frozen=True)
class CompileOptions:
    target: str = "sim"
    config: str = "small"
    dump_dir: str | None = None
    cache: bool = True
    matmul_precision: str | None = None
    pipeline: bool = True
    verify: bool = False
    profile: str | None = None
    dynamic_max: int = 1 << 16
    max_cycles: int | None = None

    @classmethod
    def resolve(cls, options: dict[str, Any] | None) -> CompileOptions:
        """The options of one torch.compile call, completed from the environment, checked."""
        from device_sim.config import get_config
        from torch_tpu_backend import cache

        options = dict(options or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"ctpu backend: unknown option(s) {unknown}; known: {sorted(known)}")
        target = options.get("target") or runtime.default_target()
        if target not in runtime.TARGETS:
            raise ValueError(f"ctpu backend: target {target!r}; expected one of {runtime.TARGETS}")
        config = get_config(options.get("config") or runtime.default_config()).name
        precision = options.get("matmul_precision")
        if precision is not None and precision not in MATMUL_PRECISIONS:
            raise ValueError(f"ctpu backend: matmul_precision {precision!r}; expected one of {MATMUL_PRECISIONS}")
        dump = dump_root(options.get("dump_dir"))
        use_cache = bool(options.get("cache", True)) and cache.cache_dir() is not None
        profile = options.get("profile")
        if profile is not None and target != "sim":
            raise ValueError(f"ctpu backend: profile needs target 'sim' (the simulator records the trace), not "
                             f"{target!r}")
        max_cycles = options.get("max_cycles")
        if max_cycles is not None and (isinstance(max_cycles, bool) or not isinstance(max_cycles, int)
                                       or max_cycles < 1):
            raise ValueError(f"ctpu backend: max_cycles {max_cycles!r}; expected a positive int")
        return cls(target, config, str(dump) if dump else None, use_cache, precision,
                   bool(options.get("pipeline", True)), bool(options.get("verify", False)),
                   str(profile) if profile is not None else None, int(options.get("dynamic_max", 1 << 16)),
                   max_cycles)
