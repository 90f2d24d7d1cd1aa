"""Assemble PTX with `ptxas -arch=sm_90a -v --warn-on-spills` and report its resource figures.

Any ptxas warning is a failure: a kernel that spills or that ptxas had to second-guess is a bug in its
builder, and the error names the kernel so that a failing registry lookup is easy to trace.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ptx_kernels.core import PtxKernel

ARCH = "sm_90a"


class PtxasError(RuntimeError):
    """ptxas rejected a kernel or warned about it."""


@dataclass(frozen=True)
class PtxasReport:
    """Per-entry resource usage as ptxas prints it with -v."""

    kernel: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    static_smem_bytes: int
    barriers: int


_FUNC = re.compile(r"Compiling entry function '(\w+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers")
_SMEM = re.compile(r"(\d+) bytes smem")
_BARRIERS = re.compile(r"used (\d+) barriers")


def ptxas_path() -> str:
    path = shutil.which("ptxas")
    if path is None:
        raise PtxasError("ptxas not found on PATH (install the CUDA toolkit's ptxas to check PTX offline)")
    return path


_REPORTS: dict[tuple[str, str], PtxasReport] = {}


def assemble(kernel: PtxKernel | str, ptx_text: str | None = None) -> PtxasReport:
    """Run ptxas on one kernel; return its figures or raise PtxasError naming the kernel and the message.

    Reports are memoised per (name, PTX text): a graph with the same kernel twice pays ptxas once."""
    name = kernel.name if isinstance(kernel, PtxKernel) else kernel
    text = kernel.ptx if isinstance(kernel, PtxKernel) else ptx_text
    if text is None:
        raise ValueError("assemble(name, ptx_text): PTX text missing")
    key = (name, text)
    if key not in _REPORTS:
        _REPORTS[key] = _assemble(name, text)
    return _REPORTS[key]


def _assemble(name: str, text: str) -> PtxasReport:
    with tempfile.TemporaryDirectory(prefix="ctpu_ptxas_") as tmp:
        src = Path(tmp) / f"{name}.ptx"
        src.write_text(text)
        cmd = [
            ptxas_path(),
            f"-arch={ARCH}",
            "-v",
            "--warn-on-spills",
            str(src),
            "-o",
            str(Path(tmp) / "k.cubin"),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise PtxasError(f"ptxas failed on kernel {name!r}:\n{log.strip()}")
    warnings = [line for line in log.splitlines() if "warning" in line.lower()]
    if warnings:
        raise PtxasError(f"ptxas warned on kernel {name!r}:\n" + "\n".join(warnings))
    return parse_report(name, log)


def parse_report(name: str, log: str) -> PtxasReport:
    """Pick the figures of entry `name` out of a ptxas -v log."""
    section = log
    for chunk in log.split("ptxas info    : Compiling entry function")[1:]:
        match = _FUNC.search("Compiling entry function" + chunk)
        if match and match.group(1) == name:
            section = chunk
    spill = _SPILL.search(section)
    used = _USED.search(section)
    if spill is None or used is None:
        raise PtxasError(f"could not parse ptxas -v output for kernel {name!r}:\n{log}")
    smem = _SMEM.search(section)
    barriers = _BARRIERS.search(section)
    return PtxasReport(
        kernel=name,
        registers=int(used.group(1)),
        stack_bytes=int(spill.group(1)),
        spill_stores=int(spill.group(2)),
        spill_loads=int(spill.group(3)),
        static_smem_bytes=int(smem.group(1)) if smem else 0,
        barriers=int(barriers.group(1)) if barriers else 0,
    )
