"""The `PtxKernel` record and the small helpers every kernel builder shares.

A kernel builder is a plain function of static shapes/dtypes. It writes a body with pyptx (one call, one PTX
instruction) and hands it to `trace()`, which returns a `PtxKernel`: the PTX text plus everything a launcher
needs (grid, block, dynamic shared memory, the ordered parameter list and where each value comes from).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from pyptx import kernel as pyptx_kernel
from pyptx import ptx, reg
from pyptx.ir.nodes import AddressOperand
from pyptx.reg import Reg
from pyptx.types import PtxType, b16, b32, f32, pred, s32, s64, u32, u64

Shape = tuple[int, ...]

# dtypes the kernels read and write; everything is computed in fp32 in registers.
# Integers (generated kernels only: indices, positions, masks) live in s64 registers.
DTYPE_BYTES: dict[torch.dtype, int] = {
    torch.float32: 4, torch.bfloat16: 2, torch.bool: 1, torch.int32: 4, torch.int64: 8,
}
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float32: "f32", torch.bfloat16: "bf16", torch.bool: "b8", torch.int32: "s32", torch.int64: "s64",
}
INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True)
class TmaSpec:
    """How the launcher encodes a TMA tensor map (cuTensorMapEncodeTiled) for one tensor argument.

    `dims` and `box` are innermost first, as the driver API wants them; `strides` are the byte strides of
    dims 1.. (dim 0 is contiguous). Out-of-bounds box elements are zero-filled by the hardware, which is how
    the GEMM handles M/N/K tails.
    """

    tensor: str
    dtype: torch.dtype
    dims: tuple[int, ...]
    strides: tuple[int, ...]
    box: tuple[int, ...]
    swizzle_bytes: int  # 0 (none), 32, 64 or 128


@dataclass(frozen=True)
class KernelParam:
    """One `.param` of the entry, in order.

    kind: "ptr" (u64 global address of tensor `source`), "tmap" (a 128-byte CUtensorMap passed by value,
    described by `tma`), "f32"/"u32" (a scalar whose value is `value`).
    """

    name: str
    kind: str
    source: str = ""
    value: float | int = 0
    tma: TmaSpec | None = None

    def ptx_decl(self) -> tuple[str, str]:
        """The (pyptx raw-param type, name) pair declaring this parameter."""
        decl = {"ptr": "u64", "tmap": "b8.align64.array128", "f32": "f32", "u32": "u32"}[self.kind]
        return decl, self.name


@dataclass(frozen=True)
class TensorArg:
    """A tensor the kernel reads or writes: its name, static shape and dtype (contiguous unless noted)."""

    name: str
    shape: Shape
    dtype: torch.dtype
    strides: Shape | None = None  # element strides when not contiguous (e.g. a transposed weight view)


@dataclass(frozen=True)
class PtxKernel:
    """A generated kernel: PTX text and its launch configuration."""

    name: str
    ptx: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    smem_bytes: int
    params: tuple[KernelParam, ...]
    inputs: tuple[TensorArg, ...]
    outputs: tuple[TensorArg, ...]
    notes: dict[str, object] = field(default_factory=dict)


def trace(
    name: str,
    body: Callable[[], None],
    params: Sequence[KernelParam],
    *,
    grid: tuple[int, int, int],
    block: tuple[int, int, int],
    smem_bytes: int,
    inputs: Sequence[TensorArg],
    outputs: Sequence[TensorArg],
    notes: dict[str, object] | None = None,
) -> PtxKernel:
    """Trace `body` with pyptx into one `.entry` named `name` and wrap it with its launch data.

    Shared memory is always the dynamic `extern .shared smem[]` array so that the launcher passes one size;
    `.maxntid` tells ptxas the block size so it can budget registers for exactly that many threads.
    """
    body.__name__ = name
    traced = pyptx_kernel(
        arch="sm_90a",
        version=(8, 5),
        raw_params=[p.ptx_decl() for p in params],
        extern_smem="smem",
        block=block,
        raw_directives=[("maxntid", block)],
    )(body)
    text = traced.ptx()
    return PtxKernel(
        name=name,
        ptx=text,
        grid=grid,
        block=block,
        smem_bytes=smem_bytes,
        params=tuple(params),
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        notes=dict(notes or {}),
    )


def kernel_name(prefix: str, *parts: object) -> str:
    """A PTX-legal entry name that encodes the specialisation (shapes, dtypes, options)."""
    text = "_".join(str(p) for p in (prefix, *parts))
    return "".join(c if c.isalnum() or c == "_" else "_" for c in text)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def numel(shape: Shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


# ---------------------------------------------------------------------------------------------------------
# Emission helpers. Each helper emits a fixed, documented handful of instructions.
# ---------------------------------------------------------------------------------------------------------


def fimm(value: float) -> str:
    """PTX literal for an fp32 immediate (PTX has no decimal float syntax that round-trips exactly)."""
    return "0f" + struct.pack(">f", float(value)).hex().upper()


def fconst(value: float) -> Reg:
    r = reg.scalar(f32)
    ptx.inst.mov.f32(r, fimm(value))
    return r


def tid_x() -> Reg:
    r = reg.scalar(u32)
    ptx.inst.mov.u32(r, ptx.special.tid.x())
    return r


def ctaid(axis: str) -> Reg:
    r = reg.scalar(u32)
    ptx.inst.mov.u32(r, getattr(ptx.special.ctaid, axis)())
    return r


def global_ptr(param: str) -> Reg:
    r = reg.scalar(u64)
    ptx.inst.ld.param.u64(r, ptx.addr(param))
    ptx.inst.cvta.to.global_.u64(r, r)
    return r


def lane_and_group(tid: Reg, width: int = 32) -> tuple[Reg, Reg]:
    """(tid % width, tid / width) for a power-of-two `width`: a thread's lane in its warp (or half-warp)
    and which warp (half-warp) it is in."""
    lane, group = reg.scalar(u32), reg.scalar(u32)
    ptx.inst.and_.b32(lane, tid, width - 1)
    ptx.inst.shr.u32(group, tid, width.bit_length() - 1)
    return lane, group


def smem_base() -> Reg:
    r = reg.scalar(u32)
    ptx.inst.mov.u32(r, "smem")
    return r


def elem_addr(base: Reg, index: Reg, elem_bytes: int) -> Reg:
    """base + index * elem_bytes (64-bit), two instructions."""
    off = reg.scalar(u64)
    ptx.inst.mul.wide.u32(off, index, elem_bytes)
    out = reg.scalar(u64)
    ptx.inst.add.u64(out, base, off)
    return out


def setp(cmp: str, a: Reg, b: Reg | int, kind: str = "u32") -> Reg:
    p = reg.scalar(pred)
    getattr(getattr(ptx.inst.setp, cmp), kind)(p, a, b)
    return p


def load_f32(addr: Reg, dtype: torch.dtype, guard: Reg | None = None, offset: int = 0) -> Reg:
    """Load one element of `dtype` at [addr+offset] into a fresh f32 register (0.0 where `guard` is false)."""
    out = fconst(0.0)
    where = ptx.addr(addr, offset) if offset else ptx.addr(addr)
    if dtype == torch.float32:
        ptx.inst.ld.global_.f32(out, where, pred=guard)
    elif dtype == torch.bfloat16:
        ptx.inst.cvt.f32.bf16(out, _load_or_zero(where, b16, "b16", guard))
    elif dtype == torch.bool:
        ptx.inst.cvt.rn.f32.u32(out, _load_or_zero(where, u32, "u8", guard))
    elif dtype in INT_DTYPES:
        ptx.inst.cvt.rn.f32.s64(out, load_s64(addr, dtype, guard, offset))
    else:
        raise NotImplementedError(f"ptx kernels: unsupported load dtype {dtype}")
    return out


def load_s64(addr: Reg, dtype: torch.dtype, guard: Reg | None = None, offset: int = 0) -> Reg:
    """Load one int32/int64 element into a fresh s64 register (0 where `guard` is false)."""
    where = ptx.addr(addr, offset) if offset else ptx.addr(addr)
    out = reg.scalar(s64)
    ptx.inst.mov.s64(out, 0)
    if dtype == torch.int64:
        ptx.inst.ld.global_.s64(out, where, pred=guard)
    elif dtype == torch.int32:
        ptx.inst.cvt.s64.s32(out, _load_or_zero(where, s32, "s32", guard))
    else:
        raise NotImplementedError(f"ptx kernels: integer load of {dtype}")
    return out


def _load_or_zero(where: AddressOperand, kind: PtxType, ld_type: str, guard: Reg | None) -> Reg:
    """A fresh `kind` register set to 0, then `ld.global.<ld_type>` from `where` into it where `guard` holds."""
    out = reg.scalar(kind)
    getattr(ptx.inst.mov, kind.name)(out, 0)
    getattr(ptx.inst.ld.global_, ld_type)(out, where, pred=guard)
    return out


def load_value(addr: Reg, dtype: torch.dtype, guard: Reg | None = None) -> Reg:
    """Load in the register form of `dtype`: s64 for integers, f32 otherwise (bool as 0.0/1.0)."""
    return load_s64(addr, dtype, guard) if dtype in INT_DTYPES else load_f32(addr, dtype, guard)


def store_value(addr: Reg, value: Reg, dtype: torch.dtype, guard: Reg | None = None) -> None:
    """Store an s64 or f32 register as `dtype` (integers truncate to int32 like a C cast)."""
    is_int = value.dtype == s64
    if dtype in INT_DTYPES:
        if not is_int:
            wide = reg.scalar(s64)
            ptx.inst.cvt.rzi.s64.f32(wide, value)
            value = wide
        if dtype == torch.int64:
            ptx.inst.st.global_.s64(ptx.addr(addr), value, pred=guard)
        else:
            narrow = reg.scalar(s32)
            ptx.inst.cvt.s32.s64(narrow, value)
            ptx.inst.st.global_.s32(ptx.addr(addr), narrow, pred=guard)
        return
    if is_int:
        wide = reg.scalar(f32)
        ptx.inst.cvt.rn.f32.s64(wide, value)
        value = wide
    store_f32(addr, value, dtype, guard)


def store_f32(addr: Reg, value: Reg, dtype: torch.dtype, guard: Reg | None = None, offset: int = 0) -> None:
    """Store f32 `value` as `dtype` (round-to-nearest-even for bf16) at [addr+offset] where `guard` holds."""
    where = ptx.addr(addr, offset) if offset else ptx.addr(addr)
    if dtype == torch.float32:
        ptx.inst.st.global_.f32(where, value, pred=guard)
    elif dtype == torch.bfloat16:
        raw = reg.scalar(b16)
        ptx.inst.cvt.rn.bf16.f32(raw, value)
        ptx.inst.st.global_.b16(where, raw, pred=guard)
    elif dtype == torch.bool:
        p = setp("neu", value, fimm(0.0), "f32")
        byte = reg.scalar(u32)
        ptx.inst.selp.u32(byte, 1, 0, p)
        ptx.inst.st.global_.u8(where, byte, pred=guard)
    else:
        raise NotImplementedError(f"ptx kernels: unsupported store dtype {dtype}")


def round_to_bf16(value: Reg) -> Reg:
    """fp32 -> bf16 -> fp32, the rounding an eager bf16 intermediate would see."""
    raw = reg.scalar(b16)
    ptx.inst.cvt.rn.bf16.f32(raw, value)
    out = reg.scalar(f32)
    ptx.inst.cvt.f32.bf16(out, raw)
    return out


def shfl_xor(value: Reg, lane_mask: int) -> Reg:
    """The partner lane's value in a butterfly (shfl.sync.bfly over the full warp)."""
    bits = reg.scalar(b32)
    ptx.inst.mov.b32(bits, value)
    got = reg.scalar(b32)
    ptx.inst.shfl.sync.bfly.b32(got, bits, lane_mask, 31, -1)
    out = reg.scalar(f32)
    ptx.inst.mov.b32(out, got)
    return out


