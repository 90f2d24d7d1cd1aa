"""Row-wise kernels over the last dim: RMSNorm, LayerNorm, softmax.

One CTA per row. Each thread owns 16-byte vectors at stride `threads * vec` along the row. When a row is at
most MAX_CACHED_CHUNKS vectors per thread (every LLM hidden size and a 32k vocabulary in bf16), the row is
loaded once into registers and every pass (statistics, then output) reuses them; longer rows are streamed
again for each pass (the re-reads hit L2). Reductions are shfl butterflies plus one shared-memory exchange.
"""

from __future__ import annotations

from collections.abc import Callable

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
    block_allreduce,
    ceil_div,
    ctaid,
    elem_addr,
    fimm,
    fresh_label,
    global_ptr,
    kernel_name,
    lane_and_group,
    load_vec,
    numel,
    row_base,
    setp,
    smem_base,
    store_vec,
    tid_x,
    trace,
    vector_width,
)

MAX_CACHED_CHUNKS = 8
MAX_THREADS = 512


class RowLoop:
    """Iteration of one thread over its vectors of a row of `n` elements."""

    def __init__(self, n: int, dtype: torch.dtype) -> None:
        self.n = n
        self.vec = vector_width(n, dtype)
        vectors = ceil_div(n, self.vec)
        self.threads = max(32, min(MAX_THREADS, 1 << max(0, (ceil_div(vectors, 2) - 1).bit_length())))
        self.step = self.threads * self.vec
        self.chunks = ceil_div(n, self.step)
        self.cached = self.chunks <= MAX_CACHED_CHUNKS

    def each(self, tid: Reg, fn: Callable[[Reg, Reg | None, int], None]) -> None:
        """Call fn(element_index, guard, chunk) for each of this thread's vectors.

        Cached rows unroll statically (chunk is the static index, guard is None when the chunk is always
        in range); streamed rows emit one runtime loop (chunk is -1, the loop bound is the guard).
        """
        first = reg.scalar(u32)
        ptx.inst.mul.lo.u32(first, tid, self.vec)
        if self.cached:
            for c in range(self.chunks):
                idx = first
                if c:
                    idx = reg.scalar(u32)
                    ptx.inst.add.u32(idx, first, c * self.step)
                guard = None if (c + 1) * self.step <= self.n else setp("lt", idx, self.n)
                fn(idx, guard, c)
            return
        top, done = fresh_label("row_loop"), fresh_label("row_done")
        ptx.label(top)
        ptx.bra(done, pred=setp("ge", first, self.n))
        fn(first, None, -1)
        ptx.inst.add.u32(first, first, self.step)
        ptx.bra(top)
        ptx.label(done)


def _row_setup(shape: Shape) -> tuple[int, int]:
    if len(shape) == 0 or shape[-1] == 0:
        raise ValueError(f"row-wise kernel needs a non-empty last dim, got shape {shape}")
    n = shape[-1]
    return numel(shape) // n, n


