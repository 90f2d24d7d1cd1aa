"""Elementwise kernels (SwiGLU, RoPE) and the broadcast indexing they share with the fusion generator.

One thread per 16-byte vector (SwiGLU) or per element (RoPE, whose partner element half a row away breaks
vector alignment), 256 threads per CTA, a guard on the tail CTA. Broadcast inputs are addressed by
decomposing the flat output index with constant div/rem (ptxas turns those into multiply-high sequences).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from pyptx import ptx, reg
from pyptx.reg import Reg
from pyptx.types import u32

from ptx_kernels import mathops as m
from ptx_kernels.core import (
    DTYPE_BYTES,
    DTYPE_NAMES,
    KernelParam,
    PtxKernel,
    Shape,
    TensorArg,
    ceil_div,
    ctaid,
    elem_addr,
    global_ptr,
    kernel_name,
    load_f32,
    load_vec,
    numel,
    setp,
    store_f32,
    store_vec,
    tid_x,
    trace,
    vector_width,
)

THREADS = 256


def broadcast_shape(*shapes: Shape) -> Shape:
    """torch's broadcasting of `shapes` (right-aligned)."""
    rank = max((len(s) for s in shapes), default=0)
    out = []
    for axis in range(rank):
        dims = {s[axis - rank + len(s)] for s in shapes if axis - rank + len(s) >= 0} - {1}
        if len(dims) > 1:
            raise ValueError(f"shapes {shapes} do not broadcast")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def broadcast_index(flat: Reg, out_shape: Shape, in_shape: Shape) -> Reg:
    """Element index into a contiguous `in_shape` tensor broadcast to `out_shape`, for flat output index.

    Dims where the input has extent 1 contribute nothing; equal shapes cost nothing.
    """
    if tuple(in_shape) == tuple(out_shape):
        return flat
    index = reg.scalar(u32)
    ptx.inst.mov.u32(index, 0)
    if numel(in_shape) == 1:
        return index
    padded = (1,) * (len(out_shape) - len(in_shape)) + tuple(in_shape)
    rest = flat
    in_stride = 1
    for axis in reversed(range(len(out_shape))):
        extent = out_shape[axis]
        if padded[axis] != 1 and extent != 1:
            coord = reg.scalar(u32)
            if axis == 0:
                ptx.inst.mov.u32(coord, rest)
            else:
                ptx.inst.rem.u32(coord, rest, extent)
            ptx.inst.mad.lo.u32(index, coord, in_stride, index)
        if axis > 0 and extent != 1:
            quotient = reg.scalar(u32)
            ptx.inst.div.u32(quotient, rest, extent)
            rest = quotient
        in_stride *= padded[axis]
    return index


def flat_index(vec: int, total: int) -> tuple[Reg, Reg | None]:
    """(ctaid.x * THREADS * vec + tid * vec, its guard): the first of the `vec` elements (of `total`) this
    thread handles, and `first < total`, or None when the grid of `trace_flat` has no idle threads."""
    tid, cta = tid_x(), ctaid("x")
    base = reg.scalar(u32)
    ptx.inst.mul.lo.u32(base, tid, vec)
    ptx.inst.mad.lo.u32(base, cta, THREADS * vec, base)
    return base, setp("lt", base, total) if ceil_div(total, vec) % THREADS else None


def trace_flat(
    name: str,
    body: Callable[[], None],
    params: Sequence[KernelParam],
    items: int,
    *,
    inputs: Sequence[TensorArg],
    outputs: Sequence[TensorArg],
    notes: dict[str, object] | None = None,
) -> PtxKernel:
    """`trace` with the launch of `flat_index`: one thread per item (element or vector) of `items`,
    THREADS threads per CTA, no shared memory."""
    return trace(
        name,
        body,
        params,
        grid=(ceil_div(items, THREADS), 1, 1),
        block=(THREADS, 1, 1),
        smem_bytes=0,
        inputs=inputs,
        outputs=outputs,
        notes=notes,
    )