def warp_allreduce(value: Reg, op: str, width: int = 32) -> None:
    """In-place butterfly reduction over `width` lanes (op: add/max); every lane ends with the result."""
    mask = width // 2
    while mask:
        other = shfl_xor(value, mask)
        getattr(ptx.inst, op).f32(value, value, other)
        mask //= 2


def block_allreduce(
    value: Reg, op: str, *, num_warps: int, lane: Reg, warp: Reg, smem: Reg, slot: int
) -> None:
    """In-place reduction over the whole CTA; every thread ends with the result.

    Warp butterflies first, then lane 0 of each warp parks its partial in shared memory at byte offset
    `slot` (num_warps floats) and every thread folds the partials. Callers give each reduction its own slot
    so that no second barrier is needed before the slot is reused.
    """
    warp_allreduce(value, op)
    if num_warps == 1:
        return
    addr = reg.scalar(u32)
    ptx.inst.mad.lo.u32(addr, warp, 4, smem)
    is_lane0 = setp("eq", lane, 0)
    ptx.inst.st.shared.f32(ptx.addr(addr, slot), value, pred=is_lane0)
    ptx.inst.bar.sync(0)
    ptx.inst.ld.shared.f32(value, ptx.addr(smem, slot))
    part = reg.scalar(f32)
    for w in range(1, num_warps):
        ptx.inst.ld.shared.f32(part, ptx.addr(smem, slot + 4 * w))
        getattr(ptx.inst, op).f32(value, value, part)


