"""The boxed fallback for every aten op without a ctpu kernel: run it on the CPU.

For each op call: ask the eager hook (eager.py) for a CTPU kernel; otherwise copy the ctpu storages the
op touches to host storages, run the CPU kernel on host tensors with the same sizes, strides and storage
offsets, copy mutated storages back and move results to the device. Mirroring whole storages (not
tensors) is what keeps the semantics of the CPU: arguments that alias on the device alias on the host,
view ops return views of the device storage, in-place and out= ops write back through any view, and a
resize of an out= argument resizes the device storage.

Every op name warns once (CtpuFallbackWarning) and every call is counted in stats.fallback_ops.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch._ops import OpOverload
from torch.utils._pytree import tree_map

# one warning class for every CPU fallback, eager or compiled; from its leaf module: `import torch` loads this
# device, and may do so from inside `import fx_passes` (the package is then half initialized)
from fx_passes.errors import CtpuFallbackWarning
from torch_tpu_backend import stats
from torch_tpu_backend.device import eager
from torch_tpu_backend.device.random import default_generator

_warned: set[str] = set()
_global_rng_lock = threading.Lock()


def reset_fallback_warnings() -> None:
    """Warn again for ops that have already warned (for tests)."""
    _warned.clear()


def ctpu_fallback(op: OpOverload, *args: Any, **kwargs: Any) -> Any:
    """The PrivateUse1 fallback kernel registered in torch_tpu_backend.device.register()."""
    result = eager.run(op, args, kwargs)
    if result is not NotImplemented:
        return result
    _record(op.name())
    return run_on_cpu(op, args, kwargs)


def _record(name: str) -> None:
    stats.record_fallback(name)
    if name not in _warned:
        _warned.add(name)
        warnings.warn(f"ctpu: {name} has no CTPU kernel; it runs on the CPU (inputs copied to the host, "
                      "results back to HBM). Shown once per op.", CtpuFallbackWarning, stacklevel=3)


def _uint8_view(storage: torch.UntypedStorage, device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage)


def _set_bits(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Carry the lazy conjugate / negative bits over (they are metadata, not data)."""
    if src.is_conj():
        torch._C._set_conj(dst, True)
    if src.is_neg():
        torch._C._set_neg(dst, True)
    return dst


