"""Edge values through the whole stack, eager on `device="ctpu"` (each op a compiled single-op kernel) and
under `torch.compile(backend="ctpu")`: ±0, subnormals, ±inf, NaN, the largest finite values and huge
arguments, for every lowered elementwise unary op, division, fp32 matmul, var and the norms. Regression
tests for issue 16 (items 1-5) are marked by name.

The judge is float64, with CPU torch (float32) as the reference for IEEE classes: a result must be NaN
where CPU torch gives NaN and the same infinity where it gives one, and a finite result within the op's
ulp bound of the float64 value (docs/architecture.md, "Numerics contract"). Where CPU torch itself leaves
float64 (gelu(inf) is NaN on the CPU, sigmoid(-89) is 0), matching either one is accepted.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torch_tpu_backend.device as ctpu_device
import torch_tpu_backend.stats as ctpu_stats
from codegen import math_seqs, trig_seqs
from device_sim import sequences
from device_sim.sequences import ulp_distance, ulp_error
from fx_passes import CtpuFallbackWarning

ctpu_device.register()  # a no-op when the torch.backends entry point already loaded it

MAX = torch.finfo(torch.float32).max
EDGES = [0.0, -0.0, 1e-45, -1e-45, 1e-40, -1e-40, 1.1754942e-38, -1.1754944e-38, math.inf, -math.inf, math.nan,
         MAX, -MAX, 1.7e38, -3e38, 1e30, -1e20, 1e10, -1e10, 4096.5, -88.8, -87.5, 88.72, 89.0, -104.0, 20.0,
         -9.5, 2.0, 1.0, -1.0, 0.5, -0.25, 1e-7, -3e-20, math.pi / 2, 100.0]
# and 28 random fp32 bit patterns of both signs (every binade equally likely)
RANDOM = np.random.default_rng(16).integers(0, 0xFF800000, 28, dtype=np.int64).astype(np.uint32)
RANDOM = RANDOM[(RANDOM & 0x7F800000) != 0x7F800000].view(np.float32).tolist()
# op -> (function, ulp bound against float64; None: a composite judged by rtol / atol against CPU torch)
UNARY: dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], float | None]] = {
    "exp": (torch.exp, 1.0), "log": (torch.log, 1.0), "sin": (torch.sin, 1.0), "cos": (torch.cos, 1.0),
    "tanh": (torch.tanh, 3.5), "erf": (torch.erf, 3.5), "rsqrt": (torch.rsqrt, 1.3), "sqrt": (torch.sqrt, 2.0),
    "reciprocal": (torch.reciprocal, 1.3), "one_over": (lambda x: 1 / x, 1.3), "div_const": (lambda x: x / 3.0, 1.0),
    "div_self": (lambda x: x / (x * 0.75), 3.0), "neg": (torch.neg, 0.0), "abs": (torch.abs, 0.0),
    "relu": (torch.relu, 0.0), "sigmoid": (torch.sigmoid, 3.0), "silu": (F.silu, None), "gelu": (F.gelu, None),
    "gelu_tanh": (lambda x: F.gelu(x, approximate="tanh"), None), "square": (lambda x: x**2, 0.5),
    "pow_minus_half": (lambda x: x**-0.5, 1.3), "clamp": (lambda x: x.clamp(-1.5, 2.0), 0.0),
}


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[None]:
    monkeypatch.setenv("CTPU_CACHE_DIR", str(tmp_path / "cache"))
    precision = torch.get_float32_matmul_precision()
    torch._dynamo.reset()
    ctpu_stats.reset()
    yield
    torch.set_float32_matmul_precision(precision)


def _edges() -> torch.Tensor:
    return torch.tensor(EDGES + RANDOM, dtype=torch.float32).reshape(1, -1)


def _eager(fn: Callable[..., torch.Tensor], *xs: torch.Tensor) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("error", CtpuFallbackWarning)  # nothing here may run on the CPU
        return fn(*(x.to("ctpu") for x in xs)).cpu()


def _compiled(fn: Callable[..., object], *xs: torch.Tensor) -> object:
    with warnings.catch_warnings():
        warnings.simplefilter("error", CtpuFallbackWarning)
        out = torch.compile(fn, backend="ctpu")(*xs)
    assert not ctpu_stats.last().fallback_ops
    return out


def _classes(x: np.ndarray) -> np.ndarray:
    """0 finite, 1 +inf, -1 -inf, 2 NaN."""
    return np.where(np.isnan(x), 2, np.where(np.isinf(x), np.sign(x), 0))


def check(name: str, got: torch.Tensor, cpu: torch.Tensor, f64: torch.Tensor, bound: float | None) -> None:
    got, cpu = got.float().numpy().ravel(), cpu.float().numpy().ravel()
    f64 = f64.numpy().ravel()
    with np.errstate(over="ignore"):
        f64_32 = f64.astype(np.float32)
    cls = _classes(got)
    ok_class = (cls == _classes(cpu)) | (cls == _classes(f64_32))
    assert ok_class.all(), f"{name}: IEEE class differs at {np.flatnonzero(~ok_class)}: {got[~ok_class]} vs CPU " \
                           f"{cpu[~ok_class]}"
    fin = (cls == 0) & np.isfinite(cpu)
    zero = fin & (cpu == 0) & (f64_32 == 0)
    # the CPU's own sign of zero depends on its code path (gelu of -1e10: -0.0 alone, +0.0 in an AVX2 vector);
    # float64's is the IEEE one (x * Phi(x) of a negative x is -0.0): either is right
    sign_ok = (np.signbit(got) == np.signbit(cpu)) | (np.signbit(got) == np.signbit(f64_32))
    assert sign_ok[zero].all(), f"{name}: sign of zero"
    if bound is None:
        np.testing.assert_allclose(got[fin], cpu[fin], rtol=1e-5, atol=1e-6, err_msg=name)
        return
    err = np.minimum(ulp_error(got, f64), ulp_distance(got, cpu))[fin]
    assert err.max(initial=0) <= bound, f"{name}: {err.max():.3f} ulp"


@pytest.mark.parametrize("name", [n for n in UNARY if n != "abs"])  # eager abs runs on the CPU (abs.out)
def test_unary_edges_eager(name: str) -> None:
    fn, bound = UNARY[name]
    x = _edges()
    check(name, _eager(fn, x), fn(x), fn(x.double()), bound)


def test_unary_edges_compiled() -> None:
    """All unary ops in one compiled graph (one kernel, one compile)."""
    x = _edges()
    outs = _compiled(lambda x: tuple(fn(x) for fn, _ in UNARY.values()), x)
    for (name, (fn, bound)), got in zip(UNARY.items(), outs, strict=True):  # type: ignore[arg-type]
        check(name, got, fn(x), fn(x.double()), bound)


def test_kernels_compute_the_sequences_bit_for_bit() -> None:
    """The eager kernels of the sequence ops give exactly the bits of the sequences' numpy models (the same
    op lists, emitted through instruction selection, scheduling and register allocation)."""
    x = _edges()
    models = {torch.exp: sequences.exp, torch.log: math_seqs.log, torch.sin: trig_seqs.sin, torch.cos: trig_seqs.cos,
              torch.reciprocal: sequences.reciprocal, torch.rsqrt: sequences.rsqrt, torch.sqrt: math_seqs.sqrt,
              torch.tanh: math_seqs.tanh, torch.erf: math_seqs.erf}
    for op, model in models.items():
        got = _eager(op, x).numpy().view(np.uint32)
        assert np.array_equal(got, model(x.numpy()).view(np.uint32)), op.__name__


def test_division_edges_eager_and_compiled() -> None:
    """x / y on every pair of edge values: IEEE specials (0/0, inf/inf NaN; x/0 inf; x/inf 0) and finite
    quotients within 3 ulp, where 1/y over- or underflows included (3e38 / 3e38 was 0)."""
    v = torch.tensor(EDGES, dtype=torch.float32)
    a, d = (t.reshape(1, -1).contiguous() for t in torch.meshgrid(v, v, indexing="ij"))
    a, d = a.reshape(8, -1), d.reshape(8, -1)
    for got in (_eager(torch.div, a, d), _compiled(torch.div, a, d)):
        check("div", got, a / d, a.double() / d.double(), 3.0)  # type: ignore[arg-type]


# ---- issue 16 -------------------------------------------------------------------------------------------
def test_issue16_1_reciprocal_of_subnormals() -> None:
    x = torch.tensor([[1e-45, 1e-40, -1e-45, -1e-40, 3e38, -MAX]])
    want = torch.tensor([[math.inf, math.inf, -math.inf, -math.inf, 1 / 3e38, -1 / MAX]])
    for fn in (torch.reciprocal, lambda t: 1 / t):
        assert torch.equal(_eager(fn, x), want)
        assert torch.equal(_compiled(fn, x), want)  # type: ignore[arg-type]


def test_issue16_2_log_of_nan_and_subnormals() -> None:
    x = torch.tensor([[math.nan, 1e-45, 1e-40, 1.1754942e-38]])
    for got in (_eager(torch.log, x), _compiled(torch.log, x)):
        assert torch.isnan(got[0, 0])  # was 89.13
        torch.testing.assert_close(got[0, 1:], torch.log(x[0, 1:].double()).float(), rtol=1e-7, atol=0)


def test_issue16_3_sin_cos_exact_over_the_whole_range() -> None:
    big = torch.tensor([[1e10, MAX, -MAX, 3.4e38, 1e30, 2.0**100, math.inf, math.nan]])
    grid = torch.linspace(-4096, 4096, 4096).reshape(8, -1)
    for fn in (torch.sin, torch.cos):
        for got in (_eager(fn, big), _compiled(fn, big)):
            check(fn.__name__, got, fn(big), fn(big.double()), 1.0)  # type: ignore[arg-type]
        err = (_eager(fn, grid).double() - fn(grid.double())).abs().max().item()
        assert err < 1e-7, err  # was 2e-4 (CPU: 3.5e-8)


@pytest.mark.parametrize("precision", ["highest", "high"])
def test_issue16_4_fp32_matmul_keeps_infinities(precision: str) -> None:
    """The bf16 split computed inf - inf; and inf in hi met the other operand's zero residual (inf * 0)."""
    from torch_tpu_backend.device import eager

    eager._cache.clear()  # eager kernels are cached per op and layout, not per matmul precision
    torch.set_float32_matmul_precision(precision)
    a, b = torch.randn(8, 16), torch.randn(16, 8)
    a[0, 3], a[1, 5], a[2, 7], a[4, 2], a[5, 9] = math.inf, -math.inf, math.nan, math.inf, math.inf
    a[3, 0] = 1e38
    b[:, 0] = 1.0  # bf16-exact: zero residuals
    b[3, 1], b[2, 4], b[9, 6] = 0.0, math.inf, -math.inf  # inf * 0, inf * inf, inf * -inf
    cpu = a @ b
    for got in (_eager(torch.mm, a, b), _compiled(torch.mm, a, b)):
        assert torch.equal(torch.isnan(got), torch.isnan(cpu))  # type: ignore[arg-type]
        inf = torch.isinf(cpu)
        assert torch.equal(got[inf], cpu[inf])  # type: ignore[index]
        fin = torch.isfinite(cpu)
        torch.testing.assert_close(got[fin], cpu[fin], rtol=1e-4 if precision == "high" else 1e-5,  # type: ignore[index]
                                   atol=1e-4)
    eager._cache.clear()


