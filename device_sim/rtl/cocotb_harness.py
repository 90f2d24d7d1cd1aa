"""cocotb bench for ctpu_tb_top: runs a batch of programs on the RTL core at Verilator speed.

Driver: for each job, copies the program and HBM image into the C++ model (ctypes, no per-word VPI),
pulses rst_n and awaits `done` (the clock is generated in SystemVerilog, so Python sleeps while the core
runs). Monitor: reads back sregs, vregs, vmem, the HBM bytes that changed, statistics, trap state and the
optional trace. The golden-model comparison happens in the calling process (device_sim/rtl/runner.py and
tests/rtl/), which owns the simulator; this bench checks only that every job finished.

Environment: CTPU_RTL_JOB names the pickled job file written by runner.py; results go to its "out" path.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import time

import cocotb
import numpy as np
from cocotb.triggers import ClockCycles, First, RisingEdge, Timer

_C = ctypes.c_void_p


def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(None)  # the simulator binary itself (linked with -rdynamic)
    for name in ("ctpu_tb_hbm", "ctpu_tb_imem", "ctpu_tb_sregs", "ctpu_tb_vregs", "ctpu_tb_vmem", "ctpu_tb_stats",
                 "ctpu_tb_trace", "ctpu_tb_args"):
        getattr(lib, name).restype = _C
    lib.ctpu_tb_trace_words.restype = ctypes.c_uint64
    lib.ctpu_tb_init.argtypes = [ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32]
    lib.ctpu_tb_set_run.argtypes = [ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int]
    return lib


def _array(ptr: int, n: int, dtype: np.dtype) -> np.ndarray:
    buf = (ctypes.c_uint8 * (n * np.dtype(dtype).itemsize)).from_address(ptr)
    return np.frombuffer(buf, dtype=dtype, count=n)


@cocotb.test()
async def run_jobs(dut) -> None:
    with open(os.environ["CTPU_RTL_JOB"], "rb") as f:
        spec = pickle.load(f)
    cfg = spec["config"]
    lanes, vmem_rows, hbm_bytes, imem = cfg["lanes"], cfg["vmem_rows"], cfg["hbm_bytes"], cfg["imem_bundles"]
    lib = _lib()
    lib.ctpu_tb_init(hbm_bytes, imem, vmem_rows, lanes)
    hbm = _array(lib.ctpu_tb_hbm(), hbm_bytes, np.uint8)
    imem_words = _array(lib.ctpu_tb_imem(), imem * 9, np.uint32)
    args = _array(lib.ctpu_tb_args(), 32, np.uint32)
    results = []
    errors = 0
    for job in spec["jobs"]:
        bundles = np.asarray(job["bundles"], dtype=np.uint32).reshape(-1, 9)
        imem_words[:] = 0
        imem_words[: bundles.size] = bundles.ravel()
        hbm[:] = 0
        for addr, data in job["hbm"]:
            hbm[addr : addr + len(data)] = np.frombuffer(data, np.uint8)
        initial = hbm.copy()
        args[:] = 0
        for reg, value in job.get("args", {}).items():
            args[reg] = value & 0xFFFFFFFF
        lib.ctpu_tb_set_run(len(bundles), job["max_cycles"], int(job["trace"]))
        dut.rst_n.value = 0
        await ClockCycles(dut.clk, 3)  # the harness samples imem and args, then the core's reset takes them
        await Timer(1, "ps")
        started = time.perf_counter()
        dut.rst_n.value = 1
        # Python sleeps until the core is done; a wall-clock guard in simulated time catches hangs.
        guard = Timer(2 * (job["max_cycles"] + 10_000_000), "ns")
        fired = await First(RisingEdge(dut.done), guard)
        wall = time.perf_counter() - started
        if fired is guard:
            errors += 1
            dut._log.error("job did not finish")
        stats = _array(lib.ctpu_tb_stats(), 32, np.uint64).copy()
        changed = np.nonzero(hbm != initial)[0].astype(np.int64)
        nwords = lib.ctpu_tb_trace_words()
        trace = _array(lib.ctpu_tb_trace(), nwords, np.uint32).copy() if nwords else np.zeros(0, np.uint32)
        results.append({
            "stats": stats,
            "sregs": _array(lib.ctpu_tb_sregs(), 32, np.uint32).copy(),
            "vregs": _array(lib.ctpu_tb_vregs(), 32 * 8 * lanes, np.uint32).copy().reshape(32, 8, lanes),
            "vmem": _array(lib.ctpu_tb_vmem(), vmem_rows * lanes, np.uint32).copy().reshape(vmem_rows, lanes),
            "hbm_changed": changed,
            "hbm_values": hbm[changed].copy(),
            "trace": trace,
            "wall_seconds": wall,
        })
    with open(spec["out"], "wb") as f:
        pickle.dump(results, f)
    assert errors == 0, f"{errors} jobs did not finish"