def _build_rowwise(
    op: str,
    shape: Shape,
    dtype: torch.dtype,
    extra: list[TensorArg],
    stats: Callable[[RowLoop, Callable[[Reg, Reg | None, int], list[Reg]], Reg, dict], None],
    finish: Callable[[list[Reg], Reg, dict], list[Reg]],
    tag: str,
) -> PtxKernel:
    """Shared skeleton: load/cache x, compute row statistics (`stats`), write `finish(x_vec, idx, state)`."""
    rows, n = _row_setup(shape)
    loop = RowLoop(n, dtype)
    num_warps = loop.threads // 32
    esize = DTYPE_BYTES[dtype]
    # the extra operands' dtypes are part of the name: an fp32 weight and a bf16 one give different kernels
    name = kernel_name(f"ctpu_{op}", DTYPE_NAMES[dtype], rows, n, tag, *(DTYPE_NAMES[a.dtype] for a in extra))

    def body() -> None:
        tid = tid_x()
        row = ctaid("x")
        x_row = row_base("x", row, n * esize)
        out_row = row_base("out", row, n * esize)
        lane, warp = lane_and_group(tid)
        state: dict = {
            "tid": tid,
            "lane": lane,
            "warp": warp,
            "smem": smem_base(),
            "num_warps": num_warps,
            "ptrs": {a.name: global_ptr(a.name) for a in extra},
        }
        cache: dict[int, list[Reg]] = {}

        def x_at(idx: Reg, guard: Reg | None, chunk: int) -> list[Reg]:
            if chunk in cache:
                return cache[chunk]
            vals = load_vec(elem_addr(x_row, idx, esize), dtype, loop.vec, guard)
            if chunk >= 0:
                cache[chunk] = vals
            return vals

        stats(loop, x_at, tid, state)

        def write(idx: Reg, guard: Reg | None, chunk: int) -> None:
            outs = finish(x_at(idx, guard, chunk), idx, state)
            store_vec(elem_addr(out_row, idx, esize), outs, dtype, guard)

        loop.each(tid, write)
        ptx.ret()

    params = [KernelParam("x", "ptr", "x"), *[KernelParam(a.name, "ptr", a.name) for a in extra]]
    params.append(KernelParam("out", "ptr", "out"))
    return trace(
        name,
        body,
        params,
        grid=(rows, 1, 1),
        block=(loop.threads, 1, 1),
        smem_bytes=3 * num_warps * 4,
        inputs=[TensorArg("x", shape, dtype), *extra],
        outputs=[TensorArg("out", shape, dtype)],
        notes={"threads": loop.threads, "vec": loop.vec, "cached_row": loop.cached},
    )


def _reduce(state: dict, value: Reg, op: str, slot: int) -> None:
    block_allreduce(
        value,
        op,
        num_warps=state["num_warps"],
        lane=state["lane"],
        warp=state["warp"],
        smem=state["smem"],
        slot=slot * state["num_warps"] * 4,
    )


def _vec_param(state: dict, name: str, idx: Reg, dtype: torch.dtype, count: int) -> list[Reg]:
    return load_vec(elem_addr(state["ptrs"][name], idx, DTYPE_BYTES[dtype]), dtype, count)


def _masked(v: Reg, guard: Reg | None, fill: float) -> Reg:
    if guard is None:
        return v
    out = m.new()
    ptx.inst.selp.f32(out, v, fimm(fill), guard)
    return out


def rms_norm(shape: Shape, dtype: torch.dtype, weight_dtype: torch.dtype | None, eps: float) -> PtxKernel:
    """out = x * rsqrt(mean(x^2) + eps) * weight, all in fp32, one rounding to x's dtype at the end."""
    n = shape[-1]
    extra = [TensorArg("weight", (n,), weight_dtype)] if weight_dtype is not None else []

    def stats(loop: RowLoop, x_at, tid: Reg, state: dict) -> None:
        ss = m.new()
        ptx.inst.mov.f32(ss, fimm(0.0))
        loop.each(tid, lambda i, g, c: [ptx.inst.fma.rn.f32(ss, v, v, ss) for v in x_at(i, g, c)])
        _reduce(state, ss, "add", 0)
        state["rstd"] = m.rsqrt(m.fma(ss, fimm(1.0 / n), fimm(eps)))

    def finish(xs: list[Reg], idx: Reg, state: dict) -> list[Reg]:
        outs = [m.binary("mul", x, state["rstd"]) for x in xs]
        if weight_dtype is not None:
            ws = _vec_param(state, "weight", idx, weight_dtype, len(xs))
            outs = [m.binary("mul", o, w) for o, w in zip(outs, ws, strict=True)]
        return outs

    return _build_rowwise("rms_norm", shape, dtype, extra, stats, finish, f"w{int(weight_dtype is not None)}")


