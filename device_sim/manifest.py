"""Program manifests: how to set up, run and check a CTPU assembly program.

A manifest is a TOML file beside its program (`gemm.s` -> `gemm.toml`):

    [program]
    config = "small"                # the configuration it is written for
    max_cycles = 3_000_000          # the simulator's cycle limit for it (default: default_max_cycles)
    description = "..."

    [[inputs]]                      # one per HBM tensor the program reads
    name = "A"
    hbm_addr = 0x0
    shape = [512, 512]
    dtype = "bf16"                  # f32 | bf16 | i32 (row-major in HBM; bf16 values are rounded RNE)
    init = { dist = "normal", seed = 1, mean = 0.0, std = 1.0 }
        # dist: normal (mean, std) | uniform (low, high) | randint (low, high; i32) | file (path: .npy
        # beside the manifest)

    [[outputs]]                     # one per HBM tensor the program writes
    name = "C"
    hbm_addr = 0x100000
    shape = [512, 512]
    dtype = "f32"
    [[outputs.checks]]              # one or more: a reference in device_sim/programs/references.py
    reference = "gemm_mxu_order"
    params = { k_tile = 8 }
    max_ulp = 0                     # or atol = ..., rtol = ... (|out - ref| <= atol + rtol |ref|)
    why = "one line: why this tolerance"

`run_manifest` sets up HBM, runs the program on a runner (`device_sim.runners`: the simulator, the RTL
with `target="rtl"`, or an injected one), reads the outputs back and checks each against its references.
A program without a manifest just runs. Bad input is a ManifestError naming the manifest and the input or
output (an unreadable file, a .npy that is not one, an address outside the configuration's HBM); a NaN
where the reference has NaN, or the same infinity, is a match.
"""

from __future__ import annotations

import dataclasses
import importlib
import io
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from device_sim import numerics, sequences
from device_sim.asm import load_program
from device_sim.config import HardwareConfig, get_config
from device_sim.program import Program
from device_sim.runners import Runner, SimulatorRunner
from device_sim.simulator import DEFAULT_MAX_CYCLES, CtpuTrap

REFERENCES_MODULE = "device_sim.programs.references"
DTYPES = {"f32": np.float32, "bf16": np.uint16, "i32": np.int32}  # the HBM element types
# The cycle limit of a program that gives none: proportionate to its size, so that a runaway one stops in
# about a second rather than after DEFAULT_MAX_CYCLES (minutes). The shipped GEMM, the loopiest program,
# runs ~18,000 cycles a bundle of its code.
CYCLES_PER_BUNDLE = 20_000
MIN_MAX_CYCLES = 1_000_000
_NPY_MAGIC = b"\x93NUMPY"


class ManifestError(ValueError):
    """A manifest that cannot be used: names the file and the field."""


@dataclass(frozen=True)
class CheckSpec:
    reference: str
    params: dict[str, Any]
    max_ulp: float | None
    atol: float | None
    rtol: float | None
    why: str

    def tolerance(self) -> str:
        if self.max_ulp is not None:
            return f"max_ulp <= {self.max_ulp:g}"
        return f"|err| <= {self.atol or 0.0:g} + {self.rtol or 0.0:g} |ref|"


@dataclass(frozen=True)
class TensorSpec:
    name: str
    hbm_addr: int
    shape: tuple[int, ...]
    dtype: str
    init: dict[str, Any] = field(default_factory=dict)
    checks: tuple[CheckSpec, ...] = ()

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(DTYPES[self.dtype]).itemsize


@dataclass(frozen=True)
class Manifest:
    path: Path
    program: Path
    config: str
    max_cycles: int | None  # None: default_max_cycles(program)
    description: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]


def _need(table: dict[str, Any], key: str, where: str) -> Any:
    if key not in table:
        raise ManifestError(f"{where}: missing '{key}'")
    return table[key]


