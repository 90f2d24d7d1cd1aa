"""Execution statistics of the last launches: the public API documented in the README.

    import torch_tpu_backend.stats as ctpu_stats
    ctpu_stats.reset()
    model(x)                       # compiled with backend="ctpu", or eager ops on ctpu tensors
    s = ctpu_stats.last()          # ExecutionStats since the last reset
    s.kernels_launched, s.bundles, s.cycles, s.mxu_busy_cycles, s.dma_bytes, s.fallback_ops
    s.host_bytes_uploaded, s.host_bytes_read_back   # what crossed between host memory and HBM
    s.uncompiled_calls             # calls dynamo ran eagerly without the backend (recompile limit)
    s.graphs_compiled, s.program_variants   # dynamo graphs the backend compiled; padded programs of
                                            # graphs with symbolic sizes (one per bucket of sizes)
"""

from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class LaunchRecord:
    """One launch: its name, the target it ran on, and that target's statistics (a RunStats)."""

    name: str
    target: str
    stats: Any
    profile: Any = None  # a device_sim.profile.Profile when the launch was profiled (option `profile`)


@dataclass
class ExecutionStats:
    kernels_launched: int = 0
    bundles: int = 0
    cycles: int = 0
    mxu_busy_cycles: int = 0
    macs: int = 0
    dma_bytes_loaded: int = 0
    dma_bytes_stored: int = 0
    fallback_ops: Counter[str] = field(default_factory=Counter)  # op name -> times it ran on CPU
    launches: list[LaunchRecord] = field(default_factory=list)
    # Host memory -> HBM and back, as the runtime copies them: a launch's CPU inputs (a resident copy only
    # when new or updated in place), its CPU outputs, the ctpu storages an eager CPU fallback reads and writes.
    # A user's own .to("ctpu") / .cpu() is not counted.
    host_bytes_uploaded: int = 0
    host_bytes_read_back: int = 0
    # function -> calls dynamo ran without the backend (recompile limit hit: recompile_watch.py)
    uncompiled_calls: Counter[str] = field(default_factory=Counter)
    graphs_compiled: int = 0  # graphs the backend compiled (forward and backward, static or symbolic)
    program_variants: int = 0  # padded programs compiled for graphs with symbolic sizes (one per bucket)

    @property
    def dma_bytes(self) -> int:
        return self.dma_bytes_loaded + self.dma_bytes_stored

    @property
    def mxu_utilization(self) -> float:
        return self.mxu_busy_cycles / self.cycles if self.cycles else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "kernels_launched": self.kernels_launched, "bundles": self.bundles, "cycles": self.cycles,
            "mxu_busy_cycles": self.mxu_busy_cycles, "mxu_utilization": self.mxu_utilization, "macs": self.macs,
            "dma_bytes_loaded": self.dma_bytes_loaded, "dma_bytes_stored": self.dma_bytes_stored,
            "fallback_ops": dict(self.fallback_ops),
            "host_bytes_uploaded": self.host_bytes_uploaded, "host_bytes_read_back": self.host_bytes_read_back,
            "uncompiled_calls": dict(self.uncompiled_calls),
            "graphs_compiled": self.graphs_compiled, "program_variants": self.program_variants,
            "launches": [{"name": r.name, "target": r.target, "cycles": r.stats.cycles} for r in self.launches],
        }


_lock = threading.Lock()
_current = ExecutionStats()
MAX_LAUNCH_RECORDS = 1000  # keep the per-launch list bounded in long runs


def reset() -> None:
    global _current
    with _lock:
        _current = ExecutionStats()


def last() -> ExecutionStats:
    """Statistics accumulated since the last reset() (a snapshot)."""
    with _lock:
        s = _current
        return ExecutionStats(s.kernels_launched, s.bundles, s.cycles, s.mxu_busy_cycles, s.macs,
                              s.dma_bytes_loaded, s.dma_bytes_stored, Counter(s.fallback_ops), list(s.launches),
                              s.host_bytes_uploaded, s.host_bytes_read_back, Counter(s.uncompiled_calls),
                              s.graphs_compiled, s.program_variants)


def record_launch(record: LaunchRecord) -> None:
    st = record.stats
    with _lock:
        _current.kernels_launched += 1
        _current.bundles += st.bundles
        _current.cycles += st.cycles
        _current.mxu_busy_cycles += st.mxu_busy_cycles
        _current.macs += st.macs
        _current.dma_bytes_loaded += st.dma_bytes_loaded
        _current.dma_bytes_stored += st.dma_bytes_stored
        if len(_current.launches) < MAX_LAUNCH_RECORDS:
            _current.launches.append(record)


def record_fallback(op_name: str, count: int = 1) -> None:
    with _lock:
        _current.fallback_ops[op_name] += count


def record_kernel_launch(count: int = 1) -> None:
    """A launch that has no CTPU statistics (a PTX kernel on a GPU)."""
    with _lock:
        _current.kernels_launched += count


def record_host_copies(uploaded: int, read_back: int) -> None:
    """Bytes copied from host memory into HBM and from HBM back to host memory."""
    with _lock:
        _current.host_bytes_uploaded += uploaded
        _current.host_bytes_read_back += read_back


def record_uncompiled_call(where: str) -> None:
    """A call of a compiled function that dynamo ran eagerly, without the backend (CPU work)."""
    with _lock:
        _current.uncompiled_calls[where] += 1


def record_graph_compiled() -> None:
    with _lock:
        _current.graphs_compiled += 1


def record_variant() -> None:
    """A padded program compiled for one bucket of a symbolic graph's sizes (torch_tpu_backend/dynamic.py)."""
    with _lock:
        _current.program_variants += 1