def layer_norm(
    shape: Shape,
    dtype: torch.dtype,
    weight_dtype: torch.dtype | None,
    bias_dtype: torch.dtype | None,
    eps: float,
) -> PtxKernel:
    """Two-pass (mean, then centred variance) layer norm; the row is in registers so pass two is free."""
    n = shape[-1]
    extra = []
    if weight_dtype is not None:
        extra.append(TensorArg("weight", (n,), weight_dtype))
    if bias_dtype is not None:
        extra.append(TensorArg("bias", (n,), bias_dtype))

    def stats(loop: RowLoop, x_at, tid: Reg, state: dict) -> None:
        total = m.new()
        ptx.inst.mov.f32(total, fimm(0.0))
        loop.each(tid, lambda i, g, c: [ptx.inst.add.rn.f32(total, total, v) for v in x_at(i, g, c)])
        _reduce(state, total, "add", 0)
        mean = m.binary("mul", total, fimm(1.0 / n))
        var = m.new()
        ptx.inst.mov.f32(var, fimm(0.0))

        def centred(i: Reg, g: Reg | None, c: int) -> None:
            for v in x_at(i, g, c):
                d = _masked(m.binary("sub", v, mean), g, 0.0)
                ptx.inst.fma.rn.f32(var, d, d, var)

        loop.each(tid, centred)
        _reduce(state, var, "add", 1)
        state["mean"] = mean
        state["rstd"] = m.rsqrt(m.fma(var, fimm(1.0 / n), fimm(eps)))

    def finish(xs: list[Reg], idx: Reg, state: dict) -> list[Reg]:
        outs = [m.binary("mul", m.binary("sub", x, state["mean"]), state["rstd"]) for x in xs]
        if weight_dtype is not None:
            ws = _vec_param(state, "weight", idx, weight_dtype, len(xs))
            outs = [m.binary("mul", o, w) for o, w in zip(outs, ws, strict=True)]
        if bias_dtype is not None:
            bs = _vec_param(state, "bias", idx, bias_dtype, len(xs))
            outs = [m.binary("add", o, b) for o, b in zip(outs, bs, strict=True)]
        return outs

    tag = f"w{int(weight_dtype is not None)}b{int(bias_dtype is not None)}"
    return _build_rowwise("layer_norm", shape, dtype, extra, stats, finish, tag)


def softmax(shape: Shape, dtype: torch.dtype, dim: int) -> PtxKernel:
    """exp(x - max) / sum(exp(x - max)) over the last dim; padding lanes read as -inf so they add 0."""
    if dim not in (-1, len(shape) - 1):
        raise NotImplementedError(f"ptx softmax supports the last dim only, got dim={dim} for shape {shape}")

    def stats(loop: RowLoop, x_at, tid: Reg, state: dict) -> None:
        mx = m.new()
        ptx.inst.mov.f32(mx, fimm(float("-inf")))
        loop.each(
            tid,
            lambda i, g, c: [ptx.inst.max.f32(mx, mx, _masked(v, g, float("-inf"))) for v in x_at(i, g, c)],
        )
        _reduce(state, mx, "max", 0)
        total = m.new()
        ptx.inst.mov.f32(total, fimm(0.0))

        def add_exp(i: Reg, g: Reg | None, c: int) -> None:
            for v in x_at(i, g, c):
                ptx.inst.add.rn.f32(total, total, _masked(m.exp(m.binary("sub", v, mx)), g, 0.0))

        loop.each(tid, add_exp)
        _reduce(state, total, "add", 1)
        state["max"] = mx
        state["inv_sum"] = m.div(fimm(1.0), total)

    def finish(xs: list[Reg], idx: Reg, state: dict) -> list[Reg]:
        return [m.binary("mul", m.exp(m.binary("sub", x, state["max"])), state["inv_sum"]) for x in xs]

    return _build_rowwise("softmax", shape, dtype, [], stats, finish, "last")


__all__ = ["RowLoop", "layer_norm", "rms_norm", "softmax"]