def _int(value: Any, what: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ManifestError(f"{where}: {what} must be an integer, got {value!r}")
    return value


def _tensor(t: Any, where: str, output: bool) -> TensorSpec:
    if not isinstance(t, dict):
        raise ManifestError(f"{where}: expected a table, got {t!r}")
    name = _need(t, "name", where)
    where = f"{where} '{name}'"
    shape = _need(t, "shape", where)
    if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
        raise ManifestError(f"{where}: shape must be a list of sizes >= 0, got {shape!r}")
    dtype = _need(t, "dtype", where)
    if dtype not in DTYPES:
        raise ManifestError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    checks = []
    for i, c in enumerate(t.get("checks", []) if output else []):
        cw = f"{where} check {i}"
        tol = {k: c.get(k) for k in ("max_ulp", "atol", "rtol")}
        if tol["max_ulp"] is None and tol["atol"] is None and tol["rtol"] is None:
            raise ManifestError(f"{cw}: give max_ulp or atol/rtol")
        checks.append(CheckSpec(_need(c, "reference", cw), dict(c.get("params", {})), tol["max_ulp"], tol["atol"],
                                tol["rtol"], _need(c, "why", cw)))
    if not output and not isinstance(_need(t, "init", where), dict):
        raise ManifestError(f"{where}: init must be a table, got {t['init']!r}")
    return TensorSpec(name, _int(_need(t, "hbm_addr", where), "hbm_addr", where), tuple(shape), dtype,
                      dict(t.get("init", {})), tuple(checks))


def manifest_path(program_path: str | Path) -> Path:
    return Path(program_path).with_suffix(".toml")


def load_manifest(path: str | Path) -> Manifest:
    """Read a manifest (the .toml, or the program's .s: the manifest beside it)."""
    path = Path(path)
    if path.suffix != ".toml":
        path = manifest_path(path)
    try:
        data = tomllib.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ManifestError(f"{path}: cannot read the manifest ({e.strerror or e})") from None
    except UnicodeDecodeError as e:
        raise ManifestError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except tomllib.TOMLDecodeError as e:
        raise ManifestError(f"{path}: {e}") from None
    prog = data.get("program", {})
    program = path.with_suffix(".s") if "source" not in prog else path.parent / prog["source"]
    inputs = tuple(_tensor(t, f"{path}: input", False) for t in data.get("inputs", []))
    outputs = tuple(_tensor(t, f"{path}: output", True) for t in data.get("outputs", []))
    max_cycles = _int(prog["max_cycles"], "max_cycles", f"{path}: [program]") if "max_cycles" in prog else None
    return Manifest(path, program, prog.get("config", "small"), max_cycles, prog.get("description", ""), inputs,
                    outputs)


def default_max_cycles(program: Program) -> int:
    """The cycle limit of a program that gives none: CYCLES_PER_BUNDLE a bundle of its code, at least
    MIN_MAX_CYCLES, at most the simulator's DEFAULT_MAX_CYCLES."""
    return min(DEFAULT_MAX_CYCLES, max(MIN_MAX_CYCLES, CYCLES_PER_BUNDLE * len(program)))


def make_input(spec: TensorSpec, base: Path) -> np.ndarray:
    """The input's values as float32 (f32, bf16: already bf16-rounded) or int32 (i32)."""
    init = spec.init
    dist = init.get("dist", "normal")
    rng = np.random.default_rng(init.get("seed", 0))
    if dist == "file":
        values = _load_npy(base / _need(init, "path", f"input '{spec.name}': init"), spec)
    elif dist == "normal":
        values = rng.normal(init.get("mean", 0.0), init.get("std", 1.0), spec.shape)
    elif dist == "uniform":
        values = rng.uniform(init.get("low", 0.0), init.get("high", 1.0), spec.shape)
    elif dist == "randint":
        values = rng.integers(init.get("low", 0), init.get("high", 100), spec.shape)
    else:
        raise ManifestError(f"input '{spec.name}': unknown dist {dist!r} (normal, uniform, randint, file)")
    if spec.dtype == "i32":
        return np.asarray(values).astype(np.int32)
    values = np.asarray(values, dtype=np.float32)
    return numerics.round_to_bf16(values) if spec.dtype == "bf16" else values


def _load_npy(path: Path, spec: TensorSpec) -> np.ndarray:
    where = f"input '{spec.name}': {path}"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ManifestError(f"{where}: cannot read it ({e.strerror or e})") from None
    if not data.startswith(_NPY_MAGIC):  # else numpy takes it for a pickle, and says so
        raise ManifestError(f"{where}: not a .npy file (it does not start with {_NPY_MAGIC!r})")
    try:
        values = np.load(io.BytesIO(data))  # allow_pickle=False: an object array is refused, never unpickled
    except (ValueError, EOFError) as e:  # a damaged .npy: numpy says what is wrong, but not about which file
        raise ManifestError(f"{where}: not a readable .npy file ({e})") from None
    if not isinstance(values, np.ndarray) or values.dtype.kind not in "biuf":
        raise ManifestError(f"{where}: not an array of numbers ({getattr(values, 'dtype', type(values).__name__)})")
    if tuple(values.shape) != spec.shape:
        raise ManifestError(f"{where}: has shape {values.shape}, not {spec.shape}")
    return values


def _check_hbm_range(spec: TensorSpec, kind: str, config: HardwareConfig, where: Path) -> None:
    if spec.hbm_addr < 0 or spec.hbm_addr + spec.nbytes > config.hbm_bytes:
        raise ManifestError(f"{where}: {kind} '{spec.name}': HBM bytes [{spec.hbm_addr:#x}, "
                            f"{spec.hbm_addr + spec.nbytes:#x}) outside the HBM of the {config.name} "
                            f"configuration ({config.hbm_bytes:#x} bytes)")


def _to_hbm(values: np.ndarray, dtype: str) -> np.ndarray:
    return numerics.f32_to_bf16_bits(values) if dtype == "bf16" else np.ascontiguousarray(values)


def _from_hbm(raw: np.ndarray, dtype: str) -> np.ndarray:
    return numerics.bf16_bits_to_f32(raw) if dtype == "bf16" else raw


@dataclass
class CheckResult:
    output: str
    reference: str
    passed: bool
    tolerance: str
    why: str
    max_abs_err: float
    max_rel_err: float
    max_ulp: float  # vs a float64 reference: fractional ulps of the exact value; else fp32 ulp distance
    mismatches: int


@dataclass
class ManifestResult:
    program: str
    config: str
    target: str
    stats: dict[str, Any]
    checks: list[CheckResult]
    outputs: dict[str, np.ndarray]

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready: the run's statistics and every check (outputs themselves are left out)."""
        return {"program": self.program, "config": self.config, "target": self.target, "passed": self.passed,
                "stats": self.stats, "checks": [dataclasses.asdict(c) for c in self.checks]}

    def summary(self) -> str:
        s = self.stats
        lines = [f"{self.program} on {self.target} ({self.config}): {s.get('cycles')} cycles, "
                 f"{s.get('bundles')} bundles, MXU utilization {s.get('mxu_utilization', 0.0):.4f}"]
        for c in self.checks:
            lines.append(f"  {c.output} vs {c.reference}: {'PASS' if c.passed else 'FAIL'} ({c.tolerance}; "
                         f"max abs {c.max_abs_err:.3g}, max rel {c.max_rel_err:.3g}, max ulp {c.max_ulp:.3g})")
        return "\n".join(lines)


def check_output(name: str, out: np.ndarray, ref: np.ndarray, check: CheckSpec) -> CheckResult:
    """Compare one output with one reference under the check's tolerance."""
    ref = np.asarray(ref)
    if ref.shape != out.shape:
        raise ManifestError(f"reference {check.reference} returned shape {ref.shape} for '{name}' {out.shape}")
    o64, r64 = out.astype(np.float64), ref.astype(np.float64)
    nan_ok = np.isnan(o64) == np.isnan(r64)
    same = (o64 == r64) | (np.isnan(o64) & np.isnan(r64))  # a match under any tolerance (inf, NaN included)
    finite = np.isfinite(o64) & np.isfinite(r64)
    with np.errstate(all="ignore"):
        abs_err = np.where(finite, np.abs(o64 - r64), np.where(o64 == r64, 0.0, np.inf))
        abs_err = np.where(np.isnan(o64) & np.isnan(r64), 0.0, abs_err)
        rel_err = np.where(abs_err == 0, 0.0, abs_err / np.abs(r64))
    if ref.dtype == np.float64:
        ulp = sequences.ulp_error(out, ref)
    else:
        ulp = sequences.ulp_distance(out, ref.astype(np.float32))
    with np.errstate(invalid="ignore"):  # 0 * inf: a tolerance at an infinite reference
        if check.max_ulp is not None:
            bad = ~(ulp <= check.max_ulp)
        else:
            bad = ~(abs_err <= (check.atol or 0.0) + (check.rtol or 0.0) * np.abs(r64))
    bad &= ~same
    bad |= ~nan_ok
    return CheckResult(name, check.reference, not bad.any(), check.tolerance(), check.why,
                       float(abs_err.max(initial=0.0)), float(np.nan_to_num(rel_err, nan=np.inf).max(initial=0.0)),
                       float(ulp.max(initial=0.0)), int(bad.sum()))


def run_manifest(program_path: str | Path, target: str = "sim", config: str | HardwareConfig | None = None,
                 runner: Runner | None = None, max_cycles: int | None = None) -> ManifestResult:
    """Assemble and run a program with its manifest's inputs; check every output against its references.

    target: "sim" (the simulator) or "rtl" (the Verilator RTL core); an injected `runner` (a
    `device_sim.runners.Runner`) replaces both. config: overrides the manifest's configuration. Without a
    manifest the program just runs (no checks).
    """
    program_path = Path(program_path)
    if program_path.suffix == ".toml":
        program_path = program_path.with_suffix(".s")
    mpath = manifest_path(program_path)
    manifest = load_manifest(mpath) if mpath.exists() else None
    cfg = get_config(config if config is not None else (manifest.config if manifest else "small"))
    if runner is None:
        runner = make_runner(target, cfg)
    program = load_program(program_path)
    if max_cycles is not None:
        limit, source = max_cycles, "the one given (--max-cycles)"
    elif manifest is not None and manifest.max_cycles is not None:
        limit, source = manifest.max_cycles, f"max_cycles in {mpath}"
    else:
        limit = default_max_cycles(program)
        source = (f"the default for a program of {len(program)} bundle(s) that sets no max_cycles "
                  f"({CYCLES_PER_BUNDLE:,} cycles a bundle, at least {MIN_MAX_CYCLES:,})")

    ins, outs = (manifest.inputs, manifest.outputs) if manifest else ((), ())
    for kind, specs in (("input", ins), ("output", outs)):
        for t in specs:
            _check_hbm_range(t, kind, cfg, mpath)
    try:
        values = {t.name: make_input(t, mpath.parent) for t in ins}
    except ManifestError as e:
        raise ManifestError(f"{mpath}: {e}") from None
    hbm = np.zeros(cfg.hbm_bytes, dtype=np.uint8)
    for t in ins:
        data = np.ascontiguousarray(_to_hbm(values[t.name], t.dtype)).view(np.uint8).reshape(-1)
        hbm[t.hbm_addr : t.hbm_addr + data.size] = data
    started = time.perf_counter()
    try:
        stats = runner.run(program, hbm, {}, limit).as_dict()
    except CtpuTrap as trap:
        if trap.reason.startswith("cycle limit"):
            trap.add_note(f"the limit, {limit:,} cycles, is {source}; set another with --max-cycles (ctpu run) "
                          "or max_cycles in the manifest")
        raise
    stats["run_seconds"] = time.perf_counter() - started
    if runner.name == "rtl" and stats.get("wall_seconds"):
        stats["rtl_cycles_per_second"] = stats["cycles"] / stats["wall_seconds"]

    refs = importlib.import_module(REFERENCES_MODULE)
    outputs, checks = {}, []
    for spec in outs:
        raw = hbm[spec.hbm_addr : spec.hbm_addr + spec.nbytes].view(DTYPES[spec.dtype]).reshape(spec.shape)
        out = _from_hbm(raw.copy(), spec.dtype)
        outputs[spec.name] = out
        for check in spec.checks:
            fn = getattr(refs, check.reference, None)
            if fn is None:
                raise ManifestError(f"{mpath}: no reference '{check.reference}' in {REFERENCES_MODULE}")
            checks.append(check_output(spec.name, out, fn(values, **check.params), check))
    return ManifestResult(program_path.name, cfg.name, runner.name, stats, checks, outputs)


def make_runner(target: str, config: HardwareConfig) -> Runner:
    """The built-in runner of a target: "sim" or "rtl" (Verilator + cocotb, imported only when used)."""
    if target == "sim":
        return SimulatorRunner(config)
    if target == "rtl":
        from device_sim.rtl.runner import RtlRunner

        return RtlRunner(config)
    raise ValueError(f"target {target!r} does not run CTPU programs (built in: 'sim', 'rtl')")
