"""Generates the row-wise programs (softmax.s, rmsnorm.s) from their sequences in `device_sim/sequences.py`.

    python -m device_sim.programs.row_programs        # rewrites softmax.s and rmsnorm.s beside this file

A small compiler back end for one pattern: a kernel applied to every row of an [R, 8N] fp32 matrix, one
row per vreg (a row of 8N elements is 8 vmem rows). What it does, in order:

1. DMA pipeline. Rows move in blocks of 8 (one 8 x 8N DMA = 64 vmem rows, flag f0 / f1 by buffer).
   The loop body handles two blocks, one per input buffer, so flags and buffers are static. Once a
   block's rows are loaded into vregs, `dma.ld` brings the block two ahead into its buffer; results go
   to an output buffer (per parity, flags f2 / f3) and leave by `dma.st` after the block's last vst.
   The last body is a copy without the loads.
2. List scheduling of the body's 16 rows: every op of the row's sequence, plus its vld and vst, placed in
   the first cycle where its operands have landed (issue + latency, exactly: there are no interlocks)
   and its slot is free (2 vector ALUs, vld, vst, dma, 2 scalar). Priority: earlier row first, then
   longer latency-weighted path to the row's end. A row may start only when row r - WINDOW has issued
   its vst (bounds register pressure). The first vld of a block carries the `wait` on its buffer's flag.
   So rows overlap like a software pipeline with up to WINDOW rows in flight.
3. Register allocation: constants live in pinned vregs (prologue: li/lih/vbcast); each other value
   holds a vreg from the cycle it lands to its last read (a later value may land in the same register
   the cycle after that read), assigned by linear scan.

`tests/device_sim/test_programs.py` regenerates both programs and fails if the files differ.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from device_sim import isa, sequences
from device_sim.sequences import SeqBuilder

HERE = Path(__file__).parent
LANES = 8  # the `small` configuration
SUBLANES = 8
ROWS_PER_BLOCK = 8  # one DMA
VMEM_BUF = (0, 64)  # input buffers: 8 rows x 8 vmem rows each
VMEM_OUT = (128, 192)  # output buffers
VMEM_W = 256  # rmsnorm's weight row
VMEM_CONST = 264  # the constant table: 8 rows per constant
N_VREGS = isa.NUM_VREGS
SLOTS = {"v": 2, "vld": 1, "vst": 1, "dma": 1, "s": 2, "ctrl": 1}


@dataclass
class Node:
    """One instruction of the loop body. `text` has {d} / {a} / {b} / {c} for vregs, filled after allocation."""

    unit: str
    text: str
    row: int
    tag: str
    dst: str | None = None
    srcs: tuple[str, ...] = ()
    lat: int = 0
    units: tuple[str, ...] = ()  # extra slots it occupies (a dma's scalar pointer bump, a vld's wait)
    preds: list[tuple[Node, int]] = field(default_factory=list)  # (node, min distance in cycles)
    height: int = 0
    time: int = -1


@dataclass
class RowProgram:
    name: str
    build: Callable[[SeqBuilder, str, str], str]  # (builder, x, w) -> y
    pinned_inputs: dict[str, int]  # name -> vmem row of the vreg to load in the prologue (rmsnorm's w)
    hbm: dict[str, int]
    rows: int
    window: int  # rows in flight
    reserve: int  # vregs only the oldest row may take
    pin: int  # constants pinned in vregs (the rest reload from vmem)


def _mnemonic_text(mn: str, nsrc: int) -> str:
    regs = ["{d}", *["{a}", "{b}", "{c}"][:nsrc]]
    return f"{mn} " + ", ".join(regs)


def build_body(k: RowProgram, blocks: tuple[int, int], loads: bool, window: int, table: dict[str, int]
               ) -> list[Node]:
    """The nodes of one loop body: rows of two blocks (buffers 0 and 1), their DMAs, dependencies.

    Constants in `table` (name -> vmem row) are not pinned: each use loads it just in time (a vld
    issued so it lands when the op's other operand does).
    """
    nodes: list[Node] = []
    prev_vst: list[Node] = []
    for blk, buf in zip(blocks, (0, 1), strict=True):
        base, obase = VMEM_BUF[buf], VMEM_OUT[buf]
        first_vld: Node | None = None
        first_vst: Node | None = None
        vlds, vsts = [], []
        for r in range(ROWS_PER_BLOCK):
            row = blk * ROWS_PER_BLOCK + r
            b = SeqBuilder()
            x, w = b.input("x"), b.input("w")
            y = k.build(b, x, w)
            vld = Node("vld", f"vld {{d}}, s0, {base + 8 * r}", row, "ld", dst=f"r{row}.x", lat=isa.LAT_VLOAD)
            if first_vld is None:
                vld.units = ("ctrl",)
                vld.text += f" ; wait f{buf}"
                first_vld = vld
            else:
                vld.preds.append((first_vld, 0))
            if len(prev_vst) >= window:
                vld.preds.append((prev_vst[-window], 0))
            nodes.append(vld)
            vlds.append(vld)
            producer: dict[str, Node] = {f"r{row}.x": vld}
            rename = {x: f"r{row}.x"}
            for op in b.ops:
                srcs = tuple(rename.get(s, s) for s in op.srcs)
                if any(s in table for s in srcs):
                    operands = [producer[s] for s in srcs if s in producer] or [vld]
                    new = []
                    for s in srcs:
                        if s in table:
                            kn = Node("vld", f"vld {{d}}, s0, {table[s]}", row, "k", dst=f"r{row}.k{len(nodes)}",
                                      lat=isa.LAT_VLOAD,
                                      preds=[(p, max(0, p.lat - isa.LAT_VLOAD)) for p in operands])
                            nodes.append(kn)
                            producer[kn.dst] = kn
                            s = kn.dst
                        new.append(s)
                    srcs = tuple(new)
                n = Node("v", _mnemonic_text(op.mnemonic, len(srcs)), row, op.tag, dst=f"r{row}.{op.dst}",
                         srcs=srcs, lat=isa.BY_MNEMONIC[op.mnemonic].latency)
                rename[op.dst] = n.dst
                producer[n.dst] = n
                nodes.append(n)
            vst = Node("vst", f"vst {{a}}, s0, {obase + 8 * r}", row, "st", srcs=(rename[y],))
            if first_vst is None:  # the output buffer's previous store (two blocks back) must be done
                vst.units = ("ctrl",)
                vst.text += f" ; wait f{2 + buf}"
                first_vst = vst
            else:
                vst.preds.append((first_vst, 0))
            nodes.append(vst)
            vsts.append(vst)
            prev_vst.append(vst)
            for n in nodes:
                if n.row == row and n.unit != "vld":
                    n.preds += [(producer[s], producer[s].lat) for s in n.srcs if s in producer]
        # once the block's rows are read, the block two ahead can come into its input buffer (a later
        # bundle: a DMA issued with the vld would own the rows first); after its last vst, its results go out
        if loads:
            ld = Node("dma", f"dma.ld s5, s{3 + buf}, s1, s2, f{buf} ; addi s5, s5, {_block_bytes()}", -1, "dma",
                      units=("s",), preds=[(v, 1) for v in vlds])
            nodes.append(ld)
        st = Node("dma", f"dma.st s6, s{8 + buf}, s1, s2, f{2 + buf} ; addi s6, s6, {_block_bytes()}", -1, "dma",
                  units=("s",), preds=[(v, isa.LAT_VSTORE) for v in vsts])
        nodes.append(st)
    return nodes


def _block_bytes() -> int:
    return ROWS_PER_BLOCK * SUBLANES * LANES * 4


def _heights(nodes: list[Node]) -> None:
    succs: dict[int, list[tuple[Node, int]]] = {id(n): [] for n in nodes}
    for n in nodes:
        for p, d in n.preds:
            succs[id(p)].append((n, d))
    for n in reversed(nodes):  # nodes are in a topological order
        n.height = max((d + s.height for s, d in succs[id(n)]), default=n.lat)


def schedule(nodes: list[Node], free: list[int], reserve: int) -> tuple[int, dict[str, int]]:
    """Cycle-driven list scheduling with register allocation folded in.

    A node issues at the first cycle where its operands have landed, its slots are free and, if it
    produces a value, a vreg is free. A vreg frees when the last reader of its value issues (a new value
    lands at least one cycle later, so the reader still sees the old one). Only the oldest unfinished
    row may take the last `reserve` free vregs, so it always progresses. Returns (bundles, vreg of each
    value); raises ValueError when the live values cannot fit (a deadlock: nothing can issue).
    """
    _heights(nodes)
    readers: dict[str, int] = {}
    for n in nodes:
        for src in n.srcs:
            readers[src] = readers.get(src, 0) + 1
    pending = sorted(nodes, key=lambda n: (n.row if n.row >= 0 else 10**6, -n.height))
    pool = list(free)
    regs: dict[str, int] = {}
    t = idle = 0
    while pending:
        used = dict.fromkeys(SLOTS, 0)
        rest = []
        oldest = min((n.row for n in pending if n.row >= 0), default=-1)
        for n in pending:
            need = (n.unit, *n.units)
            ok = (all(p.time >= 0 and p.time + d <= t for p, d in n.preds)
                  and all(used[u] + need.count(u) <= SLOTS[u] for u in set(need))
                  and (n.dst is None or len(pool) > (0 if n.row == oldest else reserve)))
            if not ok:
                rest.append(n)
                continue
            for u in need:
                used[u] += 1
            n.time = t
            for src in n.srcs:
                if src in regs:
                    readers[src] -= 1
                    if readers[src] == 0:
                        pool.append(regs[src])
            if n.dst is not None:
                if not readers.get(n.dst):
                    raise ValueError(f"{n.dst} is never read")
                regs[n.dst] = pool.pop(0)
        idle = idle + 1 if len(rest) == len(pending) else 0
        if idle > 64:
            raise ValueError(f"out of vregs at cycle {t}")
        pending = rest
        t += 1
    return max(n.time for n in nodes) + 1, regs


def emit_body(nodes: list[Node], length: int, regs: dict[str, int], label: str | None,
              branch: str | None, counter: str | None) -> list[str]:
    bundles: list[list[Node]] = [[] for _ in range(length)]
    for n in nodes:
        bundles[n.time].append(n)
    if branch and any("ctrl" in n.units for n in bundles[-1]):
        bundles.append([])  # the loop branch needs the ctrl slot
        length += 1
    slot_order = {"s": 0, "v": 1, "vld": 2, "vst": 3, "dma": 4}
    lines = [f"{label}:"] if label else []
    for i, ns in enumerate(bundles):
        ns.sort(key=lambda n: slot_order[n.unit])
        texts = []
        for n in ns:
            names = dict(zip("abc", (f"v{regs[s]}" for s in n.srcs), strict=False))
            names["d"] = f"v{regs[n.dst]}" if n.dst else ""
            texts.append(n.text.format(**names))
        if i == 0 and counter:
            texts.append(counter)
        if i == length - 1 and branch:
            texts.append(branch)
        rows: dict[int, list[str]] = {}
        for n in ns:
            if n.row >= 0:
                rows.setdefault(n.row, [])
                if n.tag not in rows[n.row]:
                    rows[n.row].append(n.tag)
        note = "  ".join(f"r{r}:{'/'.join(t)}" for r, t in sorted(rows.items()))
        if any(n.unit == "dma" for n in ns):
            note = (note + "  " if note else "") + "DMA"
        line = "    " + (" ; ".join(texts) if texts else "nop")
        lines.append(f"{line:<60} # {note}" if note else line)
    return lines


def _split_constants(k: RowProgram) -> tuple[SeqBuilder, list[str], dict[str, int]]:
    """The row's sequence; its `pin` most-used constants (pinned vregs) and the rest (vmem table rows)."""
    b = SeqBuilder()
    k.build(b, b.input("x"), b.input("w"))
    uses = Counter(s for op in b.ops for s in op.srcs if s in b.consts)
    order = sorted(b.consts, key=lambda c: -uses[c])  # stable: ties keep first-use order
    table = {c: VMEM_CONST + SUBLANES * i for i, c in enumerate(order[k.pin:])}
    return b, order[: k.pin], table


def generate(k: RowProgram, window: int | None = None, reserve: int | None = None) -> tuple[str, int]:
    """The program text and the loop body's length in bundles."""
    b, pins, table = _split_constants(k)
    pinned = {c: i for i, c in enumerate(pins)}
    for j, name in enumerate(k.pinned_inputs):
        pinned[name] = len(pins) + j
    free = [r for r in range(N_VREGS) if r not in pinned.values()]
    nblocks = k.rows // ROWS_PER_BLOCK
    assert nblocks % 2 == 0 and nblocks >= 4
    bodies = []
    for loads in (True, False):
        nodes = build_body(k, (0, 1), loads, window or k.window, table)
        length, regs = schedule(nodes, free, reserve or k.reserve)
        regs.update(pinned)  # constants and pinned inputs keep their names (and vregs) in every row
        bodies.append((nodes, length, regs))
    return _program_text(k, b, pinned, table, nblocks // 2, bodies), bodies[0][1]


def tune(k: RowProgram) -> list[tuple[int, int, int, int]]:
    """(body bundles, pin, window, reserve) of every setting that schedules, best first (slow: minutes)."""
    results = []
    for pin in range(0, len(_split_constants(k)[0].consts) + 1, 2):
        for window in range(2, 10):
            for reserve in (2, 3, 4, 6, 8):
                kk = RowProgram(k.name, k.build, k.pinned_inputs, k.hbm, k.rows, window, reserve, pin)
                try:
                    results.append((generate(kk)[1], pin, window, reserve))
                except ValueError:
                    pass
    return sorted(results)


def _program_text(k: RowProgram, b: SeqBuilder, pinned: dict[str, int], table: dict[str, int], iters: int,
                  bodies: list[tuple[list[Node], int, dict[str, int]]]) -> str:
    hbm = k.hbm
    shape = (ROWS_PER_BLOCK << 16) | (SUBLANES * LANES)
    npin = len(pinned) - len(k.pinned_inputs)
    out = [
        f"# {k.name}.s: GENERATED by `python -m device_sim.programs.row_programs` from device_sim/sequences.py; "
        "do not edit.",
        f"# {k.name} of X[{k.rows}, {SUBLANES * LANES}] fp32 on `small`: one row per vreg (8 vmem rows), "
        f"{len(b.ops)} vector ops per row",
        "# (the sequence in sequences.py; bit-exact against its numpy model). The generator is row_programs.py.",
        "#   prologue  issue the loads of blocks 0 and 1 (8 rows each, f0 / f1); build the constants (li, lih,",
        "#             vbcast, staggered one per bundle): the most used stay pinned in vregs, the others go to",
        f"#             a table at vmem row {VMEM_CONST} (8 rows each), reloaded by a vld just in time for each use",
        f"#   loop      {iters - 1} x the body: blocks 2i (buffer 0) and 2i+1 (buffer 1), 16 rows list-scheduled",
        f"#             (a row starts once row -{k.window} has stored: software pipelining, up to {k.window} rows in",
        "#             flight); after a block's last vld: dma.ld the block 2 ahead into its input buffer (f0/f1);",
        "#             results go to an output buffer (its first vst waits on that buffer's previous store,",
        "#             f2/f3); after the block's last vst: dma.st it (f2/f3)",
        "#   tail      the body once more, without loads; halt drains the stores",
        "# Comments: rN:stage = row N of the body (0..15) has ops of that stage in the bundle; k = constant reload.",
        f"# vregs: pinned constants v0..v{npin - 1}" + (f", pinned inputs v{npin}" if k.pinned_inputs else "")
        + ", the rest allocated per value by the scheduler.",
        "# sregs: s1 DMA shape 8x64, s2 HBM row stride 64, s3/s4 input buffers, s8/s9 output buffers,",
        "#        s5/s6 HBM load/store pointers, s7 loop count",
        "",
        f"    li s1, {shape & 0xFFFF} ; li s2, {SUBLANES * LANES}",
        f"    lih s1, {shape >> 16} ; li s5, {hbm['X']}",
        f"    li s3, {VMEM_BUF[0]} ; li s4, {VMEM_BUF[1]}",
        f"    li s8, {VMEM_OUT[0]} ; li s9, {VMEM_OUT[1]}",
        f"    dma.ld s5, s3, s1, s2, f0 ; addi s5, s5, {_block_bytes()} ; li s6, {hbm['Y']}      # block 0",
        f"    dma.ld s5, s4, s1, s2, f1 ; addi s5, s5, {_block_bytes()} ; li s7, {iters - 1}      # block 1",
    ]
    for name, vrow in k.pinned_inputs.items():
        out.append(f"    li s10, {hbm[name.upper()]} ; li s11, {vrow}")
        out.append("    li s12, 64 ; li s13, 64")
        out.append("    lih s12, 1                                 # shape 1 x 64: one row, 8 vmem rows")
        out.append(f"    dma.ld s10, s11, s12, s13, f4             # {name}")
    # constants: bundle i: li (constant i), lih (i-1), vbcast (i-2) into its pinned vreg or a temporary,
    # vst of the temporary to the table (i-4, when the vbcast has landed)
    consts = [(c, b.consts[c]) for c in pinned if c in b.consts] + [(c, b.consts[c]) for c in table]
    tmp, vtmp = ["s20", "s21", "s22"], [31, 30, 29]
    for i in range(len(consts) + 4):
        texts, notes = [], []
        if i < len(consts):
            name, bits = consts[i]
            texts.append(f"li {tmp[i % 3]}, {bits & 0xFFFF:#x}")
            where = f"v{pinned[name]}" if name in pinned else f"vmem {table[name]}"
            notes.append(f"{name} = {_describe(bits)} -> {where}")
        if 0 <= i - 1 < len(consts):
            texts.append(f"lih {tmp[(i - 1) % 3]}, {consts[i - 1][1] >> 16:#x}")
        if 0 <= i - 2 < len(consts):
            name = consts[i - 2][0]
            dest = pinned[name] if name in pinned else vtmp[(i - 2) % 3]
            texts.append(f"vbcast v{dest}, {tmp[(i - 2) % 3]}")
        if 0 <= i - 4 < len(consts) and consts[i - 4][0] in table:
            texts.append(f"vst v{vtmp[(i - 4) % 3]}, s0, {table[consts[i - 4][0]]}")
        line = "    " + (" ; ".join(texts) if texts else "nop")
        out.append(f"{line:<60} # {'; '.join(notes)}" if notes else line)
    for name, vrow in k.pinned_inputs.items():
        out.append(f"    wait f4 ; vld v{pinned[name]}, s0, {vrow}                # {name}, laid out like a row")
        out.append("    nop")
    (nodes, length, regs), (tnodes, tlength, tregs) = bodies
    out += emit_body(nodes, length, regs, "loop", "bnz s7, loop", "addi s7, s7, -1")
    out += emit_body(tnodes, tlength, tregs, "tail", None, None)
    out.append("    halt")
    return "\n".join(out) + "\n"


def _describe(bits: int) -> str:
    f = float(np.array([bits], dtype=np.uint32).view(np.float32)[0])
    if bits < 0x10000 or bits in (0x7FFFFFFF, sequences.RCP_MAGIC, sequences.RSQRT_MAGIC):
        return f"int {bits:#x}"
    return f"{f:.9g}"


def softmax_kernel(b: SeqBuilder, x: str, w: str) -> str:
    return sequences.softmax_row(b, x)


RMSNORM_EPS = 1e-6


def rmsnorm_kernel(b: SeqBuilder, x: str, w: str) -> str:
    return sequences.rmsnorm_row(b, x, w, 1.0 / (SUBLANES * LANES), RMSNORM_EPS)


ROW_PROGRAMS = {
    # window / reserve / pin: the best of `tune()` (python -m device_sim.programs.row_programs --tune)
    "softmax": RowProgram("softmax", softmax_kernel, {}, {"X": 0x0, "Y": 0x8000}, 64, window=5, reserve=2, pin=6),
    "rmsnorm": RowProgram("rmsnorm", rmsnorm_kernel, {"w": VMEM_W}, {"X": 0x0, "W": 0x4000, "Y": 0x8000}, 64,
                         window=5, reserve=2, pin=2),
}


def main() -> None:
    import sys

    for name, k in ROW_PROGRAMS.items():
        if "--tune" in sys.argv:
            print(name, "(bundles, pin, window, reserve):", tune(k)[:5])
        else:
            (HERE / f"{name}.s").write_text(generate(k)[0])


if __name__ == "__main__":
    main()
