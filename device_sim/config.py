"""Named hardware configurations of the one parameterised CTPU design.

Every figure the project reports names one of these. The RTL takes the same numbers as SystemVerilog
parameters (see `device_sim/rtl/ctpu_isa_pkg.sv`, generated from this file and `isa.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

SUBLANES = 8  # rows in a vector register, in every configuration (as on TPUs)
HBM_POISON = -4  # as an unsigned address 0xFFFFFFFC: above every configuration's HBM, 4-byte aligned


@dataclass(frozen=True)
class HardwareConfig:
    """One CTPU configuration. Sizes are in the units the hardware addresses.

    lanes           width of a vector register row, a vmem row and the matrix unit (mxu_dim == lanes)
    vmem_rows       vector memory size in rows of `lanes` 32-bit words
    hbm_bytes       HBM size (byte addressed by 32-bit scalar registers, so at most 4 GiB; above it nothing is
                    mapped, and software poisons an address it must not use by moving it up there: a DMA to it traps)
    hbm_bytes_per_cycle   DMA bandwidth in HBM bytes per cycle
    vmem_port_rows  vmem rows per cycle the DMA channel moves: a DMA of R vmem rows and B bytes transfers in
                    max(ceil(R / this), ceil(B / hbm_bytes_per_cycle)) cycles
    weight_port_rows  vmem rows per cycle the MXU weight port reads: `mxu.lw` / `mxu.lwt` take lanes / this
                    cycles (docs/architecture.md: why `large` has 4 and 8)
    dma_latency     cycles from a DMA's last row to its completion flag
    imem_bundles    instruction memory size in bundles
    dma_queue / mxu_queue  command FIFO depths; issuing into a full FIFO stalls the bundle
    """

    name: str
    lanes: int
    vmem_rows: int
    hbm_bytes: int
    hbm_bytes_per_cycle: int
    dma_latency: int
    imem_bundles: int
    dma_queue: int = 8
    mxu_queue: int = 4
    clock_mhz: int = 1000
    vmem_port_rows: int = 1
    weight_port_rows: int = 1

    def __post_init__(self) -> None:
        if not 0 < self.hbm_bytes <= (HBM_POISON & 0xFFFFFFFF):
            raise ValueError(f"{self.name}: hbm_bytes {self.hbm_bytes:#x} must leave the poison address "
                             f"{HBM_POISON & 0xFFFFFFFF:#x} unmapped")
        if self.vmem_port_rows < 1 or self.lanes % self.vmem_port_rows:
            raise ValueError(f"{self.name}: vmem_port_rows {self.vmem_port_rows} must divide lanes {self.lanes}")
        if self.weight_port_rows < 1 or self.lanes % self.weight_port_rows:
            raise ValueError(f"{self.name}: weight_port_rows {self.weight_port_rows} must divide lanes {self.lanes}")

    @property
    def mxu_dim(self) -> int:
        return self.lanes

    @property
    def sublanes(self) -> int:
        return SUBLANES

    @property
    def mxu_weight_cycles(self) -> int:
        """Cycles one mxu.lw / mxu.lwt occupies the weight port: N rows, weight_port_rows per cycle."""
        return self.lanes // self.weight_port_rows

    @property
    def mxu_drain(self) -> int:
        """Cycles from the last row entering the systolic array to its result being written: 2N."""
        return 2 * self.lanes

    @property
    def vmem_bytes(self) -> int:
        return self.vmem_rows * self.lanes * 4

    def as_dict(self) -> dict[str, int | str]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


SMALL = HardwareConfig(
    name="small",
    lanes=8,
    vmem_rows=4096,  # 128 KiB
    hbm_bytes=16 << 20,
    hbm_bytes_per_cycle=32,
    dma_latency=32,
    imem_bundles=32768,  # 1.1 MiB: a whole compiled model (the tiny Llama at "highest": 16.4k bundles)
)

LARGE = HardwareConfig(
    name="large",
    lanes=128,
    vmem_rows=32768,  # 16 MiB, like a TPUv4 core's vector memory
    hbm_bytes=3 << 30,  # a 1B-parameter model in bf16 (2.5 GB) + its KV cache; the top GiB stays unmapped
    hbm_bytes_per_cycle=1024,  # ~1 TB/s at 1 GHz
    dma_latency=500,
    imem_bundles=65536,
    # a bf16 weight row is 256 bytes: 4 rows per cycle keep up with HBM (1 row per cycle ran decode at 1/4);
    # 8, as a cached key or value row of head dim 64 is 128 bytes (docs/architecture.md)
    vmem_port_rows=8,
    # twice HBM's pace: a decode projection's weights prefetched during the small kernels before it are
    # consumed faster than HBM delivers the rest, so that time is won back (docs/architecture.md)
    weight_port_rows=8,
)

CONFIGS: dict[str, HardwareConfig] = {c.name: c for c in (SMALL, LARGE)}


def get_config(name: str | HardwareConfig) -> HardwareConfig:
    if isinstance(name, HardwareConfig):
        return name
    try:
        return CONFIGS[name]
    except KeyError:
        raise ValueError(f"unknown CTPU configuration {name!r}; known: {', '.join(CONFIGS)}") from None
