"""Launching without a GPU raises PtxLaunchError with the documented message; ptxas errors name the kernel."""

import pytest
import torch

from ptx_kernels import NO_GPU, PtxasError, PtxLaunchError, assemble, kernel_for, run
from ptx_kernels.ptxas import parse_report


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA device is present; this checks the no-GPU path")
def test_launch_without_gpu_raises():
    kernel = kernel_for("ctpu::softmax", [(2, 64)], [torch.float32], {"dim": -1})
    with pytest.raises(PtxLaunchError) as info:
        run(kernel, torch.zeros(2, 64))
    assert str(info.value) == NO_GPU


def test_ptxas_error_names_kernel():
    bad = ".version 8.5\n.target sm_90a\n.address_size 64\n.visible .entry broken() { bogus.u32 %r0; }\n"
    with pytest.raises(PtxasError, match="broken"):
        assemble("broken", bad)


def test_parse_report():
    log = """ptxas info    : Compiling entry function 'k1' for 'sm_90a'
ptxas info    : Function properties for k1
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 256 bytes smem
"""
    report = parse_report("k1", log)
    assert (report.registers, report.spill_stores, report.spill_loads, report.static_smem_bytes) == (
        40,
        4,
        4,
        256,
    )


def test_bench_dry_run(capsys):
    from ptx_kernels import bench

    bench.main(["--dry-run"])
    out = capsys.readouterr().out
    assert '"mode": "dry-run"' in out and "gemm_8192" in out


@pytest.mark.parametrize(
    "name,peak",
    [
        ("NVIDIA H100 80GB HBM3", 3.35e12),  # what an H100 SXM calls itself
        ("NVIDIA H100 PCIe", 2.0e12),
        ("NVIDIA H100 NVL", 3.9e12),
        ("NVIDIA H200", 4.8e12),
        ("NVIDIA GH200 480GB", 4.0e12),
        ("NVIDIA A100-SXM4-80GB", None),
    ],
)
def test_bench_peak_by_device_name(name, peak):
    from ptx_kernels import bench

    assert bench._peak(name) == peak