class _HostMirror:
    """Host copies of the ctpu storages an op touches, one per storage, and the way back."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host_of: dict[int, torch.UntypedStorage] = {}  # ctpu StorageImpl -> host storage
        self.device_of: dict[int, torch.UntypedStorage] = {}  # host StorageImpl -> ctpu storage

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        dev_storage = t.untyped_storage()
        host = self.host_of.get(dev_storage._cdata)
        if host is None:
            host = _uint8_view(dev_storage, t.device).cpu().untyped_storage()
            stats.record_host_copies(0, host.nbytes())
            self.host_of[dev_storage._cdata] = host
            self.device_of[host._cdata] = dev_storage
        h = torch.empty(0, dtype=t.dtype).set_(host, t.storage_offset(), t.size(), t.stride())
        return _set_bits(h, t)

    def to_device(self, h: torch.Tensor) -> torch.Tensor:
        if h._is_zerotensor():  # _efficientzerotensor (the gradient of sgn, ...): no data behind its storage
            return torch.zeros(h.size(), dtype=h.dtype, device=self.device)
        host = h.untyped_storage()
        dev_storage = self.device_of.get(host._cdata)
        if dev_storage is None:  # a new result: its whole host storage moves to HBM, layout kept
            dev_bytes = torch.empty(host.nbytes(), dtype=torch.uint8, device=self.device)
            dev_bytes.copy_(_uint8_view(host, torch.device("cpu")))
            stats.record_host_copies(host.nbytes(), 0)
            dev_storage = dev_bytes.untyped_storage()
            self.device_of[host._cdata] = dev_storage
        d = torch.empty(0, dtype=h.dtype, device=self.device).set_(dev_storage, h.storage_offset(), h.size(),
                                                                      h.stride())
        return _set_bits(d, h)

    def write_back(self, t: torch.Tensor, h: torch.Tensor, done: set[int]) -> None:
        """Make ctpu tensor `t` what its host mirror `h` became (data, and metadata if it was resized)."""
        dev_storage, host = t.untyped_storage(), h.untyped_storage()
        if dev_storage._cdata not in done:
            done.add(dev_storage._cdata)
            if host.nbytes() != dev_storage.nbytes():
                dev_storage.resize_(host.nbytes())
            if host.nbytes():
                _uint8_view(dev_storage, t.device).copy_(_uint8_view(host, torch.device("cpu")))
                stats.record_host_copies(host.nbytes(), 0)
        if (h.size(), h.stride(), h.storage_offset()) != (t.size(), t.stride(), t.storage_offset()):
            t.set_(dev_storage, h.storage_offset(), h.size(), h.stride())


def _is_ctpu(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type == "ctpu"


def _is_generator(arg: torch.Argument) -> bool:
    return "Generator" in str(arg.type)


def _target_device(values: list[Any]) -> torch.device:
    for v in values:
        for leaf in v if isinstance(v, list | tuple) else [v]:
            if _is_ctpu(leaf):
                return leaf.device
            if isinstance(leaf, torch.device) and leaf.type == "ctpu":
                return leaf
    return torch.device("ctpu", 0)


def run_on_cpu(op: OpOverload, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    schema = op._schema
    # Pair every value with its schema argument: positional first, then keyword. An omitted generator
    # argument is made explicit: it must become the ctpu generator, not the CPU's default.
    named = [(a, args[i] if i < len(args) else kwargs.get(a.name)) for i, a in enumerate(schema.arguments)
             if i < len(args) or a.name in kwargs or _is_generator(a)]
    device = _target_device([v for _, v in named])
    mirror = _HostMirror(device)
    generators: list[tuple[torch.Generator, torch.Generator]] = []

    def host_value(arg: torch.Argument, value: Any) -> Any:
        if _is_generator(arg):
            gen = value if value is not None else default_generator()
            if gen.device.type == "cpu":
                return gen
            host = torch.Generator()
            host.set_state(gen.get_state())
            generators.append((gen, host))
            return host
        if isinstance(value, torch.device) and value.type == "ctpu":
            return torch.device("cpu")
        if isinstance(value, bool | int | float | complex) and str(arg.type) == "Tensor":
            # The dispatcher hands wrapped-number tensors (Python scalars in a Tensor argument) to Python
            # as numbers; the CPU op wants them back as (double precision, like wrapped numbers) tensors.
            return torch.tensor(value, dtype=torch.float64 if isinstance(value, float) else None)
        return tree_map(lambda x: mirror.to_host(x) if _is_ctpu(x) else x, value)

    host_named = [(a, v, host_value(a, v)) for a, v in named]
    host_args = [h for _, _, h in host_named[:len(args)]]
    host_kwargs = {a.name: h for a, _, h in host_named[len(args):]}
    out = _with_ctpu_rng(op, lambda: op(*host_args, **host_kwargs))
    for gen, host in generators:
        gen.set_state(host.get_state())

    # Mutated arguments: copy their storages back (once each) before building the results.
    written: set[int] = set()
    originals: dict[str, Any] = {}
    for a, v, h in host_named:
        if a.alias_info is None:
            continue
        originals.update(dict.fromkeys(a.alias_info.before_set, v))
        if a.alias_info.is_write:
            pairs = zip(v, h, strict=True) if isinstance(v, list | tuple) else [(v, h)]
            for t, ht in pairs:
                if _is_ctpu(t):
                    mirror.write_back(t, ht, written)

    def device_value(ret: torch.Argument, value: Any) -> Any:
        alias = ret.alias_info
        if alias is not None and alias.is_write:  # in-place / out=: the caller's own tensor
            return originals[next(iter(alias.before_set))]
        return tree_map(lambda x: mirror.to_device(x) if isinstance(x, torch.Tensor) else x, value)

    if not schema.returns:
        return None
    if len(schema.returns) == 1:
        return device_value(schema.returns[0], out)
    return tuple(device_value(r, v) for r, v in zip(schema.returns, out, strict=True))


def _with_ctpu_rng(op: OpOverload, call: Callable[[], Any]) -> Any:
    """Seeded ops without a generator argument (native_dropout, ...) draw from the CPU's default
    generator: lend it the ctpu generator's state for the call."""
    seeded = torch.Tag.nondeterministic_seeded in op.tags
    if not seeded or any(_is_generator(a) for a in op._schema.arguments):
        return call()
    ctpu_gen, cpu_gen = default_generator(), torch.default_generator
    with _global_rng_lock:
        saved = cpu_gen.get_state()
        cpu_gen.set_state(ctpu_gen.get_state())
        try:
            return call()
        finally:
            ctpu_gen.set_state(cpu_gen.get_state())
            cpu_gen.set_state(saved)


def native_layer_norm(*args: Any) -> Any:
    """aten::native_layer_norm: without a PrivateUse1 kernel PyTorch decomposes layer norm into batch norm,
    whose numerics differ from the CPU's layer norm; a kernel here keeps it one op (compiled, or the CPU's)."""
    return ctpu_fallback(torch.ops.aten.native_layer_norm.default, *args)


def convolution(*args: Any) -> torch.Tensor:
    """aten::convolution_overrideable: where PyTorch sends convolutions on devices other than CPU/CUDA."""
    return _fallback_as(torch.ops.aten.convolution_overrideable.default, torch.ops.aten.convolution.default, args)


def convolution_backward(grad_output: torch.Tensor, input: torch.Tensor, weight: torch.Tensor, *rest: Any) -> Any:
    """aten::convolution_backward_overrideable, run as the CPU's convolution_backward."""
    stride, padding, dilation, transposed, output_padding, groups, output_mask = rest
    out_channels = weight.size(1) * groups if transposed else weight.size(0)
    args = (grad_output, input, weight, [out_channels], stride, padding, dilation, transposed, output_padding,
            groups, output_mask)
    return _fallback_as(torch.ops.aten.convolution_backward_overrideable.default,
                        torch.ops.aten.convolution_backward.default, args)


def _fallback_as(op: OpOverload, cpu_op: OpOverload, args: tuple[Any, ...]) -> Any:
    """Fall back for `op` by running `cpu_op` (same arguments and results) on the CPU."""
    result = eager.run(op, args, {})
    if result is not NotImplemented:
        return result
    _record(op.name())
    return run_on_cpu(cpu_op, args, {})