def vector_width(n: int, dtype: torch.dtype) -> int:
    """Elements per 16-byte access when every access along a row of n elements stays 16-byte aligned."""
    vec = 16 // DTYPE_BYTES[dtype]
    return vec if n % vec == 0 else 1


def load_vec(addr: Reg, dtype: torch.dtype, count: int, guard: Reg | None = None) -> list[Reg]:
    """Load `count` consecutive elements (count*size <= 16 bytes, aligned) as f32 registers, 0 if guarded off.

    bf16 is widened with shifts: a bf16 is the upper half of the f32 with the same value.
    """
    if count == 1:
        return [load_f32(addr, dtype, guard)]
    per_access = 16 // DTYPE_BYTES[dtype]
    if count > per_access:  # e.g. fp32 weights next to a bf16 row: split into 16-byte accesses
        vals = []
        for start in range(0, count, per_access):
            part = addr if start == 0 else _offset(addr, start * DTYPE_BYTES[dtype])
            vals += load_vec(part, dtype, per_access, guard)
        return vals
    if dtype == torch.float32:
        vals = [fconst(0.0) for _ in range(count)]
        getattr(ptx.inst.ld.global_, f"v{count}").f32(vals, ptx.addr(addr), pred=guard)
        return vals
    if dtype != torch.bfloat16:
        raise NotImplementedError(f"ptx kernels: vector load of {dtype}")
    words = [reg.scalar(b32) for _ in range(count // 2)]
    for w in words:
        ptx.inst.mov.b32(w, 0)
    if len(words) == 1:
        ptx.inst.ld.global_.b32(words[0], ptx.addr(addr), pred=guard)
    else:
        getattr(ptx.inst.ld.global_, f"v{len(words)}").b32(words, ptx.addr(addr), pred=guard)
    vals = []
    for w in words:
        lo = reg.scalar(b32)
        ptx.inst.shl.b32(lo, w, 16)
        hi = reg.scalar(b32)
        ptx.inst.and_.b32(hi, w, -65536)
        for half in (lo, hi):
            v = reg.scalar(f32)
            ptx.inst.mov.b32(v, half)
            vals.append(v)
    return vals


def store_vec(addr: Reg, vals: list[Reg], dtype: torch.dtype, guard: Reg | None = None) -> None:
    """Store f32 registers as consecutive `dtype` elements (one vector store; bf16 packed in pairs)."""
    if len(vals) == 1:
        store_f32(addr, vals[0], dtype, guard)
        return
    per_access = 16 // DTYPE_BYTES[dtype]
    if len(vals) > per_access:
        for start in range(0, len(vals), per_access):
            part = addr if start == 0 else _offset(addr, start * DTYPE_BYTES[dtype])
            store_vec(part, vals[start : start + per_access], dtype, guard)
        return
    if dtype == torch.float32:
        getattr(ptx.inst.st.global_, f"v{len(vals)}").f32(ptx.addr(addr), list(vals), pred=guard)
        return
    if dtype != torch.bfloat16:
        raise NotImplementedError(f"ptx kernels: vector store of {dtype}")
    words = []
    for i in range(0, len(vals), 2):
        w = reg.scalar(b32)
        # cvt.rn.bf16x2.f32 d, a, b puts a in the upper half: element i+1 is the upper one.
        ptx.inst.cvt.rn.bf16x2.f32(w, vals[i + 1], vals[i])
        words.append(w)
    if len(words) == 1:
        ptx.inst.st.global_.b32(ptx.addr(addr), words[0], pred=guard)
    else:
        getattr(ptx.inst.st.global_, f"v{len(words)}").b32(ptx.addr(addr), words, pred=guard)


def fresh_label(stem: str) -> str:
    from pyptx._trace import get_ctx

    return get_ctx().fresh_label(stem)


def row_base(param: str, row: Reg, row_bytes: int) -> Reg:
    """Global address of row `row` of a contiguous [rows, row_bytes] tensor passed as `param`."""
    base = global_ptr(param)
    off = reg.scalar(u64)
    ptx.inst.mul.wide.u32(off, row, row_bytes)
    ptx.inst.add.u64(base, base, off)
    return base


def _offset(addr: Reg, nbytes: int) -> Reg:
    out = reg.scalar(u64)
    ptx.inst.add.u64(out, addr, nbytes)
    return out


def chunk_width(count: int, dtype: torch.dtype) -> int:
    """Elements per access for `count` consecutive elements starting at a multiple of `count`: the largest
    power of two dividing `count` that fits 16 bytes (so every access stays naturally aligned)."""
    width = count & -count
    return min(width, 16 // DTYPE_BYTES[dtype])


def load_chunks(addr: Reg, dtype: torch.dtype, count: int, guard: Reg | None = None) -> list[Reg]:
    """`count` consecutive elements (any count) as f32 registers, in aligned vector accesses."""
    width = chunk_width(count, dtype)
    vals: list[Reg] = []
    for start in range(0, count, width):
        part = addr if start == 0 else _offset(addr, start * DTYPE_BYTES[dtype])
        vals += load_vec(part, dtype, width, guard)
    return vals


def store_chunks(addr: Reg, vals: list[Reg], dtype: torch.dtype, guard: Reg | None = None) -> None:
    width = chunk_width(len(vals), dtype)
    for start in range(0, len(vals), width):
        part = addr if start == 0 else _offset(addr, start * DTYPE_BYTES[dtype])
        store_vec(part, vals[start : start + width], dtype, guard)
