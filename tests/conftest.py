"""Session-wide test setup. CI runs the suite on two workers (pytest-xdist, `-n 2` in the README's test
command, `--dist loadfile` in pyproject.toml: the tests of one file share a worker, so a module's fixtures,
like the training tests' compile cache, are built once). Each worker gets its share of the cores for
torch's intra-op threads. RTL tests in two workers take turns on a Verilator model (a lock in
device_sim/rtl/verilator_build.py)."""

from __future__ import annotations

import os

if os.environ.get("PYTEST_XDIST_WORKER_COUNT") and "OMP_NUM_THREADS" not in os.environ:
    # read by torch when it is first imported, which happens after this (a worker imports conftests first)
    workers = int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // workers))
