"""The CTPU as a target (runners `sim` and `rtl`): codegen decides what it can lower, compiles a graph
to an `Executable`, and the runtime launches it on the device, reading ctpu tensors in place.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.fx

from device_sim import numerics
from device_sim.executable import ArgSpec, Executable, OutputView, pack_input, read_output
from device_sim.machine import CtpuTrap
from torch_tpu_backend import cache, runtime
from torch_tpu_backend import stats as exec_stats
from torch_tpu_backend.dump import GraphDump
from torch_tpu_backend.options import CompileOptions
from torch_tpu_backend.target import OutputSpec

log = logging.getLogger("ctpu.backend")
_DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


class CtpuTarget:
    """The CTPU on the simulator (`sim`) or the SystemVerilog core (`rtl`)."""

    fuse_elementwise = False  # the MLIR pipeline fuses elementwise chains itself

    def __init__(self, opts: CompileOptions) -> None:
        self.opts, self.name = opts, opts.target

    def unsupported_reason(self, node: torch.fx.Node) -> str | None:
        import codegen

        return codegen.unsupported_reason(node)

    def refusal_reason(self, error: Exception) -> str | None:
        import codegen

        return str(error) if isinstance(error, codegen.UnsupportedError) else None

    def compile(self, gm: torch.fx.GraphModule, example_inputs: Sequence[Any], name: str,
                dump: GraphDump) -> Executable:
        import codegen

        opts = self.opts
        precision = opts.matmul_precision or torch.get_float32_matmul_precision()
        key = cache.make_key(str(gm.graph), signature(example_inputs), opts.config, precision, _constants(gm),
                             opts.pipeline)
        exe, hit = cache.cached(cache.cache_dir() if opts.cache else None, key, lambda: codegen.compile_graph(
            gm, example_inputs, opts.config, matmul_precision=precision, pipeline=opts.pipeline,
            verify=opts.verify, progress=_progress_logger(name)), expect=Executable)
        log.info("ctpu: %s compiled (%d bundles, cache %s)", name, len(exe.program), "hit" if hit else "miss")
        for stage, text in exe.stages.items():
            stem, _, ext = stage.rpartition(".")
            dump.stage(f"{name}_{stem or ext}", text, ext if stem else "txt")
        dump.stage(f"{name}_program", exe.program.to_bytes(), "bin")
        dump.stage(f"{name}_summary", json.dumps(exe.summary, indent=2, default=str), "json")
        return exe

    def launch(self, exe: Executable, args: Sequence[Any], outputs: Sequence[OutputSpec], name: str,
               bumped_after: frozenset[int] = frozenset()) -> list[Any]:
        return launch_executable(exe, args, outputs, self.name, name, bumped_after, self.opts.profile,
                                 self.opts.max_cycles)


def launch_executable(exe: Executable, tensors: Sequence[Any], outputs: Sequence[OutputSpec], target: str,
                      name: str, bumped_after: frozenset[int] = frozenset(),
                      profile: str | None = None, max_cycles: int | None = None) -> list[torch.Tensor]:
    """Launch on the device of the executable's configuration. ctpu tensors already in its HBM are read in
    place (their addresses go in the argument table); CPU tensors are read from their resident HBM copies
    (torch_tpu_backend.resident: uploaded when new or updated in place, so a CPU model's weights cross once);
    anything else is copied into HBM for this launch. The arena lives for the launch. Each output is made as
    `outputs` says (a ctpu tensor written in HBM, or a CPU tensor). Host <-> HBM bytes go to the statistics.
    `profile`: a folder to write the launch's trace in (device_sim.profile); `max_cycles`: the simulator's
    cycle limit (None: its default)."""
    device = runtime.get_device(exe.config)
    with device.resident.launch_lock:  # no other launch evicts the copies this one reads
        try:
            return _launch(device, exe, tensors, outputs, target, name, bumped_after, profile, max_cycles)
        except runtime.HbmOutOfMemory:
            if not device.resident.evict():  # HBM full: the copies of host tensors are what can go
                raise
            device.allocator.uncount_oom()
            return _launch(device, exe, tensors, outputs, target, name, bumped_after, profile, max_cycles)


def _launch(device: runtime.CtpuDevice, exe: Executable, tensors: Sequence[Any], outputs: Sequence[OutputSpec],
            target: str, name: str, bumped_after: frozenset[int], profile: str | None,
            max_cycles: int | None) -> list[torch.Tensor]:
    allocations: list[int] = []
    uploaded = read_back = 0
    try:
        input_addrs, staged, resident = [], set(), set()
        for i, (spec, tensor) in enumerate(zip(exe.inputs, tensors, strict=True)):
            addr = _in_place_address(device, spec, tensor)
            if addr is None and isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and \
                    not tensor.is_inference():  # inference tensors have no version counter: not kept
                addr, nbytes = device.resident.address(
                    tensor, (spec.dtype,), lambda s=spec, t=tensor: pack_input(s, runtime.to_numpy_bits(t)),
                    device.hbm)
                resident.add(i)
                uploaded += nbytes
            elif addr is None:  # copied for this launch: a ctpu tensor not readable in place, an inference tensor
                host = runtime.to_numpy_bits(tensor)
                bits = pack_input(spec, host)
                if isinstance(tensor, torch.Tensor) and tensor.device.type == "ctpu":
                    read_back += host.nbytes
                addr = device.allocator.alloc(bits.nbytes)
                allocations.append(addr)
                staged.add(i)
                device.hbm[addr : addr + bits.nbytes] = bits
                uploaded += bits.nbytes
            input_addrs.append(addr)
        arena = device.allocator.alloc(max(exe.arena_bytes, 1))
        allocations.append(arena)
        try:
            arrays, run_stats = device.launch(exe, input_addrs, arena, target=target, name=name,
                                              max_cycles=max_cycles, profile_dir=profile)
        except CtpuTrap as e:
            if e.reason.startswith("cycle limit"):
                e.add_note(f"ctpu: {name} ({len(exe.program)} bundles) ran past the cycle limit: a long program "
                           "(a 2048-token prefill of many layers) needs a larger one, the backend option "
                           "max_cycles (torch.compile(..., options={'max_cycles': N}))")
            raise
        # The program wrote a CPU input's HBM copy in place: the host tensor gets the bytes it wrote (a KV cache
        # step: the new rows only), and a resident copy stays current through the version bump the caller makes
        # after the call (a CPU KV cache is not uploaded again next step; any other change to it is).
        for i in exe.mutated_inputs:
            if i in staged or i in resident:
                written = run_stats.written_within(input_addrs[i], input_addrs[i] + exe.inputs[i].nbytes)
                read_back += _copy_back(device, exe.inputs[i], input_addrs[i], tensors[i], written)
            if i in resident:
                device.resident.written_back(tensors[i], (exe.inputs[i].dtype,), 1 if i in bumped_after else 0)
    finally:
        for addr in allocations:
            device.allocator.release(addr)
    results = []
    for a, o in zip(arrays, outputs, strict=True):
        if o.device.type == "ctpu":
            results.append(_device_tensor(a, o.dtype))
        else:
            results.append(torch.from_numpy(a).to(o.dtype))
            read_back += a.nbytes
    exec_stats.record_host_copies(uploaded, read_back)
    return results


def _copy_back(device: runtime.CtpuDevice, spec: ArgSpec, addr: int, tensor: torch.Tensor,
               written: list[tuple[int, int]]) -> int:
    """The program wrote the HBM bytes `written` of input `tensor`'s copy (staged or resident) at `addr`: the
    caller's tensor gets those elements (all of it when it is not contiguous). Returns the bytes read back."""
    esize = spec.nbytes // max(1, int(np.prod(spec.shape)))
    if not tensor.is_contiguous():
        written = [(addr, addr + spec.nbytes)] if written else []
        strides = tuple(int(np.prod(spec.shape[i + 1:])) for i in range(len(spec.shape)))
        values = read_output(device.hbm, OutputView(spec.shape, strides, 0, spec.dtype, spec.nbytes, input=0),
                             [addr], 0)
        with torch.no_grad():
            tensor.copy_(torch.from_numpy(values))
        return spec.nbytes if written else 0
    flat = tensor.view(-1)
    for lo, hi in written:
        first, end = (lo - addr) // esize, -(-(hi - addr) // esize)
        view = OutputView((end - first,), (1,), first, spec.dtype, spec.nbytes, input=0)
        with torch.no_grad():
            flat[first:end].copy_(torch.from_numpy(read_output(device.hbm, view, [addr], 0)))
    return sum(hi - lo for lo, hi in written)


def _in_place_address(device: runtime.CtpuDevice, spec: ArgSpec, tensor: Any) -> int | None:
    """The HBM address of a ctpu tensor the program can read as it is (same device, dtype, contiguous)."""
    if not isinstance(tensor, torch.Tensor) or tensor.device.type != "ctpu":
        return None
    from torch_tpu_backend.device import memory

    if memory.hbm_device() is not device or not tensor.is_contiguous() or tensor.dtype != _DTYPES.get(spec.dtype):
        return None
    return memory.hbm_address(tensor)


def _device_tensor(values: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """A new ctpu tensor holding `values` (fp32), written straight into its HBM bytes: those of the device
    ctpu tensors live on (`memory.hbm_device()`), which need not be the one the program ran on (a graph
    compiled with options={"config": "large"} runs on a large device; its outputs were written into that
    device's HBM at the new tensor's address, and the tensor read zeros)."""
    from torch_tpu_backend.device import memory

    out = torch.empty(values.shape, dtype=dtype, device="ctpu")
    if dtype == torch.bfloat16:
        bits = numerics.f32_to_bf16_bits(values)
    else:
        bits = np.ascontiguousarray(values).astype(str(dtype).removeprefix("torch."), copy=False)
    addr = memory.hbm_address(out)
    memory.hbm_device().hbm[addr : addr + bits.nbytes] = bits.reshape(-1).view(np.uint8)
    return out


def signature(values: Sequence[Any]) -> tuple[Any, ...]:
    return tuple((tuple(v.shape), str(v.dtype), tuple(v.stride())) if isinstance(v, torch.Tensor) else repr(v)
                 for v in values)


def _constants(gm: torch.fx.GraphModule) -> bytes:
    """The bytes of the graph's constant tensors: part of the cache key (weights are not inputs here)."""
    h = hashlib.sha256()
    for node in gm.graph.find_nodes(op="get_attr"):
        value = getattr(gm, node.target, None)
        if isinstance(value, torch.Tensor):
            h.update(runtime.to_numpy_bits(value).tobytes())
    return h.digest()


def _progress_logger(name: str, every_seconds: float = 5.0) -> Callable[[int, int], None]:
    """A `compile_graph` progress callback: logs (INFO, logger "ctpu.backend") how many kernels of a graph
    are compiled, at most every few seconds, so a long compile shows it is moving."""
    last = time.monotonic()

    def report(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_seconds or done == total:
            last = now
            log.info("ctpu: %s: %d/%d kernels compiled", name, done, total)
    return report