ROWS = torch.tensor([[3e38] * 8, [3e38, -3e38] * 4, [1e20, 2e20, -1e20, 0, 0, 0, 0, 5e19], [1e-30] * 4 + [2e-30] * 4,
                     [math.inf] + [1.0] * 7, [1e-40] * 8, [MAX] * 8, [1e19, -2e19, 3e19, 5.0, 0, 0, 1, 2],
                     [1.0, 2, 3, 4, 5, 6, 7, 8]], dtype=torch.float32)


def test_issue16_5_variance_at_extreme_magnitudes() -> None:
    """The mean sum(x) / n overflowed (a row of 3e38 gave NaN; float64 gives 0)."""
    want = ROWS.double().var(-1).float()
    for got in (_eager(lambda x: x.var(-1), ROWS), _compiled(lambda x: x.var(-1), ROWS)):
        assert torch.equal(torch.isnan(got), torch.isnan(want)) and torch.equal(torch.isinf(got), torch.isinf(want))
        fin = torch.isfinite(want)
        torch.testing.assert_close(got[fin], want[fin], rtol=1e-5, atol=0)  # type: ignore[index]


def test_norms_at_extreme_magnitudes_compiled() -> None:
    """layer_norm and rms_norm (fused to ctpu:: ops) against float64: rows whose squares overflow fp32 are
    normalised from scaled values (CPU torch float32 gives NaN or 0 there)."""
    w, bias = torch.rand(8) + 0.5, torch.randn(8)

    def norms(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.layer_norm(x, (8,), w, bias), F.rms_norm(x, (8,), w, eps=1e-6)

    got = _compiled(norms, ROWS, w, bias)
    want = norms(ROWS.double(), w.double(), bias.double())
    for g, r in zip(got, want, strict=True):  # type: ignore[call-overload]
        r = r.float()
        assert torch.equal(torch.isnan(g), torch.isnan(r)), (g, r)
        fin = torch.isfinite(r)
        torch.testing.assert_close(g[fin], r[fin], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("n", [3, 5, 768])
def test_issue16_5_rows_of_one_value_have_no_spread(n: int) -> None:
    """Widths that are not powers of two: the row mean sum(x 2^-p) (2^p / n) was an ulp off (2^p / n
    rounds), so a row of one value had nonzero deviations: var(-1) of a row of 3e38 was inf, of 3e20
    1.5e27, a layer norm of +-1 or 4e-6 (eager, float64: 0). Its refinement makes them exactly 0."""
    x = torch.tensor([[0.1] * n, [1.7] * n, [3e20] * n, [-3e38] * n, [MAX] * n])
    var = lambda t: t.var(-1)
    layer_norm = lambda t: F.layer_norm(t, (n,))
    for got in (_eager(var, x), _compiled(var, x), _eager(layer_norm, x), _compiled(layer_norm, x)):
        assert torch.equal(got, torch.zeros_like(got)), got  # type: ignore[arg-type]


def test_softmax_rows_with_specials() -> None:
    """max-subtracted softmax: a row holding +inf or NaN, or all -inf, is NaN (as on the CPU); ±MAX and
    subnormal rows are exact."""
    x = torch.tensor([[math.inf, 1.0, 2, 3], [-math.inf] * 4, [math.nan, 0, 1, 2], [MAX, -MAX, 0, MAX],
                      [1e-45, -1e-45, 0, 1e-40], [-math.inf, 0, 1, -math.inf], [88.0, -88.0, 89.0, 0]])
    cpu = torch.softmax(x, -1)
    for got in (_eager(lambda t: torch.softmax(t, -1), x), _compiled(lambda t: torch.softmax(t, -1), x)):
        check("softmax", got, cpu, torch.softmax(x.double(), -1), 3.0)  # type: ignore[arg-type]
