"""Launch a `PtxKernel` on torch CUDA tensors through the CUDA driver API (cuda-python, imported lazily).

cuModuleLoadData JIT-assembles the PTX for the current device, TMA tensor maps are encoded with
cuTensorMapEncodeTiled and passed by value (128-byte `.param`), and the launch goes on torch's current
stream, so the kernel orders with surrounding torch work. Without a CUDA device nothing is imported
and `PtxLaunchError` says so.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from ptx_kernels.core import PtxKernel, TensorArg, TmaSpec, numel

NO_GPU = "target 'ptx' needs an NVIDIA GPU with CUDA; none found (PTX was generated and checked with ptxas)"


class PtxLaunchError(RuntimeError):
    """A PTX kernel could not be launched (no GPU, no cuda-python, a driver error, or bad arguments)."""


def _driver() -> Any:
    if not torch.cuda.is_available():
        raise PtxLaunchError(NO_GPU)
    try:
        from cuda.bindings import driver  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cuda as driver  # older cuda-python layout
        except ImportError as exc:
            raise PtxLaunchError(
                "target 'ptx' needs cuda-python to launch kernels: pip install cuda-python"
            ) from exc
    return driver


def _check(driver: Any, result: Any, what: str) -> Any:
    """cuda-python returns (CUresult, *values); raise on anything but success, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if err != driver.CUresult.CUDA_SUCCESS:
        _, text = driver.cuGetErrorString(err)
        raise PtxLaunchError(f"{what} failed: {err} {text.decode() if isinstance(text, bytes) else text}")
    return values[0] if len(values) == 1 else values


class _Loaded:
    def __init__(self, module: Any, function: Any) -> None:
        self.module = module
        self.function = function


_LOADED: dict[tuple[int, str, int], _Loaded] = {}