def swiglu(shape: Shape, gate_dtype: torch.dtype, up_dtype: torch.dtype, act: str) -> PtxKernel:
    """out = act(gate) * up in fp32, stored in gate's dtype; 16-byte vectors when the size allows."""
    total = numel(shape)
    vec = min(vector_width(total, gate_dtype), vector_width(total, up_dtype))
    vectors = ceil_div(total, vec)
    name = kernel_name("ctpu_swiglu", act, DTYPE_NAMES[gate_dtype], DTYPE_NAMES[up_dtype], total)

    def body() -> None:
        gate_p, up_p, out_p = global_ptr("gate"), global_ptr("up"), global_ptr("out")
        first, guard = flat_index(vec, total)
        gates = load_vec(elem_addr(gate_p, first, DTYPE_BYTES[gate_dtype]), gate_dtype, vec, guard)
        ups = load_vec(elem_addr(up_p, first, DTYPE_BYTES[up_dtype]), up_dtype, vec, guard)
        outs = [m.binary("mul", m.activation(act, g), u) for g, u in zip(gates, ups, strict=True)]
        store_vec(elem_addr(out_p, first, DTYPE_BYTES[gate_dtype]), outs, gate_dtype, guard)
        ptx.ret()

    return trace_flat(
        name,
        body,
        [KernelParam(n, "ptr", n) for n in ("gate", "up", "out")],
        vectors,
        inputs=[TensorArg("gate", shape, gate_dtype), TensorArg("up", shape, up_dtype)],
        outputs=[TensorArg("out", shape, gate_dtype)],
        notes={"vec": vec},
    )


def rope(
    x_shape: Shape, x_dtype: torch.dtype, cos_shape: Shape, sin_shape: Shape, cs_dtype: torch.dtype
) -> PtxKernel:
    """out = x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2])."""
    d = x_shape[-1]
    if d % 2:
        raise ValueError(f"rope needs an even last dim, got {x_shape}")
    broadcast_shape(x_shape, cos_shape, sin_shape)  # raises on a mismatch
    total = numel(x_shape)
    half = d // 2
    name = kernel_name("ctpu_rope", DTYPE_NAMES[x_dtype], DTYPE_NAMES[cs_dtype], *x_shape, "cs", *cos_shape)

    def body() -> None:
        x_p, cos_p, sin_p, out_p = (global_ptr(n) for n in ("x", "cos", "sin", "out"))
        idx, guard = flat_index(1, total)
        col = reg.scalar(u32)
        ptx.inst.rem.u32(col, idx, d)
        first_half = setp("lt", col, half)
        # The partner is half a row away; in the first half rotate_half contributes -x[partner].
        partner = reg.scalar(u32)
        ptx.inst.add.u32(partner, idx, half)
        ptx.inst.sub.u32(partner, idx, half, pred=~first_half)
        esize = DTYPE_BYTES[x_dtype]
        x = load_f32(elem_addr(x_p, idx, esize), x_dtype, guard)
        other = load_f32(elem_addr(x_p, partner, esize), x_dtype, guard)
        ptx.inst.neg.f32(other, other, pred=first_half)
        csize = DTYPE_BYTES[cs_dtype]
        c = load_f32(elem_addr(cos_p, broadcast_index(idx, x_shape, cos_shape), csize), cs_dtype, guard)
        s = load_f32(elem_addr(sin_p, broadcast_index(idx, x_shape, sin_shape), csize), cs_dtype, guard)
        out = m.fma(other, s, m.binary("mul", x, c))
        store_f32(elem_addr(out_p, idx, esize), out, x_dtype, guard)
        ptx.ret()

    params = [KernelParam(n, "ptr", n) for n in ("x", "cos", "sin", "out")]
    return trace_flat(
        name,
        body,
        params,
        total,
        inputs=[
            TensorArg("x", x_shape, x_dtype),
            TensorArg("cos", cos_shape, cs_dtype),
            TensorArg("sin", sin_shape, cs_dtype),
        ],
        outputs=[TensorArg("out", x_shape, x_dtype)],
    )
