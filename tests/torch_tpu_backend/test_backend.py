"""The ctpu torch.compile backend: registration, options, fallback, statistics, dumps and the cache."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import torch_tpu_backend.stats as ctpu_stats
from fx_passes import CtpuFallbackWarning


@pytest.fixture(autouse=True)
def fresh(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CTPU_CACHE_DIR", str(tmp_path / "cache"))
    torch._dynamo.reset()
    ctpu_stats.reset()


def test_registered_by_entry_point_without_import() -> None:
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "ctpu" in list_backends(exclude_tags=())
    assert lookup_backend("ctpu").__name__ == "ctpu_backend"


def test_runs_on_the_ctpu_with_statistics() -> None:
    def f(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.exp(x + y) * 0.5

    x, y = torch.randn(8, 16), torch.randn(16)
    out = torch.compile(f, backend="ctpu")(x, y)
    torch.testing.assert_close(out, f(x, y), rtol=2e-6, atol=1e-7)
    s = ctpu_stats.last()
    assert s.kernels_launched == 1 and not s.fallback_ops
    assert s.bundles > 0 and s.cycles >= s.bundles and s.dma_bytes > 0
    assert s.launches[0].target == "sim"


def test_unsupported_op_falls_back_with_one_warning() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.cumprod(torch.exp(x), dim=1) * 2.0

    x = torch.randn(4, 8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = torch.compile(f, backend="ctpu")(x)
    torch.testing.assert_close(out, f(x), rtol=1e-5, atol=1e-6)
    fallback = [w for w in caught if issubclass(w.category, CtpuFallbackWarning)]
    assert len(fallback) == 1 and "cumprod" in str(fallback[0].message)
    s = ctpu_stats.last()
    assert any("cumprod" in op for op in s.fallback_ops) and s.kernels_launched >= 1


def test_options_are_validated() -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    with pytest.raises(Exception, match="unknown option"):
        torch.compile(f, backend="ctpu", options={"targte": "sim"})(torch.ones(2))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="target 'tpu'"):
        torch.compile(f, backend="ctpu", options={"target": "tpu"})(torch.ones(2))


def test_max_cycles_bounds_a_launch_and_says_how_to_raise_it() -> None:
    """A launch past the cycle limit (a runaway guard, 10^8 by default; a long prefill of many layers needs
    more) traps with a note naming the backend option; the option raises it, and a bad value is refused."""
    from device_sim.machine import CtpuTrap

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * 2.0, dim=-1)

    x = torch.randn(64, 256)
    with pytest.raises(CtpuTrap, match="cycle limit 100 exceeded") as caught:
        torch.compile(f, backend="ctpu", options={"max_cycles": 100, "cache": False})(x)
    assert any("max_cycles" in note for note in caught.value.__notes__)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="ctpu", options={"max_cycles": 10**6})(x), f(x))
    torch._dynamo.reset()
    with pytest.raises(Exception, match="max_cycles 0"):
        torch.compile(f, backend="ctpu", options={"max_cycles": 0})(x)


def test_dump_dir_has_every_stage(tmp_path: Path) -> None:
    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x * 2.0, dim=-1)

    dump = tmp_path / "dump"
    torch.compile(f, backend="ctpu", options={"dump_dir": str(dump)})(torch.randn(8, 16))
    assert ctpu_stats.last().kernels_launched == 1
    graph_dirs = list(dump.iterdir())
    assert len(graph_dirs) == 1
    names = " ".join(p.name for p in graph_dirs[0].iterdir())
    for stage in ("fx_aten", "fx_after_passes", "mlir", "machine_ir", "scheduled", "program.s", "program.bin",
                  "summary"):
        assert stage in names, (stage, names)


def test_compile_cache_reuses_binaries(tmp_path: Path) -> None:
    from torch_tpu_backend import cache

    def f(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x) * 3.0

    x = torch.randn(8, 8)
    torch.compile(f, backend="ctpu")(x)
    entries = list((tmp_path / "cache").glob("*.pkl"))
    assert len(entries) == 1
    torch._dynamo.reset()
    hits = []
    real_cached = cache.cached

    def spy(directory: Path | None, key: str, build: object, **kwargs: object) -> object:
        value, hit = real_cached(directory, key, build, **kwargs)  # type: ignore[arg-type]
        hits.append(hit)
        return value, hit

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cache, "cached", spy)
        out = torch.compile(f, backend="ctpu")(x)
    assert hits == [True]
    torch.testing.assert_close(out, f(x), rtol=1e-5, atol=1e-6)
