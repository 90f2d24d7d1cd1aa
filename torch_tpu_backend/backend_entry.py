"""`backend="ctpu"` registered in dynamo's backend registry before any thread can race for it.

Dynamo finds the backend through the `torch_dynamo_backends` entry point (pyproject.toml), resolved lazily by
`torch._dynamo.backends.registry.lookup_backend` on the first `torch.compile(..., backend="ctpu")`: it checks
that "ctpu" is not registered yet, loads the entry point and registers it, all without a lock. Threads that
compile for the first time at once all pass the check, and every one but the first fails with
`AssertionError: duplicate name: ctpu`.

`install()` (called when the ctpu device registers, i.e. on `import torch`) registers "ctpu" as the registry
module is imported, inside its import: Python's import lock lets one thread execute a module and makes every
other thread that imports it wait until it has executed, so no thread can look a backend up before "ctpu" is
there, and the racy lazy path is never taken. What is registered is `ctpu_backend` below, which imports the
entry point's function (torch_tpu_backend.dynamo.ctpu_backend) on the first compile: the registry is
imported half way through `torch._dynamo`'s own import, too early to import the compiler. Importing dynamo
on `import torch` instead would cost every user of torch seconds; this costs nothing until dynamo is
imported. The backend module must not register itself (`@register_backend`) as well: that is the same
duplicate. With TORCH_DEVICE_BACKEND_AUTOLOAD=0 and no import of ours, the entry point alone is used.

The same hook registers ctpu's dynamo device interface (`torch_tpu_backend/device/interface.py`) as
`torch._dynamo.device_interface` is imported, for the same reason: no cost on `import torch`.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any

REGISTRY = "torch._dynamo.backends.registry"
DEVICE_INTERFACE = "torch._dynamo.device_interface"
BACKEND = "ctpu"


def ctpu_backend(gm: Any, example_inputs: Sequence[Any], **kwargs: Any) -> Callable[..., Any]:
    """What dynamo calls for backend="ctpu": torch_tpu_backend.dynamo.ctpu_backend, imported on first use."""
    from torch_tpu_backend.dynamo import ctpu_backend as backend

    return backend(gm, example_inputs, **kwargs)


def install() -> None:
    """Register "ctpu" in dynamo's backend registry and device interfaces now if their modules are imported,
    else as each is imported (idempotent)."""
    for name, register in ((REGISTRY, _register), (DEVICE_INTERFACE, _register_interface)):
        module = sys.modules.get(name)
        if module is not None:
            register(module)
        elif not any(isinstance(f, _RegisterOnImport) and f.name == name for f in sys.meta_path):
            sys.meta_path.insert(0, _RegisterOnImport(name, register))


def _register(registry: ModuleType) -> None:
    if BACKEND not in registry._COMPILER_FNS:
        registry.register_backend(compiler_fn=ctpu_backend, name=BACKEND)


def _register_interface(device_interface: ModuleType) -> None:
    from torch_tpu_backend.device.interface import CtpuInterface

    device_interface.register_interface_for_device(BACKEND, CtpuInterface)


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds one module as the path finder does, and calls `register(module)` once it has executed."""

    def __init__(self, name: str, register: Callable[[ModuleType], None]) -> None:
        self.name, self.register = name, register

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None  # the other finders decide
        sys.meta_path.remove(self)  # one shot; safe while the import system iterates: it stops at this spec
        exec_module = spec.loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            self.register(module)

        spec.loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec
