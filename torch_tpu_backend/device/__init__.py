"""The PyTorch device `ctpu` (PrivateUse1): tensors in the CTPU's HBM, the `torch.ctpu` module, eager ops.

Loaded by the `torch.backends` entry point when torch is imported (see pyproject.toml), so after
`pip install -e .` a plain `import torch` makes `torch.randn(2, device="ctpu")` work. `register()` is
idempotent; `_autoload()` never lets a failure here break `import torch` (it warns instead).

    csrc/ctpu (C++, torch_tpu_backend.device._C): allocator over the HBM arena, device guard, PrivateUse1
        hooks, generator, and the empty/view/resize/set/copy kernels.
    memory.py   HBM arena hand-over and the memory statistics
    random.py   the generator's Python API
    fallback.py every other op: run on the CPU, one CtpuFallbackWarning per op name
    rnn_cells.py the fused LSTM/GRU cells PyTorch asks of non-CPU devices, as ordinary ops
    eager.py    the hook for compiled single-op CTPU kernels
    ctpu.py     the module registered as torch.ctpu
"""

from __future__ import annotations

import threading
import warnings

_registered = False
_register_lock = threading.Lock()
_fallback_library = None  # keeps the torch.library registration alive


def register() -> None:
    """Make `ctpu` a PyTorch device (idempotent)."""
    global _registered, _fallback_library
    with _register_lock:
        if _registered:
            return
        import torch
        import torch.utils.backend_registration as backend_registration

        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", "ctpu"):
            raise RuntimeError(f"PrivateUse1 is already the {name!r} backend; ctpu cannot register")

        # Importing these loads the extension _C, whose static registrations install the allocator, the
        # guard, the hooks and the kernels.
        from torch_tpu_backend.device import ctpu, memory
        from torch_tpu_backend.device.fallback import (
            convolution,
            convolution_backward,
            ctpu_fallback,
            native_layer_norm,
        )

        memory.install()
        if name != "ctpu":
            torch.utils.rename_privateuse1_backend("ctpu")
        if not hasattr(torch.Tensor, "is_ctpu"):
            backend_registration.generate_methods_for_privateuse1_backend(
                for_tensor=True, for_module=True, for_packed_sequence=True, for_storage=True)
        if getattr(torch, "ctpu", None) is not ctpu:
            torch._register_device_module("ctpu", ctpu)
        # autocast("ctpu") casts with the policies csrc/ctpu/autocast.cpp registers; its default dtype is the
        # MXU's bf16 (torch defaults a new device to fp16, which the CTPU does not compute in)
        torch.set_autocast_dtype("ctpu", torch.bfloat16)
        library = torch.library.Library("_", "IMPL")
        library.fallback(ctpu_fallback, dispatch_key="PrivateUse1")
        # Convolutions on other devices go to these two ops, whose default kernels only raise.
        aten = torch.library.Library("aten", "IMPL")
        aten.impl("convolution_overrideable", convolution, "PrivateUse1")
        aten.impl("convolution_backward_overrideable", convolution_backward, "PrivateUse1")
        aten.impl("native_layer_norm", native_layer_norm, "PrivateUse1")
        from torch_tpu_backend.device import rnn_cells

        rnn_cells.register(aten)  # nn.LSTM/GRU's fused cells, which the CPU (so the fallback) lacks
        _fallback_library = (library, aten)
        from torch_tpu_backend.device import eager, eager_compiler

        eager.set_eager_compiler(eager_compiler.compile_single_op)  # eager ops run as compiled CTPU kernels
        from torch_tpu_backend import backend_entry

        backend_entry.install()  # "ctpu" registered as dynamo's registry is imported: no thread races for it
        _registered = True


def _autoload() -> None:
    """The `torch.backends` entry point: register, and never break `import torch`."""
    try:
        register()
    except Exception as err:  # a broken device must not take torch down with it
        warnings.warn(f"ctpu: the ctpu device is not available: {err!r} "
                      "(rebuild with `pip install -e .`; TORCH_DEVICE_BACKEND_AUTOLOAD=0 skips loading)",
                      RuntimeWarning, stacklevel=2)


# Last, so that whichever of torch and this package is imported first, torch's entry point finds `_autoload`
# here and registers the device before any submodule is imported half way.
import torch  # noqa: E402, F401
