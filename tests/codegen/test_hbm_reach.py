"""HBM at the size of the configuration: `large` maps 3 GiB, addressed by 32-bit registers (addresses past
2^31 are unsigned), its simulator HBM costs host memory only where it is written, and an index that would
address outside its tensor (an embedding id, a KV cache position) traps instead of reading or writing
another buffer."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch
from codegen_helpers import trace

from codegen import compile_graph
from device_sim.config import HBM_POISON, LARGE, SMALL, HardwareConfig
from device_sim.executable import ALIGN, InputRangeError, launch, pack_input, run_fresh
from device_sim.machine import CtpuTrap
from device_sim.runners import SimulatorRunner


def _lookup(table: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.embedding(ids, table) * 2.0 + 1.0


@pytest.mark.parametrize("bad_id", [10, 11, 1000, -1])
def test_an_embedding_id_outside_the_table_traps(bad_id: int) -> None:
    table, ids = torch.randn(10, 12), torch.tensor([[3, bad_id, 7]])
    exe = compile_graph(trace(_lookup, table, torch.tensor([[3, 1, 7]])), [table, ids], "small")
    with pytest.raises(InputRangeError, match="out of bounds") as err:  # the values' fault: the call may rerun
        run_fresh(exe, [table.numpy(), ids.numpy()], SimulatorRunner("small"))
    assert isinstance(err.value.__cause__, CtpuTrap) and err.value.__cause__.index_range
    outs, _ = run_fresh(exe, [table.numpy(), torch.tensor([[3, 9, 0]]).numpy()], SimulatorRunner("small"))
    np.testing.assert_array_equal(outs[0], _lookup(table, torch.tensor([[3, 9, 0]])).numpy())


def test_buffers_past_2_gib_on_large() -> None:
    """The table, the ids and the arena above 2^31: gathers, DMAs and address arithmetic are unsigned."""
    table, ids = torch.randn(300, 256), torch.tensor([[299, 0, 17, 150, 3]])
    exe = compile_graph(trace(_lookup, table, ids), [table, ids], "large")
    runner = SimulatorRunner("large")
    hbm = runner.hbm
    data = [pack_input(spec, x.numpy()) for spec, x in zip(exe.inputs, (table, ids), strict=True)]
    at = (5 << 29)  # 2.5 GiB
    addrs = []
    for d in data:
        hbm[at: at + d.nbytes] = d
        addrs.append(at)
        at += -(-d.nbytes // ALIGN) * ALIGN
    assert at + exe.arena_bytes <= LARGE.hbm_bytes and min(addrs) >= 1 << 31
    outs, _ = launch(exe, runner, hbm, addrs, at)
    np.testing.assert_array_equal(outs[0], _lookup(table, ids).numpy())


def test_large_maps_3_gib_and_leaves_the_poison_address_unmapped() -> None:
    assert LARGE.hbm_bytes == 3 << 30  # a 1B-parameter bf16 model (2.5 GB) and its KV cache fit
    for cfg in (SMALL, LARGE):
        assert cfg.hbm_bytes <= HBM_POISON & 0xFFFFFFFF
    with pytest.raises(ValueError, match="poison"):
        HardwareConfig("huge", lanes=8, vmem_rows=64, hbm_bytes=1 << 32, hbm_bytes_per_cycle=32, dma_latency=1,
                       imem_bundles=64)


@pytest.mark.slow  # load-dependent: 2,621 MiB in two full parallel suites (2026-11-27), under 1,536 alone (11 s)
def test_the_large_simulator_costs_host_memory_only_where_hbm_is_written() -> None:
    """A small program on `large` (3 GiB of HBM) runs in far less host memory: the image is zero pages until
    written (checked in a fresh process, whose peak resident size is its own)."""
    script = """
import resource, numpy as np, torch
from codegen import compile_graph
from codegen_helpers import trace
from device_sim.executable import run_fresh
from device_sim.runners import SimulatorRunner
x = torch.randn(64, 256)
exe = compile_graph(trace(lambda x: x * 2.0, x), [x], "large")
outs, _ = run_fresh(exe, [x.numpy()], SimulatorRunner("large"))
assert np.array_equal(outs[0], (x * 2.0).numpy())
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True,
                          cwd=__file__.rsplit("/", 1)[0])
    peak_mib = int(done.stdout.split()[-1])
    assert peak_mib < 1536, f"peak resident {peak_mib} MiB for a 64 KiB program on a 3 GiB HBM"
