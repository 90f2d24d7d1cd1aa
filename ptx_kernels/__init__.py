"""PTX kernels for NVIDIA Hopper (sm_90a), written with pyptx: the GPU back end of ctpu's fused graphs.

- `kernel_for(op, shapes, dtypes, attrs)`: a kernel for a fused op of docs/fused_ops.md or mm/bmm.
- `kernel_for_subgraph(gm, shapes, dtypes)`: a kernel generated from an elementwise/reduction FX subgraph.
- `assemble(kernel)`: ptxas -arch=sm_90a check with register/spill figures (no GPU needed).
- `launch` / `run`: execution on torch CUDA tensors through cuda-python; `PtxLaunchError` without a GPU.

Importing this package needs only torch, numpy and pyptx.
"""

from ptx_kernels.core import KernelParam, PtxKernel, TensorArg, TmaSpec
from ptx_kernels.generator import SubgraphError, kernel_for_subgraph
from ptx_kernels.launch import NO_GPU, PtxLaunchError, launch, run
from ptx_kernels.ptxas import PtxasError, PtxasReport, assemble
from ptx_kernels.registry import kernel_for, supported_ops

__all__ = [
    "NO_GPU",
    "KernelParam",
    "PtxKernel",
    "PtxLaunchError",
    "PtxasError",
    "PtxasReport",
    "SubgraphError",
    "TensorArg",
    "TmaSpec",
    "assemble",
    "kernel_for",
    "kernel_for_subgraph",
    "launch",
    "run",
    "supported_ops",
]
