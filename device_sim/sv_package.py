"""Generate the SystemVerilog package `device_sim/rtl/ctpu_isa_pkg.sv` from `isa.py`, `config.py` and the
exp and reciprocal units' steps (`sequences.exp_unit_seq`, `rcp_unit_seq`, `div_unit_seq`).

The RTL imports every opcode, field position, latency, slot index and configuration parameter from this
package, so an ISA change cannot silently diverge from the hardware: `tests/rtl/test_sv_package.py`
regenerates the file and fails on any difference.

    python -m device_sim.sv_package          # rewrite the package
    python -m device_sim.sv_package --check  # exit 1 if the committed package is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from device_sim import isa, sequences
from device_sim.config import CONFIGS, SUBLANES

PACKAGE_PATH = Path(__file__).parent / "rtl" / "ctpu_isa_pkg.sv"

# Trap codes the RTL reports (trap_code_o). The simulator raises CtpuTrap with a message; the RTL harness
# classifies those messages into the same codes (device_sim/rtl/traps.py) to compare the two.
TRAP_CODES: tuple[tuple[str, str], ...] = (
    ("NONE", "no trap"),
    ("ILLEGAL", "illegal encoding: unknown opcode, wrong slot, reserved bits, bad viota mode"),
    ("VMEM_OOB", "a vmem row out of bounds (vld, vst, DMA, MXU)"),
    ("HBM_OOB", "an HBM byte out of bounds (DMA)"),
    ("MISALIGNED", "a DMA HBM address not aligned to its element size"),
    ("ZERO_SHAPE", "a DMA with zero rows or cols, an mm with zero rows (or more than vmem holds)"),
    ("MM_OVERLAP", "mxu.mm output rows overlap its input rows"),
    ("PC_END", "pc ran past the end of the program (or a branch target outside it)"),
    ("CYCLE_LIMIT", "the cycle limit was exceeded"),
    ("WRITE_CONFLICT", "two results land in the same register in the same cycle"),
    ("LANE_RANGE", "vext names a lane outside the register"),
    ("STORE_OVERLAP", "a DMA store whose HBM rows overlap (rows > 1 and stride < cols)"),
)

_UNITS = tuple(isa.Unit)


def sv_name(mnemonic: str) -> str:
    """'vadd.f' -> 'OP_VADD_F', 'dma.ld.bf16' -> 'OP_DMA_LD_BF16'."""
    return "OP_" + re.sub(r"[^A-Za-z0-9]", "_", mnemonic).upper()


def _unit_name(u: isa.Unit) -> str:
    return "UNIT_" + u.name


# The units' steps (sequences.exp_unit_seq, ...) as SystemVerilog: fp32 ops call ctpu_fp_pkg, int32 and
# bitwise ops are plain arithmetic on the bit patterns, a compare gives a lane mask of 32 equal bits.
_SV_STEPS: dict[str, str] = {
    "vadd.f": "fp32_add({0}, {1})", "vsub.f": "fp32_sub({0}, {1})", "vmul.f": "fp32_mul({0}, {1})",
    "vmax.f": "fp32_max({0}, {1})", "vmin.f": "fp32_min({0}, {1})",
    "vcmp.lt.f": "{{32{{fp32_lt({0}, {1})}}}}", "vcmp.eq.f": "{{32{{fp32_eq({0}, {1})}}}}",
    "vadd.i": "{0} + {1}", "vsub.i": "{0} - {1}", "vshl": "{0} << {1}[4:0]",
    "vsra": "32'($signed({0}) >>> {1}[4:0])",
    "vand": "{0} & {1}", "vor": "{0} | {1}", "vxor": "{0} ^ {1}", "vsel": "({0} != 32'd0) ? {1} : {2}",
}

# name, instruction, steps, inputs, shared core: the functions the vector unit's long pipeline calls on
# every lane. A unit's sequence that starts with its core's steps calls the core's function for them.
_CORE = ("fp32_rcp_core", sequences.reciprocal_core, ("d",))
_LANE_UNITS = [
    ("fp32_exp", "vexp.f", sequences.exp_unit_seq, ("x",), None),
    ("fp32_rcp", "vrcp.f", sequences.rcp_unit_seq, ("d",), _CORE),
    ("fp32_div", "vdiv.f", sequences.div_unit_seq, ("a", "d"), _CORE),
]


def _sv_steps(b: sequences.SeqBuilder, ops: list[sequences.VOp], what: str) -> tuple[list[str], list[str]]:
    """(declarations, statements) of `ops` in SystemVerilog, the constants they read included."""
    decls = [f"    localparam logic [31:0] {c} = 32'h{bits:08x};" for c, bits in b.consts.items()
             if any(c in op.srcs for op in ops)]
    decls.append("    logic [31:0] " + ", ".join(op.dst for op in ops) + ";")
    stmts = []
    for op in ops:
        if op.mnemonic not in _SV_STEPS:
            raise ValueError(f"{what} has no SystemVerilog for step {op.mnemonic}")
        stmts.append(f"    {op.dst} = {_SV_STEPS[op.mnemonic].format(*op.srcs)};")
    return decls, stmts


def _built(build: Callable[..., Any], inputs: tuple[str, ...]) -> tuple[sequences.SeqBuilder, Any, str]:
    """(the builder, what `build` returned, the SystemVerilog argument list) of a sequence over `inputs`."""
    b = sequences.SeqBuilder()
    out = build(b, *(b.input(i) for i in inputs))
    return b, out, ", ".join(f"input logic [31:0] {i}" for i in inputs)


def _core_function(name: str, build: Callable[..., tuple[str, ...]], inputs: tuple[str, ...]) -> list[str]:
    """A shared core: its steps, its results packed first to last into one word per result."""
    b, outs, args = _built(build, inputs)
    decls, stmts = _sv_steps(b, b.ops, name)
    return [f"  // sequences.{build.__name__}'s {len(b.ops)} steps, shared by the units below.",
            f"  function automatic logic [{32 * len(outs) - 1}:0] {name}({args});",
            *decls, *stmts, f"    return {{{', '.join(outs)}}};", "  endfunction"]


def _unit_function(name: str, mnemonic: str, build: Callable[..., str], inputs: tuple[str, ...],
                   core: tuple[str, Callable[..., tuple[str, ...]], tuple[str, ...]] | None) -> list[str]:
    """One unit's function: its sequence step by step, so the RTL's unit and the simulator's instruction
    evaluate one list of single-rounding steps; the steps of its `core` (the same ops, first) by a call."""
    b, out, args = _built(build, inputs)
    lines = [f"  // {mnemonic}: sequences.{build.__name__}'s {len(b.ops)} steps, one fp32, int32 or bitwise op each.",
             f"  function automatic logic [31:0] {name}({args});"]
    ops, call = b.ops, []
    if core is not None:
        core_name, core_build, core_inputs = core
        c, outs, _ = _built(core_build, core_inputs)
        if b.ops[:len(c.ops)] != c.ops:
            raise ValueError(f"{mnemonic}'s steps do not start with {core_name}'s")
        ops = b.ops[len(c.ops):]
        lines += [f"    logic [{32 * len(outs) - 1}:0] core;", "    logic [31:0] " + ", ".join(outs) + ";"]
        call = [f"    core = {core_name}({', '.join(core_inputs)});"]
        call += [f"    {o} = core[{32 * (len(outs) - j) - 1}:{32 * (len(outs) - j - 1)}];" for j, o in enumerate(outs)]
    decls, stmts = _sv_steps(b, ops, mnemonic)
    return [*lines, *decls, *call, *stmts, f"    return {out};", "  endfunction"]


def generate() -> str:
    """The package text (deterministic: depends only on the tables)."""
    out: list[str] = []
    w = out.append
    w("// GENERATED by device_sim/sv_package.py from device_sim/isa.py and device_sim/config.py. DO NOT EDIT;")
    w("// regenerate with `python -m device_sim.sv_package` (tests/rtl/test_sv_package.py checks it is fresh).")
    w("`default_nettype none")
    w("")
    w("// Not every module uses every constant (e.g. the large configuration's): unused ones are expected.")
    w("/* verilator lint_off UNUSEDPARAM */")
    w("package ctpu_isa_pkg;")
    w("  import ctpu_fp_pkg::*;  // the exp and reciprocal units' steps")
    w("")
    w("  // ---- bundle and register files ----")
    w(f"  localparam int NUM_SLOTS = {isa.NUM_SLOTS};")
    w(f"  localparam int WORD_BITS = {isa.WORD_BITS};")
    w(f"  localparam int BUNDLE_BITS = {isa.NUM_SLOTS * isa.WORD_BITS};")
    w(f"  localparam int NUM_SREGS = {isa.NUM_SREGS};")
    w(f"  localparam int NUM_VREGS = {isa.NUM_VREGS};")
    w(f"  localparam int NUM_FLAGS = {isa.NUM_FLAGS};")
    w(f"  localparam int SUBLANES = {SUBLANES};")
    w(f"  localparam int DMA_SHAPE_ROWS_SHIFT = {isa.DMA_SHAPE_ROWS_SHIFT};")
    w(f"  localparam int DMA_SHAPE_COLS_MASK = 'h{isa.DMA_SHAPE_COLS_MASK:x};")
    w("")
    w("  // ---- slots (index = position of the slot word in a bundle) ----")
    for s in isa.SLOTS:
        w(f"  localparam int SLOT_{s.name.upper()} = {s.index};")
    w("")
    w("  // ---- units ----")
    w("  typedef enum logic [2:0] {")
    w(",\n".join(f"    {_unit_name(u)} = 3'd{i}" for i, u in enumerate(_UNITS)))
    w("  } unit_e;")
    w("")
    w("  function automatic unit_e slot_unit(input int slot);")
    w("    case (slot)")
    for s in isa.SLOTS:
        w(f"      {s.index}: return {_unit_name(s.unit)};")
    w(f"      default: return {_unit_name(isa.Unit.CTRL)};")
    w("    endcase")
    w("  endfunction")
    w("")
    w("  // ---- slot word fields: [hi:lo] ----")
    w(f"  localparam int OPCODE_HI = {isa.WORD_BITS - 1};")
    w(f"  localparam int OPCODE_LO = {isa.OPCODE_LO};")
    fields = {"D": isa.F_D, "A": isa.F_A, "B": isa.F_B, "C": isa.F_C, "FLAG": isa.F_FLAG,
              "IMM14": isa.F_IMM14, "IMM19": isa.F_IMM19, "IMM16": isa.F_IMM16}
    for name, f in fields.items():
        w(f"  localparam int F_{name}_HI = {f.hi};")
        w(f"  localparam int F_{name}_LO = {f.lo};")
    w("")
    w("  // ---- latencies (issue -> visible), isa.py ----")
    for name in ("LAT_SCALAR", "LAT_VALU", "LAT_XLANE", "LAT_VLOAD", "LAT_VSTORE"):
        w(f"  localparam int {name} = {getattr(isa, name)};")
    w("")
    w("  // ---- opcodes ----")
    width = max(len(sv_name(i.mnemonic)) for i in isa.INSTRUCTIONS)
    for ins in isa.INSTRUCTIONS:
        w(f"  localparam logic [7:0] {sv_name(ins.mnemonic):<{width}} = 8'h{ins.opcode:02x};  // {ins.semantics}")
    w("")
    w("  // ---- decode tables ----")
    w("  // Known opcode?")
    w("  function automatic logic op_known(input logic [7:0] op);")
    w("    case (op)")
    w("      " + ",\n      ".join(sv_name(i.mnemonic) for i in isa.INSTRUCTIONS) + ": return 1'b1;")
    w("      default: return 1'b0;")
    w("    endcase")
    w("  endfunction")
    w("")
    w("  // The unit an opcode belongs to (nop is legal in every slot).")
    w("  function automatic unit_e op_unit(input logic [7:0] op);")
    w("    case (op)")
    for u in _UNITS:
        ops = [sv_name(i.mnemonic) for i in isa.INSTRUCTIONS if i.unit is u and i is not isa.NOP]
        if ops:
            w("      " + ",\n      ".join(ops) + f": return {_unit_name(u)};")
    w(f"      default: return {_unit_name(isa.Unit.CTRL)};")
    w("    endcase")
    w("  endfunction")
    w("")
    w("  // Bits the opcode's format uses; any other bit set is an illegal encoding.")
    w("  function automatic logic [31:0] op_used_mask(input logic [7:0] op);")
    w("    case (op)")
    by_mask: dict[int, list[str]] = {}
    for ins in isa.INSTRUCTIONS:
        by_mask.setdefault(ins.used_mask, []).append(sv_name(ins.mnemonic))
    for mask, ops in by_mask.items():
        w("      " + ",\n      ".join(ops) + f": return 32'h{mask:08x};")
    w("      default: return 32'h0;")
    w("    endcase")
    w("  endfunction")
    w("")
    w("  // Immediate ranges narrower than the field (decode traps outside them).")
    w("  function automatic logic op_imm_ok(input logic [7:0] op, input logic signed [31:0] imm);")
    w("    case (op)")
    for ins in isa.INSTRUCTIONS:
        if ins.imm_range:
            lo, hi = ins.imm_range
            w(f"      {sv_name(ins.mnemonic)}: return imm >= {lo} && imm <= {hi};")
    w("      default: return 1'b1;")
    w("    endcase")
    w("  endfunction")
    w("")
    w("  // Latency of each opcode (0 for async units and control).")
    w("  function automatic int op_latency(input logic [7:0] op);")
    w("    case (op)")
    by_lat: dict[int, list[str]] = {}
    for ins in isa.INSTRUCTIONS:
        if ins.latency:
            by_lat.setdefault(ins.latency, []).append(sv_name(ins.mnemonic))
    for lat, ops in sorted(by_lat.items()):
        w("      " + ",\n      ".join(ops) + f": return {lat};")
    w("      default: return 0;")
    w("    endcase")
    w("  endfunction")
    w("")
    out.extend(_core_function(*_CORE))
    for unit in _LANE_UNITS:
        out.extend(_unit_function(*unit))
    w("")
    w("  // ---- trap codes (trap_code_o) ----")
    for i, (name, doc) in enumerate(TRAP_CODES):
        w(f"  localparam logic [3:0] TRAP_{name} = 4'd{i};  // {doc}")
    w("")
    w("  // ---- hardware configurations, config.py ----")
    cfg_fields = ("lanes", "vmem_rows", "hbm_bytes", "hbm_bytes_per_cycle", "dma_latency", "imem_bundles",
                  "dma_queue", "mxu_queue", "vmem_port_rows", "weight_port_rows")
    for cfg in CONFIGS.values():
        for f in cfg_fields:
            value = getattr(cfg, f)
            if f == "hbm_bytes":  # 3 GiB does not fit a signed int
                w(f"  localparam longint CFG_{cfg.name.upper()}_{f.upper()} = 64'd{value};")
            else:
                w(f"  localparam int CFG_{cfg.name.upper()}_{f.upper()} = {value};")
    w("")
    w("endpackage")
    w("/* verilator lint_on UNUSEDPARAM */")
    w("")
    w("`default_nettype wire")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the package file is stale")
    parser.add_argument("--out", type=Path, default=PACKAGE_PATH)
    args = parser.parse_args(argv)
    text = generate()
    if args.check:
        current = args.out.read_text() if args.out.exists() else ""
        if current != text:
            print(f"{args.out} is stale: run `python -m device_sim.sv_package`", file=sys.stderr)
            return 1
        print(f"{args.out} is up to date")
        return 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
