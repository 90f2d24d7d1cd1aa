"""The profiler: what each unit of the CTPU did during one simulator run, as spans on tracks, per kernel, and
as a roofline table (docs/simulator_api.md, Profiling).

    sim = Simulator("small", profile=True); sim.load(program); sim.run()
    prof = analyze(sim.recording, kernels=exe.summary["kernels"])   # a Profile (kernels: optional names)
    write_trace(prof, "trace.json")             # Chrome trace JSON: ui.perfetto.dev, chrome://tracing
    print(format_roofline(prof.roofline()))

`Recording` is what the simulator fills while it runs (straight-line issue runs, stalls by cause, DMA and MXU
commands with their timing); `analyze` turns it into spans after the run, so the run itself only appends a
few tuples. Spans cover merged cycles: a slot's track has one span per run of consecutive cycles in which it
issued an operation. Kernels are the program's pc ranges between the `k{i}_*` labels the compiler writes
(the entry before `k0`, the exit after the last); a program without them is one kernel, "program".
Time: 1 cycle is 1/clock_mhz microseconds (1 ns at the configurations' 1 GHz); every span also carries its
start cycle and cycle count in its args.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from device_sim import isa
from device_sim.config import HardwareConfig
from device_sim.program import Program

KERNELS, LAYERS, STALLS, DMA, MXU_WEIGHTS, MXU_DATA = ("kernels", "layers", "stalls", "dma channel",
                                                      "mxu weight port", "mxu data port")
SLOT_TRACKS = tuple(f"slot {s.name}" for s in isa.SLOTS)
TRACKS = (KERNELS, LAYERS, STALLS, *SLOT_TRACKS, DMA, MXU_WEIGHTS, MXU_DATA)
STALL_CAUSES = ("wait", "dma_queue", "mxu_queue")  # as RunStats.stall_cycles names them
_KERNEL_LABEL = re.compile(r"(k\d+|exit)_\d+")
_LAYER = re.compile(r"^(.*?\blayers\.\d+)(\.|$)")


class Recording:
    """Raw events of one run, appended by the simulator and its units (only while profiling)."""

    def __init__(self, config: HardwareConfig, program: Program | None, slot_masks: list[tuple[bool, ...]]) -> None:
        self.config, self.program, self.slot_masks = config, program, slot_masks
        self.runs: list[list[int]] = []  # [first issue cycle, first pc, bundles]: consecutive cycles and pcs
        self.stalls: list[tuple[str, int, int, int, int]] = []  # (cause, first cycle, end, pc, flag or -1)
        self.dma_commands: list[tuple[int, int, int, int, int, bool]] = []  # (pc, start, xfer end, done, bytes, store)
        self.weight_loads: list[tuple[int, int, int, bool]] = []  # (pc, start, done, transposed)
        self.streams: list[tuple[int, int, int, int, int]] = []  # (pc, start, stream end, done, macs)
        self.end = 0  # the run's cycle count (set when it halts)
        self._last: list[int] = [-2, -2, 0]

    def issue(self, t: int, pc: int) -> None:
        r = self._last
        if t == r[0] + r[2] and pc == r[1] + r[2]:
            r[2] += 1
        else:
            self._last = [t, pc, 1]
            self.runs.append(self._last)

    def stall(self, cause: str, start: int, end: int, pc: int, flag: int = -1) -> None:
        self.stalls.append((cause, start, end, pc, flag))

    def dma(self, pc: int, start: int, xfer_end: int, done: int, nbytes: int, store: bool) -> None:
        self.dma_commands.append((pc, start, xfer_end, done, nbytes, store))

    def mxu_weights(self, pc: int, start: int, done: int, transposed: bool) -> None:
        self.weight_loads.append((pc, start, done, transposed))

    def mxu_stream(self, pc: int, start: int, stream_end: int, done: int, macs: int) -> None:
        self.streams.append((pc, start, stream_end, done, macs))


@dataclass
class Span:
    track: str
    name: str
    start: int  # cycle
    end: int  # cycle after the last
    args: dict[str, Any] = field(default_factory=dict)

    @property
    def cycles(self) -> int:
        return self.end - self.start


@dataclass
class KernelProfile:
    """One kernel (a pc range) over the run: what its bundles issued, waited on and commanded."""

    label: str  # "k3", "entry", "exit", or "program"
    name: str  # the FX node it came from when known, else its label
    kind: str = ""
    module: str = ""  # the nn.Module path of its FX node ("model.layers.0.mlp"), when known
    first_pc: int = 0
    cycles: int = 0  # the cycles its spans cover (its stalls included)
    bundles: int = 0
    slot_ops: dict[str, int] = field(default_factory=lambda: {s.name: 0 for s in isa.SLOTS})
    stall_cycles: dict[str, int] = field(default_factory=lambda: dict.fromkeys(STALL_CAUSES, 0))
    dma_commands: int = 0
    dma_bytes_loaded: int = 0
    dma_bytes_stored: int = 0
    weight_loads: int = 0
    macs: int = 0

    @property
    def layer(self) -> str:
        """'model.layers.3' for a kernel of the fourth decoder layer, else ''."""
        m = _LAYER.match(self.module)
        return m.group(1) if m else ""


@dataclass
class Profile:
    config: HardwareConfig
    cycles: int
    spans: list[Span]
    kernels: list[KernelProfile]
    has_layers: bool  # whether the kernels named their module paths (else the layer track is empty)

    def busy_cycles(self, track: str) -> int:
        return sum(s.cycles for s in self.spans if s.track == track)

    def roofline(self) -> list[dict[str, Any]]:
        """Per kernel: HBM bytes, MACs, cycles and the cycles each unit needs at least (HBM: bytes / bandwidth;
        MXU: streamed rows = MACs / N^2, or the weight port's N / weight_port_rows per tile if that is more;
        VPU: vector-slot ops per vector slot, or vld / vst ops); `bound` is the unit needing most, or "latency"
        when even that is under half the kernel's cycles (it mostly waits or issues scalar work);
        `pct_of_bound` = that unit's cycles / the kernel's cycles."""
        cfg = self.config
        n, vector_slots = cfg.mxu_dim, [s.name for s in isa.SLOTS_OF_UNIT[isa.Unit.VECTOR]]
        rows = []
        for k in self.kernels:
            need = {"hbm": (k.dma_bytes_loaded + k.dma_bytes_stored) / cfg.hbm_bytes_per_cycle,
                    "mxu": max(k.macs / (n * n), k.weight_loads * cfg.mxu_weight_cycles),
                    "vpu": max(sum(k.slot_ops[s] for s in vector_slots) / len(vector_slots),
                               k.slot_ops["vld"], k.slot_ops["vst"])}
            unit = max(need, key=lambda u: need[u])
            pct = 100.0 * need[unit] / k.cycles if k.cycles else 0.0
            rows.append({"kernel": k.label, "name": k.name, "kind": k.kind, "module": k.module, "cycles": k.cycles,
                         "share": k.cycles / self.cycles if self.cycles else 0.0, "bundles": k.bundles,
                         "stall_cycles": sum(k.stall_cycles.values()),
                         "hbm_bytes": k.dma_bytes_loaded + k.dma_bytes_stored, "dma_commands": k.dma_commands,
                         "macs": k.macs,
                         "weight_loads": k.weight_loads, "hbm_cycles": round(need["hbm"], 1),
                         "mxu_cycles": round(need["mxu"], 1), "vpu_cycles": round(need["vpu"], 1),
                         "bound": unit if pct >= 50.0 else "latency", "pct_of_bound": round(pct, 1)})
        return rows

    def chrome_trace(self) -> dict[str, Any]:
        """The Chrome trace event format (JSON object form): one thread per track, "X" complete events."""
        us = 1.0 / self.config.clock_mhz
        events: list[dict[str, Any]] = [{"ph": "M", "pid": 1, "tid": 0, "name": "process_name",
                                         "args": {"name": f"CTPU ({self.config.name})"}}]
        tids = {t: i + 1 for i, t in enumerate(TRACKS)}
        for track, tid in tids.items():
            events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_name", "args": {"name": track}})
            events.append({"ph": "M", "pid": 1, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
        for s in self.spans:
            events.append({"ph": "X", "pid": 1, "tid": tids[s.track], "name": s.name, "ts": round(s.start * us, 6),
                           "dur": round(s.cycles * us, 6), "args": {"cycle": s.start, "cycles": s.cycles, **s.args}})
        return {"traceEvents": events, "displayTimeUnit": "ns",
                "otherData": {"config": self.config.name, "clock_mhz": self.config.clock_mhz, "cycles": self.cycles}}


def analyze(rec: Recording, kernels: list[dict[str, Any]] | None = None) -> Profile:
    """The spans and per-kernel figures of a recording. `kernels`: the compiler's per-kernel summary
    (Executable.summary["kernels"]: kind, node, module), which names the `k{i}` pc ranges."""
    n_pcs = len(rec.slot_masks)
    profs, starts = _kernel_ranges(rec.program, kernels or [])
    region = np.searchsorted(np.array(starts), np.arange(n_pcs), side="right") - 1  # pc -> kernel
    runs = np.array(rec.runs, dtype=np.int64).reshape(-1, 3)
    lens = runs[:, 2]
    within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
    pcs, times = np.repeat(runs[:, 1], lens) + within, np.repeat(runs[:, 0], lens) + within  # per issued bundle
    masks = np.array(rec.slot_masks, dtype=bool).reshape(n_pcs, isa.NUM_SLOTS)
    executed = np.bincount(pcs, minlength=n_pcs)
    spans: list[Span] = []

    # kernels: each bundle covers its stall cycles and its issue cycle; the last kernel also the drain after halt
    ready = np.concatenate([[0], times[:-1] + 1])
    owner = region[pcs]
    firsts = np.concatenate([[0], np.flatnonzero(owner[1:] != owner[:-1]) + 1]) if owner.size else np.zeros(0, int)
    bounds = [*ready[firsts].tolist(), rec.end]
    for j, i in enumerate(firsts.tolist()):
        k = profs[owner[i]]
        spans.append(Span(KERNELS, k.name, bounds[j], bounds[j + 1], {"kernel": k.label, "kind": k.kind,
                                                                     "module": k.module}))
        k.cycles += bounds[j + 1] - bounds[j]
    for r, k in enumerate(profs):
        in_k = region == r
        k.bundles = int(executed[in_k].sum())
        k.slot_ops = {s.name: int(executed[in_k & masks[:, s.index]].sum()) for s in isa.SLOTS}
    spans += _layer_spans([s for s in spans if s.track == KERNELS], profs)

    # slots: one span per run of consecutive issue cycles using the slot
    for s in isa.SLOTS:
        used = times[masks[pcs, s.index]]
        if used.size:
            cut = np.flatnonzero(np.diff(used) != 1) + 1
            lo, hi = used[np.concatenate([[0], cut])], used[np.concatenate([cut - 1, [used.size - 1]])] + 1
            spans += [Span(SLOT_TRACKS[s.index], s.unit.value, a, b, {"ops": b - a})
                      for a, b in zip(lo.tolist(), hi.tolist(), strict=True)]

    for cause, start, end, pc, flag in rec.stalls:
        k = profs[region[pc]]
        k.stall_cycles[cause] += end - start
        spans.append(Span(STALLS, cause, start, end, {"pc": pc, "kernel": k.label} | ({"flag": flag} if flag >= 0
                                                                                      else {})))
    for pc, start, xfer_end, done, nbytes, store in rec.dma_commands:
        k = profs[region[pc]]
        k.dma_commands += 1
        if store:
            k.dma_bytes_stored += nbytes
        else:
            k.dma_bytes_loaded += nbytes
        spans.append(Span(DMA, "dma.st" if store else "dma.ld", start, xfer_end,
                          {"bytes": nbytes, "done": done, "pc": pc, "kernel": k.label}))
    for pc, start, done, transposed in rec.weight_loads:
        k = profs[region[pc]]
        k.weight_loads += 1
        spans.append(Span(MXU_WEIGHTS, "mxu.lwt" if transposed else "mxu.lw", start, done,
                          {"pc": pc, "kernel": k.label}))
    for pc, start, stream_end, done, macs in rec.streams:
        k = profs[region[pc]]
        k.macs += macs
        spans.append(Span(MXU_DATA, "mxu.mm", start, stream_end,
                          {"rows": stream_end - start, "macs": macs, "done": done, "pc": pc, "kernel": k.label}))
    spans.sort(key=lambda s: (TRACKS.index(s.track), s.start))
    return Profile(rec.config, rec.end, spans, profs, any(k.module for k in profs))


def _kernel_ranges(program: Program | None, kernels: list[dict[str, Any]]) -> tuple[list[KernelProfile], list[int]]:
    """The kernels in pc order and the first pc of each, from the `k{i}_*` / `exit_*` labels."""
    firsts: dict[str, int] = {}
    for label, pc in (program.labels if program is not None else {}).items():
        m = _KERNEL_LABEL.fullmatch(label)
        if m:
            firsts[m.group(1)] = min(pc, firsts.get(m.group(1), pc))
    if not firsts:
        return [KernelProfile("program", "program")], [0]
    if min(firsts.values()) > 0:
        firsts["entry"] = 0
    profs = []
    for label, pc in sorted(firsts.items(), key=lambda kv: kv[1]):
        info = kernels[int(label[1:])] if label[0] == "k" and int(label[1:]) < len(kernels) else {}
        node = info.get("node") or ""
        profs.append(KernelProfile(label, f"{label} {node}" if node else label, info.get("kind", ""),
                                   info.get("module") or "", pc))
    return profs, [k.first_pc for k in profs]


def _layer_spans(kernel_spans: list[Span], profs: list[KernelProfile]) -> list[Span]:
    """Consecutive kernel spans of one decoder layer (module path `...layers.N`) merged into one span."""
    by_label = {k.label: k for k in profs}
    out: list[Span] = []
    for s in kernel_spans:
        layer = by_label[s.args["kernel"]].layer
        if not layer:
            continue
        if out and out[-1].name == layer and out[-1].end == s.start:
            out[-1].end = s.end
            out[-1].args["kernels"] += 1
        else:
            out.append(Span(LAYERS, layer, s.start, s.end, {"kernels": 1}))
    return out


def write_trace(profile: Profile, path: str | Path) -> Path:
    """Write the Chrome trace JSON (opens in ui.perfetto.dev and chrome://tracing)."""
    path = Path(path)
    path.write_text(json.dumps(profile.chrome_trace(), separators=(",", ":")))
    return path


def format_roofline(rows: list[dict[str, Any]], top: int | None = None) -> str:
    """The roofline table as text (`top`: only the kernels with the most cycles, in program order)."""
    if top is not None:
        keep = {id(r) for r in sorted(rows, key=lambda r: -r["cycles"])[:top]}
        rows = [r for r in rows if id(r) in keep]
    head = (f"{'kernel':<7} {'name':<24} {'kind':<11} {'cycles':>10} {'%run':>5} {'bundles':>8} {'stalls':>9} "
            f"{'HBM B':>10} {'MACs':>11} {'hbm cyc':>9} {'mxu cyc':>9} {'vpu cyc':>9} {'bound':<7} {'%bound':>6}")
    lines = [head, "-" * len(head)]
    for r in rows:
        name = r["name"].removeprefix(r["kernel"]).strip() or "-"
        lines.append(f"{r['kernel']:<7} {name[:24]:<24} {r['kind'][:11]:<11} {r['cycles']:>10,} "
                     f"{100 * r['share']:>5.1f} {r['bundles']:>8,} {r['stall_cycles']:>9,} {r['hbm_bytes']:>10,} "
                     f"{r['macs']:>11,} {r['hbm_cycles']:>9,.0f} {r['mxu_cycles']:>9,.0f} {r['vpu_cycles']:>9,.0f} "
                     f"{r['bound']:<7} {r['pct_of_bound']:>6.1f}")
    return "\n".join(lines)
