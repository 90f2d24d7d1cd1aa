"""Dynamo's device interface for ctpu (`torch._dynamo.device_interface.get_interface_for_device("ctpu")`).

Dynamo and Inductor ask a device's interface for its current device, count, synchronization and
properties (device-generic code such as `torch._dynamo.utils` and compiled autocast look it up by device
type). Registered by `backend_entry.install()` as `torch._dynamo.device_interface` is imported, so a plain
`import torch` does not import dynamo.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch._dynamo.device_interface import DeviceInterface

from torch_tpu_backend.device import ctpu


class CtpuProperties(NamedTuple):
    """What a worker process may ask of the device; one core executes a program."""

    name: str
    multi_processor_count: int


class CtpuInterface(DeviceInterface):
    """The ctpu device as dynamo sees it: one synchronous device, one stream, no Triton."""

    device = ctpu.device  # type: ignore[assignment]

    class Worker:
        @staticmethod
        def set_device(device: int) -> None:
            ctpu.set_device(device)

        @staticmethod
        def current_device() -> int:
            return ctpu.current_device()

        @staticmethod
        def get_device_properties(device: torch.types.Device = None) -> CtpuProperties:
            return CtpuProperties("ctpu", 1)

    current_device = staticmethod(ctpu.current_device)
    set_device = staticmethod(ctpu.set_device)  # type: ignore[arg-type]
    device_count = staticmethod(ctpu.device_count)
    is_available = staticmethod(ctpu.is_available)
    synchronize = staticmethod(ctpu.synchronize)
    memory_allocated = staticmethod(ctpu.memory_allocated)

    @staticmethod
    def exchange_device(device: int) -> int:
        previous = ctpu.current_device()
        ctpu.set_device(device)
        return previous

    maybe_exchange_device = exchange_device

    @staticmethod
    def get_raw_stream(device_idx: int) -> int:
        return 0  # the one stream

    @classmethod
    def get_device_properties(cls, device: torch.types.Device = None) -> Any:
        return cls.Worker.get_device_properties(device)

    @staticmethod
    def get_compute_capability(device: torch.types.Device = None) -> str:
        return ""

    @staticmethod
    def is_bf16_supported(including_emulation: bool = False) -> bool:
        return True  # the MXU's input type

    @staticmethod
    def is_triton_capable(device: torch.types.Device = None) -> bool:
        return False
