"""What every kernel's instruction selection shares: vmem regions, flags, HBM addresses, DMA commands.

A kernel runs with vmem to itself: `KernelContext.begin` resets the region allocator (above the spill
area), and `end` waits on every flag the kernel used, so no command of a kernel is in flight when the next
one starts. HBM order between kernels needs nothing: DMA commands execute in order on one channel.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from codegen.builder import Builder
from codegen.errors import CapacityError
from codegen.kernels import ESIZE, View
from codegen.mir import Mem, Reg
from codegen.regalloc import SPILL_SLOTS
from device_sim.config import HardwareConfig

SPILL_ROWS = SPILL_SLOTS * 8


@dataclass
class Region:
    name: str
    row: int  # first vmem row
    rows: int

    def mem(self, lo: int = 0, hi: int | None = None, write: bool = False) -> Mem:
        return Mem(self.name, lo, self.rows if hi is None else hi, write)


@dataclass
class KernelContext:
    b: Builder
    config: HardwareConfig
    hbm_base: dict[str, tuple[Reg, int]]  # buffer -> (base register, byte offset)
    scratch: tuple[Reg, int]  # HBM scratch area for materialized operands (register, byte offset)
    matmul_precision: str = "highest"
    _next_row: int = SPILL_ROWS
    _regions: int = 0
    _flags_used: set[int] = field(default_factory=set)
    _scratch_used: int = 0
    scratch_peak: int = 0

    @property
    def lanes(self) -> int:
        return self.config.lanes

    def begin(self, kernel: str) -> None:
        self._next_row = SPILL_ROWS
        self._flags_used = set()
        self._scratch_used = 0
        self.kernel = kernel

    def end(self) -> None:
        for f in sorted(self._flags_used):
            self.b.emit("wait", flag=f)

    def region(self, rows: int, hint: str) -> Region:
        rows = max(8, -(-rows // 8) * 8)
        if self._next_row + rows > self.config.vmem_rows:
            need = self._next_row + rows
            raise CapacityError(f"{self.kernel}: vmem exhausted ({need} > {self.config.vmem_rows} rows)")
        self._regions += 1
        r = Region(f"{hint}{self._regions}", self._next_row, rows)
        self._next_row += rows
        return r

    def vmem_free(self) -> int:
        return self.config.vmem_rows - self._next_row

    def flag(self, f: int) -> int:
        self._flags_used.add(f)
        return f

    def scratch_bytes(self, nbytes: int) -> tuple[Reg, int]:
        off = self.scratch[1] + self._scratch_used
        self._scratch_used += -(-nbytes // 64) * 64
        self.scratch_peak = max(self.scratch_peak, self._scratch_used)
        return self.scratch[0], off

    # ---- addresses and DMA --------------------------------------------------------------------------
    def hbm_addr(self, view: View, element_offset: int) -> Reg:
        """A register holding the byte address of element `element_offset` of `view`'s buffer."""
        base, off = self.hbm_base[view.buffer]
        return self.b.offset_reg(base, off + element_offset * ESIZE[view.dtype])

    def dma(self, load: bool, dtype: str, hbm: Reg, region: Region, row: int, rows: int, cols: int,
            stride: int, flag: int) -> None:
        """One 2-D DMA: `rows` x `cols` elements, HBM row stride `stride` elements, at vmem region row `row`."""
        b = self.b
        p = -(-cols // self.lanes)
        op = ("dma.ld" if load else "dma.st") + (".bf16" if dtype == "bf16" else "")
        shape = b.const(rows << 16 | cols)
        vrow = b.const(region.row + row)
        b.emit(op, None, (hbm, vrow, shape, b.const(stride)), flag=self.flag(flag),
               mem=(region.mem(row, row + rows * p, write=load),))