def _load(driver: Any, kernel: PtxKernel) -> Any:
    device = torch.cuda.current_device()
    key = (device, kernel.name, hash(kernel.ptx))
    if key not in _LOADED:
        torch.cuda.synchronize()  # makes sure torch created (and made current) the primary context
        current = _check(driver, driver.cuCtxGetCurrent(), "cuCtxGetCurrent")
        if current is None or int(current) == 0:
            dev = _check(driver, driver.cuDeviceGet(device), "cuDeviceGet")
            ctx = _check(driver, driver.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
            _check(driver, driver.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        image = kernel.ptx.encode() + b"\0"
        module = _check(driver, driver.cuModuleLoadData(image), f"cuModuleLoadData({kernel.name})")
        function = _check(
            driver, driver.cuModuleGetFunction(module, kernel.name.encode()), "cuModuleGetFunction"
        )
        if kernel.smem_bytes > 48 * 1024:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _check(driver, driver.cuFuncSetAttribute(function, attr, kernel.smem_bytes), "cuFuncSetAttribute")
        _LOADED[key] = _Loaded(module, function)
    return _LOADED[key].function


def _check_tensor(arg: TensorArg, t: torch.Tensor, kernel: str) -> None:
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
        raise PtxLaunchError(f"{kernel}: argument {arg.name!r} must be a CUDA tensor")
    if t.dtype != arg.dtype or t.numel() != numel(arg.shape):
        raise PtxLaunchError(
            f"{kernel}: argument {arg.name!r} is {t.dtype}{tuple(t.shape)}, the kernel was "
            f"generated for {arg.dtype}{arg.shape}"
        )
    if arg.strides is None:
        if not t.is_contiguous():
            raise PtxLaunchError(f"{kernel}: argument {arg.name!r} must be contiguous")
    else:
        want = arg.strides[len(arg.strides) - t.dim() :]
        if tuple(t.stride()) != tuple(want):
            raise PtxLaunchError(f"{kernel}: argument {arg.name!r} has strides {t.stride()}, expected {want}")


_TMA_DTYPES = {
    torch.bfloat16: "CU_TENSOR_MAP_DATA_TYPE_BFLOAT16",
    torch.float32: "CU_TENSOR_MAP_DATA_TYPE_FLOAT32",
}
_SWIZZLE = {
    0: "CU_TENSOR_MAP_SWIZZLE_NONE",
    32: "CU_TENSOR_MAP_SWIZZLE_32B",
    64: "CU_TENSOR_MAP_SWIZZLE_64B",
    128: "CU_TENSOR_MAP_SWIZZLE_128B",
}


def _tensor_map(driver: Any, spec: TmaSpec, t: torch.Tensor) -> Any:
    rank = len(spec.dims)
    result = driver.cuTensorMapEncodeTiled(
        getattr(driver.CUtensorMapDataType, _TMA_DTYPES[spec.dtype]),
        rank,
        t.data_ptr(),
        [driver.cuuint64_t(d) for d in spec.dims],
        [driver.cuuint64_t(s) for s in spec.strides],
        [driver.cuuint32_t(b) for b in spec.box],
        [driver.cuuint32_t(1)] * rank,
        driver.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE,
        getattr(driver.CUtensorMapSwizzle, _SWIZZLE[spec.swizzle_bytes]),
        driver.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
        # FLOAT_OOB_FILL_NONE fills out-of-bounds box elements with zeros: the GEMM's tail handling.
        driver.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
    )
    return _check(driver, result, f"cuTensorMapEncodeTiled({spec.tensor})")


def launch(kernel: PtxKernel, tensors: dict[str, torch.Tensor]) -> None:
    """Launch `kernel` on torch's current stream; `tensors` maps every input and output name to a tensor."""
    driver = _driver()
    if torch.cuda.get_device_capability() != (9, 0):
        raise PtxLaunchError(
            f"{kernel.name}: sm_90a PTX needs a Hopper GPU (compute capability 9.0), found "
            f"{torch.cuda.get_device_name()} {torch.cuda.get_device_capability()}"
        )
    for arg in (*kernel.inputs, *kernel.outputs):
        if arg.name not in tensors:
            raise PtxLaunchError(f"{kernel.name}: missing tensor argument {arg.name!r}")
        _check_tensor(arg, tensors[arg.name], kernel.name)
    function = _load(driver, kernel)
    keep: list[Any] = []  # the values the pointer array points at must outlive the launch call
    for p in kernel.params:
        if p.kind == "ptr":
            keep.append(ctypes.c_uint64(tensors[p.source].data_ptr()))
        elif p.kind == "f32":
            keep.append(ctypes.c_float(float(p.value)))
        elif p.kind == "u32":
            keep.append(ctypes.c_uint32(int(p.value)))
        elif p.kind == "tmap":
            keep.append(_tensor_map(driver, p.tma, tensors[p.source]))
        else:
            raise PtxLaunchError(f"{kernel.name}: unknown parameter kind {p.kind!r}")
    addresses = [v.getPtr() if hasattr(v, "getPtr") else ctypes.addressof(v) for v in keep]
    pointer_array = (ctypes.c_void_p * max(1, len(addresses)))(*addresses)
    stream = torch.cuda.current_stream().cuda_stream
    _check(
        driver,
        driver.cuLaunchKernel(
            function,
            *kernel.grid,
            *kernel.block,
            kernel.smem_bytes,
            stream,
            ctypes.addressof(pointer_array),
            0,
        ),
        f"cuLaunchKernel({kernel.name})",
    )


def run(kernel: PtxKernel, *inputs: torch.Tensor) -> list[torch.Tensor]:
    """Allocate the outputs, launch with `inputs` in the kernel's input order, return the outputs."""
    if not torch.cuda.is_available():
        raise PtxLaunchError(NO_GPU)
    if len(inputs) != len(kernel.inputs):
        raise PtxLaunchError(f"{kernel.name}: expected {len(kernel.inputs)} inputs, got {len(inputs)}")
    device = inputs[0].device if inputs else torch.device("cuda")
    outputs = [torch.empty(a.shape, dtype=a.dtype, device=device) for a in kernel.outputs]
    named = {a.name: t for a, t in zip(kernel.inputs, inputs, strict=True)}
    named.update({a.name: t for a, t in zip(kernel.outputs, outputs, strict=True)})
    launch(kernel, named)
    return outputs
