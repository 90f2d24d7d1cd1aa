"""Run CTPU programs on the RTL core (Verilator + cocotb), with the simulator's result types.

    from device_sim.rtl.runner import run_on_rtl
    result = run_on_rtl(program, {0x0: x.tobytes()}, config="small", args={1: 0x0})
    result.stats.cycles, result.hbm, result.vmem, result.sregs, result.vregs, result.trap

`run_batch_on_rtl` runs many programs in one simulator process (the Verilator model is built once and
cached under build/rtl/; starting the process costs ~1 s, a program then runs at Verilator speed).
Before a program is released the host-side loader checks it (device_sim/rtl/traps.py, as
`Simulator.load` does): a program it rejects is not run and its result carries the loader's trap.
`args` preset s1..s31 (the launch ABI). A trap does not raise: `result.trap` names it (code, pc, cycle);
`result.raise_if_trapped()` turns it into the simulator's `CtpuTrap`.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from device_sim import isa
from device_sim.config import HardwareConfig, get_config
from device_sim.program import Program
from device_sim.rtl import verilator_build as vb
from device_sim.rtl.traps import loader_trap
from device_sim.simulator import DEFAULT_MAX_CYCLES, CtpuTrap, RunStats
from device_sim.sv_package import TRAP_CODES

TOP = "ctpu_tb_top"
TRAP_NAMES = [name for name, _ in TRAP_CODES]

HbmImage = dict[int, bytes] | np.ndarray


@dataclass
class RtlTrap:
    code: str  # a TRAP_CODES name, e.g. "VMEM_OOB"
    pc: int
    cycle: int

    def __str__(self) -> str:
        return f"RTL trap {self.code} at bundle {self.pc}, cycle {self.cycle}"


@dataclass
class RtlResult:
    stats: RunStats
    sregs: np.ndarray  # uint32 (32,)
    vregs: np.ndarray  # uint32 (32, 8, N)
    vmem: np.ndarray  # uint32 (vmem_rows, N)
    hbm: np.ndarray  # uint8 (hbm_bytes,)
    trap: RtlTrap | None = None
    trace: list[tuple[Any, ...]] | None = None  # the simulator's trace format
    wall_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def raise_if_trapped(self) -> None:
        if self.trap is not None:
            raise CtpuTrap(f"RTL trap {self.trap.code}", self.trap.pc, self.trap.cycle)


@dataclass
class RtlJob:
    program: Program
    hbm: HbmImage
    max_cycles: int = DEFAULT_MAX_CYCLES
    trace: bool = False
    args: dict[int, int] = field(default_factory=dict)  # launch arguments: sreg number (1..31) -> value
    loader: bool = True  # False: release the core without the loader's check (tests of fetch-time traps)


def _hbm_regions(hbm: HbmImage) -> list[tuple[int, bytes]]:
    if isinstance(hbm, np.ndarray):
        data = np.ascontiguousarray(hbm).view(np.uint8).reshape(-1)
        nz = np.nonzero(data)[0]
        if nz.size == 0:
            return []
        # runs of nonzero bytes, merged when close, so a sparse 16 MiB image travels as a few chunks
        lo, hi = int(nz[0]), int(nz[-1]) + 1
        return [(lo, data[lo:hi].tobytes())]
    return [(int(a), bytes(np.ascontiguousarray(b).view(np.uint8).tobytes()) if isinstance(b, np.ndarray)
             else bytes(b)) for a, b in hbm.items()]


def _config_params(cfg: HardwareConfig) -> dict[str, object]:
    if (cfg.vmem_port_rows, cfg.weight_port_rows) != (1, 1):  # ctpu_dma / ctpu_mxu move one vmem row per cycle
        raise ValueError(f"{cfg.name}: the RTL implements a one-row vmem port (vmem_port_rows and weight_port_rows "
                         f"1), not {cfg.vmem_port_rows} and {cfg.weight_port_rows}; simulate this configuration "
                         "with the simulator")
    return {
        "LANES": cfg.lanes, "VMEM_ROWS": cfg.vmem_rows, "HBM_BYTES": f"64'd{cfg.hbm_bytes}",
        "BPC": cfg.hbm_bytes_per_cycle, "DMA_LATENCY": cfg.dma_latency, "DMA_QUEUE": cfg.dma_queue,
        "MXU_QUEUE": cfg.mxu_queue, "IMEM_BUNDLES": cfg.imem_bundles,
    }


def build(config: str | HardwareConfig = "small", waves: bool = False):  # -> runner
    cfg = get_config(config)
    return vb.build(f"core_{cfg.name}", TOP, vb.HARNESS_SOURCES, parameters=_config_params(cfg), waves=waves)


def _decode_trace(words: np.ndarray) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    i, n = 0, words.size
    while i < n:
        kind, lo, hi, idx, nw = (int(x) for x in words[i : i + 5])
        cycle = lo | (hi << 32)
        data = words[i + 5 : i + 5 + nw]
        i += 5 + nw
        if kind == 0:
            out.append((cycle, idx))
        elif kind == 1:
            out.append(("w", cycle, f"s{idx}", int(data[0])))
        else:
            out.append(("w", cycle, f"v{idx}", data.astype("<u4").tobytes()))
    return out


def _result(cfg: HardwareConfig, job: RtlJob, raw: dict[str, Any]) -> RtlResult:
    s = [int(x) for x in raw["stats"]]
    stats = RunStats(cfg.name)
    stats.cycles, stats.bundles = s[0], s[1]
    stats.stall_cycles = {"wait": s[6], "dma_queue": s[7], "mxu_queue": s[8]}
    stats.slot_ops = {slot.name: s[16 + slot.index] for slot in isa.SLOTS}
    stats.mxu_busy_cycles, stats.mxu_weight_loads = s[9], s[10]
    stats.macs = s[9] * cfg.lanes * cfg.lanes
    stats.dma_commands, stats.dma_bytes_loaded, stats.dma_bytes_stored = s[11], s[12], s[13]
    stats.wall_seconds = raw["wall_seconds"]
    hbm = np.zeros(cfg.hbm_bytes, np.uint8)
    for addr, data in _hbm_regions(job.hbm):
        hbm[addr : addr + len(data)] = np.frombuffer(data, np.uint8)
    hbm[raw["hbm_changed"]] = raw["hbm_values"]
    stats.hbm_written = _runs(raw["hbm_changed"])
    trap = RtlTrap(TRAP_NAMES[s[3]], s[4], s[5]) if s[2] else None
    return RtlResult(stats=stats, sregs=raw["sregs"], vregs=raw["vregs"], vmem=raw["vmem"], hbm=hbm, trap=trap,
                     trace=_decode_trace(raw["trace"]) if job.trace else None, wall_seconds=raw["wall_seconds"])


def _runs(indices: np.ndarray) -> list[tuple[int, int]]:
    """[lo, hi) runs of consecutive byte indices (what the RTL changed: a store of unchanged bytes needs no
    read-back, so this stands for the simulator's `hbm_written`)."""
    if indices.size == 0:
        return []
    breaks = np.nonzero(np.diff(indices) != 1)[0]
    starts = np.concatenate([[indices[0]], indices[breaks + 1]])
    ends = np.concatenate([indices[breaks], [indices[-1]]]) + 1
    return [(int(a), int(b)) for a, b in zip(starts, ends, strict=True)]


def _rejected(cfg: HardwareConfig, job: RtlJob, trap: RtlTrap) -> RtlResult:
    """The loader refused the program: nothing ran, the state is the launch state."""
    sregs = np.zeros(isa.NUM_SREGS, np.uint32)
    for reg, value in job.args.items():
        sregs[reg] = value & 0xFFFFFFFF
    hbm = np.zeros(cfg.hbm_bytes, np.uint8)
    for addr, data in _hbm_regions(job.hbm):
        hbm[addr : addr + len(data)] = np.frombuffer(data, np.uint8)
    return RtlResult(stats=RunStats(cfg.name), sregs=sregs,
                     vregs=np.zeros((isa.NUM_VREGS, cfg.sublanes, cfg.lanes), np.uint32),
                     vmem=np.zeros((cfg.vmem_rows, cfg.lanes), np.uint32), hbm=hbm, trap=trap,
                     trace=[] if job.trace else None)


def run_batch_on_rtl(jobs: list[RtlJob], config: str | HardwareConfig = "small", waves: bool = False,
                     wave_file: str | os.PathLike[str] | None = None) -> list[RtlResult]:
    """Run every job in one Verilator process; results in job order. `waves=True` builds the FST-tracing
    variant and writes `wave_file` (default build/rtl/ctpu_rtl.fst)."""
    cfg = get_config(config)
    for job in jobs:
        if len(job.program) > cfg.imem_bundles:
            raise ValueError(f"program has {len(job.program)} bundles; imem holds {cfg.imem_bundles}")
        for reg in job.args:
            if not 1 <= reg < isa.NUM_SREGS:
                raise ValueError(f"launch argument register s{reg}: must be s1..s{isa.NUM_SREGS - 1}")
    rejected: dict[int, RtlResult] = {}
    for i, job in enumerate(jobs):
        bad = loader_trap(job.program) if job.loader else None
        if bad is not None:
            rejected[i] = _rejected(cfg, job, RtlTrap(bad.code, bad.pc, bad.cycle))
    to_run = [j for i, j in enumerate(jobs) if i not in rejected]
    ran = iter(_run_jobs(cfg, to_run, waves, wave_file) if to_run else [])
    return [rejected[i] if i in rejected else next(ran) for i in range(len(jobs))]


def _run_jobs(cfg: HardwareConfig, jobs: list[RtlJob], waves: bool, wave_file: str | os.PathLike[str] | None
              ) -> list[RtlResult]:
    runner = build(cfg, waves=waves)
    with tempfile.TemporaryDirectory(prefix="ctpu_rtl_") as tmp:
        job_path, out_path = os.path.join(tmp, "job.pkl"), os.path.join(tmp, "out.pkl")
        spec = {
            "config": {"lanes": cfg.lanes, "vmem_rows": cfg.vmem_rows, "hbm_bytes": cfg.hbm_bytes,
                       "imem_bundles": cfg.imem_bundles},
            "jobs": [{"bundles": np.array(j.program.bundles, dtype=np.uint32).reshape(-1, isa.NUM_SLOTS),
                      "hbm": _hbm_regions(j.hbm), "max_cycles": int(j.max_cycles), "trace": j.trace,
                      "args": {int(k): int(v) & 0xFFFFFFFF for k, v in j.args.items()}}
                     for j in jobs],
            "out": out_path,
        }
        with open(job_path, "wb") as f:
            pickle.dump(spec, f)
        fst = str(wave_file) if wave_file is not None else os.path.join(str(vb.BUILD_ROOT), "ctpu_rtl.fst")
        test_args = [f"+ctpu_fst={os.path.abspath(fst)}"] if waves else []
        vb.run_test(runner, TOP, "device_sim.rtl.cocotb_harness", extra_env={"CTPU_RTL_JOB": job_path},
                    test_args=test_args)
        if not os.path.exists(out_path):
            raise RuntimeError("the RTL simulation produced no results (see the cocotb log above)")
        with open(out_path, "rb") as f:
            raws = pickle.load(f)
    return [_result(cfg, j, r) for j, r in zip(jobs, raws, strict=True)]


def run_on_rtl(program: Program, hbm_image: HbmImage | None = None, config: str | HardwareConfig = "small",
               max_cycles: int = DEFAULT_MAX_CYCLES, trace: bool = False, waves: bool = False,
               args: dict[int, int] | None = None, wave_file: str | os.PathLike[str] | None = None) -> RtlResult:
    """Run one program on the RTL core; `args` preset s1..s31 (the launch ABI). `result.hbm` is the final
    HBM. `waves=True` writes an FST waveform (build/rtl/ctpu_rtl.fst unless `wave_file` says)."""
    job = RtlJob(program, hbm_image if hbm_image is not None else {}, max_cycles, trace, dict(args or {}))
    return run_batch_on_rtl([job], config, waves=waves, wave_file=wave_file)[0]


class RtlRunner:
    """The RTL core as a `device_sim.runners.Runner`: same HBM in and out, same statistics, traps raise."""

    name = "rtl"

    def __init__(self, config: str | HardwareConfig = "small") -> None:
        self.config = get_config(config)
        self.last: RtlResult | None = None

    def run(self, program: Program, hbm: np.ndarray, args: dict[int, int],
            max_cycles: int | None = None) -> RunStats:
        result = run_on_rtl(program, hbm, config=self.config, args=args, max_cycles=max_cycles or DEFAULT_MAX_CYCLES)
        self.last = result
        result.raise_if_trapped()
        hbm[:] = result.hbm
        return result.stats
