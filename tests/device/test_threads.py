"""Threads: the first torch.compile(backend="ctpu") from several threads at once, and the autograd worker
allocating HBM after an op failed on the main thread (it used to wait forever on a leaked allocator lock).

The multi-threaded cases run in a fresh interpreter (the first lookup of a backend happens once per
process) under a timeout, so that a regression fails instead of hanging the suite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from torch_tpu_backend.device import memory

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # a fresh interpreter imports torch and compiles: seconds; a hang is forever


def _run_fresh(script: str, tmp_path: Path) -> str:
    # As users run it: `import torch` loads the device (tests/codegen's conftest turns that off for the session)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DEVICE_BACKEND_AUTOLOAD"}
    env.update(PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               CTPU_CACHE_DIR=str(tmp_path / "cache"))
    try:
        done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                              env=env, cwd=ROOT, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung for {TIMEOUT_S} s (deadlock?):\n{e.stderr}")
    assert done.returncode == 0, done.stderr[-4000:]
    return done.stdout


def test_first_compile_from_four_threads_at_once(tmp_path: Path) -> None:
    out = _run_fresh("""
        import threading
        import torch

        barrier, errors = threading.Barrier(4), []

        def first_compile(i):
            try:
                barrier.wait()
                x = torch.full((8, 16), float(i))
                y = torch.compile(lambda t: t * 2.0 + 1.0, backend="ctpu")(x)
                torch.testing.assert_close(y, x * 2.0 + 1.0)
            except Exception as err:
                errors.append(repr(err))

        threads = [threading.Thread(target=first_compile, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        print("errors:", errors)
    """, tmp_path)
    assert "errors: []" in out


def test_backward_under_the_profiler_after_a_failed_op(tmp_path: Path) -> None:
    # The shape error frees the two temporary ctpu arguments while the error is set: the HBM free used to
    # run Python with it set, leaking the allocator's lock (and losing the error); backward's worker
    # thread then waited forever for that lock.
    out = _run_fresh("""
        import torch

        try:
            torch.matmul(torch.randn(5, 5, device="ctpu"), torch.randn(3, 3, device="ctpu"))
        except RuntimeError as err:
            assert "cannot be multiplied" in str(err), err
        model = torch.nn.Sequential(torch.nn.Linear(10, 20), torch.nn.ReLU(), torch.nn.Linear(20, 10)).to("ctpu")
        x = torch.randn(4, 10, device="ctpu", requires_grad=True)
        with torch.profiler.profile():
            model(x).sum().backward()
        assert x.grad is not None and x.grad.device.type == "ctpu"
        print("backward done")
    """, tmp_path)
    assert "backward done" in out


def test_a_failed_op_leaves_the_allocator_free_for_other_threads() -> None:
    with pytest.raises(RuntimeError, match="cannot be multiplied"):  # not SystemError: the error is kept
        torch.matmul(torch.randn(5, 5, device="ctpu"), torch.randn(3, 3, device="ctpu"))
    lock = memory.hbm_device().allocator._lock
    got: list[bool] = []

    def try_lock() -> None:
        got.append(lock.acquire(timeout=10))
        if got[-1]:
            lock.release()

    other = threading.Thread(target=try_lock)
    other.start()
    other.join()
    assert got == [True], "the HBM allocator's lock is still held after the failed op"
