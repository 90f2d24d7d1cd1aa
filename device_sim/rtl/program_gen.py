"""Random valid CTPU programs for RTL-vs-simulator fuzzing (docs/rtl.md, "Fuzzing").

    gen = ProgramGenerator(np.random.default_rng(seed))
    case = gen.generate()          # FuzzCase: assembly text, Program, HBM image, cycle limit

Every slot is exercised: both scalar slots (every scalar op, li/lih), both vector slots (every vector op of
the table: fp/int ALU, compares, conversions, vsel, vbcast, viota, vext, the four reductions), vld, vld.row,
vst, every MXU command (lw, lwt, lwt.lo, lwt.hi, mm, mma, mms, mmas), every DMA command (f32 and bf16, strided, partial
rows, overlapping load rows), wait, counted loops (nested), data-dependent forward branches (bz) and jumps
over dead code. Data: random fp32 with inf/NaN/subnormals/-0, random bits, bf16 patterns.

What makes a program valid (no trap in the simulator), and how the generator keeps it so:
- Addresses: s14..s31 are address registers, written only by the generator's own li/lih; it knows their
  values (forgotten at every label, so loops and branches re-load them). Data ops write s1..s11 (vext too);
  loop counters are s12, s13. Every address, shape and row count is in bounds.
- Write conflicts: a result of latency L issued at bundle b conflicts with one of latency L' < L issued at
  b' > b only if the distance in cycles is exactly L - L'. Stalls only lengthen distances, so forbidding
  b' - b <= L - L' (and equal latencies to one register within a bundle) is safe whatever the timing.
  Branches: the two bundles before a branch and before a label write no vreg and no vext (a "barrier"), after
  which nothing pending can collide with anything, so the tracker restarts at labels.
- Races: the generator records the vmem rows each DMA/MXU command owns until a `wait` on its flag; an
  access that would race makes its bundle wait on the owner's flag (or picks other rows). Before a loop's
  back edge it waits on every flag it issued in the body. DMA-after-DMA and mm-output-after-mm-output
  overlaps are left unwaited (the hardware orders them).
- Early reads are deliberate: sources are chosen regardless of pending writes (the exposed pipeline returns
  the old value; both models must agree).
With `trap_rate > 0` a program may end in a bundle that traps (kind and pc must then match).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from device_sim import isa
from device_sim.asm import assemble
from device_sim.config import SMALL, HardwareConfig
from device_sim.program import Program

DATA_S = tuple(range(1, 12))
LOOP_S = (12, 13)
ADDR_S = tuple(range(14, 32))
INPUT_BASE, INPUT_BYTES = 0x0, 0x10000  # random data the program loads
OUTPUT_BASE, OUTPUT_BYTES = 0x10000, 0x10000  # where stores go (random too, so partial stores show)
VMEM_SPAN = 600  # rows the generator uses: small, so DMA, MXU, vld and vst meet often

SCALAR_OPS = [i for i in isa.INSTRUCTIONS if i.unit is isa.Unit.SCALAR]
VECTOR_OPS = [i for i in isa.INSTRUCTIONS if i.unit is isa.Unit.VECTOR]
MXU_OPS = ["mxu.lw", "mxu.lwt", "mxu.lwt.lo", "mxu.lwt.hi", "mxu.mm", "mxu.mma", "mxu.mms", "mxu.mmas"]
DMA_OPS = ["dma.ld", "dma.ld.bf16", "dma.st", "dma.st.bf16"]
SPECIAL_F32 = np.array([0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00001, 0x00000001,
                        0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0x3F808000, 0x3F818000, 0x4F000000, 0xCF000001],
                       np.uint32)
TRAPS = ["vld v1, s0, 4095", "vst v2, s0, 4090", "vext s1, v3, 64", "li s5, 1 ; li s5, 2",
         "mxu.mm s0, s0, s0, f0", "dma.ld s0, s0, s0, s0, f1", "vld.row v1, s0, -1"]


@dataclass
class FuzzCase:
    text: str
    program: Program
    hbm: dict[int, bytes]
    max_cycles: int = 200_000


@dataclass(eq=False)
class Owned:
    lo: int
    hi: int
    writes: bool
    unit: str  # "dma", "mxu.w", "mxu.in", "mxu.out", "vld", "vst"
    flag: int
    bundle: int


@dataclass
class Bundle:
    scalar: list[str] = field(default_factory=list)
    vector: list[str] = field(default_factory=list)
    vld: str = ""
    vst: str = ""
    mxu: str = ""
    dma: str = ""
    ctrl: str = ""
    label: str = ""

    def barrier(self) -> bool:
        """Writes no vreg and no sreg through a vector slot (see the module docstring)."""
        return not self.vector and not self.vld

    def text(self) -> str:
        ops = [*self.scalar, *self.vector, self.vld, self.vst, self.mxu, self.dma, self.ctrl]
        line = " ; ".join(o for o in ops if o) or "nop"
        return (f"{self.label}:\n" if self.label else "") + f"    {line}"


def _ordered(a: str, b: str) -> bool:
    return (a == b == "dma") or (a == b == "mxu.out")


class ProgramGenerator:
    def __init__(self, rng: np.random.Generator, config: HardwareConfig = SMALL, work_bundles: int = 40,
                 trap_rate: float = 0.0) -> None:
        self.rng, self.cfg = rng, config
        self.n, self.work, self.trap_rate = config.lanes, work_bundles, trap_rate

    # ---- state ---------------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.bundles: list[Bundle] = []
        self.pending: dict[str, list[tuple[int, int]]] = {}  # register -> [(bundle, latency)]
        self.addr: dict[int, int] = {}  # address register -> value (visible from the next bundle on)
        self.lru: list[int] = list(ADDR_S)
        self.owned: list[Owned] = []
        self.labels = 0
        self.depth = 0
        self.last_dma_row = -1  # the last vmem row of the latest DMA command (chained into the next one)
        self.last_mm_out = -1  # the first output row of the latest mm

    @property
    def b(self) -> int:
        return len(self.bundles)

    def _can_write(self, reg: str, lat: int, b: int) -> bool:
        for b0, l0 in self.pending.get(reg, ()):
            if b0 == b and l0 == lat:
                return False
            if b0 < b and l0 > lat and b - b0 <= l0 - lat:
                return False
        return True

    def _wrote(self, reg: str, lat: int, b: int) -> None:
        lst = [(b0, l0) for b0, l0 in self.pending.get(reg, ()) if b - b0 <= 4]
        lst.append((b, lat))
        self.pending[reg] = lst

    def _pick_dest(self, kind: str, lat: int, b: int) -> str | None:
        pool = [f"s{r}" for r in DATA_S] + ["s0"] if kind == "s" else [f"v{r}" for r in range(isa.NUM_VREGS)]
        for _ in range(6):
            reg = pool[int(self.rng.integers(len(pool)))]
            if self._can_write(reg, lat, b):
                self._wrote(reg, lat, b)
                return reg
        return None

    def _emit(self, bundle: Bundle) -> None:
        if bundle.ctrl.startswith("wait "):
            flag = int(bundle.ctrl.split("f")[1])
            self.owned = [o for o in self.owned if not (o.flag == flag and o.bundle < self.b)]
        self.bundles.append(bundle)

    # ---- random operands -----------------------------------------------------------------------------
    def _int(self, lo: int, hi: int) -> int:
        return int(self.rng.integers(lo, hi + 1))

    def _sreg(self) -> str:
        return f"s{self._int(0, 31)}"

    def _vreg(self) -> str:
        return f"v{self._int(0, 31)}"

    def _scalar_op(self, bundle: Bundle, b: int) -> None:
        ins = SCALAR_OPS[self._int(0, len(SCALAR_OPS) - 1)]
        dest = self._pick_dest("s", 1, b)
        if dest is None:
            return
        if ins.mnemonic == "li":
            imm = int(self.rng.choice(SPECIAL_F32)) & 0x3FFFF if self.rng.random() < 0.3 else self._int(-(1 << 18),
                                                                                                         (1 << 18) - 1)
            bundle.scalar.append(f"li {dest}, {imm}")
        elif ins.mnemonic == "lih":
            imm = (int(self.rng.choice(SPECIAL_F32)) >> 16) if self.rng.random() < 0.5 else self._int(0, 0xFFFF)
            bundle.scalar.append(f"lih {dest}, {imm}")
        elif ins.fmt is isa.FMT_RI:
            bundle.scalar.append(f"{ins.mnemonic} {dest}, {self._sreg()}, {self._int(-8192, 8191)}")
        else:
            bundle.scalar.append(f"{ins.mnemonic} {dest}, {self._sreg()}, {self._sreg()}")

    def _vector_op(self, bundle: Bundle, b: int) -> None:
        ins = VECTOR_OPS[self._int(0, len(VECTOR_OPS) - 1)]
        kind = "s" if ins.mnemonic == "vext" else "v"
        dest = self._pick_dest(kind, ins.latency, b)
        if dest is None:
            return
        if ins.mnemonic == "vext":
            bundle.vector.append(f"vext {dest}, {self._vreg()}, {self._int(0, 8 * self.n - 1)}")
        elif ins.mnemonic == "viota":
            bundle.vector.append(f"viota {dest}, {self._int(0, 2)}")
        elif ins.mnemonic == "vbcast":
            bundle.vector.append(f"vbcast {dest}, {self._sreg()}")
        else:
            srcs = [self._vreg() for _ in ins.operands[1:]]
            bundle.vector.append(f"{ins.mnemonic} {', '.join([dest, *srcs])}")

    def _filler(self, bundle: Bundle, b: int, vector: bool, p: float = 0.5) -> None:
        while len(bundle.scalar) < 2 and self.rng.random() < p:
            self._scalar_op(bundle, b)
        while vector and len(bundle.vector) < 2 and self.rng.random() < p:
            self._vector_op(bundle, b)

    # ---- address registers ---------------------------------------------------------------------------
    def _setup(self, values: list[int]) -> list[str]:
        """Registers holding `values` in the next bundle; emits li/lih bundles for the missing ones."""
        regs: list[int | None] = [0 if val == 0 else next((r for r, v in self.addr.items() if v == val), None)
                                  for val in values]
        busy = {r for r in regs if r is not None}
        lows, highs = [], []
        for i, val in enumerate(values):
            if regs[i] is not None:
                continue
            same = next((regs[j] for j in range(i) if values[j] == val and regs[j] is not None), None)
            if same is not None:
                regs[i] = same
                continue
            reg = next(r for r in self.lru if r not in busy)
            busy.add(reg)
            regs[i] = reg
            self.addr.pop(reg, None)
            signed = val - (1 << 32) if val & 0x80000000 else val
            if -(1 << 18) <= signed < (1 << 18):
                lows.append(f"li s{reg}, {signed}")
            else:
                lows.append(f"li s{reg}, {val & 0xFFFF}")
                highs.append(f"lih s{reg}, {val >> 16}")
        for group in (lows, highs):
            for k in range(0, len(group), 2):
                bundle = Bundle(scalar=group[k : k + 2])
                self._filler(bundle, self.b, vector=True, p=0.4)
                self._emit(bundle)
        for reg, val in zip(regs, values, strict=True):
            assert reg is not None
            if reg == 0:
                continue
            self.addr[reg] = val
            self.lru.remove(reg)
            self.lru.append(reg)
        return [f"s{r}" for r in regs]

    # ---- memory operations and ownership -------------------------------------------------------------
    def _claim(self, bundle: Bundle, claims: list[Owned], lo: int, hi: int, writes: bool, unit: str) -> bool:
        """Can this bundle touch rows [lo, hi) race-free (adding a wait if one flag clears it)?"""
        flags = set()
        for o in self.owned:
            if o.lo < hi and lo < o.hi and (writes or o.writes) and not _ordered(o.unit, unit):
                flags.add(o.flag)
        for o in claims:  # this bundle's own commands: no wait can help
            if o.lo < hi and lo < o.hi and (writes or o.writes) and not _ordered(o.unit, unit):
                return False
        wait = int(bundle.ctrl.split("f")[1]) if bundle.ctrl.startswith("wait") else None
        if len(flags) > 1 or (flags and wait is not None and flags != {wait}):
            return False
        if flags:
            bundle.ctrl = f"wait f{flags.pop()}"
        return True

    def _mxu(self, bundle: Bundle, claims: list[Owned]) -> list[int] | None:
        mn = MXU_OPS[self._int(0, len(MXU_OPS) - 1)]
        flag = self._int(0, 5)
        if mn.startswith("mxu.lw"):
            row = self._int(0, VMEM_SPAN - self.n)
            if not self._claim(bundle, claims, row, row + self.n, False, "mxu.w"):
                return None
            claims.append(Owned(row, row + self.n, False, "mxu.w", flag, self.b))
            bundle.mxu = f"{mn} {{0}}, f{flag}"
            return [row]
        rows = self._int(1, 24) if self.rng.random() < 0.8 else self._int(25, 80)
        x = self._int(0, VMEM_SPAN - rows)
        o = self._int(0, VMEM_SPAN - rows)
        if self.last_mm_out >= 0 and self.rng.random() < 0.3 and self.last_mm_out + rows <= VMEM_SPAN:
            o = self.last_mm_out  # outputs of back-to-back mms meet in the output stage (ordered)
        if x < o + rows and o < x + rows:
            return None
        if not (self._claim(bundle, claims, x, x + rows, False, "mxu.in")
                and self._claim(bundle, claims, o, o + rows, True, "mxu.out")):
            return None
        claims += [Owned(x, x + rows, False, "mxu.in", flag, self.b), Owned(o, o + rows, True, "mxu.out", flag, self.b)]
        self.last_mm_out = o
        bundle.mxu = f"{mn} {{0}}, {{1}}, {{2}}, f{flag}"
        return [x, o, rows]

    def _dma(self, bundle: Bundle, claims: list[Owned]) -> list[int] | None:
        mn = DMA_OPS[self._int(0, 3)]
        store, esize = mn.startswith("dma.st"), 2 if mn.endswith("bf16") else 4
        rows = self._int(1, 6)
        cols = self._int(1, 3 * self.n) if self.rng.random() < 0.8 else self._int(1, 64)
        if store and rows > 1:
            stride = self._int(cols, cols + 9)
        else:
            stride = self._int(0, cols + 9)  # loads may read overlapping rows, even the same row (stride 0)
        span = ((rows - 1) * stride + cols) * esize
        base, size = (OUTPUT_BASE, OUTPUT_BYTES) if store or self.rng.random() < 0.3 else (INPUT_BASE, INPUT_BYTES)
        hbm = base + self._int(0, (size - span) // esize) * esize
        pitch = -(-cols // self.n)
        vrow = self._int(0, VMEM_SPAN - rows * pitch)
        if self.last_dma_row >= 0 and self.rng.random() < 0.3 and self.last_dma_row + rows * pitch <= VMEM_SPAN:
            vrow = self.last_dma_row  # starts on the previous command's last row (DMA is ordered)
        flag = self._int(0, 5)
        if not self._claim(bundle, claims, vrow, vrow + rows * pitch, not store, "dma"):
            return None
        claims.append(Owned(vrow, vrow + rows * pitch, not store, "dma", flag, self.b))
        self.last_dma_row = vrow + rows * pitch - 1
        bundle.dma = f"{mn} {{0}}, {{1}}, {{2}}, {{3}}, f{flag}"
        return [hbm, vrow, rows << 16 | cols, stride]

    def _vmem_access(self, bundle: Bundle, claims: list[Owned], store: bool) -> tuple[int, int, bool] | None:
        """vld/vld.row/vst rows: (base register value, immediate offset, vld.row?)."""
        row_only = not store and self.rng.random() < 0.3
        count = 1 if row_only else 8
        row = self._int(0, VMEM_SPAN - count)
        if not self._claim(bundle, claims, row, row + count, store, "vst" if store else "vld"):
            return None
        base = 0 if self.rng.random() < 0.5 else max(0, row + self._int(-100, 100))
        return base, row - base, row_only

    def _work_bundle(self) -> None:
        bundle, claims = Bundle(), []
        if self.rng.random() < 0.08:
            bundle.ctrl = f"wait f{self._int(0, 5)}"
        values: list[int] = []
        fmts: list[tuple[str, int]] = []  # (bundle field, how many values)
        if self.rng.random() < 0.25 and (v := self._mxu(bundle, claims)) is not None:
            values += v
            fmts.append(("mxu", len(v)))
        if self.rng.random() < 0.3 and (v := self._dma(bundle, claims)) is not None:
            values += v
            fmts.append(("dma", len(v)))
        mem = {}
        for store in (False, True):
            if self.rng.random() < (0.25 if store else 0.35):
                acc = self._vmem_access(bundle, claims, store)
                if acc is not None:
                    mem[store] = acc
                    if acc[0]:
                        values.append(acc[0])
        regs = self._setup(values) if values else []
        b = self.b
        k = 0
        for name, count in fmts:
            setattr(bundle, name, getattr(bundle, name).format(*regs[k : k + count]))
            k += count
        for store, (base, off, row_only) in mem.items():
            reg = "s0"
            if base:
                reg = regs[k]
                k += 1
            if store:
                bundle.vst = f"vst {self._vreg()}, {reg}, {off}"
            elif (dest := self._pick_dest("v", isa.LAT_VLOAD, b)) is not None:
                bundle.vld = f"{'vld.row' if row_only else 'vld'} {dest}, {reg}, {off}"
        self._filler(bundle, b, vector=True, p=0.6)
        self._emit(bundle)
        for c in claims:  # the commands own their rows from this bundle until a wait on their flag
            c.bundle = b
            self.owned.append(c)

    # ---- control flow --------------------------------------------------------------------------------
    def _barrier(self, count: int) -> None:
        """Make the last `count` bundles barriers (appending scalar-only bundles as needed)."""
        have = 0
        for bundle in reversed(self.bundles):
            if not bundle.barrier():
                break
            have += 1
        for _ in range(count - have):
            bundle = Bundle()
            self._filler(bundle, self.b, vector=False, p=0.4)
            self._emit(bundle)

    def _label(self) -> str:
        self.labels += 1
        return f"L{self.labels}"

    def _place_label(self, name: str) -> None:
        """A branch target: everything pending is safe after the barrier; forget address registers."""
        self._barrier(2)
        self.pending.clear()
        self.addr.clear()
        self.bundles.append(Bundle(label=name))  # an empty bundle carrying the label

    def _loop(self, budget: int) -> None:
        counter = LOOP_S[self.depth]
        self.depth += 1
        self._emit(Bundle(scalar=[f"li s{counter}, {self._int(1, 3)}"]))
        top = self._label()
        self._place_label(top)
        before = list(self.owned)  # references, not ids: a freed id may be reused by a new command
        self._block(budget)
        for flag in sorted({o.flag for o in self.owned if o not in before and o.flag >= 0}):
            self._barrier(1)
            self._emit(Bundle(ctrl=f"wait f{flag}"))
        self._barrier(1)
        self._emit(Bundle(scalar=[f"addi s{counter}, s{counter}, -1"]))
        self._emit(Bundle(ctrl=f"bnz s{counter}, {top}"))
        self.pending.clear()
        self.depth -= 1

    def _skip(self, budget: int) -> None:
        """`bz sX, skip` over a block (data-dependent), or `jmp` over dead code that would trap."""
        end = self._label()
        if self.rng.random() < 0.3:
            self._barrier(1)
            self._emit(Bundle(ctrl=f"jmp {end}"))
            self.bundles.append(Bundle(vector=[f"vext s1, v1, {8 * self.n + 5}"], vld="vld v2, s0, 4095"))
            self._place_label(end)
            return
        self._barrier(1)
        self._emit(Bundle(ctrl=f"bz s{DATA_S[self._int(0, len(DATA_S) - 1)]}, {end}"))
        before = list(self.owned)
        self._block(budget)
        self.owned = before + [o for o in self.owned if o not in before]
        self._place_label(end)

    def _block(self, budget: int) -> None:
        while budget > 0:
            r = self.rng.random()
            if r < 0.06 and self.depth < len(LOOP_S) and budget > 4:
                n = self._int(2, min(8, budget))
                self._loop(n)
                budget -= n
            elif r < 0.1 and budget > 3:
                n = self._int(1, min(5, budget))
                self._skip(n)
                budget -= n
            else:
                self._work_bundle()
                budget -= 1

    def generate(self) -> FuzzCase:
        self._reset()
        self._block(self.work)
        if self.rng.random() < self.trap_rate:
            self._barrier(2)
            self._emit(Bundle(scalar=[TRAPS[self._int(0, len(TRAPS) - 1)]]))
        elif self.rng.random() < 0.5:
            for flag in sorted({o.flag for o in self.owned if o.flag >= 0}):
                self._emit(Bundle(ctrl=f"wait f{flag}"))
        self._emit(Bundle(ctrl="halt"))
        text = "\n".join(b.text() for b in self.bundles) + "\n"
        return FuzzCase(text, assemble(text, "fuzz.s"), self._hbm())

    def _hbm(self) -> dict[int, bytes]:
        words = (INPUT_BYTES + OUTPUT_BYTES) // 4
        bits = self.rng.integers(0, 1 << 32, size=words, dtype=np.uint64).astype(np.uint32)
        normal = self.rng.standard_normal(words).astype(np.float32) * np.float32(4.0)
        choice = self.rng.random(words)
        data = np.where(choice < 0.5, normal.view(np.uint32), bits)
        special = choice > 0.85
        data[special] = self.rng.choice(SPECIAL_F32, size=int(special.sum()))
        return {INPUT_BASE: data.tobytes()}
